"""A window after a wait: what spinning, other Python or a sleep before it costs the window.

    python bench/cold_window.py [--rounds 2000] [--out DIR]

In an update of several replicas each process waits between its windows: the master at
the board for the workers' gradients, a worker for the master's next Step. This bench
shows what such a wait costs the window after it, with nothing of ours: one process, one
``bench/overhead.py`` MLP (batch 16), each window its forward and backward
(``cleargrads``; ``model(x, t).backward()``) on a batch loaded before the wait. Before each
window comes one of these gaps:

- ``none``: the window straight after the last one's loading;
- ``spin X``: X ms of a Python loop that polls a word in memory and yields the CPU
  (``os.sched_yield``) between looks, as a rank waiting at the board does;
- ``python X``: X ms of other Python (pickling and unpickling a small dict, copying a
  small array), as the master's own protocol between its windows;
- ``sleep X``: ``time.sleep`` for X ms, as a rank that waits longer does.

The gaps take turns, one window each, in an order shuffled anew each round (a rotation
would keep each gap's window after the same other gap's, and a window after a sleep is
itself still slower); each round gives every gap's window time over ``none``'s, and the
table the median with its 95% bootstrap interval. The process is on one core (``--core``,
default the last), as a bound replica. Writes ``cold_window.md`` and ``.json`` into
``--out``.
"""
import argparse
import os
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

for _name in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
    os.environ.setdefault(_name, '1')

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common, overhead  # noqa: E402

import chainer  # noqa: E402
import numpy  # noqa: E402

SCHEMA = 'mgpu_updater.bench.cold_window/1'
BATCH = 16
GAPS = (('none', 0.0), ('spin', 0.05), ('spin', 0.3), ('python', 0.3), ('spin', 2.0),
        ('sleep', 0.3), ('sleep', 2.0))
# what 'python' pickles: about a window result's size and shape
_RESULT = {'count': 16, 'loss_sum': 1.25, 'sums': {'main/loss': 0.1, 'main/accuracy': 0.5},
           'weights': {'main/loss': 16.0, 'main/accuracy': 16.0},
           'times': {'data': 1e-4, 'compute': 5e-4}, 'epochs': [(0, 0.1, 0.09, False)]}


def label(kind, ms):
    return kind if kind == 'none' else f'{kind} {ms:g} ms'


def spin(seconds, word):
    """Poll ``word`` (never set here) for ``seconds``, yielding the CPU between looks."""
    clock, end = time.perf_counter, time.perf_counter() + seconds
    while not word[0] and clock() < end:
        os.sched_yield()


def python_work(seconds, small):
    """Other Python for ``seconds``: pickle a window-result-like dict and back, copy a
    small array."""
    clock, end = time.perf_counter, time.perf_counter() + seconds
    while clock() < end:
        pickle.loads(pickle.dumps(_RESULT, protocol=pickle.HIGHEST_PROTOCOL))
        small[1][...] = small[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rounds', type=int, default=2000)
    p.add_argument('--warmup', type=int, default=100, help='untimed rounds first')
    p.add_argument('--core', type=int, default=None,
                   help='the core to run on (default: the last this process may use)')
    p.add_argument('--out')
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error(f'--rounds must be >= 2, got {args.rounds}')
    cores = _common.cpu_count()   # the machine's, before this process takes one
    core = max(os.sched_getaffinity(0)) if args.core is None else args.core
    os.sched_setaffinity(0, {core})
    model = overhead.make_model()
    it = overhead._iterator(overhead.make_dataset(4096), BATCH, 1)
    word = memoryview(bytearray(8)).cast('q')
    small = (numpy.ones(4096, numpy.float32), numpy.zeros(4096, numpy.float32))
    names = [label(kind, ms) for kind, ms in GAPS]
    times = {name: [] for name in names}
    order, shuffle = list(GAPS), random.Random(0).shuffle
    for i in range(args.warmup + args.rounds):
        shuffle(order)
        for kind, ms in order:
            x, t = chainer.dataset.concat_examples(it.next())
            if kind == 'spin':
                spin(ms / 1e3, word)
            elif kind == 'python':
                python_work(ms / 1e3, small)
            elif kind == 'sleep':
                time.sleep(ms / 1e3)
            start = time.perf_counter()
            model.cleargrads()
            model(x, t).backward()
            seconds = time.perf_counter() - start
            if i >= args.warmup:
                times[label(kind, ms)].append(seconds)
    result = {'schema': SCHEMA, 'rounds': args.rounds, 'batch': BATCH,
              'cpu': _common.cpu_model(), 'cores': cores, 'core': core,
              'versions': {k: v for k, v in _common.versions().items()
                           if k in ('python', 'numpy', 'chainer')},
              'ms': {name: 1e3 * statistics.median(v) for name, v in times.items()},
              'ratios': {}}
    for name in names[1:]:
        summary = _common.ratio_summary([a / b for a, b in zip(times[name], times['none'])])
        del summary['ratios']
        result['ratios'][name] = summary
    lines = [f'`python bench/cold_window.py{" --out " + args.out if args.out else ""}`', '',
             f'One process on core {core}: the forward and backward of bench/overhead.py\'s MLP '
             f'(batch {BATCH}) after each gap, the gaps taking turns in a shuffled order, '
             f'{args.rounds} rounds; '
             f'{result["cpu"]} ({result["cores"]} cores), Python '
             f'{result["versions"]["python"]}, numpy {result["versions"]["numpy"]}, Chainer '
             f'{result["versions"]["chainer"]}.', '',
             '| before the window | window ms (median) | its time / after none, per round: '
             'median (95% interval) |', '|---|---:|---|']
    for name in names:
        cell = '1' if name == 'none' else _common.ratio_cell(result['ratios'][name])
        lines.append(f'| {name} | {result["ms"][name]:.3f} | {cell} |')
    _common.save_results(args.out, 'cold_window', result, '\n'.join(lines) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())

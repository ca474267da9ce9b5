"""A gated loader's window: the place a taken batch frees, handed back at once or on release.

    python bench/gated_loader.py [--rounds 3000] [--idle 0.4] [--bind CORE] [--out DIR]

A worker's loader under ``prefetch='auto'`` is gated (``mgpu_updater._loader.Prefetcher``):
it loads while the worker waits for the master (the gate released) and not while the
worker computes (the gate held). After a wait its queue is full and its thread waits, a
batch loaded ahead in hand, for a place. This bench plays that worker in one process: a
window holds the gate, takes a batch (``get``) and runs forward and backward of
``bench/overhead.py``'s launch-bound MLP (batch 16); between windows the gate is released
for ``--idle`` milliseconds (the wait for the next Step). Three loaders take turns window
by window, the order shuffled anew each round (a rotation, as here before 2026-12-05, kept
each loader behind the same other one nearly every round):

- ``deferred``: the package's, which hands the place back when the gate is let go;
- ``immediate``: the same, handing it back at once in ``get`` (as the package did before):
  that wakes the thread in the middle of the window, to take the GIL and park at the gate;
- ``inline``: the synchronous loader (``prefetch=0``), which loads in the window.

Each window's time (get, forward and backward); per loader the median, and per round the
ratio to ``deferred`` with the median's 95% bootstrap interval. By default the threads run
where the scheduler puts them, as a worker's do on a GPU (``bind_cores='auto'`` binds CPU
replicas only); ``--bind`` puts the whole process on one core, as a bound CPU replica.
Writes ``gated_loader.md`` and ``.json`` into ``--out`` (``gated_loader_bound.*`` with
``--bind``).
"""
import argparse
import os
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

from mgpu_updater._loader import Loader, Prefetcher  # noqa: E402

SCHEMA = 'mgpu_updater.bench.gated_loader/2'   # /2: the order shuffled each round
LOADERS = ('deferred', 'immediate', 'inline')
BATCH = 16


class Immediate(Prefetcher):
    """The gated loader handing a taken batch's place back at once."""

    def get(self):
        batch = super().get()
        self._pay()
        return batch


def make(kind, seed):
    it = overhead._iterator(overhead.make_dataset(4096), BATCH, seed)
    device = chainer.get_device('@numpy')
    convert = chainer.dataset.concat_examples
    if kind == 'inline':
        loader = Loader(it, convert, device)
    else:
        cls = Prefetcher if kind == 'deferred' else Immediate
        loader = cls(it, convert, device, 2, gated=True)
    return loader, overhead.make_model()


def window(loader, model):
    """One window: hold the gate, take a batch, forward and backward; its seconds."""
    loader.hold()
    start = time.perf_counter()
    x, t = loader.get().arrays
    model.cleargrads()
    model(x, t).backward()
    seconds = time.perf_counter() - start
    loader.release()
    return seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rounds', type=int, default=3000)
    p.add_argument('--idle', type=float, default=0.4, help='ms released between windows')
    p.add_argument('--bind', type=int, default=None, help='run the process on this core')
    p.add_argument('--out')
    args = p.parse_args(argv)
    if args.bind is not None:
        os.sched_setaffinity(0, {args.bind})   # before the threads start: they inherit it
    loaders = {kind: make(kind, 1) for kind in LOADERS}
    idle = args.idle / 1e3
    times = {kind: [] for kind in LOADERS}
    try:
        order, shuffle = list(LOADERS), random.Random(0).shuffle
        for i in range(200 + args.rounds):
            shuffle(order)   # anew each round: no loader always follows the same one
            for kind in order:
                time.sleep(idle)
                seconds = window(*loaders[kind])
                if i >= 200:
                    times[kind].append(seconds)
    finally:
        for loader, _ in loaders.values():
            loader.close()
    result = {'schema': SCHEMA, 'rounds': args.rounds, 'idle_ms': args.idle,
              'bind': args.bind, 'cpu': _common.cpu_model(), 'cores': _common.cpu_count(),
              'versions': {k: v for k, v in _common.versions().items()
                           if k in ('python', 'numpy', 'chainer')},
              'ms': {k: 1e3 * statistics.median(v) for k, v in times.items()},
              'ratios': {}}
    for kind in ('immediate', 'inline'):
        ratios = [a / b for a, b in zip(times[kind], times['deferred'])]
        summary = _common.ratio_summary(ratios)
        del summary['ratios']
        result['ratios'][f'{kind}/deferred'] = summary
    where = f'the process on core {args.bind}' if args.bind is not None else 'threads unbound'
    lines = [f'`python bench/gated_loader.py{" --bind %d" % args.bind if args.bind is not None else ""}'
             f'{" --out " + args.out if args.out else ""}`', '',
             f'A worker\'s gated loader, one process: windows of bench/overhead.py\'s MLP '
             f'(batch 16), {args.idle} ms released between them, {args.rounds} rounds, '
             f'{where}; {result["cpu"]} ({result["cores"]} cores), Python '
             f'{result["versions"]["python"]}, numpy {result["versions"]["numpy"]}, Chainer '
             f'{result["versions"]["chainer"]}.', '',
             '| loader | window ms (median) | its time / deferred\'s, per round: median '
             '(95% interval) |', '|---|---:|---|']
    for kind in LOADERS:
        cell = ('1' if kind == 'deferred'
                else _common.ratio_cell(result['ratios'][f'{kind}/deferred']))
        lines.append(f'| {kind} | {result["ms"][kind]:.3f} | {cell} |')
    stem = 'gated_loader' if args.bind is None else 'gated_loader_bound'
    _common.save_results(args.out, stem, result, '\n'.join(lines) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())

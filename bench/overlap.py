"""Does loading overlap compute, with the defaults? A step against max(L, C).

    python bench/overlap.py [--load-ms 20] [--compute-ms 20] [--rounds 12] [--out DIR]

Each case: a dataset whose batch takes L to load and a model whose update takes C, run by
``ParallelAccumulatingUpdater`` with its defaults (``prefetch='auto'``: each replica times
loading inline and ahead over its first updates and keeps the faster) on one and on two
``'@numpy'`` replicas, and, for scale, with ``prefetch=0``. The ideal step is max(L, C);
loading inline costs L + C. The goal: a step <= 1.1 x max(L, C) where loading can overlap.

- ``sleep``: loading that waits (each example sleeps, as a file or a network read does),
  and a compute that waits too (a sleep in the forward, as a GPU computes while its host
  waits, plus a small matrix product). Overlap needs no spare core.
- ``python``: loading that is Python work (a pure-Python loop per example, holding the
  GIL), and a compute that is BLAS (matrix products, which release the GIL). One replica
  has a core for each; two replicas, each with its loader, need four busy threads, which a
  2-core machine does not have.
- ``multiprocess``: the ``sleep`` dataset read through a ``MultiprocessIterator`` (2
  processes per replica): the defaults against ``prefetch=0``, which must not be faster.
- ``python-multiprocess``: the ``python`` dataset and compute, the dataset read through a
  ``MultiprocessIterator`` of one process per replica: Python-work loading moved out of
  the replica's process, as the docs advise (the defaults do not fork a loader process).
  One replica has a core for its process and one for its loader; two replicas need four
  busy processes.
- ``host-bound``: the ``python`` dataset and a compute that is Python too (a loop holding
  the GIL, as a model whose host launches a fast GPU's kernels): nothing can overlap, a
  step costs L + C at best, so this row has no goal against max(L, C); what it shows is
  what a loader thread costs there (``defaults / prefetch=0``, which must not be above
  1: ``prefetch='auto'`` should load inline). Since ``overlap/3``: the loader thread keeps
  the interpreter's switch interval at most 0.2 ms while it loads
  (``mgpu_updater/_gil_handoff.py``), which helps the ``python`` row and costs a hand-over
  of the GIL every 0.2 ms where both threads run Python, as here.

L and C are measured alone in every round (L: the iterator and the converter for one
batch; C: ``StandardUpdater`` on a batch already in memory), between the updaters' turns.
For ``python`` on one replica, each round also times that compute beside a plain thread
that loads the same batches without a pause, under a switch interval of
:data:`BEST_INTERVAL` (the shortest that still helped here): what any loader thread can
reach there (the ``a thread's best`` column), against which the defaults' step is read.
No thread reaches 1.0: every one of the compute's waits ends with a wait for the GIL, a
wake-up of the main thread by the operating system.
Each case reports the median over the rounds of step / max(L, C), with a 95% interval, and
each replica's choice (``loading_modes``).

Prints a Markdown table; with ``--out`` writes ``overlap.json`` and ``overlap.md``.
"""
import argparse
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

for _name in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
    os.environ.setdefault(_name, '1')

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common  # noqa: E402

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import numpy as np  # noqa: E402

# /3: the host-bound case; /4: a thread's best (``best_over_max``, python on one replica);
# /5: python-multiprocess
SCHEMA = 'mgpu_updater.bench.overlap/5'
GOAL = 1.1
#: the switch interval of the thread that measures "a thread's best" (seconds)
BEST_INTERVAL = 1e-5
FEATURES, CLASSES = 64, 10


class Dataset(chainer.dataset.DatasetMixin):
    """``kind`` 'sleep': each example sleeps ``seconds``; 'python': each runs a Python
    loop of about ``seconds`` (calibrated, :func:`calibrate`)."""

    def __init__(self, n, kind, seconds, loops=0):
        rng = np.random.RandomState(0)
        self.x = rng.random_sample((n, FEATURES)).astype(np.float32)
        self.t = rng.randint(0, CLASSES, n).astype(np.int32)
        self.kind, self.seconds, self.loops = kind, seconds, loops

    def __len__(self):
        return len(self.x)

    def get_example(self, i):
        if self.kind == 'python':
            total = 0
            for j in range(self.loops):
                total += j * j
        else:
            time.sleep(self.seconds)
        return self.x[i], self.t[i]


class Model(chainer.Chain):
    """'sleep': a small MLP whose forward waits ``seconds`` (device time); 'python': the
    same MLP after ``products`` BLAS products of ``size`` square matrices (GIL released);
    'host-bound': after a Python loop of ``loops`` steps (GIL held)."""

    def __init__(self, kind, seconds, size=0, products=0, loops=0):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(FEATURES, 64)
            self.l2 = L.Linear(64, CLASSES)
        self.kind, self.seconds, self.products, self.loops = kind, seconds, products, loops
        self.a = np.random.RandomState(1).random_sample((size, size)).astype(np.float32)

    def forward(self, x):
        if self.kind == 'python':
            for _ in range(self.products):
                self.a.dot(self.a)
        elif self.kind == 'host-bound':
            total = 0
            for j in range(self.loops):
                total += j * j
        else:
            time.sleep(self.seconds)
        return self.l2(F.relu(self.l1(x)))


def calibrate(load_s, compute_s, batch):
    """Python-loop length per example, the BLAS products per forward and the Python-loop
    length per forward that take about ``load_s`` per batch and ``compute_s`` per update
    here."""
    n = 200000
    per_loop = math.inf
    for _ in range(3):   # the fastest of three: the first can run at half speed
        start = time.perf_counter()
        total = 0
        for j in range(n):
            total += j * j
        per_loop = min(per_loop, (time.perf_counter() - start) / n)
    loops = max(1, int(load_s / batch / per_loop))
    size = 384
    a = np.random.RandomState(1).random_sample((size, size)).astype(np.float32)
    a.dot(a)
    per_product = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(5):
            a.dot(a)
        per_product = min(per_product, (time.perf_counter() - start) / 5)
    return (loops, size, max(1, int(compute_s / per_product)),
            max(1, int(compute_s / per_loop)))


def _kinds(kind):
    """The dataset's kind and the model's for the case ``kind``."""
    if kind == 'host-bound':
        return 'python', 'host-bound'
    return ('python', 'python') if kind.startswith('python') else ('sleep', 'sleep')


def _model(kind, args, cal):
    loops, size, products, compute_loops = cal
    return L.Classifier(Model(_kinds(kind)[1], args.compute_ms / 1e3, size, products,
                              compute_loops))


def _optimizer(kind, args, cal):
    """SGD set up on a new model for ``kind`` (the model is its ``target``)."""
    optimizer = chainer.optimizers.SGD(0.01)
    optimizer.setup(_model(kind, args, cal))
    return optimizer


def build(kind, n, args, cal, prefetch):
    """An updater over ``n`` replicas for ``kind``; its model and its iterators."""
    from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators
    b = args.batch
    dataset = Dataset(4096, _kinds(kind)[0], args.load_ms / 1e3 / b, cal[0])
    optimizer = _optimizer(kind, args, cal)
    extra = {}
    if kind == 'multiprocess':
        extra = dict(iterator_class=chainer.iterators.MultiprocessIterator, n_processes=2)
    elif kind == 'python-multiprocess':
        extra = dict(iterator_class=chainer.iterators.MultiprocessIterator, n_processes=1)
    its = shard_iterators(dataset, n, b, **extra)
    updater = ParallelAccumulatingUpdater(its if n > 1 else its[0], optimizer,
                                          devices=['@numpy'] * n, prefetch=prefetch,
                                          report_times=False)
    return updater, optimizer.target


def alone(kind, args, cal):
    """(L, C) as this machine runs them now: one batch loaded; one StandardUpdater step."""
    b = args.batch
    dataset = Dataset(b, _kinds(kind)[0], args.load_ms / 1e3 / b, cal[0])
    start = time.perf_counter()
    batch = chainer.dataset.concat_examples([dataset[i] for i in range(b)])
    load = time.perf_counter() - start
    optimizer = _optimizer(kind, args, cal)
    model = optimizer.target
    start = time.perf_counter()
    optimizer.update(model, *batch)
    return load, time.perf_counter() - start


def beside_thread(kind, args, cal):
    """C as in :func:`alone`, run while a plain thread loads batches of the ``kind``'s
    dataset without a pause, under a switch interval of :data:`BEST_INTERVAL`."""
    b = args.batch
    dataset = Dataset(b, _kinds(kind)[0], args.load_ms / 1e3 / b, cal[0])
    batch = chainer.dataset.concat_examples([dataset[i] for i in range(b)])
    optimizer = _optimizer(kind, args, cal)
    model = optimizer.target
    stop = threading.Event()

    def load():
        while not stop.is_set():
            chainer.dataset.concat_examples([dataset[i] for i in range(b)])

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=load, daemon=True)
    sys.setswitchinterval(BEST_INTERVAL)
    thread.start()
    try:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            optimizer.update(model, *batch)
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return statistics.median(times)


def measure(kind, n, args, cal):
    runs = {}
    for name, prefetch in (('auto', 'auto'), ('off', 0)):
        updater, model = build(kind, n, args, cal, prefetch)
        for _ in range(args.trial_updates):   # the trial of prefetch='auto', in a row
            updater.update()
        runs[name] = updater
    rows = {'auto': [], 'off': [], 'L': [], 'C': []}
    best = kind == 'python' and n == 1   # a thread's best: one loader beside the compute
    if best:
        rows['best'] = []
    try:
        for r in range(args.rounds):
            order = ['auto', 'off'] if r % 2 == 0 else ['off', 'auto']
            for name in order:
                updater = runs[name]
                updater.update()   # warms it after the other's turn: not timed
                start = time.perf_counter()
                for _ in range(args.block):
                    updater.update()
                rows[name].append((time.perf_counter() - start) / args.block)
            load, compute = zip(*(alone(kind, args, cal) for _ in range(3)))
            rows['L'].append(statistics.median(load))
            rows['C'].append(statistics.median(compute))
            if best:
                rows['best'].append(beside_thread(kind, args, cal))
        modes = {name: list(u.loading_modes) for name, u in runs.items()}
    finally:
        for updater in runs.values():
            updater.finalize()
    bound = [max(a, b) for a, b in zip(rows['L'], rows['C'])]
    auto = _common.ratio_summary([s / m for s, m in zip(rows['auto'], bound)])
    auto['verdict'] = ('-' if kind == 'host-bound' else   # no overlap is possible
                       'met' if auto['ci95'][1] <= GOAL else
                       'not met' if auto['ci95'][0] > GOAL else 'not resolved')
    return {'kind': kind, 'replicas': n,
            'ms': {key: 1e3 * statistics.median(v) for key, v in rows.items()},
            'auto_over_max': auto,
            'off_over_max': _common.ratio_summary([s / m for s, m in zip(rows['off'], bound)]),
            'auto_over_off': _common.ratio_summary(
                [a / o for a, o in zip(rows['auto'], rows['off'])]),
            'best_over_max': _common.ratio_summary(
                [s / m for s, m in zip(rows['best'], bound)]) if best else None,
            'loading_modes': modes}


def markdown(result):
    lines = ['# Loading and compute overlapping, with the defaults', '',
             '`{}`'.format(result['command']), '',
             'L = {load_ms} ms per batch of {batch}, C = {compute_ms} ms per update as '
             'asked (measured below); {rounds} rounds of {block} timed updates per updater, '
             'each replica\'s trial ({trial_updates} updates) first. Machine: {cpu} ({cores} '
             'cores), Python {python}; load average {l0} at start, {l1} at the end.'.format(
                 cpu=result['machine']['cpu'], cores=result['machine']['cores'],
                 python=result['versions']['python'], l0=result['machine']['loadavg_start'],
                 l1=result['machine']['loadavg_end'], **result['args']), '',
             '| case | replicas | L ms | C ms | defaults ms | prefetch=0 ms | defaults / '
             'max(L, C) | goal <= {} | prefetch=0 / max(L, C) | defaults / prefetch=0 | '
             'a thread\'s best / max(L, C) | loading |'.format(GOAL),
             '|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|']
    for row in result['rows']:
        ms = row['ms']
        best = row['best_over_max']
        lines.append('| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {} | {} | {} | {} | {} '
                     '| {} |'
                     .format(row['kind'], row['replicas'], ms['L'], ms['C'], ms['auto'],
                             ms['off'], _common.ratio_cell(row['auto_over_max']),
                             row['auto_over_max']['verdict'],
                             _common.ratio_cell(row['off_over_max']),
                             _common.ratio_cell(row['auto_over_off']),
                             _common.ratio_cell(best) if best else '-',
                             ', '.join(row['loading_modes']['auto'])))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--load-ms', type=float, default=20.0)
    p.add_argument('--compute-ms', type=float, default=20.0)
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--rounds', type=int, default=12)
    p.add_argument('--block', type=int, default=4)
    p.add_argument('--trial-updates', type=int, default=130)
    p.add_argument('--kinds', default='sleep,python,multiprocess,python-multiprocess,host-bound')
    p.add_argument('--replicas', default='1,2')
    p.add_argument('--out')
    args = p.parse_args(argv)
    result = {'schema': SCHEMA,
              'command': 'python bench/overlap.py ' + ' '.join(
                  sys.argv[1:] if argv is None else argv),
              'args': {k: getattr(args, k) for k in ('load_ms', 'compute_ms', 'batch',
                                                     'rounds', 'block', 'trial_updates')},
              'machine': {'cpu': _common.cpu_model(), 'cores': _common.cpu_count(),
                          'loadavg_start': _common.loadavg()},
              'versions': _common.versions(), 'rows': []}
    cal = calibrate(args.load_ms / 1e3, args.compute_ms / 1e3, args.batch)
    result['calibration'] = {'python_loops_per_example': cal[0], 'matrix_size': cal[1],
                             'products_per_forward': cal[2],
                             'python_loops_per_forward': cal[3]}
    for kind in args.kinds.split(','):
        for n in (int(x) for x in args.replicas.split(',')):
            result['rows'].append(measure(kind, n, args, cal))
    result['machine']['loadavg_end'] = _common.loadavg()
    _common.save_results(args.out, 'overlap', result, markdown(result))
    return 0


if __name__ == '__main__':
    sys.exit(main())

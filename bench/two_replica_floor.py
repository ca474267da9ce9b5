"""The floor for two CPU replicas: the least any two-process updater can cost here.

    python bench/two_replica_floor.py [--rounds 300] [--block 5] [--untimed 1] [--out DIR]

``bench/overhead.py`` sets ours with two replicas beside StandardUpdater on its
launch-bound MLP (batch 16, forward plus backward well under a millisecond). This bench
asks what two processes in lockstep cost at the least on the same machine, with nothing
of ours: a worker process and the master share one block of shared memory; the master's
parameters are views of it (so the worker sees every step without a copy); each update
the master raises a flag, both run forward and backward on their own batch, the worker
copies its gradients into shared memory and raises its flag, the master adds them, halves
(the mean of two replicas), and its optimizer steps. No pipe, no checks, no reporting,
no loading ahead: a floor, not an updater. Flags are spun on; after :data:`SPIN` seconds
without a round (the others' turns) the worker sleeps between looks as ours' waiters do,
longer the longer it has waited, at most 1 ms. (A worker that looked every 0.2 ms, this
bench at first, took enough of the two cores in the others' turns to read ours at
1.65-1.74 of StandardUpdater in turns of 60 updates, where ``bench/overhead.py`` reads it
alone at 1.29-1.39.)

StandardUpdater and ours (``ParallelAccumulatingUpdater`` with two ``'@numpy'`` replicas,
its defaults, each replica with StandardUpdater's batch, as ``bench/overhead.py``'s
``ours_n2``) run in the same process, the three taking turns round by round (the order
shuffled anew each round: a rotation, as here before 2026-12-05, kept each method behind
the same other one nearly every round, ``bench/cold_window.py``), turns of ``--block``
updates each (default 5), the first ``--untimed`` of a turn (default 1) not timed, each
update inside a reporter scope as under a Trainer; ours first warmed up until
``prefetch='auto'`` has decided. Per round the ratios floor / standard, ours / standard
and ours / floor; for each, its median with the 5-95% quantiles of the rounds and a 95%
bootstrap interval of the median. Writes ``two_replica_floor.md`` and ``.json`` into
``--out`` (with turns other than 5 updates, ``two_replica_floor_blockN.*``).

In short turns a process whose turn it is not sleeps, and the first updates after that
compute slower (``bench/cold_window.py``): the worker of ours and the floor's alike. Long
turns (``--block 60 --untimed 10 --rounds 60``, as ``bench/overhead.py``'s warm row) give
the floor as training sees it, where the workers never wait long.
"""
import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

for _name in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
    os.environ.setdefault(_name, '1')   # one core per process, as ours sets by default

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import multiprocessing  # noqa: E402
from multiprocessing import shared_memory  # noqa: E402

import chainer  # noqa: E402
import numpy  # noqa: E402

from bench import _common, overhead  # noqa: E402
# how the worker sleeps between looks once it has spun: as ours' waiters at the board
from mgpu_updater._local.board import BACKOFF, LONGEST_SLEEP  # noqa: E402

BATCH = 16
HEADER = 16   # two int64 flags: the master's round, the worker's round (-1: stop)
SPIN = 2e-3   # seconds the worker spins for a round before it sleeps between looks


def _params(model):
    return [p for _, p in sorted(model.namedparams())]


def _views(block, n):
    flags = numpy.ndarray((2,), numpy.int64, block.buf, 0)
    params = numpy.ndarray((n,), numpy.float32, block.buf, HEADER)
    grads = numpy.ndarray((n,), numpy.float32, block.buf, HEADER + 4 * n)
    return flags, params, grads


def _bind(model, flat, write):
    """Make the model's parameters views of ``flat`` (``write``: with their values first);
    (param, offset) of each."""
    out, offset = [], 0
    for p in _params(model):
        if write:
            flat[offset:offset + p.size] = p.array.ravel()
        p.array = flat[offset:offset + p.size].reshape(p.shape)
        out.append((p, offset))
        offset += p.size
    return out


def worker(name, n):
    block = shared_memory.SharedMemory(name)
    flags, params, grads = _views(block, n)
    model = overhead.make_model()
    bound = _bind(model, params, write=False)   # the master's parameters, not a copy
    it = overhead._iterator(overhead.make_dataset(4096), BATCH, 2)
    r = 0
    try:
        while True:
            r += 1
            since = time.perf_counter()
            while flags[0] < r:
                if flags[0] < 0:
                    return
                waited = time.perf_counter() - since
                if waited < SPIN:
                    os.sched_yield()
                else:   # the others' turn: leave the cores to them, as ours' board does
                    time.sleep(min(BACKOFF * waited, LONGEST_SLEEP))
            x, t = chainer.dataset.concat_examples(it.next())
            model.cleargrads()
            model(x, t).backward()
            for p, o in bound:
                grads[o:o + p.size] = p.grad.ravel()
            flags[1] = r
    finally:
        del flags, params, grads
        block.close()


PAIRS = (('floor', 'standard'), ('ours', 'standard'), ('ours', 'floor'))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=300)
    parser.add_argument('--block', type=int, default=5,
                        help='updates per turn of a method (default 5)')
    parser.add_argument('--untimed', type=int, default=1,
                        help='updates at the start of each turn that are not timed (default 1)')
    parser.add_argument('--out', default=None, help='folder for the .md and .json')
    args = parser.parse_args(argv)
    if args.rounds < 2 or not 0 <= args.untimed < args.block:
        parser.error(f'--rounds must be >= 2 and --untimed >= 0 and below --block; got '
                     f'--rounds {args.rounds} --block {args.block} --untimed {args.untimed}')
    timed = args.block - args.untimed

    model = overhead.make_model()
    n = sum(p.size for p in _params(model))
    block = shared_memory.SharedMemory(create=True, size=HEADER + 8 * n)
    flags, params, grads = _views(block, n)
    flags[:] = 0
    bound = _bind(model, params, write=True)
    optimizer = _common.make_optimizer(model)
    it = overhead._iterator(overhead.make_dataset(4096), BATCH, 1)
    proc = multiprocessing.get_context('spawn').Process(target=worker, args=(block.name, n))
    proc.start()
    std_model = overhead.make_model()
    standard = overhead._observed(chainer.training.updaters.StandardUpdater(
        overhead._iterator(overhead.make_dataset(4096), BATCH, 1),
        _common.make_optimizer(std_model)), std_model)
    from mgpu_updater import ParallelAccumulatingUpdater
    ours_model = overhead.make_model()
    dataset = overhead.make_dataset(4096)
    ours_updater = ParallelAccumulatingUpdater(
        [overhead._iterator(dataset, BATCH, 1 + r) for r in range(2)],
        _common.make_optimizer(ours_model), devices=['@numpy'] * 2)
    ours = overhead._observed(ours_updater, ours_model)
    state = {'round': 0}

    def floor():
        state['round'] += 1
        r = state['round']
        flags[0] = r
        x, t = chainer.dataset.concat_examples(it.next())
        model.cleargrads()
        model(x, t).backward()
        while flags[1] < r:
            if not proc.is_alive():
                raise RuntimeError(f'the worker died (exit code {proc.exitcode})')
            os.sched_yield()
        for p, o in bound:
            p.grad += grads[o:o + p.size].reshape(p.shape)
            p.grad *= 0.5
        optimizer.update()

    try:
        floor()   # the workers' start-up
        warm = 0   # ours past prefetch='auto''s trial (about 125 windows): as it trains
        while warm < 10 or ('trial' in ours_updater.loading_modes and warm < 300):
            ours()
            warm += 1
        times = {'floor': [], 'standard': [], 'ours': []}
        ratios = {pair: [] for pair in PAIRS}
        steps = [('floor', floor), ('standard', standard), ('ours', ours)]
        shuffle = random.Random(0).shuffle
        for i in range(args.rounds):
            got = {}
            shuffle(steps)   # anew each round: no method always follows the same one
            for name, step in steps:
                for _ in range(args.untimed):
                    step()
                t0 = time.perf_counter()
                for _ in range(timed):
                    step()
                got[name] = (time.perf_counter() - t0) / timed
                times[name].append(got[name])
            for a, b in PAIRS:
                ratios[(a, b)].append(got[a] / got[b])
    finally:
        ours_updater.finalize()
        flags[0] = -1
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        del flags, params, grads
        block.close()
        block.unlink()
    result = {
        'bench': 'two_replica_floor', 'order': 'shuffled each round', 'rounds': args.rounds,
        'batch': BATCH,
        'block': args.block, 'untimed': args.untimed,
        'model': 'bench/overhead.py make_model()', 'python': platform.python_version(),
        'numpy': numpy.__version__, 'chainer': chainer.__version__,
        'cpu_count': os.cpu_count(),
        'floor_ms': 1e3 * statistics.median(times['floor']),
        'standard_ms': 1e3 * statistics.median(times['standard']),
        'ours_ms': 1e3 * statistics.median(times['ours']),
        'ours_loading': ours_updater.loading_modes, 'ratios': {}}
    for (a, b), values in ratios.items():
        q = statistics.quantiles(values, n=20)
        low, high = _common.median_interval(values)
        result['ratios'][f'{a}/{b}'] = {'median': statistics.median(values), 'q05': q[0],
                                        'q95': q[-1], 'ci95': [low, high]}
    # the floor's own line, as before
    floor_std = result['ratios']['floor/standard']
    result.update(ratio_median=floor_std['median'], ratio_q05=floor_std['q05'],
                  ratio_q95=floor_std['q95'])
    lines = [f"floor {result['floor_ms']:.3f} ms, ours {result['ours_ms']:.3f} ms, "
             f"StandardUpdater {result['standard_ms']:.3f} ms per update (medians), "
             f"{args.rounds} rounds, turns of {args.block} updates "
             f"({args.untimed} untimed)", '',
             '| ratio | median | 95% interval of the median | 5-95% of the rounds |',
             '|---|---:|---:|---:|']
    for key, r in result['ratios'].items():
        lines.append(f"| {key} | {r['median']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} "
                     f"| {r['q05']:.3f}-{r['q95']:.3f} |")
    line = '\n'.join(lines)
    # the default turns keep the old name; other turns (long ones: warm workers) their own
    stem = ('two_replica_floor' if args.block == parser.get_default('block')
            else f'two_replica_floor_block{args.block}')
    _common.save_results(args.out, stem, result, (
        f'`python bench/two_replica_floor.py --rounds {args.rounds} --block {args.block} '
        f'--untimed {args.untimed} --out {args.out}`\n\n'
        f'Two processes in lockstep, nothing of ours (the floor, see the bench\'s '
        f'docstring), beside StandardUpdater and ours with two replicas, on '
        f'bench/overhead.py\'s MLP, batch {BATCH} per replica, taking turns; Python '
        f'{result["python"]}, numpy {result["numpy"]}, Chainer {result["chainer"]}, '
        f'{result["cpu_count"]} cores.\n\n{line}\n'))
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Ours against Chainer's MultiprocessParallelUpdater, both with N NCCL ranks on one GPU.

Usage (``bench/gpu_check.py`` runs it for its section ``nccl_ranks_on_one_gpu``)::

    python bench/gpu_nccl_anchor.py [--ranks 2] [--updates 20] [--warmup 3] [--dry-run]

Both updaters run the same way: one process per rank, all on GPU 0, each rank acting as a
host of its own for NCCL (the test mode of docs/gpu.md: its own ``NCCL_HOSTID``, NCCL's
socket transport on the loopback interface). Chainer's ``MultiprocessParallelUpdater``
divides the learning rate by N and sums the replicas' gradients; ours runs with
``replica_reduction='sum'`` and the learning rate it leaves, so both take the same steps on
the same samples: the parameters after the first and the last update are compared (its
trajectory), and the time per update of each is measured, device synchronised, after
``--warmup`` updates. Its workers get their ``NCCL_HOSTID`` from a subclass of its
``_Worker`` (the process class it starts), before their first NCCL call.

Prints one ``RESULT {json}`` line per item: ``setup``, each updater's ``run``, and the
``comparison`` (``max_param_diff_vs_mpu``, ``ours_over_mpu_time``, ``follows``), or one
``skipped`` line where CuPy, a GPU, NCCL or the updater is missing (``--dry-run`` says so
without trying). Where Chainer's updater cannot compile its CUDA kernel (Chainer 7.8.1 under
CuPy 14: its gather kernel names ``float16``, an incomplete type there), an
``mpu_unavailable`` line says so, and ours is timed alone.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mgpu_updater  # noqa: E402,F401  applies the compat shim before Chainer
import numpy  # noqa: E402
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
from chainer.training.updaters import multiprocess_parallel_updater as mpu  # noqa: E402

from mgpu_updater import ParallelAccumulatingUpdater, _cuda  # noqa: E402
from mgpu_updater.comm.nccl import TEST_SWITCH, act_as_own_host  # noqa: E402

RESULT = 'RESULT '
TOLERANCE = 1e-5   # the largest parameter difference that still follows the trajectory


def emit(obj: Dict[str, Any]) -> None:
    print(RESULT + json.dumps(obj, default=str), flush=True)


_ChainerWorker = mpu._Worker


class HostPerRankWorker(_ChainerWorker):
    """Chainer's worker process, acting as a host of its own before its first NCCL call.

    ``main`` puts this class in ``mpu._Worker``, where Chainer's updater looks up the
    class it starts. Chainer's ``__init__`` calls ``super(_Worker, self).__init__()``
    with the module's name, which would then be this class (and ``_Worker.__init__``
    again, without arguments): so Chainer's own class goes back there while it runs."""

    def __init__(self, proc_id: int, pipe: Any, master: Any) -> None:
        mpu._Worker = _ChainerWorker
        try:
            _ChainerWorker.__init__(self, proc_id, pipe, master)
        finally:
            mpu._Worker = HostPerRankWorker

    def run(self) -> None:
        act_as_own_host(self.proc_id)
        super().run()


class MLP(chainer.Chain):
    def __init__(self, n_in: int = 784, n_hidden: int = 512, n_out: int = 10) -> None:
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, n_out)

    def forward(self, x: Any) -> Any:
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def make_model() -> chainer.Link:
    numpy.random.seed(0)
    return L.Classifier(MLP())


def shards(ranks: int, batch: int, updates: int) -> List[Any]:
    rng = numpy.random.RandomState(1)
    n = batch * updates
    return [chainer.datasets.TupleDataset(rng.rand(n, 784).astype(numpy.float32),
                                          rng.randint(0, 10, n).astype(numpy.int32))
            for _ in range(ranks)]


def params(model: chainer.Link) -> Dict[str, numpy.ndarray]:
    return {name: chainer.backends.cuda.to_cpu(p.array).copy()
            for name, p in model.namedparams()}


def max_diff(a: Dict[str, numpy.ndarray], b: Dict[str, numpy.ndarray]) -> float:
    return max(float(numpy.max(numpy.abs(a[k].astype(numpy.float64) - b[k]))) for k in a)


def run(which: str, ranks: int, batch: int, lr: float, warmup: int,
        updates: int) -> Dict[str, Any]:
    """One updater: the parameters after its first update and its last, and the
    seconds per update over ``updates`` after ``warmup``."""
    import cupy
    model = make_model()
    data = shards(ranks, batch, warmup + updates + 1)
    its = [chainer.iterators.SerialIterator(d, batch, shuffle=False) for d in data]
    devices = ['@cupy:0'] * ranks
    if which == 'mpu':
        optimizer = chainer.optimizers.MomentumSGD(lr=lr).setup(model)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')   # "optimizer.lr is changed to lr / N"
            updater = mpu.MultiprocessParallelUpdater(its, optimizer, devices=devices)
    else:
        optimizer = chainer.optimizers.MomentumSGD(lr=lr / ranks).setup(model)
        updater = ParallelAccumulatingUpdater(its, optimizer, devices=devices,
                                              replica_reduction='sum', start_timeout=120)
    sync = cupy.cuda.Device(0).synchronize
    try:
        updater.update()
        sync()
        first = params(model)
        for _ in range(warmup - 1):
            updater.update()
        sync()
        t0 = time.perf_counter()
        for _ in range(updates):
            updater.update()
        sync()
        seconds = (time.perf_counter() - t0) / updates
        last = params(model)
    finally:
        finalize(updater)
    return {'which': which, 'ms_per_update': round(1000 * seconds, 3), 'first': first,
            'last': last, 'lr_stepped': optimizer.lr}


def finalize(updater: Any, timeout: float = 30.0) -> None:
    """Finalize; Chainer's joins its workers without a bound, so they are ended after
    ``timeout`` if they are still there."""
    workers = list(getattr(updater, '_workers', []))
    done = {}

    def target() -> None:
        updater.finalize()
        done['ok'] = True
    import threading
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(5)


def unavailable() -> Optional[str]:
    reason = _cuda.unavailable_reason(nccl=True)
    if reason:
        return reason
    if not mpu.MultiprocessParallelUpdater.available():
        return 'chainer.training.updaters.MultiprocessParallelUpdater.available() is False'
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--ranks', type=int, default=2)
    parser.add_argument('--batch', type=int, default=64, help='samples per rank and update')
    parser.add_argument('--updates', type=int, default=20, help='timed updates')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--lr', type=float, default=0.05)
    parser.add_argument('--dry-run', action='store_true',
                        help='report "skipped" without touching a GPU')
    args = parser.parse_args(argv)
    reason = 'dry run (no GPU)' if args.dry_run else unavailable()
    if reason:
        emit({'skipped': reason})
        return 0
    os.environ[TEST_SWITCH] = '1'
    act_as_own_host(0)   # this process is rank 0 of both, before its first NCCL call
    multiprocessing.set_start_method('spawn', force=True)   # CUDA is initialised here
    mpu._Worker = HostPerRankWorker
    emit({'setup': {'ranks': args.ranks, 'batch_per_rank': args.batch,
                    'warmup': args.warmup, 'timed_updates': args.updates, 'lr': args.lr,
                    'model': 'MLP 784-512-512-10', 'optimizer': 'MomentumSGD',
                    'ours': "replica_reduction='sum', lr / ranks",
                    'chainer': chainer.__version__}})
    runs = {}
    status = 0
    for which in ('ours', 'mpu'):
        try:
            runs[which] = run(which, args.ranks, args.batch, args.lr, args.warmup,
                              args.updates)
            emit({'run': {k: v for k, v in runs[which].items()
                          if k not in ('first', 'last')}})
        except BaseException as e:  # noqa: B902  reported, the other still runs
            if which == 'mpu' and type(e).__name__ == 'CompileException':
                # Chainer 7.8.1's gather kernel names float16, which CuPy 14's kernel
                # headers leave incomplete where no argument is float16: Chainer's
                # updater cannot run there, which says nothing about ours
                emit({'mpu_unavailable': f'{type(e).__name__}: {str(e).splitlines()[0]}'})
                continue
            emit({'error': f'{which}: {type(e).__name__}: {e}',
                  'traceback': traceback.format_exc()})
            status = 1
    if len(runs) == 2:
        ours, theirs = runs['ours'], runs['mpu']
        diff_first = max_diff(ours['first'], theirs['first'])
        diff_last = max_diff(ours['last'], theirs['last'])
        emit({'comparison': {
            'max_param_diff_vs_mpu_first': diff_first,
            'max_param_diff_vs_mpu': diff_last,
            'follows': diff_last <= TOLERANCE and diff_first <= TOLERANCE,
            'tolerance': TOLERANCE,
            'ours_ms_per_update': ours['ms_per_update'],
            'mpu_ms_per_update': theirs['ms_per_update'],
            'ours_over_mpu_time': round(ours['ms_per_update'] / theirs['ms_per_update'], 3)}})
        if diff_last > TOLERANCE or diff_first > TOLERANCE:
            status = 1
    return status


if __name__ == '__main__':
    sys.exit(main())

"""A child forked (``os.fork``) from a process whose updater runs, exiting normally: its
exit hooks (``hooks``), or a ``finally`` that finalizes the updater before them
(``finally``), saw the parent's inherited updater and pool, stopped the parent's worker
and removed its shared memory; an updater built here and started and finalized in a
child forked with multiprocessing (``started_there``) must stop its workers there.
Prints the parent's difference from StandardUpdater after an
update that follows the child's exit, then OK."""
import os
import sys

import chainer
import chainer.links as L
import numpy

from mgpu_updater import ParallelAccumulatingUpdater

B = 4


def model():
    numpy.random.seed(0)
    return L.Classifier(L.Linear(3, 2))


def optimizer(target):
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(target)
    return opt


def _train_here(updater):
    """In a child forked with the updater built (not started) in its parent."""
    try:
        for _ in range(2):
            updater.update()
    finally:
        updater.finalize()


if __name__ == '__main__':
    rng = numpy.random.RandomState(1)
    x = rng.normal(size=(48, 3)).astype(numpy.float32)
    t = rng.randint(0, 2, 48).astype(numpy.int32)
    ours = model()
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x[r::2], t[r::2]),
                                          B, shuffle=False) for r in range(2)],
        optimizer(ours), devices=['@numpy', '@numpy'])
    reference = model()
    # the reference batches: the master's B samples, then the worker's
    order = [i for u in range(3) for r in range(2) for i in range(2 * B * u + r,
                                                                 2 * B * (u + 1), 2)]
    standard = chainer.training.updaters.StandardUpdater(
        chainer.iterators.SerialIterator(
            chainer.datasets.TupleDataset(x[order], t[order]), 2 * B, shuffle=False),
        optimizer(reference))
    if sys.argv[1] == 'started_there':
        # built here, started and finalized in a forked child: its workers are its own
        import multiprocessing
        import time
        child = multiprocessing.get_context('fork').Process(target=_train_here,
                                                            args=(updater,))
        began = time.monotonic()
        child.start()
        child.join(60)
        print('CHILD', child.exitcode, round(time.monotonic() - began, 1))
        print('DIFF 0.0')
        print('OK' if child.exitcode == 0 else 'HUNG')
        sys.exit(0)
    for _ in range(2):
        updater.update()
        standard.update()
    if sys.argv[1] == 'hooks':
        # the child's exit runs the exit hooks alone: the dropped updater's, the pools'
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
    try:
        if sys.argv[1] == 'finally':
            # ... after a finally that finalizes the updater (as the Trainer's does)
            pid = os.fork()
            if pid == 0:
                sys.exit(0)
            os.waitpid(pid, 0)
        updater.update()
        standard.update()
        print('DIFF', max(float(abs(a.array - b.array).max())
                          for a, b in zip(ours.params(), reference.params())))
        print('OK')
    finally:
        updater.finalize()

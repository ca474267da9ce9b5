"""Run under ``mpiexec -n 2 python -m mpi4py trainer.py MODE OUT_DIR``.

``resume``: a Trainer with the multi-node evaluator, a LogReport on rank 0 and one snapshot
per rank. Run A trains 6 updates straight; run B trains 3, then a fresh trainer loads each
rank's own snapshot and trains 3 more (and every rank loads rank 0's once more, which
rank 1 is warned about). Rank 0 writes ``OUT_DIR/resume.json``: parameters
of A and B (bitwise), reports of A and B, rank 0's LogReport, the evaluator's values.

``fail``: rank 1's loss function raises at the 3rd update while rank 0 waits in the
allreduce. ``python -m mpi4py`` turns the uncaught exception into ``MPI_Abort``; the test
measures how long the job takes to end after the raise (printed as ``RAISED_AT <time>``).
"""
import json
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))   # tests/

import mgpu_updater  # noqa: E402,F401  (applies the compat shim before chainer)
import chainer  # noqa: E402
import chainermn  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402

from mgpu_updater import ParallelAccumulatingUpdater  # noqa: E402

from _models import classifier, dataset, params, setup_optimizer  # noqa: E402

comm = chainermn.create_communicator('naive')
RANK = comm.rank
BATCH, STEPS, UPDATES, SNAP_AT = 4, 2, 6, 3


class Record(chainer.training.Extension):
    """Keeps every update's observation (the reported values, as floats)."""
    trigger = (1, 'iteration')
    priority = chainer.training.PRIORITY_READER

    def __init__(self):
        self.log = []

    def __call__(self, trainer):
        self.log.append({k: float(v) for k, v in trainer.observation.items()
                         if not k.startswith('main/time/')})


def make_trainer(out, stop, snapshot_at=None):
    train = dataset(80, seed=1) if RANK == 0 else None
    test = dataset(30, seed=2) if RANK == 0 else None
    train = chainermn.scatter_dataset(train, comm, shuffle=True, seed=0)
    test = chainermn.scatter_dataset(test, comm)
    model = classifier(seed=0)
    opt = setup_optimizer('adam', model)
    it = chainer.iterators.SerialIterator(
        train, BATCH, order_sampler=chainer.iterators.ShuffleOrderSampler(
            np.random.RandomState(10 + RANK)))
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'],
                                          accumulate_steps=STEPS, prefetch=2,
                                          communicator=comm, report_times=True)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=out)
    test_it = chainer.iterators.SerialIterator(test, 8, repeat=False, shuffle=False)
    evaluator = chainermn.create_multi_node_evaluator(
        extensions.Evaluator(test_it, model), comm)
    trainer.extend(evaluator, name='validation', trigger=(SNAP_AT, 'iteration'))
    if snapshot_at:
        trainer.extend(extensions.snapshot(
            filename=f'snapshot_iter_{{.updater.iteration}}_rank{RANK}'),
            trigger=(snapshot_at, 'iteration'))
    if RANK == 0:
        trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    record = Record()
    trainer.extend(record)
    return trainer, model, record


def resume(out):
    a, model_a, rec_a = make_trainer(os.path.join(out, 'a'), UPDATES)
    a.run()
    b, _, _ = make_trainer(os.path.join(out, 'b'), SNAP_AT, snapshot_at=SNAP_AT)
    b.run()
    c, model_c, rec_c = make_trainer(os.path.join(out, 'b'), UPDATES)
    own = _loaded(c, f'snapshot_iter_{SNAP_AT}_rank{RANK}', out)
    c.run()
    # every rank loads rank 0's file (one snapshot for all ranks): named on rank 1
    crossed = _loaded(make_trainer(os.path.join(out, 'd'), UPDATES)[0],
                      f'snapshot_iter_{SNAP_AT}_rank0', out)
    pa, pc = params(model_a), params(model_c)
    everyone = comm.mpi_comm.allgather((pa, pc, rec_a.log, rec_c.log, own, crossed))
    if RANK == 0:
        log = a.get_extension('LogReport').log
        result = {
            'a_equals_resumed': all(np.array_equal(pa[k], pc[k]) for k in pa),
            'ranks_equal': all(all(np.array_equal(e[0][k], pa[k]) for k in pa)
                               for e in everyone),
            'iterations': [a.updater.iteration, c.updater.iteration],
            'record_a': rec_a.log,
            'record_resumed': rec_c.log,
            'records_equal_across_ranks': all(e[2] == rec_a.log for e in everyone),
            'logreport': [{k: float(v) for k, v in entry.items()} for entry in log],
            'snapshots': sorted(os.listdir(os.path.join(out, 'b'))),
            'own_snapshot_warnings': [e[4] for e in everyone],
            'rank_0_snapshot_warnings': [e[5] for e in everyone],
        }
        with open(os.path.join(out, 'resume.json'), 'w') as f:
            json.dump(result, f, indent=1)


def _loaded(trainer, name, out):
    """Load the snapshot ``name`` into ``trainer``; the RuntimeWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        chainer.serializers.load_npz(os.path.join(out, 'b', name), trainer)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def fail(out):
    model = classifier(seed=0)
    calls = [0]

    def loss_func(x, t):
        calls[0] += 1
        if RANK == 1 and calls[0] == 2 * STEPS + 1:
            print(f'RAISED_AT {time.time()}', file=sys.stderr, flush=True)
            raise RuntimeError('boom on rank 1')
        return model(x, t)

    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(64, seed=RANK), BATCH)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'],
                                          accumulate_steps=STEPS, loss_func=loss_func,
                                          communicator=comm)
    trainer = training.Trainer(updater, (100, 'iteration'), out=out)
    trainer.run()
    print(f'rank {RANK} finished, which it should not', flush=True)


if __name__ == '__main__':
    {'resume': resume, 'fail': fail}[sys.argv[1]](sys.argv[2])

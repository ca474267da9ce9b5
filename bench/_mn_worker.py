"""ChainerMN baseline: one rank of ``mpiexec -n N python bench/_mn_worker.py '<json plan>'``.

Every rank trains the benchmark model with a ``naive`` communicator and
``create_multi_node_optimizer`` on its scattered share of the synthetic data, ``k*b`` samples
per update (so the global batch is ``N*k*b``, as for the other methods). Rank 0 appends one
JSON line per accumulate_steps value to ``plan['out']``.
"""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import _common  # noqa: E402  (imports Chainer through the package's shim)

import chainer  # noqa: E402


def run(plan, comm):
    import chainermn
    common = plan['common']
    n, b = comm.size, common['micro_batch']
    dataset = _common.make_dataset(common['dataset_size'], seed=0) if comm.rank == 0 else None
    dataset = chainermn.scatter_dataset(dataset, comm, shuffle=True, seed=0)

    def barrier():
        comm.mpi_comm.Barrier()

    for k in plan['ks']:
        start = time.perf_counter()
        model = _common.make_model(common['model'])
        optimizer = chainermn.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.01), comm)
        optimizer.setup(model)
        iterator = chainer.iterators.SerialIterator(dataset, k * b, shuffle=True)
        updater = chainer.training.updaters.StandardUpdater(iterator, optimizer)
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)

        def step():
            with reporter.scope({}):
                updater.update()
        # The first update broadcasts rank 0's parameters (ChainerMN's is_changed): warm-up.
        rates = _common.time_rounds(step, n * k * b, common['warmup'] + 1, common['rounds'],
                                    common['updates'], sync=barrier)
        if comm.rank == 0:
            record = {'method': 'chainermn', 'n': n, 'k': k, 'samples_per_s': rates,
                      'wall_s': time.perf_counter() - start, 'event': 'case',
                      'threads': _common.current_thread_env()}
            with open(plan['out'], 'a') as f:
                f.write(json.dumps(record) + '\n')


def main(argv):
    plan = json.loads(argv[1])
    import chainermn
    comm = chainermn.create_communicator('naive')
    try:
        run(plan, comm)
    except Exception:
        if comm.rank == 0:
            with open(plan['out'], 'a') as f:
                f.write(json.dumps({'event': 'error', 'method': 'chainermn', 'n': comm.size,
                                    'error': traceback.format_exc()}) + '\n')
        comm.mpi_comm.Abort(1)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))

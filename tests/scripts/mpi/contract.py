"""The communicator contract on the MPI backend; run by tests/test_comm_contract.py as
``mpiexec -n N python -m mpi4py contract.py OUT_DIR``. Each rank writes ``rank<r>.pkl``:
what it saw (see ``scripts/comm_contract.py``), plus the order check as the MPI group does
it (every rank's issued collectives compared through ``allgather_obj``).
"""
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # tests/scripts: comm_contract

import mgpu_updater  # noqa: E402,F401  (applies the compat shim before chainer)
import chainermn  # noqa: E402

import comm_contract  # noqa: E402
from mgpu_updater.comm.base import check_same_order  # noqa: E402
from mgpu_updater.comm.mpi import MpiCommunicator  # noqa: E402


def order_check(comm):
    """The last rank broadcasts another buffer of the same size and dtype: MPI pairs the
    two (no hang), and comparing the issued sequences across the ranks catches it."""
    last = comm.size - 1
    comm.begin_update()
    comm.bcast('other/<f4' if comm.rank == last else 'buf/<f4')
    issued = comm.allgather_obj(comm.issued())
    return {'issued': issued, 'compare': comm_contract._error(
        lambda: check_same_order(dict(enumerate(issued)), update=comm.updates))}


def main(out_dir):
    chainermn_comm = chainermn.create_communicator('naive')

    def job():
        comm = MpiCommunicator(chainermn_comm, comm_contract.SPEC, '@numpy')
        out = comm_contract.run(comm, lambda step: None, allreduce=True)
        out['order'] = order_check(comm)
        out['after_finalize'] = comm_contract.after_finalize(comm)
        return out

    out = comm_contract.guarded(job)
    with open(os.path.join(out_dir, f'rank{chainermn_comm.rank}.pkl'), 'wb') as f:
        pickle.dump(out, f)
    if 'traceback' in out:
        sys.stderr.write(out['traceback'])
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1]))

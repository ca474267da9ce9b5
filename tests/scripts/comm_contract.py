"""The communicator contract, as one rank runs it: tests/test_comm_contract.py runs it on
every rank of every backend (shared memory in spawned processes, NCCL and the host-staged
backend on the CuPy stand-in in threads, MPI under ``mpiexec`` through ``mpi/contract.py``)
and compares what the ranks report with numpy.

The contract is what :mod:`mgpu_updater.comm.base` promises: ``reduce`` sums every rank's
buffer into the root's, ``bcast`` copies the root's into every rank's, ``allreduce`` gives
every rank the sum; buffers keep their dtype; ``finalize()`` twice is fine; a verb after it
raises. ``channel(step)`` stands for the updater's control channel (every rank calls it at
the same steps): the shared-memory backend needs it between the non-root ranks' ``reduce``
and the root's, and between the root's ``bcast`` and the others'; the collective backends
synchronise inside the verb and need none (their channel does nothing).
"""
from __future__ import annotations

import traceback
from functools import reduce as fold
from typing import Any, Callable, Dict, List, Optional

import numpy

COUNT = 7
DTYPES = ['float16', 'float32', 'float64', 'int32', 'int64']
# 'buf/<dtype>' per dtype; 'other/<f4' has the size and dtype of 'buf/<f4' (the collectives
# of the order checks pair up on both); 'empty/<f4' holds nothing
SPEC = {f'buf/{numpy.dtype(d).str}': (numpy.dtype(d).str, COUNT) for d in DTYPES}
SPEC.update({'other/<f4': ('<f4', COUNT), 'empty/<f4': ('<f4', 0)})
NAMES = sorted(SPEC)
ROOT = 0
BCAST_SEED = 1000   # the root's bcast data differs from every rank's reduce data


def rank_data(name: str, seed: int) -> numpy.ndarray:
    """What rank ``seed`` puts into buffer ``name``: random values of its dtype (floats with
    full mantissas, so that the order of a sum shows in its bits; small integers)."""
    dtype, count = SPEC[name]
    rng = numpy.random.RandomState(seed * 7919 + NAMES.index(name))
    if numpy.dtype(dtype).kind == 'f':
        return (rng.randn(count) * 10).astype(dtype)
    return rng.randint(-1000, 1000, size=count).astype(dtype)


def rank_order_sum(name: str, size: int, wide: bool = False) -> numpy.ndarray:
    """numpy's sum of every rank's data, in rank order, in the buffer's dtype; with
    ``wide``, float16 summed in float32 and cast back once (the NCCL backend's sum)."""
    data = [rank_data(name, r) for r in range(size)]
    if wide and data[0].dtype == numpy.float16:
        return fold(numpy.add, [d.astype(numpy.float32) for d in data]).astype(numpy.float16)
    return fold(numpy.add, data)


def _host(array: Any) -> numpy.ndarray:
    if not isinstance(array, numpy.ndarray):   # a CuPy array: a host read
        array = array.get()
    return numpy.array(array).view(numpy.ndarray)


def _fill(comm: Any, name: str, data: numpy.ndarray) -> None:
    buffer = comm.buffer(name)
    if hasattr(buffer, 'set'):   # a CuPy array: `buffer[...] = data` takes scalars only
        buffer.set(data)
    else:
        buffer[...] = data


def run(comm: Any, channel: Callable[[str], None], allreduce: bool) -> Dict[str, Any]:
    """One update's reduce and bcast on every buffer (and allreduce when the backend offers
    it under its ordering contract); returns what this rank saw, as numpy arrays."""
    rank = comm.rank
    out: Dict[str, Any] = {'rank': rank, 'size': comm.size, 'reduce': {}, 'bcast': {},
                           'allreduce': {}, 'dtypes': {}}
    comm.begin_update()
    for name in NAMES:
        _fill(comm, name, rank_data(name, rank))
    if rank != ROOT:
        for name in NAMES:
            comm.reduce(name, root=ROOT)
    channel('every non-root rank reduced')
    if rank == ROOT:
        for name in NAMES:
            comm.reduce(name, root=ROOT)
            out['reduce'][name] = _host(comm.buffer(name))
        for name in NAMES:
            _fill(comm, name, rank_data(name, BCAST_SEED))
            comm.bcast(name, root=ROOT)
    channel('the root filled and broadcast')
    for name in NAMES:
        if rank != ROOT:
            comm.bcast(name, root=ROOT)
        out['bcast'][name] = _host(comm.buffer(name))
        out['dtypes'][name] = str(comm.buffer(name).dtype)
    if rank != ROOT:
        comm.end_update()
    channel('every non-root rank ended its update')
    if rank == ROOT:
        comm.end_update()
    channel('the root compared the update')   # no rank begins the next one before
    if allreduce:
        comm.begin_update()
        for name in NAMES:
            _fill(comm, name, rank_data(name, rank))
            comm.allreduce(name)
            out['allreduce'][name] = _host(comm.buffer(name))
        comm.end_update()
    return out


def _error(call: Callable[[], Any]) -> Optional[List[str]]:
    """[type name, message] of what ``call`` raised, None if it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return [type(e).__name__, str(e)]
    return None


def order_checks(comm: Any, channel: Callable[[str], None]) -> Dict[str, Any]:
    """Three updates whose collectives differ between the ranks, on a backend that checks
    the issue order itself (shared memory, also behind the host-staged wrapper): what each
    rank's verbs and ``end_update`` raised, as [type name, message] (None: nothing)."""
    rank, last = comm.rank, comm.size - 1
    out: Dict[str, Any] = {}
    # 1. the last rank reduces another buffer than the others at the same position
    comm.begin_update()
    if rank != ROOT:
        out['1 worker reduce'] = _error(
            lambda: comm.reduce('other/<f4' if rank == last else 'buf/<f4'))
    channel('reduced')
    if rank == ROOT:
        out['1 root reduce'] = _error(lambda: comm.reduce('buf/<f4'))
    channel('compared')
    # 2. the last rank issues one collective more; rank 0 finds it at end_update
    comm.begin_update()
    if rank != ROOT:
        comm.reduce('buf/<f4')
        if rank == last:
            comm.reduce('other/<f4')
        comm.end_update()
    channel('reduced')
    if rank == ROOT:
        out['2 root reduce'] = _error(lambda: comm.reduce('buf/<f4'))
        out['2 root end_update'] = _error(comm.end_update)
    channel('compared')
    # 3. the root broadcasts one buffer, the last rank asks for another
    comm.begin_update()
    if rank == ROOT:
        comm.bcast('buf/<f4')
    channel('broadcast')
    if rank != ROOT:
        out['3 worker bcast'] = _error(
            lambda: comm.bcast('other/<f4' if rank == last else 'buf/<f4'))
    channel('compared')
    return out


def after_finalize(comm: Any) -> Dict[str, Any]:
    """``finalize()`` twice, then each verb: what raised ([type name, message] or None)."""
    out: Dict[str, Any] = {'finalize twice': _error(lambda: (comm.finalize(), comm.finalize()))}
    out['finalized'] = bool(comm.finalized)
    for verb in ('buffer', 'reduce', 'bcast', 'allreduce'):
        out[verb] = _error(lambda: getattr(comm, verb)('buf/<f4'))
    return out


def guarded(job: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``job()``, or {'traceback': ...} when it raised: a rank reports, never hangs silent."""
    try:
        return job()
    except BaseException:  # noqa: BLE001 - reported to the test
        return {'traceback': traceback.format_exc()}


def shm_rank(handle: Any, rank: int, barrier: Any, conn: Any) -> None:
    """A spawned rank of the shared-memory backend: attach, run the contract, report."""
    from mgpu_updater.comm.shm import ShmCommunicator

    def job() -> Dict[str, Any]:
        comm = ShmCommunicator.attach(handle, rank)
        channel = lambda step: barrier.wait(60)   # noqa: E731
        try:
            out = run(comm, channel, allreduce=False)
            out['order'] = order_checks(comm, channel)
        finally:
            barrier.wait(60)   # the master (the owner) finalizes last
        out['after_finalize'] = after_finalize(comm)
        return out

    conn.send(guarded(job))
    conn.close()

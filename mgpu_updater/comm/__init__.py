"""Communicator backends behind one interface, created by name.

- ``'shm'``: CPU replicas (``'@numpy'``), shared memory; the reference backend. Also GPU
  replicas that share a GPU (NCCL refuses that), staged through host memory.
- ``'nccl'``: GPU replicas, ``cupy.cuda.nccl`` (needs the ``cuda12``/``cuda13`` extra).
  With the test switch ``MGPU_TEST_NCCL_RANKS_ON_ONE_GPU=1`` (docs/gpu.md) also GPU
  replicas that share a GPU, each rank acting as a host of its own
  (:func:`~mgpu_updater.comm.nccl.act_as_own_host`): for testing the NCCL path on one GPU.
- ``'mpi'``: across hosts, on a ChainerMN communicator (needs the ``mpi`` extra).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Collection, Optional, Tuple

from .base import BufferSpec, Communicator

__all__ = ['Communicator', 'BufferSpec', 'create', 'attach', 'backend_for']


def backend_for(devices: list) -> str:
    """The local backend that fits these (already validated) Chainer devices.

    GPUs: NCCL, one GPU per replica. NCCL refuses two ranks on one GPU, so where a GPU is
    listed more than once, shared memory with device <-> host staging (``comm/staged.py``);
    NCCL anyway under the test switch (:func:`~mgpu_updater.comm.nccl.ranks_as_hosts`).
    """
    import numpy
    from .nccl import ranks_as_hosts
    if devices[0].xp is numpy:
        return 'shm'
    ids = [d.device.id for d in devices]
    return 'nccl' if len(set(ids)) == len(ids) or ranks_as_hosts() else 'shm'


def _gpu_id(device: Any) -> Any:
    """The CUDA device id of a Chainer device, or None for the CPU."""
    import numpy
    return None if device is None or device.xp is numpy else device.device.id


def create(name: str, size: int, spec: BufferSpec, device: Any,
           broadcast: Collection[str] = (),
           timeout: Optional[float] = None) -> Tuple[Communicator, Any]:
    """Create the master's (rank 0) communicator; returns it and the workers' handle.
    ``broadcast``: the buffers that are only ever broadcast (shm shares one slot; NCCL
    moves them as bytes, any dtype). ``timeout``: the bound on every host wait of a
    backend whose collectives run after the verb returned (NCCL), on every rank."""
    if name == 'shm':
        from .shm import ShmCommunicator
        comm = ShmCommunicator.create(size, spec, broadcast)
        handle = comm.handle
        if _gpu_id(device) is not None:
            from .staged import HostStagedCommunicator
            comm = _staged(HostStagedCommunicator, comm, spec, _gpu_id(device))
        return comm, handle
    if name == 'nccl':
        from .nccl import NcclCommunicator, NcclHandle, act_as_own_host, ranks_as_hosts
        as_hosts = ranks_as_hosts()
        if as_hosts:   # before our first NCCL call: the unique id
            act_as_own_host(0)
        unique_id = NcclCommunicator.new_unique_id()
        handle = NcclHandle(unique_id, size, spec, tuple(sorted(broadcast)), timeout,
                            os.getpid(), as_hosts)
        comm = NcclCommunicator(0, size, device.device.id, spec, unique_id, timeout=timeout,
                                broadcast=handle.broadcast)
        comm.handle = handle   # what rebuild() renews
        return comm, handle
    raise ValueError(f"unknown local communicator {name!r}; use 'shm' or 'nccl'")


def attach(name: str, handle: Any, rank: int, device: Any) -> Communicator:
    """A worker's communicator, from the handle the master created."""
    if name == 'shm':
        from .shm import ShmCommunicator
        comm = ShmCommunicator.attach(handle, rank)
        if _gpu_id(device) is not None:
            from .staged import HostStagedCommunicator
            comm = _staged(HostStagedCommunicator, comm, handle[1], _gpu_id(device))
        return comm
    if name == 'nccl':
        from .nccl import NcclCommunicator, act_as_own_host
        if handle.as_hosts:   # before this process's first NCCL call (its init)
            act_as_own_host(rank)
        check = None if handle.master_pid is None else _alive_check(handle.master_pid)
        return NcclCommunicator(rank, handle.size, device.device.id, handle.spec,
                                handle.unique_id, timeout=handle.timeout,
                                check_peer_alive=check, broadcast=handle.broadcast)
    raise ValueError(f"unknown local communicator {name!r}; use 'shm' or 'nccl'")


def _alive_check(pid: int) -> Callable[[], None]:
    """What a worker's communicator checks while it waits: that the master (``pid``) is
    still there (a worker's own watch ends it soon after, see ``_local/worker.py``; this
    makes the wait itself give up at once)."""
    def check() -> None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise RuntimeError(f'the master process (pid {pid}) is gone') from None
        except PermissionError:   # alive, another user's (cannot be the master): fine
            pass
    return check


def _staged(cls: Any, inner: Communicator, spec: BufferSpec, device_id: int) -> Communicator:
    try:
        return cls(inner, spec, device_id)
    except BaseException:
        inner.finalize()   # the master owns the segments: they go too
        raise

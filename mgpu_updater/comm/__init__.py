"""Communicator backends behind one interface, created by name.

- ``'shm'``: CPU replicas (``'@numpy'``), shared memory; the reference backend. Also GPU
  replicas that share a GPU (NCCL refuses that), staged through host memory.
- ``'nccl'``: GPU replicas, ``cupy.cuda.nccl`` (needs the ``cuda12``/``cuda13`` extra).
- ``'mpi'``: across hosts, on a ChainerMN communicator (needs the ``mpi`` extra).
"""
from __future__ import annotations

from typing import Any, Collection, Tuple

from .base import BufferSpec, Communicator

__all__ = ['Communicator', 'BufferSpec', 'create', 'attach', 'backend_for']


def backend_for(devices: list) -> str:
    """The local backend that fits these (already validated) Chainer devices.

    GPUs: NCCL, one GPU per replica. NCCL refuses two ranks on one GPU, so where a GPU is
    listed more than once, shared memory with device <-> host staging (``comm/staged.py``).
    """
    import numpy
    if devices[0].xp is numpy:
        return 'shm'
    ids = [d.device.id for d in devices]
    return 'nccl' if len(set(ids)) == len(ids) else 'shm'


def _gpu_id(device: Any) -> Any:
    """The CUDA device id of a Chainer device, or None for the CPU."""
    import numpy
    return None if device is None or device.xp is numpy else device.device.id


def create(name: str, size: int, spec: BufferSpec, device: Any,
           broadcast: Collection[str] = ()) -> Tuple[Communicator, Any]:
    """Create the master's (rank 0) communicator; returns it and the workers' handle.
    ``broadcast``: the buffers that are only ever broadcast (shm shares one slot)."""
    if name == 'shm':
        from .shm import ShmCommunicator
        comm = ShmCommunicator.create(size, spec, broadcast)
        handle = comm.handle
        if _gpu_id(device) is not None:
            from .staged import HostStagedCommunicator
            comm = _staged(HostStagedCommunicator, comm, spec, _gpu_id(device))
        return comm, handle
    if name == 'nccl':
        from .nccl import NcclCommunicator
        unique_id = NcclCommunicator.new_unique_id()
        comm = NcclCommunicator(0, size, device.device.id, spec, unique_id)
        return comm, (unique_id, size, spec)
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
        from .nccl import NcclCommunicator
        unique_id, size, spec = handle
        return NcclCommunicator(rank, size, device.device.id, spec, unique_id)
    raise ValueError(f"unknown local communicator {name!r}; use 'shm' or 'nccl'")


def _staged(cls: Any, inner: Communicator, spec: BufferSpec, device_id: int) -> Communicator:
    try:
        return cls(inner, spec, device_id)
    except BaseException:
        inner.finalize()   # the master owns the segments: they go too
        raise

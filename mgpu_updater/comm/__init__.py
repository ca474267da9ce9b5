"""Communicator backends behind one interface, created by name.

- ``'shm'``: CPU replicas (``'@numpy'``), shared memory; the reference backend.
- ``'nccl'``: GPU replicas, ``cupy.cuda.nccl`` (needs the ``cuda12``/``cuda13`` extra).
- ``'mpi'``: across hosts, on a ChainerMN communicator (needs the ``mpi`` extra).
"""
from __future__ import annotations

from typing import Any, Collection, Tuple

from .base import BufferSpec, Communicator

__all__ = ['Communicator', 'BufferSpec', 'create', 'attach', 'backend_for']


def backend_for(devices: list) -> str:
    """The local backend that fits these (already validated) Chainer devices."""
    import numpy
    return 'shm' if devices[0].xp is numpy else 'nccl'


def create(name: str, size: int, spec: BufferSpec, device: Any,
           broadcast: Collection[str] = ()) -> Tuple[Communicator, Any]:
    """Create the master's (rank 0) communicator; returns it and the workers' handle.
    ``broadcast``: the buffers that are only ever broadcast (shm shares one slot)."""
    if name == 'shm':
        from .shm import ShmCommunicator
        comm = ShmCommunicator.create(size, spec, broadcast)
        return comm, comm.handle
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
        return ShmCommunicator.attach(handle, rank)
    if name == 'nccl':
        from .nccl import NcclCommunicator
        unique_id, size, spec = handle
        return NcclCommunicator(rank, size, device.device.id, spec, unique_id)
    raise ValueError(f"unknown local communicator {name!r}; use 'shm' or 'nccl'")

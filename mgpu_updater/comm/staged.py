"""GPU replicas through the shared-memory backend: device buffers staged through host memory.

NCCL refuses two ranks on one GPU, so ``devices=['@cupy:0', '@cupy:0']`` (several replicas
on one GPU, each its own process) runs on :class:`~mgpu_updater.comm.shm.ShmCommunicator`
with this wrapper around it. Each rank's buffers live on its GPU (one CuPy array per name,
allocated once), where the replicas pack and unpack; every verb copies between those and
the rank's slot of the shared host segment:

- ``reduce``: each rank copies its buffer device -> host into its slot; the root then sums
  the slots on the host (the shared-memory reduce) and copies the sum host -> device.
- ``bcast``: the root copies device -> host into the one shared slot; every other rank
  copies that slot host -> device. (The shared-memory backend gives the buffers named
  broadcast-only at creation one shared slot, the others one slot per rank.)

Every copy is synchronous (``ndarray.get(out=...)`` and ``ndarray.set``, on the current
stream of the rank's device), so when a verb returns its data have left or reached GPU
memory, and the control-channel contract of :mod:`mgpu_updater.comm.base` holds as on
CPU. This is for exercising the multi-process GPU path on a one-GPU machine (CUDA in
spawned workers, GPU prefetch, gradients leaving GPU memory, BatchNorm statistics on
the GPU), not for speed: use one GPU per replica and NCCL for that.

CuPy is imported when a communicator is constructed, never when this module is imported.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from .. import _cuda
from .base import BufferSpec, Communicator, named_buffer
from .shm import ShmCommunicator

__all__ = ['HostStagedCommunicator']


class HostStagedCommunicator(Communicator):
    """``inner`` (shared host memory, laid out by ``spec``) behind buffers on CUDA device
    ``device_id``."""

    name = 'shm'

    def __init__(self, inner: ShmCommunicator, spec: BufferSpec, device_id: int) -> None:
        super().__init__(inner.rank, inner.size)
        self._inner = inner
        self.device_id = int(device_id)
        cupy = self._cupy = _cuda.import_cupy()
        self._device = cupy.cuda.Device(self.device_id)
        with self._device:
            self._buffers: Dict[str, Any] = {
                name: cupy.zeros(count, dtype=dtype) for name, (dtype, count) in spec.items()}

    @property
    def owned_segments(self) -> List[str]:
        return self._inner.owned_segments

    def watch_peers(self, check_alive: Callable[[], None]) -> None:
        self._inner.watch_peers(check_alive)

    rebuilds = True

    def rebuild(self) -> Any:
        return self._inner.rebuild()   # the host segments and their ledger are the inner's

    def begin_update(self) -> None:
        self._inner.begin_update()   # the shared-memory ledger checks the issue order

    def end_update(self) -> None:
        self._inner.end_update()

    def buffer(self, name: str) -> Any:
        self._check_open()
        return named_buffer(self._buffers, name)

    def reduce(self, name: str, root: int = 0) -> None:
        device_buffer, host = self.buffer(name), self._inner.buffer(name)
        with self._device:
            device_buffer.get(out=host)          # device -> this rank's host slot
            self._inner.reduce(name, root)       # the root sums the slots
            if self.rank == root:
                device_buffer.set(host)          # the sum back to the device

    def bcast(self, name: str, root: int = 0) -> None:
        device_buffer, host = self.buffer(name), self._inner.buffer(name)
        with self._device:
            if self.rank == root:
                device_buffer.get(out=host)      # into the one shared slot
            self._inner.bcast(name, root)
            if self.rank != root:
                device_buffer.set(host)          # the root's data onto this device

    def abort(self) -> None:
        self._finalized = True
        self._buffers = {}
        self._inner.abort()

    def finalize(self) -> None:
        if self._finalized:
            return
        self._finalized = True
        self._buffers = {}
        self._inner.finalize()

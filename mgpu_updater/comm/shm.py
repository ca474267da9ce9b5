"""Shared-memory CPU backend: the reference implementation of the interface.

Every buffer name gets one shared segment. A ``reduce`` buffer holds one slot per rank
(rank r writes slot r, the root sums the others into its own); a ``bcast`` buffer holds a
single slot that the root writes and everybody reads. The verbs copy nothing on non-root
ranks: the control channel orders them (see :mod:`mgpu_updater.comm.base`).

Segment names are random (128 bits) and the master alone owns them: it unlinks them in
:meth:`finalize`; a worker that sees the master die unlinks them too.
"""
from __future__ import annotations

import secrets
import sys
from multiprocessing import shared_memory
from typing import Dict, List, Tuple

import numpy

from .base import BufferSpec, Communicator, check_spec


def _open(name: str, size: int = 0, create: bool = False) -> shared_memory.SharedMemory:
    if create:
        return shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    # Before 3.13 attaching registers the name with the resource tracker again. Spawned
    # workers share the master's tracker, whose registry is a set: a no-op. (Unregistering
    # here would make the master's own unlink fail in the tracker.)
    return shared_memory.SharedMemory(name=name)


class ShmCommunicator(Communicator):
    """CPU replicas on one host, through ``multiprocessing.shared_memory``.

    Create it in the master with :meth:`create`, send :attr:`handle` to each worker, and
    attach there with :meth:`attach`. ``spec`` maps buffer names to (dtype, count); names
    starting with ``'param'`` are broadcast buffers, every other name is a reduce buffer.
    """

    name = 'shm'

    def __init__(self, rank: int, size: int, spec: BufferSpec,
                 segments: Dict[str, shared_memory.SharedMemory], owner: bool) -> None:
        super().__init__(rank, size)
        self._spec = spec
        self._segments = segments
        self._owner = owner
        self._slots: Dict[str, List[numpy.ndarray]] = {}
        for key, (dtype, count) in spec.items():
            n = 1 if self.is_bcast(key) else size
            whole = numpy.ndarray((n, count), dtype=dtype, buffer=segments[key].buf)
            self._slots[key] = [whole[i] for i in range(n)]

    @staticmethod
    def is_bcast(key: str) -> bool:
        return key.startswith('param')

    @classmethod
    def create(cls, size: int, spec: BufferSpec) -> 'ShmCommunicator':
        spec = check_spec(spec)
        segments = {}
        try:
            for key, (dtype, count) in spec.items():
                n = 1 if cls.is_bcast(key) else size
                nbytes = n * count * numpy.dtype(dtype).itemsize
                segments[key] = _open('mgpu_' + secrets.token_hex(16), nbytes, create=True)
        except BaseException:
            for seg in segments.values():
                seg.close()
                seg.unlink()
            raise
        return cls(0, size, spec, segments, owner=True)

    @property
    def handle(self) -> Tuple[int, BufferSpec, Dict[str, str]]:
        """What a worker needs to attach (picklable)."""
        return (self.size, self._spec, {k: s.name for k, s in self._segments.items()})

    @property
    def segment_names(self) -> List[str]:
        return [s.name for s in self._segments.values()]

    @classmethod
    def attach(cls, handle: Tuple[int, BufferSpec, Dict[str, str]], rank: int) -> 'ShmCommunicator':
        size, spec, names = handle
        segments = {}
        try:
            for key, name in names.items():
                segments[key] = _open(name)
        except BaseException:
            for seg in segments.values():
                seg.close()
            raise
        return cls(rank, size, spec, segments, owner=False)

    def buffer(self, name: str) -> numpy.ndarray:
        self._check_open()
        slots = self._slots[name]
        return slots[0] if len(slots) == 1 else slots[self.rank]

    def reduce(self, name: str, root: int = 0) -> None:
        self._check_open()
        if self.rank != root:
            return
        slots = self._slots[name]
        dst = slots[root]
        for r, src in enumerate(slots):
            if r != root:
                numpy.add(dst, src, out=dst)

    def bcast(self, name: str, root: int = 0) -> None:
        self._check_open()   # one shared slot: the root's write is everybody's read

    def finalize(self) -> None:
        if self._finalized:
            return
        self._finalized = True
        self._slots = {}
        for seg in self._segments.values():
            try:
                seg.close()
            except BufferError:  # a view is still alive somewhere; the unlink still works
                pass
            if self._owner:
                try:
                    seg.unlink()
                except FileNotFoundError:
                    pass
        self._segments = {}


def unlink_quietly(name: str) -> None:
    """Remove a segment by name, if it still exists; used by a worker whose master died.

    The name is also taken off the resource tracker the workers share with the master,
    so the tracker does not warn about (or unlink again) what was cleaned up here. The
    segment is never opened: opening would register it with the tracker once more.
    """
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister('/' + name, 'shared_memory')
    except Exception:  # noqa: BLE001 - no tracker (3.13+ untracked, or it is gone)
        pass
    try:
        shared_memory._posixshmem.shm_unlink('/' + name)  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass

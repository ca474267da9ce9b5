"""A stand-in for the few CuPy and NCCL calls of ``mgpu_updater._cuda`` and ``comm/nccl.py``.

It checks control flow on machines without a GPU: which calls happen, in which order, on
which stream, and what the lifecycle does. It proves nothing about CUDA itself; the tests
marked ``gpu`` do that. Arrays are numpy arrays with a CuPy-like ``.data``; events are done
unless the test sets ``fake.hang = True``; with one rank a collective leaves the buffer as
it is, which is what NCCL does too.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
import types
from typing import Any, List, Optional

import numpy

_ptrs = itertools.count(0x1000)


class _Pointer:
    def __init__(self, array: numpy.ndarray, log: List[Any]) -> None:
        self._array = array
        self._log = log
        self.ptr = array.ctypes.data

    def copy_from_host_async(self, mem: int, size: int, stream: Any = None) -> None:
        assert size <= self._array.nbytes
        ctypes.memmove(self.ptr, mem, size)
        self._log.append(('h2d', stream, size))


class _Pinned(bytearray):
    def size(self) -> int:
        return len(self)


def make(nccl_available: bool = True) -> types.SimpleNamespace:
    """A fresh fake ``cupy`` module; ``fake.cuda.nccl`` is the fake NCCL module."""
    log: List[Any] = []
    local = threading.local()
    fake = types.SimpleNamespace(log=log, hang=False, comms=[], pinned=[])

    class FakeArray(numpy.ndarray):
        @property
        def data(self) -> _Pointer:  # type: ignore[override]
            return _Pointer(self, log)

    def empty(shape: Any, dtype: Any = float) -> FakeArray:
        return numpy.empty(shape, dtype).view(FakeArray)

    def zeros(shape: Any, dtype: Any = float) -> FakeArray:
        return numpy.zeros(shape, dtype).view(FakeArray)

    class Device:
        def __init__(self, device_id: int = 0) -> None:
            self.id = device_id

        def __enter__(self) -> 'Device':
            self._previous = getattr(local, 'device', None)
            local.device = self.id
            return self

        def __exit__(self, *args: Any) -> None:
            local.device = self._previous

        def use(self) -> None:
            local.device = self.id

    class Stream:
        null: 'Stream'

        def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
            self.ptr = 0 if null else next(_ptrs)
            self.non_blocking = non_blocking
            self.device = getattr(local, 'device', None)

        def __enter__(self) -> 'Stream':
            self._previous = getattr(local, 'stream', None)
            local.stream = self
            return self

        def __exit__(self, *args: Any) -> None:
            local.stream = self._previous

        def wait_event(self, event: 'Event') -> None:
            log.append(('wait', self, event))

        def __repr__(self) -> str:
            return f'<Stream {self.ptr:#x}>'

    Stream.null = Stream(null=True)

    class Event:
        def __init__(self, disable_timing: bool = False) -> None:
            self.device = getattr(local, 'device', None)

        def record(self, stream: Optional[Stream] = None) -> None:
            log.append(('record', stream, self))

        @property
        def done(self) -> bool:
            return not fake.hang

        def synchronize(self) -> None:
            assert not fake.hang, 'would block forever'

    def get_current_stream() -> Stream:
        return getattr(local, 'stream', None) or Stream.null

    class NcclCommunicator:
        block: Optional[threading.Event] = None   # set by a test: init waits on it

        def __init__(self, ndev: int, comm_id: tuple, rank: int) -> None:
            if NcclCommunicator.block is not None:
                NcclCommunicator.block.wait(10)
            assert len(comm_id) == 128
            self.args = (ndev, comm_id, rank)
            self.device = getattr(local, 'device', None)
            self.calls: List[Any] = []
            self.async_error: Optional[str] = None
            fake.comms.append(self)

        def _call(self, *call: Any) -> None:
            self.calls.append(call)
            log.append(('nccl',) + call)

        def reduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                   root: int, stream: int) -> None:
            self._call('reduce', send, recv, count, dtype, op, root, stream)

        def bcast(self, buff: int, count: int, dtype: int, root: int, stream: int) -> None:
            self._call('bcast', buff, count, dtype, root, stream)

        def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                      stream: int) -> None:
            self._call('allReduce', send, recv, count, dtype, op, stream)

        def check_async_error(self) -> None:
            if self.async_error:
                raise RuntimeError(self.async_error)

        def abort(self) -> None:
            self.calls.append(('abort',))

        def destroy(self) -> None:
            self.calls.append(('destroy',))

    nccl = types.SimpleNamespace(
        available=nccl_available, NcclCommunicator=NcclCommunicator,
        get_unique_id=lambda: tuple(range(-64, 64)),
        NCCL_SUM=0, NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_UINT32=3, NCCL_INT64=4,
        NCCL_UINT64=5, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8)

    def alloc_pinned_memory(size: int) -> _Pinned:
        mem = _Pinned(size)
        fake.pinned.append(mem)
        return mem

    fake.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, Event=Event, get_current_stream=get_current_stream,
        alloc_pinned_memory=alloc_pinned_memory, nccl=nccl,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    fake.empty, fake.zeros, fake.FakeArray = empty, zeros, FakeArray
    return fake


def install(monkeypatch: Any, nccl_available: bool = True) -> types.SimpleNamespace:
    """Make ``mgpu_updater._cuda`` hand out a fresh fake instead of CuPy."""
    from mgpu_updater import _cuda
    fake = make(nccl_available)

    def import_nccl() -> Any:
        if not fake.cuda.nccl.available:
            raise ImportError(f'NCCL could not be loaded; {_cuda.NCCL_HINT}')
        return fake.cuda.nccl

    monkeypatch.setattr(_cuda, 'import_cupy', lambda: fake)
    monkeypatch.setattr(_cuda, 'import_nccl', import_nccl)
    return fake

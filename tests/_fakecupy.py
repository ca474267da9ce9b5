"""A stand-in for the few CuPy and NCCL calls of ``mgpu_updater._cuda`` and ``comm/nccl.py``.

It checks control flow on machines without a GPU: which calls happen, in which order, on
which stream, and what the lifecycle does. It proves nothing about CUDA itself; the tests
marked ``gpu`` do that. It models CuPy 14's API: the names, the parameter names and types,
and what needs no device (``nccl.get_unique_id()`` returns 128 ``bytes``;
``NcclCommunicator`` refuses anything else with CuPy's own error).
tests/test_fakecupy.py compares it with the real CuPy wherever CuPy >= 14 is installed. Arrays are numpy arrays with a CuPy-like ``.data``; events are done
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
UNIQUE_ID_BYTES = 128   # NCCL_UNIQUE_ID_BYTES
VERSION = '14.2.0'      # the CuPy release this stand-in models


class _Pointer:
    def __init__(self, array: numpy.ndarray, log: List[Any]) -> None:
        self._array = array
        self._log = log
        self.ptr = array.ctypes.data

    def copy_from_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
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
    fake = types.SimpleNamespace(__version__=VERSION, log=log, hang=False, comms=[],
                                 pinned=[])

    class FakeArray(numpy.ndarray):
        @property
        def data(self) -> _Pointer:  # type: ignore[override]
            return _Pointer(self, log)

        def get(self, stream: Any = None, order: str = 'C', out: Any = None,
                blocking: bool = True) -> numpy.ndarray:
            """Device -> host (a copy, or into ``out``)."""
            host = numpy.array(self, order=order).view(numpy.ndarray)
            if out is not None:
                assert out.shape == self.shape and out.dtype == self.dtype
                out[...] = host
                host = out
            log.append(('d2h', getattr(local, 'device', None), self.nbytes))
            return host

        def set(self, arr: Any, stream: Any = None) -> None:
            """Host -> device, in place."""
            assert arr.shape == self.shape and arr.dtype == self.dtype
            numpy.ndarray.__setitem__(self, Ellipsis, arr)
            log.append(('h2d', getattr(local, 'device', None), self.nbytes))

    def empty(shape: Any, dtype: Any = float, order: str = 'C') -> FakeArray:
        return numpy.empty(shape, dtype, order).view(FakeArray)

    def zeros(shape: Any, dtype: Any = float, order: str = 'C') -> FakeArray:
        return numpy.zeros(shape, dtype, order).view(FakeArray)

    class Device:
        def __init__(self, device: Optional[int] = None) -> None:
            self.id = 0 if device is None else device

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

        def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                     priority: Optional[int] = None) -> None:
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
        def __init__(self, block: bool = False, disable_timing: bool = False,
                     interprocess: bool = False) -> None:
            self.device = getattr(local, 'device', None)

        def record(self, stream: Optional[Stream] = None) -> None:
            log.append(('record', stream, self))

        @property
        def done(self) -> bool:
            return not fake.hang

        def synchronize(self) -> None:
            assert not fake.hang, 'would block forever'

    def get_current_stream(device_id: int = -1) -> Stream:
        return getattr(local, 'stream', None) or Stream.null

    class NcclCommunicator:
        """CuPy 14's ``NcclCommunicator(int ndev, bytes commId, int rank,
        NcclConfig config=None)``: the id must be exactly ``bytes`` of 128."""

        block: Optional[threading.Event] = None   # set by a test: init waits on it

        def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:
            if type(commId) is not bytes:   # Cython's typed argument: exact type, no None
                if commId is None:
                    raise TypeError("object of type 'NoneType' has no len()")
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, "
                                f"got {type(commId).__name__})")
            if len(commId) != UNIQUE_ID_BYTES:
                raise ValueError(f'commId length {len(commId)} != {UNIQUE_ID_BYTES}.')
            if NcclCommunicator.block is not None:
                NcclCommunicator.block.wait(10)
            self.args = (ndev, commId, rank)
            self.device = getattr(local, 'device', None)
            self.calls: List[Any] = []
            self.async_error: Optional[str] = None
            fake.comms.append(self)

        def _call(self, *call: Any) -> None:
            self.calls.append(call)
            log.append(('nccl',) + call)

        def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                   root: int, stream: int) -> None:
            self._call('reduce', sendbuf, recvbuf, count, datatype, op, root, stream)

        def bcast(self, buff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
            self._call('bcast', buff, count, datatype, root, stream)

        def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                      stream: int) -> None:
            self._call('allReduce', sendbuf, recvbuf, count, datatype, op, stream)

        def check_async_error(self) -> None:
            if self.async_error:
                raise RuntimeError(self.async_error)

        def abort(self) -> None:
            self.calls.append(('abort',))

        def destroy(self) -> None:
            self.calls.append(('destroy',))

    unique_ids = (bytes((i * 37 + n) % 256 for i in range(UNIQUE_ID_BYTES))
                  for n in itertools.count())

    def get_unique_id() -> bytes:
        """CuPy 14: the id as ``bytes`` of 128 (a tuple of ints before 14.0)."""
        return next(unique_ids)

    # the values are CuPy 14's (tests/test_fakecupy.py compares them)
    nccl = types.SimpleNamespace(
        available=nccl_available, NcclCommunicator=NcclCommunicator,
        get_unique_id=get_unique_id,
        NCCL_SUM=0, NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_UINT32=3, NCCL_INT64=4,
        NCCL_UINT64=5, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8)

    def getDeviceCount() -> int:
        return 1

    def alloc_pinned_memory(size: int) -> _Pinned:
        mem = _Pinned(size)
        fake.pinned.append(mem)
        return mem

    fake.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, Event=Event, get_current_stream=get_current_stream,
        alloc_pinned_memory=alloc_pinned_memory, nccl=nccl,
        runtime=types.SimpleNamespace(getDeviceCount=getDeviceCount))
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

"""A stand-in for the few CuPy and NCCL calls of ``mgpu_updater._cuda`` and ``comm/nccl.py``.

It checks control flow on machines without a GPU: which calls happen, in which order, on
which stream and with which device current, and what the lifecycle does. It proves nothing
about CUDA itself; the tests marked ``gpu`` do that. It models CuPy 14's API: the names,
the parameter names and types, and what needs no device (``nccl.get_unique_id()`` returns
128 ``bytes``; ``NcclCommunicator`` refuses anything else with CuPy's own error).
tests/test_fakecupy.py compares it with the real CuPy wherever CuPy >= 14 is installed.

What it models, beyond the names:

- Arrays are numpy arrays with a CuPy-like ``.data`` and ``.device``: the device current
  when they were made (a view keeps its base's). Every kernel on them (a ufunc, an
  assignment, ``fill``, ``copy``) is logged in ``fake.kernels`` with the device current at
  the launch and the current stream: CuPy launches on the *current* device's stream, also
  for arrays of another device (through peer access, with a warning), so
  ``fake.cross_device()`` lists the kernels that ran with another device current than
  their arrays'.
- The current stream is per thread and per device, as in CuPy (``with stream:`` makes it
  current for its own device).
- Streams, events and host reads: a collective of a connected world enqueued on a stream
  leaves a ticket there, done when the collective ran; ``Event.record`` captures the
  tickets the stream holds so far (its own and those of the events it waits for),
  ``Event.done`` says whether they are all done, and a host read (``ndarray.get``,
  ``Event.synchronize``) of work that never finishes raises :class:`HostReadBlocked`
  where CUDA would block for good. ``fake.hang = True``: everything queued on the GPU is
  stuck (a collective waiting for a dead peer): events stay undone and host reads raise.
  ``fake.pending_polls = n`` makes the next n ``done`` queries say no (work that is still
  running, then finishes; a host read waits it out).
- NCCL: unconnected (the default), a collective leaves the buffer as it is, which is what
  NCCL does with one rank. :func:`connect_ranks` makes the communicators of one unique id
  one world, with NCCL's rendezvous at creation (and its refusal of two ranks with the same
  ``NCCL_HOSTID`` and device: "Duplicate GPU detected"), its lazy connection (NCCL >=
  2.22: the first collective that needs a ring or a tree connects it, blocking on the host
  until every rank does the same), and data moving between the ranks.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
import types
from functools import reduce as fold
from typing import Any, Dict, List, Optional

import numpy

_ptrs = itertools.count(0x1000)
UNIQUE_ID_BYTES = 128   # NCCL_UNIQUE_ID_BYTES
VERSION = '14.2.0'      # the CuPy release this stand-in models
TIMEOUT = 60.0          # seconds a rank of a connected world waits for the others


class HostReadBlocked(AssertionError):
    """A host read of GPU work that never finishes: real CUDA would block here for good."""


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


# CuPy 14's NcclError texts: its name of the status, then NCCL's ncclGetErrorString
# (tests/test_fakecupy.py compares those of 5, duplicate GPU, and 6, a peer that died)
_NCCL_ERRORS = {
    1: ('NCCL_ERROR_UNHANDLED_CUDA_ERROR', 'unhandled cuda error (run with NCCL_DEBUG=INFO '
                                           'for details)'),
    2: ('NCCL_ERROR_SYSTEM_ERROR', 'unhandled system error (run with NCCL_DEBUG=INFO for '
                                   'details)'),
    3: ('NCCL_ERROR_INTERNAL_ERROR', 'internal error - please report this issue to the '
                                     'NCCL developers'),
    4: ('NCCL_ERROR_INVALID_ARGUMENT', 'invalid argument (run with NCCL_DEBUG=WARN for '
                                       'details)'),
    5: ('NCCL_ERROR_INVALID_USAGE', 'invalid usage (run with NCCL_DEBUG=WARN for details)'),
    6: ('NCCL_ERROR_REMOTE_ERROR', 'remote process exited or there was a network error')}


class NcclError(RuntimeError):
    """CuPy's ``nccl.NcclError(int status)``."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__('%s: %s' % _NCCL_ERRORS[status])


def _basic_key(key: Any) -> bool:
    """Whether an index is basic (ints, slices, Ellipsis, None): no index arrays."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, numpy.integer, slice))
               for k in parts)


def make(nccl_available: bool = True) -> types.SimpleNamespace:
    """A fresh fake ``cupy`` module; ``fake.cuda.nccl`` is the fake NCCL module."""
    log: List[Any] = []
    local = threading.local()   # .device: the current device; .streams: device -> stream
    fake = types.SimpleNamespace(__version__=VERSION, log=log, hang=False, comms=[],
                                 pinned=[], kernels=[], pending_polls=0,
                                 HostReadBlocked=HostReadBlocked)
    streams_by_ptr: Dict[int, Any] = {}

    def current_device() -> int:
        return getattr(local, 'device', 0)   # CUDA's default: device 0

    def current_streams() -> Dict[int, Any]:
        if not hasattr(local, 'streams'):
            local.streams = {}
        return local.streams

    def kernel(name: str, *arrays: Any) -> None:
        devices = tuple(a._device for a in arrays if isinstance(a, FakeArray))
        fake.kernels.append((name, current_device(), devices,
                             get_current_stream()))

    def cross_device() -> List[Any]:
        """The kernels launched with another device current than one of their arrays'."""
        return [k for k in fake.kernels if any(d != k[1] for d in k[2])]

    fake.cross_device = cross_device

    class FakeArray(numpy.ndarray):
        _device: int = 0

        def __array_finalize__(self, obj: Any) -> None:
            self._device = getattr(obj, '_device', current_device())

        @property
        def data(self) -> _Pointer:  # type: ignore[override]
            return _Pointer(self, log)

        @property
        def device(self) -> 'Device':  # type: ignore[override]
            return Device(self._device)

        def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
            out = kwargs.get('out') or ()
            kernel(ufunc.__name__, *inputs, *out)
            plain = tuple(x.view(numpy.ndarray) if isinstance(x, FakeArray) else x
                          for x in inputs)
            if out:
                kwargs['out'] = tuple(o.view(numpy.ndarray) if isinstance(o, FakeArray)
                                      else o for o in out)
            result = getattr(ufunc, method)(*plain, **kwargs)
            if out:
                return out[0] if len(out) == 1 else out
            if isinstance(result, numpy.ndarray):   # made on the current device
                result = result.view(FakeArray)
                result._device = current_device()
            return result

        def __setitem__(self, key: Any, value: Any) -> None:
            # CuPy: a host array assigned through basic indexing goes to ndarray.fill,
            # which takes scalars only (host data goes in with set() or cupy.asarray)
            if (isinstance(value, numpy.ndarray) and not isinstance(value, FakeArray)
                    and value.shape != () and _basic_key(key)):
                raise ValueError('non-scalar numpy.ndarray cannot be used for fill')
            kernel('copy', self, value)
            numpy.ndarray.__setitem__(self, key, value)

        def fill(self, value: Any) -> None:
            kernel('fill', self)
            numpy.ndarray.fill(self, value)

        def copy(self, order: str = 'C') -> 'FakeArray':  # type: ignore[override]
            kernel('copy', self)
            out = numpy.ndarray.copy(self, order).view(FakeArray)
            out._device = current_device()   # CuPy copies onto the current device
            return out

        def get(self, stream: Any = None, order: str = 'C', out: Any = None,
                blocking: bool = True) -> numpy.ndarray:
            """Device -> host (a copy, or into ``out``), after the work queued before it
            on the stream (default: the current one of the array's device)."""
            if stream is None:
                stream = get_current_stream(self._device)
            wait_host('ndarray.get()', stream.blockers())
            host = numpy.array(self, order=order).view(numpy.ndarray)
            if out is not None:
                assert out.shape == self.shape and out.dtype == self.dtype
                out[...] = host
                host = out
            log.append(('d2h', current_device(), self.nbytes))
            return host

        def set(self, arr: Any, stream: Any = None) -> None:
            """Host -> device, in place."""
            assert arr.shape == self.shape and arr.dtype == self.dtype
            numpy.ndarray.__setitem__(self, Ellipsis, arr)
            log.append(('h2d', current_device(), self.nbytes))

    def wait_host(what: str, blockers: List[threading.Event]) -> None:
        """A host wait for ``blockers`` (collectives' tickets): bounded here, where CUDA
        would wait for good."""
        if fake.hang:
            raise HostReadBlocked(f'{what} waits for GPU work that never finishes')
        for ticket in blockers:
            if not ticket.wait(TIMEOUT):
                raise HostReadBlocked(f'{what} waited {TIMEOUT:g} s for a collective that '
                                      'no peer completes')
        fake.pending_polls = 0

    def empty(shape: Any, dtype: Any = float, order: str = 'C') -> FakeArray:
        out = numpy.empty(shape, dtype, order).view(FakeArray)
        out._device = current_device()
        return out

    def zeros(shape: Any, dtype: Any = float, order: str = 'C') -> FakeArray:
        out = numpy.zeros(shape, dtype, order).view(FakeArray)
        out._device = current_device()
        return out

    class Device:
        def __init__(self, device: Optional[int] = None) -> None:
            self.id = current_device() if device is None else device
            self._stack: List[int] = []

        def __enter__(self) -> 'Device':
            self._stack.append(current_device())
            local.device = self.id
            return self

        def __exit__(self, *args: Any) -> None:
            local.device = self._stack.pop()

        def use(self) -> None:
            local.device = self.id

        def __repr__(self) -> str:
            return f'<CUDA Device {self.id}>'

    class Stream:
        null: 'Stream'

        def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                     priority: Optional[int] = None) -> None:
            self.ptr = 0 if null else next(_ptrs)
            self.non_blocking = non_blocking
            self.device = None if null else current_device()
            # the unfinished collectives that work queued here from now on waits for: its
            # own, and those of the events it was told to wait for
            self._tickets: List[threading.Event] = []
            self._previous: List[Any] = []
            streams_by_ptr[self.ptr] = self

        def __enter__(self) -> 'Stream':
            device = current_device() if self.device is None else self.device
            self._previous.append((device, current_streams().get(device)))
            current_streams()[device] = self
            return self

        def __exit__(self, *args: Any) -> None:
            device, previous = self._previous.pop()
            current_streams()[device] = previous

        def wait_event(self, event: 'Event') -> None:
            log.append(('wait', self, event))
            self._tickets.extend(event.blockers)

        def blockers(self) -> List[threading.Event]:
            """The unfinished collectives that work queued on this stream so far waits
            for."""
            self._tickets = [t for t in self._tickets if not t.is_set()]
            return list(self._tickets)

        def __repr__(self) -> str:
            return f'<Stream {self.ptr:#x}>'

    Stream.null = Stream(null=True)

    class Event:
        def __init__(self, block: bool = False, disable_timing: bool = False,
                     interprocess: bool = False) -> None:
            self.device = current_device()
            self.blockers: List[threading.Event] = []   # as of the last record

        def record(self, stream: Optional[Stream] = None) -> None:
            if stream is None:
                stream = get_current_stream()
            log.append(('record', stream, self))
            self.blockers = stream.blockers()

        @property
        def done(self) -> bool:
            if fake.hang:
                return False
            if fake.pending_polls > 0:
                fake.pending_polls -= 1
                return False
            return all(ticket.is_set() for ticket in self.blockers)

        def synchronize(self) -> None:
            wait_host('Event.synchronize()', self.blockers)

    def get_current_stream(device_id: int = -1) -> Stream:
        device = current_device() if device_id == -1 else device_id
        return current_streams().get(device) or Stream.null

    class NcclCommunicator:
        """CuPy 14's ``NcclCommunicator(int ndev, bytes commId, int rank,
        NcclConfig config=None)``: the id must be exactly ``bytes`` of 128."""

        block: Optional[threading.Event] = None   # set by a test: init waits on it
        abort_block: Optional[threading.Event] = None   # set by a test: abort waits on it

        def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:
            if type(commId) is not bytes:   # Cython's typed argument: exact type, no None
                if commId is None:
                    raise TypeError("object of type 'NoneType' has no len()")
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, "
                                f"got {type(commId).__name__})")
            if len(commId) != UNIQUE_ID_BYTES:
                raise ValueError(f'commId length {len(commId)} != {UNIQUE_ID_BYTES}.')
            self.host_id = os.environ.get('NCCL_HOSTID')   # NCCL reads it at init
            if NcclCommunicator.block is not None:
                NcclCommunicator.block.wait(10)
            self.args = (ndev, commId, rank)
            self.device = current_device()
            self.calls: List[Any] = []
            self.async_error: Optional[str] = None
            fake.comms.append(self)
            self._join()

        def _join(self) -> None:
            """NCCL's rendezvous (a connected world: :func:`connect_ranks`)."""

        def _call(self, *call: Any) -> None:
            if self.async_error:   # NCCL returns the error it holds to the next call
                raise NcclError(6)
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
            if NcclCommunicator.abort_block is not None:
                NcclCommunicator.abort_block.wait(10)

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
        get_unique_id=get_unique_id, NcclError=NcclError,
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
    fake.streams_by_ptr = streams_by_ptr
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


# ---------------------------------------------------------------- a world of NCCL ranks
# the NCCL algorithm a collective needs connected: bcast and reduce run on rings only; a
# small allReduce between ranks that look like separate hosts takes a tree
ALGORITHM = {'bcast': 'ring', 'reduce': 'ring', 'allReduce': 'tree'}


def connect_ranks(fake: types.SimpleNamespace, asynchronous: bool = False,
                  timeout: float = TIMEOUT) -> None:
    """Make the stand-in's NCCL communicators of one unique id one world of ranks (one
    thread each, in tests), with NCCL's rules:

    - creation is a rendezvous of every rank, which refuses two ranks on one device that
      share a host identity (``NCCL_HOSTID``, as each rank's environment had it when it
      created its communicator): ``NcclError`` "invalid usage", as NCCL's "Duplicate GPU
      detected";
    - the first collective that needs a ring (``bcast``, ``reduce``) or a tree
      (``allReduce``) connects it with a blocking exchange on the host: that call returns
      only once every rank has made a call that connects the same;
    - a collective moves data once every rank issued its own, rank 0 doing NCCL's work
      (sums in rank order, in the buffer's type); a rank that issues a different
      collective at the same position fails the check (NCCL would mix the buffers or
      hang). Synchronous (default): each call returns after that, as if the host waited.
      ``asynchronous``: a call returns once enqueued, like NCCL's, leaving a ticket on its
      stream, which the last rank's call completes; events and host reads see it. A rank
      whose communicator is aborted (ncclCommAbort) has its unfinished collectives end,
      their buffers as they are, and its stream goes on; the other ranks' stay stuck
      until they abort theirs.

    A wait that no rank ends fails after ``timeout`` seconds instead of hanging.
    """
    base = fake.cuda.nccl.NcclCommunicator
    types_by_code = {getattr(fake.cuda.nccl, f'NCCL_{n.upper()}'): numpy.dtype(n)
                     for n in ('int8', 'uint8', 'int32', 'uint32', 'int64', 'uint64',
                               'float16', 'float32', 'float64')}
    worlds: Dict[bytes, Any] = {}
    lock = threading.Lock()

    def world_of(size: int, unique_id: bytes) -> Any:
        with lock:
            return worlds.setdefault(unique_id, types.SimpleNamespace(
                size=size, members={}, joined=threading.Barrier(size, timeout=timeout),
                connect={algo: threading.Barrier(size, timeout=timeout)
                         for algo in set(ALGORITHM.values())},
                calls={}, tickets={}, lock=threading.Lock(),
                data=threading.Barrier(size, timeout=timeout)))

    def view(ptr: int, count: int, code: int) -> numpy.ndarray:
        dtype = types_by_code[code]
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
        return numpy.ctypeslib.as_array(raw).view(numpy.uint8).view(dtype)

    def wait(barrier: threading.Barrier, what: str) -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f'{what}: not every rank came within {timeout:g} s; real '
                               'NCCL would wait here for good') from None

    class Connected(base):
        def _join(self) -> None:
            size, unique_id, rank = self.args
            self.world = world = world_of(size, unique_id)
            self.connected: set = set()
            self.issued = 0
            self.pending: List[threading.Event] = []   # its tickets, for abort
            world.members[rank] = self
            wait(world.joined, f'rank {rank}: NCCL initialisation')
            for other, comm in world.members.items():
                if other != rank and (comm.host_id, comm.device) == (self.host_id,
                                                                     self.device):
                    # NCCL: "Duplicate GPU detected : rank %d and rank %d both on CUDA
                    # device %x", then ncclInvalidUsage
                    raise NcclError(5)

        def _call(self, *call: Any) -> None:
            super()._call(*call)
            size, _, rank = self.args
            world, verb = self.world, call[0]
            algo = ALGORITHM[verb]
            if algo not in self.connected:   # lazy connection, blocking on the host
                wait(world.connect[algo], f'rank {rank}: the first {verb} connects the '
                                          f'{algo}s')
                self.connected.add(algo)
            position, self.issued = self.issued, self.issued + 1
            if not asynchronous:
                world.calls.setdefault(position, {})[rank] = call
                wait(world.data, f'rank {rank}: {verb}')
                if rank == 0:
                    try:
                        execute([world.calls[position][r] for r in range(size)])
                    except BaseException:
                        world.data.abort()   # the others fail now, not at the time-out
                        raise
                wait(world.data, f'rank {rank}: {verb}')
                return
            with world.lock:
                ticket = world.tickets.setdefault(position, {})[rank] = threading.Event()
                calls = world.calls.setdefault(position, {})
                calls[rank] = call
                complete = len(calls) == size
            self.pending.append(ticket)
            fake.streams_by_ptr[call[-1]]._tickets.append(ticket)
            if complete:
                execute([calls[r] for r in range(size)])
                for each in world.tickets[position].values():
                    each.set()

        def abort(self) -> None:
            super().abort()
            for ticket in self.pending:   # ncclCommAbort ends this rank's kernels
                ticket.set()

    def execute(calls: List[tuple]) -> None:
        verb = calls[0][0]
        shape = [(c[0],) + tuple(c[3:5] if c[0] != 'bcast' else c[2:4]) for c in calls]
        assert all(s == shape[0] for s in shape), f'the ranks issued different collectives: ' \
                                                  f'{calls}'
        if verb == 'bcast':
            _, _, count, code, root, _ = calls[0]
            src = view(calls[root][1], count, code).copy()
            for c in calls:
                view(c[1], count, code)[...] = src
            return
        count, code = calls[0][3], calls[0][4]
        total = fold(numpy.add, [view(c[1], count, code).copy() for c in calls])
        if verb == 'reduce':
            root = calls[0][6]
            view(calls[root][2], count, code)[...] = total
        else:   # allReduce
            for c in calls:
                view(c[2], count, code)[...] = total

    fake.cuda.nccl.NcclCommunicator = Connected

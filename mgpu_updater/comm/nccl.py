"""The NCCL backend: one process per GPU, named flat buffers on the device.

CuPy is imported when a communicator is constructed, never when this module is imported.

Sync points, in plain words:

- A verb (``reduce``, ``bcast``, ``allreduce``) *enqueues* its collective and returns; the
  host does not wait. The collective runs on the communicator's own non-blocking stream,
  after all the work the caller had enqueued on its current (compute) stream, and the
  compute stream's later work waits for it. So ``pack -> reduce -> unpack`` on the compute
  stream is correct with no host synchronisation, and the control-channel contract of
  :mod:`mgpu_updater.comm.base` holds: a worker that has enqueued its ``reduce`` may tell
  the master it is done, and the master then enqueues the matching ``reduce``.
- The host waits in :meth:`NcclCommunicator.init` (NCCL's rendezvous of all ranks, then a
  warm-up of every verb), :meth:`~NcclCommunicator.wait`, :meth:`~NcclCommunicator.drain`
  and :meth:`~NcclCommunicator.finalize`, nowhere else. Each wait polls instead of blocking
  in the driver, calls ``check_peer_alive`` between polls and honours ``timeout``; when a
  peer is dead or the time is up it aborts the communicator (itself bounded: NCCL may hang
  in ``ncclCommAbort`` when one rank of a host aborts alone), so that stuck NCCL kernels
  end, then raises.
- Reading a result on the host (``buffer.get()``, ``float(loss)``, a hook of the optimizer,
  an extension) blocks in the driver until every collective the compute stream waits for
  is done, without a bound: a peer that died leaves it there for good, where Ctrl-C cannot
  reach. So call :meth:`~NcclCommunicator.wait` first (the master's group does, before
  its window's values are read and before the optimizer step). And send the control
  message that lets the peers reach the matching collective *before* any such host read:
  a worker that enqueued ``reduce`` and then reads its loss on the host waits for the
  master's ``reduce``, which waits for that worker's message. Read reported values before
  the verb, or after the message.
- NCCL pairs collectives by their order: every rank calls the same verbs on the same
  buffers in the same order. NCCL >= 2.22 connects its rings and trees lazily, inside the
  first collective that needs them, with a blocking exchange between the ranks on the
  host: so :meth:`~NcclCommunicator.init` warms up every verb while every rank is there,
  and no verb of an update blocks its caller waiting for a peer that waits for a message.
- Sums: float16 buffers are summed in float32 (a float32 copy on the device, cast back
  after the collective), as Chainer's ``MultiprocessParallelUpdater`` does: N float16
  gradients neither lose their low bits nor overflow half-way through NCCL's ring. A
  buffer that is only ever broadcast (``broadcast``) may have any dtype: ``bcast`` moves
  bytes, as the MPI backend does (bool, int16 and uint16 persistents, which NCCL cannot
  sum).
- Each rank runs on its own GPU: NCCL refuses two ranks on one device, unless they look
  like two hosts (:func:`act_as_own_host`, a test mode; see docs/gpu.md).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Collection, Dict, NamedTuple, Optional, Tuple

import numpy

from .. import _cuda
from .base import BufferSpec, Communicator, PeerFailure, check_spec, named_buffer
from .._warning import warn

__all__ = ['NcclCommunicator', 'NcclHandle', 'act_as_own_host', 'ranks_as_hosts']

# numpy dtype name -> name of the NCCL data type constant in cupy.cuda.nccl
_NCCL_TYPES = {
    'int8': 'NCCL_INT8', 'uint8': 'NCCL_UINT8',
    'int32': 'NCCL_INT32', 'uint32': 'NCCL_UINT32',
    'int64': 'NCCL_INT64', 'uint64': 'NCCL_UINT64',
    'float16': 'NCCL_FLOAT16', 'float32': 'NCCL_FLOAT32', 'float64': 'NCCL_FLOAT64',
}
_UNIQUE_ID_BYTES = 128
_FINALIZE_TIMEOUT = 60.0   # bound on finalize's waits when no timeout was given
_ABORT_TIMEOUT = 5.0       # bound on ncclCommAbort (it may hang)
_PEER_GRACE = 2.0          # seconds an NCCL error waits for the peer check to name a death

#: The test mode (docs/gpu.md, "Several NCCL ranks on one GPU"): set to 1, the local NCCL
#: backend also takes a GPU listed several times, each rank acting as a host of its own.
#: For testing the NCCL path on a machine with one GPU; not a way to train.
TEST_SWITCH = 'MGPU_TEST_NCCL_RANKS_ON_ONE_GPU'


def ranks_as_hosts() -> bool:
    """Whether the test mode is on (:data:`TEST_SWITCH` set, not to ``0``)."""
    return os.environ.get(TEST_SWITCH, '') not in ('', '0')


def act_as_own_host(rank: int) -> None:
    """Make this process look to NCCL like a host of its own: its own ``NCCL_HOSTID``
    (NCCL hashes it into the host identity it compares, once per process, at the first
    communicator), and sockets on the loopback interface between the "hosts" (NCCL's
    socket transport; InfiniBand off). NCCL's duplicate-GPU check then passes for ranks
    that share a GPU. Call it before the process's first NCCL call (the master: before
    the unique id; a worker: before its ``init``). The test mode only."""
    os.environ['NCCL_HOSTID'] = f'mgpu-test-rank-{int(rank)}'
    os.environ.setdefault('NCCL_SOCKET_IFNAME', 'lo')
    os.environ.setdefault('NCCL_IB_DISABLE', '1')


class NcclHandle(NamedTuple):
    """What a worker needs to join the master's communicator (it travels pickled)."""
    unique_id: bytes                 # the master's new_unique_id()
    size: int
    spec: Dict[str, Tuple[str, int]]
    broadcast: Tuple[str, ...] = ()  # the buffers only ever broadcast
    timeout: Optional[float] = None  # the bound on every host wait (start_timeout)
    master_pid: Optional[int] = None # watched while a worker waits
    as_hosts: bool = False           # the test mode: each rank acts as its own host


def nccl_type_name(dtype: Any) -> str:
    """Name of the NCCL data type for ``dtype``; TypeError when NCCL has none."""
    dt = numpy.dtype(dtype)
    name = _NCCL_TYPES.get(dt.name)
    if name is None or dt.byteorder not in '=|':
        raise TypeError(
            f'the nccl communicator cannot sum {dt.str} ({dt.name}) buffers; NCCL supports '
            f'{", ".join(sorted(_NCCL_TYPES))} in native byte order')
    return name


def check_unique_id(unique_id: Any, what: str = 'unique_id') -> None:
    """Raise unless ``unique_id`` is an NCCL unique id as CuPy >= 14 takes it: exactly
    ``bytes`` (not a subclass, bytearray or tuple), 128 of them."""
    if type(unique_id) is not bytes:
        raise TypeError(
            f'{what} must be the {_UNIQUE_ID_BYTES} bytes that '
            f'NcclCommunicator.new_unique_id() returned on the master, not a '
            f'{type(unique_id).__name__} ({_short(unique_id)}); CuPy >= 14 takes bytes only')
    if len(unique_id) != _UNIQUE_ID_BYTES:
        raise ValueError(
            f'{what} must be the {_UNIQUE_ID_BYTES} bytes that '
            f'NcclCommunicator.new_unique_id() returned on the master, got '
            f'{len(unique_id)} bytes ({_short(unique_id)})')


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + '...'


class NcclCommunicator(Communicator):
    """NCCL collectives on one GPU per process (see the module docstring for the sync points).

    Args:
        rank: this process's rank; rank 0 is the master.
        size: the number of ranks (processes, GPUs).
        device_id: the CUDA device of this rank.
        spec: buffer name -> (dtype, element count); identical on every rank. Each buffer
            is one CuPy array on ``device_id``, allocated here, once.
        unique_id: :meth:`new_unique_id` of the master (128 ``bytes``), the same on every
            rank. It stays ``bytes`` end to end: CuPy 14's ``NcclCommunicator`` takes
            nothing else.
        timeout: seconds any host wait may take (None: no limit, but ``check_peer_alive``
            still runs).
        check_peer_alive: called while the host waits; raises (any exception) when a peer
            process died. The exception propagates after the communicator is aborted.
        broadcast: the buffers that are only ever broadcast: any dtype (they move as
            bytes); every other buffer must be of a type NCCL can sum.

    The NCCL communicator itself is created lazily, by :meth:`init` or the first verb,
    with ``device_id`` current, as ChainerMN's ``PureNcclCommunicator`` does.
    """

    name = 'nccl'

    def __init__(self, rank: int, size: int, device_id: int, spec: BufferSpec,
                 unique_id: bytes, *, timeout: Optional[float] = None,
                 check_peer_alive: Optional[Callable[[], None]] = None,
                 broadcast: Collection[str] = ()) -> None:
        super().__init__(rank, size)
        self._finalized = True   # until fully constructed: finalize() has nothing to do
        if not 0 <= rank < size:
            raise ValueError(f'rank {rank} is not in [0, {size})')
        check_unique_id(unique_id)
        self._spec = check_spec(spec)
        self._broadcast_only = frozenset(broadcast) & set(self._spec)
        self._type_names = {k: nccl_type_name(dt) for k, (dt, _) in self._spec.items()
                            if k not in self._broadcast_only}
        self._unique_id = unique_id
        self.device_id = int(device_id)
        self.timeout = timeout
        self.check_peer_alive = check_peer_alive

        cupy = self._cupy = _cuda.import_cupy()
        nccl = self._nccl = _cuda.import_nccl()
        self._types = {k: getattr(nccl, v) for k, v in self._type_names.items()}
        self._device = cupy.cuda.Device(self.device_id)
        with self._device:
            self._buffers = {k: cupy.zeros(n, dtype=dt) for k, (dt, n) in self._spec.items()}
            # float16 sums go through float32 (see the module docstring)
            self._wide = {k: cupy.zeros(n, dtype=numpy.float32)
                          for k, (dt, n) in self._spec.items()
                          if k in self._type_names and numpy.dtype(dt) == numpy.float16}
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._ready = cupy.cuda.Event(disable_timing=True)
            self._done = cupy.cuda.Event(disable_timing=True)
        self._comm: Any = None
        self._lock = threading.Lock()
        self._pending_init: Optional[Dict[str, Any]] = None
        #: a peer died and this rank gave up its collectives (:meth:`abandon`): no
        #: collective until :meth:`rebuild` or :meth:`rejoin`
        self._abandoned = False
        #: what a worker joins with (the master's, set by ``comm.create``), for rebuild()
        self.handle: Optional[NcclHandle] = None
        self._finalized = False

    # -- set-up -------------------------------------------------------------------------

    @classmethod
    def new_unique_id(cls) -> bytes:
        """A fresh NCCL unique id (128 ``bytes``), made once on the master.

        Pass it unchanged to every rank (through the spawn arguments; bytes pickle as
        they are).
        """
        unique_id = _cuda.import_nccl().get_unique_id()
        check_unique_id(unique_id, 'cupy.cuda.nccl.get_unique_id() returned')
        return unique_id

    @property
    def stream(self) -> Any:
        """The non-blocking CUDA stream the collectives run on."""
        return self._stream

    @property
    def initialized(self) -> bool:
        return self._comm is not None

    def init(self, timeout: Optional[float] = None) -> None:
        """Join NCCL's rendezvous of all ranks, then warm up every verb (``allReduce``,
        ``reduce``, ``bcast``), so that NCCL connects what each needs while every rank is
        here (see the module docstring).

        Call it on every rank during the start-up handshake; otherwise the first verb calls
        it. Blocks until every rank has joined and the warm-up is done: bounded by
        ``timeout`` (default: the constructor's) and watched by ``check_peer_alive``.
        """
        self._check_open()
        if self._comm is not None:
            return
        self._check_not_abandoned()
        timeout = self.timeout if timeout is None else timeout
        comm = self._create_comm(timeout)
        with self._lock:
            aborted = self._finalized or self._abandoned   # from another thread meanwhile
            if not aborted:
                self._comm = comm
        if aborted:
            _bounded(comm.abort, _ABORT_TIMEOUT, f'ncclCommAbort on rank {self.rank}')
            self._check_open()
        self._warm_up(timeout)

    def _create_comm(self, timeout: Optional[float]) -> Any:
        # ncclCommInitRank blocks until every rank joined and cannot be interrupted, so it
        # runs in a daemon thread (CuPy releases the GIL inside) while this thread watches.
        state: Dict[str, Any] = {'abandoned': False}
        lock = self._lock

        def target() -> None:
            try:
                with self._cupy.cuda.Device(self.device_id):
                    comm = self._nccl.NcclCommunicator(self.size, self._unique_id, self.rank)
            except BaseException as e:  # handed to the waiting thread
                state['error'] = e
                return
            with lock:
                abandoned = state['abandoned']
                if not abandoned:
                    state['comm'] = comm
            if abandoned:   # nobody will use it; do not leave it half-open
                _bounded(comm.abort, _ABORT_TIMEOUT, f'ncclCommAbort on rank {self.rank}')

        thread = threading.Thread(
            target=target, name=f'nccl-init-rank{self.rank}', daemon=True)
        self._pending_init = state
        thread.start()
        try:
            self._bounded_join(thread, 'NCCL initialisation (every rank must call init)',
                               timeout)
        except BaseException:
            with lock:
                state['abandoned'] = True
                comm = state.pop('comm', None)
            if comm is not None:
                _bounded(comm.abort, _ABORT_TIMEOUT, f'ncclCommAbort on rank {self.rank}')
            self._finalized = True
            raise
        finally:
            self._pending_init = None
        if 'error' in state:
            self._finalized = True
            raise RuntimeError(
                f'NCCL initialisation failed on rank {self.rank} (device {self.device_id}): '
                f'{state["error"]}') from state['error']
        if 'comm' not in state:   # abort() was called meanwhile
            raise RuntimeError(f'the nccl communicator of rank {self.rank} was aborted '
                               'during its initialisation')
        return state['comm']

    def _bounded_join(self, thread: threading.Thread, what: str,
                      timeout: Optional[float]) -> None:
        start = time.monotonic()
        while thread.is_alive():
            thread.join(0.05)
            if not thread.is_alive():
                break
            if self.check_peer_alive is not None:
                self.check_peer_alive()
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f'{what} did not finish within {timeout:g} s '
                                   f'on rank {self.rank}')

    def _warm_up(self, timeout: Optional[float]) -> None:
        """One tiny collective of each verb, in the same order on every rank: NCCL
        connects the rings (``reduce``, ``bcast``) and trees (``allReduce``) each uses,
        here, while every rank is in its ``init``."""
        nccl = self._nccl
        with self._device:
            scratch = self._cupy.zeros(1, dtype=numpy.float32)
            for verb, call in (
                    ('allReduce', lambda comm, ptr, n, t, s: comm.allReduce(
                        ptr, ptr, n, t, nccl.NCCL_SUM, s)),
                    ('reduce', lambda comm, ptr, n, t, s: comm.reduce(
                        ptr, ptr, n, t, nccl.NCCL_SUM, 0, s)),
                    ('bcast', lambda comm, ptr, n, t, s: comm.bcast(ptr, n, t, 0, s))):
                self._enqueue(f'warm-up {verb}', scratch, nccl.NCCL_FLOAT32, call)
        self.wait(timeout)

    # -- verbs --------------------------------------------------------------------------

    def buffer(self, name: str) -> Any:
        self._check_open()
        return named_buffer(self._buffers, name)

    def reduce(self, name: str, root: int = 0) -> None:
        self._check_root(root)
        self._sum('reduce', name, root == self.rank, lambda comm, ptr, n, t, s: comm.reduce(
            ptr, ptr, n, t, self._nccl.NCCL_SUM, root, s))

    def bcast(self, name: str, root: int = 0) -> None:
        """The root's bytes to every rank (any dtype: NCCL moves them as ``uint8``)."""
        self._check_root(root)
        array = self.buffer(name)
        self.init()
        with self._device:
            self._enqueue('bcast', array.view(numpy.uint8), self._nccl.NCCL_UINT8,
                          lambda comm, ptr, n, t, s: comm.bcast(ptr, n, t, root, s), name)

    def allreduce(self, name: str) -> None:
        self._sum('allreduce', name, True, lambda comm, ptr, n, t, s: comm.allReduce(
            ptr, ptr, n, t, self._nccl.NCCL_SUM, s))

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f'root {root} is not a rank in [0, {self.size})')

    def _sum(self, verb: str, name: str, receives: bool, call: Callable[..., None]) -> None:
        """A summing verb on ``name``; ``receives``: whether this rank gets the sum."""
        array = self.buffer(name)
        if name in self._broadcast_only:
            raise TypeError(
                f'buffer {name!r} was created broadcast-only (its dtype '
                f'{numpy.dtype(self._spec[name][0]).name} moves as bytes): it cannot be '
                f'{verb}d; create it without broadcast= to sum it')
        self.init()
        wide = self._wide.get(name)
        with self._device:
            if wide is None:
                self._enqueue(verb, array, self._types[name], call, name)
                return
            # float16: summed in float32; both casts on the compute stream, ordered with
            # the collective by the events of _enqueue
            wide[...] = array
            self._enqueue(verb, wide, self._nccl.NCCL_FLOAT32, call, name)
            if receives:
                array[...] = wide

    def _enqueue(self, verb: str, array: Any, nccl_type: int, call: Callable[..., None],
                 name: str = '') -> None:
        """Run ``call(comm, ptr, count, type, stream)`` on our stream, ordered with the
        compute stream both ways. The caller holds the device."""
        comm = self._comm
        if array.size == 0:
            return
        compute = self._cupy.cuda.get_current_stream()
        self._ready.record(compute)
        self._stream.wait_event(self._ready)
        try:
            if comm is None:   # abort() or abandon() from another thread
                self._check_open()
                self._check_not_abandoned()
            call(comm, array.data.ptr, array.size, nccl_type, self._stream.ptr)
        except Exception as e:
            what = f'NCCL {verb}{f" of {name!r}" if name else ""}'
            if self._finalized or self._abandoned:
                raise RuntimeError(f'{what} on rank {self.rank}: the communicator was '
                                   f'aborted or finalized meanwhile ({e})') from e
            # NCCL hands an asynchronous error it holds (a dead peer's closed sockets) to
            # the next collective enqueued: a dead peer is named as in a wait
            self._name_a_dead_peer()
            raise RuntimeError(
                f'{what} failed on rank {self.rank} (device {self.device_id}): {e}') from e
        self._done.record(self._stream)
        compute.wait_event(self._done)

    # -- waiting ------------------------------------------------------------------------

    def poll(self) -> bool:
        """Non-blocking: True once every collective enqueued so far has finished.

        Raises RuntimeError when NCCL reported an asynchronous error (a peer failed or the
        network broke); abort the communicator then.
        """
        self._check_open()
        if self._comm is None:
            return True
        self._check_async_error()
        return bool(self._done.done)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block the host until every collective enqueued so far has finished.

        Polls, runs ``check_peer_alive`` and NCCL's asynchronous error check meanwhile, and
        gives up after ``timeout`` (default: the constructor's). On any failure the
        communicator is abandoned (:meth:`abandon`: ncclCommAbort, which ends the stuck
        collectives) before the exception propagates.
        """
        self._check_open()
        if self._comm is None:
            return
        timeout = self.timeout if timeout is None else timeout
        try:
            _cuda.wait_event(self._done, timeout=timeout, check=self._check_during_wait,
                             what=f'NCCL collectives on rank {self.rank}')
            self._check_async_error()
        except BaseException:
            self.abandon()
            raise

    def drain(self) -> None:
        """Wait (bounded: ``timeout``, or 60 s) for the collectives in flight, before the
        peers are told to stop: so that none of them leaves while a collective of ours
        still needs it (over a network transport a rank's part can be done before its data
        left). Never raises for a communication failure (it runs at teardown): it warns,
        and the communicator is aborted."""
        if self._finalized or self._comm is None:
            return
        try:
            self.wait(self.timeout if self.timeout is not None else _FINALIZE_TIMEOUT)
        except Exception as e:  # wait() has abandoned the communicator
            warn(f'the collectives in flight on rank {self.rank} did not finish '
                 f'before the other ranks were stopped; the nccl communicator was '
                 f'aborted: {e}', RuntimeWarning)

    def _check_during_wait(self) -> None:
        """A dead peer raises what ``check_peer_alive`` raises (it names the peer); an
        error NCCL reports first (a dead peer's sockets close at once) waits a moment
        for that check to see the death, then raises."""
        if self.check_peer_alive is not None:
            self.check_peer_alive()
        try:
            self._check_async_error()
        except RuntimeError:
            self._name_a_dead_peer()
            raise

    def _name_a_dead_peer(self) -> None:
        """After an NCCL error: ``check_peer_alive``, which raises naming a dead peer,
        for up to :data:`_PEER_GRACE` seconds, since the peer's death may be seen a
        moment after NCCL saw its sockets close; returns where no peer died."""
        deadline = time.monotonic() + _PEER_GRACE
        while self.check_peer_alive is not None and time.monotonic() < deadline:
            self.check_peer_alive()
            time.sleep(0.05)

    def _check_async_error(self) -> None:
        comm = self._comm
        if comm is None:
            return
        try:
            comm.check_async_error()
        except Exception as e:
            raise PeerFailure(
                f'NCCL reported an asynchronous error on rank {self.rank} '
                f'(device {self.device_id}): {e}') from e

    # -- a rank replaced (max_worker_restarts) ------------------------------------------

    rebuilds = True
    rejoins = True

    def abandon(self) -> None:
        """A peer died: ncclCommAbort (bounded, as in :meth:`abort`), which ends the
        collectives stuck waiting for it, so that the streams that wait for them go on
        (what those collectives left in the buffers is undefined). The buffers stay; no
        collective can be issued until :meth:`rebuild` or :meth:`rejoin` gives this rank
        a new NCCL communicator: a dead rank leaves NCCL's for good."""
        with self._lock:
            comm, self._comm = self._comm, None
            self._abandoned = True
            if self._pending_init is not None:
                self._pending_init['abandoned'] = True
        if comm is not None:
            _bounded(comm.abort, _ABORT_TIMEOUT, f'ncclCommAbort on rank {self.rank}')

    def rebuild(self) -> 'NcclHandle':
        """The master's part: abandon the NCCL communicator (if not yet), make a fresh
        unique id and return the handle with it, which new ranks attach with and every
        surviving rank rejoins with (:meth:`rejoin`); the master joins with :meth:`init`
        while they do (NCCL's rendezvous needs every rank at once)."""
        self._check_open()
        if self.rank != 0 or self.handle is None:
            raise RuntimeError("rebuild() is the master's (rank 0, made by comm.create)")
        self.abandon()
        unique_id = self.new_unique_id()
        self.handle = self.handle._replace(unique_id=unique_id)
        self._renew(unique_id)
        return self.handle

    def rejoin(self, handle: 'NcclHandle') -> None:
        """A surviving worker's part: abandon the NCCL communicator (if not yet) and
        join the one of ``handle``'s unique id, with every other rank (:meth:`init`)."""
        self._check_open()
        check_unique_id(handle.unique_id, 'the rebuilt handle\'s unique_id')
        self.abandon()
        self._renew(handle.unique_id)
        self.init()

    def _renew(self, unique_id: bytes) -> None:
        with self._lock:
            self._unique_id = unique_id
            self._abandoned = False

    def _check_not_abandoned(self) -> None:
        if self._abandoned:
            raise RuntimeError(
                f'the nccl communicator of rank {self.rank} was abandoned after a peer '
                'failed; it takes no collective until rebuild() (the master) or rejoin() '
                '(a worker) gives it a new NCCL communicator')

    # -- shutdown -----------------------------------------------------------------------

    def abort(self) -> None:
        """Give up at once (a peer died): ncclCommAbort, which ends stuck collectives.

        Returns within about 5 s whatever NCCL does (it may hang in ncclCommAbort when
        one rank of a host aborts alone: then the call is left to process exit, with a
        warning); the communicator is finalized afterwards. The device buffers stay
        allocated until this object is dropped.
        """
        with self._lock:
            self._finalized = True
        self.abandon()

    def finalize(self) -> None:
        """Wait (bounded) for the collectives in flight, destroy the NCCL communicator,
        release the buffers. Safe to call twice and after :meth:`abort`.

        It does not raise for communication failures, since it runs during clean-up after
        errors too: when the wait fails or times out, it warns and aborts instead.
        """
        if self._finalized:
            return
        comm = self._comm
        if comm is not None:
            timeout = self.timeout if self.timeout is not None else _FINALIZE_TIMEOUT
            try:
                self.wait(timeout)
            except BaseException as e:  # wait() has abandoned the communicator
                warn(f'the nccl communicator of rank {self.rank} was aborted '
                     f'instead of destroyed: {e}', RuntimeWarning)
                self._release()
                if not isinstance(e, Exception):
                    raise
                return
            self._destroy(comm, timeout)
        self._release()

    def _destroy(self, comm: Any, timeout: float) -> None:
        # ncclCommDestroy may wait on peers in some NCCL versions: bound it too
        def destroy() -> None:
            with self._cupy.cuda.Device(self.device_id):
                comm.destroy()
        _bounded(destroy, timeout, f'ncclCommDestroy on rank {self.rank}')

    def _release(self) -> None:
        with self._lock:
            self._comm = None
            self._finalized = True
        self._buffers = {}
        self._wide = {}


def _bounded(call: Callable[[], None], timeout: float, what: str) -> bool:
    """Run ``call`` in a daemon thread and wait at most ``timeout`` seconds: NCCL's abort
    and destroy can hang on a peer. True when it returned; otherwise (it is left to process
    exit) or when it raised, False with a warning."""
    failed: Dict[str, BaseException] = {}

    def target() -> None:
        try:
            call()
        except BaseException as e:  # reported below, never over the caller's error
            failed['error'] = e

    thread = threading.Thread(target=target, name=what.replace(' ', '-'), daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        warn(f'{what} did not return within {timeout:g} s; leaving it to process '
             'exit', RuntimeWarning)
        return False
    if 'error' in failed:
        warn(f'{what} failed: {failed["error"]}', RuntimeWarning)
        return False
    return True

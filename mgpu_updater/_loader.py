"""Loading micro-batches ahead of use, in a background thread, with exact iterator state.

A loader hands out :class:`Batch` items: the converted arrays, the sample count and the
iterator's epoch bookkeeping *as of that batch*. Because the thread runs ahead of the
training loop, the iterator object itself is ahead too; :meth:`Loader.state` therefore
returns the iterator state captured (:func:`mgpu_updater._checkpoint.capture_state`) just
before the oldest batch that was loaded but not yet handed out, so a snapshot resumes with
no batch lost or repeated.

A *gated* prefetcher (loading ``'inline'``, which ``prefetch='auto'`` starts with and keeps
where it is the faster way: :mod:`mgpu_updater._load_trial`, :func:`plan`) starts a load
only while its consumer does not hold the gate
(:meth:`Loader.hold`, :meth:`Loader.release`) or waits in :meth:`Loader.get` for a batch
that is not loaded yet. On the CPU the thread's loading is Python (the iterator, the
converter) that takes the GIL from the replica's forward and backward: measured in one
process, interleaved with the hand-written loop on the same batches, the window's compute
read 1.020x the loop's with the thread loading meanwhile and 1.002x without it, and with two
replicas each window ran 3.5% slower than the limit's loops (``bench/paired_replicas.py``).
A worker releases the gate while it waits for the master's next message, so that it loads
then; the master holds it, and loads each batch when it needs it. A :meth:`Loader.get` that
finds nothing loaded while the thread is parked at the held gate loads the batch itself, in
the consumer's thread (the thread cannot move while the gate is held, so the iterator is the
consumer's alone): a hand-off to the thread and back cost the master 0.16 ms per batch at
k=1 in ``bench/paired_replicas.py``. (Only where the caller may read the iterator there:
see :func:`reads_in_caller_safely`.) An ungated prefetcher (loading ``'ahead'``) loads
while its consumer computes: what a dataset that reads files, a ``MultiprocessIterator`` or
a GPU that computes while the host waits can hide. Under ``prefetch='auto'`` each replica's
trial (:class:`~mgpu_updater._load_trial.LoadTrial`) switches between the two and keeps the
faster. While an ungated thread is inside a load, a consumer done waiting gets the GIL back
within 0.2 ms, not the interpreter's 5 ms (:mod:`mgpu_updater._gil_handoff`).
"""
from __future__ import annotations

import collections
import copy
import functools
import queue
import random
import threading
import time
import types
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

import numpy
import chainer
from chainer.dataset import convert

from ._chainer_private import call_converter, observer_name
from ._checkpoint import capture_state
from ._chunks import NotCallableAside
from ._functions import cell_is_set, global_names
from ._cuda import Staged   # imports no CuPy
from ._gil_handoff import handoff_for
from ._inherit import apply_thread_settings, thread_settings
from ._interrupts import ctrl_c_held

_STOP_WAIT = 5.0   # seconds finalize waits for the thread to notice
AUTO_DEPTH = 2     # the micro-batches loaded ahead under prefetch='auto'


class EpochInfo(NamedTuple):
    epoch: int
    epoch_detail: float
    previous_epoch_detail: Optional[float]
    is_new_epoch: bool


class Batch(NamedTuple):
    size: int            # samples in this micro-batch
    arrays: Any          # what the converter returned
    epoch: Any           # the iterator's bookkeeping right after this batch: an
    #                      EpochInfo, or the iterator itself (Loader.get's live_epoch)
    examples: Any = None   # what the iterator returned, where Loader.keep_examples
    reports: Optional[Dict[str, Any]] = None   # what its loading reported (_LoadReports)


class _LoadReporter(chainer.Reporter):
    """The reporter current while a batch loads: it knows the model and its links, and
    where the master loads, the observers of the reporter the update ran under (the
    Trainer's: ``trainer.reporter.add_observer('aux', link)``), as of the last update
    (:attr:`_LoadReports.outer`)."""

    def __init__(self, loads: '_LoadReports') -> None:
        super().__init__()
        self._loads = loads

    def report(self, values: Dict[str, Any], observer: Any = None) -> None:
        try:
            super().report(values, observer)
            return
        except KeyError as exc:
            outer = self._loads.outer
            if outer is None:   # the master's update runs under no reporter: as there,
                return          # chainer.report does nothing
            name = None if outer is _IN_A_WORKER else observer_name(outer, observer)
            if name is None:
                raise KeyError(
                    f'chainer.report({sorted(values)!r}, observer) while a batch loads '
                    '(the iterator, its dataset or the converter): that observer is '
                    "neither the model nor one of its links, nor one the Trainer's "
                    'reporter was given, the only observers known where batches load (a '
                    "worker process knows the model's alone). Report with the model or "
                    'one of its links as the observer, or with none') from exc
        self.observation.update({f'{name}/{key}': value for key, value in values.items()})


#: :attr:`_LoadReports.outer` where no reporter of the master's is known (a worker's)
_IN_A_WORKER = object()


class _LoadReports:
    """What the iterator, its dataset and the converter report (``chainer.report``) while
    a batch loads, kept with the batch: the replica reports it with that micro-batch's
    values, weighted by its samples (:meth:`mgpu_updater._replica.Replica.run_window`).
    Under ``StandardUpdater`` they load inside the Trainer's reporter scope; here they load
    in a thread of their own (nothing current: the reports were dropped) or between two
    micro-batches (into the last one's values, already read: dropped too). One reporter
    per loading thread, naming the model and its links as the replica's does
    (``observe``), so that ``chainer.report(values, model)`` names its keys alike."""

    def __init__(self, observe: Optional[Callable[[Any], None]],
                 outer: Any = _IN_A_WORKER) -> None:
        self._observe = observe
        self._local = threading.local()
        #: the reporter current where the master's update ran (set at each), None where
        #: none was, or _IN_A_WORKER
        self.outer: Any = outer

    def begin(self) -> Tuple[Any, Dict[str, Any], Any]:
        reporter = getattr(self._local, 'reporter', None)
        if reporter is None:
            reporter = self._local.reporter = _LoadReporter(self)
            if self._observe is not None:
                self._observe(reporter)
        observation: Dict[str, Any] = {}
        outer = reporter.observation
        reporter.__enter__()
        reporter.observation = observation
        return reporter, observation, outer

    @staticmethod
    def end(token: Tuple[Any, Dict[str, Any], Any]) -> Optional[Dict[str, Any]]:
        reporter, observation, outer = token
        reporter.__exit__(None, None, None)
        reporter.observation = outer
        return observation or None


def epoch_info(iterator: Any) -> EpochInfo:
    """The iterator's epoch as of now. An iterator of the user's own may lack ``epoch``
    or ``epoch_detail``, which StandardUpdater reads only where asked (a trigger in
    epochs): None here, and the updater's property reads the iterator then."""
    return EpochInfo(getattr(iterator, 'epoch', None), getattr(iterator, 'epoch_detail', None),
                     getattr(iterator, 'previous_epoch_detail', None), iterator.is_new_epoch)


class RepeatingIteratorStopped(RuntimeError):
    """An iterator with ``repeat=True`` raised ``StopIteration``: something inside it
    (its dataset's ``__getitem__``, most likely) raised it, since such an iterator never
    ends. Under ``StandardUpdater`` it would propagate and end the training loop; here it
    would look like the end of one replica's data while the others go on, so it is an
    error, named by the replica that met it (:class:`mgpu_updater._replica.Replica`)."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator
        super().__init__(
            f'its iterator ({type(iterator).__name__}, repeat=True) raised StopIteration, '
            'which an iterator that repeats never does: something inside it, most likely '
            "its dataset's __getitem__ or get_example, raised StopIteration (see the "
            'traceback above); fix that code, or pass repeat=False if the data is meant to '
            'end')


class Loader:
    """Synchronous loader (``prefetch=0``): loads in the caller's thread."""

    def __init__(self, iterator: Any, converter: Callable, device: Any,
                 keep_examples: bool = False,
                 observe: Optional[Callable[[Any], None]] = None,
                 reports_under: Any = _IN_A_WORKER) -> None:
        self.iterator = iterator
        self.converter = converter
        self.device = device
        self._reports = _LoadReports(observe, reports_under)
        #: what the converter is given as its device: the replica's, as StandardUpdater
        #: gives it, except that Chainer's own concat_examples on the CPU gets None, for
        #: which it returns the same arrays without a transfer per array (four calls each)
        self.converter_device = None if (converter is convert.concat_examples
                                         and not _is_gpu(device)) else device
        self._exhausted = False
        self._closed = False
        #: whether each Batch holds the examples it was converted from as well (where a
        #: replica splits its batches, until it has checked a cut: _chunks.check_split)
        self.keep_examples = keep_examples
        #: how its batches count their samples (a tuple of lists: examples or columns)
        self._counts = TupleOfLists()

    def _read(self) -> Optional[Tuple[Any, EpochInfo, Optional[Dict[str, Any]]]]:
        """The iterator's next batch as it gave it, with its epoch bookkeeping after it
        and what the read reported; ``None`` once it is exhausted. An iterator that
        repeats never ends: a ``StopIteration`` out of one (raised inside its dataset, a
        converter of its own) is :class:`RepeatingIteratorStopped`, not the end of the
        data."""
        token = self._reports.begin()
        try:
            batch = self.iterator.next()
        except StopIteration as exc:
            if getattr(self.iterator, 'repeat', False):
                raise RepeatingIteratorStopped(self.iterator) from exc
            return None
        finally:
            reports = self._reports.end(token)
        return batch, epoch_info(self.iterator), reports

    def _convert(self, read: Tuple[Any, EpochInfo, Optional[Dict[str, Any]]],
                 stager: Any = None) -> Batch:
        batch, epoch, reports = read
        token = self._reports.begin()
        try:
            if stager is None:
                arrays = call_converter(self.converter, batch, self.converter_device)
            else:   # GPU: convert on the host, copy from pinned memory on a side stream
                arrays = stager.stage(call_converter(self.converter, batch, None))
        finally:
            converted = self._reports.end(token)
        if converted:
            reports = {**reports, **converted} if reports else converted
        return Batch(self._counts.count(batch, self.iterator), arrays, epoch,
                     batch if self.keep_examples else None, reports)

    def convert_aside(self, examples: Any) -> Any:
        """The converter's output for ``examples``, as a batch of them is converted (here,
        in the caller's thread: on a GPU, straight to the device), by a copy of the
        converter (:func:`_aside`): its generators (held directly, deeper, or in a
        function's closure) and a counter it rebinds stay as they were, and the data it
        holds (a vocabulary, a table) is not copied."""
        token = self._reports.begin()   # what it reports: not this update's
        try:
            return call_converter(_aside(self.converter), examples, self.converter_device)
        finally:
            self._reports.end(token)

    def get(self, live_epoch: bool = False, report_here: bool = False) -> Optional[Batch]:
        """The next micro-batch, or ``None`` once the iterator is exhausted: what
        :meth:`_read` and :meth:`_convert` do, in one call (it runs for every micro-batch
        loaded inline). ``live_epoch``: the batch's ``epoch`` is the iterator itself, read
        when asked as ``StandardUpdater`` reads it, not an :class:`EpochInfo` of it (four
        reads of its properties, about 5 us a batch on a 2-core VM); for a caller that
        reads it only until this loader reads the iterator again, which nothing else does
        meanwhile (the synchronous loader; a gated prefetcher's thread parked at the gate
        the caller holds: :meth:`Prefetcher.get`). ``report_here``: what loading it
        reports goes to the reporter current in the caller, as under StandardUpdater (a
        one-device window whose model reports there too), not into the batch."""
        if self._closed:
            raise RuntimeError('this loader was closed')
        if self._exhausted:
            return None
        it = self.iterator
        token = None if report_here else self._reports.begin()
        try:
            try:
                batch = it.next()
            except StopIteration as exc:
                if getattr(it, 'repeat', False):
                    raise RepeatingIteratorStopped(it) from exc
                self._exhausted = True
                return None
            epoch = it if live_epoch else epoch_info(it)
            arrays = call_converter(self.converter, batch, self.converter_device)
        finally:
            reports = None if token is None else self._reports.end(token)
        return Batch(self._counts.count(batch, self.iterator), arrays, epoch,
                     batch if self.keep_examples else None, reports)

    def state(self) -> Dict[str, numpy.ndarray]:
        return capture_state(self.iterator)

    def reports_under(self, reporter: Any) -> None:
        """The reporter the master's update runs under (the Trainer's): what loading
        reports through an observer it was given is named as it names it."""
        self._reports.outer = reporter

    def read_ahead_state(self) -> Optional[Dict[str, numpy.ndarray]]:
        """The iterator's state as of the last batch handed out, where the loader has
        read further (None: it has not, the iterator is there), taken when it read."""
        return None

    #: how this loader loads: 'none' (in the caller, prefetch=0), 'ahead' (a thread, as
    #: far as its depth), 'inline' (a gated thread: in the caller), or 'trial'
    mode = 'none'

    def window_started(self) -> None:
        """A window starts (the trial of ``prefetch='auto'`` times the cycles between
        them). Elsewhere nothing."""

    def hold(self) -> None:
        """The replica is busy: a gated prefetcher starts no load until :meth:`release`
        (or a :meth:`get` that finds nothing loaded). Elsewhere nothing."""

    def release(self) -> None:
        """The replica waits for something else: a gated prefetcher may load now."""

    def pause(self) -> None:
        """The master's update is over: a prefetcher reads nothing until :meth:`resume`
        (a read under way is waited for), so that the iterator and the dataset are read
        by no thread of this package while the code between updates runs (extensions, an
        Evaluator over the same dataset object). Elsewhere nothing."""

    def resume(self) -> None:
        """The master's update starts: a prefetcher may read again."""

    def close(self) -> None:
        self._closed = True


class Prefetcher(Loader):
    """Loads up to ``depth`` micro-batches ahead in a daemon thread.

    The iterator's first batch is read in the constructor, in the caller's thread, and
    every later one in the background thread, which also converts and copies each batch
    to the device. An exception there is re-raised by :meth:`get`, with its original
    traceback.

    Why the first read happens here: ``MultiprocessIterator`` forks its pool of loader
    processes at its first ``next()`` (Chainer 7.8.1 ``iterators/multiprocess_iterator.py``
    :145-152, ``_PrefetchLoop.launch_thread`` at :463-469, ``multiprocessing.Pool`` with the
    default ``fork``). Forked from a background thread while the main thread is inside an
    OpenBLAS call (the lazy-parameter forward pass, the first window), that call never
    returns. Forked here, before the thread starts and before the caller does any BLAS
    work, nothing runs alongside the fork. No later ``next()`` forks again: the pool is
    launched only while ``_prefetch_loop.thread`` is None (:147), which stays set until
    ``finalize()`` (:167-178); ``reset()`` and ``serialize()`` only signal the running loop
    (``_reset_state`` -> ``_Communicator.reset``, :248-256). (With ``maxtasksperchild``
    the pool replaces its processes from its own thread, as under StandardUpdater.)
    """

    def __init__(self, iterator: Any, converter: Callable, device: Any, depth: int,
                 gated: bool = False, load_here: bool = True, trial: Any = None,
                 keep_examples: bool = False, made: Optional[List[Loader]] = None,
                 observe: Optional[Callable[[Any], None]] = None,
                 reports_under: Any = _IN_A_WORKER) -> None:
        super().__init__(iterator, converter, device, keep_examples, observe, reports_under)
        self.depth = depth
        # whether a get may load in the caller's thread (the thread parked at the gate)
        self.load_here = load_here
        # The gate (see the module docstring): a C lock the consumer holds while busy, so
        # that the thread starts no load then; held from the start. ``gated`` follows the
        # trial's word (:meth:`window_started`), where there is one.
        self.gated = gated
        #: the plan's word, kept: whether this loader started gated
        self.planned_gated = gated
        #: ``prefetch='auto'``: which way loads faster here, measured (None: decided, or
        #: as asked)
        self.trial = trial
        self._gate = threading.Lock()
        self._holding = False
        # True while the thread waits at the gate, set before it tries the gate and
        # cleared before it lets go of it: seen True by a consumer that holds the gate,
        # the thread cannot move until released (it has handed out every batch it loaded,
        # and recorded no state for another), so the consumer may read the iterator itself.
        self._parked = False
        # True while the thread is past the gate, inside a load (until it hands the batch
        # over; both changes under ``_lock``, with what they come with): a consumer that finds nothing loaded then waits for that batch without
        # opening the gate, which would let the thread start one more (``get``)
        self._loading = True
        self.hold()
        # Loaded items, and one token per free place: both C queues (_queue.SimpleQueue),
        # so that no Python-level lock is taken in the consumer's thread (see close()).
        self._items: 'queue.SimpleQueue[tuple]' = queue.SimpleQueue()
        self._free: 'queue.SimpleQueue[None]' = queue.SimpleQueue()
        for _ in range(depth):
            self._free.put(None)
        # places freed by a consumer holding the gate, handed back when it lets go
        # (release) or finds nothing loaded (get): see get
        self._owed = 0
        # states captured before each batch loaded or being loaded and not yet handed
        # out, oldest first; empty only while the thread is not inside a load
        self._pending: Deque[Dict[str, numpy.ndarray]] = collections.deque()
        self._lock = threading.Lock()
        # pause(): between the master's updates the thread starts no read (of the
        # iterator, the dataset, the converter), and the master waits for one under way
        self._paused = False
        self._reading = False
        self._read_done = threading.Condition(self._lock)
        # who waits on it (notified only then: a Condition's notify is Python, and the
        # master pauses and resumes every update)
        self._waiting = {'thread': False, 'master': False}
        self._stop = threading.Event()
        self._pending.append(capture_state(iterator))
        self._first_read: Optional[Tuple[Any, EpochInfo, Optional[Dict[str, Any]]]] = None
        self._first_error: Optional[BaseException] = None
        try:
            self._first_read = self._read()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer by the thread
            self._first_error = exc
        # the caller's own configuration and numpy error handling, for the thread that
        # runs the dataset and converter from now on (_inherit)
        self._settings = thread_settings()
        self._reading = True   # the thread converts the first batch first
        self._thread = threading.Thread(target=self._run, name='mgpu-prefetch', daemon=True)
        # The thread started and this loader in ``made`` (the caller's, who closes it), or
        # neither: a Ctrl-C in between left the thread reading the iterator for good.
        with ctrl_c_held():
            try:
                self._thread.start()
            except BaseException:   # the thread running or not: it stops as after close()
                self._stop.set()
                self.release()
                if self._thread.ident is not None:
                    self._thread.join(_STOP_WAIT)
                raise
            #: the loading thread's native id (for binding it to cores, _threads)
            self.thread_id = self._thread.native_id
            if made is not None:
                made.append(self)

    def _run(self) -> None:
        stager = None
        try:
            try:
                apply_thread_settings(self._settings)
                read, self._first_read = self._first_read, None
                if self._first_error is not None:
                    raise self._first_error
                if _is_gpu(self.device):
                    from ._cuda import PinnedStager
                    self.device.use()
                    stager = PinnedStager(self.device.device.id, timeout=60.0)
                with handoff_for(ahead=not self.gated):
                    item = None if read is None else self._convert(read, stager)
            finally:
                self._read_ended()
            while True:
                self._put(('item', item) if item is not None else ('end', None))
                if item is None or self._stop.is_set():
                    return
                if self.gated and not self._pass_gate():
                    return
                # Record the state before loading, then load without the lock: the
                # consumer must never wait for a load in progress to pop its entry.
                with self._lock:
                    while self._paused and not self._stop.is_set():
                        self._waiting['thread'] = True
                        self._read_done.wait(0.1)
                    self._waiting['thread'] = False
                    if self._stop.is_set():
                        return
                    self._reading = self._loading = True
                    self._pending.append(capture_state(self.iterator))
                # one load, read and converted (ahead, beside the compute: the GIL back
                # soon to it when it waits)
                try:
                    with handoff_for(ahead=not self.gated):
                        read = self._read()
                        item = None if read is None else self._convert(read, stager)
                finally:
                    self._read_ended()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(('error', exc))
        finally:
            if stager is not None:
                stager.close()

    def _read_ended(self) -> None:
        """The thread's read is over: the lock only where the master waits for it (a
        master that starts to wait just after this looked waits 10 ms at most)."""
        if self._waiting['master']:
            with self._lock:
                self._reading = False
                self._read_done.notify_all()
        else:
            self._reading = False

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            while self._reading and self._thread.is_alive() and not self._stop.is_set():
                self._waiting['master'] = True
                self._read_done.wait(0.01)
            self._waiting['master'] = False

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            if self._waiting['thread']:
                self._read_done.notify_all()

    def _pass_gate(self) -> bool:
        """Wait until the consumer does not hold the gate, checking the stop every 0.1 s;
        False: stopped."""
        self._parked = True
        while not self._gate.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        self._parked = False
        self._gate.release()
        return not self._stop.is_set()

    @property
    def mode(self) -> str:   # type: ignore[override]
        if self.trial is not None:
            return 'trial'
        return 'inline' if self.gated else 'ahead'

    def window_started(self) -> None:
        trial = self.trial
        if trial is None:
            return
        way = trial.window(time.perf_counter())
        if trial.decision is not None:
            self.trial = None
        self._set_gated(way == 'inline')

    def _set_gated(self, gated: bool) -> None:
        """Load inline (gated) or ahead from now on; batches loaded meanwhile stay."""
        if gated == self.gated:
            return
        if gated:
            self.gated = True
            self.hold()
        else:
            self.gated = False
            self.release()

    def hold(self) -> None:
        if self.gated and not self._holding:
            self._gate.acquire()
            self._holding = True

    def release(self) -> None:
        if self._holding:
            self._holding = False
            self._pay()
            self._gate.release()

    def _pay(self) -> None:
        """Hand back the places freed while the gate was held (see :meth:`get`)."""
        owed, self._owed = self._owed, 0
        for _ in range(owed):
            self._free.put(None)

    def _put(self, entry: tuple) -> None:
        """Wait for a free place (checking the stop every 0.1 s), then hand ``entry`` on."""
        while not self._stop.is_set():
            try:
                self._free.get(timeout=0.1)
            except queue.Empty:
                continue
            # the batch and the end of the load together, as a get sees them (get)
            with self._lock:
                self._items.put(entry)
                self._loading = False
            return
        self._loading = False

    def get(self, live_epoch: bool = False, report_here: bool = False) -> Optional[Batch]:
        """As :meth:`Loader.get`; ``live_epoch`` and ``report_here`` only where the batch
        is read here (a batch the thread read has its :class:`EpochInfo`, the thread may
        read on; and what it reported, in the batch)."""
        if self._closed:
            raise RuntimeError('this loader was closed')
        if self._exhausted:
            return None
        opened = self._holding and self._items.empty()
        if opened and self._parked and self.load_here:
            # The thread stays put: load the batch here, in the consumer's thread, as the
            # synchronous loader does (this runs for every micro-batch loaded inline); an
            # error is raised as it came. The thread stays parked until the consumer lets
            # go of the gate, which a decided loader's does not do between its gets.
            return Loader.get(self, live_epoch, report_here)
        if opened:
            self._pay()   # a thread waiting for a place to put its batch gets one
            # Nothing loaded: a thread inside a load goes on by itself (opening the gate
            # would let it start one more: loading ahead, which a gated loader does not);
            # one at the gate, or on its way there, must be let through. Read under the
            # lock that _put hands a batch on with: a thread seen loading puts one more.
            with self._lock:
                stuck = not self._loading and self._items.empty()
            if stuck:
                self.release()
        while True:
            try:
                kind, payload = self._items.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._items.empty():
                    raise RuntimeError('the prefetch thread stopped unexpectedly') from None
        if opened:   # the gate is held again: a gated loader loads no further ahead
            self.hold()
        if self._holding:
            # The place this batch held goes back when the gate is let go (release, or a
            # get that finds nothing loaded): handed back now, it would wake the thread,
            # which after a wait holds a batch loaded ahead for a place, in the middle of
            # the window, to take the GIL from it and park at the gate again. That cost a
            # window of a launch-bound model 0.2 ms of 0.8 with threads unbound (as a GPU
            # worker's), 0.04 ms with the process on one core (bench/gated_loader.py).
            self._owed += 1
        else:
            self._free.put(None)
        if kind == 'error':
            self._exhausted = True
            with self._lock:   # the thread stopped: the iterator is where the error left it
                self._pending.clear()   # (past a batch its dataset or converter failed on,
            raise payload               # as StandardUpdater's update leaves it)
        with self._lock:
            self._pending.popleft()
        if kind == 'end':
            self._exhausted = True
            return None
        if isinstance(payload.arrays, Staged):   # on a side stream: order it, don't block
            payload = payload._replace(arrays=payload.arrays.wait())
        return payload

    def state(self) -> Dict[str, numpy.ndarray]:
        with self._lock:
            if self._pending:
                return self._pending[0]
            return capture_state(self.iterator)

    def read_ahead_state(self) -> Optional[Dict[str, numpy.ndarray]]:
        with self._lock:
            return self._pending[0] if self._pending else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.release()
        # The thread's _put gives up within 0.1 s of the stop; the join is bounded, and
        # the thread is a daemon. Why C queues and no draining here: this loader once
        # used queue.Queue, whose lock is taken and released by Python code
        # (threading.Condition.__enter__/__exit__). A KeyboardInterrupt (Ctrl-C) checked
        # at the start of that __exit__, before the release, left the mutex held, and
        # draining the queue here then blocked the master's teardown for good (CI,
        # test_faults[master_sigint_mpit], 2026-11; tests/scripts/interrupted_loader.py
        # hangs that way within 2000 interrupts on CPython 3.11 and 3.12); checked in
        # _acquire_restore it turned the interrupt into "RuntimeError: release unlocked
        # lock".
        # SimpleQueue's get and put are one C call each: an interrupt there either
        # takes nothing or loses the item it took, which teardown drops anyway.
        self._thread.join(_STOP_WAIT)


_COLUMNS = 8   # values of a tuple batch looked at for a column of rows, at most


def sample_count(batch: Any, columns: Optional[bool] = None) -> int:
    """How many samples a batch, as the iterator returned it, holds.

    A list (what Chainer's iterators return: one example per entry) counts its entries.
    A tuple or dict of columns (a custom iterator's: Chainer's word2vec ``WindowIterator``
    returns ``(centers, contexts)``) counts the rows of its first array of one or more
    dimensions (one row per sample; a column before it may be a list of sequences or a
    number), looked for among a tuple's first :data:`_COLUMNS` values; a dict of lists of
    one length, that length. A tuple of lists alone (:func:`lists_length`) may be
    examples as much as columns: ``columns`` says which (:class:`TupleOfLists` decides),
    else it counts its entries. Anything else with a shape counts its leading dimension;
    anything else, its length.
    """
    if columns and type(batch) is tuple:
        length = lists_length(batch)
        if length is not None:
            return length
    if isinstance(batch, (tuple, dict)) and batch:
        values = tuple(batch.values()) if isinstance(batch, dict) else batch[:_COLUMNS]
        for value in values:
            if getattr(value, 'ndim', 0) >= 1:
                return int(value.shape[0])
        if isinstance(batch, dict) and all(type(value) is list for value in values):
            lengths = {len(value) for value in values}
            if len(lengths) == 1:
                return lengths.pop()
    return len(batch)


def lists_length(batch: tuple) -> Optional[int]:
    """The one length of a tuple batch's values where they are all lists (or tuples), as
    a tuple of examples and a tuple of columns both are: ``((x0, t0), (x1, t1), (x2,
    t2))``, ``([x0, x1, x2], [t0, t1, t2])``; else None."""
    if not batch or not all(type(value) in (list, tuple) for value in batch):
        return None
    lengths = {len(value) for value in batch}
    return lengths.pop() if len(lengths) == 1 else None


class TupleOfLists:
    """Which a tuple of lists of one length is, as its iterator returns them: examples
    (it counts its entries) or columns (it counts their entries). Where the two counts
    differ, the first such batch decides for the later ones: by the iterator's
    ``batch_size``, the count that equals it, unless what the lists hold says otherwise
    (:func:`_reading`: a column holds one kind of value, an example one of each field; a
    short batch with as many fields as the batch size); where the batch size tells
    neither (none; a short first batch, a resumed run's), by what they hold alone. A
    batch that tells neither way is refused: the weighting would be a guess.

    Read as columns, every batch after must have as many: one with another number of
    lists was examples (a first batch of 3 examples of token sequences ``(x, t)``, read as
    2 columns by a ``batch_size`` of 2, their fields), and is refused, naming both counts.
    (Read as examples, a later batch cannot tell: an example may be a sequence whose
    length varies.)"""

    def __init__(self) -> None:
        #: True: columns; False: examples; None: not decided yet
        self.columns: Optional[bool] = None
        self._first: Tuple[int, int] = (0, 0)   # (lists, their length) of the decider

    def count(self, batch: Any, iterator: Any) -> int:
        if type(batch) is not tuple:
            return sample_count(batch)
        if self.columns is None:
            length = lists_length(batch)
            if length is not None and length != len(batch):
                self.columns = self._decide(batch, length, iterator)
                self._first = (len(batch), length)
        elif self.columns and len(batch) != self._first[0] and \
                lists_length(batch) is not None:
            raise self._misread(batch, iterator)
        return sample_count(batch, self.columns)

    def _misread(self, batch: tuple, iterator: Any) -> ValueError:
        lists, length = self._first
        return ValueError(
            f'the iterator ({type(iterator).__name__}) returned a batch that is a tuple of '
            f'{len(batch)} lists, where its first such batch, a tuple of {lists} lists of '
            f'{length} entries each, was read as {lists} columns of {length} samples (by '
            f'its batch_size, {getattr(iterator, "batch_size", None)!r}, and what the '
            'lists hold): columns do not change in number, so these were examples, and '
            'the samples of the updates so far were counted wrongly. Return a list of '
            "examples (as Chainer's iterators do), or the columns as a dict of lists or "
            'as arrays')

    @staticmethod
    def _decide(batch: tuple, length: int, iterator: Any) -> bool:
        size = getattr(iterator, 'batch_size', None)
        by_size = True if size == length else False if size == len(batch) else None
        by_values = _reading(batch, length)
        if by_values is not None:
            return by_values
        if by_size is not None:
            return by_size
        raise ValueError(
            f'the iterator ({type(iterator).__name__}) returned a batch that is a tuple '
            f'of {len(batch)} lists of {length} entries each: {length} samples in '
            f'{len(batch)} columns, or {len(batch)} samples of {length} fields each; '
            f'their values read alike either way, and its batch_size ({size!r}) tells '
            "neither. Return a list of examples (as Chainer's iterators do), or the "
            'columns as a dict of lists or as arrays')


def _reading(batch: tuple, length: int) -> Optional[bool]:
    """Columns (True) where each list holds one kind of value and the lists' values at
    one place do not (an array beside a number), examples (False) the other way round;
    None where both or neither reading holds. Kinds are broad: any number is one (an int
    beside a float, a numpy scalar), text is one, an array is one by its dtype's kind
    (integers, floats) whatever its rank, and None is any."""
    def alike(values: Any) -> bool:
        return len({_kind(v) for v in values} - {None}) <= 1
    as_columns = all(alike(values) for values in batch)
    as_examples = all(alike([values[i] for values in batch]) for i in range(length))
    return as_columns if as_columns != as_examples else None


def _kind(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (bool, int, float, complex, numpy.number, numpy.bool_)):
        return 'number'
    if isinstance(value, (str, bytes)):
        return 'text'
    dtype = getattr(value, 'dtype', None)
    if dtype is not None and getattr(value, 'ndim', 0) == 0:
        return 'number'
    if dtype is not None:
        kind = numpy.dtype(dtype).kind
        return ('array', 'int' if kind in 'iub' else kind)
    return type(value)


def _is_gpu(device: Any) -> bool:
    return device is not None and device.xp is not numpy


def plan(prefetch: Any) -> Tuple[int, bool, bool]:
    """(depth, gated, trial) of every replica's loader for the updater's ``prefetch``: an
    int is that depth, loading ahead; ``'auto'`` is :data:`AUTO_DEPTH`, inline (gated) at
    first, each replica then keeping the faster way (:mod:`mgpu_updater._load_trial`)."""
    if prefetch != 'auto':
        return int(prefetch), False, False
    return AUTO_DEPTH, True, True


def reads_in_caller_safely(iterator: Any) -> bool:
    """Whether the master's thread may read ``iterator`` itself (a gated loader's
    on-demand load) rather than through the loader thread: where its ``next`` is
    ``SerialIterator``'s, Python that takes no lock. Ctrl-C reaches the master's main
    thread as a KeyboardInterrupt; raised inside an iterator that waits on threads of its
    own, it can leave them waiting for good. Chainer 7.8.1 ``MultiprocessIterator``: its
    prefetch thread waits in ``_Communicator.put`` on a condition with no timeout
    (``iterators/multiprocess_iterator.py``:366-372) and ``finalize`` joins that thread
    until it ends (``_PrefetchLoop.terminate``, :398-404); with the master interrupted
    inside ``next`` (``_Communicator.get``, :324-336) that wait never ended
    (``test_faults[master_sigint_mpit]``, a CI run of 2026-12-02: the teardown hung).
    Through the loader thread, the master waits in a C queue, which an interrupt leaves
    whole (see :meth:`Prefetcher.close`). Workers ignore SIGINT and may always load here."""
    import chainer
    return getattr(type(iterator), 'next', None) is chainer.iterators.SerialIterator.next


_GENERATORS = (numpy.random.RandomState, numpy.random.Generator, random.Random)
_REACH_DEPTH = 4       # links from the converter to a generator it draws from, at most
_REACH_OBJECTS = 2000  # objects looked at, at most (once per replica)
_REACH_ITEMS = 64      # a container with more items is not looked into
_EMPTY = object()      # a closure's cell not assigned yet


def _aside(converter: Any) -> Any:
    """A copy of ``converter`` for a call whose draws and counts must not stay (see
    :meth:`Loader.convert_aside`): a shallow copy of a converter object (or of a bound
    method's object), in which each random generator it reaches within a few links (an
    attribute, one of an object or container it holds, a function's closure or
    defaults, a partial's arguments) is a copy, and so is what leads there. Nothing the
    converter shares is changed, so the loader's thread may convert meanwhile; a
    function that reaches no generator is called as it is."""
    try:
        copied = _reaching_copy(converter, _REACH_DEPTH, set(), [_REACH_OBJECTS], top=True)
    except Exception as exc:  # noqa: BLE001 - called itself, it would move its draws
        raise NotCallableAside(f'{exc!r} copying the converter') from exc
    return converter if copied is None else copied


def _reaching_copy(obj: Any, depth: int, path: set, budget: List[int],
                   top: bool = False) -> Any:
    """A copy of ``obj`` whose generators within ``depth`` links are copies, or None where
    it reaches none (``top``: an object is copied anyway, for a counter it rebinds)."""
    if isinstance(obj, _GENERATORS):
        if isinstance(obj, random.SystemRandom):   # no state: the system's entropy
            return None
        return copy.deepcopy(obj)
    if depth < 0 or budget[0] <= 0 or id(obj) in path or _no_generator_inside(obj):
        return None
    budget[0] -= 1
    path.add(id(obj))
    try:
        return _copy_parts(obj, depth - 1, path, budget, top)
    finally:
        path.discard(id(obj))


def _no_generator_inside(obj: Any) -> bool:
    return obj is None or isinstance(obj, (str, bytes, int, float, complex, numpy.ndarray,
                                           numpy.generic, types.ModuleType, type,
                                           types.BuiltinFunctionType, types.CodeType,
                                           chainer.Variable))


def _copy_parts(obj: Any, depth: int, path: set, budget: List[int], top: bool) -> Any:
    def sub(value: Any) -> Any:
        return _reaching_copy(value, depth, path, budget)

    def merged(old: List[Any], new: List[Any]) -> List[Any]:
        return [n if n is not None else o for o, n in zip(old, new)]

    if isinstance(obj, types.MethodType):   # its object, copied as the converter is
        owner = _reaching_copy(obj.__self__, depth + 1, path, budget, top)
        return None if owner is None else types.MethodType(obj.__func__, owner)
    if isinstance(obj, types.FunctionType):
        contents = [c.cell_contents if cell_is_set(c) else _EMPTY
                    for c in obj.__closure__ or ()]
        new_contents = [None if v is _EMPTY else sub(v) for v in contents]
        defaults = list(obj.__defaults__ or ())
        new_defaults = [sub(v) for v in defaults]
        keywords = dict(obj.__kwdefaults__ or {})
        new_keywords = {k: sub(v) for k, v in keywords.items()}
        names = [n for n in global_names(obj.__code__) if n in obj.__globals__]
        new_globals = {n: sub(obj.__globals__[n]) for n in names}
        if all(v is None for v in new_contents + new_defaults + list(new_keywords.values())
               + list(new_globals.values())):
            return None
        closure = tuple(types.CellType() if v is _EMPTY else types.CellType(v)
                        for v in merged(contents, new_contents))
        module = obj.__globals__
        if any(v is not None for v in new_globals.values()):   # a module's generator
            module = dict(module)
            module.update((n, v) for n, v in new_globals.items() if v is not None)
        func = types.FunctionType(obj.__code__, module, obj.__name__,
                                  tuple(merged(defaults, new_defaults)) or None,
                                  closure or None)
        func.__kwdefaults__ = {k: new_keywords[k] if new_keywords[k] is not None else v
                               for k, v in keywords.items()} or None
        func.__dict__.update(obj.__dict__)
        return func
    if isinstance(obj, functools.partial):
        args, keys = list(obj.args), list(obj.keywords)
        new = [sub(v) for v in [obj.func, *args, *(obj.keywords[k] for k in keys)]]
        if all(v is None for v in new):
            return None
        values = merged([obj.func, *args, *(obj.keywords[k] for k in keys)], new)
        return functools.partial(values[0], *values[1:1 + len(args)],
                                 **dict(zip(keys, values[1 + len(args):])))
    if isinstance(obj, (list, tuple, dict)):   # and their kinds (OrderedDict, namedtuple)
        if len(obj) > _REACH_ITEMS:
            return None
        keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
        old = [obj[k] for k in keys]
        new = [sub(v) for v in old]
        if all(v is None for v in new):
            return None
        values = merged(old, new)
        if isinstance(obj, tuple):
            return type(obj)(*values) if hasattr(obj, '_fields') else type(obj)(values)
        clone = copy.copy(obj)
        for key, value in zip(keys, values):
            clone[key] = value
        return clone
    attributes = _attributes(obj)
    if attributes is None:
        return None
    replaced = {name: sub(value) for name, value in attributes.items()}
    replaced = {name: value for name, value in replaced.items() if value is not None}
    if not replaced and not top:
        return None
    clone = copy.copy(obj)
    for name, value in replaced.items():
        object.__setattr__(clone, name, value)
    return clone


def _attributes(obj: Any) -> Optional[Dict[str, Any]]:
    """An object's attributes: its ``__dict__`` and its ``__slots__`` (None: neither)."""
    found: Dict[str, Any] = {}
    slots = []
    for kind in type(obj).__mro__:
        declared = kind.__dict__.get('__slots__', ())
        slots += [declared] if isinstance(declared, str) else list(declared)
    slots = [name for name in slots if name not in ('__dict__', '__weakref__')]
    for name in slots:
        try:
            found[name] = object.__getattribute__(obj, name)
        except AttributeError:   # a slot not set
            pass
    attributes = getattr(obj, '__dict__', None)
    if isinstance(attributes, dict):
        found.update(attributes)
    elif not slots:
        return None
    return found


def make_loader(iterator: Any, converter: Callable, device: Any, depth: int,
                gated: bool = False, load_here: bool = True, trial: bool = False,
                keep_examples: bool = False, made: Optional[List[Loader]] = None,
                observe: Optional[Callable[[Any], None]] = None,
                reports_under: Any = _IN_A_WORKER) -> Loader:
    """The loader of ``depth`` (0: inline); one with a thread of its own is put in
    ``made`` as soon as that thread runs, for the caller to close should it be
    interrupted before it holds the loader. ``observe`` names the observers of the
    reporter that takes what loading reports (the replica's model: :class:`_LoadReports`),
    ``reports_under`` is the reporter the master's update runs under (see
    :meth:`Loader.reports_under`)."""
    if depth <= 0:
        return Loader(iterator, converter, device, keep_examples, observe, reports_under)
    from ._load_trial import LoadTrial
    return Prefetcher(iterator, converter, device, depth, gated=gated, load_here=load_here,
                      trial=LoadTrial() if trial else None, keep_examples=keep_examples,
                      made=made, observe=observe, reports_under=reports_under)

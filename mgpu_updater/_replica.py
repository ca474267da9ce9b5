"""What every replica does in one update: its window of micro-batches.

The master and each worker run the same :class:`Replica`. Every factor a gradient is
scaled by (accumulation, ``loss_reduction``, ``replica_reduction``) is decided here, in
:class:`Scaling`, and nowhere else.
"""
from __future__ import annotations

import copy
import functools
import gc
import math
import random
import time
import types
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import numpy

import chainer

from ._chainer_private import (backward_scaled, forgotten_function,
                               is_static_graph_machinery, is_unregistered_observer_error,
                               registered_names, static_graph_links)
from ._chunks import Chunking, check_split, split, splits
from ._functions import cell_is_set, global_names
from ._flat_buffers import KeptPersistents, ModelIndex, persistent_arrays, unique_params
from ._loader import Batch, EpochInfo, Loader, RepeatingIteratorStopped
from ._made_once import Seen
from ._warning import warn


class WindowResult(NamedTuple):
    """What a replica tells the master about its window (small and picklable)."""
    count: int                           # samples in the window
    loss_sum: Any                        # sum over micro-batches of loss * samples: a
                                         # float (a 0-dim array: Replica.read_values False)
    sums: Dict[str, Any]                 # reported key -> sum of value * samples
    weights: Dict[str, float]            # reported key -> samples that reported it
    times: Dict[str, float]              # seconds: 'data', 'compute'
    epochs: List[EpochInfo]              # epoch bookkeeping after each micro-batch
    summed: Tuple[str, ...] = ()         # keys whose values add up (the loss under 'sum')
    micro_batch_size: Optional[int] = None   # samples a forward takes now (None: empty)
    loading: str = ''                    # how its loader loads (_loader.Loader.mode)
    chunk_limit: Optional[int] = None    # the most samples it splits batches into (None:
                                         # whole batches; under 'auto', what it halved to)
    made_once: Optional[Dict[str, Any]] = None   # after its first windows: the digests of
                                         # what its forward made once (_made_once.Seen)


#: what :meth:`Replica.direct_window` returns: samples, the loss (a float; when
#: ``read_values`` is False the array the loss Variable holds, one element of its dtype,
#: where it is: no cast, which on a GPU is a kernel launch an update), the epoch after
#: the batch (an :class:`EpochInfo`, or the iterator itself under ``live_epoch``; None
#: without samples), and the seconds of loading and of forward and backward
DirectWindow = Tuple[int, Any, Any, float, float]


class Scaling(NamedTuple):
    """Every factor a replica's gradient is scaled by: the one home of gradient scaling.

    Notation: a micro-batch of ``b`` samples whose ``loss_func`` returned ``L``; ``W`` the
    nominal samples of one update over all replicas (``update_norm``); ``W_r`` this
    replica's nominal samples per window, ``accumulate_steps`` times its batch size
    (``window_norm``); ``B_r`` and ``B`` the samples the window and the update really held.

    ============  ===========  =====================================  ======================
    loss          replicas     the update's gradient                  factors
    ============  ===========  =====================================  ======================
    ``'mean'``    ``'mean'``   of the mean loss over all ``B``        ``b/W``, then ``W/B``
                               samples (StandardUpdater, one batch)   on the reduced sum
    ``'mean'``    ``'sum'``    sum over replicas of the gradient of   ``b/W_r``, then
                               the replica's window mean loss         ``W_r/B_r`` per window
                               (ParallelUpdater, one batch of
                               ``accumulate_steps * b`` per device)
    ``'sum'``     either       of the sum of ``L`` over every micro-  ``1``
                               batch = the summed loss of all ``B``
                               samples (StandardUpdater, one batch)
    ============  ===========  =====================================  ======================

    The micro-batch factor multiplies the loss before ``backward`` (with the optimizer's
    own loss scale); the window factor is applied by the replica to its own gradient,
    before the reduction, only where its window held another count than nominal (a short
    one, a larger batch of a bucketing iterator); the update factor is applied by the
    master to the reduced gradient, likewise (the end of an epoch with ``repeat=False``).
    """
    loss_reduction: str       # 'mean' | 'sum': what loss_func returns over its batch
    replica_reduction: str    # 'mean' | 'sum': how the replicas' gradients combine
    update_norm: float        # W
    window_norm: float        # W_r

    def micro_batch(self, size: int) -> float:
        """Factor on the loss of a micro-batch of ``size`` samples, before backward."""
        if self.loss_reduction == 'sum':
            return 1.0
        if self.replica_reduction == 'sum':
            return size / self.window_norm
        return size / self.update_norm

    def whole_window(self, size: int) -> float:
        """Factor on the loss of a window that is one whole micro-batch of ``size``
        samples (:meth:`Replica.direct_window`): :meth:`micro_batch`'s and
        :meth:`window`'s in one, so that a short window is scaled as a long one is."""
        if self.loss_reduction == 'mean' and self.replica_reduction == 'sum':
            return 1.0   # (size / W_r) * (W_r / size): the window's mean loss itself
        return self.micro_batch(size)

    def window(self, count: int) -> float:
        """Factor on this replica's gradient once its window held ``count`` samples."""
        if self.loss_reduction == 'mean' and self.replica_reduction == 'sum' and count:
            return self.window_norm / count
        return 1.0

    def update(self, count: int) -> float:
        """Factor on the reduced gradient once the whole update held ``count`` samples."""
        if self.loss_reduction == 'mean' and self.replica_reduction == 'mean' and count:
            return self.update_norm / count
        return 1.0


def writable_in_place(array: Any) -> bool:
    """Whether writing ``array`` in place writes each of its elements once: it is not
    read-only (numpy) and no two of its indices share memory (no zero stride).

    Chainer's backward hands a parameter that is only summed whole (``F.sum(W)``,
    ``F.mean(W)``) a broadcast of one element as its gradient, read-only in numpy; CuPy
    has no read-only flag, and there each element's write would land on that one. (Runs
    for every parameter of every update on a GPU master: the strides first, the flags,
    a new object per look, only for numpy's arrays.)"""
    return 0 not in array.strides and (not isinstance(array, numpy.ndarray)
                                       or array.flags.writeable)


def scale_gradients(params: List[Tuple[str, chainer.Parameter]], factor: float) -> None:
    """Multiply the gradient of each of ``params`` by ``factor``: every array once.

    Two parameters may hold one gradient array (``F.sum(a + b)``: Add's backward hands
    ``gy`` to both), which scaling each parameter's gradient in place would scale twice;
    and a gradient may not be writable in place (:func:`writable_in_place`). So each
    array is scaled once, in place where it can be, else replaced by its scaled copy for
    every parameter that held it (one array still: in-place hooks of the optimizer act
    on it as under StandardUpdater). Call it with the parameters' device current."""
    done: Dict[int, Tuple[Any, Any]] = {}   # id(array) -> (array, its scaled self)
    for _, param in params:
        grad = param.grad
        if grad is None:
            continue
        seen = done.get(id(grad))
        if seen is None:
            if writable_in_place(grad):
                grad *= factor
                seen = (grad, grad)
            else:
                seen = (grad, grad * factor)
            done[id(grad)] = seen
        if seen[1] is not grad:
            param.grad = seen[1]


# --------------------------------------------------------------------------------------
# What a forward keeps from one call to the next, outside parameters and persistents

State = List[Tuple[str, chainer.Link, Dict[str, Any]]]


def kept_between_calls(model: chainer.Link, loss_func: Optional[Callable] = None,
                       copies: bool = False) -> State:
    """(path, link, its plain attributes) of every link of the model (and of ``loss_func``
    where it is a link of its own): what its forward may keep from one call to the next,
    as an RNN link keeps its state ``h``, ``c``. Plain: neither a parameter, a child link
    nor a persistent of the link (those travel as the model's state). ``copies``: a
    recurrent link's (one with ``reset_state``) dicts, lists and arrays as copies, which
    :func:`put_back` can set back where a call filled them in place."""
    links = list(model.namedlinks())
    if isinstance(loss_func, chainer.Link):
        known = {id(link) for _, link in links}
        links += [(f'(loss_func){path}', link) for path, link in loss_func.namedlinks()
                  if id(link) not in known]
    out = []
    for path, link in links:
        values = _plain(link)
        if copies and callable(getattr(link, 'reset_state', None)):
            values = {name: (copy.copy(value) if isinstance(
                value, (dict, list, numpy.ndarray)) else value)
                for name, value in values.items()}
        out.append((path, link, values))
    return out


def _plain(link: chainer.Link) -> Dict[str, Any]:
    skip = registered_names(link)
    return {name: value for name, value in vars(link).items() if name not in skip}


def put_back(state: State) -> None:
    """Set back the state a call left in recurrent links (``state`` as
    :func:`kept_between_calls` gives it, with ``copies``): what their ``reset_state``
    clears (Chainer's convention for links that keep state between calls: ``L.LSTM``'s
    ``h`` and ``c``). Each link with a ``reset_state`` is reset (and its children, where
    it resets them); each attribute that changed takes its value from before the call
    again (a dict, list or array filled in place, its contents). Where ``reset_state``
    raises (one that needs arguments), each Variable the call stored in that link is set
    back instead. Everything else stays as the call left it: a Variable or an array made
    once at the first call (a fixed projection, a mask), a flag, a counter (a link cannot
    tell a counter from a flag)."""
    after = [_plain(link) for _, link, _ in state]
    failed = set()
    for _, link, _ in state:
        reset = getattr(link, 'reset_state', None)
        if callable(reset):
            try:
                reset()
            except Exception:  # noqa: BLE001 - one that needs arguments: not Chainer's
                failed.add(id(link))
    for (_, link, before), left in zip(state, after):
        now = _plain(link)
        for name in set(left) | set(now):
            if id(link) in failed:
                changed = (holds_forward_output(left.get(name))
                           and left.get(name) is not before.get(name, _ABSENT))
            else:
                changed = now.get(name, _ABSENT) is not left.get(name, _ABSENT)
            if not changed:
                continue
            old = before.get(name, _ABSENT)
            if old is not _ABSENT:
                object.__setattr__(link, name, old)
            elif name in vars(link):
                delattr(link, name)


Stored = List[Tuple[str, chainer.Link, str, List[Any], List[Any]]]


def stored_outputs(state: State) -> Stored:
    """(path, link, name, variables, nodes) of the plain attributes that hold a Variable
    (or a tuple or list of them) a call stored since :func:`kept_between_calls` gave
    ``state``: weak references, to those Variables and to their graph nodes, which keep no
    graph alive (``L.Classifier`` keeps its last loss, whose graph holds the
    micro-batch's activations until its next call)."""
    out = []
    for path, link, before in state:
        for name, value in _plain(link).items():
            if value is not before.get(name, _ABSENT) and holds_forward_output(value):
                variables = _variables(value)
                out.append((path, link, name, [weakref.ref(v) for v in variables],
                            [weakref.ref(v.node) for v in variables]))
    return out


def read_again(stored: Stored, limit: int = 100_000) -> List[str]:
    """The attributes of ``stored`` (what one call stored) whose Variables the graph of
    what a later call stored there reaches: state the later call started from. The walk
    stops after ``limit`` nodes. A node gone is reached by no graph (one would keep it)."""
    out = []
    for path, link, name, before, nodes in stored:
        wanted = {id(node) for node in (ref() for ref in nodes) if node is not None}
        now = _variables(getattr(link, name, None))
        if not wanted or (len(now) == len(before)
                          and all(ref() is v for ref, v in zip(before, now))):
            continue   # nothing left to reach, or the same Variables: stored once
        todo = [v.node for v in now]
        seen = set()
        while todo and len(seen) < limit:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if id(node) in wanted:
                out.append(f'{path.rstrip("/")}/{name}')
                break
            creator = node.creator_node
            if creator is not None:
                todo.extend(n for n in creator.inputs if n is not None)
    return out


def _variables(value: Any) -> List[chainer.Variable]:
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _variables(item)]
    return [value] if isinstance(value, chainer.Variable) else []


_ABSENT = object()


def holds_forward_output(value: Any) -> bool:
    """A Variable that is not a parameter, or a tuple or list that holds one."""
    return any(not isinstance(v, chainer.Parameter) for v in _variables(value))


_NOT_LOADED = object()   # a key loading did not report (run_window)

#: the name every replica's own reporter gives the model (its links: ``(model)/path``);
#: the master names an update's values as the reporter current there names each link
#: (:meth:`mgpu_updater.ParallelAccumulatingUpdater._named`), as ``StandardUpdater``'s
#: model reporting into it would be named
MODEL_OBSERVER = '(model)'
#: the prefix of the updater's own keys (``(updater)/time/data``), named as the model is
UPDATER_KEYS = '(updater)'


def observers(reporter: chainer.Reporter, model: chainer.Link) -> None:
    """Name the model and its links (:data:`MODEL_OBSERVER`)."""
    reporter.add_observer(MODEL_OBSERVER, model)
    reporter.add_observers(MODEL_OBSERVER, model.namedlinks(skipself=True))


def _host(value: Any) -> Any:
    if isinstance(value, chainer.Variable):
        value = value.array
    if isinstance(value, chainer.get_array_types()):
        value = chainer.backend.CpuDevice().send(value)
        return float(value) if value.size == 1 else numpy.asarray(value, dtype=numpy.float64)
    return float(value)


def read_on_host(values: List[Any]) -> List[Any]:
    """``_host`` of each of ``values``, with one device-to-host read per GPU.

    Reading a GPU array on the host waits for the device to finish all the work queued
    before it; one read per window (not one per micro-batch and reported key) is the only
    time a replica's host waits for its device before the gradient reduction. The
    one-element arrays of each device are stacked (one kernel) and read together; a
    float32 value reads as the same float either way.
    """
    out: List[Any] = [None] * len(values)
    on_gpu: Dict[Any, List[Tuple[int, Any]]] = {}
    gpu_array = chainer.backends.cuda.ndarray
    for i, value in enumerate(values):
        if isinstance(value, chainer.Variable):
            value = value.array
        kind = type(value)
        if kind is numpy.ndarray and value.size == 1:   # the CPU's case, every update
            out[i] = float(value.item())
        elif kind is float:
            out[i] = value
        elif isinstance(value, gpu_array) and value.size == 1:
            on_gpu.setdefault(value.device.id, []).append((i, value))
        else:
            out[i] = _host(value)
    for device_id, items in on_gpu.items():
        xp = chainer.backends.cuda.cupy
        with xp.cuda.Device(device_id):
            stacked = xp.stack([a.reshape(()) for _, a in items])
        for (i, _), v in zip(items, stacked.get().tolist()):
            out[i] = float(v)
    return out


def keep_on_device(values: List[Any]) -> List[Any]:
    """Each of ``values`` as float64 where it is: a one-element array as a 0-dim float64
    array on its device (float16 sums would overflow), anything else as ``_host`` gives
    it. No host read; each array costs one kernel (the cast)."""
    out: List[Any] = []
    for value in values:
        if isinstance(value, chainer.Variable):
            value = value.array
        if isinstance(value, chainer.get_array_types()) and value.size == 1:
            out.append(value.reshape(()).astype(numpy.float64))
        else:
            out.append(_host(value))
    return out


class Replica:
    """One model replica with its loader, running ``accumulate_steps`` micro-batches.

    Args:
        name: how errors name this replica (``'replica 1 (@numpy)'``).
        chunking: run each loaded micro-batch as chunks of at most ``chunking.size``
            samples (None: whole); with ``chunking.auto``, halve that size and redo the
            window whenever it runs out of memory (:meth:`run_window`).
        keep_graphs: keep, when ``chainer.config.keep_graph_on_report`` is on, the
            Variables (with their graphs) that the window's first micro-batch reported,
            in :attr:`graph_roots` (the master does, for ``DumpGraph``).
        read_values: read the window's loss and reported values on the host at its end
            (:func:`read_on_host`, a wait for the device); False keeps them where they
            are, summed in float64 (the master of one host under ``nonfinite='ignore'``:
            nothing needs them on the host before the step, and ``chainer.report`` takes
            device arrays, as under StandardUpdater).
        one_of_many: whether other replicas share the update (workers, or MPI ranks):
            then its first window checks that the model kept the parameters and
            persistents it started with (:meth:`_check_unchanged`). Alone, with one
            micro-batch per window and no chunks, there is no mean to take: the model
            reports into the caller's reporter as under StandardUpdater
            (:meth:`direct_window`), and only its loss is read.
        before_read: called before that read (the master's group's ``settle``: its
            window ran after collectives that a dead peer could leave unfinished, and a
            host read would then wait for good).
        initialised_before: the lazy parameters were initialised before its first window
            (``pipelined``; implied by ``one_of_many``): one still without an array then
            must stay so (:meth:`_check_unset`).
    """

    def __init__(self, model: chainer.Link, loss_func: Optional[Callable],
                 loader: Loader, accumulate_steps: int, scaling: Scaling,
                 name: str = 'replica 0', keep_graphs: bool = False,
                 chunking: Chunking = Chunking(), read_values: bool = True,
                 one_of_many: bool = False,
                 before_read: Optional[Callable[[], None]] = None,
                 initialised_before: bool = False) -> None:
        self.model = model
        self.loss_func = loss_func if loss_func is not None else model
        self.loader = loader
        self.accumulate_steps = accumulate_steps
        self.scaling = scaling
        self.name = name
        self.keep_graphs = keep_graphs
        self.read_values = read_values
        self.before_read = before_read
        self.chunking = chunking
        self._index: Optional[ModelIndex] = None   # under chunking.auto (_Rewind)
        #: what the model held at the start of its first window (the update's values
        #: set: a replacement worker's persistents as the master's), until the first
        #: window that ran a micro-batch checked it (:meth:`_check_unchanged`); then None
        self._started_with: Optional[Tuple[Any, FrozenSet[str]]] = None
        self._check_start = one_of_many   # whether that is still to come
        #: parameters with no array when the replicas were copied (a lazy link no forward
        #: called): each window checks that they still have none (:meth:`_check_unset`)
        self._unset = ([(name, p) for name, p in unique_params(model) if p.array is None]
                       if one_of_many or initialised_before else [])
        #: one replica, one micro-batch, whole: :meth:`direct_window` (no mean to take)
        self.direct = not one_of_many and accumulate_steps == 1 and chunking == Chunking()
        self._loss_checked = False   # the first loss is checked (:meth:`_check_loss`)
        self._gradients_checked = False   # ... and the first gradient (_check_gradients)
        self._split_checked = False   # ... and the first chunked batch (check_split)
        #: whether a forward after a backward has had its full look (below): from then
        #: on, which gradient arrays the parameters hold is compared only
        self._forward_checked = False
        self._own_params: Optional[List[chainer.Parameter]] = None
        #: reported key -> Variable of the last window's first micro-batch (see keep_graphs)
        self.graph_roots: Dict[str, chainer.Variable] = {}
        #: parameters whose backward sets their gradient instead of adding to it
        #: (``@static_graph``): a window of several backward passes sums them itself
        self._set_by_backward = _set_by_backward(model)
        self._largest_batch = 0   # the most samples a loaded micro-batch held so far
        #: the master's links' plain attributes before its first window of several
        #: micro-batches, which looks for state carried between them (:meth:`_check_carried`)
        self._carried: Optional[State] = (
            kept_between_calls(model, loss_func)
            if keep_graphs and (accumulate_steps > 1 or splits(chunking)) else None)
        if self._set_by_backward and (accumulate_steps > 1 or splits(chunking)):
            _refuse_tied_across_static(model, name)
        self.reporter = chainer.Reporter()
        #: where :meth:`direct_window` reports what loading its batch reported, before
        #: the model reports (the updater's, which names the keys): None, nowhere
        self.publish_loaded: Optional[Callable[[Dict[str, Any]], None]] = None
        observers(self.reporter, model)
        #: several replicas: what the forward made once, looked at over its first windows
        self._made_once: Optional[Seen] = None
        self._one_of_many = one_of_many
        self.look_again()

    def look_again(self) -> None:
        """Start the look at what the forward makes once (:mod:`._made_once`; several
        replicas only) from the next window: a survivor's window that a worker's death
        abandoned (``max_worker_restarts``) counts for nothing."""
        if self._one_of_many:
            model, loss_func = self.model, self.loss_func
            self._made_once = Seen(lambda: kept_between_calls(model, loss_func),
                                   model.params)

    def run_window(self, loss_scale: Optional[float]) -> WindowResult:
        """Run up to ``accumulate_steps`` micro-batches, accumulating gradients.

        With a chunk size m, each loaded micro-batch runs as chunks of at most m samples;
        a chunk counts as a micro-batch of its own size below, so the update stays the
        same over the same samples. With ``chunking.auto``, an out-of-memory error
        (``MemoryError``, which CuPy's ``OutOfMemoryError`` is) in forward or backward
        discards the window's gradients and reports, frees memory, halves m (starting
        from the whole batch) and redoes the window from the same loaded micro-batches;
        m is kept for the windows after. One sample that does not fit is an error.

        The gradient is scaled as :class:`Scaling` says, here and nowhere else: each
        micro-batch back-propagates ``loss * scaling.micro_batch(b)`` (times the
        optimizer's own loss scale), and a short window's gradient is multiplied by
        ``scaling.window(count)``; the master applies ``scaling.update(count)``.
        Under ``loss_reduction='sum'`` the reported value that is the loss itself (the
        same Variable or array ``loss_func`` returned) adds up over the update instead of
        being averaged, so ``main/loss`` is the summed loss of the update's samples.
        """
        if self.direct:
            return self._direct(loss_scale)
        if self._check_start and self._started_with is None:
            self._started_with = _start_signature(self.model)
        self.loader.window_started()
        times = {'data': 0.0, 'compute': 0.0}   # seconds, added up over the attempts
        window = _Window(self.loader, self.name)
        rewind = None
        if self.chunking.auto:
            if self._index is None:   # found once: the window's start reads through it
                self._index = ModelIndex(self.model)
            rewind = _Rewind(self._index)
        while True:
            try:
                return self._attempt(window, loss_scale, times)
            except MemoryError as exc:
                if rewind is None:
                    raise
                self.chunking = self._halved(window, exc)
            # out of the except block: the failed attempt's arrays are unreachable now
            self.model.cleargrads()
            self.graph_roots = {}
            _free_memory(self.model)
            rewind.restore()

    def _attempt(self, window: '_Window', loss_scale: Optional[float],
                 times: Dict[str, float]) -> WindowResult:
        # The last update's gradients are cleared after the window's first forward, just
        # before its first backward: the order of Chainer's ``Optimizer.update``
        # (chainer/optimizer.py:874-876: ``loss = lossfun(...)``, then ``cleargrads()``).
        # Cleared before it, the forward ran about 2% slower on a 2-core Xeon VM, the whole
        # update 1.1% (bench/window_order.py; bench/results/window-order).
        # This loop runs once per micro-batch of every update, on every replica: where the
        # host decides the speed (a small model, a fast GPU) each microsecond here is one
        # StandardUpdater does not spend (bench/overhead.py). Hence one reporter scope per
        # window, plain clocks, and the checks of the first window only.
        clock = time.perf_counter
        cleared = False
        self.graph_roots = {}
        keep_graphs = self.keep_graphs and bool(chainer.config.keep_graph_on_report)
        count = 0
        # (key or None for the loss, value, factor): read on the host once, at the end
        terms: List[Tuple[Optional[str], Any, float]] = []
        weights: Dict[str, float] = {}
        summed: Dict[str, None] = {}
        epochs: List[EpochInfo] = []
        data = compute = 0.0
        scaling, model, reporter = self.scaling, self.model, self.reporter
        sum_loss = scaling.loss_reduction == 'sum'
        chunk = self.chunking.size
        largest = 0
        own_sum = _GradientSum(self._set_by_backward) if self._set_by_backward else None
        unchecked = not self._gradients_checked
        # what the first call stored, seen before the second (the first window that makes
        # several calls looks at it: _check_carried)
        first_stored = None
        # one reporter scope for the window, a fresh observation per micro-batch (what
        # Reporter.scope does, without its generator per micro-batch)
        outer = reporter.observation
        reporter.__enter__()
        try:
            for i in range(self.accumulate_steps):
                start = clock()
                batch = window.get(i)
                loaded = clock()
                data += loaded - start
                if batch is None:        # iterator exhausted: the window holds what it got
                    break
                size = batch.size
                if size > largest:
                    largest = size
                # what loading it reported (the iterator, the dataset, the converter):
                # in its first piece's values, where the model's of the same name win, as
                # they do under StandardUpdater (the converter reports first)
                from_loading = batch.reports
                if chunk is None or chunk >= size:
                    pieces: Any = ((size, batch.arrays),)
                else:
                    if not self._split_checked and check_split(
                            self.loader.convert_aside, batch.examples, batch.arrays, size,
                            chunk):
                        self._split_checked = True
                        self.loader.keep_examples = False
                    pieces = split(batch.arrays, size, chunk)
                for size, arrays in pieces:
                    observation: Dict[str, Any] = dict(from_loading) if from_loading else {}
                    # (weighted by the batch's samples, where a piece is less: below)
                    loading, from_loading = from_loading, None
                    reporter.observation = observation
                    if cleared:   # a call before this one in the window
                        if self._carried is not None and first_stored is None:
                            first_stored = stored_outputs(self._carried)
                        loss = self._forward_leaving_gradients(arrays)
                    else:
                        loss = self._forward(arrays)
                    if not self._loss_checked:
                        self._check_loss(loss)
                    if not cleared:
                        model.cleargrads()
                        cleared = True
                    # the leaves' stamps stay None
                    backward_scaled(loss, scaling.micro_batch(size), loss_scale)
                    if own_sum is not None:
                        own_sum.add()
                    if unchecked:
                        unchecked = self._check_gradients(loss)
                    loss_array = loss.array
                    terms.append((None, loss_array, size))
                    if keep_graphs:   # the first chunk's graphs only
                        keep_graphs = False
                        self.graph_roots = {k: v for k, v in observation.items()
                                            if isinstance(v, chainer.Variable)}
                    for key, value in observation.items():
                        weight = size
                        if loading is not None and loading.get(key, _NOT_LOADED) is value:
                            weight = batch.size   # what loading reported, not the model
                        if isinstance(value, chainer.Variable):
                            value = value.array
                        if sum_loss and value is loss_array:
                            summed[key] = None
                        terms.append((key, value, 1 if key in summed else weight))
                        weights[key] = weights.get(key, 0.0) + weight
                    del loss, loss_array
                compute += clock() - loaded
                count += batch.size
                epochs.append(batch.epoch)
        finally:
            reporter.__exit__(None, None, None)
            reporter.observation = outer
        times['data'] += data
        times['compute'] += compute
        if not cleared:   # no micro-batch: the window leaves no gradient
            model.cleargrads()
        if self._unset:
            self._check_unset()
        if own_sum is not None:
            own_sum.put()
        if count:
            if self._started_with is not None:
                self._check_unchanged()
            if first_stored is not None:   # the window made several calls
                self._check_carried(first_stored)
            factor = scaling.window(count)
            if factor != 1.0:
                scale_gradients(unique_params(model), factor)   # a tied one once
        # the size in force: a short batch (the last of a pass) does not make it smaller
        self._largest_batch = max(self._largest_batch, largest)
        micro_batch_size = (min(chunk, self._largest_batch) if chunk is not None
                            else self._largest_batch) if count else None
        loss_sum: Any = 0.0
        sums: Dict[str, Any] = {}
        values = [t[1] for t in terms]
        if self.read_values and self.before_read is not None:
            self.before_read()
        try:
            values = read_on_host(values) if self.read_values else keep_on_device(values)
        except (TypeError, ValueError) as exc:
            raise self._unreadable_report(terms, exc) from exc
        for (key, _, factor), value in zip(terms, values):
            if key is None:
                loss_sum = loss_sum + value * factor
            else:
                sums[key] = sums.get(key, 0.0) + value * factor
        made_once = None
        if count and self._made_once is not None:
            made_once = self._made_once.window_ended()
            if made_once is not None:
                self._made_once = None
        return WindowResult(
            count=count,
            loss_sum=loss_sum,   # a float, or a 0-dim array when kept on the device
            sums=sums,
            weights=weights, times=dict(times), epochs=epochs,
            summed=tuple(summed), micro_batch_size=micro_batch_size,
            loading=self.loader.mode, chunk_limit=chunk, made_once=made_once)

    def _direct(self, loss_scale: Optional[float]) -> WindowResult:
        """:meth:`direct_window` as a :class:`WindowResult` (a pipelined master alone)."""
        size, value, epoch, data, compute = self.direct_window(loss_scale)
        mode = self.loader.mode
        if not size:
            return WindowResult(0, 0.0, {}, {}, {'data': data, 'compute': 0.0}, [],
                                loading=mode)
        if not self.read_values:   # summed as every window's values are (float16 overflows)
            value = keep_on_device([value])[0]
        return WindowResult(size, value * size, {}, {}, {'data': data, 'compute': compute},
                            [epoch], (), size, loading=mode)

    def direct_window(self, loss_scale: Optional[float],
                      live_epoch: bool = False) -> DirectWindow:
        """The window of one replica, one whole micro-batch: StandardUpdater's update up
        to the step, no more. The model reports into the caller's reporter (the Trainer's,
        as under StandardUpdater: the values as reported, Variables included, graphs
        kept under ``keep_graph_on_report``), so only the loss is read, on the host as
        every window's is (``read_values``). Returns ``(samples, loss, epoch, data
        seconds, compute seconds)``, a plain tuple; no samples once the iterator is
        exhausted. ``live_epoch``: as for :meth:`Loader.get` (the caller's stepping now,
        with no window of this replica before the next). Where the host decides the
        speed, every call and object saved here is one StandardUpdater does not make
        (``bench/overhead.py``)."""
        self.loader.window_started()
        clock = time.perf_counter
        start = clock()
        try:
            # (loaded here, it reports into the caller's reporter, as the model does)
            batch = self.loader.get(live_epoch, True)
        except RepeatingIteratorStopped as exc:
            raise RuntimeError(f'{self.name}: {exc}') from exc
        loaded = clock()
        if batch is None:
            self.model.cleargrads()   # no micro-batch: no gradient
            return 0, 0.0, None, loaded - start, 0.0
        if batch.reports and self.publish_loaded is not None:
            self.publish_loaded(batch.reports)   # first: the model's of a name win
        arrays = batch.arrays
        func = self.loss_func
        if isinstance(arrays, tuple):
            loss = func(*arrays)
        elif isinstance(arrays, dict):
            loss = func(**arrays)
        else:
            loss = func(arrays)
        if not self._loss_checked:
            self._check_loss(loss)
        self.model.cleargrads()
        size = batch.size
        # the leaves' stamps stay None
        backward_scaled(loss, self.scaling.whole_window(size), loss_scale)
        loss_array = loss.array
        if not self._gradients_checked:
            self._check_gradients(loss)
        del loss
        if self._unset:   # pipelined: its parameters are stepped from the update before
            self._check_unset()
        if not self.read_values:
            value = loss_array   # as it is: only the step's late check looks at it
        elif type(loss_array) is numpy.ndarray:
            value = float(loss_array.item())   # the CPU's case: read_on_host's, inline
        else:
            value = read_on_host([loss_array])[0]
        return size, value, batch.epoch, loaded - start, clock() - loaded

    def _halved(self, window: '_Window', exc: MemoryError) -> Chunking:
        current = window.chunk_size(self.chunking.size)
        if current is None or current <= 1:
            raise MemoryError(
                f'{self.name}: one sample alone does not fit in memory (out of memory in '
                f'forward or backward with micro_batch_size=1: {exc}); use a smaller model '
                'or input, float16, or a device with more memory') from exc
        return self.chunking._replace(size=current // 2)

    def _forward_leaving_gradients(self, arrays: Any) -> chainer.Variable:
        """:meth:`_forward` where a backward of the window ran before it: raise if it
        changed the parameters' gradients (a forward that calls ``cleargrads()`` and
        ``backward()`` itself, to read a gradient, now and then). Under
        ``StandardUpdater`` the optimizer clears what a forward left there; here the
        gradients the window summed so far are there, and such a forward would change
        them. The first time, each gradient's array and sum are compared (a backward
        without ``cleargrads()`` adds in place); then the arrays only (a few
        microseconds a micro-batch, no read of a device)."""
        full = not self._forward_checked
        if self._own_params is None:   # found once (a walk of the links costs ~50 us)
            # not those of @static_graph links: their schedule sets their gradients in
            # its forward too, and the window sums those after each backward (_GradientSum)
            static = {id(p) for p in self._set_by_backward}
            self._own_params = [p for _, p in unique_params(self.model)
                                if id(p) not in static]
        marks = _gradient_marks(self._own_params, full)
        loss = self._forward(arrays)
        if _gradient_marks(self._own_params, full) != marks:
            raise RuntimeError(
                f'{self.name}: the forward ({_describe(self.loss_func)}) changed the '
                "parameters' gradients (it calls backward() or cleargrads() itself, e.g. "
                'to read a gradient norm). Under StandardUpdater the optimizer clears what '
                'a forward leaves there; here, with several micro-batches a window '
                '(accumulate_steps > 1, micro_batch_size), the gradients of its earlier '
                'micro-batches are there during the later forwards, and would change. '
                'Compute such a gradient with chainer.grad(...), which leaves param.grad '
                'as it is, or use accumulate_steps=1 and micro_batch_size=None')
        self._forward_checked = True
        return loss

    def _forward(self, arrays: Any) -> chainer.Variable:
        try:
            if isinstance(arrays, tuple):
                return self.loss_func(*arrays)
            if isinstance(arrays, dict):
                return self.loss_func(**arrays)
            return self.loss_func(arrays)
        except KeyError as exc:
            if not is_unregistered_observer_error(exc):   # a link of another model reported
                raise
            if isinstance(self.loss_func, chainer.Link) and any(
                    link is self.model for link in self.loss_func.links(skipself=True)):
                raise RuntimeError(
                    f'{self.name}: loss_func ({_describe(self.loss_func)}) is a link around '
                    f'the model (the optimizer\'s target, {_describe(self.model)}, is one of '
                    'its links) and reported through a link that is not the model\'s, so '
                    'no reporter of a replica knows it. Set the optimizer up on '
                    f'{_describe(self.loss_func)} and pass no loss_func, as Chainer\'s '
                    'examples do; to train a part of it only, call disable_update() on the '
                    'others') from exc
            raise RuntimeError(
                f'{self.name}: loss_func ({_describe(self.loss_func)}) reported through a '
                'link that is not part of this replica\'s model, so it computes with a '
                f'different copy of the model. {_LOSS_FUNC_FIX}') from exc

    def _check_loss(self, loss: Any) -> None:
        """The first loss of the replica is a floating-point Variable of one element, or
        an error that names ``loss_func`` and says what it returned."""
        what = None
        if not isinstance(loss, chainer.Variable):
            text = repr(loss)
            what = (f'{type(loss).__name__} {text[:60] + "..." if len(text) > 60 else text}'
                    ', not a chainer.Variable: return the loss as a Variable computed from '
                    'the model (e.g. F.softmax_cross_entropy(y, t)); a number or an array '
                    'has no graph to back-propagate')
        elif loss.size != 1:
            what = (f'a Variable of shape {loss.shape}, not one value: reduce it to a '
                    "scalar (F.mean; or F.sum with loss_reduction='sum')")
            if loss.grad is not None:
                what += ('; the gradient set on it (loss.grad) weights its elements, '
                         "summed: return F.sum(w * loss) with loss_reduction='sum'")
        elif numpy.dtype(loss.dtype).kind != 'f':
            what = (f'a Variable of dtype {numpy.dtype(loss.dtype).name}: a loss must be '
                    'floating point (float16, float32 or float64) to be back-propagated')
        if what is not None:
            raise TypeError(f'{self.name}: loss_func ({_describe(self.loss_func)}) '
                            f'returned {what}')
        self._loss_checked = True

    def _check_unchanged(self) -> None:
        """After the first window: the model holds the parameters and array persistents
        it started with (names, shapes, dtypes). A link created inside ``forward`` (in
        ``init_scope``, on the first call) gets each replica's own random values, and no
        collective carries it, so the replicas would train apart, silently."""
        (before, numbers), self._started_with = self._started_with, None
        self._check_start = False
        # a persistent that held a number may hold a 0-d array now (``x = x + xp.sum(...)``
        # on a GPU): it travels as the number did (_flat_buffers.ModelLayouts.values); one
        # it made an array of another shape (each replica's own statistic) is compared
        now = tuple(entry for entry in model_signature(self.model)
                    if not (entry[0] in numbers and entry[1][0] == ()))
        if now == before:
            return
        old, new = dict(before), dict(now)
        added = sorted(set(new) - set(old))
        gone = sorted(set(old) - set(new))
        changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
        parts = [f'{label} {names}' for label, names in (
            ('new', added), ('removed', gone), ('reshaped or retyped', changed)) if names]
        arrays = {name for name, _ in persistent_arrays(self.model)}
        if added and set(added) <= arrays and not gone and not changed:
            raise RuntimeError(
                f'{self.name}: its model changed during its first update: the persistents '
                f'{added} held no array (None, or a number) or were not yet registered '
                'when the replicas were copied and became arrays in the forward, where '
                'each replica gives them its own '
                'values and no update can carry arrays it did not start with. Give them '
                'their arrays in __init__ '
                "(self.add_persistent('buf', numpy.zeros(n, 'f')); a link of Chainer's: "
                'its size, L.BatchNormalization(n))')
        if changed and not added and not gone and set(changed) <= arrays:
            raise RuntimeError(
                f'{self.name}: its forward changed the shape or dtype of the persistents '
                f'{changed} during its first update: each update carries every persistent '
                'between the replicas in a slot of the shape and dtype it had when they '
                'were built. Give such a persistent its full shape and dtype in __init__ '
                '(a buffer of fixed size that the forward fills)')
        raise RuntimeError(
            f'{self.name}: its model changed during its first update '
            f'({"; ".join(parts)}). A link created inside forward (for example in '
            'init_scope on the first call) gets each replica\'s own initial values, and no '
            'replica shares it, so the replicas would train apart. Create every link in '
            '__init__; where a size is known only at the first call, give it as None '
            '(L.Linear(None, n)): such parameters are initialised by one forward pass on '
            'the master before the workers start, so every replica starts the same')

    def _check_carried(self, first_stored: Stored) -> None:
        """After the first window of several calls: warn where a link's forward stored a
        Variable in a plain attribute (an RNN link's state) that the next call started
        from, though it came from other samples."""
        self._carried = None
        stored = read_again(first_stored)
        if stored:
            warn(
                f'{self.name}: the forward starts from state it stored at its last call, in '
                f'{stored} (as L.LSTM keeps h and c). Each update calls the model once per '
                'micro-batch (accumulate_steps, micro_batch_size), so a micro-batch starts '
                'from the state the one before it left, over other samples, where '
                "StandardUpdater's one call per update starts from the last update's: the "
                "update is not StandardUpdater's. Reset it in the forward "
                '(link.reset_state()), or train with one micro-batch per update',
                RuntimeWarning, stacklevel=2)

    def _check_unset(self) -> None:
        """A parameter without an array when the replicas were copied has none yet: no
        replica shares one that its own call initialised (with its own random values)."""
        now = [name for name, p in self._unset if p.array is not None]
        if now:
            raise RuntimeError(
                f'{self.name}: parameters {now} were still uninitialised when the replicas '
                'were copied (the forward pass that initialises lazy parameters on the '
                'master, in test mode, chainer.config.train False, did not call their '
                'links) and this update\'s forward initialised them: each replica would '
                'give them its own initial values, and no update shares them (nor, under '
                'pipelined=True, steps them on the gradient of the update before). A link '
                'that only training mode or some inputs reach needs its input size '
                '(L.Linear(784, n), not L.Linear(None, n))')

    def _unreadable_report(self, terms: List[Tuple[Optional[str], Any, float]],
                           exc: Exception) -> Exception:
        """The error for a reported value that is no number (a string, None): it names
        the key, which the conversion's own error does not."""
        for key, value, _ in terms:
            try:
                _host(value)
            except (TypeError, ValueError):
                text = repr(value)
                if key is not None and key.startswith(MODEL_OBSERVER):   # as a Trainer names it
                    key = 'main' + key[len(MODEL_OBSERVER):]
                return TypeError(
                    f'{self.name}: {"the loss" if key is None else repr(key)} was reported '
                    f'as {type(value).__name__} '
                    f'{text[:60] + "..." if len(text) > 60 else text}, which cannot be '
                    'averaged over the replicas and micro-batches: report numbers, '
                    'one-element arrays or Variables (chainer.report), and anything else '
                    'from an extension')
        return exc

    def _check_gradients(self, loss: chainer.Variable) -> bool:
        """After a backward of ``loss`` that left no parameter with a gradient: raise if it
        was computed with another model (checked until the first backward that gave this
        model a gradient: the loss_func's binding does not change). A loss that reached no
        parameter at all (a constant: a detection loss over images without objects) leaves
        no gradient, as under ``StandardUpdater``, whose step then sees zeros; the next
        backward is checked instead. Returns whether the check is still to be made."""
        if any(p.grad is not None for p in self.model.params()):
            self._gradients_checked = True
            return False
        if chainer.config.enable_backprop and not _reaches_a_parameter(loss, self.model):
            return True
        if not chainer.config.enable_backprop:
            raise RuntimeError(
                f'{self.name}: no parameter of its model got a gradient from this update\'s '
                'micro-batches: chainer.config.enable_backprop is False (training inside '
                'chainer.no_backprop_mode(), or enable_backprop set so), so no graph was '
                'built to back-propagate through. Train with backprop enabled')
        raise RuntimeError(
            f'{self.name}: no parameter of its model got a gradient from this update\'s '
            f'micro-batches, so its share of the gradient would be zeros. Most likely '
            f'loss_func ({_describe(self.loss_func)}) computes with a different copy of the '
            f'model than this replica\'s. {_LOSS_FUNC_FIX}')


def _reaches_a_parameter(loss: chainer.Variable, model: chainer.Link) -> bool:
    """Whether the graph of ``loss`` has a :class:`chainer.Parameter` among its leaves (of
    whichever model), or is one, or has a node whose inputs do not list the parameters it
    reaches: a ``@static_graph`` schedule, or ``F.forget`` of a function that reaches
    another link than ``model``'s (:func:`_reaches_another_model`)."""
    if isinstance(loss, chainer.Parameter):
        return True
    stack = [loss.creator_node]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if is_static_graph_machinery(type(node)):
            return True
        forgotten = forgotten_function(node)
        if forgotten is not None and _reaches_another_model(forgotten, model):
            return True
        seen.add(id(node))
        for leaf_or_not in node.inputs:
            if leaf_or_not.creator_node is not None:
                stack.append(leaf_or_not.creator_node)
            elif isinstance(leaf_or_not.get_variable_or_none(), chainer.Parameter):
                return True
    return False


def _reaches_another_model(func: Any, model: chainer.Link) -> bool:
    """Whether ``func`` reaches a :class:`chainer.Link` or :class:`chainer.Parameter` that
    is not ``model``'s, within a few links: a bound method's object, a function's closure,
    defaults and the globals its code names (and the functions found there), a partial's
    arguments, an object's attributes, small containers. (A forgotten function that
    reaches only the replica's own model ran with it: no gradient then means a constant.)"""
    own = {id(link) for link in model.links()} | {id(p) for p in model.params()}
    layer, seen, budget = [func], set(), 500
    for _ in range(5):
        following: List[Any] = []
        for obj in layer:
            if id(obj) in seen or budget <= 0:
                continue
            seen.add(id(obj))
            budget -= 1
            if isinstance(obj, (chainer.Link, chainer.Parameter)):
                if id(obj) not in own:
                    return True
                continue   # the model's own: what it holds is the model's too
            following += _parts_of(obj)
        layer = following
    return False


def _parts_of(obj: Any) -> List[Any]:
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, numpy.ndarray,
                                       types.ModuleType, type, chainer.Variable)):
        return []
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    code = getattr(obj, '__code__', None)
    if isinstance(obj, types.FunctionType) and code is not None:
        found = [c.cell_contents for c in obj.__closure__ or () if cell_is_set(c)]
        found += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        return found + [obj.__globals__[n] for n in set(global_names(code))
                        if n in obj.__globals__]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj) if len(obj) <= 64 else []
    if isinstance(obj, dict):
        return list(obj.values()) if len(obj) <= 64 else []
    attributes = getattr(obj, '__dict__', None)
    return list(attributes.values()) if isinstance(attributes, dict) else []


_LOSS_FUNC_FIX = (
    'Whatever the loss_func holds that is the model or one of its links (itself, a '
    'method, a closure, a partial, an attribute, a global of the script itself) means the '
    'replica in each worker; one that reaches the model another way (a global of an '
    'imported module) computes with that module\'s own copy in the worker. Hold the model '
    'in loss_func, or pass a function of the model\'s outputs')


def _gradient_marks(params: List[chainer.Parameter], full: bool) -> List[Any]:
    """Each parameter's gradient: which array, and (``full``) its sum, read on the host
    (NaN as a string: one NaN sum is not unequal to another)."""
    if not full:
        return [id(p.grad) for p in params]
    return [None if p.grad is None else (id(p.grad), _equal_if_nan(float(p.grad.sum())))
            for p in params]


def _equal_if_nan(value: float) -> Any:
    return value if value == value else 'nan'


def _set_by_backward(model: chainer.Link) -> List[chainer.Parameter]:
    """The parameters of the model's ``@static_graph`` links, each once."""
    found: Dict[int, chainer.Parameter] = {}
    for link in static_graph_links(model):
        for param in link.params():
            found.setdefault(id(param), param)
    return list(found.values())


def _refuse_tied_across_static(model: chainer.Link, name: str) -> None:
    """Raise where a parameter of a ``@static_graph`` link is also one of a link outside
    every static one: each backward through the static link sets its gradient, dropping
    what the other link added, so no sum over backward passes is the whole batch's."""
    links = static_graph_links(model)
    static = {id(link) for link in links}
    held = {id(p) for link in links for p in link.params()}
    named = list(model.namedlinks())
    roots = [path.rstrip('/') + '/' for path, link in named if id(link) in static]

    def inside(path: str) -> bool:   # at or under a static link's path
        return any((path.rstrip('/') + '/').startswith(root) for root in roots)

    # a parameter of a static link's that a link outside registers (also the very link,
    # registered outside too: ``self.head = self.body.l2``)
    tied = sorted(path.rstrip('/') + sub for path, link in named if not inside(path)
                  for sub, p in link.namedparams() if sub.count('/') == 1 and id(p) in held)
    if tied:
        raise ValueError(
            f'{name}: parameters {tied} are registered both in a @static_graph link and '
            'outside it. Each backward through the static link sets their gradient, '
            "dropping what the other link added, so a window of several backward passes "
            '(accumulate_steps > 1, micro_batch_size) cannot sum them to the whole '
            "batch's: use accumulate_steps=1 and micro_batch_size=None, or tie them inside "
            'the static link only')


class _GradientSum:
    """A window's gradient of parameters whose every backward sets it instead of adding
    to it (``@static_graph``: :func:`mgpu_updater._chainer_private.static_graph_links`):
    summed here after each backward, and put back at the window's end, so that the window
    holds the sum over its micro-batches, as for every other parameter."""

    def __init__(self, params: List[chainer.Parameter]) -> None:
        self.params = params
        self.sums: List[Any] = [None] * len(params)

    def add(self) -> None:
        for i, param in enumerate(self.params):
            grad = param.grad
            if grad is None:
                continue
            if self.sums[i] is None:
                self.sums[i] = grad.copy()
            else:
                self.sums[i] += grad

    def put(self) -> None:
        for param, total in zip(self.params, self.sums):
            if total is not None:
                param.grad = total


def model_signature(model: chainer.Link) -> Tuple[Tuple[str, Tuple[Any, ...]], ...]:
    """(name, (shape, dtype)) of every parameter (each once) and array persistent."""
    out = [(name, (None if p.array is None else tuple(p.array.shape),
                   None if p.array is None else numpy.dtype(p.array.dtype).str))
           for name, p in unique_params(model)]
    out += [(name, (tuple(a.shape), numpy.dtype(a.dtype).str))
            for name, a in persistent_arrays(model)]
    return tuple(sorted(out))


def _start_signature(model: chainer.Link) -> Tuple[Any, FrozenSet[str]]:
    """:func:`model_signature`, and the persistents that hold a number (not None)."""
    numbers = frozenset(path for path, value in ModelIndex(model).persistent_scalars().items()
                        if value is not None)
    return model_signature(model), numbers


def copy_signature(model: chainer.Link) -> Tuple[Any, ...]:
    """What a replica's copy of ``model`` must hold alike: :func:`model_signature`, and
    which parameters hold one array (:attr:`ModelIndex.aliases`). A tie (``self.l3.W =
    self.l1.W``) is one entry of the signature: broken, it is two."""
    return model_signature(model), tuple(sorted(ModelIndex(model).aliases.items()))


def copy_difference(model: Tuple[Any, ...], replica: Tuple[Any, ...]) -> Optional[str]:
    """How a copy's :func:`copy_signature` differs from its model's, in words, or None.

    Every replica lays out its buffers from its own copy: a parameter the copy lacks (a
    link rebuilt from its constructor's arguments by its ``__reduce__`` lacks what was
    added to it after), or a tie the copy broke, shifts every parameter after it, and the
    summed gradients land on the wrong parameters, silently."""
    if model == replica:
        return None
    old, new = dict(model[0]), dict(replica[0])
    parts = [f'{label} {names}' for label, names in (
        ('only in the model:', sorted(set(old) - set(new))),
        ('only in the copy:', sorted(set(new) - set(old))),
        ('other shapes or dtypes:', sorted(k for k in set(old) & set(new)
                                           if old[k] != new[k]))) if names]
    if model[1] != replica[1]:
        parts.append(f'parameters holding one array: {list(model[1])} in the model, '
                     f'{list(replica[1])} in the copy')
    return ('the copy of the model for the worker processes differs from the model ('
            + '; '.join(parts) + '). Every replica must hold the same parameters and '
            'persistents (names, shapes, dtypes, ties) for the gradients summed over them '
            'to land where they belong. A link whose __reduce__, __getstate__ or '
            '__deepcopy__ rebuilds it from its constructor\'s arguments leaves out what was '
            'added to it after (add_param, add_persistent, a tie such as l3.W = l1.W): '
            'let such a link be copied whole (drop the method, or carry its __dict__ in it)')


def _describe(func: Any) -> str:
    text = getattr(func, '__qualname__', None) or type(func).__name__
    return text if len(text) <= 80 else text[:77] + '...'


class _Window:
    """The micro-batches of one window, loaded once: a redone window reuses them."""

    def __init__(self, loader: Loader, name: str) -> None:
        self.loader = loader
        self.name = name   # the replica's, for errors
        self.batches: List[Batch] = []
        self.exhausted = False

    def get(self, i: int) -> Optional[Batch]:
        if i < len(self.batches):
            return self.batches[i]
        if self.exhausted:
            return None
        try:
            batch = self.loader.get()
        except RepeatingIteratorStopped as exc:
            raise RuntimeError(f'{self.name}: {exc}') from exc
        if batch is None:
            self.exhausted = True
        else:
            self.batches.append(batch)
        return batch

    def chunk_size(self, size: Optional[int]) -> Optional[int]:
        """The most samples one forward held: ``size``, or the largest batch."""
        largest = max((b.size for b in self.batches), default=None)
        if size is None or largest is None:
            return largest
        return min(size, largest)


class _Rewind:
    """What a window's forwards move besides the gradients, as it was before the window,
    for an attempt that ran out of memory: the model's persistents (BatchNorm's running
    statistics and counter moved by the failed forwards, which the attempt redone moves
    again) and the host's random states (numpy's and Python's: dropout draws the same
    masks again). CuPy's generator has no state to read back: on a GPU a redone window's
    dropout draws anew. Taken at each window's start under ``micro_batch_size='auto'``
    only (a copy of the persistents, a few microseconds for BatchNorm's)."""

    def __init__(self, index: ModelIndex) -> None:
        self.persistents = KeptPersistents(index)
        self.numpy_random = numpy.random.get_state()
        self.python_random = random.getstate()

    def restore(self) -> None:
        self.persistents.restore()
        numpy.random.set_state(self.numpy_random)
        random.setstate(self.python_random)


def _free_memory(model: chainer.Link) -> None:
    """Give back what a failed attempt held: garbage, and CuPy's cached blocks."""
    gc.collect()
    if model.xp is not numpy:
        model.xp.get_default_memory_pool().free_all_blocks()


def combine(results: List[WindowResult]) -> Dict[str, Any]:
    """The sample-weighted mean of every reported value over all replicas' windows; the
    sum for the keys a replica marked ``summed`` (the loss under ``loss_reduction='sum'``)."""
    if len(results) == 1:   # one replica: every update of one device
        r = results[0]
        summed_keys, weights_of = r.summed, r.weights
        return {key: value if key in summed_keys else value / weights_of[key]
                for key, value in r.sums.items() if weights_of[key] > 0}
    first = results[0]
    sums: Dict[str, Any] = {key: 0.0 + value for key, value in first.sums.items()}
    weights: Dict[str, float] = {key: 0.0 + first.weights[key] for key in sums}
    summed = set(first.summed)
    for r in results[1:]:   # (each update of several replicas, on the master)
        if r.summed:
            summed.update(r.summed)
        their_weights = r.weights
        for key, value in r.sums.items():
            if key in sums:   # (not +=: that would write into an array in place)
                sums[key] = sums[key] + value
                weights[key] = weights[key] + their_weights[key]
            else:
                sums[key] = 0.0 + value
                weights[key] = 0.0 + their_weights[key]
    return {key: value if key in summed else value / weights[key]
            for key, value in sums.items() if weights[key] > 0}


class AggregatedOverUpdate(chainer.FunctionNode):
    """A node that outputs the update's aggregate of a reported value.

    Its input is what the master's first micro-batch reported (with its graph), so
    ``DumpGraph`` draws the model's graph of that micro-batch, ending in this node, while
    the value that ``LogReport`` averages is exactly the aggregate over the update.
    It only exists to be looked at: backward through it is refused.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        device = chainer.backend.get_device_from_array(inputs[0])
        value = self.value
        if not isinstance(value, chainer.get_array_types()):
            value = numpy.asarray(value)
        return device.send(value),

    def backward(self, indexes: Tuple[int, ...], grad_outputs: Tuple[Any, ...]) -> Any:
        raise RuntimeError('AggregatedOverUpdate is a reported value, not part of the '
                           'loss: do not back-propagate through it')


def with_graph(root: chainer.Variable, value: Any) -> chainer.Variable:
    """``value`` as a Variable whose graph is ``root``'s, for extensions that read graphs
    (``DumpGraph``; anything relying on ``chainer.config.keep_graph_on_report``)."""
    with chainer.force_backprop_mode():
        out, = AggregatedOverUpdate(value).apply((root,))
    return out


def total_loss(results: List[WindowResult]) -> float:
    return mean_loss([(r.count, r.loss_sum) for r in results])


def mean_loss(windows: List[Tuple[int, Any]]) -> Any:
    """The mean loss of windows given as (samples, loss sum), summed in their order (NaN
    without a sample): the one home of this arithmetic (the board's posts use it too,
    :func:`mgpu_updater._local.board.posted_total`)."""
    count = sum(c for c, _ in windows)
    if count == 0:
        return math.nan
    return sum(loss for _, loss in windows) / count

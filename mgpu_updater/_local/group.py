"""Worker processes on this host, one per extra device: the master's side.

:class:`LocalGroup` starts the workers (:mod:`.pool`), runs the master's half of the local
protocol (:mod:`.protocol`) every update, and closes them. :func:`payload_factory` pickles
what each worker needs (:mod:`mgpu_updater._payload`).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import chainer
import numpy

from .. import _cuda, _payload
from .. import comm as comm_module
from .._checkpoint import capture_state
from .._flat_buffers import ModelLayouts, grad_arrays, overlapping
from .._groups import Group, ReduceHandle, ensure_grads
from .._module_globals import warn as warn_module_differences
from .._replica import WindowResult
from .._restarts import RestartLog, not_restarted_at_start
from .._threads import available_cores
from ..errors import WorkerError
from .board import STORE_ORDER, Board, announces_packs, spin_for
from .pool import WorkerPool
from .protocol import (Joining, Rejoin, Rejoined, State, StateRequest, Step, broadcast_only,
                       master_begin, master_finish, slot_views)
from .recovery import Recovery
from .resume import Records, ResumePoint
from .worker import ProcessSetup, WorkerInit, main as worker_main


class LocalGroup(Group):
    """Worker processes on this host, one per extra device.

    Each update runs the master's half of :mod:`mgpu_updater._local.protocol`: :meth:`begin` is
    :func:`~mgpu_updater._local.protocol.master_begin`, :meth:`finish` and :meth:`finish_async`
    are :func:`~mgpu_updater._local.protocol.master_finish`, all on the calling thread, with
    the master's device current (its kernels on the buffers run on the stream that the
    collectives are ordered with). The master's host waits for its collectives, bounded and
    watching the workers (:meth:`settle`), before it reads anything on the host during an
    update: its window's values, and after the reductions, before the step. With
    ``restarts`` (``max_worker_restarts``), a worker that dies in them is replaced and the
    update redone (:mod:`.recovery`) before they return.
    """

    def __init__(self, model: chainer.Link, layouts: ModelLayouts, backend: str,
                 master_device: Any, devices: List[Any], payloads: Dict[int, 'Payload'],
                 start_method: str, start_timeout: float,
                 stall_warning: Optional[float] = None,
                 update_timeout: Optional[float] = None,
                 restarts: Optional[RestartLog] = None,
                 detached: Optional['Detached'] = None) -> None:
        self.size = len(devices)
        self.model = model
        self.layouts = layouts
        # first: its stack folder needs a usable temporary directory, and where there is
        # none nothing else is made yet (the segments below were left behind)
        self.pool = WorkerPool(devices, start_method, stall_warning, update_timeout)
        try:
            self.comm, handle = comm_module.create(
                backend, self.size, layouts.spec(), master_device,
                broadcast=broadcast_only(layouts), timeout=start_timeout)
        except BaseException:
            self.pool.close()
            raise
        #: the ranks' board (:mod:`.board`): where every rank says its gradient is packed
        #: (:func:`.board.announces_packs`) on the shared-memory backend; None: the pipes
        #: alone
        self.board: Optional[Board] = None
        try:
            self.grads = SummedGrads(layouts, self.comm, model)
            self.params = SlotParams(layouts, self.comm, model, detached)
            if self.comm.packs_in_shared_memory and STORE_ORDER:
                self.board = Board.create(self.size, spin_for(self.size, available_cores()))
        except BaseException:
            self.close(abort=True)
            raise
        #: whether every rank says at the board that its gradient is packed (decided here,
        #: for the workers too: :func:`.board.announces_packs`)
        self.announce_packs = announces_packs(self.board)
        board = self.board.name if self.board is not None else None
        segments = self.comm.owned_segments + ([board] if board is not None else [])
        self._started = False
        #: under ``max_worker_restarts``: what replaces a worker that died (None: nothing)
        self.recovery: Optional[Recovery] = None
        self._sent: Optional[Step] = None   # ... and the update's Step, to send again
        self._stepped = False
        #: a death the master's wait in its window found (:meth:`settle`), recovered in
        #: its half after the window
        self._death: Optional[WorkerError] = None
        try:
            self.comm.watch_peers(self._check_workers)   # NCCL checks it while it waits
            data = _pickled(payloads, handle, board, self.announce_packs)
            if restarts is not None:
                self.recovery = Recovery(
                    restarts, Records({r: ResumePoint(capture_state(p.iterator))
                                       for r, p in payloads.items()}),
                    self.pool, self.comm, self.board,
                    payload=lambda r, point, size, renewed: payloads[r](
                        renewed, board, self.announce_packs, resume=point, chunk_size=size),
                    start=lambda data, survivors, renewed: self._replace(
                        data, segments, start_timeout,
                        self._rejoiner(sorted(data), survivors, renewed, start_timeout)))
            readies = self.pool.start(worker_main, data, segments, start_timeout,
                                      before_ready=self._joiner(start_timeout))
            self._started = True
            warn_module_differences({r: d for r, d in readies.items() if d}, stacklevel=6)
        except WorkerError as exc:
            self.close(abort=True)
            if restarts is None:
                raise
            raise not_restarted_at_start(exc) from exc
        except BaseException:
            self.close(abort=True)
            raise

    def _replace(self, data: Dict[int, bytes], segments: List[str], start_timeout: float,
                 rejoin: Callable[[], None]) -> Dict[int, int]:
        """Start the workers that replace dead ones; a replacement imports the user's
        modules again (from a file edited since?): what it found otherwise is warned
        about, as at the start."""
        pids = self.pool.replace(worker_main, data, segments, start_timeout,
                                 before_ready=rejoin)
        warn_module_differences({r: d for r, d in self.pool.replaced_ready.items() if d},
                                stacklevel=3)
        return pids

    def _joiner(self, start_timeout: float) -> Callable[[], None]:
        """What the master does once the workers have their payloads: wait until each
        says it joins the communicator (:class:`~.protocol.Joining`), then join too (NCCL's
        rendezvous, which nothing interrupts), within what is left of ``start_timeout``."""
        deadline = time.monotonic() + start_timeout

        def join() -> None:
            self.pool.gather(Joining.KIND, timeout=max(0.0, deadline - time.monotonic()),
                             what='start')
            self.comm.init(timeout=max(0.0, deadline - time.monotonic()))
        return join

    def _check_workers(self) -> None:
        """What the communicator runs while it waits: a worker that died or sent Failed
        raises WorkerError; in an update, the stall watch sees the wait (:mod:`.stall`)."""
        if self._started:
            self.pool.check('update', self.pool.ranks)
        else:
            self.pool.check('start')

    def _on_device(self) -> Any:
        """The master's device current for a block (nothing on the CPU)."""
        return _cuda.using_device(self.comm.device_id)

    def settle(self) -> None:
        """Return once the master's collectives in flight have finished: bounded by the
        communicator's timeout, watching the workers (a dead one raises WorkerError, the
        communicator abandoned). A no-op on backends whose verbs return done. The
        master's replica calls it before it reads its window's values; there, under
        ``max_worker_restarts`` on a communicator that a dead rank breaks (NCCL), a death
        is kept instead and raised in the master's half after the window, which recovers
        it (:mod:`.recovery`): the window's values are the master's own, which its bcast
        (the collective a dead rank left waiting, now abandoned) never wrote."""
        try:
            self.comm.wait()
        except WorkerError as error:
            if self.recovery is None or not self.comm.rejoins or not error.died:
                raise
            self._death = error

    def begin(self, loss_scale: Optional[float], parity: Optional[int] = None) -> None:
        with self._on_device():
            if self.recovery is None:
                master_begin(self.pool, self.comm, self.layouts, self.model, loss_scale,
                             parity, in_place=self.params.bind())
                return
            in_place = self.params.bind()
            try:
                self._sent = master_begin(self.pool, self.comm, self.layouts, self.model,
                                          loss_scale, parity, in_place=in_place)
            except WorkerError as error:
                # Raised while sending: the master's window has not run, so its Step is
                # made again alike.
                self._sent = Step(loss_scale,
                                  self.layouts.step_values(self.model), parity)
                self.recovery.recover(error, self._begin_again)

    def _begin_again(self) -> None:
        """The update's Step again, the parameters in the buffers as they were packed."""
        master_begin(self.pool, self.comm, self.layouts, self.model, None, None,
                     again=self._sent)

    def _rejoiner(self, ranks: List[int], survivors: List[int], handle: Any,
                  start_timeout: float) -> Callable[[], None]:
        """What the master does once the replacements of ``ranks`` have their payloads
        (:mod:`.recovery`): wait until each says it joins the communicator; where the
        ranks meet again (NCCL's rendezvous), tell the ``survivors`` to rejoin through
        ``handle``, join too, and wait until each survivor says it has, all within
        ``start_timeout``."""
        deadline = time.monotonic() + start_timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        def join() -> None:
            self.pool.gather(Joining.KIND, timeout=left(), what='restart', ranks=ranks)
            if self.comm.rejoins:
                if survivors:
                    self.pool.send(Rejoin(handle), ranks=survivors)
                self.comm.init(timeout=left())
                if survivors:
                    self.pool.gather(Rejoined.KIND, timeout=left(), what='restart',
                                     ranks=survivors)
        return join

    def _recovering(self, finish: Callable[[], List[WindowResult]]) -> List[WindowResult]:
        """``finish()`` (the master's half after its window), redone from the update's
        Step after a worker that died was replaced; then the workers' resume points of the
        update hold. A death after the step (which the protocol rules out) is raised."""
        recovery = self.recovery
        while True:
            try:
                death, self._death = self._death, None
                if death is not None:   # found in the master's window (settle)
                    raise death
                results = finish()
            except WorkerError as error:
                if self._stepped:
                    raise
                recovery.recover(error, self._begin_again)   # type: ignore[union-attr]
                continue
            recovery.records.commit()   # type: ignore[union-attr]
            return results

    @property
    def _pack_board(self) -> Optional[Board]:
        """The board where the master learns that the gradients are packed, or None (each
        worker's Done says so)."""
        return self.board if self.announce_packs else None

    def _master_half(self, own: WindowResult, parity: Optional[int],
                     then: Optional[Callable[[int, float], None]] = None,
                     after: Optional[Callable[[], None]] = None) -> List[WindowResult]:
        """The workers' results of the master's half after its window
        (:func:`.protocol.master_finish`), then ``after()``; with restarts, both redone
        after a death (:meth:`_recovering`). A synchronous update (``parity`` None) sums
        onto the master's gradient arrays where it can (:meth:`SummedGrads.targets`)."""
        recovery = self.recovery
        unwrap = recovery.records.unwrap if recovery is not None else None
        # with restarts, where a dead rank can leave the reductions unfinished (NCCL),
        # they are waited for before their sums reach the model: a death found then
        # leaves the master's own gradient and statistics for the redo
        settle = self.comm.wait if recovery is not None and self.comm.rejoins else None

        def half() -> List[WindowResult]:
            onto = self.grads.targets() if parity is None else None
            others = master_finish(self.pool, self.comm, self.layouts, self.model, parity,
                                   self.size, own, self._pack_board, then=then,
                                   unwrap=unwrap, settle=settle, onto=onto)
            if after is not None:
                after()
            return others
        if recovery is None:
            return half()
        self._stepped = False
        return self._recovering(half)

    def _receive(self) -> None:
        """The sum into the model's gradients (enqueued while the reductions run), then
        the wait for them: what follows may read on the host (the step, extensions)."""
        self.grads.receive()
        self.comm.wait()

    def finish(self, own: WindowResult) -> List[WindowResult]:
        with self._on_device():
            return [own] + self._master_half(own, None, after=self._receive)

    def finish_stepping(self, own: WindowResult,
                        step: Callable[[int, float], None]) -> List[WindowResult]:
        def summed(count: int, loss: float) -> None:
            self._receive()        # the step may read on the host (hooks, loss scaling)
            self._stepped = True   # no death is recovered past this (_recovering)
            step(count, loss)
        with self._on_device():
            return [own] + self._master_half(own, None, then=summed)

    def finish_async(self, own: WindowResult, parity: int) -> Tuple[List[WindowResult], ReduceHandle]:
        """As :meth:`finish`, but the summed gradient stays in the parity's buffers until
        the updater applies it, one update later (the next update uses the other set)."""
        with self._on_device():
            # what follows may read on the host (the step, extensions)
            others = self._master_half(own, parity, after=self.comm.wait)
        grads = self.layouts.grad_set(parity)

        def source() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for dtype, entries in grads.groups.items():
                flat = self.comm.buffer(f'{grads.prefix}/{dtype}')
                for e in entries:
                    out[e.name] = flat[e.offset:e.offset + e.size].reshape(e.shape)
            return out

        return [own] + others, ReduceHandle(source, self.comm.device_id)

    def states(self, timeout: float = 60.0) -> Dict[int, Dict[str, Any]]:
        if self.recovery is not None:   # the master holds them (a worker may be dead)
            return {rank: point.iterator
                    for rank, point in self.recovery.records.points.items()}
        self.pool.send(StateRequest())
        return self.pool.gather(State.KIND, timeout=timeout, what='snapshot')

    def pids(self) -> List[int]:
        return self.pool.pids()

    def detached(self) -> Optional['Detached']:
        return getattr(getattr(self, 'params', None), 'detached', None)

    def close(self, abort: bool = False) -> None:
        try:
            try:
                for views in (getattr(self, 'params', None), getattr(self, 'grads', None)):
                    if views is not None:   # (None: closed while being built)
                        views.detach()
                if not abort:
                    self.comm.drain()   # our collectives in flight end before the workers stop
            finally:
                self.pool.close()   # whatever failed before: no worker is left behind
        finally:
            if self.board is not None:
                self.board.close()
                self.board = None
            if abort:
                self.comm.abort()
            else:
                self.comm.finalize()


class SummedGrads:
    """How the master's parameters receive the summed gradient of a synchronous update.

    Where the backend sums onto arrays of the root's own
    (:attr:`~mgpu_updater.comm.base.Communicator.sums_onto_arrays`, the shared-memory one),
    the master's gradients are not packed at all: :meth:`targets` hands its gradient
    arrays to the reductions, which add the workers' slots to them in place (two replicas
    of the launch-bound benchmark model: 1.4% less time per update, about 12 us, than
    packing, summing in the slot and taking views). That needs every gradient to be a
    contiguous numpy array of its own that can be written in place; Chainer's backward
    can leave two parameters one array (``a + b``) or a read-only broadcast (``F.sum(W)``),
    and then, for that update, the gradients are packed as elsewhere.

    Otherwise, on the CPU (numpy buffers) each ``param.grad`` becomes a view of the
    master's slot of the ``grad`` buffers, where the reduction left the sum: no copy
    (0.3-0.4 ms per update for the benchmark's CNN). The slot is written again only by the
    next update's packing, after that update's window cleared the gradients
    (``cleargrads``), so the views are never overwritten while they are the gradients;
    :meth:`detach` copies them off before the buffers are released. Elsewhere (device
    buffers) the sum is copied into the parameters' own gradient arrays, as before.
    """

    def __init__(self, layouts: ModelLayouts, comm: Any, model: chainer.Link) -> None:
        self.params = dict(model.namedparams())
        self._on_host = comm.device_id is None   # numpy buffers
        self._views: Optional[Dict[str, Any]] = None   # (views: at the first use)
        self.layouts, self.comm, self.model = layouts, comm, model
        #: per ``grad`` buffer: its name, dtype and (offset, shape, parameter) entries,
        #: where the backend sums onto arrays (else empty)
        self._onto = [(f'{layouts.grad.prefix}/{dtype}', numpy.dtype(dtype),
                       [(e.offset, e.shape, self.params[e.name]) for e in entries])
                      for dtype, entries in layouts.grad.groups.items()] \
            if comm.sums_onto_arrays else []
        #: whether the latest update's sums went onto the gradient arrays (:meth:`targets`)
        self.summed_in_place = False

    @property
    def views(self) -> Dict[str, Any]:
        """The master's slot of each gradient, as its parameter's shape (numpy buffers),
        taken where the sums are first taken from the slot: where they go onto the
        gradient arrays, the slot is never written, and the shared-memory backend does not
        reserve its pages until it is (.comm.shm)."""
        if self._views is None:
            self._views = self.layouts.grad.views(self.comm.buffer, self.params) \
                if self._on_host else {}
        return self._views

    def targets(self) -> Optional[Dict[str, List[Tuple[int, Any]]]]:
        """The master's gradient arrays for this update's reductions to sum onto: by
        ``grad`` buffer name, (offset, array) covering the buffer; None where the backend
        cannot, or where a gradient is missing, of another dtype or shape, not
        C-contiguous, not writable, or in memory whose owner another gradient shares:
        then they are packed and the sum taken from the slot. (This runs every update,
        on the critical path: plain checks only.)"""
        self.summed_in_place = False
        if not self._onto:
            return None
        out: Dict[str, List[Tuple[int, Any]]] = {}
        owners = set()
        ndarray = numpy.ndarray
        for name, dtype, entries in self._onto:
            pairs = []
            for offset, shape, param in entries:
                grad = param.grad
                if type(grad) is not ndarray or grad.shape != shape or (
                        grad.dtype is not dtype and grad.dtype != dtype):
                    return None
                flags = grad.flags
                if not (flags.c_contiguous and flags.writeable):
                    return None
                base = grad.base
                owner = id(grad) if base is None else id(base)
                if owner in owners:
                    return None
                owners.add(owner)
                pairs.append((offset, grad))
            out[name] = pairs
        self.summed_in_place = True
        return out

    def receive(self) -> None:
        if self.summed_in_place:   # the sums are the gradient arrays already
            return
        if self.views:
            # Parameters whose window left them one gradient array (``a + b``) get one
            # view, the first's (their sums are the same values): one array, as under
            # StandardUpdater, which in-place optimizer hooks (WeightDecay) then act on
            # alike. Each entry: id(their array) -> (that array, the view).
            shared: Dict[int, Tuple[Any, Any]] = {}
            for name, view in self.views.items():
                param = self.params[name]
                grad = param.grad
                if grad is not None:
                    view = shared.setdefault(id(grad), (grad, view))[1]
                try:
                    param.grad = view
                except TypeError as exc:   # Chainer's "Dtype of data and grad mismatch"
                    raise RuntimeError(
                        f'the parameter {name} holds a {param.dtype} array now, where the '
                        f'replicas and the buffers that carry its gradient hold '
                        f'{view.dtype}: its array was replaced by one of another dtype '
                        'during training. Change dtypes before the first update, or '
                        'finalize this updater and build a new one after the change'
                    ) from exc
            return
        ensure_grads(self.model)
        self.layouts.grad.unpack(self.comm.buffer, grad_arrays(self.model))

    def detach(self) -> None:
        """Gradients that are still views of the buffers become copies (one copy of a
        view that several parameters hold), and the views go: the buffers can be unmapped
        at once (.comm.shm ``finalize``), not when the garbage collector finds this group."""
        views = {id(view): view for view in (self._views or {}).values()}
        copies: Dict[int, Any] = {}
        for param in self.params.values():
            if param.array is None:   # a lazy link no forward called: no gradient to read
                continue
            grad = param.grad
            if grad is not None and views.get(id(grad)) is grad:
                if id(grad) not in copies:
                    copies[id(grad)] = grad.copy()
                param.grad = copies[id(grad)]
        self._views = {}


class SlotParams:
    """The master's parameters, kept in the broadcast parameter slot.

    Where the backend gives every rank the one slot the master writes
    (:meth:`~mgpu_updater.comm.base.Communicator.shared_slot`: the shared-memory one) and
    the parameters are numpy arrays, each master parameter's array is a view of its slice
    of that slot: the optimizer steps it in place there, and sending the parameters to the
    workers (who read the slot in place, :class:`~mgpu_updater._local.protocol.ParamViews`)
    costs no copy (0.5 ms per update for the benchmark's CNN).

    The ordering contract makes this safe: the master changes its parameters only between
    updates (the optimizer step, extensions), after every worker's Done and before the
    next Step, and a worker reads them only inside its update. The first :meth:`bind`
    copies each parameter into its slice and binds the view; a parameter whose array
    shares memory with another array of the model (:func:`overlapping`), or is read-only
    and stepped, is left as it is, and copied into the slot each update, so that the
    sharing stays and a step that writes it fails as ``StandardUpdater``'s does (a frozen
    read-only one is bound, nothing writes it, and gets its own array back if its update
    rule is enabled later). A parameter whose array is replaced later (an extension's own
    buffer, another parameter's array to tie them, an update rule that assigns a new
    array) keeps it, as under ``StandardUpdater``, and is copied from then on; parameters
    that held one array at the start and no longer do are refused (the slot carries that
    array once for both). :meth:`detach` copies the views off before the buffers are
    released, so that the model outlives the workers; at the next start of the workers
    (:class:`Detached`) the parameters that hold those copies are bound again, and those
    that hold the user's arrays keep them.
    """

    def __init__(self, layouts: ModelLayouts, comm: Any, model: chainer.Link,
                 detached: Optional['Detached'] = None) -> None:
        """``detached``: at a later start of the updater's workers, the arrays the last
        :meth:`detach` gave the parameters; a parameter that holds any other holds one
        the user gave it (an extension's buffer, tied or not), which it keeps."""
        self.params, self.views = slot_views(comm, layouts, model)
        #: every view, by name, as made: what :meth:`detach` copies off
        self._made = dict(self.views)
        #: what :meth:`detach` gave the parameters, once it ran (until then, what the
        #: last one gave them: a run closed before its first bind changed nothing)
        self.detached: Optional[Detached] = detached
        #: bound parameters whose own array was read-only (a frozen embedding): given it
        #: back if their update rule is enabled later, so that the step fails as alone
        self._read_only: List[Tuple[str, chainer.Parameter, Any]] = []
        for name in overlapping(layouts.index_of(model)):
            self.views.pop(name, None)   # copied into the slot each update instead
        for name in list(self.views):
            param = self.params[name]
            array = param.array
            if isinstance(array, numpy.ndarray) and not array.flags.writeable:
                if param.update_rule is not None and param.update_rule.enabled:
                    del self.views[name]   # likewise: the step writes it as it would alone
                    continue
                self._read_only.append((name, param, array))
            if detached is not None and array not in detached:
                del self.views[name]   # an array the user gave it: its own still
        self._pairs = [(name, self.params[name], view) for name, view in self.views.items()]
        self._every = frozenset(self.views)
        self._bound = False

    def bind(self) -> FrozenSet[str]:
        """The parameters whose arrays are their slices now: at the first call, each that
        can be, its values copied in; later, the same but those whose arrays were
        replaced since, which keep their new arrays from then on. (Every update: where
        nothing was replaced, as after every step of the usual optimizers, it makes no
        new object.)"""
        if not self._bound:
            self._bound = True
            unbound = []
            for name, param, view in self._pairs:
                array = param.array
                if not (isinstance(array, numpy.ndarray) and array.dtype == view.dtype
                        and array.shape == view.shape):
                    unbound.append(name)   # another type or shape: copied, as before
                    continue
                view[...] = array
                param.array = view
            self._keep(unbound)
            return self._every
        if self._read_only:
            self._unfrozen()
        replaced = None
        for name, param, view in self._pairs:
            if param.array is not view:
                replaced = (replaced or []) + [name]
        if replaced is not None:
            self._keep(replaced)
        return self._every

    def _unfrozen(self) -> None:
        """A read-only parameter bound while frozen whose update rule is enabled now gets
        its own array back (its values unchanged: nothing stepped it), which the step
        then fails to write, as ``StandardUpdater``'s does."""
        for entry in list(self._read_only):
            name, param, own = entry
            rule = param.update_rule
            if rule is not None and rule.enabled:
                self._read_only.remove(entry)
                if param.array is self.views.get(name):
                    param.array = own

    def _keep(self, names: List[str]) -> None:
        """Leave the parameters ``names`` with the arrays they hold, copied into the slot
        at each begin from now on; refuse where one shared its view with another (one
        array at the start, Chainer's ``copy(mode='share')``, ``b.W.array = a.W.array``)."""
        if not names:
            return
        gone = set(names)
        for name in names:
            view = self.views[name]
            tied = sorted(other for other, v in self.views.items()
                          if v is view and other != name)
            if tied and any(self.params[other].array is not self.params[name].array
                            for other in tied):
                raise RuntimeError(
                    f'the parameters {sorted([name] + tied)} held one array when the '
                    "updater started, and now hold different ones: the buffers that carry "
                    'parameters to the worker processes hold that array once for all of '
                    'them, so the workers would not see them apart. Untie them before the '
                    'first update, or finalize this updater and build a new one after the '
                    'change (an update rule that gives each its own new array at every '
                    'step, as use_fp32_update() does, unties them at the first: give each '
                    'its own array before the first update)')
            gone.update(tied)   # replaced alike (the same new array): kept alike
        for name in gone:
            del self.views[name]
        self._pairs = [(n, p, v) for n, p, v in self._pairs if n not in gone]
        self._every = frozenset(self.views)

    def detach(self) -> None:
        """Parameters that hold a view of the slot become copies, one copy of each view
        however many hold it (one kept, tied to another's, takes that one's copy), and the
        views go (as :meth:`SummedGrads.detach`). A read-only parameter bound while frozen
        gets its own array back where the view still holds its values."""
        if not self._bound:
            return   # nothing bound: the parameters hold what they held
        views = {id(view): view for view in self._made.values()}
        copies: Dict[int, Any] = {}
        for name, param, own in self._read_only:
            view = self.views.get(name)
            if param.array is view and numpy.array_equal(view, own):
                param.array = copies[id(view)] = own
        for param in self.params.values():
            view = views.get(id(param.array))
            if view is not None:
                param.array = copies.setdefault(id(view), view.copy())
        self.views, self._pairs, self._made, self._read_only = {}, [], {}, []
        self.detached = Detached(copies.values())


class Detached:
    """The arrays a :meth:`SlotParams.detach` gave the parameters, by identity (held
    weakly): at the next start of the updater's workers, a parameter that holds one of
    them is bound to the new slot, as every parameter at the first start; one that holds
    any other array holds one the user gave it since the first start, which it keeps."""

    def __init__(self, arrays: Any) -> None:
        self._held = {id(a): weakref.ref(a) for a in arrays}

    def __contains__(self, array: Any) -> bool:
        ref = self._held.get(id(array))
        return ref is not None and ref() is array



class Payload:
    """A worker's payload, pickled (a :class:`~.worker.ProcessSetup`, then a
    :class:`~.worker.WorkerInit`) once the communicator handle, the board's name (None: no
    board) and whether the ranks announce their packs there are known (see ``_payload``);
    again, with a resume point, for a worker that replaces one that died
    (:mod:`.recovery`).

    Whatever in it refers to ``master_model`` or its links (a closure as ``loss_func``)
    refers to the worker's replica, ``init_kwargs['model']``, once unpickled.
    """

    def __init__(self, init_kwargs: Dict[str, Any], master_model: chainer.Link) -> None:
        self.init_kwargs, self.master_model = init_kwargs, master_model

    @property
    def iterator(self) -> Any:
        """The worker's iterator, as the payload carries it (as of the workers' start)."""
        return self.init_kwargs['iterator']

    def __call__(self, handle: Any, board: Optional[str] = None, announce_packs: bool = False,
                 resume: Any = None, chunk_size: Optional[int] = None) -> bytes:
        """The pickled payload; ``resume``, a replacement's resume point, and
        ``chunk_size``: under ``micro_batch_size='auto'``, the size the lost worker had
        come to (None: as at the start)."""
        kwargs = dict(self.init_kwargs)
        replace = _payload.replica_links(self.master_model, kwargs['model'])
        if chunk_size is not None and kwargs['chunking'].auto:
            kwargs['chunking'] = kwargs['chunking']._replace(size=chunk_size)
        setup = ProcessSetup(kwargs['device'], **{name: kwargs.pop(name) for name in
                                                  ProcessSetup._fields[1:] if name in kwargs})
        return _payload.dumps_each([
            (setup, None),
            (WorkerInit(comm_handle=handle, board=board, announce_packs=announce_packs,
                        resume=resume, **kwargs), replace)])


def _pickled(payloads: Dict[int, 'Payload'], handle: Any, board: Optional[str],
             announce_packs: bool) -> Dict[int, bytes]:
    """Every worker's payload, pickled; one that does not pickle, though every part of it
    did at construction (``_validate.worker_payload``), is explained where its iterator
    is what changed (a file its dataset opened since)."""
    try:
        return {r: p(handle, board, announce_packs) for r, p in payloads.items()}
    except Exception:
        from .._validate import opened_since
        opened_since({r: p.iterator for r, p in payloads.items()})
        raise


def payload_factory(init_kwargs: Dict[str, Any], master_model: chainer.Link) -> Payload:
    """The :class:`Payload` of one worker."""
    return Payload(init_kwargs, master_model)

"""The local per-update protocol in one place: the messages, the collective order, both halves.

The invariant: one order of collectives
---------------------------------------
Collectives pair up by the order in which each rank issues them (NCCL's rule; MPI's too).
So in every update, every rank issues exactly the list that :func:`collective_order`
declares, in that order, from one thread (the main one), and nothing else:

1. ``bcast`` of each ``param`` buffer: parameters and array persistents, from the master;
2. the update's window runs (no collective);
3. ``reduce`` of each ``stat`` buffer: float persistents (BatchNorm statistics), averaged;
4. ``reduce`` of each buffer of the update's gradient set: ``grad``, or in pipelined mode
   ``grad0`` and ``grad1`` alternating with the update's parity.

Within a step, buffers go in sorted name order (one buffer per dtype). Across hosts
(:mod:`mgpu_updater._multihost`) the same declaration gives steps 3 and 4 as ``allreduce`` and no
step 1 (parameters travel once, at start). The gradient comes last so that it is the one
collective that may still be running when the next update's compute starts (NCCL's stream
gives that overlap; no thread issues collectives).

Both halves below iterate that one list: the master's (:func:`master_begin`,
:func:`master_finish`, driven by :class:`mgpu_updater._local.group.LocalGroup`) and the worker's
(:func:`worker_step`, driven by :mod:`mgpu_updater._local.worker`). The shared-memory backend
checks the order of every update on every rank (:mod:`mgpu_updater.comm.shm`), and the MPI
group compares the ranks' sequences every update; a mismatch raises
:class:`~mgpu_updater.comm.base.CollectiveOrderError` naming both sequences.

One update, side by side::

    master (rank 0)                              worker (rank r)
    begin_update; pack param; bcast param/*
    (on shm the master's parameters already are
    the slot: :class:`~.group.SlotParams`)
    send Step(loss_scale, scalars, parity)  -->  begin_update; bcast param/*; unpack param
                                                 (on shm the parameters are read in place:
                                                 :class:`ParamViews`; persistents unpacked)
    run its own window                           run its window
    pack stat (and grad, unless the sums go      pack grad, stat
      onto its own gradient arrays, on shm)
                                                 reduce stat/*, grad/*; end_update
    post count, loss; wait for every post   <--  post count, loss (packs announced)
      (elsewhere: wait for every Done)
    reduce stat/*, grad/* (on shm grad/* onto
      its gradient arrays); end_update
    unpack stat (and grad, or keep it pending)
    then(count, loss): the step              <--  its result in its mailbox (board)
    take every result (already there)             (elsewhere: send Done(result))

Packs are announced at the board (:mod:`.board`) where the backend's packs are stores into
memory every rank maps and the machine's store order publishes them with the post
(:func:`.board.announces_packs`, decided by the master, told in ``WorkerInit``): the master
then sums and steps before it reads the workers' results, which each worker puts in its
mailbox at the board right after its post (:func:`deliver`, :func:`take_results`; a result
too large for the mailbox goes as a Done through the pipe), off the critical path.
Elsewhere Done says that the worker's gradient is packed, and the master waits for every
Done before it sums.

Under ``max_worker_restarts`` (:mod:`.recovery`) a worker also keeps where its window
started and ended (:mod:`.resume`), delivers a :class:`Shipment` (its result, and where its
next update starts) instead of its bare result, and delivers it before its post, so that
the master never learns of a death after it has stepped; :class:`Rewind` sends a survivor
back to where its window started, once the update is abandoned.

The messages (master -> worker: :class:`Step`, :class:`StateRequest`, :class:`Rewind`,
:class:`Rejoin`, :class:`Stop`; worker -> master: :class:`Hello`, :class:`Joining`,
:class:`Ready`, :class:`Done`, :class:`State`, :class:`Rewound`, :class:`Rejoined`,
:class:`Failed`; the start-up payload goes
as bytes between Hello and Ready, see
:mod:`mgpu_updater._local.pool`) are named tuples whose first field, ``kind``, names the
message, so ``msg[0]`` dispatches. The master's go as bytes that :class:`Encoder` keeps
while the message stays the same (every update's Step, mostly), and the worker's
:class:`Decoder` unpickles only bytes it has not just seen: with the caches cold after a
window, pickling a Step took the master 40-150 us of every update and unpickling it the
worker 35-65 us, both before the worker's window starts.
"""
from __future__ import annotations

from typing import (Any, Callable, ClassVar, Collection, Dict, List, Mapping, NamedTuple,
                    Optional, Protocol, Tuple)

import math
import pickle
import weakref

import numpy

from .._flat_buffers import ModelLayouts, overlapping
from .._loader import EpochInfo
from .._replica import Replica, WindowResult
from .board import MAILBOX, Board, posted_total


# ------------------------------------------------------------------------------ messages
class _Kind:
    """Mixin: the message's class fixes its first field, ``kind`` (``KIND``)."""

    __slots__ = ()
    KIND: ClassVar[str]

    def __new__(cls, *fields: Any) -> Any:
        return super().__new__(cls, cls.KIND, *fields)  # type: ignore[call-arg]

    def __getnewargs__(self) -> Tuple[Any, ...]:   # pickle: rebuild through __new__
        return tuple(self)[1:]  # type: ignore[arg-type]


class _StepFields(NamedTuple):
    kind: str
    loss_scale: Optional[float]      # the optimizer's loss scale (mixed precision)
    scalars: Dict[str, Any]          # the master's non-array persistents (BatchNorm's N)
    parity: Optional[int]            # the gradient set: None, or 0/1 in pipelined mode


class Step(_Kind, _StepFields):
    """master -> worker: run one update (``Step(loss_scale, scalars, parity)``)."""
    KIND = 'step'


class _NoFields(NamedTuple):
    kind: str


class StateRequest(_Kind, _NoFields):
    """master -> worker: send your iterator's state (for a snapshot)."""
    KIND = 'state'


class Stop(_Kind, _NoFields):
    """master -> worker: exit."""
    KIND = 'stop'


class Hello(_Kind, _NoFields):
    """worker -> master, once: Python's start-up (which re-imports ``__main__``) is over;
    send the payload."""
    KIND = 'hello'


class Joining(_Kind, _NoFields):
    """worker -> master, once: built, now joining the communicator (``comm.init``). The
    master joins (NCCL's rendezvous, which nothing can interrupt) only once every worker
    said so: a worker that fails or hangs in its build never leaves it waiting there."""
    KIND = 'joining'


class _ReadyFields(NamedTuple):
    kind: str
    differences: Tuple[str, ...] = ()   # what its modules hold otherwise (_module_globals)


class Ready(_Kind, _ReadyFields):
    """worker -> master, once: started, communicator joined; with what its own import of
    the user's modules holds otherwise than the master's (``Ready(differences)``)."""
    KIND = 'ready'


class _DoneFields(NamedTuple):
    kind: str
    result: WindowResult


class Done(_Kind, _DoneFields):
    """worker -> master: this update's window and reductions are done."""
    KIND = 'done'


class _StateFields(NamedTuple):
    kind: str
    state: Dict[str, Any]


class State(_Kind, _StateFields):
    """worker -> master: the iterator state asked for by :class:`StateRequest`."""
    KIND = 'state'


class _FailedFields(NamedTuple):
    kind: str
    traceback: str


class Failed(_Kind, _FailedFields):
    """worker -> master: an exception, with its formatted traceback."""
    KIND = 'error'


class Rewind(_Kind, _NoFields):
    """master -> worker (``max_worker_restarts``): another worker died, this update is
    abandoned: go back to where your latest window started (:mod:`.resume`); answer
    :class:`Rewound`. The update is redone with a new Step."""
    KIND = 'rewind'


class Rewound(_Kind, _NoFields):
    """worker -> master: back where its latest window started, waiting for a Step."""
    KIND = 'rewound'


class _RejoinFields(NamedTuple):
    kind: str
    handle: Any


class Rejoin(_Kind, _RejoinFields):
    """master -> worker (``max_worker_restarts``, a communicator that
    :attr:`~mgpu_updater.comm.base.Communicator.rejoins`): after :class:`Rewind`, join the
    rebuilt communicator through ``handle`` (NCCL: a fresh unique id), with the new ranks
    and the master; answer :class:`Rejoined`."""
    KIND = 'rejoin'


class Rejoined(_Kind, _NoFields):
    """worker -> master: joined the rebuilt communicator."""
    KIND = 'rejoined'


class Abandoned(Exception):
    """Raised in a worker, under ``max_worker_restarts``, where it waits for its
    collectives during an update (a communicator whose collectives a dead rank leaves
    unfinished, NCCL) and a message from the master came meanwhile (in an update that
    is a :class:`Rewind`, or a Stop), or the backend reported that a peer failed: its
    window is given up, and it reads the message."""


class Shipment(NamedTuple):
    """What a worker delivers for its window under ``max_worker_restarts``, in its
    mailbox or a Done: the result, and where its next update starts
    (:class:`.resume.Change`), which the master keeps once the update is complete."""
    result: WindowResult
    change: Any


# ------------------------------------------------------------------------------ encoding
class Encoder:
    """The master's messages as bytes, the last one's kept: a message that pickles as the
    last did (:func:`same_pickle`) costs no pickling."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[tuple, bytes]] = None

    def encode(self, msg: tuple) -> bytes:
        last = self._last
        if last is not None and same_pickle(msg, last[0]):
            return last[1]
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._last = (msg, data)
        return data


class Decoder:
    """A worker's view of the master's bytes: the same bytes as last time give the same
    message (nothing in a message is changed by its reader), others are unpickled."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[bytes, Any]] = None

    def decode(self, data: bytes) -> Any:
        last = self._last
        if last is not None and data == last[0]:
            return last[1]
        msg = pickle.loads(data)
        self._last = (data, msg)
        return msg


_PLAIN = (str, bytes, int, bool, type(None))
#: immutable values that one object pickles alike every time (a float's bits included)
_ATOMS = frozenset(_PLAIN + (float,))


def same_pickle(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` would unpickle as the same values: the same types all the
    way down (tuples, named tuples and dicts of plain values: str, bytes, int, bool,
    float, None) and equal values, zeros of the same sign. Anything else (an array, two
    NaN objects) counts as different, so that it is pickled anew. (Every update's Step is
    compared with the last before the workers start: one object, or two empty dicts,
    answer at once.)"""
    kind = type(a)
    if kind is not type(b):
        return False
    if a is b and kind in _ATOMS:
        return True
    if isinstance(a, tuple):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            if not (x is y and type(x) in _ATOMS) and not same_pickle(x, y):
                return False
        return True
    if kind is dict and not a and not b:
        return True
    if isinstance(a, dict):
        return len(a) == len(b) and all(same_pickle(ka, kb) and same_pickle(a[ka], b[kb])
                                        for ka, kb in zip(a, b))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return isinstance(a, _PLAIN) and a == b


# ------------------------------------------------------------------------------ the order
class Collective(NamedTuple):
    """One collective of the protocol: a communicator verb on a named buffer."""
    verb: str       # 'bcast', 'reduce' or 'allreduce'
    buffer: str     # e.g. 'grad0/<f4'


def collective_order(layouts: ModelLayouts, parity: Optional[int] = None,
                     across_hosts: bool = False) -> Tuple[Collective, ...]:
    """THE collectives of one update, in the order every rank issues them.

    ``parity`` picks the gradient set (``None``: ``grad``; 0 or 1: pipelined mode's
    ``grad0``/``grad1``). ``across_hosts``: the MPI group's form, every rank ends with the
    sums (``allreduce``) and no parameters travel (they stay equal by construction).
    """
    memo = _ORDERS.get(layouts)   # (setdefault would make a weak reference every call)
    if memo is None:
        memo = _ORDERS.setdefault(layouts, {})
    key = (parity, across_hosts)
    order = memo.get(key)
    if order is None:
        order = memo[key] = _declare(layouts, parity, across_hosts)
    return order


#: Every update asks for its order, before and after its window, on every rank (50 us
#: each with the caches cold): it is declared once per layouts and arguments, which
#: do not change after their construction.
_ORDERS: 'weakref.WeakKeyDictionary[ModelLayouts, Dict[tuple, Tuple[Collective, ...]]]' = \
    weakref.WeakKeyDictionary()


def _declare(layouts: ModelLayouts, parity: Optional[int],
             across_hosts: bool) -> Tuple[Collective, ...]:
    reduce = 'allreduce' if across_hosts else 'reduce'
    order = [] if across_hosts else [
        Collective('bcast', name) for name in sorted(layouts.state.buffer_names().values())]
    order += [Collective(reduce, name) for name in sorted(layouts.stat.buffer_names().values())]
    order += [Collective(reduce, name)
              for name in sorted(layouts.grad_set(parity).buffer_names().values())]
    return tuple(order)


def broadcast_only(layouts: ModelLayouts) -> List[str]:
    """The buffers the declared order only ever broadcasts (the same in every mode): a
    backend may give them one slot that every rank reads (the shared-memory one does)."""
    order = collective_order(layouts)
    return sorted({c.buffer for c in order if c.verb == 'bcast'}
                  - {c.buffer for c in order if c.verb != 'bcast'})


def before_window(order: Tuple[Collective, ...]) -> Tuple[Collective, ...]:
    """The collectives issued before the window: the leading broadcasts."""
    n = 0
    while n < len(order) and order[n].verb == 'bcast':
        n += 1
    return order[:n]


def after_window(order: Tuple[Collective, ...]) -> Tuple[Collective, ...]:
    """The collectives issued after the window: everything after the leading broadcasts."""
    return order[len(before_window(order)):]


def issue(comm: Any, collectives: Tuple[Collective, ...],
          onto: Optional[Mapping[str, Any]] = None) -> None:
    """Issue ``collectives`` on ``comm``, in order, from this thread. ``onto``: on the
    master, the arrays that the ``reduce`` of a buffer named there sums onto instead of
    its slot (``comm.reduce_onto``: :attr:`~mgpu_updater.comm.base.Communicator.sums_onto_arrays`)."""
    for verb, name in collectives:
        if verb == 'bcast':
            comm.bcast(name)
        elif verb == 'reduce':
            if onto is not None and name in onto:
                comm.reduce_onto(name, onto[name])
            else:
                comm.reduce(name)
        elif verb == 'allreduce':
            comm.allreduce(name)
        else:
            raise ValueError(f'unknown collective verb {verb!r} for buffer {name!r}')


def pack_window(comm: Any, layouts: ModelLayouts, model: Any, parity: Optional[int],
                size: int) -> None:
    """Copy this replica's gradients and its float persistents (weighted ``1/size``, so
    that the sum is the mean) into the buffers that the reductions sum."""
    layouts.grad_set(parity).pack(layouts.index_of(model).grad_arrays(), comm.buffer)
    pack_stats(comm, layouts, model, size)


def pack_stats(comm: Any, layouts: ModelLayouts, model: Any, size: int) -> None:
    """Copy this replica's float persistents, weighted ``1/size``, into ``stat`` (where
    the model has any)."""
    if layouts.stat.groups:
        layouts.stat.pack(dict(layouts.index_of(model).persistent_arrays()), comm.buffer,
                          scale=1.0 / size)


# ------------------------------------------------------------------------------ the master
class Workers(Protocol):
    """What the master's half needs of the worker pool."""

    ranks: List[int]

    def send(self, msg: tuple, ranks: Optional[List[int]] = None) -> None: ...

    def gather(self, kind: str, ranks: Optional[List[int]] = None) -> Dict[int, Any]: ...

    def check(self, what: str = 'update', waiting: Collection[int] = ()) -> None: ...


def take_results(workers: Workers, board: Board,
                 unwrap: Optional[Callable[[int, Any], WindowResult]] = None
                 ) -> Dict[int, WindowResult]:
    """The workers' window results of the board's latest round, by rank: from their
    mailboxes (:func:`deliver`), and as Done messages through the pipes for those too
    large for one. ``workers.check`` runs while a mailbox is awaited. ``unwrap(rank,
    shipment)``: what each worker delivered is a :class:`Shipment`, whose result it
    returns (``max_worker_restarts``)."""
    out: Dict[int, Any] = {}
    by_pipe = []
    for rank in workers.ranks:
        data = board.result(rank, lambda: workers.check(waiting=(rank,)))
        if data is None:
            by_pipe.append(rank)
        else:
            out[rank] = unpack_result(data)
    if by_pipe:
        out.update(workers.gather(Done.KIND, ranks=by_pipe))
    if unwrap is not None:
        return {rank: unwrap(rank, shipment) for rank, shipment in out.items()}
    return out


def master_begin(workers: Workers, comm: Any, layouts: ModelLayouts, model: Any,
                 loss_scale: Optional[float], parity: Optional[int],
                 in_place: Collection[str] = (), again: Optional[Step] = None) -> Step:
    """The master's half, before its window: parameters out, then the workers start;
    returns the Step sent. ``in_place``: parameters whose arrays already are their slices
    of the broadcast buffer (:class:`mgpu_updater._local.group.SlotParams`), not copied.
    ``again``: the Step of an update that is being redone (``max_worker_restarts``): the
    parameters are in the buffers already (packed for it, and nothing wrote there since)
    and are not packed again, since the master's window may have changed its persistents
    (``loss_scale`` and ``parity`` are the Step's)."""
    order = collective_order(layouts, parity if again is None else again.parity)
    comm.begin_update()
    if again is None:
        index = layouts.index_of(model)
        if not layouts.state.names.issubset(in_place):   # else nothing to copy
            layouts.state.pack(index.state_arrays(), comm.buffer, skip=in_place)
        again = Step(loss_scale, layouts.step_values(model), parity)
    issue(comm, before_window(order))
    workers.send(again)
    return again


def master_finish(workers: Workers, comm: Any, layouts: ModelLayouts, model: Any,
                  parity: Optional[int], size: int, own: Optional[WindowResult] = None,
                  board: Optional[Board] = None,
                  then: Optional[Callable[[int, float], None]] = None,
                  unwrap: Optional[Callable[[int, Any], WindowResult]] = None,
                  settle: Optional[Callable[[], None]] = None,
                  onto: Optional[Mapping[str, Any]] = None) -> List[WindowResult]:
    """The master's half, after its window: wait until every worker's gradient is packed,
    then issue the reductions and take the averaged statistics, and call ``then(count,
    loss)``, the update's sample count and mean loss. The summed gradient is in the
    master's slot of ``layouts.grad_set(parity)``; the caller unpacks it (now, in
    ``then``, or later). Returns the workers' window results in rank order.

    Where the ranks post at ``board`` that their gradient is packed, with their count and
    loss (``board`` is given where :func:`.board.announces_packs`), the master meets them
    there, sums, calls ``then`` and only then takes every :class:`Done`, which each worker
    sent after its post and which is on its way meanwhile; elsewhere (``board`` None) it
    waits for every Done first. ``own``, the master's window result, is needed with a
    ``board`` (the master posts its count and loss too) or a ``then``. ``unwrap``: as for
    :func:`take_results` (``max_worker_restarts``). ``settle``: called once the
    reductions are issued, before their sums are unpacked into the model (the waits for
    them, under ``max_worker_restarts`` where a dead rank can leave them unfinished: a
    death found there leaves the master's own statistics and gradient as its window made
    them, for the update's redo to pack again). ``onto`` (the shared-memory backend, from
    :meth:`.group.SummedGrads.targets`): the master's own gradient arrays by buffer name,
    which are not packed: the reductions sum the workers' slots onto them, so that they
    are the summed gradient when ``then`` is called (a death is found only before the
    reductions: every worker said its gradient is packed before they are issued)."""
    order = collective_order(layouts, parity)
    if onto is None:
        pack_window(comm, layouts, model, parity, size)
    else:
        pack_stats(comm, layouts, model, size)
    by_board = board is not None
    if by_board:
        if own is None:
            raise ValueError('master_finish: the ranks meet at the board; pass own')
        posted = board.meet(own.count, own.loss_sum,   # type: ignore[union-attr]
                            lambda: workers.check(waiting=board.behind()))   # type: ignore[union-attr]
    else:
        others = workers.gather(Done.KIND)
        if unwrap is not None:
            others = {rank: unwrap(rank, shipment) for rank, shipment in others.items()}
        if then is not None:
            posted = [(r.count, r.loss_sum)
                      for r in [own] + [others[k] for k in sorted(others)]]  # type: ignore[list-item]
    issue(comm, after_window(order), onto)
    comm.end_update()
    if settle is not None:
        settle()
    if layouts.stat.groups:
        layouts.stat.unpack(comm.buffer, dict(layouts.index_of(model).persistent_arrays()))
    if then is not None:
        then(*posted_total(posted))
    if by_board:
        others = take_results(workers, board, unwrap)   # type: ignore[arg-type]
    return [others[rank] for rank in sorted(others)]


# ------------------------------------------------------------------------------ the worker
def slot_views(comm: Any, layouts: ModelLayouts,
               model: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The model's parameters whose broadcast buffer is one slot every rank reads
    (:meth:`~mgpu_updater.comm.base.Communicator.shared_slot`), by name, and a view of
    each one's slice of that slot (none where the backend has no shared slot)."""
    shared = {dtype for dtype, name in layouts.state.buffer_names().items()
              if comm.shared_slot(name)}
    params = {name: p for name, p in model.namedparams() if numpy.dtype(p.dtype).str in shared}
    views = layouts.state.views(comm.buffer, params)
    for name, held in layouts.index_of(model).aliases.items():
        if held in views and name in params:
            views[name] = views[held]   # one array, as the model holds it: one view
    return params, views


#: Added to a worker's traceback of numpy's "read-only" error (:class:`ParamViews`).
READ_ONLY_ADVICE = (
    "\n(On a worker the model's parameters are read-only views of the master's: a forward "
    'that writes a parameter in place, such as a max-norm constraint, would change every '
    "replica's, and runs once per micro-batch where StandardUpdater's runs once per update. "
    "If the array is a parameter, constrain it after the step instead, once per update on "
    "the master: optimizer.add_hook(hook, timing='post').)\n")


def advice_for(exc: Optional[BaseException]) -> str:
    """What to add to the traceback of ``exc``, raised in a worker: :data:`READ_ONLY_ADVICE`
    for numpy's error on writing a read-only array, else ''."""
    if isinstance(exc, ValueError) and 'read-only' in str(exc):
        return READ_ONLY_ADVICE
    return ''


class ParamViews:
    """A worker's parameters, read in place from the broadcast parameter buffer.

    Where the backend gives every rank the one slot the master writes
    (:meth:`~mgpu_updater.comm.base.Communicator.shared_slot`: the shared-memory one), the
    worker's parameter arrays are views of it, so that receiving the parameters costs no
    copy (0.4-0.7 ms per update for the benchmark's CNN). The master writes the slot only
    before it sends Step, never while a worker computes (the ordering contract), and the
    worker never writes parameters; on the CPU the views are read-only, so that a model
    that did would fail loudly rather than change what other workers read. Array
    persistents (BatchNorm's statistics, which the forward updates) are copied as before,
    and so are parameters whose arrays share memory with another array of the replica
    (:func:`~mgpu_updater._flat_buffers.overlapping`: an array a link holds that is a
    parameter's array, which the unpickled replica keeps as one object), so that the
    sharing stays as on the master.
    With other backends nothing is bound and :meth:`bind` does nothing.
    """

    def __init__(self, comm: Any, layouts: ModelLayouts, model: Any) -> None:
        params, self.views = slot_views(comm, layouts, model)
        for name in overlapping(layouts.index_of(model)):
            self.views.pop(name, None)
        for view in self.views.values():
            if isinstance(view, numpy.ndarray):
                view.flags.writeable = False
        self.params = params
        self.names = frozenset(self.views)

    def bind(self) -> None:
        """Make each parameter's array its view again if anything replaced it."""
        for name, view in self.views.items():
            param = self.params[name]
            if param.array is not view:
                param.array = view


def worker_step(step: Step, replica: Replica, comm: Any, layouts: ModelLayouts,
                size: int, views: Optional[ParamViews] = None,
                board: Optional[Board] = None,
                done: Callable[[Any], None] = lambda result: None,
                announce_packs: bool = False, keeper: Any = None) -> None:
    """The worker's half of one update: parameters in, the window, reductions issued,
    ``done(result)`` (which sends :class:`Done`); with ``announce_packs``, instead a post
    at ``board`` with its count and loss, which tells the master that its gradient is
    packed, and the result in its mailbox there (:func:`deliver`).

    ``keeper`` (``max_worker_restarts``, a :class:`.resume.Keeper`): the window's start
    and end are kept, and what is delivered is a :class:`Shipment`, the result with where
    the next update starts; with ``announce_packs`` it is delivered before the post."""
    if keeper is not None:
        keeper.window_starts()
    model = replica.model
    order = collective_order(layouts, step.parity)
    comm.begin_update()
    issue(comm, before_window(order))
    if views is not None:
        views.bind()
    index = layouts.index_of(model)
    layouts.state.unpack(comm.buffer, index.state_arrays(),
                         skip=views.names if views is not None else ())
    index.set_persistent_scalars(step.scalars)
    result = replica.run_window(step.loss_scale)
    pack_window(comm, layouts, model, step.parity, size)
    issue(comm, after_window(order))
    comm.end_update()
    if keeper is not None:
        shipment = Shipment(result, keeper.window_ended(replica.loader))
        if announce_packs:   # the result first: a rank seen posting has delivered it
            deliver(board, shipment, done, ahead=True)   # type: ignore[arg-type]
            board.post(result.count, result.loss_sum)   # type: ignore[union-attr]
        else:
            done(shipment)
        return
    if announce_packs:   # the gradient is packed: the master sums
        board.post(result.count, result.loss_sum)   # type: ignore[union-attr]
        deliver(board, result, done)   # type: ignore[arg-type]
        return
    done(result)


def deliver(board: Board, result: Any, done: Callable[[Any], None],
            ahead: bool = False) -> None:
    """A worker's window result, after its post at ``board``: into its mailbox there
    (:meth:`.board.Board.post_result`), or where it does not fit, ``done(result)`` (a
    Done through the pipe), which the mailbox then announces. The master takes it with
    :func:`take_results`. ``ahead``: before the post, as the result of the round posted
    next (the Done, where it goes by the pipe, sent before the mailbox says so)."""
    data = pack_result(result)
    if ahead:
        if len(data) > MAILBOX:
            done(result)
        board.post_result(data, ahead=True)
        return
    if not board.post_result(data):
        done(result)


def pack_result(result: Any) -> bytes:
    """What a worker puts in its mailbox (:func:`deliver`): a :class:`WindowResult` as a
    plain tuple, its epochs (:class:`EpochInfo`) as tuples, pickled; anything else (a
    :class:`Shipment`) pickled as it is. :func:`unpack_result` reads it. It is unpickled
    on the master's critical path, with its caches cold after the step, where looking up
    the named tuples' classes and calling their constructors took about 4 of its 10 us
    (two warm replicas of ``bench/overhead.py``'s MLP)."""
    if type(result) is WindowResult:
        fields = list(result)
        fields[_EPOCHS] = [tuple(e) if type(e) is EpochInfo else e for e in result.epochs]
        result = tuple(fields)
    return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_result(data: bytes) -> Any:
    """What :func:`pack_result` packed, as it was."""
    value = pickle.loads(data)
    if type(value) is not tuple:
        return value
    fields = list(value)
    fields[_EPOCHS] = [EpochInfo._make(e) if type(e) is tuple else e
                       for e in fields[_EPOCHS]]
    return WindowResult._make(fields)


_EPOCHS = WindowResult._fields.index('epochs')

"""The communicator interface every backend implements.

A communicator moves *named flat buffers* between the ranks of one update. Rank 0 is the
master. Every rank asks for the same buffers by the same names (the updater derives them
from the model's sorted parameter names, grouped by dtype), so the layout is identical on
every rank. The verbs follow MPI:

- ``reduce(name)``: sum ``buffer(name)`` of every rank into the root's ``buffer(name)``.
- ``bcast(name)``: overwrite every rank's ``buffer(name)`` with the root's.
- ``allreduce(name)``: every rank ends with the sum.

Ordering contract: backends whose verbs do not synchronise by themselves (the shared-memory
CPU backend) rely on the caller's control channel: a worker finishes ``reduce`` before it
tells the master it is done (a message, or a post at the local group's board where
:attr:`~Communicator.packs_in_shared_memory`), the master calls ``reduce`` only after every
worker said so,
and the master fills a ``bcast`` buffer before it tells the workers to start. Collective
backends (NCCL, MPI) synchronise inside the verb and work under the same contract.

Issue-order contract (NCCL's): collectives pair up by the order in which each rank issues
them, so every rank issues the same verbs on the same buffers in the same order, each rank
from one thread. :meth:`Communicator.begin_update` and :meth:`~Communicator.end_update`
bracket the collectives of one update, the unit in which backends that can check the order
compare it (the shared-memory backend does, on every update); a mismatch raises
:class:`CollectiveOrderError` naming both ranks' sequences.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy

BufferSpec = Dict[str, Tuple[str, int]]
"""Buffer name -> (dtype string, element count)."""

Issued = Tuple[str, str]
"""One collective as a rank issued it: (verb, buffer name), e.g. ``('reduce', 'grad/<f4')``."""


class CollectiveOrderError(RuntimeError):
    """Two ranks issued different collectives (verb or buffer) at the same position.

    NCCL would pair the two (mixing buffers: wrong sums) or wait forever; this error is the
    check that catches it first, with both ranks' sequences of the update in the message
    (``first``: the position of their first entries, when only the latest were kept).
    """

    def __init__(self, rank_a: int, issued_a: Sequence[Issued], rank_b: int,
                 issued_b: Sequence[Issued], update: Optional[int] = None,
                 detail: str = '', first: int = 0) -> None:
        self.sequences = {rank_a: list(issued_a), rank_b: list(issued_b)}
        self.update = update
        where = '' if update is None else f' in update {update}'
        if not detail:
            detail = _first_difference(rank_a, issued_a, rank_b, issued_b, first)
        since = f' (from collective #{first} on)' if first else ''
        super().__init__(
            f'rank {rank_a} and rank {rank_b} issued different collectives{where}: {detail}. '
            f'rank {rank_a} issued{since} {_show(issued_a)}; rank {rank_b} issued{since} '
            f'{_show(issued_b)}. '
            'Collectives pair up by issue order (NCCL would mix these buffers or hang): every '
            'rank must issue the same verbs on the same buffers in the same order, the order '
            'that mgpu_updater._local.protocol.collective_order declares')


class PeerFailure(RuntimeError):
    """The backend itself reported that the ranks can no longer communicate (NCCL's
    asynchronous error: a peer's connection closed, its process died or the network
    broke)."""


def _show(issued: Sequence[Issued]) -> str:
    return '[' + ', '.join(repr(tuple(c)) for c in issued) + ']'


def _first_difference(rank_a: int, issued_a: Sequence[Issued], rank_b: int,
                      issued_b: Sequence[Issued], first: int = 0) -> str:
    for i, (a, b) in enumerate(zip(issued_a, issued_b)):
        if tuple(a) != tuple(b):
            return (f'collective #{first + i} is {tuple(a)!r} on rank {rank_a} but '
                    f'{tuple(b)!r} on rank {rank_b}')
    short, rank, n = ((issued_b, rank_b, len(issued_a)) if len(issued_b) < len(issued_a)
                      else (issued_a, rank_a, len(issued_b)))
    return (f'rank {rank} issued {first + len(short)} collective(s) where the other issued '
            f'{first + n}')


def check_same_order(sequences: Mapping[int, Sequence[Issued]],
                     update: Optional[int] = None) -> None:
    """Raise :class:`CollectiveOrderError` unless every rank issued what the lowest rank did.

    ``sequences`` maps rank -> that rank's collectives of one update, in issue order.
    """
    ranks = sorted(sequences)
    first = [tuple(c) for c in sequences[ranks[0]]]
    for rank in ranks[1:]:
        if [tuple(c) for c in sequences[rank]] != first:
            raise CollectiveOrderError(ranks[0], first, rank, sequences[rank], update)


class Communicator(abc.ABC):
    """Base class of the backends (``shm``, ``nccl``, ``mpi``)."""

    #: name of the backend, as the factory knows it
    name: str = ''

    #: the CUDA device this rank's buffers live on; None on the host. The rank's own
    #: kernels on them (packing, unpacking) run with it current (``_cuda.using_device``).
    device_id: Optional[int] = None

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size
        self._finalized = False
        #: called while the host waits on peers; raises when one died (see watch_peers)
        self.check_peer_alive: Optional[Callable[[], None]] = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def finalized(self) -> bool:
        return self._finalized

    @abc.abstractmethod
    def buffer(self, name: str) -> Any:
        """This rank's flat 1-D array for ``name`` (numpy or cupy), reused across updates."""

    @abc.abstractmethod
    def reduce(self, name: str, root: int = 0) -> None:
        """Sum every rank's ``buffer(name)`` into the root's, in place."""

    @abc.abstractmethod
    def bcast(self, name: str, root: int = 0) -> None:
        """Copy the root's ``buffer(name)`` into every other rank's."""

    def allreduce(self, name: str) -> None:
        """Every rank ends with the sum; by default a reduce then a bcast."""
        self.reduce(name)
        self.bcast(name)

    #: whether a rank's pack into its buffers is a plain store into memory that every rank
    #: maps (the shared-memory backend): then a post at the local group's board
    #: (:mod:`mgpu_updater._local.board`) publishes it, as the ordering contract's control
    #: channel, where the machine's memory order allows
    packs_in_shared_memory: bool = False

    #: whether the root can sum the other ranks' buffers onto arrays of its own in place
    #: of its ``reduce`` (``reduce_onto(name, targets)``, the shared-memory backend): the
    #: master's gradients are then not packed, and the sums are its gradient arrays
    sums_onto_arrays: bool = False

    # -------------------------------------------------------------- what a group may ask
    # Every backend answers these; the defaults fit a backend that needs none of them.

    def init(self, timeout: Optional[float] = None) -> None:
        """Join the other ranks, for a backend with a rendezvous (NCCL), within
        ``timeout`` seconds. The master calls it once every worker said it joins
        (:class:`~mgpu_updater._local.protocol.Joining`), each worker before it reports
        ready. Default: nothing."""

    def wait(self, timeout: Optional[float] = None) -> None:
        """Return once every collective this rank issued has finished, bounded (and, where
        a backend's collectives can still be running after the verb returned, watching
        the peers): call it before anything reads on the host what a collective may still
        write, or what the compute stream orders after one. Raises when a peer died or
        the time is up (the communicator is aborted then). Default: nothing (the verbs
        return when their part is done)."""

    def drain(self) -> None:
        """Before the peers are told to stop: wait (bounded) for this rank's collectives
        in flight; never raises for a communication failure (it warns). Default: nothing."""

    @property
    def owned_segments(self) -> List[str]:
        """Names of the shared-memory segments the master owns; a worker that sees the
        master die unlinks them. Default: none."""
        return []

    def watch_peers(self, check_alive: Callable[[], None]) -> None:
        """``check_alive()`` raises when a peer process died; a backend whose host waits
        can block (NCCL) calls it between polls. Default: kept as ``check_peer_alive``."""
        self.check_peer_alive = check_alive

    def shared_slot(self, name: str) -> bool:
        """Whether ``buffer(name)`` is, on every rank, the one memory the root writes (a
        broadcast-only buffer of the shared-memory backend): a rank may then read it in
        place from one ``bcast`` until the root writes it again, which under the ordering
        contract it does only before the next ``bcast``. Default: False (each rank has its
        own copy, which ``bcast`` fills)."""
        return False

    def begin_update(self) -> None:
        """The collectives issued from now on, until :meth:`end_update`, are one update's:
        the unit in which the issue order is compared across ranks. Default: nothing."""

    def end_update(self) -> None:
        """This rank issued every collective of the update. Backends that check the issue
        order compare the ranks' sequences here (on rank 0, which under the ordering
        contract is the last to issue) or earlier. Default: nothing."""

    #: whether :meth:`rebuild` can take a new rank in place of one that died
    #: (``max_worker_restarts``)
    rebuilds: bool = False

    #: whether the ranks meet again after :meth:`rebuild` (NCCL's rendezvous): then the
    #: master tells every surviving rank to :meth:`rejoin` with the handle, and joins
    #: with :meth:`init` while they and the new ranks do
    rejoins: bool = False

    def abandon(self) -> None:
        """A peer died (``max_worker_restarts``): give up this rank's collectives in
        flight, at once and without blocking, keeping the buffers and their contents.
        Until :meth:`rebuild` (the master) or :meth:`rejoin` (a worker) no collective can
        be issued. Default: nothing (a dead rank breaks nothing of the others')."""

    def rebuild(self) -> Any:
        """On the master, after a rank's process died, once every surviving rank has
        abandoned the update (:meth:`abandon`) and before new processes take the dead
        ranks' places (``max_worker_restarts``): make the communicator one that all of
        them can use again, each counting updates from the first, and return the handle
        a new rank attaches with (and a survivor rejoins with, where :attr:`rejoins`).
        The shared-memory backend keeps its segments (the dead rank only wrote its own
        slots) and clears its ledger; NCCL makes a fresh unique id, for a new NCCL
        communicator that every rank joins. Default: cannot (:attr:`rebuilds` False)."""
        raise NotImplementedError(f'the {self.name or type(self).__name__} communicator '
                                  'cannot take a new rank')

    def rejoin(self, handle: Any) -> None:
        """On a surviving worker, after :meth:`rebuild` on the master: join the rebuilt
        communicator through ``handle`` (blocking until every rank did, where
        :attr:`rejoins`). Default: nothing (the same segments serve on)."""

    def abort(self) -> None:
        """Give up at once because a peer died; must never block. Default: finalize."""
        self.finalize()

    def finalize(self) -> None:
        """Release every resource; safe to call twice."""
        self._finalized = True

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(
                f'the {self.name or type(self).__name__} communicator was finalized; '
                'create a new one (a new updater) to communicate again')


def named_buffer(buffers: Mapping[str, Any], name: str) -> Any:
    """``buffers[name]``, or a KeyError that lists the names there are."""
    try:
        return buffers[name]
    except KeyError:
        raise KeyError(f'no buffer named {name!r}; the spec has {sorted(buffers)}') from None


def check_spec(spec: BufferSpec) -> BufferSpec:
    """Validate and normalise a buffer spec (dtype strings, non-negative counts)."""
    out = {}
    for key, (dtype, count) in spec.items():
        out[key] = (numpy.dtype(dtype).str, int(count))
        if out[key][1] < 0:
            raise ValueError(f'buffer {key!r} has a negative size ({count} given)')
    return out

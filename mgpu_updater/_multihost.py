"""The replicas of one update across MPI ranks (ChainerMN): :class:`MpiGroup`.

Every rank runs its own :class:`~mgpu_updater.ParallelAccumulatingUpdater` on one device
and its own shard of the data. Per update:

1. every rank runs ``accumulate_steps`` micro-batches, with no communication;
2. :meth:`MpiGroup.finish` averages the float persistents (BatchNorm statistics, one
   allreduce per dtype) and sums the gradients over the ranks (one allreduce per dtype), in
   the order :func:`mgpu_updater._local.protocol.collective_order` declares (``across_hosts``),
   then gathers every rank's small :class:`~mgpu_updater._replica.WindowResult` (counts,
   losses, reports) together with the collectives it issued, and rank 0's other
   persistents (integer arrays, non-array values), which every rank takes: every rank
   checks that all issued the same sequence, and raises
   :class:`~mgpu_updater.comm.base.CollectiveOrderError` alike if not (no extra message);
3. every rank's optimizer then steps on the same summed gradient.

No parameters travel after the start: the same gradient through the same optimizer gives
bitwise the same parameters on every rank (ChainerMN's approach; the allreduce hands every
rank the same sum). The parameters and array persistents are broadcast from rank 0 once,
when the group starts, so ranks whose models were initialised differently begin alike.
Under ``chainer.set_debug(True)`` every update first checks that the ranks still agree.

The results come back in rank order, the same list on every rank, so the reported means
(``main/loss``...) are the same bits on every rank.

``pipelined=True`` uses :meth:`Group.finish_async`'s default: the same reduction, at once,
with the gradient applied one update late as that mode defines; across ranks it does not
overlap the reduction with the next compute yet.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional

import numpy

import chainer

from ._chainer_private import optimizer_fingerprint
from ._flat_buffers import ModelLayouts, state_arrays
from ._groups import Group, ensure_grads
from ._local.protocol import before_window, collective_order, issue, pack_window
from ._replica import WindowResult
from .comm.base import check_same_order
from .comm.mpi import MpiCommunicator
from ._warning import warn


class MpiGroup(Group):
    """This rank and its peers, reached through a ChainerMN communicator.

    Args:
        communicator: the ChainerMN communicator given to the updater.
        model: this rank's model (parameters initialised, on this rank's device).
        local_weight: this rank's nominal samples per update (``accumulate_steps`` times
            its iterator's batch size). :attr:`nominal_samples` is their sum over the ranks:
            the global nominal samples per update, which every rank's replica divides by.
    """

    def __init__(self, communicator: Any, model: chainer.Link, local_weight: float,
                 settings: Optional[Dict[str, Any]] = None,
                 optimizer: Optional[chainer.Optimizer] = None) -> None:
        self.model = model
        #: this rank's optimizer, compared with every rank's at each update
        self.optimizer = optimizer
        self.layouts = ModelLayouts(model)
        self.comm = MpiCommunicator(communicator, self.layouts.spec(), model.device)
        self.size = self.comm.size
        self.rank = self.comm.rank
        self._warned_epochs = False
        # array persistents that are not averaged (integer, bool): rank 0's, every update
        self._kept = [name for name, array in self.layouts.index.persistent_arrays()
                      if numpy.dtype(array.dtype).kind != 'f']
        try:
            weights = self._agree(float(local_weight), settings or {})
            self.nominal_samples = float(sum(weights))
            self._broadcast_state()
        except BaseException:
            self.comm.abort()
            raise
        self._order = collective_order(self.layouts, across_hosts=True)

    def _agree(self, local_weight: float, settings: Dict[str, Any]) -> List[float]:
        """Check that every rank has the same model layout and the same ``settings`` (the
        updater's arguments that decide the result: a rank that normalised, reduced or
        applied its gradient otherwise would train apart, silently); return every rank's
        weight. Every rank sees the same gathered list, so every rank raises alike."""
        unset = sorted(n for n, p in self.model.namedparams() if p.array is None)
        mine = (self.layouts.spec(), [n for n, _ in self.model.namedparams()], unset)
        gathered = self.comm.allgather_obj((mine, local_weight, settings))
        for rank, (theirs, _, _) in enumerate(gathered):
            if theirs[2] != gathered[0][0][2] and theirs[1] == gathered[0][0][1]:
                here, there = set(gathered[0][0][2]), set(theirs[2])
                parts = [f'parameters {sorted(names)} are uninitialised on rank {a} and '
                         f'initialised on rank {b}'
                         for names, a, b in ((here - there, 0, rank), (there - here, rank, 0))
                         if names]
                raise ValueError(
                    f'{"; ".join(parts)} after the forward pass that initialises lazy '
                    'parameters (each rank runs it on the first samples of its own shard, in '
                    'test mode): a link that only some inputs reach. Give those links their '
                    'input sizes (L.Linear(784, n), not L.Linear(None, n))')
            if theirs != gathered[0][0]:
                raise ValueError(
                    f'rank {rank} has a different model from rank 0 (parameter names, '
                    f'shapes or dtypes differ): rank 0 has {_describe(gathered[0][0])}, rank '
                    f'{rank} has {_describe(theirs)}; build the same model on every rank')
        first = gathered[0][2]
        for name in sorted(first):
            apart = [r for r, (_, _, theirs) in enumerate(gathered)
                     if theirs.get(name) != first[name]]
            if apart:
                given = ', '.join(f'rank {r}: {gathered[r][2].get(name)!r}' for r in apart)
                raise ValueError(
                    f'the ranks were given different {name}: rank 0: {first[name]!r}, '
                    f'{given}; pass the same {", ".join(sorted(first))} on every rank (the '
                    'ranks reduce one gradient and must treat it alike)')
        return [w for _, w, _ in gathered]

    def _broadcast_state(self) -> None:
        """Parameters and array persistents from rank 0 to every rank (once)."""
        arrays = state_arrays(self.model)
        self.layouts.state.pack(arrays, self.comm.buffer)
        issue(self.comm, before_window(collective_order(self.layouts)))   # the local bcasts
        self.layouts.state.unpack(self.comm.buffer, arrays)

    # ------------------------------------------------------------------ each update
    def begin(self, loss_scale: Optional[float], parity: Optional[int] = None,
              optimizer: Any = None) -> bool:
        if chainer.is_debug():
            self._check_in_sync()
        return False

    def finish(self, own: WindowResult) -> List[WindowResult]:
        model, layouts, comm = self.model, self.layouts, self.comm
        comm.begin_update()
        pack_window(comm, layouts, model, None, self.size)
        issue(comm, self._order)
        comm.end_update()
        index = layouts.index_of(model)
        persistents = dict(index.persistent_arrays())
        # the kept arrays that hold no array now (a number or None given since): raised
        # on every rank alike, after the exchange, not by one rank before it
        lost = [name for name in self._kept if name not in persistents]
        kept = (self._rank0_values(persistents, layouts.step_values(model))
                if self.rank == 0 and not lost else None)
        stepping = None if self.optimizer is None else optimizer_fingerprint(self.optimizer)
        gathered = comm.allgather_obj((own, comm.issued(), kept, stepping, lost))
        check_same_order({rank: g[1] for rank, g in enumerate(gathered)}, comm.updates)
        _check_same_optimizer([g[3] for g in gathered], comm.updates)
        lost_on = {rank: g[4] for rank, g in enumerate(gathered) if g[4]}
        if lost_on:
            raise RuntimeError(
                'the persistents ' + '; '.join(f'{names} of rank {rank}' for rank, names
                                               in sorted(lost_on.items()))
                + ' held arrays when the ranks started and hold no array now: each update '
                'takes them from rank 0 into the array every rank holds. Set their elements '
                'instead (link.name[...] = value), or build new updaters after the change')
        ensure_grads(model)
        layouts.grad.unpack(comm.buffer, index.grad_arrays())
        layouts.stat.unpack(comm.buffer, persistents)
        if self.rank != 0:
            self._take_rank0_values(index, persistents, gathered[0][2])
        results = [g[0] for g in gathered]
        results[self.rank] = own
        self._check_epochs(results)
        return results

    def _rank0_values(self, arrays: Dict[str, Any], values: Dict[str, Any]) -> Any:
        """The persistents that are not averaged, as rank 0 holds them after its window:
        integer arrays (on the host) and non-array values (BatchNorm's ``N``). A forward
        that moves them (a counter of samples) moved each rank's by its own share; as
        among local replicas, they take the master's: rank 0's."""
        host = chainer.backend.CpuDevice()
        return ({name: numpy.array(host.send(arrays[name])) for name in self._kept}, values)

    def _take_rank0_values(self, index: Any, own: Dict[str, Any], kept: Any) -> None:
        arrays, scalars = kept
        for name, value in arrays.items():
            own[name][...] = chainer.backend.get_device_from_array(own[name]).send(value)
        if scalars:
            index.set_persistent_scalars(scalars)

    def _check_in_sync(self) -> None:
        digest = hashlib.sha256()
        for name, array in sorted(state_arrays(self.model).items()):
            digest.update(name.encode())
            digest.update(chainer.backend.CpuDevice().send(array).tobytes())
        digests = self.comm.allgather_obj(digest.hexdigest())
        apart = [r for r, d in enumerate(digests) if d != digests[0]]
        if apart:
            raise RuntimeError(
                f'the parameters of rank(s) {apart} differ from rank 0 at the start of an '
                'update; every rank must run the same optimizer on the same model (a '
                'non-deterministic optimizer hook, or a model that an extension run on some '
                'ranks only changed?)')

    def _check_epochs(self, results: List[WindowResult]) -> None:
        """Warn once when the ranks disagree on the epoch: an epoch trigger would then
        fire at different updates on different ranks, and a rank that stops while the
        others wait in the next collective leaves them hanging."""
        if self._warned_epochs:
            return
        epochs = [r.epochs[-1].epoch for r in results if r.epochs]
        if len(set(epochs)) > 1:
            self._warned_epochs = True
            if self.rank == 0:
                warn(
                    f'the ranks are at different epochs ({epochs}, in rank order): their '
                    'shards or batch sizes differ, so a stop trigger or extension counted '
                    'in epochs fires at different updates on different ranks, and a rank '
                    'left waiting in a collective hangs. Give every rank as many batches '
                    'per epoch (chainermn.scatter_dataset shards are equal by default; use '
                    'the same batch size), or count triggers in iterations',
                    RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ the rest
    def states(self, timeout: float = 60.0) -> Dict[int, Dict[str, Any]]:
        return {}   # each rank snapshots its own iterator

    def pids(self) -> List[int]:
        return []

    def close(self, abort: bool = False) -> None:
        if abort:
            self.comm.abort()
        else:
            self.comm.finalize()


def _check_same_optimizer(fingerprints: List[Any], update: int) -> None:
    """Raise, on every rank alike (each sees the same list), where a rank's optimizer
    would take another step than rank 0's on the same summed gradient: another class,
    hyperparameter or hook, given so (``lr=0.1`` on one rank) or set so since by an
    extension that runs on some ranks only (``ExponentialShift`` under ``if comm.rank ==
    0``). The ranks' parameters would drift apart, silently; raised before the step."""
    first = fingerprints[0]
    apart = [r for r, theirs in enumerate(fingerprints) if theirs != first]
    if not apart or first is None:
        return
    theirs = fingerprints[apart[0]]
    differ = []
    if first[0] != theirs[0]:
        differ.append(f'class: rank 0: {first[0]}, rank {apart[0]}: {theirs[0]}')
    elif first[1] != theirs[1]:   # (another class has other hyperparameters anyway)
        ours, other = dict(first[1]), dict(theirs[1])
        keys = sorted(k for k in set(ours) | set(other)
                      if ours.get(k, _NONE) != other.get(k, _NONE))
        differ.append(', '.join(f'{k}: rank 0: {ours.get(k)!r}, rank {apart[0]}: '
                                f'{other.get(k)!r}' for k in keys))
    if first[2] != theirs[2]:
        differ.append(f'hooks: rank 0: {list(first[2])}, rank {apart[0]}: {list(theirs[2])}')
    raise RuntimeError(
        f"the optimizers of rank(s) {apart} differ from rank 0's at update {update} "
        f'({"; ".join(differ)}): each rank steps its own optimizer on the same summed '
        'gradient, so their parameters would drift apart. Build the same optimizer on '
        "every rank, and extend every rank's trainer with each extension that changes it "
        '(ExponentialShift and the other shifts, a hook added later); only extensions '
        'that report (LogReport, PrintReport, ProgressBar) may run on rank 0 alone')


_NONE = object()   # a hyperparameter one optimizer has and another has not


def _describe(layout: Any) -> str:
    spec, names = layout[:2]
    values = ', '.join(f'{count} {numpy.dtype(dtype).name}'
                       for key, (dtype, count) in sorted(spec.items()) if key.startswith('grad/'))
    return f'{len(names)} parameters of {values or "no"} values'

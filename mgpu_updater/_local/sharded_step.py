"""The optimizer step, sharded over the replicas of one host (ZeRO stage 1, in shared memory).

Opt-in (``shard_optimizer=True``). By default the master sums every replica's gradient and
steps every parameter while the workers wait. Where the step is elementwise (every update rule of Chainer's own optimizers
but MSVAG, with no hooks but ``WeightDecay``, ``Lasso`` and ``GradientHardClipping``) it can
be split instead: replica r owns slice r of each flat gradient buffer
(:func:`mgpu_updater.comm.base.shard_range`), sums the replicas' gradients over it
(``reduce_scatter``) and steps the parameters of that slice itself, where every replica reads
them (the shared parameter slot, :class:`~.group.SlotParams`), with the optimizer's state of
that slice, which lives in shared memory too (the ``ostate/<dtype>`` buffers,
:class:`StateLayout`). The summing and the step then take about 1/N of the time each, and no
replica waits for another's step but at the end.

The result is bitwise the master's step: every element is summed in the same order (rank 0
first, :func:`mgpu_updater.comm.shm.sum_slots`), scaled by the same factor, passed through
the same hooks and the same rule with the same hyperparameters and the same ``t``; an
elementwise rule on a slice computes, element by element, what it computes on the whole
array. The master keeps the bookkeeping of ``optimizer.update()`` (``optimizer.t``, each
rule's ``t``, its state, which the snapshots save), so the optimizer is the user's, untouched,
and between updates it is what it would be after the master's own step; only the arrays of
its state are views of the shared buffer while the workers live (copied off at close, as the
parameters are).

Which update is sharded the master decides at every begin (:meth:`MasterShards.prepare`), and
says so in :class:`~.protocol.Step`, which carries each worker's rules; a reason not to (loss
scaling, a hook that reads every gradient as ``GradientClipping``, a rule not listed here,
pipelined mode, a parameter not in the shared slot, a CPU whose memory order the board
cannot rely on) makes that update the master's step, as before. The ranks of a sharded
update meet at the board (:mod:`.board`), each decides the factor itself; the messages and
the order of the collectives are :mod:`.protocol`'s.
"""
from __future__ import annotations

import copy
import pickle
import platform
from typing import (Any, Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional,
                    Tuple)

import chainer
import numpy
from chainer import optimizer_hooks, optimizers

from .. import _chainer_private as chainer_private
from .._flat_buffers import FlatLayout, ModelLayouts
from ..comm.base import shard_range
from .board import STORE_ORDER

#: The update rules whose step on a slice is, element by element, the step on the whole
#: array: Chainer's own, each ``is_elementwise``, whose only state is arrays shaped as the
#: parameter and whose only other attribute is constant (``AdamRule.initial_alpha``).
#: ``MSVAGRule`` is left out: it keeps a running scalar (``beta_power``) besides its arrays.
ELEMENTWISE_RULES: FrozenSet[type] = frozenset({
    optimizers.sgd.SGDRule, optimizers.momentum_sgd.MomentumSGDRule,
    optimizers.corrected_momentum_sgd.CorrectedMomentumSGDRule,
    optimizers.nesterov_ag.NesterovAGRule, optimizers.adam.AdamRule,
    optimizers.ada_grad.AdaGradRule, optimizers.ada_delta.AdaDeltaRule,
    optimizers.rmsprop.RMSpropRule, optimizers.rmsprop_graves.RMSpropGravesRule,
    optimizers.smorms3.SMORMS3Rule})

#: The optimizer hooks that act on each element of a parameter's gradient alone.
#: ``GradientClipping`` (a global norm), ``GradientLARS`` (a norm per parameter) and
#: ``GradientNoise`` (random draws) are not: with them the master steps.
ELEMENTWISE_HOOKS: Tuple[type, ...] = (optimizer_hooks.WeightDecay, optimizer_hooks.Lasso,
                                       optimizer_hooks.GradientHardClipping)

_RULE_BASE_ATTRS = frozenset(vars(chainer.UpdateRule()))   # what every rule has


class Piece(NamedTuple):
    """One parameter's part of a rank's slice: elements ``[lo, hi)`` of its flattened
    array, at ``offset`` in the ``dtype``'s gradient buffer."""
    name: str
    dtype: str
    offset: int
    lo: int
    hi: int


def pieces(grad: FlatLayout, size: int, rank: int) -> List[Piece]:
    """The pieces of ``rank``'s slice of every gradient buffer, in buffer order."""
    out = []
    for dtype, entries in grad.groups.items():
        lo, hi = shard_range(grad.sizes[dtype], size, rank)
        for e in entries:
            a, b = max(lo, e.offset), min(hi, e.offset + e.size)
            if a < b:
                out.append(Piece(e.name, dtype, e.offset, a - e.offset, b - e.offset))
    return out


class StateLayout:
    """Where the optimizer's state lives: one buffer per dtype, ``ostate/<dtype>``, holding
    one region per state entry (``keys``, sorted), each laid out as the gradient buffer."""

    prefix = 'ostate'

    def __init__(self, grad: FlatLayout, keys: Iterable[str]) -> None:
        self.grad = grad
        self.keys = tuple(sorted(keys))

    def spec(self) -> Dict[str, Tuple[str, int]]:
        if not self.keys:
            return {}
        return {f'{self.prefix}/{dtype}': (dtype, len(self.keys) * n)
                for dtype, n in self.grad.sizes.items()}

    def flat(self, buffer: Any, key: str, dtype: str, offset: int, lo: int,
             hi: int) -> Any:
        """Elements ``[lo, hi)`` of the entry at ``offset``, in ``key``'s region."""
        base = self.keys.index(key) * self.grad.sizes[dtype] + offset
        return buffer(f'{self.prefix}/{dtype}')[base + lo:base + hi]


def state_keys(optimizer: Any) -> Optional[Tuple[str, ...]]:
    """The state entries of the optimizer's update rules (sorted), or None where its step
    can never be sharded (not a ``GradientMethod``, or a rule not in
    :data:`ELEMENTWISE_RULES`). Found as Chainer's ``UpdateRule.serialize`` finds them, by
    initialising a copy's state on a one-element array."""
    if not isinstance(optimizer, chainer.GradientMethod) or optimizer.target is None:
        return None
    keys = set()
    for param in optimizer.target.params():
        rule = param.update_rule
        if rule is None:
            continue
        if type(rule) not in ELEMENTWISE_RULES:
            return None
        probe = copy.copy(rule)
        chainer_private.set_rule_state(probe, {})
        one = numpy.zeros(1, dtype=numpy.float32)
        probe.init_state(chainer.Variable(one, grad=one))
        keys.update(probe.state)
    return tuple(sorted(keys))


def why_not(optimizer: Any, loss_scale: Optional[float], keys: Tuple[str, ...]) -> Optional[str]:
    """Why this update's step cannot be sharded, or None."""
    if not STORE_ORDER:
        return ('the ranks meet in shared memory without messages, which needs the store '
                'order of x86-64 (this machine is a ' + platform.machine() + ')')
    if not isinstance(optimizer, chainer.GradientMethod):
        return 'the optimizer is not a GradientMethod'
    if type(optimizer).update is not chainer.GradientMethod.update:
        return f'{type(optimizer).__name__} has an update() of its own'
    if loss_scale is not None:
        return 'loss scaling is on'
    pre, post = chainer_private.optimizer_hooks(optimizer)
    if post:
        return f'the optimizer has post-update hooks ({sorted(post)})'
    for name, hook in pre.items():
        if not (isinstance(hook, ELEMENTWISE_HOOKS)
                and getattr(hook, 'call_for_each_param', False)):
            return f'the optimizer hook {name!r} is not elementwise'
    for name, param in optimizer.target.namedparams():
        rule = param.update_rule
        if rule is None:
            continue
        if type(rule) not in ELEMENTWISE_RULES:
            return f'the update rule of {name} ({type(rule).__name__}) is not elementwise'
        if chainer_private.rule_has_hooks(rule):
            return f'the update rule of {name} has hooks'
        if chainer_private.rule_uses_fp32_update(rule):
            return f'the update rule of {name} uses use_fp32_update'
        state = rule.state
        if state is not None and not set(state) <= set(keys):
            return f'the update rule of {name} has state entries {sorted(state)}'
    return None


class RuleSpec(NamedTuple):
    """What a worker needs to run one parameter's rule on its piece, every update."""
    cls: type
    t: int                    # the rule's t after this update's increment
    hyper: Dict[str, Any]     # rule.hyperparam.get_dict(): its own values and its parent's
    extra: Dict[str, Any]     # attributes the class adds (AdamRule.initial_alpha)


class _Slices:
    """One rank's pieces as Chainer parameters over the shared buffers: the parameter
    slot, the summed gradient (where ``reduce_scatter`` leaves it) and the state."""

    def __init__(self, comm: Any, layouts: ModelLayouts, states: StateLayout,
                 rank: int) -> None:
        self.pieces = pieces(layouts.grad, comm.size, rank)
        where = {e.name: (dtype, e.offset) for dtype, entries in layouts.state.groups.items()
                 for e in entries}
        self.params: Dict[str, chainer.Parameter] = {}
        self.states: Dict[str, Dict[str, Any]] = {}
        for p in self.pieces:
            dtype, at = where[p.name]
            array = comm.buffer(f'{layouts.state.prefix}/{dtype}')[at + p.lo:at + p.hi]
            grad = comm.scattered(f'{layouts.grad.prefix}/{p.dtype}')[
                p.offset + p.lo:p.offset + p.hi]
            param = chainer.Parameter(array, name=p.name)
            param.grad = grad
            self.params[p.name] = param
            self.states[p.name] = {key: states.flat(comm.buffer, key, p.dtype, p.offset,
                                                    p.lo, p.hi) for key in states.keys}
        self._arrays = {name: (param.array, param.grad) for name, param in self.params.items()}

    def step(self, rules: Dict[str, Any], factor: float, hooks: Iterable[Any]) -> None:
        """Each piece whose rule is given: scale its gradient, run the hooks, then the rule
        (what ``optimizer.update()`` does to each element, in that order)."""
        hooks = tuple(hooks)
        for name, rule in rules.items():
            param = self.params[name]
            array, grad = self._arrays[name]
            if factor != 1.0:
                grad *= factor
            for hook in hooks:
                hook(rule, param)
            rule.update_core(param)
            # A rule or hook that assigned new arrays instead of writing in place: copy
            # them into the shared buffers, where the other ranks and the master read them.
            if param.array is not array:
                array[...] = param.array
                param.array = array
            if param.grad is not grad:
                grad[...] = param.grad
                param.grad = grad
            state = rule.state
            for key, view in self.states[name].items():
                if key in state and state[key] is not view:
                    view[...] = state[key]
                    state[key] = view

    def piece_state(self, name: str) -> Dict[str, Any]:
        return dict(self.states[name])


class MasterShards:
    """The master's side: decide, bind the optimizer's state, keep its bookkeeping, step
    slice 0, tell each worker what its rules are."""

    def __init__(self, comm: Any, layouts: ModelLayouts, states: StateLayout,
                 model: chainer.Link) -> None:
        self.states = states
        self.slices = _Slices(comm, layouts, states, 0)
        self.model = model
        self.params = dict(model.namedparams())
        self.names_of = {rank: [p.name for p in pieces(layouts.grad, comm.size, rank)]
                         for rank in range(1, comm.size)}
        entries = {e.name: (dtype, e) for dtype, es in layouts.grad.groups.items() for e in es}
        self.state_views: Dict[str, Dict[str, Any]] = {}
        for name, (dtype, e) in entries.items():
            self.state_views[name] = {
                key: states.flat(comm.buffer, key, dtype, e.offset, 0, e.size).reshape(e.shape)
                for key in states.keys}
        self.reason: Optional[str] = None   # why the latest update was not sharded

    def prepare(self, optimizer: Any, loss_scale: Optional[float],
                bound: FrozenSet[str]) -> bool:
        """Whether this update's step is sharded; if so, every rule's state exists and is
        its view of the shared buffer. ``bound``: the parameters in the shared slot."""
        self.reason = why_not(optimizer, loss_scale, self.states.keys)
        if self.reason is None and optimizer.target is not self.model:
            self.reason = "the optimizer's target is not the model the updater started with"
        if self.reason is None and bound != frozenset(self.params):
            self.reason = f'parameters {sorted(set(self.params) - bound)} are not in the slot'
        if self.reason is None:
            self.reason = self._bind_state()
        return self.reason is None

    def _bind_state(self) -> Optional[str]:
        for name, param in self.params.items():
            rule = param.update_rule
            if rule is None or not rule.enabled:
                continue
            chainer_private.init_rule_state(rule, param)
            state = rule.state
            for key, value in state.items():
                view = self.state_views[name].get(key)
                if value is view:
                    continue
                if not (isinstance(value, numpy.ndarray) and view is not None
                        and value.dtype == view.dtype and value.shape == view.shape):
                    return f'the state {key!r} of {name} is not an array shaped as it'
                view[...] = value
                state[key] = view
        return None

    def orders(self, optimizer: Any) -> Tuple[Tuple[Any, ...], Dict[int, bytes]]:
        """The optimizer's hooks, and what each worker's :class:`~.protocol.Step` carries,
        pickled at begin: the rules of its pieces as they will be after :meth:`count`
        (``t`` one up; None for a rule that is off, ``enabled = False`` or no rule), and
        those hooks."""
        pre, _ = chainer_private.optimizer_hooks(optimizer)
        hooks = tuple(pre.values())
        out = {}
        for rank, names in self.names_of.items():
            rules: Dict[str, Optional[RuleSpec]] = {}
            for name in names:
                rule = self.params[name].update_rule
                if rule is None or not rule.enabled:
                    rules[name] = None
                    continue
                extra = {k: v for k, v in vars(rule).items() if k not in _RULE_BASE_ATTRS}
                rules[name] = RuleSpec(type(rule), rule.t + 1, rule.hyperparam.get_dict(),
                                       extra)
            out[rank] = pickle.dumps((rules, hooks), protocol=pickle.HIGHEST_PROTOCOL)
        return hooks, out

    def count(self, optimizer: Any) -> None:
        """The bookkeeping of ``GradientMethod.update`` (chainer/optimizer.py, 7.8.1):
        ``optimizer.t`` and each enabled rule's ``t`` go up by one."""
        optimizer.t += 1
        for param in self.params.values():
            rule = param.update_rule
            if rule is not None and rule.enabled:
                rule.t += 1

    def step(self, optimizer: Any, factor: float, hooks: Tuple[Any, ...]) -> None:
        """Step slice 0 (after :meth:`count`)."""
        chainer_private.set_update_loss_scale(self.model, None)
        rules = {}
        for p in self.slices.pieces:
            rule = self.params[p.name].update_rule
            if rule is None or not rule.enabled:
                continue
            piece_rule = copy.copy(rule)   # shares the hyperparameters, and t as it is now
            chainer_private.set_rule_state(piece_rule, self.slices.piece_state(p.name))
            rules[p.name] = piece_rule
        self.slices.step(rules, factor, hooks)

    def detach(self) -> None:
        """State arrays that are still views of the shared buffer become copies."""
        for name, param in self.params.items():
            rule = param.update_rule
            state = None if rule is None else rule.state
            if not state:
                continue
            for key, view in self.state_views[name].items():
                if state.get(key) is view:
                    state[key] = view.copy()


class WorkerShards:
    """A worker's side: pack its gradient in two parts, decide the factor
    (``decide(count, loss)``, as the master does), step its slice with the rules the
    master sent."""

    def __init__(self, comm: Any, layouts: ModelLayouts, states: StateLayout,
                 decide: Callable[[int, float], Optional[float]]) -> None:
        self.slices = _Slices(comm, layouts, states, comm.rank)
        self.decide = decide
        self._rules: Dict[str, Any] = {}
        self._grad = layouts.grad
        self._buffer = comm.buffer
        self._own = self.slices.pieces
        self._others = [p for rank in range(comm.size) if rank != comm.rank
                        for p in pieces(layouts.grad, comm.size, rank)]

    def pack(self, model: chainer.Link, own: bool) -> None:
        """Copy the gradient of the other ranks' slices (``own`` False: before the post,
        as they read them after it) or of its own slice (True: after the post, while the
        others post; only this rank reads it) into this rank's slot."""
        grads = {name: p.grad for name, p in model.namedparams()}
        for p in (self._own if own else self._others):
            dst = self._buffer(f'{self._grad.prefix}/{p.dtype}')[
                p.offset + p.lo:p.offset + p.hi]
            src = grads[p.name]
            if src is None:
                dst.fill(0)
            else:
                dst[...] = src.reshape(-1)[p.lo:p.hi]

    def step(self, count: int, loss: float, orders: bytes) -> None:
        """Step its slice for an update over ``count`` samples of mean loss ``loss``."""
        factor = self.decide(count, loss)
        if factor is None:   # no step (the master skips it, or raises)
            return
        specs, hooks = pickle.loads(orders)
        rules = {}
        for name, spec in specs.items():
            if spec is None:
                continue
            rule = self._rules.get(name)
            if type(rule) is not spec.cls:
                rule = spec.cls.__new__(spec.cls)
                chainer.UpdateRule.__init__(rule)
                chainer_private.set_rule_state(rule, self.slices.piece_state(name))
                self._rules[name] = rule
            vars(rule).update(spec.extra)
            rule.hyperparam = chainer.optimizer.Hyperparameter()
            vars(rule.hyperparam).update(spec.hyper)
            rule.t = spec.t
            rules[name] = rule
        self.slices.step(rules, factor, hooks)

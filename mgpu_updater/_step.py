"""When a reduced gradient becomes an optimizer step: at once, or one update late.

The policy is chosen once, at construction, as ChainerMN's
``create_multi_node_optimizer(double_buffering=...)`` picks ``_MultiNodeOptimizer`` or
``_DoubleBufferingOptimizer`` (``chainermn/optimizers.py:5,59,149-182``); each reads
straight through:

- :class:`ImmediateStep` (default): the update's gradient is reduced into the model and
  stepped on in the same update.
- :class:`OneLateStep` (``pipelined=True``): the gradient of update t is reduced into one
  of two sets of buffers (the *parity*, alternating) and stepped on at update t+1, so update
  t+1's gradient was computed on parameters one step stale. The first update steps on nothing.

Both hand the updater a :class:`GradientStep` to apply; only the one-late policy holds
state between updates (the step in flight), which it saves in snapshots, under
``pending/``, and detaches from the communicator's buffers before they are released.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import chainer

from . import _chainer_private as chainer_private
from ._flat_buffers import initialized_params
from ._groups import Group, ReduceHandle
from ._replica import WindowResult, total_loss


def decide(count: int, loss: float, nonfinite: str, dynamic: bool,
           scaling: Any) -> Tuple[Optional[float], bool]:
    """The factor on the summed gradient of an update over ``count`` samples whose mean
    loss is ``loss``, or None when nothing is stepped (no sample, or a non-finite loss
    under the ``nonfinite`` policy 'raise' or 'skip'); and whether the loss was non-finite
    (for the caller to raise or warn). With dynamic loss scaling a non-finite step is
    Chainer's to skip (and to lower the scale), exactly as on one device. The one home of
    this decision."""
    if count == 0:
        return None, False
    if nonfinite != 'ignore' and not dynamic and not math.isfinite(loss):
        return None, True
    # The update's own factor, decided by Scaling with the others (see _replica).
    return scaling.update(count), False


def nonfinite_gradients(optimizer: chainer.Optimizer) -> List[str]:
    """The names of the parameters whose gradient holds inf or NaN and would reach a
    parameter in the optimizer's step; empty when there is none. One reduction per
    parameter on its device, then one host read. Under a static loss scale nothing else
    looks (Chainer's own check runs only for dynamic scaling), and a float16 gradient that
    overflowed, in backward or in the sum over the replicas, would reach the parameters.

    A parameter the step leaves alone (``disable_update()``, ``update_rule.enabled =
    False``, no update rule) does not count, as ``StandardUpdater`` trains the others
    whatever its gradient holds, unless a hook of the optimizer that runs before the step
    reads every gradient (one called with the optimizer, not for each parameter:
    ``GradientClipping``'s norm), through which it would reach them all."""
    whole = any(timing == 'pre' and not getattr(hook, 'call_for_each_param', False)
                for timing, _, hook in chainer_private.optimizer_hooks(optimizer))
    checked, flags, seen = [], [], set()
    for param in optimizer.target.params():
        grad, rule = param.grad, param.update_rule
        if grad is None or id(param) in seen or not (
                whole or (rule is not None and rule.enabled)):
            continue
        seen.add(id(param))
        with chainer.using_device(param.device):
            flags.append(param.device.xp.isfinite(grad).all())
        checked.append(param)
    if not flags:
        return []
    xp = chainer.backend.get_array_module(flags[0])
    with chainer.using_device(chainer.backend.get_device_from_array(flags[0])):
        finite = chainer.backend.CpuDevice().send(xp.stack(flags))
    if finite.all():
        return []
    bad = {id(param) for param, ok in zip(checked, finite) if not ok}
    names = {}
    for name, param in optimizer.target.namedparams():
        if id(param) in bad:
            names.setdefault(id(param), name)
    return list(names.values())


class GradientStep:
    """A reduced gradient with what applying it needs.

    ``handle`` is ``None`` when the gradient already lies in the model's ``grad`` arrays,
    else a :class:`~mgpu_updater._groups.ReduceHandle` to copy it from first.
    """

    def __init__(self, count: int, loss: float, loss_scale: Optional[float],
                 handle: Optional[ReduceHandle]) -> None:
        self.count, self.loss, self.loss_scale, self.handle = count, loss, loss_scale, handle


class ImmediateStep:
    """Reduce, then step on that gradient in the same update."""

    def parity(self) -> Optional[int]:
        return None   # one set of gradient buffers

    def reduce(self, group: Group, own: WindowResult, loss_scale: Optional[float],
               parity: Optional[int], on_step: Callable[[GradientStep], None]
               ) -> Tuple[List[WindowResult], GradientStep]:
        """The replicas' results, and this update's gradient (now in the model), which
        ``on_step`` is given as soon as it is there (:meth:`Group.finish_stepping`)."""
        steps: List[GradientStep] = []

        def step(count: int, loss: float) -> None:
            steps.append(GradientStep(count, loss, loss_scale, None))
            on_step(steps[0])
        results = group.finish_stepping(own, step)
        return results, steps[0]

    def due(self, fresh: GradientStep, model: chainer.Link) -> Optional[GradientStep]:
        """The step to apply now: this update's."""
        return fresh

    def save(self, serializer: Any, model: chainer.Link) -> None:
        serializer('present', False)

    def load(self, serializer: Any, model: chainer.Link) -> None:
        serializer('present', False)

    def detach(self) -> None:
        pass

    def drop(self) -> None:
        pass


class OneLateStep:
    """Reduce into the parity's buffers; step on the previous update's gradient."""

    def __init__(self) -> None:
        self.in_flight: Optional[GradientStep] = None
        self._reduced_into = 1   # the set the last update's gradient went to (first: 0)

    def parity(self) -> Optional[int]:
        """The set of buffers the next update reduces into: the other one than the step
        in flight's. (Not ``iteration % 2``: a script may set ``updater.iteration``
        between updates, which then reduced onto the gradient in flight.)"""
        return 1 - self._reduced_into

    def reduce(self, group: Group, own: WindowResult, loss_scale: Optional[float],
               parity: Optional[int], on_step: Callable[[GradientStep], None]
               ) -> Tuple[List[WindowResult], GradientStep]:
        """The replicas' results, and this update's gradient (left in its buffers), given
        to ``on_step`` once the results are in."""
        results, handle = group.finish_async(own, parity)
        fresh = GradientStep(sum(r.count for r in results), total_loss(results), loss_scale,
                             handle)
        if fresh.count:   # (none: the end of the data, stepped on never; in flight stays)
            self._reduced_into = parity
        on_step(fresh)
        return results, fresh

    def due(self, fresh: GradientStep, model: chainer.Link) -> Optional[GradientStep]:
        """The previous update's step, its gradient copied into the model; ``fresh``
        waits for the next update. ``None`` at the first update."""
        due, self.in_flight = self.in_flight, fresh
        if due is not None and due.handle is not None:
            due.handle.apply(model)
        return due

    def save(self, serializer: Any, model: chainer.Link) -> None:
        """The step in flight is state: its gradient, count, loss and loss scale."""
        serializer('present', self.in_flight is not None)
        if self.in_flight is None:
            return
        grads = self.in_flight.handle.wait()
        node = serializer['grads']
        for name, _ in initialized_params(model):
            node(name, grads[name])
        serializer('count', self.in_flight.count)
        serializer('loss', float(self.in_flight.loss))   # a 0-dim array under 'ignore'
        serializer('loss_scale', -1.0 if self.in_flight.loss_scale is None
                   else self.in_flight.loss_scale)

    def load(self, serializer: Any, model: chainer.Link) -> None:
        if not bool(serializer('present', False)):
            self.in_flight = None
            return
        node = serializer['grads']
        grads = {name: model.xp.asarray(node(name, None)) for name, _ in initialized_params(model)}
        scale = float(serializer('loss_scale', -1.0))
        self.in_flight = GradientStep(int(serializer('count', 0)),
                                      float(serializer('loss', 0.0)),
                                      None if scale < 0 else scale,
                                      ReduceHandle(lambda: grads))

    def detach(self) -> None:
        """Copy the gradient in flight off the buffers that are about to be released."""
        if self.in_flight is not None and self.in_flight.handle is not None:
            self.in_flight.handle = self.in_flight.handle.detached()

    def drop(self) -> None:
        """Forget the step in flight (after a failure its buffers are gone)."""
        self.in_flight = None


def choose(pipelined: bool) -> Any:
    """The policy for ``pipelined``."""
    return OneLateStep() if pipelined else ImmediateStep()

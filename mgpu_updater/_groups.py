"""The replicas of one update, seen from the master: how their gradients meet.

A group hides where the other replicas are: nowhere (:class:`SoloGroup`, one device), in
worker processes on this host (:class:`mgpu_updater._local.group.LocalGroup`: shared
memory or NCCL), or in other MPI ranks (:class:`mgpu_updater._multihost.MpiGroup`). The
updater's step policy (:mod:`mgpu_updater._step`) calls, every update::

    group.begin(loss_scale, parity)   # parameters out, the others start their windows
    own = replica.run_window(...)     # the master's own share
    results = group.finish(own)       # model grads := sum over replicas,
                                      # float persistents := mean over replicas

The pipelined mode calls ``finish_async`` instead: it returns with a :class:`ReduceHandle`
on the summed gradient, which the step policy applies one update later.
"""
from __future__ import annotations

import abc
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import chainer

from . import _cuda
from ._flat_buffers import initialized_params
from ._replica import WindowResult, total_loss, writable_in_place


class ReduceHandle:
    """A summed gradient kept for later (pipelined mode): ``wait()`` then ``apply(model)``.

    Every collective was issued, in order, before this object exists (see
    :mod:`mgpu_updater._local.protocol`); ``source`` reads the result where it lies, on CUDA
    device ``device_id`` (None: the host), which is current while the result is copied.
    """

    def __init__(self, source: Callable[[], Dict[str, Any]],
                 device_id: Optional[int] = None) -> None:
        self._source = source
        self.device_id = device_id

    def wait(self) -> Dict[str, Any]:
        """The summed gradients by parameter name."""
        return self._source()

    def apply(self, model: chainer.Link) -> None:
        grads = self.wait()
        ensure_grads(model)
        with _cuda.using_device(self.device_id):
            for name, param in initialized_params(model):
                param.grad[...] = grads[name]

    def detached(self) -> 'ReduceHandle':
        """A handle on a copy of the gradients, off the buffers they lie in (before the
        buffers are released)."""
        with _cuda.using_device(self.device_id):   # CuPy copies onto the current device
            grads = {name: g.copy() for name, g in self.wait().items()}
        return ReduceHandle(lambda: grads, self.device_id)


class Group(abc.ABC):
    """The other replicas of an update (the master's replica is the caller's)."""

    size = 1
    model: chainer.Link

    def begin(self, loss_scale: Optional[float], parity: Optional[int] = None) -> None:
        """Send the parameters out and start the others' windows (no-op alone)."""

    def settle(self) -> None:
        """Return once this rank's collectives in flight have finished, bounded and
        watching the others: the master calls it before it reads its window's values on
        the host (a wait for its device). Default: nothing (no collective runs on)."""

    @abc.abstractmethod
    def finish(self, own: WindowResult) -> List[WindowResult]:
        """Wait for the others; the model's gradients become the sum over replicas."""

    def finish_stepping(self, own: WindowResult,
                        step: Callable[[int, float], None]) -> List[WindowResult]:
        """:meth:`finish`, calling ``step(count, loss)`` (the update's sample count and mean
        loss) once the summed gradient is in the model. Default: after :meth:`finish`; the
        local group calls it sooner where its workers post at the board that their
        gradient is packed, before it takes their results (their Done messages, on their
        way meanwhile)."""
        results = self.finish(own)
        step(sum(r.count for r in results), total_loss(results))
        return results

    def finish_async(self, own: WindowResult,
                     parity: int) -> Tuple[List[WindowResult], ReduceHandle]:
        """Default: reduce now, keep a copy of the summed gradient for later."""
        results = self.finish(own)
        ensure_grads(self.model)
        saved = {name: p.grad.copy() for name, p in initialized_params(self.model)}
        return results, ReduceHandle(lambda: saved)

    def states(self, timeout: float = 60.0) -> Dict[int, Dict[str, Any]]:
        """Iterator states of the other replicas by rank (for a snapshot), waiting at most
        ``timeout`` seconds for them."""
        return {}

    def pids(self) -> List[int]:
        return []

    def detached(self) -> Any:
        """After :meth:`close`, what the next start of the workers needs to tell the
        arrays the user gave parameters from the copies the close gave them
        (:class:`~._local.group.Detached`), or None."""
        return None

    def close(self, abort: bool = False) -> None:
        pass


class SoloGroup(Group):
    """One device, no one else: nothing to exchange."""

    def __init__(self, model: chainer.Link) -> None:
        self.model = model

    def finish(self, own: WindowResult) -> List[WindowResult]:
        return [own]

    def finish_stepping(self, own: WindowResult,
                        step: Callable[[int, float], None]) -> List[WindowResult]:
        # total_loss([own]), without the lists: this runs every update of one device
        count = own.count
        step(count, own.loss_sum / count if count else math.nan)
        return [own]


class ClosedGroup(Group):
    """Before the first update and after teardown: no replica runs."""

    def finish(self, own: WindowResult) -> List[WindowResult]:
        raise RuntimeError('no group is running (the updater has not started or was '
                           'finalized)')


def ensure_grads(model: chainer.Link) -> None:
    """Give every parameter a gradient array that the reduced one can be written into in
    place: zeros where it has none, and a copy where the one it has cannot take the write
    (:func:`~mgpu_updater._replica.writable_in_place`: a broadcast, which Chainer's
    backward leaves to a parameter that is only summed whole). Two parameters that hold
    one array (``a + b``) keep it: every rank's two sums are the same values."""
    for param in model.params():
        if param.array is None:   # a link never called: no gradient (initialized_params)
            continue
        grad = param.grad
        if grad is None:
            with chainer.using_device(param.device):
                param.grad = param.device.xp.zeros_like(param.array)
        elif not writable_in_place(grad):
            with chainer.using_device(param.device):
                param.grad = grad.copy()

"""The loss check of ``nonfinite='raise'`` where the loss is on a GPU: without a wait.

The updater must know whether an update's loss is finite. Where the loss is on the host
already (CPU replicas), or the master waits for its device before the step anyway (other
replicas, whose reduction it waits for; MPI ranks), it is checked before the step, and a
non-finite one leaves the parameters as they were. Where the master is alone on a GPU,
reading its loss before the step makes the host wait for the device once per update, and
then the device idles while the host launches the next update: on one H200 with the
example CNN at global batch 4096 the hand-written loop with that one read ran at 0.645 of
StandardUpdater's samples/s, and ours with the check at 0.685, against 0.998 without it
(``bench/results/gpu``).

So there the check does not wait: :meth:`LateCheck.start` queues a copy of the loss into
pinned host memory on the current stream and records an event after it; the update steps;
the value is looked at (:meth:`LateCheck.take`) when the next step is due, by when the
device has long finished that copy (and, if the host ran ahead, waiting for it keeps the
host at most one update ahead of the device), or when the updater is serialized (a
snapshot never holds a step whose loss was not looked at), or finalized. A non-finite
loss then raises :class:`~mgpu_updater.NonFiniteLossError` naming its update, whose step
was applied (an updater dropped without ``finalize`` warns instead: nobody to raise to).
``nonfinite='skip'`` still reads before the step (it must not step).

:func:`defers` is the one place that says on which devices the check of a lone master is
late (the updater adds: one device, no MPI communicator); a CPU test can make it defer
there too and so run the updater's side of this protocol (the 0-dim numpy loss is then
copied at :meth:`~LateCheck.start`).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy

from . import _cuda

#: seconds the host may wait for the copy of a loss (the device's work queued before it)
TIMEOUT = 600.0


def _cuda_ndarray() -> Any:
    import chainer
    return chainer.backends.cuda.ndarray


def defers(device: Any) -> bool:
    """Whether ``nonfinite='raise'`` checks the loss of a master on ``device`` (a Chainer
    device) one step late: where reading it would wait for a GPU."""
    return device.xp is not numpy


class LateCheck:
    """At most one update's loss on its way to the host."""

    def __init__(self) -> None:
        self._update: Optional[int] = None
        self._value: Any = None     # pinned host view (GPU) or a copy (CPU), 0-dim
        self._event: Any = None     # after the copy (GPU)
        self._pinned: Any = None    # the pinned memory, reused
        self._marker: Any = None    # the event, reused: recorded anew at each start

    @property
    def pending(self) -> bool:
        return self._update is not None

    def start(self, update: int, loss: Any) -> None:
        """The loss of ``update`` (a 0-dim array, where the step left it) starts for the
        host; the previous one must have been taken."""
        if self._update is not None:
            raise RuntimeError(f'the loss of update {self._update} was not checked yet')
        if not isinstance(loss, _cuda_ndarray()):   # on the host already
            self._value = numpy.array(loss, dtype=numpy.float64).reshape(())
        else:
            # what runs here runs every update on the host of a lone GPU master: the
            # pinned memory and the event are made once (the last copy was waited for)
            cupy = _cuda.import_cupy()
            with cupy.cuda.Device(loss.device.id):
                if self._pinned is None:
                    self._pinned = cupy.cuda.alloc_pinned_memory(8)
                    self._marker = cupy.cuda.Event(disable_timing=True)
                host = numpy.ndarray((), loss.dtype, buffer=self._pinned)
                stream = cupy.cuda.get_current_stream()
                loss.reshape(()).get(stream=stream, out=host, blocking=False)
                self._marker.record(stream)
            self._value, self._event = host, self._marker
        self._update = update

    def take(self) -> Optional[Tuple[int, float]]:
        """(update, loss) where the pending loss is not finite, else None; nothing is
        pending after. Waits for the copy if it has not finished."""
        if self._update is None:
            return None
        update, value, event = self._update, self._value, self._event
        self._update = self._value = self._event = None
        if event is not None:
            _cuda.wait_event(event, timeout=TIMEOUT,
                             what=f'the copy of the loss of update {update} to the host')
        loss = float(value)
        return None if math.isfinite(loss) else (update, loss)

    def drop(self) -> None:
        """Forget the pending loss (the updater is torn down after a failure)."""
        self._update = self._value = self._event = None

"""Exceptions raised in the master for what happened elsewhere."""
from __future__ import annotations

from typing import Optional, Sequence


class WorkerError(RuntimeError):
    """A worker process failed or died; raised in the master.

    Attributes:
        replica: index of the replica (the master is 0, workers are 1..N-1).
        device: the device specifier of that replica, as given.
        remote_traceback: the worker's formatted traceback, or ``None`` when the process
            died without one (killed by a signal, exited).
        exitcode: the process's exit code when it died, else ``None``.
        reason: what happened, the message without the replica and the traceback.
    """

    def __init__(self, message: str, *, replica: int, device: str,
                 remote_traceback: Optional[str] = None,
                 exitcode: Optional[int] = None) -> None:
        self.replica = replica
        self.device = device
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.reason = message
        text = f'replica {replica} on device {device!r}: {message}'
        if remote_traceback:
            text += '\n\n--- traceback in the worker process ---\n' + remote_traceback.rstrip()
        super().__init__(text)

    @property
    def died(self) -> bool:
        """Whether the worker's process is gone without a Python error of its own (a
        signal, the OOM killer, an exit): what ``max_worker_restarts`` recovers from."""
        return self.remote_traceback is None and self.exitcode is not None

    def __reduce__(self):  # keep it picklable with its keyword arguments
        return (_rebuild, (self.args[0], self.replica, self.device,
                           self.remote_traceback, self.exitcode, self.reason))


def _rebuild(text, replica, device, tb, exitcode, reason=None):
    err = WorkerError.__new__(WorkerError)
    RuntimeError.__init__(err, text)
    err.replica, err.device, err.remote_traceback, err.exitcode = replica, device, tb, exitcode
    err.reason = reason
    return err


class WorkerRestartWarning(RuntimeWarning):
    """A worker process died and, under ``max_worker_restarts``, a new one took its place
    and the update is being redone; the message names the replica, how it died, the
    update and the restarts so far."""


class StallWarning(RuntimeWarning):
    """The master has waited ``stall_warning`` seconds for workers that have not finished
    their update; the message names them and gives each one's Python stack."""


class NonFiniteLossError(FloatingPointError):
    """The loss of an update was NaN or infinite (``nonfinite='raise'``, the default).

    Attributes:
        iteration: the number of the update that produced it (1-based, as the Trainer
            counts after the update).
        loss: the sample-weighted mean loss of the update.
        applied: whether that update's step was applied (where the master's loss is on
            a GPU the check does not wait for it, and raises when the next step is due,
            at a snapshot, or at ``finalize``); False: the parameters are as before it.
    """

    def __init__(self, iteration: int, loss: float, applied: bool = False) -> None:
        self.iteration = iteration
        self.loss = loss
        self.applied = applied
        what = ('its step was applied (on a GPU the check does not wait for the loss: '
                "nonfinite='skip' checks before the step)" if applied
                else 'parameters were not updated')
        super().__init__(
            f'the loss became {loss} at update {iteration}; {what}. '
            "Lower the learning rate, use loss scaling for float16, or pass nonfinite='skip' "
            'to skip such updates')


class NonFiniteGradientError(NonFiniteLossError):
    """The loss of an update was finite but its summed gradient was not, under a static
    loss scale (``optimizer.loss_scaling(scale=...)``), which Chainer steps on unchecked
    (dynamic loss scaling checks and skips by itself); ``nonfinite='raise'``.

    Attributes: as :class:`NonFiniteLossError`, ``loss_scale``, and ``parameters``: the
    names of those whose gradient holds inf or NaN.
    """

    def __init__(self, iteration: int, loss: float, loss_scale: float,
                 parameters: Sequence[str] = ()) -> None:
        self.iteration = iteration
        self.loss = loss
        self.applied = False
        self.loss_scale = loss_scale
        self.parameters = list(parameters)
        FloatingPointError.__init__(
            self,
            f'the summed gradient of update {iteration} holds inf or NaN under the static '
            f'loss scale {loss_scale:g} (the loss is {loss}{_in_gradients(parameters)}); '
            'parameters were not updated. '
            'Lower the loss scale, use dynamic loss scaling (optimizer.loss_scaling() '
            "without scale), or pass nonfinite='skip' to skip such updates")


def _in_gradients(names: Sequence[str], most: int = 8) -> str:
    """``', in the gradient of /a/W, /b/W'``: at most ``most`` names, then how many more."""
    if not names:
        return ''
    shown = ', '.join(names[:most])
    more = f' and {len(names) - most} more' if len(names) > most else ''
    return f'; in the gradient of {shown}{more}'

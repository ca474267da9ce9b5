"""``max_worker_restarts``: the budget of worker restarts, their record, warning and report.

The local group replaces a worker process that died and redoes the update
(:mod:`mgpu_updater._local.recovery`). This module holds what outlives one group (a
snapshot loaded into a running updater starts a new one): how many restarts the run may
still make, the record of each, the :class:`~mgpu_updater.WorkerRestartWarning` that says
so at once, ``main/worker_restarts`` in every update's report, and the
:class:`~mgpu_updater.WorkerError` that ends the run once the budget is spent, naming the
restarts before it.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from .errors import WorkerError, WorkerRestartWarning
from ._warning import warn

REPORT_KEY = '(updater)/worker_restarts'   # named as the model is (updater._named)


class Restart(NamedTuple):
    """One worker replaced."""
    update: Optional[int]   # the update redone, 1-based (the iteration after it)
    replica: int
    device: str
    what: str               # how the process ended: 'the worker process (pid 9) was killed ...'
    pid: int                # the new worker's
    seconds: float          # from the master learning of the death to the new worker ready
    start_seconds: float    # ... of which the new worker's start-up (spawn to ready)


class RestartLog:
    """The restarts of one updater's run, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.restarts: List[Restart] = []
        #: the update in progress (1-based), set by the updater before each
        self.update: Optional[int] = None

    def __len__(self) -> int:
        return len(self.restarts)

    def admit(self, deaths: Sequence[WorkerError]) -> None:
        """Raise the error that ends the run unless ``deaths`` (workers that died, not yet
        replaced) all fit in the restarts left."""
        left = self.limit - len(self.restarts)
        if len(deaths) > left:
            raise self.spent(deaths[left], [d for d in deaths if d is not deaths[left]])

    def spent(self, death: WorkerError, others: Sequence[WorkerError] = ()) -> WorkerError:
        """``death``, as the error that ends the run: no restart is left (``others``: the
        workers found dead with it)."""
        before = '; '.join(f'replica {r.replica} at update {r.update}: {r.what}'
                           for r in self.restarts)
        with_it = (f', and with it died replica{"s" if len(others) > 1 else ""} '
                   f'{", ".join(str(d.replica) for d in others)}' if others else '')
        return WorkerError(
            f'{death.reason}; not restarted: max_worker_restarts={self.limit} allows '
            f'{self.limit} restart{"s" if self.limit != 1 else ""} over the run and '
            + (f'{len(self.restarts)} took place before ({before})' if before else
               'none took place before') + with_it,
            replica=death.replica, device=death.device, exitcode=death.exitcode)

    def record(self, restart: Restart) -> None:
        """A worker was replaced: keep it, and warn."""
        self.restarts.append(restart)
        warn(WorkerRestartWarning(
            f'replica {restart.replica} on device {restart.device!r}: {restart.what}, found '
            f'in update {restart.update}; a new worker process (pid {restart.pid}) took its '
            f'place within {restart.seconds:.1f} s, and update {restart.update} is redone '
            f'from its start (restart {len(self.restarts)} of '
            f'max_worker_restarts={self.limit})'), stacklevel=2)

    def report(self, observation: Dict[str, Any]) -> None:
        """Add the restarts so far to an update's observation."""
        observation[REPORT_KEY] = len(self.restarts)


def not_restarted_at_start(error: WorkerError) -> WorkerError:
    """A worker that failed or died while the workers started, under
    ``max_worker_restarts``: raised as ever, saying why there was no restart."""
    return WorkerError(
        f'{error.reason} (not restarted: this happened while the workers started, before '
        'the first update ran; max_worker_restarts replaces a worker process that dies '
        'once training runs)', replica=error.replica, device=error.device,
        remote_traceback=error.remote_traceback, exitcode=error.exitcode)


def not_restarted(error: WorkerError) -> WorkerError:
    """A worker's own Python error (``Failed``) under ``max_worker_restarts``: raised as
    ever, saying why no restart helps."""
    return WorkerError(
        f'{error.reason} (not restarted: max_worker_restarts replaces a worker process that '
        'died, from a signal or the out-of-memory killer; a Python exception in the '
        'worker is a bug that the same code would raise again)', replica=error.replica,
        device=error.device, remote_traceback=error.remote_traceback,
        exitcode=error.exitcode)

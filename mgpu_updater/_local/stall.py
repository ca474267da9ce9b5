"""A worker that does not finish its update: seen, named, and (opt-in) ended.

A worker that hangs (a deadlocked data loader, a stopped process, a lost device) would
keep the master waiting in its update for good, with only Ctrl-C to end it. As Horovod's
stall inspector and PyTorch's NCCL watchdog do, the master's waits for its workers in an
update (at the board, for a Done, for a mailbox: :mod:`.protocol`) are watched:

- after ``stall_warning`` seconds of waiting, a :class:`~mgpu_updater.errors.StallWarning`
  names the replicas not done and gives each one's Python stack;
- after ``update_timeout`` seconds (opt-in), a :class:`~mgpu_updater.errors.WorkerError`
  with the same information; the updater then stops every worker, as after any failure.

The clock starts when the master, its own window over, first waits for a worker in the
update, not when the update starts: a model whose windows take minutes is no stall. Nor is
a time the master itself did not run: the waits check at least every :data:`POLL` seconds,
and a gap between two checks longer than ``POLL + NOT_RUN`` (the whole job stopped by
``SIGSTOP``, as a scheduler suspends it, or a suspended virtual machine) counts as
``POLL``.

The stacks: each worker registers :mod:`faulthandler` on ``SIGUSR1`` (:data:`STACK_SIGNAL`)
with a file of its own (:meth:`StackFiles.path`), which dumps every thread's Python stack
from the signal handler, without the GIL, so a worker stuck in Python or blocked in a
C call answers. A stopped process (``SIGSTOP``, state ``T``) cannot answer until it is
continued; the report says so.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from typing import Any, Callable, Collection, Dict, List, Optional, Set

from ..errors import StallWarning, WorkerError
from .._warning import warn

STACK_SIGNAL = signal.SIGUSR1
DUMP_WAIT = 1.0   # seconds the master waits for a worker's stack after the signal
POLL = 1.0        # seconds a watched wait blocks at most between two checks
NOT_RUN = 2.0     # seconds beyond POLL between two checks: the master itself did not run


class StackFiles:
    """One file per worker in a private folder of the master, where the worker's
    faulthandler writes its stacks on :data:`STACK_SIGNAL`."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix='mgpu-stacks-')
        self._ranks: Set[int] = set()   # whose path was handed out

    def path(self, rank: int) -> str:
        self._ranks.add(rank)
        return os.path.join(self.folder, f'replica{rank}.txt')

    def dump(self, rank: int, pid: int) -> str:
        """Ask the worker for its stacks and return them (or why there are none)."""
        state = _process_state(pid)
        if state is None:
            return '(the process is gone)'
        if state in ('T', 't'):
            return (f'(the process is stopped: state {state!r}, as after SIGSTOP; it '
                    'cannot dump its stack until it is continued)')
        path = self.path(rank)
        before = _size(path)
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return '(the process is gone)'
        deadline = time.monotonic() + DUMP_WAIT
        size = before
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = _size(path)
            if now > before and now == size:   # written, and no longer growing
                break
            size = now
        with open(path, 'rb') as f:
            f.seek(before)
            text = f.read().decode('utf-8', 'replace').strip()
        return text or (f'(no stack within {DUMP_WAIT:.0f} s of {STACK_SIGNAL.name}; '
                        f'process state {state!r})')

    def close(self) -> None:
        """Remove the folder. The files are unlinked by name first: a start that failed
        for want of file descriptors (``ulimit -n``) gets here with none free, and
        ``shutil.rmtree`` needs one to list the folder (it left the folder behind)."""
        for rank in self._ranks:
            try:
                os.unlink(os.path.join(self.folder, f'replica{rank}.txt'))
            except OSError:
                pass
        try:
            os.rmdir(self.folder)
        except FileNotFoundError:
            pass
        except OSError:
            shutil.rmtree(self.folder, ignore_errors=True)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _process_state(pid: int) -> Optional[str]:
    """The state letter of ``/proc/<pid>/stat`` (None: gone or a zombie); ``'?'``
    where there is no ``/proc``."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            state = f.read().rsplit(')', 1)[1].split()[0]
    except FileNotFoundError:
        return None if os.path.isdir('/proc') else '?'
    except OSError:
        return '?'
    return None if state in ('Z', 'X') else state


def register_stack_dump(path: Optional[str]) -> None:
    """In a worker: dump every thread's stack into ``path`` on :data:`STACK_SIGNAL`."""
    if path is None:
        return
    import atexit
    import faulthandler
    out = open(path, 'w')   # kept open for the process's life, as faulthandler needs
    faulthandler.register(STACK_SIGNAL, file=out, all_threads=True)
    atexit.register(_release_stack_dump, out)   # closed at exit, not left to the collector


def _release_stack_dump(out: Any) -> None:
    import faulthandler
    faulthandler.unregister(STACK_SIGNAL)
    out.close()


def remove_stack_file(path: Optional[str]) -> None:
    """In a worker whose master is gone (killed: it removes nothing then): this worker's
    stack file, and the folder once it is empty. Each worker removes its own file before
    it tries the folder, so the last of them to try removes it."""
    if path is None:
        return
    for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(target)
        except OSError:   # gone already, or another worker's file is still there
            pass


class StallWatch:
    """The master's watch over its waits for the workers within one update.

    ``warn_after`` and ``timeout`` are seconds (None: never). :meth:`new_update` at each
    Step; :meth:`check` from every wait, with the ranks still awaited.
    """

    def __init__(self, warn_after: Optional[float], timeout: Optional[float],
                 stacks: StackFiles, pid_of: Callable[[int], int],
                 device_of: Callable[[int], str]) -> None:
        self.warn_after, self.timeout = warn_after, timeout
        self.stacks, self._pid_of, self._device_of = stacks, pid_of, device_of
        self._since: Optional[float] = None
        self._last = 0.0   # when check last ran
        self._warned = False
        self.update = 0

    def new_update(self) -> None:
        self.update += 1
        self._since = None
        self._warned = False

    def due_in(self) -> Optional[float]:
        """Seconds until :meth:`check` has something to do (None: never), for a wait that
        blocks."""
        waited = 0.0 if self._since is None else time.monotonic() - self._since
        due = [t - waited for t in ((None if self._warned else self.warn_after),
                                    self.timeout) if t is not None]
        return max(0.0, min(due + [POLL])) if due else None

    def check(self, waiting: Collection[int]) -> None:
        """The master is waiting for ``waiting``: warn, or raise, when it is time."""
        if not waiting or (self.warn_after is None and self.timeout is None):
            return
        now = time.monotonic()
        if self._since is None:
            self._since = self._last = now
            return
        gap, self._last = now - self._last, now
        if gap > POLL + NOT_RUN:   # the master did not run either: nobody's stall
            self._since += gap - POLL
        waited = now - self._since
        if self.timeout is not None and waited >= self.timeout:
            ranks = sorted(waiting)
            stacks = self._stacks(ranks)
            raise WorkerError(
                f'did not finish update {self.update} within update_timeout='
                f'{self.timeout:g} s (the master waited {waited:.1f} s for replicas '
                f'{ranks}); every worker is stopped.\n\n{_format(stacks)}',
                replica=ranks[0], device=self._device_of(ranks[0]))
        if self.warn_after is not None and not self._warned and waited >= self.warn_after:
            self._warned = True
            ranks = sorted(waiting)
            warn(StallWarning(
                f'update {self.update}: the master has waited {waited:.1f} s for replicas '
                f'{ranks} ({", ".join(self._device_of(r) for r in ranks)}), which have not '
                'finished their windows (stall_warning='
                f'{self.warn_after:g} s; update_timeout ends such a wait).\n\n'
                f'{_format(self._stacks(ranks))}'), stacklevel=2)

    def _stacks(self, ranks: List[int]) -> Dict[int, str]:
        return {r: f'pid {self._pid_of(r)}\n{self.stacks.dump(r, self._pid_of(r))}'
                for r in ranks}


def _format(stacks: Dict[int, str]) -> str:
    return '\n\n'.join(f'--- replica {rank}, {text}' for rank, text in stacks.items())

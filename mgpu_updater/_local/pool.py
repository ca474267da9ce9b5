"""Starting, talking to and stopping the worker processes, every wait bounded.

Workers start with ``spawn`` (default) or ``forkserver``, so a master that already
initialised CUDA is fine. Every wait watches the workers' process sentinels, so a worker
that dies (SIGKILL, OOM killer) becomes a :class:`WorkerError` at once, and shutdown
escalates ask -> kill, each step bounded, and always reaps (a worker leaves a SIGTERM
to its master: ``.worker``).

Start-up runs in three steps, so that no write can block on a process that is gone:

1. Each worker starts with a small argument list (its pipe, the master's pid, the names
   of the shared-memory segments). Python writes those arguments into a pipe whose read
   end the master itself holds until the write is done (``popen_spawn_posix.py``), so a
   large argument hangs the master for good when the worker dies before reading it.
2. The worker says ``Hello()`` once Python's start-up, which imports the main module
   again, is over. A worker that dies before that died importing the main module: the
   script most likely trains at module level without ``if __name__ == '__main__':``.
3. The master sends the payload (model, data shard, ...) over the worker's own pipe from
   a thread, watching the worker's sentinel, and waits for ``Ready()``.

Workers are not daemonic, so their iterators may start processes of their own
(``MultiprocessIterator``). Each worker leads its own process group; on shutdown the
master kills what is left of each group, so no grandchild outlives a worker, also one
that was SIGKILLed. A worker whose master dies kills its own group (see ``.worker``).
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util   # its atexit hook (join non-daemonic children) must run after ours
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Set

from .protocol import Encoder, Failed, Hello, Ready, Step, Stop
from .output import Relay, started as output_started
from .stall import StackFiles, StallWatch
from .._interrupts import ctrl_c_held
from ..errors import WorkerError

ASK_TIMEOUT = 3.0        # seconds a worker gets to exit after Stop()
KILL_TIMEOUT = 2.0       # after SIGKILL
MAIN_GUARD_EXIT = 78     # exit code of a worker that re-ran the script's training (EX_CONFIG)

GUARD_HINT = ("the script needs `if __name__ == '__main__':` around the code that builds and "
              'runs the updater: every worker process imports the main module again')


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return 'is not running'
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f'was killed by signal {-code}'
        if -code == signal.SIGBUS:   # a mapped page with nothing behind it
            return (f'was killed by {name} (a write to mapped memory with no room behind '
                    'it: most often /dev/shm full, which a container sizes with --shm-size)')
        return f'was killed by {name}'
    return f'exited with code {code}'


def _main_module() -> str:
    """The main module's file, as the master runs it or a worker re-imports it."""
    for name in ('__mp_main__', '__main__'):   # a worker imports it as __mp_main__
        path = getattr(sys.modules.get(name), '__file__', None)
        if path:
            return repr(path)
    return 'the main module'


def refuse_while_bootstrapping() -> None:
    """In a worker still importing the main module, stop at once: the script has no guard.

    Python marks a process that is still unpickling its start-up data, the main module
    included, with ``_inheriting`` (``multiprocessing/spawn.py`` ``_main``; its own
    ``_check_not_importing_main`` reads the same flag). The exit code tells the master why.
    """
    if getattr(multiprocessing.current_process(), '_inheriting', False):
        sys.stderr.write(f'mgpu_updater: this worker process re-ran the training code while '
                         f'importing {_main_module()}; {GUARD_HINT}.\n')
        sys.stderr.flush()
        raise SystemExit(MAIN_GUARD_EXIT)


_live: 'weakref.WeakSet[WorkerPool]' = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """At interpreter exit, stop the workers of pools never closed (no ``finalize()``).

    Registered after ``multiprocessing.util``'s hook, so it runs before that hook joins
    non-daemonic children, which would otherwise wait for the workers forever. Not the
    pools a child forked from their process (``os.fork``) inherited: they are the
    parent's, whose training goes on (a child that exited normally stopped its workers).
    """
    for pool in list(_live):
        if pool.owner != os.getpid():
            continue
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


@contextlib.contextmanager
def _sigint_held(spawning: bool) -> Iterator[None]:
    """A Ctrl-C held back while a worker process is spawned and recorded, then delivered.

    In the new process: a signal mask survives fork and exec, so with SIGINT blocked here
    the new Python starts with it blocked, and a Ctrl-C in its first second (importing the
    main module and Chainer again, still in the terminal's process group) stays pending
    until the worker, ignoring SIGINT in a group of its own, drops it (``.worker``)
    instead of dying with a traceback; CPython's resource tracker is spawned the same way
    (bpo-33613). SIGTERM is blocked with it: a job's SIGTERM that reaches the new worker
    in that second stays pending until the worker leaves SIGTERM to its master
    (``.worker._defer_sigterm``), where it killed the worker; in the master a SIGTERM
    blocked here acts as it would have once the mask is restored. In the master: the
    signal may reach another thread, and Python raises it
    in this one at its next instruction, which may be in the middle of ``start()``, with
    the child waiting for what was never written; so Python's handler only notes it here,
    and the one it replaced runs once the process is recorded (in another thread, which
    is not where Python raises it, only the mask is needed). Only for ``spawn`` (a
    ``forkserver`` started under the block would pass it on to every process it forks)."""
    if not spawning:
        yield
        return
    with ctrl_c_held():
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


class WorkerPool:
    """The worker processes of one updater: ranks 1..N-1.

    ``stall_warning`` and ``update_timeout``: seconds the master waits for a worker in an
    update before it warns, or gives up (:mod:`.stall`; None: never)."""

    def __init__(self, devices: Sequence[Any], start_method: str,
                 stall_warning: Optional[float] = None,
                 update_timeout: Optional[float] = None) -> None:
        self._devices = list(devices)          # labels, index = rank
        self.owner = os.getpid()               # the process whose exit closes it
        self._start_method = start_method
        self._ctx = multiprocessing.get_context(start_method)
        self._procs: Dict[int, Any] = {}
        self._conns: Dict[int, Any] = {}
        self._exits: Dict[int, Any] = {}    # per rank: ready once that worker has exited
        self._early: Dict[int, tuple] = {}  # per rank: a message :meth:`check` read early
        self._group_killed: Set[int] = set()   # ranks whose group :meth:`_reap` killed
        self._started: Dict[int, Optional[str]] = {}   # per rank: its _start_time
        self._encoder = Encoder()             # the messages sent, as bytes
        self._closed = False
        self._stacks = StackFiles()
        try:
            self._output = Relay()            # what the workers print and log, written here
        except BaseException:   # (no file descriptor left: ulimit -n)
            self._stacks.close()
            raise
        self.replaced_ready: Dict[int, Any] = {}   # (:meth:`replace`)
        self.stall = StallWatch(stall_warning, update_timeout, self._stacks,
                                pid_of=lambda r: self._procs[r].pid,
                                device_of=lambda r: str(self._devices[r]))

    @property
    def ranks(self) -> List[int]:
        return sorted(self._procs)

    def pids(self) -> List[int]:
        """The workers' process ids, in rank order."""
        return [self._procs[rank].pid for rank in self.ranks]

    def start(self, target: Callable[..., None], payloads: Dict[int, bytes],
              shm_names: List[str], timeout: float,
              before_ready: Optional[Callable[[], None]] = None) -> Dict[int, Any]:
        """Start one process per payload and wait (bounded) until each says it is ready.

        ``target(conn, master_pid, shm_names, default_start_method, stack_file, output)``
        is the worker's entry point (``stack_file``: where it dumps its stacks,
        :mod:`.stall`; ``output``: where its stdout, stderr and log records go,
        :mod:`.output`): it says
        ``Hello()``, receives its payload with ``conn.recv_bytes()``, then says
        ``Ready()``. ``timeout`` bounds the whole start. ``before_ready`` runs after
        the payloads are sent and before the wait for ready: the NCCL communicator's
        initialisation, which needs every rank at once. Returns what each ready said.
        """
        refuse_while_bootstrapping()
        deadline = time.monotonic() + timeout
        _live.add(self)
        # What the user's own processes (a MultiprocessIterator's pool) use in the master,
        # None for the platform's default: the same in the workers, where Python would
        # otherwise make it the workers' own start method.
        default_method = multiprocessing.get_start_method(allow_none=True)
        self._default_method = default_method
        for rank in sorted(payloads):
            self._spawn(rank, target, shm_names)
        self._collect(Hello.KIND, deadline, timeout, 'start', on_dead=self._raise_not_started)
        self._send_payloads(payloads, deadline, timeout)
        if before_ready is not None:
            before_ready()
        return self._collect(Ready.KIND, deadline, timeout, 'start', on_dead=self._raise_dead)

    def _spawn(self, rank: int, target: Callable[..., None], shm_names: List[str]) -> None:
        """Start rank's process (see :meth:`start`), without waiting for it."""
        parent, child = self._ctx.Pipe(duplex=True)
        output = self._output.ends()
        args = (child, os.getpid(), list(shm_names), self._default_method,
                self._stacks.path(rank), tuple(output))   # a tuple: unpickled, no import
        proc = self._ctx.Process(target=target, args=args,
                                 name=f'mgpu-worker-{rank}', daemon=False)
        with _sigint_held(self._start_method == 'spawn'):
            try:
                proc.start()
            except OSError as exc:
                if 'AF_UNIX path too long' not in str(exc):
                    raise
                # forkserver's socket lies in a folder under the temporary directory
                raise OSError(
                    f"start_method={self._start_method!r} could not start worker {rank}: "
                    f"its server's socket lies under the temporary directory "
                    f"({tempfile.gettempdir()!r}, {len(tempfile.gettempdir())} characters), "
                    'and a socket path may have at most 107 (Python said: '
                    f"{exc}). Set TMPDIR to a shorter directory, or pass "
                    "start_method='spawn'") from exc
            finally:
                output_started(output)   # the worker has its copies, or never started
            self._procs[rank] = proc
            self._started[rank] = _start_time(proc.pid)
            self._conns[rank] = parent
            self._exits[rank] = _exit_handle(proc)
        child.close()

    # ------------------------------------------------------------------ restarts
    def dead_ranks(self) -> List[int]:
        """The ranks whose process has exited (never blocks)."""
        return [rank for rank in self.ranks if self._exited(rank)]

    def death(self, rank: int) -> WorkerError:
        """The error that says how rank's process ended, or what it sent last if that was
        a ``Failed`` (read from its pipe, up to its end)."""
        while True:
            msg = self._last_words(rank)
            if msg is None:
                return self._dead_error(rank)
            if msg[0] == Failed.KIND:
                return WorkerError('failed', replica=rank, device=str(self._devices[rank]),
                                   remote_traceback=msg[1])

    def rewind(self, ranks: Sequence[int], message: tuple, reply: str,
               drop: Collection[str]) -> List[int]:
        """Send ``message`` to each of ``ranks`` and wait for each one's ``reply``,
        dropping the messages of the kinds in ``drop`` that come before it (what an
        abandoned update still delivers); returns the ranks that died instead of
        answering. A ``Failed`` raises :class:`WorkerError`; the wait is watched as an
        update's is (:mod:`.stall`)."""
        data = self._encoder.encode(message)
        dead: List[int] = []
        waiting = set()
        for rank in ranks:
            try:
                self._conns[rank].send_bytes(data)
                waiting.add(rank)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                dead.append(rank)
        for rank in list(self._early):
            if rank in waiting:
                msg = self._early.pop(rank)
                if msg[0] == Failed.KIND:
                    raise WorkerError('failed during update', replica=rank,
                                      device=str(self._devices[rank]), remote_traceback=msg[1])
        while waiting:
            self.stall.check(waiting)
            conns = {self._conns[r]: r for r in waiting}
            sentinels = {self._exits[r]: r for r in waiting}
            ready = multiprocessing.connection.wait(list(conns) + list(sentinels),
                                                    timeout=self.stall.due_in())
            for obj in ready:
                rank = conns.get(obj)
                if rank is None or rank not in waiting:
                    continue
                try:
                    msg = obj.recv()
                except (EOFError, OSError):   # its end is closed: it is gone
                    waiting.discard(rank)
                    dead.append(rank)
                    continue
                if msg[0] == Failed.KIND:
                    raise WorkerError('failed during update', replica=rank,
                                      device=str(self._devices[rank]), remote_traceback=msg[1])
                if msg[0] == reply:
                    waiting.discard(rank)
                elif msg[0] not in drop:
                    raise WorkerError(f'sent {msg[0]!r} while {reply!r} was expected',
                                      replica=rank, device=str(self._devices[rank]))
            for obj in ready:
                rank = sentinels.get(obj)
                if rank in waiting and not self._conns[rank].poll(0):
                    waiting.discard(rank)
                    dead.append(rank)
        return dead

    def replace(self, target: Callable[..., None], payloads: Dict[int, bytes],
                shm_names: List[str], timeout: float,
                before_ready: Optional[Callable[[], None]] = None) -> Dict[int, int]:
        """Start a new process for each rank of ``payloads``, whose process died, with its
        payload, and wait (``timeout``) until each is ready, as :meth:`start` does, all
        at once (``before_ready`` as there: a rendezvous needs every new rank); returns
        their pids by rank. What each dead one's iterator started (its process group) is
        killed first, and the dead one reaped. A failure here raises
        :class:`WorkerError`, as at start-up."""
        ranks = sorted(payloads)
        for rank in ranks:
            old = self._procs[rank]
            self._kill_worker_group(rank)
            old.join(KILL_TIMEOUT)
            self._group_killed.discard(rank)
            self._conns.pop(rank).close()
            handle = self._exits.pop(rank)
            if isinstance(handle, int):
                os.close(handle)
            if old.exitcode is not None:
                old.close()
            del self._procs[rank]
            self._early.pop(rank, None)
        deadline = time.monotonic() + timeout
        for rank in ranks:
            self._spawn(rank, target, shm_names)
        self._collect(Hello.KIND, deadline, timeout, 'restart', on_dead=self._raise_dead,
                      ranks=ranks)
        self._send_payloads(payloads, deadline, timeout)
        if before_ready is not None:
            before_ready()
        # what each replacement's ready said, by rank (as :meth:`start` returns them)
        self.replaced_ready = self._collect(Ready.KIND, deadline, timeout, 'restart',
                                            on_dead=self._raise_dead, ranks=ranks)
        return {rank: self._procs[rank].pid for rank in ranks}

    def _send_payloads(self, payloads: Dict[int, bytes], deadline: float,
                       timeout: float) -> None:
        """Write each payload from its own thread, watching the workers' sentinels."""
        failed: Dict[int, BaseException] = {}

        def send(rank: int) -> None:
            try:
                self._conns[rank].send_bytes(payloads[rank])
            except BaseException as exc:  # noqa: BLE001 - reported below
                failed[rank] = exc

        threads = {rank: threading.Thread(target=send, args=(rank,), daemon=True,
                                          name=f'mgpu-send-{rank}') for rank in payloads}
        for thread in threads.values():
            thread.start()
        while threads:
            for rank, thread in list(threads.items()):
                if not thread.is_alive():
                    del threads[rank]
                    if rank in failed:
                        if self._exited(rank) or isinstance(
                                failed[rank], (BrokenPipeError, ConnectionResetError)):
                            self._raise_dead(rank)
                        raise WorkerError(f'could not send the start-up payload: '
                                          f'{type(failed[rank]).__name__}: {failed[rank]}',
                                          replica=rank, device=str(self._devices[rank]))
            if not threads:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(threads)
                raise WorkerError(f'did not take its start-up payload within {timeout:.0f} s '
                                  f'(replicas {late})', replica=late[0],
                                  device=str(self._devices[late[0]]))
            sentinels = {self._exits[r]: r for r in threads}
            for obj in multiprocessing.connection.wait(list(sentinels), min(left, 0.05)):
                self._raise_dead(sentinels[obj])

    def check_alive(self) -> None:
        """Raise :class:`WorkerError` if a worker has died (never blocks)."""
        for rank in list(self._procs):
            if self._exited(rank):
                msg = self._last_words(rank)
                if msg is not None:
                    if msg[0] == Failed.KIND:
                        raise WorkerError('failed', replica=rank, device=str(self._devices[rank]),
                                          remote_traceback=msg[1])
                self._raise_dead(rank)

    def check(self, what: str = 'update', waiting: Collection[int] = ()) -> None:
        """Raise :class:`WorkerError` if a worker died or reported an error (its
        ``Failed``, with its traceback); never blocks. What else a worker said meanwhile is
        kept for the next :meth:`gather`, and a worker's pipe is still watched after that,
        for a ``Failed`` behind it (a worker that sent Done and then failed); anything else
        behind it breaks the protocol. (The master runs this while it
        waits at the board, :mod:`.board`, for the ranks of ``waiting``, which the stall
        watch names if the wait lasts: :mod:`.stall`.)"""
        for rank, conn in self._conns.items():
            try:
                ready = conn.poll(0)
                msg = conn.recv() if ready else None
            except (EOFError, OSError):
                self._raise_dead(rank)
            if msg is None:
                continue
            if msg[0] == Failed.KIND:
                raise WorkerError(f'failed during {what}', replica=rank,
                                  device=str(self._devices[rank]), remote_traceback=msg[1])
            if rank in self._early:
                raise WorkerError(f'sent {msg[0]!r} after {self._early[rank][0]!r}, before '
                                  f'the master took that', replica=rank,
                                  device=str(self._devices[rank]))
            self._early[rank] = msg
        self.check_alive()
        if waiting:
            self.stall.check(waiting)

    def _last_words(self, rank: int) -> Any:
        """What a dead worker sent last and nobody read yet (its ``Failed``), or None. A
        pipe at end-of-file also polls ready; reading it then raises, which means no."""
        try:
            return self._conns[rank].recv() if self._conns[rank].poll(0) else None
        except (EOFError, OSError):
            return None

    def send(self, msg: tuple, ranks: Optional[Sequence[int]] = None) -> None:
        """Send ``msg`` to every worker (or those of ``ranks``); a worker whose pipe is
        broken raises :class:`WorkerError`, once the others have it (so that, under
        ``max_worker_restarts``, every survivor is in the same update)."""
        if msg[0] == Step.KIND:
            self.stall.new_update()
        data = self._encoder.encode(msg)   # a worker's Decoder reads it
        broken = None
        for rank in (self.ranks if ranks is None else ranks):
            try:
                self._conns[rank].send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                if broken is None:
                    broken = rank
        if broken is not None:
            self._raise_dead(broken)

    def gather(self, kind: str, timeout: Optional[float] = None,
               what: str = 'update', ranks: Optional[Sequence[int]] = None) -> Dict[int, Any]:
        """Wait for one ``kind`` message from every worker (or those of ``ranks``),
        watching their sentinels.

        A worker that reports an error or dies raises :class:`WorkerError` at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._collect(kind, deadline, timeout, what, on_dead=self._raise_dead,
                             ranks=ranks)

    def _collect(self, kind: str, deadline: Optional[float], timeout: Optional[float],
                 what: str, on_dead: Callable[[int], None],
                 ranks: Optional[Sequence[int]] = None) -> Dict[int, Any]:
        waiting = set(self.ranks if ranks is None else ranks)
        out: Dict[int, Any] = {}
        for rank, msg in list(self._early.items()):   # read by :meth:`check`
            if rank not in waiting:
                continue
            del self._early[rank]
            if msg[0] != kind:
                raise WorkerError(f'sent {msg[0]!r} while {kind!r} was expected',
                                  replica=rank, device=str(self._devices[rank]))
            out[rank] = msg[1] if len(msg) > 1 else None
            waiting.discard(rank)
        watched = what == 'update'   # the update's waits: the stall watch's (.stall)
        while waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                late = sorted(waiting)
                raise WorkerError(
                    f'no answer within {timeout:.0f} s during {what} '
                    f'(still waiting for replicas {late})',
                    replica=late[0], device=str(self._devices[late[0]]))
            if watched:
                self.stall.check(waiting)
                due = self.stall.due_in()
                if due is not None:
                    left = due if left is None else min(left, due)
            conns = {self._conns[r]: r for r in waiting}
            sentinels = {self._exits[r]: r for r in waiting}
            ready = multiprocessing.connection.wait(list(conns) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in conns:
                    rank = conns[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        on_dead(rank)
                    if msg[0] == Failed.KIND:
                        raise WorkerError(
                            f'failed during {what}', replica=rank,
                            device=str(self._devices[rank]), remote_traceback=msg[1])
                    if msg[0] != kind:
                        raise WorkerError(f'sent {msg[0]!r} while {kind!r} was expected',
                                          replica=rank, device=str(self._devices[rank]))
                    out[rank] = msg[1] if len(msg) > 1 else None
                    waiting.discard(rank)
            for obj in ready:
                rank = sentinels.get(obj)
                # a worker may send an error just before dying: read that first
                if rank in waiting and not self._conns[rank].poll(0):
                    on_dead(rank)
        return out

    def _raise_dead(self, rank: int) -> None:
        raise self._dead_error(rank)

    def _reap(self, rank: int, timeout: float = 0.5) -> Any:
        """The worker process of ``rank``, reaped if it exits within ``timeout``, its
        process group (what its iterator started) killed first."""
        proc = self._procs[rank]
        if multiprocessing.connection.wait([self._exits[rank]], timeout):
            self._kill_worker_group(rank)
            self._group_killed.add(rank)   # no second kill by a pid it frees now
            proc.join(timeout)
        return proc

    def _kill_worker_group(self, rank: int) -> None:
        """SIGKILL the process group the worker of ``rank`` leads (what its iterator
        started), unless :meth:`_reap` did, or the worker was reaped (by
        ``multiprocessing``, whose ``Process.start`` reaps finished children; under
        ``forkserver``, by the server) and its pid, the group's id, is now another
        process's (another training's worker, a shell's job), whose group that would kill.
        While a member of the worker's group lives, no new process gets that pid."""
        pid = self._procs[rank].pid
        if rank in self._group_killed:
            return
        started, now = self._started.get(rank), _start_time(pid)
        if started is not None and now is not None and now != started:
            return   # the pid names a process started since
        _kill_group(pid)

    def _dead_error(self, rank: int) -> WorkerError:
        proc = self._reap(rank)
        return WorkerError(f'the worker process (pid {proc.pid}) '
                           f'{_describe_exit(proc.exitcode)}',
                           replica=rank, device=str(self._devices[rank]),
                           exitcode=proc.exitcode)

    def _raise_not_started(self, rank: int) -> None:
        """A worker died before its first message: while importing the main module."""
        proc = self._reap(rank)
        main_file = getattr(sys.modules.get('__main__'), '__file__', None)
        if proc.exitcode == MAIN_GUARD_EXIT:
            what = (f'the worker process (pid {proc.pid}) re-ran the training code while '
                    f'importing {_main_module()} and stopped')
        elif isinstance(main_file, str) and not os.path.exists(main_file):
            if main_file.startswith('<'):
                # ``python - < script.py``: __file__ is '<stdin>', which spawn then runs as
                # a path (multiprocessing/spawn.py, _fixup_main_from_path) and fails
                why = (f'the main module has no file to import ({main_file!r}; a script read '
                       'from standard input?)')
                fix = 'Save the script to a file and run that (python script.py)'
            else:
                why = (f'the main module\'s file ({main_file!r}) is gone: deleted or '
                       'renamed since the script started')
                fix = 'Leave the script where it is while it trains'
            raise WorkerError(
                f'the worker process (pid {proc.pid}) {_describe_exit(proc.exitcode)} '
                f'before it started: {why}, and a worker started by '
                f'{self._start_method!r} imports the main module from its file. {fix}',
                replica=rank, device=str(self._devices[rank]), exitcode=proc.exitcode)
        elif proc.exitcode is not None and proc.exitcode < 0:
            raise WorkerError(
                f'the worker process (pid {proc.pid}) {_describe_exit(proc.exitcode)} '
                f'before it started, while importing {_main_module()}: a signal from '
                'outside (the out-of-memory killer, a kill of its process group)',
                replica=rank, device=str(self._devices[rank]), exitcode=proc.exitcode)
        else:
            what = (f'the worker process (pid {proc.pid}) {_describe_exit(proc.exitcode)} '
                    f'before it started: importing {_main_module()} or mgpu_updater failed '
                    "there, or it could not start a thread (\"can't start new thread\": a limit "
                    'on processes, ulimit -u, a container\'s pids limit); its traceback is on '
                    'its stderr. A worker imports the main '
                    "module again, with the master's sys.path and working directory as they "
                    'are when it starts: an import that worked only before the script '
                    'changed directory (a relative sys.path entry) fails there. And if the '
                    'script trains at module level, this is why')
        raise WorkerError(f'{what}: {GUARD_HINT} (start method {self._start_method!r})',
                          replica=rank, device=str(self._devices[rank]),
                          exitcode=proc.exitcode)

    def close(self) -> None:
        """Stop every worker: ask, then kill; each wait bounded. Then kill
        what is left of each worker's process group (its iterator's processes). Twice is
        fine."""
        if self._closed:
            return
        ranks = self.ranks
        interrupted: Optional[BaseException] = None
        try:
            # marked closed inside: a Ctrl-C before the waits below (which kill on one)
            # left the workers running with nothing to stop them, and the exit waited
            self._closed = True
            _live.discard(self)
            for rank, conn in self._conns.items():
                try:
                    conn.send(Stop())
                except Exception:  # noqa: BLE001 - dead already; reaped below
                    pass
            for step, wait in (('ask', ASK_TIMEOUT), ('kill', KILL_TIMEOUT)):
                if step != 'ask':
                    for r in ranks:
                        if not self._exited(r):
                            getattr(self._procs[r], step)()
                if not self._wait_exit(ranks, time.monotonic() + wait):
                    break
        except BaseException as exc:  # noqa: BLE001 - raised again below
            # A second Ctrl-C in a wait (a worker busy in a long window does not answer
            # the Stop at once): this pool is closed already, so nothing would ever stop
            # that worker, and the interpreter's exit would wait for it. Kill, clean up,
            # then raise it.
            interrupted = exc
            for r in ranks:
                if not self._exited(r):
                    self._procs[r].kill()
        # Not reaped here yet (a zombie keeps its pid), so each group id is still that
        # worker's, unless someone else reaped it (:meth:`_kill_worker_group`).
        for r in ranks:
            self._kill_worker_group(r)
        for r in ranks:
            self._procs[r].join(KILL_TIMEOUT)
        for conn in self._conns.values():
            conn.close()
        for r in ranks:
            if self._procs[r].exitcode is not None:
                self._procs[r].close()
            if isinstance(self._exits[r], int):
                os.close(self._exits[r])
        self._procs.clear()
        self._conns.clear()
        self._exits.clear()
        self._group_killed.clear()
        self._started.clear()
        self._stacks.close()
        self._output.close()   # after the workers' ends: what they wrote last, out
        if interrupted is not None:
            raise interrupted

    def _exited(self, rank: int) -> bool:
        """Whether that worker has exited, without reaping it."""
        return bool(multiprocessing.connection.wait([self._exits[rank]], 0))

    def _wait_exit(self, ranks: List[int], deadline: float) -> List[int]:
        """Wait until every worker exited or the deadline; returns those still running."""
        running = [r for r in ranks if not self._exited(r)]
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            multiprocessing.connection.wait([self._exits[r] for r in running], left)
            running = [r for r in running if not self._exited(r)]
        return running


def _exit_handle(proc: Any) -> Any:
    """Something ``multiprocessing.connection.wait`` sees ready once ``proc`` exited.

    A pidfd (Linux 5.3+) where possible: the process sentinel is the read end of a pipe
    whose write end the worker holds, and so do the processes it forks (the pool of a
    ``MultiprocessIterator``), which would hide the worker's death while they live.
    """
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):   # not Linux, an old kernel, or already reaped
        return proc.sentinel


def _start_time(pid: int) -> Optional[str]:
    """When the process ``pid`` started, as ``/proc/<pid>/stat`` says (None: no such
    process, or no ``/proc``): with the pid, it names one process, not one that takes the
    pid later."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group a worker leads (see ``.worker.main``); gone is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

"""Starting, talking to and stopping the worker processes, every wait bounded.

Workers start with ``spawn`` (default) or ``forkserver``, so a master that already
initialised CUDA is fine. Every wait watches the workers' process sentinels, so a worker
that dies (SIGKILL, OOM killer) becomes a :class:`WorkerError` at once, and shutdown
escalates ask -> terminate -> kill, each step bounded, and always reaps.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .errors import WorkerError

ASK_TIMEOUT = 3.0        # seconds a worker gets to exit after ('stop',)
TERMINATE_TIMEOUT = 2.0  # after SIGTERM
KILL_TIMEOUT = 2.0       # after SIGKILL


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return 'is not running'
    if code < 0:
        try:
            return f'was killed by {signal.Signals(-code).name}'
        except ValueError:
            return f'was killed by signal {-code}'
    return f'exited with code {code}'


class WorkerPool:
    """The worker processes of one updater: ranks 1..N-1."""

    def __init__(self, devices: Sequence[Any], start_method: str) -> None:
        self._devices = list(devices)          # labels, index = rank
        self._ctx = multiprocessing.get_context(start_method)
        self._procs: Dict[int, Any] = {}
        self._conns: Dict[int, Any] = {}
        self._closed = False

    @property
    def ranks(self) -> List[int]:
        return sorted(self._procs)

    def pids(self) -> List[int]:
        return [p.pid for p in self._procs.values()]

    def start(self, payloads: Dict[int, bytes], shm_names: List[str],
              timeout: float, before_ready: Optional[Callable[[], None]] = None) -> None:
        """Start one process per payload and wait (bounded) until each says it is ready.

        ``before_ready`` runs after the processes started and before the wait: the NCCL
        communicator's initialisation, which needs every rank at once.
        """
        import os
        from . import _worker
        for rank, payload in sorted(payloads.items()):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker.main, args=(child, os.getpid(), payload, shm_names),
                name=f'mgpu-worker-{rank}', daemon=True)
            proc.start()
            child.close()
            self._procs[rank] = proc
            self._conns[rank] = parent
        if before_ready is not None:
            before_ready()
        self.gather('ready', timeout=timeout, what='start')

    def check_alive(self) -> None:
        """Raise :class:`WorkerError` if a worker has died (never blocks)."""
        for rank, proc in self._procs.items():
            if proc.exitcode is not None:
                if self._conns[rank].poll(0):
                    msg = self._conns[rank].recv()
                    if msg[0] == 'error':
                        raise WorkerError('failed', replica=rank, device=str(self._devices[rank]),
                                          remote_traceback=msg[1])
                self._raise_dead(rank)

    def send(self, msg: tuple, ranks: Optional[Sequence[int]] = None) -> None:
        for rank in (self.ranks if ranks is None else ranks):
            try:
                self._conns[rank].send(msg)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self._raise_dead(rank)

    def gather(self, kind: str, timeout: Optional[float] = None,
               what: str = 'update') -> Dict[int, Any]:
        """Wait for one ``kind`` message from every worker, watching their sentinels.

        A worker that reports an error or dies raises :class:`WorkerError` at once.
        """
        waiting = set(self.ranks)
        out: Dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                late = sorted(waiting)
                raise WorkerError(
                    f'no answer within {timeout:.0f} s during {what} '
                    f'(still waiting for replicas {late})',
                    replica=late[0], device=str(self._devices[late[0]]))
            conns = {self._conns[r]: r for r in waiting}
            sentinels = {self._procs[r].sentinel: r for r in waiting}
            ready = multiprocessing.connection.wait(list(conns) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in conns:
                    rank = conns[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        self._raise_dead(rank)
                    if msg[0] == 'error':
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
                    self._raise_dead(rank)
        return out

    def _raise_dead(self, rank: int) -> None:
        proc = self._procs[rank]
        proc.join(0.5)
        raise WorkerError(f'the worker process (pid {proc.pid}) '
                          f'{_describe_exit(proc.exitcode)}',
                          replica=rank, device=str(self._devices[rank]),
                          exitcode=proc.exitcode)

    def close(self) -> None:
        """Stop every worker: ask, then terminate, then kill; each wait bounded. Twice is fine."""
        if self._closed:
            return
        self._closed = True
        for rank, conn in self._conns.items():
            try:
                conn.send(('stop',))
            except Exception:  # noqa: BLE001 - dead already; reaped below
                pass
        procs = list(self._procs.values())
        for step, wait in (('ask', ASK_TIMEOUT), ('terminate', TERMINATE_TIMEOUT),
                           ('kill', KILL_TIMEOUT)):
            if step == 'terminate':
                for p in procs:
                    if p.is_alive():
                        p.terminate()
            elif step == 'kill':
                for p in procs:
                    if p.is_alive():
                        p.kill()
            deadline = time.monotonic() + wait
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if not any(p.is_alive() for p in procs):
                break
        for conn in self._conns.values():
            conn.close()
        for p in procs:
            if not p.is_alive():
                p.close()
        self._procs.clear()
        self._conns.clear()

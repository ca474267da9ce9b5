"""A worker process that died, replaced, and its update redone (``max_worker_restarts``).

Without restarts, a worker that dies ends the run with a :class:`~mgpu_updater.WorkerError`.
With them, :class:`Recovery` takes that error where the master learns of the death, in its
half of an update (:mod:`.protocol`): when it sends the Step (a worker that died between
updates), while it waits at the board for the posts, or for the Done messages where there
is no board. All of these come before the master's optimizer step: a worker delivers its
result before it posts (:func:`.protocol.worker_step` with a keeper), so once every rank
has posted nothing is awaited from a worker in that update and no death can interrupt it;
a worker that dies after its post is found at the next update's Step. The procedure:

1. The update is abandoned. The deaths are collected (a worker that sent ``Failed`` is a
   Python error, not recovered: :func:`mgpu_updater._restarts.not_restarted`) and must fit
   in the restarts left (:class:`mgpu_updater._restarts.RestartLog`).
2. The master abandons its collectives of the update
   (:meth:`~mgpu_updater.comm.base.Communicator.abandon`: NCCL aborts its communicator,
   which a dead rank leaves unusable, and the collectives stuck on it end; the
   shared-memory backend has nothing to give up), and every surviving worker is told to
   :class:`~.protocol.Rewind`: it abandons its own collectives, goes back to where its
   window started (:class:`.resume.Keeper`) and says :class:`~.protocol.Rewound`; what
   the abandoned update still delivers is dropped. On the shared-memory backend no
   collective waits for a peer, so a survivor finishes its window first; on NCCL one
   that waits for its collectives gives its window up at the Rewind
   (:class:`~.protocol.Abandoned`).
3. The communicator is rebuilt (:meth:`~mgpu_updater.comm.base.Communicator.rebuild`):
   every rank counts updates from zero again (and the board,
   :meth:`.board.Board.start_over`); NCCL makes a fresh unique id.
4. Each dead rank gets a new process with its original payload, the rebuilt communicator's
   handle and the master's record of where its update started (:class:`.resume.Records`),
   the same device, the same seed. Where the ranks meet again (NCCL's rendezvous,
   :attr:`~mgpu_updater.comm.base.Communicator.rejoins`), once the new ones join, every
   survivor is told to :class:`~.protocol.Rejoin` with the handle and the master joins
   too (:meth:`~mgpu_updater.comm.base.Communicator.init`), all at once.
5. The update is redone: the same Step again, the parameters left in the broadcast buffers
   as they were packed (the master has not stepped; NCCL's bcast only reads the root's).
   The master's own window is not run again: its result, its gradient and its loader's
   progress depend only on its own replica, the parameters and its batches, none of which
   the death touched, so keeping them equals redoing them (and draws no random number
   twice). On NCCL the master's window may end while its bcast waits for a dead rank:
   its wait before it reads its values then abandons the collectives and keeps the death
   for the master's half after the window (:meth:`.group.LocalGroup.settle`), which
   recovers it; the window's values are its own replica's, which the bcast never wrote.

A death during these steps joins the ones being handled; one during the redo starts again
at 1. Starting a replacement that fails raises, as a failure at start-up does.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

from .._restarts import Restart, RestartLog, not_restarted
from ..errors import WorkerError
from .protocol import Done, Rewind, Rewound
from .resume import Records


class Recovery:
    """The master's side of restarts for one local group.

    ``payload(rank, point, size, handle)`` pickles rank's original payload with the resume
    point ``point`` (and under ``micro_batch_size='auto'`` the chunk size ``size`` the lost
    one had come to) and the rebuilt communicator's ``handle``; ``start(payloads,
    survivors, handle)`` replaces the processes of the payloads' ranks, the ``survivors``
    rejoining where the communicator :attr:`~mgpu_updater.comm.base.Communicator.rejoins`,
    and returns the new pids by rank (:meth:`.pool.WorkerPool.replace`).
    """

    def __init__(self, log: RestartLog, records: Records, pool: Any, comm: Any, board: Any,
                 payload: Callable[[int, Any, Any, Any], bytes],
                 start: Callable[[Dict[int, bytes], List[int], Any], Dict[int, int]]) -> None:
        self.log, self.records = log, records
        self.pool, self.comm, self.board = pool, comm, board
        self._payload, self._start = payload, start

    def recover(self, error: WorkerError, redo: Callable[[], None]) -> None:
        """Replace the worker(s) ``error`` found dead and call ``redo`` (the update's Step,
        again); raise what cannot be recovered. A death during ``redo`` is recovered
        too."""
        while True:
            self._replace_the_dead(error)
            try:
                redo()
                return
            except WorkerError as again:
                error = again

    def _replace_the_dead(self, error: WorkerError) -> None:
        learned = time.monotonic()
        if not error.died:
            raise not_restarted(error) if error.remote_traceback else error
        if not self.comm.rebuilds:
            raise WorkerError(
                f'{error.reason}; not restarted: the {self.comm.name} communicator cannot '
                'take a new rank', replica=error.replica, device=error.device,
                exitcode=error.exitcode)
        self.records.discard()
        pool = self.pool
        dead = self._deaths([error.replica] + pool.dead_ranks())
        self.log.admit([dead[rank] for rank in sorted(dead)])
        self.comm.abandon()   # NCCL: the master's collectives stuck on the dead end
        survivors = [rank for rank in pool.ranks if rank not in dead]
        dead.update(self._deaths(pool.rewind(survivors, Rewind(), Rewound.KIND,
                                             (Done.KIND,))))
        self.log.admit([dead[rank] for rank in sorted(dead)])
        survivors = [rank for rank in survivors if rank not in dead]
        handle = self.comm.rebuild()
        if self.board is not None:
            self.board.start_over()
        begun = time.monotonic()
        try:
            pids = self._start({rank: self._payload(rank, self.records.points[rank],
                                                    self.records.chunk_sizes[rank],
                                                    handle)
                                for rank in sorted(dead)}, survivors, handle)
        except WorkerError as failed:
            if failed.replica in dead:
                lost = dead[failed.replica]
                during = 'while it was started in place of a worker process that died'
            else:   # a survivor, rejoining (NCCL's rendezvous)
                lost = dead[min(dead)]
                during = (f'while it rejoined the communicator rebuilt for replica '
                          f'{lost.replica}, whose worker process died')
            raise WorkerError(
                f'{failed.reason}, {during} ({lost.reason}): not restarted again',
                replica=failed.replica, device=failed.device, exitcode=failed.exitcode,
                remote_traceback=failed.remote_traceback) from lost
        started = time.monotonic() - begun
        seconds = time.monotonic() - learned
        for rank in sorted(dead):
            self.log.record(Restart(self.log.update, rank, dead[rank].device,
                                    dead[rank].reason, pids[rank], seconds, started))

    def _deaths(self, ranks: List[int]) -> Dict[int, WorkerError]:
        """The error of each rank's death; one that sent ``Failed`` raises (a Python
        error, not restarted)."""
        deaths: Dict[int, WorkerError] = {}
        for rank in ranks:
            if rank in deaths:
                continue
            death = self.pool.death(rank)
            if not death.died:
                raise not_restarted(death) if death.remote_traceback else death
            deaths[rank] = death
        return deaths

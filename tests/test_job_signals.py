"""Signals a job scheduler sends to every process of a job, the workers included.

Slurm's cancel and time limit, and a control group's kill, send SIGTERM to every process;
a suspended job (``scontrol suspend``, gang scheduling) gets SIGSTOP, then SIGCONT. Under
StandardUpdater a script may catch SIGTERM and save a snapshot before it exits, and a
suspended job goes on where it was when continued; so must they here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import warnings

import chainer

from mgpu_updater import ParallelAccumulatingUpdater, StallWarning

from _processes import alive
from _models import SleepsInWorker, classifier, dataset, run_updates, setup_optimizer


def _updater(model, **kwargs):
    its = [chainer.iterators.SerialIterator(dataset(64, seed=r), 4, shuffle=False)
           for r in range(2)]
    return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                       devices=['@numpy'] * 2, **kwargs)


def test_a_sigterm_to_the_workers_leaves_the_master_to_decide():
    """The job's SIGTERM reached the worker too, and the master's handler chose to go on
    (to finish the update and save a snapshot): the worker is still there for it (it died
    of the signal, and the master's next update raised WorkerError)."""
    model = classifier(seed=0)
    updater = _updater(model)
    try:
        run_updates(updater, model, 1)
        pid = updater.worker_pids()[0]
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert alive(pid)
        run_updates(updater, model, 2)
        assert updater.iteration == 3
    finally:
        updater.finalize()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_a_sigterm_to_a_worker_as_it_starts_leaves_the_master_to_decide(monkeypatch):
    """The job's SIGTERM reached a worker just after it was spawned, while it imports: it
    stays pending until the worker leaves SIGTERM to its master, and the worker trains
    (it died of it, and the start raised WorkerError)."""
    from mgpu_updater._local.pool import WorkerPool
    spawn = WorkerPool._spawn
    pids = []

    def spawn_then_sigterm(self, rank, target, shm_names):
        spawn(self, rank, target, shm_names)
        pids.append(self._procs[rank].pid)
        os.kill(pids[-1], signal.SIGTERM)

    monkeypatch.setattr(WorkerPool, '_spawn', spawn_then_sigterm)
    model = classifier(seed=0)
    updater = _updater(model)
    try:
        run_updates(updater, model, 2)
        assert updater.iteration == 2
        assert updater.worker_pids() == pids
    finally:
        updater.finalize()


class _SlowExamples(chainer.dataset.DatasetMixin):
    """Examples that take 20 ms each to load (in a MultiprocessIterator's processes)."""

    def __init__(self, n):
        self.base = dataset(n, seed=1)

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        time.sleep(0.02)
        return self.base[i]


def test_a_sigterm_to_a_workers_iterator_processes_leaves_them_loading():
    """The job's SIGTERM reaches the processes a worker's MultiprocessIterator forked too,
    as they load: they stay, as the master's would with the script's handler (one killed
    lost the batch it was loading, and the worker waited for it for good)."""
    model = classifier(seed=0)
    its = [chainer.iterators.SerialIterator(dataset(64, seed=0), 4),
           chainer.iterators.MultiprocessIterator(_SlowExamples(64), 4, n_processes=2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, update_timeout=20.0)
    try:
        run_updates(updater, model, 2)
        group = os.getpgid(updater.worker_pids()[0])   # the worker and what it forked
        time.sleep(0.05)   # loading ahead
        os.killpg(group, signal.SIGTERM)
        run_updates(updater, model, 3)
        assert updater.iteration == 5
    finally:
        updater.finalize()


def test_a_suspended_job_is_no_stall():
    """Master and worker stopped for 4 s while the master waits for the worker, then
    continued: with update_timeout=2 s and stall_warning=1.5 s the update goes on, since
    neither process ran meanwhile (the master raised WorkerError after the 'wait')."""
    model = SleepsInWorker(0.6, at=2)
    updater = _updater(model, update_timeout=2.0, stall_warning=1.5)
    try:
        run_updates(updater, model, 1)
        worker = updater.worker_pids()[0]
        stopper = subprocess.Popen(
            ['sh', '-c', f'sleep 0.2; kill -STOP {worker} {os.getpid()}; sleep 4; '
                         f'kill -CONT {worker} {os.getpid()}'])
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter('always')
                run_updates(updater, model, 1)   # the worker sleeps 0.6 s in this one
        finally:
            stopper.wait(30)
        assert [str(w.message) for w in record if issubclass(w.category, StallWarning)] == []
        assert updater.iteration == 2
    finally:
        updater.finalize()

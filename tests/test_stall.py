"""A worker that does not finish its update is seen, named, and (opt-in) ended.

``stall_warning`` (default 60 s) warns, naming the replicas the master waits for and
giving each one's Python stack; ``update_timeout`` (opt-in) raises WorkerError with the
same, and every worker is stopped. The times are scaled down here.
"""
from __future__ import annotations

import os
import signal
import time
import warnings

import pytest

import chainer

from mgpu_updater import ParallelAccumulatingUpdater, StallWarning, WorkerError

from _processes import alive
from _models import SleepsInWorker, dataset, run_updates, setup_optimizer


def _updater(model, **kwargs):
    its = [chainer.iterators.SerialIterator(dataset(64, seed=r), 4, shuffle=False)
           for r in range(2)]
    return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                       devices=['@numpy'] * 2, **kwargs)


def _gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_a_stalled_worker_is_named_with_its_stack_and_the_run_goes_on():
    model = SleepsInWorker(2.5, at=2)
    updater = _updater(model, stall_warning=0.5)
    try:
        run_updates(updater, model, 1)
        with pytest.warns(StallWarning) as record:
            run_updates(updater, model, 2)   # the worker sleeps in the second update
        assert len(record) == 1
        text = str(record[0].message)
        assert text.startswith('update 2: the master has waited ')
        assert 'for replicas [1] (@numpy), which have not finished their windows' in text
        pid = updater.worker_pids()[0]
        assert f'--- replica 1, pid {pid}' in text
        assert '_sleep_in_forward' in text and 'forward' in text   # its Python stack
        assert updater.iteration == 3
    finally:
        updater.finalize()


def test_update_timeout_raises_with_the_stack_and_leaves_nothing_behind():
    model = SleepsInWorker(60, at=2)
    updater = _updater(model, update_timeout=1.0, stall_warning=None)
    try:
        run_updates(updater, model, 1)
        pids = updater.worker_pids()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"^replica 1 on device '@numpy': did not finish "
                                              r'update 2 within update_timeout=1 s') as info:
            run_updates(updater, model, 1)
        assert time.monotonic() - t0 < 6
        assert '_sleep_in_forward' in str(info.value)
        assert info.value.replica == 1
    finally:
        updater.finalize()
    assert _gone(pids)


def test_a_stopped_worker_is_named_as_stopped():
    model = SleepsInWorker(0, at=10 ** 9)
    updater = _updater(model, update_timeout=1.0)
    try:
        run_updates(updater, model, 1)
        pids = updater.worker_pids()
        os.kill(pids[0], signal.SIGSTOP)
        with pytest.raises(WorkerError, match=r'did not finish update 2 within '
                                              r'update_timeout=1 s') as info:
            run_updates(updater, model, 1)
        assert 'the process is stopped' in str(info.value)
    finally:
        updater.finalize()
    assert _gone(pids)


def test_a_long_window_of_the_master_is_no_stall():
    """The clock starts when the master, its own window over, waits for a worker."""
    model = SleepsInWorker(1.5, at=1, in_master=True)
    updater = _updater(model, stall_warning=0.5)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter('always')
            run_updates(updater, model, 2)
        assert [w for w in record if issubclass(w.category, StallWarning)] == []
    finally:
        updater.finalize()


def test_a_workers_stack_file_is_closed_when_it_exits(tmp_path):
    # the worker keeps the file open for faulthandler; left to the collector at exit, it
    # printed "ResourceWarning: unclosed file" into every run's output under -W always
    import subprocess
    import sys
    path = tmp_path / 'replica1.txt'
    done = subprocess.run(
        [sys.executable, '-W', 'always::ResourceWarning', '-c',
         'from mgpu_updater._local.stall import register_stack_dump; '
         f'register_stack_dump({str(path)!r})'],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 'ResourceWarning' not in done.stderr, done.stderr

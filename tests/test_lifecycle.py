"""WorkerPool's start-up and shutdown, with small stand-in entry points (no model, no data).

``WorkerPool.start`` takes the worker's entry point, so these tests give it one that dies,
stalls or behaves, and check the master's side: which error, how fast, nothing left.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mgpu_updater import WorkerError
from mgpu_updater._local import worker as _worker
from mgpu_updater._local.pool import MAIN_GUARD_EXIT, WorkerPool

from _processes import alive

DEVICES = ['@numpy', '@numpy', '@numpy']


def _rank():
    return int(multiprocessing.current_process().name.rsplit('-', 1)[1])


def first_dies_before_hello(conn, parent_pid, shm_names, default_method, stack_file=None, output=None):
    """Replica 1 exits at once, as a worker re-running an unguarded script does; the
    others run the real entry point and wait for their payload."""
    if _rank() == 1:
        os._exit(MAIN_GUARD_EXIT)
    _worker.main(conn, parent_pid, shm_names, default_method)


def never_says_hello(conn, parent_pid, shm_names, default_method, stack_file=None, output=None):
    time.sleep(60)


def echo_payload(conn, parent_pid, shm_names, default_method, stack_file=None, output=None):
    """Says hello, takes its payload, answers ready with the payload's size."""
    conn.send(('hello',))
    payload = conn.recv_bytes()
    conn.send(('ready', len(payload)))
    conn.recv()   # ('stop',)


def busy_in_a_long_window(conn, parent_pid, shm_names, default_method, stack_file=None, output=None):
    """Ready at once, then deaf to the Stop for a minute (a worker in a long window)."""
    conn.send(('hello',))
    conn.recv_bytes()
    conn.send(('ready', 0))
    time.sleep(60)


def _close_timed(pool):
    t0 = time.monotonic()
    pool.close()
    return time.monotonic() - t0


def test_a_worker_dead_before_hello_is_a_guard_error_and_the_others_stop_at_once(
        monkeypatch):
    stopped_by_force = []
    monkeypatch.setattr(multiprocessing.process.BaseProcess, 'kill',
                        lambda proc: stopped_by_force.append('kill'))
    pool = WorkerPool(DEVICES, 'spawn')
    with pytest.raises(WorkerError, match=r"replica 1 on device '@numpy': the worker process "
                                          r'\(pid \d+\) re-ran the training code while '
                                          r"importing .*the script needs `if __name__ == "
                                          r"'__main__':`") as info:
        pool.start(first_dies_before_hello, {1: b'x', 2: b'x'}, [], timeout=60)
    assert info.value.exitcode == MAIN_GUARD_EXIT
    pids = pool.pids()
    # replica 2 waits for its payload: the stop it gets instead ends it without an error,
    # within the polite step (no SIGKILL after 3 s)
    pool.close()
    assert stopped_by_force == []
    assert multiprocessing.active_children() == []
    assert not any(alive(p) for p in pids)


def test_a_worker_that_never_starts_times_out():
    pool = WorkerPool(DEVICES[:2], 'spawn')
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r'no answer within 3 s during start \(still '
                                          r'waiting for replicas \[1\]\)'):
        pool.start(never_says_hello, {1: b''}, [], timeout=3.0)
    assert time.monotonic() - t0 < 6.0
    assert _close_timed(pool) < 6.0          # ask, then SIGKILL
    assert multiprocessing.active_children() == []


def test_payloads_far_above_the_pipe_buffer_arrive_whole():
    payloads = {1: os.urandom(8 << 20), 2: b'small'}
    pool = WorkerPool(DEVICES, 'spawn')
    try:
        ready = pool.start(echo_payload, payloads, [], timeout=60)
    finally:
        pool.close()
    assert ready == {1: 8 << 20, 2: 5}
    assert multiprocessing.active_children() == []


def test_a_second_ctrl_c_while_close_waits_kills_the_workers_and_is_raised():
    """Ctrl-C, then Ctrl-C again while the shutdown waits for a worker still in its
    window: the pool counts as closed from the start of close(), so had the second
    interrupt ended it there, nothing would stop that worker and the interpreter's exit
    would wait for it."""
    pool = WorkerPool(DEVICES[:2], 'spawn')
    pool.start(busy_in_a_long_window, {1: b''}, [], timeout=60)
    pids = pool.pids()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.close()   # in its 3 s wait for the Stop to be answered at 0.5 s
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 2.5
    assert multiprocessing.active_children() == []
    assert not any(alive(p) for p in pids)
    pool.close()   # twice is fine


def test_a_ctrl_c_while_the_workers_start_reaches_only_the_master():
    """A terminal's Ctrl-C goes to its whole process group. A spawned worker leaves that
    group only once Python's start-up is over (importing the main module and Chainer again,
    up to a second); a Ctrl-C before that killed it there, with a KeyboardInterrupt
    traceback of its own beside the master's. Spawned with SIGINT blocked, it drops it."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / 'tests')]))
    try:
        proc = subprocess.run([sys.executable, str(root / 'tests' / 'scripts' /
                                                   'ctrl_c_at_start.py')],
                              capture_output=True, text=True, timeout=90, env=env,
                              cwd=str(root), start_new_session=True)
    except subprocess.TimeoutExpired:
        pytest.fail('the script never exited after its Ctrl-C')
    assert 'CAUGHT KeyboardInterrupt' in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
    workers = json.loads(proc.stdout.split('WORKERS ', 1)[1].splitlines()[0])
    assert workers
    assert not any(alive(p) for p in workers)


@pytest.mark.parametrize('how', ['hooks', 'finally', 'started_there'])
def test_a_forked_child_that_exits_leaves_the_parents_updater_running(how):
    """``os.fork()`` from a process whose updater runs, and the child's normal exit: its
    exit hooks (the dropped updater's, the pools') stopped the parent's worker and removed
    its shared memory, and the parent's next update raised WorkerError (the worker
    "exited with code 0"); so did a ``finally`` that finalizes the updater, in the child.
    They act only in the process that made the updater."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / 'tests')]))
    proc = subprocess.run([sys.executable, str(root / 'tests' / 'scripts' / 'forked_child.py'),
                           how], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(root))
    assert proc.returncode == 0 and 'OK' in proc.stdout, proc.stdout + proc.stderr[-3000:]
    diff = float(proc.stdout.split('DIFF ', 1)[1].split()[0])
    assert diff < 1e-6

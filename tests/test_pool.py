"""``WorkerPool`` (mgpu_updater/_local/pool.py) on its own, with a trivial worker.

The worker (``scripts/pool_targets.py``) speaks the pool's start-up protocol and nothing
else, so these tests pin the pool's bounded waits, its dead-worker detection and its
teardown without Chainer, a model or a communicator: every wait ends within its bound with
a :class:`WorkerError` naming the replica and what the pool waited for, and ``close()``
leaves no process behind.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mgpu_updater._local import pool as pool_module
from mgpu_updater._local.pool import WorkerPool
from mgpu_updater.errors import WorkerError

sys.path.insert(0, str(Path(__file__).resolve().parent / 'scripts'))
import pool_targets  # noqa: E402  (spawned workers import it through the same sys.path)

DEVICES = ['@numpy', '@numpy', '@numpy']
START_TIMEOUT = 30.0   # generous: two cores shared with other jobs


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie no longer ours) within the bound."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f'/proc/{pid}/stat') as f:
                if f.read().rsplit(')', 1)[1].split()[0] == 'Z':
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def pool():
    pools = []

    def start(*behaviours, timeout=START_TIMEOUT):
        p = WorkerPool(DEVICES[:len(behaviours) + 1], 'spawn')
        pools.append(p)
        p.started = p.start(pool_targets.target,
                            {rank: b.encode() for rank, b in enumerate(behaviours, 1)},
                            [], timeout)
        return p

    start.pools = pools
    yield start
    for p in pools:
        p.close()


def test_start_gather_and_close(pool):
    p = pool('echo', 'echo')
    assert p.ranks == [1, 2]
    assert sorted(p.started) == [1, 2] and sorted(p.started.values()) == sorted(p.pids())
    p.send(('step', 'hi'))
    assert p.gather('done', timeout=10) == {1: 'hi', 2: 'hi'}
    pids = p.pids()
    p.close()
    assert p.ranks == [] and multiprocessing.active_children() == []
    assert all(gone(pid, 0) for pid in pids)
    p.close()   # twice is fine


def test_gather_timeout_names_the_rank_and_what_it_waited_for(pool):
    p = pool('echo', 'silent')
    p.send(('step', 1))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^replica 2 on device '@numpy': no answer within "
                                          r'1 s during update \(still waiting for replicas '
                                          r'\[2\]\)') as info:
        p.gather('done', timeout=1.0, what='update')
    assert 1.0 <= time.monotonic() - t0 < 3.0
    assert info.value.replica == 2


def test_a_worker_that_exits_becomes_a_worker_error_at_once(pool):
    p = pool('silent', 'exit')
    p.send(('step', 1))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^replica 2 on device '@numpy': the worker process "
                                          r'\(pid \d+\) exited with code 3') as info:
        p.gather('done', timeout=60)
    assert time.monotonic() - t0 < 5.0
    assert info.value.exitcode == 3


def _process_exists(pid):
    """Whether ``pid`` is a process (a zombie not reaped yet is one)."""
    return os.path.exists(f'/proc/{pid}')


def test_a_dead_workers_group_is_killed_before_the_pool_reaps_it(pool, monkeypatch):
    """Once a worker is reaped, its pid (its group's id) may be a new process's, another
    training's worker or a shell's job: the group kill comes while it is a zombie."""
    kills = []
    kill = pool_module._kill_group
    monkeypatch.setattr(pool_module, '_kill_group',
                        lambda pgid: (kills.append((pgid, _process_exists(pgid))), kill(pgid)))
    p = pool('silent', 'exit')
    dead = p.pids()[1]
    p.send(('step', 1))
    with pytest.raises(WorkerError, match='exited with code 3'):
        p.gather('done', timeout=60)
    assert not _process_exists(dead)   # reaped
    p.close()
    assert kills[0] == (dead, True)
    assert [pgid for pgid, _ in kills].count(dead) == 1   # not again by the pid it freed


def test_no_group_is_killed_by_a_reaped_workers_pid_that_another_process_holds(
        pool, monkeypatch):
    """A dead worker reaped by multiprocessing (any Process.start, active_children) before
    the pool saw it, its pid then taken by a new process (here: /proc gives that pid
    another start time): the pool kills no group by that pid."""
    kills = []
    kill = pool_module._kill_group
    monkeypatch.setattr(pool_module, '_kill_group',
                        lambda pgid: (kills.append(pgid), kill(pgid)))
    p = pool('silent', 'exit')
    dead = p.pids()[1]
    p.send(('step', 1))
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and _process_exists(dead):   # reaps it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    start_time = pool_module._start_time
    monkeypatch.setattr(pool_module, '_start_time',
                        lambda pid: 'later' if pid == dead else start_time(pid))
    with pytest.raises(WorkerError, match='exited with code 3'):
        p.gather('done', timeout=60)
    p.close()
    assert dead not in kills and len(kills) == 1   # the living worker's group only


def test_a_sigkilled_worker_becomes_a_worker_error_at_once(pool):
    p = pool('silent', 'silent')
    p.send(('step', 1))
    victim = p.pids()[0]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"^replica 1 on device '@numpy': the worker process "
                                          rf'\(pid {victim}\) was killed by SIGKILL') as info:
        p.gather('done')   # no timeout: the sentinel alone ends the wait
    assert time.monotonic() - t0 < 5.0
    assert info.value.exitcode == -signal.SIGKILL


def test_check_alive_reports_a_sigkilled_worker(pool):
    p = pool('silent')
    victim = p.pids()[0]
    os.kill(victim, signal.SIGKILL)
    assert gone(victim)
    with pytest.raises(WorkerError, match=rf"^replica 1 on device '@numpy': the worker process "
                                          rf'\(pid {victim}\) was killed by SIGKILL'):
        p.check_alive()


def test_a_worker_that_reports_a_failure_carries_its_traceback(pool):
    p = pool('fail')
    p.send(('step', 1))
    with pytest.raises(WorkerError, match=r"^replica 1 on device '@numpy': failed during "
                                          r'update') as info:
        p.gather('done', timeout=10)   # Failed's kind is 'error'
    assert info.value.remote_traceback.endswith('planted\n')


def test_start_timeout_when_a_worker_never_gets_ready(pool, monkeypatch):
    monkeypatch.setattr(pool_module, 'ASK_TIMEOUT', 0.3)   # the worker sleeps: not asked
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^replica 2 on device '@numpy': no answer within "
                                          r'3 s during start \(still waiting for replicas '
                                          r'\[2\]\)'):
        pool('echo', 'no_ready', timeout=3.0)
    assert time.monotonic() - t0 < 3.0 + 2.0
    p = pool.pools[-1]
    pids = p.pids()
    p.close()
    assert all(gone(pid, 0) for pid in pids) and multiprocessing.active_children() == []


def test_a_worker_dead_before_hello_is_reported_as_not_started(pool, monkeypatch):
    monkeypatch.setenv('POOL_TARGET_BEFORE_HELLO', 'exit')
    with pytest.raises(WorkerError, match=r'the worker process \(pid \d+\) exited with code 5 '
                                          r'before it started.*__name__ == .__main__.'):
        pool('echo')


def test_close_kills_a_worker_that_ignores_stop_and_sigterm(pool, monkeypatch):
    monkeypatch.setattr(pool_module, 'ASK_TIMEOUT', 0.3)
    p = pool('stubborn', 'echo')
    pids = p.pids()
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 0.3 + pool_module.KILL_TIMEOUT + 1.0
    assert all(gone(pid, 0) for pid in pids)
    assert multiprocessing.active_children() == []


def test_close_kills_the_workers_own_children(pool):
    """A worker's children (a MultiprocessIterator's pool, say) live in its process group,
    which close() kills: none outlives the pool, also when its worker was SIGKILLed."""
    p = pool('grandchild', 'grandchild')
    p.send(('step', None))
    grandchildren = list(p.gather('done', timeout=10).values())
    assert all(not gone(pid, 0) for pid in grandchildren)
    os.kill(p.pids()[0], signal.SIGKILL)   # its child is orphaned, still in its group
    p.close()
    assert all(gone(pid) for pid in grandchildren)


def test_check_sees_a_failure_behind_a_message_it_kept(pool):
    """A worker that sends Done and then fails (in its next steps): its Failed comes
    behind the Done that the master's ``check`` (run while it waits at the
    board) already read and kept: the next checks must still see it, within seconds."""
    p = pool('done_then_fail')
    p.send(('step', 1))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^replica 1 on device '@numpy': failed during "
                                          r'update') as info:
        while time.monotonic() - t0 < 10:
            p.check()
            time.sleep(0.005)
    assert time.monotonic() - t0 < 2.0
    assert info.value.remote_traceback.endswith('planted\n')


# ------------------------------------------------------------------ max_worker_restarts
def test_replace_starts_a_new_process_for_a_dead_rank_and_kills_what_it_left(pool):
    """A worker SIGKILLed: its process group (a MultiprocessIterator's pool, say) goes, it
    is reaped, and a new process for its rank speaks the protocol as the first did."""
    p = pool('grandchild', 'echo')
    p.send(('step', None), ranks=[1])
    grandchild = p.gather('done', timeout=10, ranks=[1])[1]
    victim, other = p.pids()
    os.kill(victim, signal.SIGKILL)
    assert gone(victim)
    assert p.dead_ranks() == [1]
    new = p.replace(pool_targets.target, {1: b'echo'}, [], START_TIMEOUT)[1]
    assert gone(grandchild)
    assert new not in (victim, other) and sorted(p.pids()) == sorted([new, other])
    assert p.dead_ranks() == []
    p.send(('step', 'again'))
    assert p.gather('done', timeout=10) == {1: 'again', 2: 'again'}
    p.close()
    assert all(gone(pid, 0) for pid in (victim, new, other))
    assert multiprocessing.active_children() == []


def test_rewind_drops_what_an_abandoned_update_delivers_and_names_the_dead(pool):
    """Every survivor answers Rewound after the Done of the update being abandoned (which
    is dropped); a worker that died meanwhile is returned, not raised."""
    from mgpu_updater._local.protocol import Rewind
    p = pool('echo', 'silent')
    p.send(('step', 1))
    victim = p.pids()[1]
    os.kill(victim, signal.SIGKILL)
    assert gone(victim)
    assert p.rewind([1, 2], Rewind(), 'rewound', ('done',)) == [2]
    assert p.death(2).died and p.death(2).exitcode == -signal.SIGKILL
    p.send(('step', 2), ranks=[1])   # nothing left over in its pipe
    assert p.gather('done', timeout=10, ranks=[1]) == {1: 2}


def test_rewind_raises_a_worker_failure(pool):
    from mgpu_updater._local.protocol import Rewind
    p = pool('echo', 'fail')
    p.send(('step', 1))
    with pytest.raises(WorkerError, match=r"^replica 2 on device '@numpy': failed during "
                                          r'update') as info:
        p.rewind([1, 2], Rewind(), 'rewound', ('done',))
    assert not info.value.died


def test_send_reaches_every_worker_before_it_raises_for_a_dead_one(pool):
    """Under max_worker_restarts every survivor must be in the same update: the Step goes
    to the workers after a dead one too."""
    p = pool('echo', 'echo')
    os.kill(p.pids()[0], signal.SIGKILL)
    assert gone(p.pids()[0])
    with pytest.raises(WorkerError, match=r'^replica 1 .*killed by SIGKILL') as info:
        p.send(('step', 'x'))
    assert info.value.died
    assert p.gather('done', timeout=10, ranks=[2]) == {2: 'x'}

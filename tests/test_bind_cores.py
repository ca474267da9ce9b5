"""``bind_cores``: each CPU replica process on a share of the cores of its own.

The shares are disjoint and in rank order; the master's main thread is bound while the
updater runs and gets its cores back at ``finalize()``; a worker is bound for its life.
Nothing is bound with fewer cores than replicas, on one replica, with ``False``, or (under
``'auto'``) for GPU replicas.
"""
from __future__ import annotations

import os
import warnings

import pytest

from mgpu_updater import _threads

from _models import run_updates, two_cpu_replicas


def _fake_cores(monkeypatch, cores):
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(cores))


@pytest.mark.parametrize('cores, replicas, shares', [
    ([0, 1], 2, [(0,), (1,)]),
    ([0, 1, 2, 3], 2, [(0, 1), (2, 3)]),
    ([4, 5, 6, 7, 8], 2, [(4, 5), (6, 7)]),       # an odd core out: shares stay equal
    ([0, 1, 2], 3, [(0,), (1,), (2,)]),
    ([0], 2, None),                                 # fewer cores than replicas
    ([0, 1, 2, 3], 1, None),                        # one replica: nothing to separate
])
def test_shares_are_disjoint_and_in_rank_order(monkeypatch, cores, replicas, shares):
    _fake_cores(monkeypatch, cores)
    assert _threads.core_shares('auto', replicas, on_cpu=True) == shares


def test_true_with_fewer_cores_than_replicas_warns_once_that_nothing_is_bound(monkeypatch):
    _fake_cores(monkeypatch, [3])
    monkeypatch.setattr(_threads, '_said_unbound', set())
    with pytest.warns(RuntimeWarning, match=r'bind_cores=True binds nothing: 2 replica '
                      r'processes .* 1 core\(s\) in its affinity \(\[3\]\)'):
        assert _threads.core_shares(True, 2, on_cpu=True) is None
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _threads.core_shares(True, 2, on_cpu=True) is None   # a restart: said once
        assert _threads.core_shares('auto', 2, on_cpu=True) is None   # 'auto': as it says


def test_auto_binds_cpu_replicas_only_true_any_false_none(monkeypatch):
    _fake_cores(monkeypatch, [0, 1, 2, 3])
    assert _threads.core_shares('auto', 2, on_cpu=False) is None
    assert _threads.core_shares(True, 2, on_cpu=False) == [(0, 1), (2, 3)]
    assert _threads.core_shares(False, 2, on_cpu=True) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason='needs 2 cores to bind 2 replicas')
def test_the_master_and_the_worker_run_on_their_own_cores_until_finalize():
    before = os.sched_getaffinity(0)
    shares = _threads.core_shares('auto', 2, on_cpu=True)
    model, updater = two_cpu_replicas()
    try:
        run_updates(updater, model, 2)
        assert os.sched_getaffinity(0) == set(shares[0])
        # its loading thread too (started before the binding)
        assert os.sched_getaffinity(updater._loader.thread_id) == set(shares[0])
        worker, = updater.worker_pids()
        assert os.sched_getaffinity(worker) == set(shares[1])
    finally:
        updater.finalize()
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason='needs 2 cores to bind 2 replicas')
def test_an_updater_built_while_another_runs_shares_out_the_cores_the_process_had():
    """The second's worker on its own share, not on the first's master share (which it
    would inherit: both replicas then ran on one core, at twice the time per update); the
    process's cores back only when the last one ends."""
    before = os.sched_getaffinity(0)
    shares = _threads.core_shares('auto', 2, on_cpu=True)
    first_model, first = two_cpu_replicas()
    second = None
    try:
        run_updates(first, first_model, 1)
        second_model, second = two_cpu_replicas()
        run_updates(second, second_model, 1)
        for updater in (first, second):
            worker, = updater.worker_pids()
            assert os.sched_getaffinity(worker) == set(shares[1])
        assert os.sched_getaffinity(0) == set(shares[0])
        first.finalize()
        assert os.sched_getaffinity(0) == set(shares[0])   # the second still runs
    finally:
        first.finalize()
        if second is not None:
            second.finalize()
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason='needs 2 cores to bind 2 replicas')
def test_each_thread_gets_its_own_cores_back_whichever_thread_ends_its_updater():
    """One updater trained in the main thread, another in a thread of its own, the main
    one finalized first; and a finalize() from another thread. The main thread stayed on
    its one core for good (and so did each updater built after it, its worker too)."""
    import threading
    before = os.sched_getaffinity(0)
    shares = _threads.core_shares('auto', 2, on_cpu=True)
    model, updater = two_cpu_replicas()
    seen = {}

    def other_thread():
        seen['start'] = os.sched_getaffinity(0)   # (the main thread's binding, inherited)
        other_model, other = two_cpu_replicas()
        try:
            run_updates(other, other_model, 1)
            seen['bound'] = os.sched_getaffinity(0)
            ended.wait(60)
        finally:
            other.finalize()
        seen['after'] = os.sched_getaffinity(0)

    ended = threading.Event()
    try:
        run_updates(updater, model, 1)
        thread = threading.Thread(target=other_thread)
        thread.start()
        while 'bound' not in seen and thread.is_alive():
            thread.join(0.05)
    finally:
        updater.finalize()
        ended.set()
        thread.join(60)
    assert seen['bound'] == set(shares[0]) and seen['after'] == seen['start']
    assert os.sched_getaffinity(0) == before
    model, updater = two_cpu_replicas()
    try:
        run_updates(updater, model, 1)
        finisher = threading.Thread(target=updater.finalize)
        finisher.start()
        finisher.join(60)
    finally:
        updater.finalize()
    assert os.sched_getaffinity(0) == before


def test_bind_cores_false_leaves_every_process_as_it_was():
    before = os.sched_getaffinity(0)
    model, updater = two_cpu_replicas(bind_cores=False)
    try:
        run_updates(updater, model, 1)
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(updater.worker_pids()[0]) == before
    finally:
        updater.finalize()


def test_bind_cores_is_auto_true_or_false():
    with pytest.raises(TypeError, match=r"^bind_cores must be 'auto', True or False \('yes' "
                                        r"of type str given\); pass 'auto'"):
        two_cpu_replicas(bind_cores='yes')

"""BLAS/OpenMP threads per replica (``blas_threads``): N replicas on C cores get
``max(1, C // N)`` each by default, unless the user's environment or the argument says
otherwise; the master's own threads change only while it computes its window, and only
where that window computes on the host.

The core count is faked in the master (``_threads.available_cores``), which decides the
number for every replica, so the tests mean the same on 2 cores as on 64. Each replica
reports the thread counts threadpoolctl sees while it computes, under a key of its own.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from typing import Dict

import numpy as np
import pytest
import threadpoolctl

import chainer

from mgpu_updater import ParallelAccumulatingUpdater, _threads
import _models


def _thread_counts() -> Dict[str, int]:
    return {pool['internal_api']: pool['num_threads']
            for pool in threadpoolctl.threadpool_info()}


def _blas_threads() -> int:
    """This process's BLAS threads; they must all agree (one number to compare)."""
    counts = {n for pool in threadpoolctl.threadpool_info() if pool['user_api'] == 'blas'
              for n in [pool['num_threads']]}
    assert len(counts) == 1, threadpoolctl.threadpool_info()
    return counts.pop()


def reporting_loss(model, x, t):
    """The model's loss, reporting the BLAS threads this replica computes with."""
    where = 'worker' if multiprocessing.parent_process() is not None else 'master'
    chainer.report({f'threads/{where}': float(_blas_threads())})
    return model(x, t)


class _Loss:
    """``reporting_loss`` bound to the model (re-bound to each worker's replica)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, t):
        return reporting_loss(self.model, x, t)


def _train(n_updates=2, **kwargs):
    """Two '@numpy' replicas; returns the last update's report and the master's BLAS
    threads before and after training."""
    model = _models.classifier(seed=0)
    model, updater = _models.two_cpu_replicas(model=model, loss_func=_Loss(model), **kwargs)
    before = _blas_threads()
    try:
        observations = _models.run_updates(updater, model, n_updates)
    finally:
        updater.finalize()
    return observations[-1], before, _blas_threads()


@pytest.fixture
def cores(monkeypatch):
    """Fake the cores the master sees; no thread variable in the environment."""
    for name in _threads.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def fake(n):
        monkeypatch.setattr(_threads, 'available_cores', lambda: n)
    return fake


def _default_in_fresh_process() -> int:
    """The BLAS threads a new Python process gets in this environment (what a worker has
    when nothing limits it)."""
    code = ('import json, numpy, threadpoolctl; print(json.dumps(sorted({p["num_threads"] '
            'for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"})))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True, timeout=60)
    counts = json.loads(out.stdout)
    assert len(counts) == 1, counts
    return counts[0]


# ---------------------------------------------------------------------- the number


@pytest.mark.parametrize('cores_, replicas, expected', [
    (2, 2, 1), (8, 2, 4), (3, 2, 1), (1, 4, 1), (16, 3, 5), (8, 1, None), (8, 0, None)])
def test_auto_divides_the_cores_among_the_replicas(cores, cores_, replicas, expected):
    cores(cores_)
    assert _threads.per_replica('auto', replicas) == expected


@pytest.mark.parametrize('name', _threads.USER_VARIABLES)
def test_auto_leaves_a_user_setting_alone(cores, monkeypatch, name):
    cores(8)
    monkeypatch.setenv(name, '3')
    assert _threads.per_replica('auto', 2) is None
    assert _threads.per_replica(2, 2) == 2      # an int wins over the environment
    monkeypatch.setenv(name, '')                 # set to nothing: not a setting
    assert _threads.per_replica('auto', 2) == 4


def test_an_int_and_none(cores):
    cores(8)
    assert _threads.per_replica(3, 2) == 3
    assert _threads.per_replica(3, 1) == 3
    assert _threads.per_replica(None, 2) is None


def test_replicas_on_host_under_mpi():
    class Comm:
        intra_size = 3
        size = 6
    assert _threads.replicas_on_host(1, Comm()) == 3
    assert _threads.replicas_on_host(1, object()) == 1   # unknown: leave alone
    assert _threads.replicas_on_host(4) == 4


def test_available_cores_is_the_affinity():
    if hasattr(os, 'sched_getaffinity'):
        assert _threads.available_cores() == len(os.sched_getaffinity(0))
    else:
        assert _threads.available_cores() == (os.cpu_count() or 1)


def test_window_limit_limits_inside_and_restores():
    before = _blas_threads()
    limit = _threads.WindowLimit(before + 1)
    for _ in range(2):   # the cached controller, twice
        with limit:
            assert _blas_threads() == before + 1
        assert _blas_threads() == before
    with _threads.WindowLimit(None):
        assert _blas_threads() == before


def test_window_limit_restores_after_an_error():
    before = _blas_threads()
    with pytest.raises(RuntimeError, match='boom'):
        with _threads.WindowLimit(before + 1):
            raise RuntimeError('boom')
    assert _blas_threads() == before


# ---------------------------------------------------------------------- end to end


def test_auto_limits_every_replica_and_the_master_only_in_its_window(cores):
    before = _blas_threads()
    cores(2 * (before + 1))                  # auto: before + 1, never what it has now
    obs, before_training, after = _train()
    assert obs['threads/worker'] == before + 1
    assert obs['threads/master'] == before + 1
    assert before_training == after == before


def test_users_environment_is_respected(cores, monkeypatch):
    cores(8)                                 # auto would give 4
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    obs, before, after = _train()
    assert obs['threads/worker'] == 1        # the worker's OpenBLAS read the variable
    assert obs['threads/master'] == before   # untouched: set before numpy was imported
    assert after == before


def test_an_int_wins_over_auto_and_the_environment(cores, monkeypatch):
    cores(8)
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    obs, before, after = _train(blas_threads=3)
    assert obs['threads/worker'] == 3
    assert obs['threads/master'] == 3
    assert after == before


def test_none_leaves_the_libraries_alone(cores):
    default = _default_in_fresh_process()
    cores(2 * (default + 1))                 # auto would give default + 1
    obs, before, after = _train(blas_threads=None)
    assert obs['threads/worker'] == default
    assert obs['threads/master'] == before
    assert after == before


def test_one_replica_auto_changes_nothing(cores):
    cores(64)
    model = _models.classifier(seed=0)
    optimizer = _models.setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(_models.dataset(16, seed=1), 4)
    updater = ParallelAccumulatingUpdater(it, optimizer, devices=['@numpy'],
                                          loss_func=_Loss(model))
    before = _blas_threads()
    obs = _models.run_updates(updater, model, 1)[-1]
    updater.finalize()
    assert obs['threads/master'] == before


@pytest.mark.parametrize('value, error, shown', [
    (0, ValueError, '0 given'), (-2, ValueError, '-2 given'),
    (1.5, TypeError, '1.5 of type float'), (True, TypeError, 'True of type bool'),
    ('many', TypeError, "'many' of type str"), ('AUTO', TypeError, "'AUTO' of type str"),
    (np.int64(0), ValueError, f'{np.int64(0)!r} given')])
def test_bad_values_are_refused_at_construction(value, error, shown):
    with pytest.raises(error, match=r"blas_threads must be 'auto', an int >= 1 or None") as e:
        _models.two_cpu_replicas(16, blas_threads=value)
    message = str(e.value)
    assert shown in message
    assert 'blas_threads=2' in message and 'None to leave' in message


def test_window_limit_finds_the_libraries_once(monkeypatch):
    """The master's limit builds threadpoolctl's controller (a scan of the loaded libraries,
    about 1.5 ms) once, not at every update: entering and leaving then read and set each
    library's count (about 7 us in an update)."""
    before = _blas_threads()
    built = []
    real = threadpoolctl.ThreadpoolController

    def counting():
        built.append(1)
        return real()
    monkeypatch.setattr(threadpoolctl, 'ThreadpoolController', counting)
    limit = _threads.WindowLimit(before + 1)
    for _ in range(5):
        with limit:
            pass
    assert len(built) == 1   # (threadpool_info() would build one of its own)
    assert _blas_threads() == before


def test_window_limit_sets_only_what_differs_and_restores_only_that(monkeypatch):
    """Entering sets a library's count only where it differs from the limit; leaving sets
    back only those, to what they had (the calls counted on threadpoolctl's own
    controllers of the loaded libraries)."""
    before = _blas_threads()
    controller = threadpoolctl.ThreadpoolController()
    calls = []
    for library in controller.lib_controllers:
        real = library.set_num_threads

        def counted(n, real=real, name=library.internal_api):
            calls.append((name, n))
            return real(n)
        monkeypatch.setattr(library, 'set_num_threads', counted)
    monkeypatch.setattr(threadpoolctl, 'ThreadpoolController', lambda: controller)
    counts = {lib.internal_api: lib.num_threads for lib in controller.lib_controllers}
    limit = _threads.WindowLimit(before)
    with limit:
        assert _blas_threads() == before
    assert [(name, n) for name, n in calls if counts[name] == before] == []
    calls.clear()
    limit.threads = before + 1
    with limit:
        assert _blas_threads() == before + 1
    assert _blas_threads() == before
    changed = [name for name, n in counts.items() if n != before + 1]
    assert calls == [(name, before + 1) for name in changed] + \
        [(name, counts[name]) for name in changed]


@pytest.mark.parametrize('threads', [1, 3, None])
def test_the_master_window_is_limited_only_on_the_host(threads):
    """A GPU replica's window runs no host BLAS: the master's limit there is none (it
    would cost each update its library calls); on the host it is the replicas' number."""
    assert _threads.master_window(threads, on_cpu=True).threads == threads
    assert _threads.master_window(threads, on_cpu=False).threads is None
    before = _blas_threads()
    with _threads.master_window(before + 1, on_cpu=False):
        assert _blas_threads() == before

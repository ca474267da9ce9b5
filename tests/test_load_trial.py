"""``prefetch='auto'``: each replica tries loading inline and ahead, and keeps the faster.

The schedule and the decision are checked with a driven clock; in the updater, a dataset
whose loads sleep (what a thread hides) ends loading ahead, on the master and on a worker,
and every way gives the same samples in the same order (the same weights, bitwise).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import chainer

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater import _load_trial
from mgpu_updater._load_trial import AHEAD, INLINE, LoadTrial

from _models import classifier, dataset, params, run_updates, setup_optimizer


def _run(trial, cycle):
    """Drive ``trial`` with windows whose cycle is ``cycle(way, i)`` seconds; the ways
    it asked for, until it decides."""
    now, ways = 0.0, []
    while True:
        way = trial.window(now)
        if trial.decision is not None:
            return ways
        ways.append(way)
        now += cycle(way, len(ways))


def test_the_schedule_warms_inline_then_alternates_blocks_by_round():
    ways = _run(LoadTrial(rounds=4, block=3, warmup=2, settle=1), lambda way, i: 1.0)
    assert ways == ['inline'] * 2 + (
        ['inline'] * 3 + ['ahead'] * 3 + ['ahead'] * 3 + ['inline'] * 3) * 2


@pytest.mark.parametrize('ahead_cycle, decision', [
    (0.5, AHEAD),      # loading ahead halves the cycle: a dataset that sleeps
    (0.97, AHEAD),     # 3% faster: beyond the margin
    (0.99, INLINE),    # 1% faster: within the margin, no thread
    (1.0, INLINE),
    (1.3, INLINE),     # a thread taking the GIL from the window
])
def test_the_median_ratio_decides_with_a_margin(ahead_cycle, decision):
    trial = LoadTrial(rounds=6, block=3, warmup=1, settle=1)
    _run(trial, lambda way, i: ahead_cycle if way == AHEAD else 1.0)
    assert trial.decision == decision
    assert trial.ratios() == pytest.approx([ahead_cycle] * 6)
    assert trial.window(123.0) == decision   # kept for good


def test_an_outlier_round_does_not_decide():
    trial = LoadTrial(rounds=5, block=3, warmup=1, settle=1)
    # one round where inline was slowed ten times over (the machine busy): ahead's
    # median ratio stays 1.0
    _run(trial, lambda way, i: 10.0 if (way == INLINE and 10 <= i < 14) else 1.0)
    assert trial.decision == INLINE


def test_the_first_windows_of_each_block_are_not_counted():
    trial = LoadTrial(rounds=2, block=4, warmup=1, settle=2)
    # the switch's windows (the first two of a block) 100 times slower, ahead the same
    plan = [way for way, _ in trial._plan]
    switched = {i for i in range(2, len(plan) + 1)
                if plan[i - 1] != plan[i - 2] or (i > 2 and plan[i - 2] != plan[i - 3])}
    _run(trial, lambda way, i: 100.0 if i in switched else 1.0)
    assert trial.ratios() == [1.0, 1.0] and trial.decision == INLINE


class _Sleepy(chainer.dataset.DatasetMixin):
    """Loads that wait (a file, a network): what a thread loading ahead hides."""

    def __init__(self, base, seconds):
        self.base, self.seconds = base, seconds

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        time.sleep(self.seconds)
        return self.base[i]


def _small_trial(monkeypatch):
    monkeypatch.setattr(_load_trial, 'ROUNDS', 4)
    monkeypatch.setattr(_load_trial, 'BLOCK', 4)
    monkeypatch.setattr(_load_trial, 'WARMUP', 2)
    return 2 + 4 * 2 * 4 + 1   # windows until decided


class _Waits(chainer.Chain):
    """A classifier whose forward waits ``seconds`` outside the GIL, as a GPU computes
    while its host waits."""

    def __init__(self, seconds):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed=0)
        self.seconds = seconds

    def forward(self, x, t):
        time.sleep(self.seconds)
        return self.inner(x, t)


def test_loads_that_wait_as_long_as_the_compute_end_loading_ahead(monkeypatch):
    """Loading L and computing C both outside the GIL, L = C: inline takes L + C, ahead
    max(L, C), half as long."""
    _small_trial(monkeypatch)
    monkeypatch.setattr(_load_trial, 'ROUNDS', 6)     # a busy machine: more rounds
    monkeypatch.setattr(_load_trial, 'BLOCK', 5)
    windows = 2 + 6 * 2 * 5 + 1
    model = _Waits(0.004)
    it = chainer.iterators.SerialIterator(_Sleepy(dataset(256, seed=1), 0.001), 4)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'])
    try:
        run_updates(updater, model, 1)
        assert updater.loading_modes == ['trial']
        run_updates(updater, model, windows)
        assert updater.loading_modes == ['ahead']
    finally:
        updater.finalize()


@pytest.mark.parametrize('prefetch', ['auto', 0, 2])
def test_every_way_of_loading_trains_on_the_same_samples(monkeypatch, prefetch):
    """Through a trial (switching ways every few updates) the same samples in the same
    order as without prefetch: the same weights, bitwise, and the same epoch."""
    windows = _small_trial(monkeypatch)
    out = {}
    for name, pf in (('ours', prefetch), ('reference', 0)):
        model = classifier(seed=0)
        its = [chainer.iterators.SerialIterator(dataset(64, seed=r), 4) for r in range(2)]
        updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                              devices=['@numpy'] * 2, prefetch=pf)
        try:
            run_updates(updater, model, windows + 3)
            out[name] = (params(model), updater.epoch_detail, list(updater.loading_modes))
        finally:
            updater.finalize()
    for key, value in out['reference'][0].items():
        np.testing.assert_array_equal(out['ours'][0][key], value, err_msg=key)
    assert out['ours'][1] == out['reference'][1]
    assert out['reference'][2] == ['none', 'none']
    if prefetch == 2:
        assert out['ours'][2] == ['ahead', 'ahead']
    elif prefetch == 'auto':   # the master decided (the worker's trial: its defaults)
        assert out['ours'][2][0] in ('inline', 'ahead')

"""``shard_optimizer='auto'``: the trial of both steps (``mgpu_updater._local.step_trial``).

Its contract: the schedule alternates the two steps in blocks, the order alternating by
round; only updates that took the step asked for count; the median of the rounds' ratios
decides (a tie keeps the master's step); and whichever the trial picks, the run is bitwise
the master's step (``shard_optimizer=False``), which the equivalence tests hold to a
large-batch ``StandardUpdater``.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer import optimizers

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._local import step_trial
from mgpu_updater._local.step_trial import StepTrial

from _models import classifier, dataset


class FakeClock:
    """A clock the test moves: each update takes ``cost(sharded)`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(trial, clock, cost, updates, can_shard=lambda n: True):
    """Run ``updates`` updates through ``trial``; returns which were sharded."""
    taken = []
    for n in range(updates):
        trial.begin()
        sharded = trial.wants_shard() and can_shard(n)
        clock.now += cost(sharded, n)
        trial.record(sharded)
        taken.append(sharded)
    return taken


def test_the_schedule_alternates_blocks_and_their_order():
    clock = FakeClock()
    trial = StepTrial(warmup=4, rounds=3, block=3, clock=clock)
    taken = _drive(trial, clock, lambda s, n: 1.0, 4 + 3 * 6)
    assert taken[:4] == [False, True, False, True]            # warm-up: both paths
    rounds = [taken[4 + 6 * r:4 + 6 * (r + 1)] for r in range(3)]
    assert rounds[0] == [True] * 3 + [False] * 3               # sharded first ...
    assert rounds[1] == [False] * 3 + [True] * 3               # ... then master first
    assert rounds[2] == rounds[0]
    assert trial.ratios == [1.0, 1.0, 1.0]
    assert trial.decided is False and trial.state == 'master'  # a tie: the master's step


@pytest.mark.parametrize('sharded_cost, decided', [(0.9, True), (1.1, False)])
def test_the_faster_step_is_kept(sharded_cost, decided):
    clock = FakeClock()
    trial = StepTrial(warmup=2, rounds=5, block=4, clock=clock)
    _drive(trial, clock, lambda s, n: sharded_cost if s else 1.0, 2 + 5 * 8)
    assert trial.ratios == pytest.approx([sharded_cost] * 5)
    assert trial.decided is decided
    assert trial.state == ('sharded' if decided else 'master')
    # decided: every update from now on takes that step, and nothing more is timed
    assert _drive(trial, clock, lambda s, n: 5.0, 7) == [decided] * 7
    assert len(trial.ratios) == 5


def test_the_median_decides_not_an_outlier():
    clock = FakeClock()
    trial = StepTrial(warmup=0, rounds=5, block=2, clock=clock)
    # sharded 0.95 of the master's time, but round 1's timed sharded update (n=7) stalled
    cost = lambda s, n: (50.0 if n == 7 else 0.95) if s else 1.0   # noqa: E731
    _drive(trial, clock, cost, 5 * 4)
    assert max(trial.ratios) > 10 and trial.decided is True


def test_the_first_update_of_each_block_is_not_timed():
    clock = FakeClock()
    trial = StepTrial(warmup=0, rounds=1, block=3, clock=clock)
    # the switch costs the first update of each block 10 s: it must not count
    _drive(trial, clock, lambda s, n: 10.0 if n % 3 == 0 else (1.0 if s else 2.0), 6)
    assert trial.ratios == [0.5] and trial.decided is True


def test_an_update_that_could_not_be_sharded_does_not_count():
    clock = FakeClock()
    trial = StepTrial(warmup=0, rounds=1, block=2, clock=clock)
    # the first two asked-for sharded updates fall back to the master's step (a hook
    # that is not elementwise, say): the sharded block waits for real sharded updates
    taken = _drive(trial, clock, lambda s, n: 0.5 if s else 1.0, 6,
                   can_shard=lambda n: n >= 2)
    assert taken == [False, False, True, True, False, False]
    assert trial.ratios == [0.5] and trial.decided is True


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r'block >= 2 \(0, 1, 1 given\)'):
        StepTrial(warmup=0, rounds=1, block=1)


# --------------------------------------------------------------------------------------
# In the updater: bitwise the master's step, whichever step the trial keeps


def _train(shard, updates, clock=None):
    model = classifier(seed=3)
    opt = optimizers.MomentumSGD(0.05)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(64, seed=10 + r), 4, shuffle=False)
           for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          accumulate_steps=2, shard_optimizer=shard)
    states, issued = [], []
    try:
        for _ in range(updates):
            updater.update()
            states.append(updater.optimizer_step)
            issued.append(any(verb == 'reduce_scatter'
                              for verb, _ in updater._group.comm.issued()))
    finally:
        updater.finalize()
    out = {name: np.array(p.array) for name, p in model.namedparams()}
    out.update({name + '/v': np.array(p.update_rule.state['v'])
                for name, p in model.namedparams()})
    return out, states, issued


@pytest.mark.parametrize('sharded_faster', [True, False])
def test_auto_trains_bitwise_as_the_masters_step_and_keeps_what_it_timed_faster(
        monkeypatch, sharded_faster):
    monkeypatch.setattr(step_trial, 'WARMUP', 2)
    monkeypatch.setattr(step_trial, 'ROUNDS', 2)
    monkeypatch.setattr(step_trial, 'BLOCK', 2)
    # the trial's clock: each call moves it on by what the update would have taken
    real_init = StepTrial.__init__
    ticks = {'now': 0.0}

    def clock():
        return ticks['now']

    def init(self, *args, **kwargs):
        real_init(self, *args, clock=clock, **kwargs)
    monkeypatch.setattr(StepTrial, '__init__', init)
    real_record = StepTrial.record

    def record(self, sharded):
        ticks['now'] += 1.0 if sharded == sharded_faster else 2.0
        real_record(self, sharded)
    monkeypatch.setattr(StepTrial, 'record', record)

    updates = 2 + 2 * 4 + 3
    got, states, issued = _train('auto', updates)
    reference, _, never = _train(False, updates)
    assert not any(never)
    for key in reference:
        np.testing.assert_array_equal(got[key], reference[key], err_msg=key, strict=True)
    assert states[:10] == ['trial'] * 9 + [states[9]]
    assert states[-1] == ('sharded' if sharded_faster else 'master')
    assert issued[:2] == [False, True]                         # the warm-up: both
    assert issued[-3:] == [sharded_faster] * 3                 # then what was faster

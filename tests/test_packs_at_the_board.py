"""Packs announced at the board (``mgpu_updater._local.board.announces_packs``, issue 15).

On the shared-memory backend, where the machine's store order lets a post publish what was
written before it, every rank of an update posts at the board once its
gradient is packed (with its sample count and loss), the master sums as soon as the last
post is in and steps, and only then takes the workers' Done messages, which travel
meanwhile. Elsewhere Done says it, as before. The contract: bitwise the Done path, which
the equivalence tests hold to a large-batch ``StandardUpdater``; every rank posts exactly
once per update; the master's step sees the same count and loss either way.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer import optimizers

from mgpu_updater import ParallelAccumulatingUpdater, _step
from mgpu_updater._local import board as board_module
from mgpu_updater._local import group as group_module

from _models import classifier, dataset

N, K, B, UPDATES = 2, 2, 4, 3


def _start(opt, **kwargs):
    """Two CPU replicas of the same model under ``opt``; the updater, and the list into
    which it records every step it applies (the optimizer's update sees these)."""
    model = classifier(seed=3)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(64, seed=10 + r), B, shuffle=False)
           for r in range(N)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * N,
                                          accumulate_steps=K, **kwargs)
    steps = []
    apply = updater._apply

    def recording(optimizer, count, loss, loss_scale, of_update):
        steps.append(_step.GradientStep(count, loss, loss_scale, None))
        apply(optimizer, count, loss, loss_scale, of_update)
    updater._apply = recording
    return model, updater, steps


def _train(pipelined=False, updates=UPDATES):
    """``updates`` updates of two CPU replicas; what the model holds, the steps' counts
    and losses, and the board's rounds by rank."""
    model, updater, applied = _start(optimizers.MomentumSGD(0.05), pipelined=pipelined)
    try:
        for _ in range(updates):
            updater.update()
        group = updater._group
        board = group.board
        rounds = None if board is None else [board._ints[r * board_module._WORDS
                                                         + board_module._ROUND]
                                             for r in range(N)]
        announced = group.announce_packs
    finally:
        updater.finalize()
    params = {name: np.array(p.array) for name, p in model.namedparams()}
    return params, [(s.count, float(s.loss)) for s in applied], rounds, announced


def _assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key, strict=True)


@pytest.mark.parametrize('pipelined', [False, True])
def test_the_board_path_is_bitwise_the_done_path_and_every_rank_posts_once_per_update(
        monkeypatch, pipelined):
    by_board, steps, rounds, announced = _train(pipelined)
    assert board_module.STORE_ORDER, 'this test needs an x86-64 machine'
    assert announced and rounds == [UPDATES] * N
    monkeypatch.setattr(group_module, 'STORE_ORDER', False)   # as on a weaker memory order
    by_done, done_steps, done_rounds, done_announced = _train(pipelined)
    assert not done_announced and done_rounds is None   # no board: the pipes alone
    _assert_bitwise(by_board, by_done)
    assert steps == done_steps   # the same count and loss reached the step
    # every step is over both replicas' k micro-batches (pipelined: one fewer, a late one)
    assert [c for c, _ in steps] == [N * K * B] * (UPDATES - pipelined)


def test_the_posted_counts_and_losses_are_the_reported_ones():
    """What the master steps with comes from the posts; it is what the replicas
    reported (``main/loss`` is the mean loss over both replicas' samples)."""
    model, updater, steps = _start(optimizers.SGD(0.1))
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    try:
        observation = {}
        with reporter.scope(observation):
            updater.update()
        posted = updater._group.board.posted()
    finally:
        updater.finalize()
    assert [c for c, _ in posted] == [K * B] * N
    (step,) = steps
    assert step.count == N * K * B
    assert step.loss == pytest.approx(float(observation['main/loss']), rel=1e-6)
    assert step.loss == sum(loss for _, loss in posted) / step.count

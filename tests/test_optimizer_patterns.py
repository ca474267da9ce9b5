"""How Chainer users configure what trains: each pattern trains as under StandardUpdater.

Frozen links (``disable_update()``, as fine-tuning does), a parameter's update rule turned
off, a learning rate of its own, hooks on one parameter's update rule, an optimizer hook
that runs after the step, and a parameter that some micro-batches, some replicas or a
whole update leave without a gradient: two ``'@numpy'`` replicas, two micro-batches each,
every update compared with a single-process ``StandardUpdater`` on one batch of the same
samples (the contract of ``tests/test_equivalence.py``). Before its step Chainer's
optimizer gives a parameter without a gradient one of zeros
(``GradientMethod.reallocate_cleared_grads``), so weight decay and momentum still move
it; a parameter no sample reaches moves exactly as much under both. An optimizer that
overrides that method (to leave such a parameter as it is) is warned about at
construction where the step is on a summed gradient, which every parameter has.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import (SometimesExtra, WeightedLoss, classifier, dataset, params,
                     run_updates)

UPDATES, N, K, B = 3, 2, 2, 4


def _momentum_decay(model):
    opt = chainer.optimizers.MomentumSGD(0.05)
    opt.setup(model)
    opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-2))
    return opt


def _adam(model):
    opt = chainer.optimizers.Adam(1e-2)
    opt.setup(model)
    return opt


def _frozen_link(model):
    opt = _momentum_decay(model)
    model.predictor.l1.disable_update()
    return opt


def _rule_disabled(model):
    opt = _adam(model)
    model.predictor.l2.b.update_rule.enabled = False
    return opt


def _own_learning_rate(model):
    opt = _momentum_decay(model)
    model.predictor.l1.W.update_rule.hyperparam.lr = 0.5
    return opt


def _hook_on_one_rule(model):
    opt = _momentum_decay(model)
    model.predictor.l1.W.update_rule.add_hook(chainer.optimizer_hooks.Lasso(1e-2))
    return opt


def _clamp(optimizer):
    for param in optimizer.target.params():
        np.clip(param.array, -0.2, 0.2, out=param.array)


_clamp.name = 'clamp'
_clamp.timing = 'post'


def _post_hook(model):
    opt = chainer.optimizers.SGD(0.5)
    opt.setup(model)
    opt.add_hook(_clamp)
    return opt


def _window(datasets, u):
    return [x for d in datasets for x in d[u * K * B:(u + 1) * K * B]]


def _train_both(make_model, make_optimizer):
    datasets = [dataset(K * B * UPDATES, seed=30 + r) for r in range(N)]
    ours, ref = make_model(), make_model()
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in datasets],
        make_optimizer(ours), devices=['@numpy'] * N, accumulate_steps=K)
    try:
        run_updates(updater, ours, UPDATES)
    finally:
        updater.finalize()
    ref_opt = make_optimizer(ref)
    for u in range(UPDATES):
        it = chainer.iterators.SerialIterator(_window(datasets, u), N * K * B, shuffle=False)
        run_updates(StandardUpdater(it, ref_opt), ref, 1)
    return params(ours), params(ref), params(make_model())


def _assert_same(ours, ref):
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('configure, frozen', [
    (_frozen_link, ['/predictor/l1/W', '/predictor/l1/b']),
    (_rule_disabled, ['/predictor/l2/b']),
    (_own_learning_rate, []),
    (_hook_on_one_rule, []),
    (_post_hook, []),
])
def test_what_trains_is_configured_as_under_standard_updater(configure, frozen):
    ours, ref, start = _train_both(lambda: classifier(seed=3), configure)
    _assert_same(ours, ref)
    for name in ref:   # the frozen stay as they were, all else moved
        np.testing.assert_equal(name in frozen, np.array_equal(ref[name], start[name]),
                                err_msg=name)


def test_the_data_reaches_the_extra_head_in_some_micro_batches_only():
    """The cases below are what they say on these samples: whether any sample of a
    micro-batch has its first feature above the threshold, per update (rows) and
    replica and micro-batch (columns)."""
    datasets = [dataset(K * B * UPDATES, seed=30 + r) for r in range(N)]
    first = np.array([[[d[i][0][0] for i in range((u * K + m) * B, (u * K + m + 1) * B)]
                       for d in datasets for m in range(K)] for u in range(UPDATES)])
    reached = first.max(axis=2)   # update x (replica, micro-batch)
    some = reached > 1.5   # an update where some micro-batches reach it and others not
    assert (some.any(axis=1) & ~some.all(axis=1)).any()
    assert (reached > 2.0).any(axis=1).sum() == 1   # one update of three reaches it
    assert not (reached > 9.0).any()


@pytest.mark.parametrize('threshold', [1.5, 2.0, 9.0],
                         ids=['some_micro_batches', 'one_update_of_three', 'never'])
@pytest.mark.parametrize('make_optimizer', [_momentum_decay, _adam], ids=['momentum_decay', 'adam'])
def test_a_parameter_without_a_gradient_trains_as_under_standard_updater(threshold,
                                                                         make_optimizer):
    def make_model():
        np.random.seed(4)
        return L.Classifier(SometimesExtra(threshold))
    ours, ref, start = _train_both(make_model, make_optimizer)
    _assert_same(ours, ref)
    if threshold == 9.0 and make_optimizer is _adam:
        # gradients of zeros only: Adam's moments stay zero, the head as it started
        for name in ('/predictor/extra/W', '/predictor/extra/b'):
            np.testing.assert_array_equal(ours[name], start[name], err_msg=name)
    else:   # reached, or decayed: it moved
        assert not np.array_equal(ours['/predictor/extra/W'], start['/predictor/extra/W'])


class _LeavesMissingGradients(chainer.optimizers.MomentumSGD):
    """Chainer's docstring: an optimizer that needs no zeros for missing gradients may
    override ``reallocate_cleared_grads`` with a blank one."""

    def reallocate_cleared_grads(self):
        pass


@pytest.mark.parametrize('devices, pipelined, warned', [
    (1, False, False), (1, True, True), (2, False, True)])
@pytest.mark.parametrize('where', ['class', 'instance'])
def test_an_optimizer_that_leaves_missing_gradients_is_warned_about_where_it_cannot(
        devices, pipelined, warned, where):
    model = classifier(seed=0)
    if where == 'class':
        opt = _LeavesMissingGradients(0.1)
    else:
        opt = chainer.optimizers.MomentumSGD(0.1)
        opt.reallocate_cleared_grads = lambda: None
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(8, seed=r), 4) for r in range(devices)]
    # (warnings are errors here: where none is expected, one would fail the test)
    with pytest.warns(RuntimeWarning) if warned else contextlib.nullcontext() as record:
        updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * devices,
                                              pipelined=pipelined)
    updater.finalize()
    if warned:
        message = str(record[0].message)
        assert message.startswith(f'the optimizer ({type(opt).__name__}) overrides '
                                  'reallocate_cleared_grads'), message
        assert 'link.disable_update()' in message
        assert record[0].filename == __file__   # pointed at the caller



@pytest.mark.parametrize('loss_scale', [None, 8.0])
def test_a_gradient_set_on_the_loss_weights_it_as_under_standard_updater(loss_scale):
    """``loss.grad = w`` before the backward: the update is w times the plain one under
    both (every replica's micro-batches too); under loss scaling Chainer seeds from it
    unscaled and still divides by the scale, and so does ours."""
    def make_model():
        np.random.seed(0)
        return WeightedLoss(0.5)

    def make_optimizer(model):
        opt = chainer.optimizers.SGD(0.1)
        opt.setup(model)
        if loss_scale is not None:
            opt.loss_scaling(interval=1000, scale=loss_scale)
        return opt

    ours, ref, start = _train_both(make_model, make_optimizer)
    _assert_same(ours, ref)
    assert any(not np.array_equal(ref[n], start[n]) for n in ref)

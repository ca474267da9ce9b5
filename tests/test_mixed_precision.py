"""float16 models with Chainer's loss scaling, across replicas, against the reference."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater.errors import NonFiniteGradientError

from _models import classifier, dataset, params, run_updates


def _fp16_model(seed):
    with chainer.using_config('dtype', np.float16):
        return classifier(seed=seed)


def _optimizer(model, dynamic, initial_scale):
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    opt.use_fp32_update()
    if dynamic:
        opt.loss_scaling(interval=2)
        opt._loss_scale = initial_scale
    else:
        opt.loss_scaling(scale=initial_scale)
    return opt


@pytest.mark.parametrize('dynamic,initial_scale,spike', [
    (False, 128.0, None), (True, 8.0, None),
    (True, 2.0 ** 15, 3000.0)])   # one worker sample overflows float16 gradients
def test_float16_with_loss_scaling_matches_the_reference(dynamic, initial_scale, spike):
    n, b, k, updates = 2, 4, 2, 4
    datasets = [dataset(b * k * updates, seed=90 + r, dtype=np.float16) for r in range(n)]
    if spike is not None:
        datasets[1]._datasets[0][1, :] = spike      # replica 1, update 0 only
    model, ref = _fp16_model(1), _fp16_model(1)
    assert model.predictor.l1.W.dtype == np.float16
    opt, ref_opt = _optimizer(model, dynamic, initial_scale), _optimizer(ref, dynamic, initial_scale)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n, accumulate_steps=k)
    scales, ref_scales = [], []
    try:
        with warnings.catch_warnings(), np.errstate(over='ignore', invalid='ignore'):
            # Chainer warns on every overflow that dynamic loss scaling skips (and numpy 2
            # on the float16 overflow itself)
            warnings.filterwarnings('ignore', 'Non finite number found in param.grad')
            for u in range(updates):
                run_updates(updater, model, 1)
                scales.append(opt._loss_scale)
                batch = []
                for d in datasets:
                    batch.extend(d[u * k * b:(u + 1) * k * b])
                it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
                run_updates(StandardUpdater(it, ref_opt), ref, 1)
                ref_scales.append(ref_opt._loss_scale)
    finally:
        updater.finalize()
    # an overflow anywhere skips the update for everyone, exactly as on one device
    assert scales == ref_scales
    if spike is not None:
        assert scales[0] == initial_scale / 2   # update 1 overflowed in the worker: skipped
    for name, value in params(ref).items():
        got = params(model)[name]
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), value.astype(np.float32),
                                   rtol=2e-2, atol=2e-3, err_msg=name)


def test_float16_loss_summed_over_a_large_window_stays_finite():
    """The window's loss sum (loss x samples over its micro-batches) is taken in float64 on
    the host. Summed on the device in the loss's dtype (as before read_on_host), under
    numpy 2's and CuPy's promotion rules it stayed float16, passed 65504 and made a finite
    loss look infinite (NonFiniteLossError); numpy 1's value-based casting hid it."""
    b, k = 1024, 4
    data = dataset(b * k, seed=5, dtype=np.float16)
    model, ref = _fp16_model(5), _fp16_model(5)
    expected = []
    for i in range(k):
        x, t = chainer.dataset.concat_examples(data[i * b:(i + 1) * b])
        expected.append(float(ref(x, t).array))
    assert 40 * expected[0] * b * k > 65504     # the sum overflows float16

    def loss_func(x, t):
        return model(x, t) * 40

    opt = chainer.optimizers.SGD(0.01)
    opt.setup(model)
    opt.use_fp32_update()
    it = chainer.iterators.SerialIterator(data, b, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], accumulate_steps=k,
                                          loss_func=loss_func)
    try:
        obs = run_updates(updater, model, 1)[0]     # NonFiniteLossError if it overflowed
    finally:
        updater.finalize()
    np.testing.assert_allclose(float(obs['main/loss']), np.mean(expected), rtol=1e-3)
    assert np.isfinite(params(model)['/predictor/l1/W']).all()


class FrozenSqrt(chainer.Chain):
    """A layer, frozen in the tests, whose weight gradient is NaN (a square root at 0
    behind a ReLU) while the loss and the head's gradient stay finite."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = chainer.links.Linear(5, 4)
            self.fc = chainer.links.Linear(4, 3)

    def forward(self, x):
        return self.fc(chainer.functions.sqrt(chainer.functions.relu(self.c1(x))))


class GradientNormLog:
    """An optimizer hook after the step that reads every gradient (a norm it logs)."""
    name = 'GradientNormLog'
    timing = 'post'

    def __init__(self):
        self.norms = []

    def __call__(self, optimizer):
        self.norms.append(sum(float((p.grad ** 2).sum()) for p in optimizer.target.params()
                              if p.grad is not None))


def _frozen_sqrt(freeze, clip=False, log=False):
    np.random.seed(0)
    model = chainer.links.Classifier(FrozenSqrt())
    opt = chainer.optimizers.SGD(0.1).setup(model)
    if freeze == 'disable_update':
        model.predictor.c1.disable_update()
    else:
        for param in model.predictor.c1.params():
            param.update_rule.enabled = False
    if clip:   # reads every gradient: the frozen NaN reaches the head through its norm
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    if log:   # reads every gradient after the step: nothing reaches a parameter
        opt.add_hook(GradientNormLog())
    opt.loss_scaling(scale=8.0)   # static
    return model, opt


@pytest.mark.parametrize('n,k,freeze,log', [
    (2, 2, 'disable_update', False), (1, 2, 'disable_update', False),
    (1, 1, 'disable_update', False), (2, 2, 'rule_disabled', False),
    (1, 1, 'rule_disabled', False), (2, 1, 'disable_update', True)])
def test_a_frozen_parameters_nonfinite_gradient_does_not_stop_a_static_scale(n, k, freeze,
                                                                               log):
    """Under a static loss scale the step leaves a frozen parameter alone, whatever its
    gradient holds, and StandardUpdater trains the rest: so do we, under the default
    nonfinite='raise' (it raised NonFiniteGradientError; 'skip' skipped every update).
    So does a hook after the step that reads every gradient."""
    b, updates = 4, 3
    datasets = [dataset(b * k * updates, seed=60 + r) for r in range(n)]
    model, opt = _frozen_sqrt(freeze, log=log)
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets], opt,
        devices=['@numpy'] * n, accumulate_steps=k)
    with np.errstate(divide='ignore', invalid='ignore'):
        try:
            run_updates(updater, model, updates)
        finally:
            updater.finalize()
        assert np.isnan(model.predictor.c1.W.grad).any()   # what the test is about
        ref, ref_opt = _frozen_sqrt(freeze, log=log)
        batches = sum([sum((d[i:i + b * k] for d in datasets), [])
                       for i in range(0, b * k * updates, b * k)], [])
        reference = StandardUpdater(
            chainer.iterators.SerialIterator(batches, n * b * k, shuffle=False), ref_opt)
        for _ in range(updates):
            reference.update()
    for name, value in params(model).items():
        np.testing.assert_allclose(value, params(ref)[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    assert not np.allclose(model.predictor.fc.W.array,   # the head trained
                           _frozen_sqrt(freeze)[0].predictor.fc.W.array)


def test_a_frozen_nonfinite_gradient_that_a_hook_spreads_is_raised_naming_it():
    """GradientClipping's norm reads every gradient, the frozen one's NaN included, and
    would make every gradient NaN: the step is refused, naming the parameter."""
    data = dataset(8, seed=60)
    model, opt = _frozen_sqrt('disable_update', clip=True)
    before = params(model)
    updater = ParallelAccumulatingUpdater(
        chainer.iterators.SerialIterator(data, 4, shuffle=False), opt, devices=['@numpy'])
    with np.errstate(divide='ignore', invalid='ignore'):
        try:
            with pytest.raises(NonFiniteGradientError, match=(
                    r'in the gradient of /predictor/c1/W, /predictor/c1/b\); parameters')):
                updater.update()
        finally:
            updater.finalize()
    for name, value in params(model).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)

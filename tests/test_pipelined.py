"""pipelined=True: the reduce of update t overlaps update t+1; gradients apply one late."""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer import training
from chainer.training import extensions

from mgpu_updater import NonFiniteLossError, ParallelAccumulatingUpdater, shard_iterators

from _models import classifier, dataset, params, run_updates, setup_optimizer

UPDATES = 4


def _stale_by_one_reference(model, datasets, b, k, updates):
    """P(t+1) = update(P(t), G(t-1)), G(t) the large-batch gradient at P(t)."""
    opt = setup_optimizer('adam', model)
    previous = None
    losses = []
    for u in range(updates):
        batch = []
        for d in datasets:
            batch.extend(d[u * k * b:(u + 1) * k * b])
        x, t = chainer.dataset.concat_examples(batch)
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        losses.append(float(loss.array))
        grads = {name: p.grad.copy() for name, p in model.namedparams()}
        if previous is not None:
            for name, p in model.namedparams():
                p.grad = previous[name]
            opt.update()
        previous = grads
    return losses


@pytest.mark.parametrize('n_devices', [1, 2])
def test_pipelined_applies_each_gradient_one_update_late(n_devices):
    b, k = 4, 2
    datasets = [dataset(b * k * UPDATES, seed=80 + r) for r in range(n_devices)]
    model, ref = classifier(seed=8), classifier(seed=8)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    opt = setup_optimizer('adam', model)
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n_devices,
                                          accumulate_steps=k, pipelined=True)
    try:
        first = run_updates(updater, model, 1)
        assert opt.t == 0                      # nothing to apply after the first update
        later = run_updates(updater, model, UPDATES - 1)
        assert opt.t == UPDATES - 1
    finally:
        updater.finalize()
    losses = [o['main/loss'] for o in first + later]
    ref_losses = _stale_by_one_reference(ref, datasets, b, k, UPDATES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(model)[name], value, rtol=1e-5, atol=1e-6)


def _trainer(out, stop, nonfinite='raise'):
    model = classifier(seed=9)
    its = shard_iterators(dataset(100, seed=9), 2, 4, seed=3)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                          devices=['@numpy'] * 2, accumulate_steps=3,
                                          pipelined=True, nonfinite=nonfinite)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=str(out))
    trainer.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                   trigger=(5, 'iteration'))
    return trainer, model


@pytest.mark.parametrize('nonfinite', ['raise', 'ignore'])   # 'ignore': a 0-dim loss in flight
def test_pipelined_resume_keeps_the_gradient_in_flight(tmp_path, nonfinite):
    straight, model_a = _trainer(tmp_path / 'a', 10, nonfinite)
    straight.run()
    first, _ = _trainer(tmp_path / 'b', 5, nonfinite)
    first.run()
    resumed, model_b = _trainer(tmp_path / 'b', 10, nonfinite)
    chainer.serializers.load_npz(str(tmp_path / 'b' / 'snap_5'), resumed)
    resumed.run()
    for name, value in params(model_a).items():
        assert np.array_equal(value, params(model_b)[name]), name


@pytest.mark.parametrize('nonfinite', ['raise', 'skip'])
def test_a_nonfinite_loss_is_named_by_its_own_update_when_its_step_is_due(nonfinite):
    """Pipelined, update 2's gradient is stepped on at update 3: the error, or the skip,
    comes then, and names update 2, whose loss it was."""
    datasets = [dataset(24, seed=r) for r in range(2)]
    datasets[1][4][0][...] = np.nan          # in the worker's batch of update 2
    model = classifier(seed=0)
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in datasets],
        setup_optimizer('sgd', model), devices=['@numpy'] * 2, pipelined=True,
        nonfinite=nonfinite)
    try:
        run_updates(updater, model, 2)        # update 2's loss is NaN, not stepped on yet
        if nonfinite == 'raise':
            with pytest.raises(NonFiniteLossError, match=r'the loss became nan at update 2;'):
                run_updates(updater, model, 1)
        else:
            with pytest.warns(RuntimeWarning, match=r'skipping the step of update 2, due at '
                                                    r'update 3 \(pipelined\): the loss is nan'):
                run_updates(updater, model, 1)
    finally:
        updater.finalize()

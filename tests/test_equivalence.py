"""The product's contract: N devices x k micro-batches == one large batch.

Every test compares with a single-process ``StandardUpdater`` fed one batch holding
exactly the samples of the update (the reference), on CPU replicas (``'@numpy'``).
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import (classifier, dataset, params, persistents, run_updates,
                     setup_optimizer)

UPDATES = 3


def _window_samples(datasets, batch_sizes, k, update):
    """The samples replica r uses in update u (iterators without shuffle)."""
    big = []
    for d, b in zip(datasets, batch_sizes):
        start = update * k * b
        big.extend(d[start:start + k * b])
    return big


def _reference(model, opt_kind, datasets, batch_sizes, k, updates):
    opt = setup_optimizer(opt_kind, model)
    losses = []
    for u in range(updates):
        batch = _window_samples(datasets, batch_sizes, k, u)
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        updater = StandardUpdater(it, opt)
        obs = run_updates(updater, model, 1)[0]
        losses.append(float(obs['main/loss'].array))
    return losses


def _ours(model, opt_kind, datasets, batch_sizes, k, updates, **kwargs):
    opt = setup_optimizer(opt_kind, model)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False)
           for d, b in zip(datasets, batch_sizes)]
    updater = ParallelAccumulatingUpdater(
        its, opt, devices=['@numpy'] * len(datasets), accumulate_steps=k, **kwargs)
    try:
        obs = run_updates(updater, model, updates)
    finally:
        updater.finalize()
    return [float(getattr(o['main/loss'], 'array', o['main/loss'])) for o in obs], obs


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize('n_devices', [1, 2, 3])
@pytest.mark.parametrize('k', [1, 3])
@pytest.mark.parametrize('opt_kind', ['sgd', 'momentum+decay', 'adam', 'clip'])
def test_matches_large_batch_reference(n_devices, k, opt_kind):
    batch_sizes = [4] * n_devices
    datasets = [dataset(4 * k * UPDATES, seed=10 + r) for r in range(n_devices)]
    ours_model, ref_model = classifier(seed=1), classifier(seed=1)
    ours_loss, _ = _ours(ours_model, opt_kind, datasets, batch_sizes, k, UPDATES)
    ref_loss = _reference(ref_model, opt_kind, datasets, batch_sizes, k, UPDATES)
    np.testing.assert_allclose(ours_loss, ref_loss, rtol=1e-5)
    _assert_same(params(ours_model), params(ref_model))
    # the updates really moved the parameters (a test that could fail)
    assert not np.allclose(params(ours_model)['/predictor/l1/W'],
                           params(classifier(seed=1))['/predictor/l1/W'])


def test_unequal_batch_sizes_are_weighted_by_samples():
    batch_sizes, k = [5, 2, 3], 2
    datasets = [dataset(b * k * UPDATES, seed=20 + r) for r, b in enumerate(batch_sizes)]
    ours_model, ref_model = classifier(seed=2), classifier(seed=2)
    ours_loss, _ = _ours(ours_model, 'momentum+decay', datasets, batch_sizes, k, UPDATES)
    ref_loss = _reference(ref_model, 'momentum+decay', datasets, batch_sizes, k, UPDATES)
    np.testing.assert_allclose(ours_loss, ref_loss, rtol=1e-5)
    _assert_same(params(ours_model), params(ref_model))


def test_short_end_of_epoch_is_weighted_by_real_counts():
    # repeat=False, 13 and 7 samples, micro-batch 4, k=2: the second update holds
    # 5 + 0 samples... each window is weighted by what it really held.
    sizes, b, k = [13, 7], 4, 2
    datasets = [dataset(n, seed=30 + r) for r, n in enumerate(sizes)]
    model, ref = classifier(seed=3), classifier(seed=3)
    opt = setup_optimizer('sgd', model)
    its = [chainer.iterators.SerialIterator(d, b, repeat=False, shuffle=False)
           for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          accumulate_steps=k)
    ref_opt = setup_optimizer('sgd', ref)
    try:
        for u in range(2):
            run_updates(updater, model, 1)
            batch = []
            for d in datasets:
                batch.extend(d[u * k * b:(u + 1) * k * b])
            it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
            run_updates(StandardUpdater(it, ref_opt), ref, 1)
            _assert_same(params(model), params(ref))
        with pytest.raises(StopIteration):
            updater.update()   # every iterator is exhausted
    finally:
        updater.finalize()


def test_lazily_initialised_model_starts_identical_everywhere():
    datasets = [dataset(4 * 2 * UPDATES, seed=40 + r) for r in range(2)]
    ours_model = classifier(seed=4, lazy=True)
    ref_model = classifier(seed=4, lazy=True)
    # the reference initialises on its first forward: give it the same initial values
    ours_opt = setup_optimizer('adam', ours_model)
    its = [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, ours_opt, devices=['@numpy'] * 2,
                                          accumulate_steps=2)
    try:
        assert ours_model.predictor.l1.W.array is None
        np.random.seed(99)
        updater._start()   # lazy init happens here, before any worker exists
        init = params(ours_model)
        ref_model(*chainer.dataset.concat_examples(datasets[0][:1]))  # initialise shapes
        for name, p in ref_model.namedparams():
            p.array[...] = init[name]
        ref_loss = _reference(ref_model, 'adam', datasets, [4, 4], 2, UPDATES)
        ours_loss = [o['main/loss'] for o in run_updates(updater, ours_model, UPDATES)]
    finally:
        updater.finalize()
    np.testing.assert_allclose(ours_loss, ref_loss, rtol=1e-5)
    _assert_same(params(ours_model), params(ref_model))


def test_batchnorm_matches_per_micro_batch_reference_and_syncs_statistics():
    """BatchNorm normalises over each micro-batch (like DDP without SyncBN); running
    statistics are averaged over replicas after every update."""
    n, k, b = 2, 2, 4
    datasets = [dataset(b * k * UPDATES, seed=50 + r) for r in range(n)]
    model = classifier(seed=5, batchnorm=True)
    ref = classifier(seed=5, batchnorm=True)
    opt = setup_optimizer('momentum+decay', model)
    ref_opt = setup_optimizer('momentum+decay', ref)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n,
                                          accumulate_steps=k)
    try:
        for u in range(UPDATES):
            run_updates(updater, model, 1)
            # reference: each replica's micro-batches through a copy, grads weighted
            # by samples, BN statistics averaged over the copies
            copies = [ref.copy(mode='copy') for _ in range(n)]
            total = n * k * b
            grads = {name: np.zeros_like(p.array) for name, p in ref.namedparams()}
            for r, c in enumerate(copies):
                c.cleargrads()
                for i in range(k):
                    x, t = chainer.dataset.concat_examples(
                        datasets[r][(u * k + i) * b:(u * k + i + 1) * b])
                    loss = c(x, t)
                    loss.backward(loss_scale=b / total)
                for name, p in c.namedparams():
                    grads[name] += p.grad
            for name, p in ref.namedparams():
                p.grad = grads[name]
            stats = [persistents(c) for c in copies]
            ref_opt.update()
            for path, value in persistents(ref).items():
                link = dict(ref.namedlinks())[path.rsplit('/', 1)[0]]
                link.__dict__[path.rsplit('/', 1)[1]][...] = np.mean(
                    [s[path] for s in stats], axis=0)
            _assert_same(params(model), params(ref))
            _assert_same(persistents(model), persistents(ref))
        # and the worker holds the same statistics as the master: ask it via a snapshot
        assert updater.worker_pids()
    finally:
        updater.finalize()


def test_reported_values_are_sample_weighted_over_all_replicas():
    batch_sizes, k = [3, 5], 2
    datasets = [dataset(b * k * UPDATES, seed=60 + r) for r, b in enumerate(batch_sizes)]
    ours_model, ref_model = classifier(seed=6), classifier(seed=6)
    _, obs = _ours(ours_model, 'sgd', datasets, batch_sizes, k, UPDATES, report_times=True)
    ref_opt = setup_optimizer('sgd', ref_model)
    for u in range(UPDATES):
        batch = _window_samples(datasets, batch_sizes, k, u)
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        ref_obs = run_updates(StandardUpdater(it, ref_opt), ref_model, 1)[0]
        assert obs[u]['main/loss'] == pytest.approx(float(ref_obs['main/loss'].array), rel=1e-5)
        assert obs[u]['main/accuracy'] == pytest.approx(
            float(ref_obs['main/accuracy'].array), rel=1e-5)
        for key in ('data', 'compute', 'comm', 'update'):
            assert obs[u][f'main/time/{key}'] >= 0.0


def test_the_users_optimizer_is_not_modified():
    datasets = [dataset(24, seed=70 + r) for r in range(2)]
    model = classifier(seed=7)
    opt = setup_optimizer('adam', model)
    before = dict(opt.hyperparam.get_dict())
    its = [chainer.iterators.SerialIterator(d, 4) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy', '@numpy'],
                                          accumulate_steps=3)
    try:
        run_updates(updater, model, 2)
    finally:
        updater.finalize()
    assert opt.hyperparam.get_dict() == before
    assert opt.t == 2   # one optimizer step per update, not per micro-batch

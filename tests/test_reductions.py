"""``loss_reduction`` and ``replica_reduction``: exact against Chainer's own updaters.

* ``loss_reduction='sum'`` (a loss summed over the batch, as word2vec's hierarchical
  softmax): N devices x k steps x b == ``StandardUpdater`` on the global batch of N*k*b with
  the same summed loss, gradient and reported loss alike.
* ``replica_reduction='sum'``: the trajectory of ``ParallelUpdater`` (which sums the
  devices' gradients), optimizer hooks included.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer.training.updaters import ParallelUpdater, StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _dropin_models import SumLoss, seeded
from _models import classifier, dataset, params, run_updates, setup_optimizer

UPDATES = 3


def _shards(n, b, k, updates=UPDATES, seed=70):
    return [dataset(b * k * updates, seed=seed + r) for r in range(n)]


def _global_batch(datasets, b, k, u):
    batch = []
    for d in datasets:
        batch.extend(d[u * k * b:(u + 1) * k * b])
    return batch


def _ours(model, opt_kind, datasets, b, k, updates=UPDATES, repeat=True, **kwargs):
    opt = setup_optimizer(opt_kind, model)
    its = [chainer.iterators.SerialIterator(d, b, repeat=repeat, shuffle=False)
           for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * len(datasets),
                                          accumulate_steps=k, **kwargs)
    try:
        return run_updates(updater, model, updates)
    finally:
        updater.finalize()


def _standard(model, opt_kind, batches):
    opt = setup_optimizer(opt_kind, model)
    out = []
    for batch in batches:
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        out.append(run_updates(StandardUpdater(it, opt), model, 1)[0])
    return out


def _assert_params(ours, ref, rtol=1e-5, atol=1e-6):
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=rtol, atol=atol,
                                   err_msg=name)


# ---------------------------------------------------------------------- loss_reduction
@pytest.mark.parametrize('n,k,opt_kind', [(1, 3, 'clip'), (2, 1, 'sgd'), (2, 2, 'clip')])
def test_sum_loss_matches_standard_updater_on_the_global_batch(n, k, opt_kind):
    b = 4
    datasets = _shards(n, b, k)
    ours, ref = seeded(SumLoss, 1), seeded(SumLoss, 1)
    ours_obs = _ours(ours, opt_kind, datasets, b, k, loss_reduction='sum')
    ref_obs = _standard(ref, opt_kind, [_global_batch(datasets, b, k, u)
                                        for u in range(UPDATES)])
    _assert_params(ours, ref)
    # main/loss is the loss summed over the update's samples, as StandardUpdater reports
    # it on the global batch; main/accuracy (not the loss) stays the mean.
    for key in ('main/loss', 'main/accuracy'):
        np.testing.assert_allclose([o[key] for o in ours_obs],
                                   [float(o[key].array) for o in ref_obs], rtol=1e-5,
                                   err_msg=key)


@pytest.mark.slow
def test_sum_loss_under_the_default_mean_gets_one_over_n_k_of_the_step():
    """Why the option exists: the default scales a summed loss by b/W."""
    n, k, b = 2, 2, 4
    datasets = _shards(n, b, k, updates=1)
    start = seeded(SumLoss, 2)
    mean, total = seeded(SumLoss, 2), seeded(SumLoss, 2)
    _ours(mean, 'sgd', datasets, b, k, updates=1)
    _ours(total, 'sgd', datasets, b, k, updates=1, loss_reduction='sum')
    for name, p0 in params(start).items():
        np.testing.assert_allclose(params(mean)[name] - p0,
                                   (params(total)[name] - p0) / (n * k), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


def test_sum_loss_short_end_of_epoch_is_the_sum_of_what_it_held():
    sizes, b, k = [13, 7], 4, 2
    datasets = [dataset(s, seed=80 + r) for r, s in enumerate(sizes)]
    ours, ref = seeded(SumLoss, 3), seeded(SumLoss, 3)
    ours_obs = _ours(ours, 'momentum+decay', datasets, b, k, updates=2, repeat=False,
                     loss_reduction='sum')
    ref_obs = _standard(ref, 'momentum+decay',
                        [_global_batch(datasets, b, k, u) for u in range(2)])
    _assert_params(ours, ref)
    np.testing.assert_allclose([o['main/loss'] for o in ours_obs],
                               [float(o['main/loss'].array) for o in ref_obs], rtol=1e-5)


# ---------------------------------------------------------------------- replica_reduction
def _parallel_updater(model, opt_kind, datasets, b, k, updates=UPDATES):
    """ParallelUpdater on two '@numpy' devices, fed so that device r's half of each batch
    (``batch[r::2]``) is exactly replica r's window in ours."""
    opt = setup_optimizer(opt_kind, model)
    interleaved = []
    for u in range(updates):
        for i in range(u * k * b, (u + 1) * k * b):
            interleaved.extend([datasets[0][i], datasets[1][i]])
    it = chainer.iterators.SerialIterator(interleaved, 2 * k * b, shuffle=False)
    updater = ParallelUpdater(it, opt, devices={'main': '@numpy', 'second': '@numpy'})
    out = []
    for _ in range(updates):
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        reporter.add_observer('second', updater._models['second'])
        obs = {}
        with reporter.scope(obs):
            updater.update()
        out.append(obs)
    return out


@pytest.mark.parametrize('k,opt_kind', [(1, 'momentum+decay'), (2, 'clip'), (2, 'sgd')])
def test_replica_sum_follows_parallel_updater_trajectory(k, opt_kind):
    b = 4
    datasets = _shards(2, b, k)
    ours, ref = classifier(seed=4), classifier(seed=4)
    ours_obs = _ours(ours, opt_kind, datasets, b, k, replica_reduction='sum')
    ref_obs = _parallel_updater(ref, opt_kind, datasets, b, k)
    _assert_params(ours, ref)
    # reported: the mean over every device's samples (ParallelUpdater reports each
    # device under its own name; with equal shares their mean is ours)
    np.testing.assert_allclose(
        [o['main/loss'] for o in ours_obs],
        [(float(o['main/loss'].array) + float(o['second/loss'].array)) / 2
         for o in ref_obs], rtol=1e-5)


@pytest.mark.slow
def test_replica_sum_is_n_times_the_default_step():
    b, k = 4, 2
    datasets = _shards(2, b, k, updates=1)
    start = classifier(seed=5)
    mean, total = classifier(seed=5), classifier(seed=5)
    _ours(mean, 'sgd', datasets, b, k, updates=1)
    _ours(total, 'sgd', datasets, b, k, updates=1, replica_reduction='sum')
    for name, p0 in params(start).items():
        np.testing.assert_allclose(params(total)[name] - p0, 2.0 * (params(mean)[name] - p0),
                                   rtol=1e-4, atol=1e-6, err_msg=name)


def test_replica_sum_short_windows_sum_the_mean_of_what_each_replica_held():
    """repeat=False, 13 and 7 samples, b=4, k=2: update 1 holds 8 and 7 samples, update 2
    holds 5 and none; each replica contributes the gradient of the mean over its window."""
    sizes, b, k = [13, 7], 4, 2
    datasets = [dataset(s, seed=90 + r) for r, s in enumerate(sizes)]
    ours, ref = classifier(seed=6), classifier(seed=6)
    _ours(ours, 'clip', datasets, b, k, updates=2, repeat=False, replica_reduction='sum')
    opt = setup_optimizer('clip', ref)
    for u in range(2):
        total = {name: 0 for name, _ in ref.namedparams()}
        for d in datasets:
            window = d[u * k * b:(u + 1) * k * b]
            if not len(window):
                continue
            ref.cleargrads()
            ref(*chainer.dataset.concat_examples(window)).backward()
            for name, p in ref.namedparams():
                total[name] = total[name] + p.grad
        for name, p in ref.namedparams():
            p.grad = total[name]
        opt.update()
    _assert_params(ours, ref)


def _one_device_short_pass(model, **kwargs):
    """Updates over 7 samples in batches of 3, 3 and 1 (repeat=False) on one device; plain
    SGD (a clipping hook would hide a gradient's scale)."""
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(7, seed=91), 3, repeat=False,
                                          shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], **kwargs)
    try:
        run_updates(updater, model, 3)
    finally:
        updater.finalize()


def test_replica_sum_on_one_device_steps_a_short_last_batch_as_standard_updater():
    """One device, one micro-batch a window (the direct window): under 'sum' the window's
    gradient is that of its mean loss, also for the short last batch of a pass, as under
    StandardUpdater (it stepped 1/3 of that on 1 sample of 3)."""
    ours, ref = classifier(seed=7), classifier(seed=7)
    _one_device_short_pass(ours, replica_reduction='sum')
    data = dataset(7, seed=91)
    _standard(ref, 'sgd', [data[0:3], data[3:6], data[6:7]])
    _assert_params(ours, ref)


def test_replica_sum_on_one_device_pipelined_steps_a_short_batch_as_the_mean():
    """pipelined=True on one device (the same direct window): the short last batch's
    gradient, in flight at the end of the data, steps at the next pass's first update,
    and 'sum' steps it as 'mean' does (0.063 apart before)."""
    out = []
    for reduction in ('sum', 'mean'):
        model = classifier(seed=7)
        it = chainer.iterators.SerialIterator(dataset(7, seed=91), 3, repeat=False,
                                              shuffle=False)
        updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                              devices=['@numpy'], pipelined=True,
                                              replica_reduction=reduction)
        try:
            for _ in range(2):   # two passes: 3 updates and a StopIteration each
                run_updates(updater, model, 3)
                with pytest.raises(StopIteration):
                    updater.update()
                it.reset()
        finally:
            updater.finalize()
        out.append(model)
    _assert_params(*out, rtol=1e-6, atol=1e-7)


def _multiprocess_parallel_updater(model, opt, datasets, b, updates=UPDATES):
    """What MultiprocessParallelUpdater.update_core computes (it needs CUDA and NCCL):
    every device's mean loss on its own batch, backward, the gradients summed (NCCL_SUM),
    one step of the optimizer that its constructor changed in place."""
    for u in range(updates):
        total = {name: 0 for name, _ in model.namedparams()}
        for d in datasets:
            model.cleargrads()
            model(*chainer.dataset.concat_examples(d[u * b:(u + 1) * b])).backward()
            for name, p in model.namedparams():
                total[name] = total[name] + p.grad
        for name, p in model.namedparams():
            p.grad = total[name]
        opt.update()


@pytest.mark.parametrize('kind', ['momentum+decay', 'clip', 'adam'])
def test_multiprocess_parallel_updater_dynamics(kind):
    """README's recipe: replica_reduction='sum' plus the optimizer change it made itself
    (lr / N, or eps * N for Adam) is exact, hooks included; without hooks, the default
    'mean' with the original optimizer is the same update."""
    n, b = 2, 4
    datasets = _shards(n, b, 1)
    ref = classifier(seed=9)
    ref_opt = setup_optimizer(kind, ref)
    if kind == 'adam':
        ref_opt.eps *= n
    else:
        ref_opt.lr /= n
    _multiprocess_parallel_updater(ref, ref_opt, datasets, b)
    ours = classifier(seed=9)
    if kind == 'adam':   # no hooks: the default mean with the original eps
        _ours(ours, kind, datasets, b, 1)
    else:
        opt = setup_optimizer(kind, ours)
        opt.lr /= n
        its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
        updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n,
                                              replica_reduction='sum')
        try:
            run_updates(updater, ours, UPDATES)
        finally:
            updater.finalize()
    _assert_params(ours, ref, rtol=1e-4, atol=1e-6)


def test_replica_sum_with_sum_loss_is_the_global_sum():
    n, k, b = 2, 2, 4
    datasets = _shards(n, b, k)
    ours, ref = seeded(SumLoss, 7), seeded(SumLoss, 7)
    _ours(ours, 'momentum+decay', datasets, b, k, loss_reduction='sum',
          replica_reduction='sum')
    _standard(ref, 'momentum+decay', [_global_batch(datasets, b, k, u)
                                      for u in range(UPDATES)])
    _assert_params(ours, ref)


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize('name', ['loss_reduction', 'replica_reduction'])
@pytest.mark.parametrize('value,shown', [('avg', "'avg'"), (None, 'None of type NoneType'),
                                         ('Sum', "'Sum'")])
def test_bad_reduction_is_refused_at_construction(name, value, shown):
    model = classifier()
    it = chainer.iterators.SerialIterator(dataset(8, seed=0), 4)
    with pytest.raises(ValueError, match=rf"{name} must be 'mean' or 'sum' \({shown} given\); "
                                         r"pass 'mean' .*'sum'"):
        ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model), devices=['@numpy'],
                                    **{name: value})


def test_combine_weights_every_key_by_the_samples_that_reported_it():
    """The master's combining of the replicas' reported values: each key's sums over
    every replica that reported it, divided by the samples that did (a key one replica
    did not report, a key with no samples), and summed where a replica marked it so,
    added up in rank order as a plain sum would (bitwise)."""
    import itertools
    from mgpu_updater._replica import WindowResult, combine

    def result(sums, weights, summed=()):
        return WindowResult(8, 0.0, sums, weights, {}, [], tuple(summed))

    results = [
        result({'main/loss': 0.1, 'main/acc': 0.7, 'only0': 3.0, 'never': 0.0},
               {'main/loss': 8.0, 'main/acc': 8.0, 'only0': 2.0, 'never': 0.0},
               summed=('main/loss',)),
        result({'main/loss': 0.2, 'main/acc': 0.3, 'only1': 5.0},
               {'main/loss': 8.0, 'main/acc': 4.0, 'only1': 4.0}),
        result({'main/loss': 1e-17, 'main/acc': 0.1},
               {'main/loss': 8.0, 'main/acc': 8.0}, summed=('main/loss',)),
    ]
    out = combine(results)
    assert out == {'main/loss': (0.0 + 0.1 + 0.2) + 1e-17,
                   'main/acc': ((0.0 + 0.7) + 0.3 + 0.1) / (8.0 + 4.0 + 8.0),
                   'only0': 3.0 / 2.0, 'only1': 5.0 / 4.0}
    for order in itertools.permutations(results[1:]):
        assert set(combine([results[0], *order])) == set(out)
    assert combine(results[:1]) == {'main/loss': 0.1, 'main/acc': 0.7 / 8.0,
                                    'only0': 3.0 / 2.0}

"""Tied parameters train as under StandardUpdater, with the defaults.

A :class:`chainer.Parameter` registered in two links (``self.l3.W = self.l2.W``), one used
twice in forward (an embedding matrix as the output layer), one shared with a model
that is not trained, and parameters of their own over one array (Chainer's
``repeat(n, mode='share')``, whose update rules step the array in turn; or a view of
it; or both): two ``'@numpy'`` replicas, each update compared with a single-process
``StandardUpdater`` on one batch of the same samples (the contract of
``tests/test_equivalence.py``).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._flat_buffers import ModelLayouts

from _models import (MLP, FlatStorage, SameArrayThenView, SharedCopies, ShareThenView,
                     TiedEmbedding, TiedMLP, ViewTied, dataset, params, run_updates,
                     setup_optimizer)

UPDATES, N, B = 4, 2, 4


def _tokens(n, seed, n_vocab=7, length=3):
    rng = np.random.RandomState(seed)
    x = rng.randint(0, n_vocab, (n, length)).astype(np.int32)
    t = rng.randint(0, n_vocab, n).astype(np.int32)
    return chainer.datasets.TupleDataset(x, t)


def _make(kind, seed):
    np.random.seed(seed)
    if kind == 'tied_links':
        return L.Classifier(TiedMLP())
    if kind == 'tied_embedding':
        return L.Classifier(TiedEmbedding())
    if kind == 'view_of_another':
        return L.Classifier(ViewTied())
    if kind == 'share_then_view':
        return L.Classifier(ShareThenView())
    if kind == 'same_array_then_view':
        return L.Classifier(SameArrayThenView())
    if kind == 'flat_storage':
        return L.Classifier(FlatStorage())
    if kind == 'shared_arrays':
        # a deep copy, as a worker's replica is: Chainer's share mode leaves the copies
        # one Variable storage (setting one's array sets all); a copy keeps only the array
        return copy.deepcopy(L.Classifier(SharedCopies()))
    raise ValueError(kind)


def _data(kind, r):
    n = B * UPDATES
    return _tokens(n, 30 + r) if kind == 'tied_embedding' else dataset(n, seed=30 + r)


def _train_both(kind, opt_kind):
    datasets = [_data(kind, r) for r in range(N)]
    ours, ref = _make(kind, 7), _make(kind, 7)
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in datasets],
        setup_optimizer(opt_kind, ours), devices=['@numpy'] * N)
    try:
        run_updates(updater, ours, UPDATES)
    finally:
        updater.finalize()
    ref_opt = setup_optimizer(opt_kind, ref)
    for u in range(UPDATES):
        batch = [d[i] for d in datasets for i in range(u * B, (u + 1) * B)]
        run_updates(StandardUpdater(
            chainer.iterators.SerialIterator(batch, len(batch), shuffle=False), ref_opt),
            ref, 1)
    return ours, ref


@pytest.mark.parametrize('kind', ['tied_links', 'tied_embedding', 'shared_arrays',
                                  'view_of_another', 'share_then_view',
                                  'same_array_then_view'])
@pytest.mark.parametrize('opt_kind', ['sgd', 'adam'])
def test_tied_parameters_train_as_under_standard_updater(kind, opt_kind):
    ours, ref = _train_both(kind, opt_kind)
    start = params(_make(kind, 7))
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        assert not np.allclose(value, start[name]), f'{name} did not move'
    if kind == 'tied_links':   # still one parameter after training
        assert ours.predictor.l3.W is ours.predictor.l2.W
    if kind == 'shared_arrays':   # still one array after training and finalize
        blocks = ours.predictor.mid
        assert blocks[1][0].W.array is blocks[0][0].W.array is blocks[2][0].W.array
    if kind == 'view_of_another':   # still one memory
        assert np.shares_memory(ours.predictor.l1.W.array, ours.predictor.l2.W.array)
    if kind == 'share_then_view':   # one array, and a view of it
        net = ours.predictor
        assert net.b.W.array is net.a.W.array
        assert np.shares_memory(net.a.W.array, net.c.W.array)
    if kind == 'same_array_then_view':
        net = ours.predictor
        assert net.l2.W.array is net.l1.W.array
        assert np.shares_memory(net.l1.W.array, net.l3.W.array)


@pytest.mark.parametrize('opt_kind', ['sgd', 'adam'])
def test_a_flat_array_the_parameters_are_views_of_follows_them(opt_kind):
    """Parameters that are views of one flat array a link keeps in a plain attribute stay
    its views on the master, so the array follows the training as under StandardUpdater
    (bound to the broadcast slot, the parameters left it behind at its initial values).
    A worker's replica has its own copy of the array, which no update sends: it is named
    in a warning at the second update."""
    with pytest.warns(RuntimeWarning, match=r'model\.predictor\.flat'):
        ours, ref = _train_both('flat_storage', opt_kind)
    net, ref_net = ours.predictor, ref.predictor
    np.testing.assert_allclose(net.flat, ref_net.flat, rtol=1e-5, atol=1e-6)
    assert not np.allclose(net.flat, _make('flat_storage', 7).predictor.flat)
    for layer in (net.l1, net.out):
        assert np.shares_memory(net.flat, layer.W.array)


def test_a_tied_parameter_travels_once():
    """The flat buffers hold a parameter once however many links register it (under its
    first name), so a replica's gradient for it is summed once."""
    model = L.Classifier(TiedMLP())
    layouts = ModelLayouts(model)
    names = [e.name for group in layouts.grad.groups.values() for e in group]
    assert '/predictor/l2/W' in names and '/predictor/l3/W' not in names
    assert len(names) == len({id(p) for p in model.params()})


def test_parameters_over_one_array_share_its_slot():
    """Parameters of their own that hold one array travel as that array, once; each
    keeps its gradient."""
    model = copy.deepcopy(L.Classifier(SharedCopies()))
    layouts = ModelLayouts(model)
    state = {e.name for group in layouts.state.groups.values() for e in group}
    grads = {e.name for group in layouts.grad.groups.values() for e in group}
    assert '/predictor/mid/0/0/W' in state and '/predictor/mid/1/0/W' not in state
    assert layouts.index.aliases['/predictor/mid/2/0/W'] == '/predictor/mid/0/0/W'
    assert {'/predictor/mid/0/0/W', '/predictor/mid/1/0/W'} <= grads


def test_a_parameter_shared_with_another_model_is_its_trained_array_after_finalize():
    """A link shared with a model that is not trained sees the trained values, as under
    StandardUpdater, and keeps its own array after ``finalize`` (no view of a released
    buffer)."""
    np.random.seed(3)
    model = L.Classifier(MLP())
    other = chainer.Sequential(model.predictor.l1)   # shares l1's W and b
    datasets = [dataset(B * UPDATES, seed=40 + r) for r in range(N)]
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in datasets],
        setup_optimizer('sgd', model), devices=['@numpy'] * N)
    before = other[0].W.array.copy()
    try:
        run_updates(updater, model, UPDATES)
    finally:
        updater.finalize()
    assert other[0].W is model.predictor.l1.W
    assert not np.allclose(other[0].W.array, before)
    assert other[0].W.array.base is None or other[0].W.array.flags.owndata \
        or isinstance(other[0].W.array.base, np.ndarray) and other[0].W.array.base.flags.owndata
    x = np.ones((2, 5), np.float32)
    np.testing.assert_allclose(other(x).array, model.predictor.l1(x).array)


@pytest.mark.parametrize('replica_reduction', ['mean', 'sum'])
def test_a_short_update_scales_a_tied_gradient_once(replica_reduction):
    """The last update of an epoch (``repeat=False``) holds fewer samples than nominal:
    its factor (the window's under ``replica_reduction='sum'``, the update's under
    ``'mean'``) scales a tied parameter's gradient once, as any other."""
    k, sizes = 2, [12, 10]   # the last update: windows of 4 and 2 samples out of 8
    datasets = [dataset(n, seed=50 + r) for r, n in enumerate(sizes)]
    ours, ref = _make('tied_links', 9), _make('tied_links', 9)
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, B, repeat=False, shuffle=False)
         for d in datasets],
        setup_optimizer('sgd', ours), devices=['@numpy'] * N, accumulate_steps=k,
        replica_reduction=replica_reduction)
    try:
        run_updates(updater, ours, 2)
    finally:
        updater.finalize()
    ref_opt = setup_optimizer('sgd', ref)
    for u in range(2):
        windows = [d[u * k * B:(u + 1) * k * B] for d in datasets]
        if replica_reduction == 'mean':   # one batch of the update's samples
            batch = [s for w in windows for s in w]
            run_updates(StandardUpdater(chainer.iterators.SerialIterator(
                batch, len(batch), shuffle=False), ref_opt), ref, 1)
        else:   # ParallelUpdater's sum: each window's mean-loss gradient, summed
            ref.cleargrads()
            for w in windows:
                x, t = chainer.dataset.concat_examples(w)
                ref(x, t).backward()
            ref_opt.update()
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)

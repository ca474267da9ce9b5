"""A replica's window leaves exactly its own micro-batches' gradient, cleared in Chainer's
order: after the window's first forward, before its first backward (``Optimizer.update``:
``loss = lossfun(...)``, then ``cleargrads()``, then ``backward``), never before the
forward; a window that got no micro-batch leaves no gradient at all."""
from __future__ import annotations

import copy

import numpy as np

import chainer

from mgpu_updater._loader import make_loader
from mgpu_updater._replica import Replica, Scaling

import _models


class _Recording:
    """The model as loss_func, noting at each call whether the model holds gradients."""

    def __init__(self, model):
        self.model = model
        self.had_grads = []

    def __call__(self, x, t):
        self.had_grads.append(any(p.grad is not None for p in self.model.params()))
        return self.model(x, t)


def _replica(model, dataset, k, repeat=True):
    it = chainer.iterators.SerialIterator(dataset, 4, repeat=repeat, shuffle=False)
    loader = make_loader(it, chainer.dataset.concat_examples, chainer.get_device('@numpy'), 0)
    loss = _Recording(model)
    replica = Replica(model, loss, loader, accumulate_steps=k,
                      scaling=Scaling('mean', 'mean', update_norm=4.0 * k,
                                      window_norm=4.0 * k))
    return replica, loss


def _grads(model):
    return {name: None if p.grad is None else p.grad.copy()
            for name, p in model.namedparams()}


def test_each_window_holds_its_own_gradient_cleared_after_the_first_forward():
    data = _models.dataset(32, seed=4)
    model = _models.classifier(seed=2)
    reference = copy.deepcopy(model)
    replica, loss = _replica(model, data, k=2)
    with chainer.using_config('train', True):
        for window in range(3):
            replica.run_window(None)
            # the same two micro-batches from fresh gradients, by hand
            reference.cleargrads()
            for i in range(2):
                start = (window * 2 + i) * 4
                x, t = chainer.dataset.concat_examples(data[start:start + 4])
                (reference(x, t) / 2).backward()
            got, want = _grads(model), _grads(reference)
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7,
                                           err_msg=name)
    # the first forward of windows 1 and 2 still sees the last window's gradient (cleared
    # only after it, as Chainer's Optimizer.update does), and their second this window's
    assert len(loss.had_grads) == 6
    assert loss.had_grads[2::2] == [True, True] and all(loss.had_grads[1::2])


def test_a_window_without_micro_batches_leaves_no_gradient():
    model = _models.classifier(seed=2)
    replica, loss = _replica(model, _models.dataset(8, seed=4), k=2, repeat=False)
    with chainer.using_config('train', True):
        first = replica.run_window(None)
        assert first.count == 8 and all(p.grad is not None for p in model.params())
        empty = replica.run_window(None)   # the iterator is exhausted
    assert empty.count == 0
    assert all(p.grad is None for p in model.params())
    assert len(loss.had_grads) == 2   # no forward ran in the empty window

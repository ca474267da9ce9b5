"""What the first update checks, so that nothing trains wrong without a word.

- A model that creates a link inside ``forward`` (in ``init_scope``, on the first call)
  would give each replica its own initial values for it, and no collective carries it:
  with several replicas the first update raises, naming the replica and the parameters.
  One replica trains it as ``StandardUpdater`` does.
- ``loss_func`` must return a floating-point Variable of one element: anything else is a
  TypeError naming the function and saying what it returned.
- A reported value that is no number (a string) names its key.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from mgpu_updater import ParallelAccumulatingUpdater

from _models import GrowsInForward, classifier, dataset, run_updates, setup_optimizer


def _updater(model, n=2, **kwargs):
    its = [chainer.iterators.SerialIterator(dataset(16, seed=r), 4, shuffle=False)
           for r in range(n)]
    return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                       devices=['@numpy'] * n, **kwargs)


def test_a_link_created_in_forward_is_refused_at_the_first_update():
    model = L.Classifier(GrowsInForward())
    updater = _updater(model)
    try:
        with pytest.raises(RuntimeError, match=r"^replica \d \(@numpy\): its model changed "
                           r"during its first update \(new \['/predictor/extra/W', "
                           r"'/predictor/extra/b'\]\)\. A link created inside forward") as e:
            run_updates(updater, model, 1)
        assert "give it as None" in str(e.value)
    finally:
        updater.finalize()
    assert updater.worker_pids() == []


def test_one_replica_trains_a_link_created_in_forward_as_standard_updater_does():
    np.random.seed(0)
    model = L.Classifier(GrowsInForward())
    updater = _updater(model, n=1)
    try:
        run_updates(updater, model, 2)
    finally:
        updater.finalize()
    assert model.predictor.extra.W.array is not None


class _Returns:
    def __init__(self, model, what):
        self.model, self.what = model, what

    def __call__(self, x, t):
        loss = self.model(x, t)
        if self.what == 'none':
            return None
        if self.what == 'float':
            return float(loss.array)
        if self.what == 'vector':
            return F.stack([loss, loss])
        if self.what == 'int':
            return chainer.Variable(np.array(3, np.int32))
        raise ValueError(self.what)


@pytest.mark.parametrize('what, said', [
    ('none', r'returned NoneType None, not a chainer\.Variable'),
    ('float', r'returned float [0-9.]+, not a chainer\.Variable'),
    ('vector', r'returned a Variable of shape \(2,\), not one value'),
    ('int', r'returned a Variable of dtype int32: a loss must be floating point'),
])
def test_a_loss_func_that_returns_no_scalar_loss_is_named(what, said):
    model = classifier(seed=0)
    updater = _updater(model, n=1, loss_func=_Returns(model, what))
    try:
        with pytest.raises(TypeError, match=r'^replica 0 \(@numpy\): loss_func '
                                            r'\(_Returns\) ' + said):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


class _ReportsText(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed=0)

    def forward(self, x, t):
        loss = self.inner(x, t)
        chainer.report({'phase': 'training'}, self)
        return loss


def test_a_reported_string_names_its_key():
    """(One replica with one micro-batch per update reports as StandardUpdater does, as
    they come; with a mean to take, over micro-batches or replicas, a string is named.)"""
    model = _ReportsText()
    updater = _updater(model, n=1, accumulate_steps=2)
    try:
        with pytest.raises(TypeError, match=r"^replica 0 \(@numpy\): 'main/phase' was "
                                            r"reported as str 'training', which cannot be "
                                            r"averaged"):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()

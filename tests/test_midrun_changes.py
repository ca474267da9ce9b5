"""What code between updates (a Trainer extension) changes: taken as under StandardUpdater,
or refused at the next update, naming the change; never a silent difference.

StandardUpdater reads its model, converter, loss_func and iterator at every update. Here
each worker process holds copies made at the start, and the master's buffers hold the
parameter objects it started with: a parameter object replaced (``link.W =
chainer.Parameter(...)``, a child link built anew, then ``optimizer.setup``), a worker's
iterator given another dataset or batch size, or ``updater.converter`` /
``updater.loss_func`` set anew would leave the replicas computing apart: refused at the
next update after ``optimizer.setup`` (which a replaced parameter needs to be trained),
and at each look of the watch (``_unsent_state``: updates 2 and 3, then every 10 s); a
converter or loss_func set anew at the next update. New values given
to the parameters the model has are carried as every update's are
(``tests/test_buffer_views.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, _unsent_state, shard_iterators

from _models import (GrowsPersistent, classifier, dataset, params, run_updates,
                     setup_optimizer)

B = 4


def _updater(model, n, **kwargs):
    its = shard_iterators(dataset(8 * B * n, seed=1), n, B, seed=None, shuffle=False)
    return its, ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                            devices=['@numpy'] * n, **kwargs)


def _replace_weight(model):
    with model.predictor.l1.init_scope():
        model.predictor.l1.W = chainer.Parameter(np.full((16, 5), 0.05, np.float32))


def _replace_head(model):
    del model.predictor.l2
    with model.predictor.init_scope():
        model.predictor.l2 = L.Linear(16, 3)


def _add_link(model):
    with model.predictor.init_scope():
        model.predictor.extra = L.Linear(3, 3)


@pytest.mark.parametrize('change, named', [
    (_replace_weight, r'replaced by new Parameter objects: /predictor/l1/W\)'),
    (_replace_head, r'replaced by new Parameter objects: /predictor/l2/W, /predictor/l2/b\)'),
    (_add_link, r'added: /predictor/extra/W, /predictor/extra/b\)'),
])
def test_a_parameter_object_replaced_or_added_raises_at_the_next_update(change, named):
    model = classifier()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 2)
        change(model)
        updater.get_optimizer('main').setup(model)
        with pytest.raises(RuntimeError, match=r"^parameters of the master's model changed "
                                               r'between updates \(' + named +
                                               r'\. The worker processes.*model\.copyparams'):
            run_updates(updater, model, 1)
        assert updater.iteration == 2
    finally:
        updater.finalize()


def test_a_parameter_replaced_without_optimizer_setup_raises_at_the_next_look(monkeypatch):
    """The parameters are walked every update only where the optimizer's count moved
    otherwise than by the step (optimizer.setup), else at each look of the watch (here
    every update)."""
    monkeypatch.setattr(_unsent_state, 'INTERVAL', 0.0)
    monkeypatch.setattr(_unsent_state, 'COST_SHARE', 1e9)
    model = classifier()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 4)
        _replace_weight(model)
        with pytest.raises(RuntimeError, match=r"^parameters of the master's model changed "
                                               r'between updates \(replaced by new '
                                               r'Parameter objects: /predictor/l1/W\)'):
            run_updates(updater, model, 2)
    finally:
        updater.finalize()


def test_one_replica_trains_a_replaced_parameter_as_standard_updater():
    """No worker holds a copy: the new parameter trains, as under StandardUpdater."""
    ours, ref = classifier(), classifier()
    _, updater = _updater(ours, 1)
    standard = StandardUpdater(
        chainer.iterators.SerialIterator(dataset(8 * B, seed=1), B, shuffle=False),
        setup_optimizer('sgd', ref))
    try:
        for model, upd in ((ours, updater), (ref, standard)):
            run_updates(upd, model, 2)
            _replace_weight(model)
            upd.get_optimizer('main').setup(model)
            run_updates(upd, model, 2)
    finally:
        updater.finalize()
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-6, err_msg=name)
    assert not np.allclose(params(ours)['/predictor/l1/W'], 0.05)   # it trained


@pytest.mark.parametrize('change, named', [
    (lambda its: setattr(its[1], 'batch_size', 2),
     r'^the batch_size of iterator 1 \(4 -> 2\) changed between updates'),
    (lambda its: setattr(its[1], 'dataset', dataset(8, seed=9)),
     r'^the dataset of iterator 1 changed between updates'),
])
def test_a_workers_iterator_changed_raises_at_the_next_look(change, named):
    """The user holds the worker's iterator object; its process reads a copy. (The first
    looks are at updates 2 and 3.)"""
    model = classifier()
    its, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 1)
        change(its)
        with pytest.raises(RuntimeError, match=named + r'\. Replica i > 0 reads its own copy'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_the_main_iterators_batch_size_changed_is_read_by_the_master():
    """The master reads the main iterator itself: the update is StandardUpdater's on the
    samples each replica read."""
    model = classifier()
    its, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 1)
        its[0].batch_size = 2
        run_updates(updater, model, 1)
        assert updater.last_replica_times and updater.iteration == 2
    finally:
        updater.finalize()


class _Converter:
    def __call__(self, batch, device=None):
        return chainer.dataset.concat_examples(batch, device)


@pytest.mark.parametrize('n', [1, 2])
@pytest.mark.parametrize('attribute', ['converter', 'loss_func'])
def test_the_updaters_converter_or_loss_func_set_anew_raises_at_the_next_update(n, attribute):
    model = classifier()
    _, updater = _updater(model, n)
    try:
        run_updates(updater, model, 1)
        setattr(updater, attribute, _Converter() if attribute == 'converter' else model)
        with pytest.raises(RuntimeError, match=r'^updater\.' + attribute + r' was set anew '
                                               r'after the first update'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_a_persistent_the_forward_grows_at_a_later_update_raises_naming_it():
    """A memory bank the forward grows at its third call: the slot that carries it
    between the replicas keeps its first shape. The error names it and its shapes, where
    numpy's said 'operands could not be broadcast together with shapes (10,) () (5,)'."""
    model = L.Classifier(GrowsPersistent(at_call=3))
    _, updater = _updater(model, 2)
    try:
        with pytest.raises(RuntimeError) as e:
            run_updates(updater, model, 4)
        assert ("/predictor/queue (1, 5) -> (2, 5) changed shape during training"
                in str(e.value)), str(e.value)
        assert 'full shape from the start' in str(e.value)
    finally:
        updater.finalize()
    assert updater.worker_pids() == []

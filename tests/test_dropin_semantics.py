"""A ``loss_func`` that computes with the model runs on each replica's own copy.

Chainer's scripts pass the model itself (the VAE example), a link inside it, a method of
one, or a closure over the model (``model.get_loss_func()``). Every form must train exactly
as ``StandardUpdater`` on the global batch; a form that cannot be re-bound must fail with
a clear error instead of reducing zeros.
"""
from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError
from mgpu_updater import _loss_binding, _startup
from mgpu_updater._local.worker import unpickle_payload

import _dropin_models
from _dropin_models import (HoldsAModel, HoldsAReportingModel, Outer, SelfLoss, loss_of,
                            seeded)
from _models import MLP, StaticLazyClassifier, dataset, params, setup_optimizer

N, K, B, UPDATES = 2, 2, 4, 2


def _datasets():
    return [dataset(B * K * UPDATES, seed=60 + r) for r in range(N)]


def run_updates(updater, model, n):
    """Run n updates with the model's links named as the Trainer names them."""
    observations = []
    for _ in range(n):
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        reporter.add_observers('main', model.namedlinks(skipself=True))
        obs = {}
        with reporter.scope(obs):
            updater.update()
        observations.append(obs)
    return observations


def _reference(model, make_loss, datasets):
    opt = setup_optimizer('momentum+decay', model)
    losses = []
    for u in range(UPDATES):
        batch = []
        for d in datasets:
            batch.extend(d[u * K * B:(u + 1) * K * B])
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        obs = run_updates(StandardUpdater(it, opt, loss_func=make_loss(model)), model, 1)[0]
        losses.append(obs)
    return losses


def _ours(model, make_loss, datasets, **kwargs):
    opt = setup_optimizer('momentum+decay', model)
    its = [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * N,
                                          accumulate_steps=K, loss_func=make_loss(model),
                                          **kwargs)
    try:
        return run_updates(updater, model, UPDATES)
    finally:
        updater.finalize()


FORMS = {
    # the VAE example: loss_func=model
    'the model': (SelfLoss, lambda m: m, 'main/loss'),
    # a link inside the model, called
    'a sub-link': (Outer, lambda m: m.clf, 'main/clf/loss'),
    # a method of a link inside the model
    'a method of a sub-link': (Outer, lambda m: m.clf.loss, 'main/clf/loss'),
    # a method of the model
    'a method of the model': (SelfLoss, lambda m: m.forward, 'main/loss'),
    # functools.partial over a module-level function and the model
    'a partial over the model': (SelfLoss, lambda m: functools.partial(loss_of, m), None),
}


@pytest.mark.parametrize('form', list(FORMS))
def test_loss_func_bound_to_the_model_trains_as_standard_updater(form):
    cls, make_loss, key = FORMS[form]
    datasets = _datasets()
    ours, ref = seeded(cls), seeded(cls)
    initial = params(ours)
    ours_obs = _ours(ours, make_loss, datasets)
    ref_obs = _reference(ref, make_loss, datasets)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=f'{form}: {name}')
        assert not np.allclose(value, initial[name]), name   # training moved it
    if key is not None:   # what the model reported is the mean over the global batch
        np.testing.assert_allclose([o[key] for o in ours_obs],
                                   [float(o[key].array) for o in ref_obs], rtol=1e-5)


def test_find_describes_links_and_methods_by_path():
    model = Outer()
    assert _loss_binding.find(model, model) == ('/', None)
    assert _loss_binding.find(model.clf, model) == ('/clf', None)
    assert _loss_binding.find(model.clf.loss, model) == ('/clf', 'loss')
    assert _loss_binding.find(Outer().clf.loss, model) is None     # another model's
    assert _loss_binding.find(loss_of, model) is None
    replica = pickle.loads(pickle.dumps(model))
    assert _loss_binding.resolve(_loss_binding.LossBinding('/clf', 'loss'),
                                 replica) == replica.clf.loss
    assert _loss_binding.resolve(_loss_binding.LossBinding('/', None), replica) is replica


def test_swap_model_points_closures_and_partials_at_the_replica():
    model = SelfLoss()
    replica = pickle.loads(pickle.dumps(model))
    closure = model.get_loss_func(weight=0.5)
    swapped = _loss_binding.swap_model(closure, model, replica)
    cells = {id(c.cell_contents) for c in swapped.__closure__}
    assert id(replica) in cells and id(model) not in cells
    assert any(c.cell_contents is model for c in closure.__closure__)   # original untouched
    partial = _loss_binding.swap_model(functools.partial(loss_of, model.net), model, replica)
    assert partial.args[0] is replica.net
    method = _loss_binding.swap_model(functools.partial(model.net.forward), model, replica)
    assert method.func.__self__ is replica.net
    assert _loss_binding.swap_model(loss_of, model, replica) is loss_of   # nothing to swap
    x, t = chainer.dataset.concat_examples(dataset(4, seed=1))
    np.testing.assert_allclose(swapped(x, t).array, closure(x, t).array, rtol=1e-6)


@pytest.fixture
def closure_payloads():
    """Skip while the updater refuses closures (the standard pickle does, by reference)."""
    model = SelfLoss()
    its = [chainer.iterators.SerialIterator(d, B) for d in _datasets()]
    try:
        ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=['@numpy'] * N,
                                    loss_func=model.get_loss_func()).finalize()
    except TypeError as exc:
        if 'cannot be sent to a worker process' not in str(exc):
            raise
        pytest.skip('the worker payload is pickled with the standard pickle, which refuses '
                    'closures; it carries them once it switches to cloudpickle '
                    '(issue 10 item 2)')


def test_closure_over_the_model_arrives_bound_to_the_replica_model(closure_payloads,
                                                                    monkeypatch):
    """The VAE example's ``loss_func=model.get_loss_func()``: in the worker the closure's
    ``self`` must be the worker's replica model, the very object it trains."""
    captured = {}

    class Capture:
        def __init__(self, model, layouts, backend, master_device, devices, payloads,
                     *args, **kwargs):
            captured.update(payloads)

        def settle(self):
            pass

        def close(self, abort=False):
            pass

        def detached(self):
            return None

    monkeypatch.setattr(_startup, 'LocalGroup', Capture)
    model = SelfLoss()
    opt = setup_optimizer('sgd', model)
    its = [chainer.iterators.SerialIterator(d, B) for d in _datasets()]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * N,
                                          loss_func=model.get_loss_func())
    try:
        updater._start()
    finally:
        updater.finalize()   # the master's prefetch thread
    init = unpickle_payload(captured[1](None), lambda setup: setup)[1]
    cells = [c.cell_contents for c in init.loss_func.__closure__]
    assert any(c is init.model for c in cells), cells


def test_closure_over_the_model_trains_as_standard_updater(closure_payloads):
    datasets = _datasets()
    ours, ref = seeded(SelfLoss), seeded(SelfLoss)
    ours_obs = _ours(ours, lambda m: m.get_loss_func(), datasets)
    ref_obs = _reference(ref, lambda m: m.get_loss_func(), datasets)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([o['main/loss'] for o in ours_obs],
                               [float(o['main/loss'].array) for o in ref_obs], rtol=1e-5)


@pytest.mark.parametrize('model_kind', ['plain', 'forget', 'forget_helper',
                                        'forget_attribute', 'static_graph'])
def test_worker_whose_loss_func_misses_its_model_raises_instead_of_reducing_zeros(
        monkeypatch, model_kind):
    """The loss reaches the model through a module global: in a worker, another model
    (also through ``F.forget``, directly, through a function it calls or an attribute of a
    global, and one whose forward is a ``@static_graph`` schedule: nodes whose inputs do
    not list the parameters they reach)."""
    losses = {'plain': _dropin_models.global_loss,
              'forget': _dropin_models.global_forgetting_loss,
              'forget_helper': _dropin_models.global_forgetting_through_a_helper,
              'forget_attribute': _dropin_models.global_forgetting_through_an_attribute}
    if model_kind in losses:
        model, name, loss = SelfLoss(), 'GLOBAL_MODEL', losses[model_kind]
        monkeypatch.setattr(_dropin_models.HOLDER, 'model', model)
    else:
        model, name = StaticLazyClassifier(), 'GLOBAL_STATIC'
        loss = _dropin_models.global_static_loss
    monkeypatch.setattr(_dropin_models, name, model)
    with pytest.raises(WorkerError, match=r'(?s)replica 1 .*no parameter of its model got '
                                          r'a gradient.*loss_func \(' + loss.__name__):
        _ours(model, lambda m: loss, _datasets())


def test_worker_whose_loss_func_reports_through_another_model_says_so(monkeypatch):
    model = SelfLoss()
    monkeypatch.setattr(_dropin_models, 'GLOBAL_MODEL', model)
    with pytest.raises(WorkerError, match=r'(?s)replica 1 .*reported through a link that '
                                          r'is not part of this replica'):
        _ours(model, lambda m: _dropin_models.global_reporting_loss, _datasets())


def test_a_classifier_around_the_optimizers_target_says_to_set_the_optimizer_up_on_it():
    """``loss_func=L.Classifier(net)`` with the optimizer set up on a part of ``net`` (a
    head to fine-tune): the Classifier reports through itself, no link of any replica's
    model. The error says so and how to fix it; it said the loss_func computed with a
    different copy of the model."""
    np.random.seed(0)
    net = MLP()
    classifier = chainer.links.Classifier(net)
    optimizer = chainer.optimizers.SGD(0.1).setup(net.l2)
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in _datasets()],
        optimizer, devices=['@numpy', '@numpy'], loss_func=classifier)
    reporter = chainer.Reporter()
    reporter.add_observer('main', classifier)
    try:
        with reporter.scope({}), pytest.raises(
                RuntimeError, match=r'loss_func \(Classifier\) is a link around the model '
                                    r'.*Set the optimizer up on Classifier and pass no '
                                    r'loss_func.*disable_update\(\)'):
            updater.update()
    finally:
        updater.finalize()


@pytest.mark.parametrize('holder', [HoldsAModel, HoldsAReportingModel])
def test_callable_object_holding_the_model_trains_as_standard_updater(holder):
    """The payload maps the model to the replica wherever it is held (here an attribute of
    a callable object), so nothing computes on a copy, and its reports have an observer."""
    datasets = _datasets()
    ours, ref = seeded(SelfLoss), seeded(SelfLoss)
    _ours(ours, holder, datasets)
    _reference(ref, holder, datasets)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6)


def test_master_whose_loss_func_misses_its_model_raises():
    model, other = SelfLoss(), SelfLoss()
    opt = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(_datasets()[0], B)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'],
                                          loss_func=HoldsAModel(other))
    try:
        with pytest.raises(RuntimeError, match=r'replica 0 \(@numpy\): no parameter'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()

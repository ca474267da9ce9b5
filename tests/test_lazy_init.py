"""Lazy parameters (``L.Linear(None, n)``): initialised so that the replicas start alike,
and otherwise as ``StandardUpdater`` initialises them.

One replica has no copies to make: its first window initialises them, as
``StandardUpdater``'s first update does (a link only training mode calls included).
Several replicas need them before the copies: one forward pass on the master, in test
mode, on a batch of the iterator's size from the start of its dataset, the model's
persistents set back after it. What cannot go that way fails with an error that says so.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import (BufferInForward, LazyCell, LazyFixedProjection, LazyPairs,
                     LazyRaisesInTestMode, LazyRecurrent, LazyReservoir,
                     RaisesBesideUnusedLazyLink, StaticLazyClassifier, TrainOnlyHead,
                     UnusedLazyLink, dataset, params, setup_optimizer)

B, UPDATES = 4, 2


def _shards(n, updates=UPDATES):
    return [dataset(B * updates, seed=70 + r) for r in range(n)]


def _ours(model, devices, updates=UPDATES):
    optimizer = setup_optimizer('sgd', model)
    its = [chainer.iterators.SerialIterator(d, B, shuffle=False)
           for d in _shards(len(devices), updates)]
    return ParallelAccumulatingUpdater(its, optimizer, devices=devices)


def _reference(model, n, updates=UPDATES):
    """StandardUpdater on the batches the n replicas' micro-batches make together."""
    optimizer = setup_optimizer('sgd', model)
    shards = _shards(n, updates)
    batches = sum([sum((d[i:i + B] for d in shards), []) for i in range(0, B * updates, B)],
                  [])
    updater = StandardUpdater(chainer.iterators.SerialIterator(batches, n * B, shuffle=False),
                              optimizer)
    for _ in range(updates):
        updater.update()
    return params(model)


def _run(updater, n=UPDATES):
    try:
        for _ in range(n):
            updater.update()
    finally:
        updater.finalize()


def _trains_as_standard_updater(make, devices, rtol, updates=UPDATES):
    model, reference_model = make(), make()
    updater = _ours(model, devices, updates)
    np.random.seed(5)   # the lazy weights are drawn at the first forward
    _run(updater, updates)
    np.random.seed(5)
    reference = _reference(reference_model, len(devices), updates)
    for name, value in params(model).items():
        if object in (value.dtype, reference[name].dtype):   # None: a link never called
            assert value.dtype == reference[name].dtype == object, name
            continue
        np.testing.assert_allclose(value, reference[name], rtol=rtol, err_msg=name)
    return model


def test_one_replica_initialises_a_training_only_link_as_standard_updater():
    _trains_as_standard_updater(TrainOnlyHead, ['@numpy'], rtol=1e-6)


def test_two_replicas_say_why_a_training_only_link_cannot_be_initialised():
    """The initialising pass (test mode) leaves the link uninitialised; the first
    training window would give it each replica's own values: refused there, naming it."""
    updater = _ours(TrainOnlyHead(), ['@numpy', '@numpy'])
    with pytest.raises(RuntimeError, match=r"\['/aux/W'\] were still uninitialised when "
                                           r"the replicas were copied.*test mode.*input size"):
        _run(updater, 1)


@pytest.mark.parametrize('devices', [['@numpy', '@numpy'], ['@numpy']])
def test_a_lazy_link_no_forward_calls_stays_uninitialised_as_under_standard_updater(devices):
    """A model that registers a lazy link it never calls (chainer-chemistry 0.7's GIN,
    WeaveNet) trains as under StandardUpdater: the link keeps no array and no gradient,
    in every replica."""
    model = _trains_as_standard_updater(UnusedLazyLink, devices, rtol=1e-5)
    assert model.unused.W.array is None


def test_a_recurrent_links_state_is_set_back_after_the_initialising_pass():
    """An RNN link's state (``L.LSTM``'s ``h``, ``c``), set by the pass that initialises
    the lazy parameters, is set back: the first training call starts from no state, as
    under StandardUpdater (it was 2e-3 off)."""
    _trains_as_standard_updater(LazyRecurrent, ['@numpy', '@numpy'], rtol=1e-5, updates=4)


def test_what_the_first_call_makes_once_stays_as_the_initialising_pass_made_it():
    """A Variable made once at the first call (a fixed projection) and an int flag that
    marks a mask made keep what the pass made, which every replica starts from (setting
    them back drew them again in every replica: 0.25 off)."""
    _trains_as_standard_updater(LazyFixedProjection, ['@numpy', '@numpy'], rtol=1e-5)


def test_a_recurrent_link_keeps_what_its_reset_state_does_not_clear():
    """What the pass set back is what the link's reset_state clears (its state h); its
    projection, a Variable made once at the first call, stays (setting every Variable of
    such a link back drew it again in every replica: 0.1 off)."""
    _trains_as_standard_updater(LazyReservoir, ['@numpy', '@numpy'], rtol=1e-5, updates=3)


@pytest.mark.parametrize('kind', ['argument', 'dict', 'learned'])
def test_recurrent_cells_of_ones_own_start_from_no_state_after_the_pass(kind):
    """A reset_state that needs an argument (the Variables the pass stored are set back
    instead; they stayed: 6e-3 off), state in a dict filled in place (its contents set
    back), a learned initial state (a parameter, which the set-back deleted: an
    AttributeError at the first call)."""
    _trains_as_standard_updater(lambda: LazyCell(kind), ['@numpy', '@numpy'], rtol=1e-5,
                                updates=3)


def test_pipelined_refuses_a_lazy_link_the_initialising_pass_left_uninitialised():
    """One device, pipelined=True: the step uses the update before's gradients, which a
    parameter initialised since has none of (it raised a bare KeyError)."""
    model = TrainOnlyHead()
    optimizer = setup_optimizer('sgd', model)
    it = chainer.iterators.SerialIterator(dataset(B * 3, seed=70), B, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, optimizer, devices=['@numpy'], pipelined=True)
    with pytest.raises(RuntimeError, match=r"\['/aux/W'\] were still uninitialised when "
                                           r"the replicas were copied.*pipelined=True"):
        _run(updater, 3)


def test_two_replicas_initialise_on_a_whole_batch_and_keep_the_persistents():
    model = LazyPairs()
    updater = _ours(model, ['@numpy', '@numpy'])
    _run(updater, 1)
    assert model.calls == 1   # the master's own call; the initialising pass is set back
    _trains_as_standard_updater(LazyPairs, ['@numpy', '@numpy'], rtol=1e-5)


def test_an_error_in_the_initialising_pass_says_where_it_came_from():
    updater = _ours(LazyRaisesInTestMode(), ['@numpy', '@numpy'])
    with pytest.raises(ValueError, match='this model trains only') as info:
        _run(updater, 1)
    assert any('forward pass that initialises the lazy parameters' in note
               and 'test mode' in note for note in info.value.__notes__)


def test_a_persistent_made_an_array_in_the_first_forward_is_named_as_such():
    """Only BatchNormalization's are made in the initialising pass: what another first
    call makes from its batch, the pass (one call more than StandardUpdater's) must not."""
    updater = _ours(BufferInForward(), ['@numpy', '@numpy'])
    with pytest.raises(RuntimeError, match=r"persistents \['/buf'\] held no array \(None, "
                                           r"or a number\) or were not yet registered when "
                                           r"the replicas were copied"):
        _run(updater, 1)


class _OptionalPersistent(chainer.Chain):
    """Every link sized, a persistent that stays None, and a count of calls."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(5, 3)
        self.add_persistent('opt', None)
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        return chainer.functions.softmax_cross_entropy(self.l1(x), t)


def test_a_persistent_that_stays_none_starts_no_initialising_pass():
    """The pass would be one call more than StandardUpdater's (the count, a forward that
    needs backprop): a None persistent other than BatchNormalization's starts none."""
    model = _OptionalPersistent()
    _run(_ours(model, ['@numpy', '@numpy']), 1)
    assert model.calls == 1 and model.opt is None


class _NormalisedHead(chainer.Chain):
    """Running statistics and no parameter of their own, with a size or without."""

    def __init__(self, size):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(5, 5)
            self.bn = chainer.links.BatchNormalization(size, axis=0, use_gamma=False,
                                                       use_beta=False)
            self.l2 = chainer.links.Linear(5, 3)

    def forward(self, x, t):
        return chainer.functions.softmax_cross_entropy(self.l2(self.bn(self.l1(x))), t)


def test_batch_normalization_without_parameters_or_size_trains_as_with_its_size():
    """``L.BatchNormalization(axis=0, use_gamma=False, use_beta=False)`` with no size has
    no parameter and makes its running statistics at its first call: two replicas
    refused it (StandardUpdater and one replica train it); made in the initialising
    pass, it trains as the same link given its size."""
    runs = []
    for size in (None, 5):
        np.random.seed(3)
        model = _NormalisedHead(size)
        _run(_ours(model, ['@numpy', '@numpy'], updates=3), 3)
        runs.append((params(model), model.bn.avg_mean.copy(), model.bn.avg_var.copy()))
    (lazy, lazy_mean, lazy_var), (sized, sized_mean, sized_var) = runs
    for name in sized:
        np.testing.assert_array_equal(lazy[name], sized[name], err_msg=name)
    np.testing.assert_array_equal(lazy_mean, sized_mean)
    np.testing.assert_array_equal(lazy_var, sized_var)


def _spectral_normalised_with_weights_set():
    """A lazy ``L.Linear(None, n)`` under ``SpectralNormalization``, its weight set before
    the first call (pretrained weights, a snapshot loaded into a fresh model): the hook
    draws its vector ``u`` and registers it as a persistent at that call."""
    np.random.seed(11)
    head = chainer.links.Linear(None, 3)
    head.add_hook(chainer.link_hooks.SpectralNormalization())
    head.W.initialize((3, 5))   # as load_npz does
    head.W.array[...] = np.random.uniform(-1, 1, (3, 5))
    head.b.array[...] = 0.1
    return chainer.links.Classifier(head)


def test_spectral_normalisation_of_a_lazy_link_whose_weight_was_set_draws_u_once():
    """Each replica drew its own ``u`` at its first call, and the update raised (or, with
    one, left the master's own); drawn in the initialising pass on the master, as
    StandardUpdater's first call draws it, the replicas share it and train as
    StandardUpdater."""
    model = _trains_as_standard_updater(_spectral_normalised_with_weights_set,
                                        ['@numpy', '@numpy'], rtol=1e-5)
    reference = _spectral_normalised_with_weights_set()
    np.random.seed(5)
    _reference(reference, 2)
    np.testing.assert_allclose(model.predictor.W_u, reference.predictor.W_u, rtol=1e-5)


class _CountedSpectralHead(_OptionalPersistent):
    """A counted forward, and a lazy head under SpectralNormalization, its weight set
    before the first call, which the forward never calls (another configuration's)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.aux = chainer.links.Linear(None, 2)
        self.aux.add_hook(chainer.link_hooks.SpectralNormalization())
        self.aux.W.initialize((2, 5))


@pytest.mark.parametrize('devices', [['@numpy', '@numpy'], ['@numpy']])
def test_spectral_normalisations_u_is_drawn_without_a_forward(devices):
    """The vector is drawn as the hook's first call draws it, with no initialising pass
    (one call more than StandardUpdater's, in test mode without backprop, where a loss
    that needs a gradient fails), for a link no forward calls too; one replica draws it
    at its first call, if any, as StandardUpdater does."""
    model = _CountedSpectralHead()
    _run(_ours(model, devices), 1)
    assert model.calls == 1
    assert hasattr(model.aux, 'W_u') == (len(devices) > 1)


class _LazyThenSpectral(chainer.Chain):
    """A lazy link, then a lazy link under SpectralNormalization whose weight was set:
    the initialising pass draws the first's weights and then the second's u, in the
    forward's order, as StandardUpdater's first call does."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(None, 5)
            self.l2 = chainer.links.Linear(None, 3)
        self.l2.add_hook(chainer.link_hooks.SpectralNormalization())
        self.l2.W.initialize((3, 5))

    def forward(self, x, t):
        return chainer.functions.softmax_cross_entropy(
            self.l2(chainer.functions.tanh(self.l1(x))), t)


def test_spectral_normalisations_u_is_drawn_in_the_forwards_order_after_a_lazy_link():
    """Drawn before the initialising pass, u took the numbers the lazy link's weights
    take under StandardUpdater (1.5 off in three updates)."""
    def make():
        np.random.seed(11)   # the weight set before the first call
        return _LazyThenSpectral()
    _trains_as_standard_updater(make, ['@numpy', '@numpy'], rtol=1e-5, updates=3)


def test_a_static_graph_with_lazy_links_trains_as_standard_updater():
    """``@static_graph`` (Chainer's static-graph MNIST example): the initialising pass runs
    define-by-run (``use_static_graph`` off), so that no schedule is built on the master
    before the copies, which could not take them (it holds modules and weak references);
    each replica builds its own at its first training call. The schedules, Chainer's
    bookkeeping, are not named as values the workers miss, also where an evaluation
    between updates runs the master's (warnings are errors here)."""
    updates = 4
    model, reference_model = StaticLazyClassifier(), StaticLazyClassifier()
    updater = _ours(model, ['@numpy', '@numpy'], updates)
    x = np.asarray([d[0] for d in dataset(B, seed=9)])
    np.random.seed(5)   # the lazy weights are drawn at the first forward
    try:
        for _ in range(updates):
            updater.update()
            with chainer.using_config('train', False), chainer.no_backprop_mode():
                model.predictor(x)   # what an Evaluator does
    finally:
        updater.finalize()
    np.random.seed(5)
    reference = _reference(reference_model, 2, updates)
    for name, value in params(model).items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-5, err_msg=name)


def test_a_failure_before_the_first_backward_leaves_no_worker_behind():
    """The first training forward raises (call 2; call 1 initialised the lazy sizes) on a
    model with a lazy link no forward calls, whose gradient cannot be read yet: closing
    the workers read it and stopped there, leaving the worker running."""
    import multiprocessing
    model = RaisesBesideUnusedLazyLink(at=2)
    updater = _ours(model, ['@numpy', '@numpy'])
    with pytest.raises(ValueError, match='forward call 2'):
        _run(updater, 1)
    assert multiprocessing.active_children() == []

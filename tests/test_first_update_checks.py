"""What the first update checks, so that nothing trains wrong without a word.

- A model that creates a link inside ``forward`` (in ``init_scope``, on the first call)
  would give each replica its own initial values for it, and no collective carries it:
  with several replicas the first update raises, naming the replica and the parameters.
  One replica trains it as ``StandardUpdater`` does.
- ``loss_func`` must return a floating-point Variable of one element: anything else is a
  TypeError naming the function and saying what it returned.
- A reported value that is no number (a string) names its key.
- A subclass's ``update_core`` that never calls this class's (it would train the master
  alone); under ``pipelined=True``, two calls in one iteration.
- An optimizer set up on another model after the first update (the replicas are copies of
  the first); training without backprop, named as such.
- A forward that calls ``backward()`` or ``cleargrads()`` itself, in a window of several
  micro-batches (it would change the gradients the window summed so far), is refused.
- A forward that starts from state it stored at its last call (an RNN link's ``h``, ``c``,
  never reset), in a window of several micro-batches, where each micro-batch would start
  from another's samples' state: warned, naming the attribute; one that resets it at each
  call is not.
- A window whose losses reach no parameter at all (a constant loss: a detection batch
  without objects) is no sign of a loss_func bound to another model: it trains as
  ``StandardUpdater`` does, and the next window is checked instead.
- A forward that writes a parameter in place fails on a worker, whose parameters are
  read-only views of the master's: the error says so and where to constrain instead.
"""
from __future__ import annotations

import weakref

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError

from _models import (ConstantWhenEmpty, ConstantWhenEmptyForgotten,
                     ConstantWhenEmptyForgottenMethod, ConstrainsInForward, GrowsInForward, GrowsPersistent,
                     ReadsItsGradient,
                     ReadsItsGradientNowAndThen, classifier, dataset, params, run_updates,
                     setup_optimizer)


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


def test_a_persistent_the_first_forward_grows_is_refused_naming_it():
    """Not the advice for a link created in forward: a buffer the forward grows needs its
    full shape from the start."""
    model = L.Classifier(GrowsPersistent(at_call=1))
    updater = _updater(model)
    try:
        with pytest.raises(RuntimeError, match=r"its forward changed the shape or dtype of "
                           r"the persistents \['/predictor/queue'\] during its first update") \
                as e:
            run_updates(updater, model, 1)
        assert 'full shape and dtype in __init__' in str(e.value)
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
        if self.what == 'weighted vector':   # Variable.backward's seed, set beforehand
            loss = F.stack([loss, loss])
            loss.grad = np.array([0.5, 0.5], np.float32)
            return loss
        if self.what == 'int':
            return chainer.Variable(np.array(3, np.int32))
        raise ValueError(self.what)


@pytest.mark.parametrize('what, said', [
    ('none', r'returned NoneType None, not a chainer\.Variable'),
    ('float', r'returned float [0-9.]+, not a chainer\.Variable'),
    ('vector', r'returned a Variable of shape \(2,\), not one value'),
    ('weighted vector', r'returned a Variable of shape \(2,\), not one value: .*; the '
                        r'gradient set on it \(loss\.grad\) weights its elements, summed: '
                        r"return F\.sum\(w \* loss\) with loss_reduction='sum'"),
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


class OwnUpdateCore(ParallelAccumulatingUpdater):
    """A subclass in StandardUpdater's style: its update_core reads, converts and steps
    itself (as a DCGAN updater does), never calling this class's."""

    def update_core(self):
        batch = self.get_iterator('main').next()
        x, t = self.converter(batch, self.device)
        optimizer = self.get_optimizer('main')
        optimizer.update(optimizer.target, x, t)


class ClipsAfter(ParallelAccumulatingUpdater):
    """A subclass that wraps the update (WGAN's weight clipping after the step)."""

    def update_core(self):
        super().update_core()
        for param in self.get_optimizer('main').target.params():
            np.clip(param.array, -0.05, 0.05, out=param.array)


class SkipsNowAndThen(ParallelAccumulatingUpdater):
    """Leaves every third iteration out (a schedule of its own): harmless, as under
    StandardUpdater."""

    def update_core(self):
        if self.iteration % 3 == 2:
            return
        super().update_core()


class ThreeCalls(ParallelAccumulatingUpdater):
    """A critic's several updates per iteration."""

    def update_core(self):
        for _ in range(3):
            super().update_core()


def _subclassed(cls, model, **kwargs):
    its = [chainer.iterators.SerialIterator(dataset(32, seed=r), 4, shuffle=False)
           for r in range(2)]
    return cls(its, setup_optimizer('sgd', model), devices=['@numpy'] * 2, **kwargs)


@pytest.mark.parametrize('devices', [1, 2])
def test_an_update_core_of_a_subclass_that_never_calls_this_ones_is_refused(devices):
    """It would train the master alone, on the master's shard, without accumulation,
    while the workers wait: as StandardUpdater on a part of the data, without a word."""
    model = classifier()
    updater = _updater(model, n=devices, accumulate_steps=2)
    updater.__class__ = OwnUpdateCore
    try:
        with pytest.raises(RuntimeError, match=r'^OwnUpdateCore\.update_core did not call '
                           r'ParallelAccumulatingUpdater\.update_core: whatever it did ran '
                           r"(in the master alone.*)?outside this updater's loading"
                           r'.*Call super\(\)\.update_core\(\)') as e:
            run_updates(updater, model, 1)
        assert ('no worker' in str(e.value)) == (devices > 1), str(e.value)
        assert updater.iteration == 0
    finally:
        updater.finalize()


def test_subclasses_that_call_this_update_core_train_as_it_does():
    clipped, tripled, plain = classifier(), classifier(), classifier()
    for cls, m, n in [(ClipsAfter, clipped, 2), (ThreeCalls, tripled, 2),
                      (ParallelAccumulatingUpdater, plain, 6),
                      (SkipsNowAndThen, classifier(), 4)]:
        updater = _subclassed(cls, m)
        try:
            run_updates(updater, m, n)
            assert updater.iteration == n
        finally:
            updater.finalize()
    assert max(float(abs(p.array).max()) for p in clipped.params()) <= np.float32(0.05)
    for a, b in zip(tripled.params(), plain.params()):   # 2 iterations of 3 updates each
        assert (a.array == b.array).all()
    updater = _subclassed(ThreeCalls, classifier(), pipelined=True)
    try:
        with pytest.raises(RuntimeError, match=r'^update_core ran twice in iteration 0 under '
                                               r'pipelined=True, which steps one update late'):
            run_updates(updater, updater.get_optimizer('main').target, 1)
    finally:
        updater.finalize()


@pytest.mark.parametrize('devices,k', [(1, 1), (1, 2), (2, 1)])
def test_an_optimizer_set_up_on_another_model_after_the_first_update_is_refused(devices, k):
    """The replicas are copies of the first model: the step applied the first model's
    gradients to the new one, whose gradients Chainer had left NaN (every parameter of it
    NaN after one step), where StandardUpdater trains the new model."""
    model = classifier()
    updater = _updater(model, n=devices, accumulate_steps=k)
    try:
        run_updates(updater, model, 1)
        other = classifier(seed=1)
        updater.get_optimizer('main').setup(other)
        before = [p.array.copy() for p in other.params()]
        with pytest.raises(RuntimeError, match=r'^the optimizer now updates another model '
                           r'\(Classifier at 0x[0-9a-f]+, set up after the first update\) '
                           r'than the one this updater started with'):
            run_updates(updater, other, 1)
        assert all((p.array == b).all() for p, b in zip(other.params(), before))
    finally:
        updater.finalize()


@pytest.mark.parametrize('devices', [1, 2])
def test_training_without_backprop_says_so(devices):
    model = classifier()
    updater = _updater(model, n=devices, accumulate_steps=2)
    try:
        with chainer.no_backprop_mode(), pytest.raises(
                RuntimeError, match=r'^replica 0 \(@numpy\): no parameter of its model got a '
                r'gradient .*chainer\.config\.enable_backprop is False'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def _nothing_to_find_first(n, seed):
    """dataset(n, seed) whose first 4 samples are labelled -1."""
    x, t = (np.array(c) for c in zip(*dataset(n, seed=seed)))
    t[:4] = -1
    return chainer.datasets.TupleDataset(x, t)


@pytest.mark.parametrize('make', [ConstantWhenEmpty, ConstantWhenEmptyForgotten,
                                  ConstantWhenEmptyForgottenMethod],
                         ids=['no_graph', 'forgotten', 'forgotten_method'])
@pytest.mark.parametrize('devices, k', [(1, 1), (2, 1), (1, 2)])
def test_a_first_window_whose_loss_is_a_constant_trains_as_standard_updater(devices, k, make):
    """Each replica's first micro-batch of 4 has nothing to find: its loss is a constant
    with no graph, and no parameter gets a gradient from it. StandardUpdater steps on
    zeros there (momentum and weight decay still move the parameters); so does this
    updater, over the same samples, and the replicas' later backward passes are checked
    as before."""
    n = 3 * 4 * k
    shards = [_nothing_to_find_first(n, seed=40 + r) for r in range(devices)]
    np.random.seed(0)
    model, reference = make(), make()
    reference.copyparams(model)
    its = [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in shards]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('momentum+decay', model),
                                          devices=['@numpy'] * devices, accumulate_steps=k)
    try:
        run_updates(updater, model, 3)
    finally:
        updater.finalize()
    w = 4 * k
    batches = [x for u in range(3) for d in shards for x in d[u * w:(u + 1) * w]]
    standard = chainer.training.updaters.StandardUpdater(
        chainer.iterators.SerialIterator(batches, w * devices, shuffle=False),
        setup_optimizer('momentum+decay', reference))
    run_updates(standard, reference, 3)
    for name, value in params(reference).items():
        np.testing.assert_allclose(params(model)[name], value, rtol=1e-5, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize('make', [ReadsItsGradient, ReadsItsGradientNowAndThen])
@pytest.mark.parametrize('n, k, kwargs', [(1, 2, {}), (2, 1, {'micro_batch_size': 2})])
def test_a_forward_that_changes_the_gradients_is_refused_in_a_window_of_several(
        make, n, k, kwargs):
    """Also where it does so now and then only, after windows that passed the check."""
    updater = _updater(make(), n=n, accumulate_steps=k, **kwargs)
    try:
        with pytest.raises(RuntimeError, match=r"replica 0 \(@numpy\): the forward "
                                               r'\(' + make.__name__ + r"\) changed the "
                                               r"parameters' gradients .*chainer\.grad"):
            run_updates(updater, updater.get_optimizer('main').target, 3)
    finally:
        updater.finalize()


def test_a_forward_that_changes_the_gradients_trains_alone_in_its_window():
    """One micro-batch a window: what the forward left is cleared before the backward,
    as under StandardUpdater."""
    np.random.seed(0)
    model, reference = ReadsItsGradient(), ReadsItsGradient()
    reference.copyparams(model)
    updater = _updater(model, n=2)
    try:
        run_updates(updater, model, 2)
    finally:
        updater.finalize()
    batches = [x for u in range(2) for r in range(2) for x in dataset(16, seed=r)[u * 4:u * 4 + 4]]
    standard = chainer.training.updaters.StandardUpdater(
        chainer.iterators.SerialIterator(batches, 8, shuffle=False),
        setup_optimizer('sgd', reference))
    run_updates(standard, reference, 2)
    for name, value in params(reference).items():
        np.testing.assert_allclose(params(model)[name], value, rtol=1e-5, atol=1e-7,
                                   err_msg=name)


class _Recurrent(chainer.Chain):
    """An LSTM classifier; ``reset`` says whether its forward resets the state first."""

    def __init__(self, reset):
        super().__init__()
        np.random.seed(0)
        with self.init_scope():
            self.rnn = L.LSTM(5, 4)
            self.out = L.Linear(4, 3)
        self.reset = reset

    def forward(self, x, t):
        if self.reset:
            self.rnn.reset_state()
        return F.softmax_cross_entropy(self.out(self.rnn(x)), t)


@pytest.mark.parametrize('n, kwargs', [(1, {'accumulate_steps': 2}),
                                       (2, {'micro_batch_size': 2})])
def test_state_carried_from_one_micro_batch_to_the_next_is_warned(n, kwargs):
    """With 2 micro-batches per update, the second starts from the first's LSTM state,
    over other samples, where StandardUpdater's one batch starts from the last update's:
    the first such window warns."""
    model = _Recurrent(reset=False)
    updater = _updater(model, n=n, **kwargs)
    try:
        with pytest.warns(RuntimeWarning, match=r"replica 0 \(@numpy\): the forward starts "
                                                r"from state it stored at its last call, in "
                                                r"\['/rnn/c', '/rnn/h'\]"):
            run_updates(updater, model, 2)
    finally:
        updater.finalize()


@pytest.mark.parametrize('n, k', [(1, 2), (2, 1)])
def test_state_reset_at_each_call_or_carried_by_one_call_per_update_is_not_warned(n, k):
    """Reset at each call, nothing carries; with one micro-batch per update each replica
    carries its own rows, as StandardUpdater's one batch does (warnings are errors here)."""
    model = _Recurrent(reset=(k > 1))
    updater = _updater(model, n=n, accumulate_steps=k)
    try:
        run_updates(updater, model, 2)
    finally:
        updater.finalize()


class _KeepsItsLoss(chainer.Chain):
    """``L.Classifier``'s way: the last loss kept as an attribute, dropped at the next call;
    records whether the last call's loss (and so its graph) was still alive then."""

    def __init__(self):
        super().__init__()
        np.random.seed(0)
        with self.init_scope():
            self.out = L.Linear(5, 3)
        self.loss, self.last, self.alive = None, None, []

    def forward(self, x, t):
        self.loss = None
        if self.last is not None:
            self.alive.append(self.last() is not None)
        self.loss = F.softmax_cross_entropy(self.out(x), t)
        self.last = weakref.ref(self.loss)
        return self.loss


def test_the_look_for_carried_state_keeps_no_graph_alive():
    """The first window's look holds what the first call stored weakly: a model that
    drops its last loss at its next call frees that micro-batch's graph there, as under
    a hand-written loop (the window's peak memory is one micro-batch's graph)."""
    model = _KeepsItsLoss()
    updater = _updater(model, n=1, accumulate_steps=3)
    try:
        run_updates(updater, model, 1)
    finally:
        updater.finalize()
    assert model.alive == [False, False]


class _KeepsATuple(chainer.Chain):
    """Keeps ``(y, loss)`` of its last call in an attribute (never read back), or, with
    ``carry``, a tuple state ``(h,)`` its next call starts from."""

    def __init__(self, carry):
        super().__init__()
        np.random.seed(0)
        with self.init_scope():
            self.inner = L.Linear(5, 5)
            self.out = L.Linear(5, 3)
        self.carry, self.last = carry, None

    def forward(self, x, t):
        h = self.inner(x)
        if self.carry and self.last is not None:
            h = h + self.last[0]
        y = self.out(h)
        loss = F.softmax_cross_entropy(y, t)
        self.last = (h,) if self.carry else (y, loss)
        return loss


@pytest.mark.parametrize('carry', [False, True])
def test_a_tuple_of_variables_kept_in_an_attribute_is_looked_at_too(carry):
    """A tuple (or list) of the last call's Variables: kept, not read, it trains as it
    does with one micro-batch (the look raised a TypeError: a tuple takes no weak
    reference); a tuple state the next call starts from is warned about."""
    model = _KeepsATuple(carry)
    updater = _updater(model, n=1, accumulate_steps=2)
    try:
        if carry:
            with pytest.warns(RuntimeWarning, match=r"in \['/last'\]"):
                run_updates(updater, model, 2)
        else:
            run_updates(updater, model, 2)
    finally:
        updater.finalize()


def test_a_forward_that_writes_a_parameter_in_place_is_told_where_to_constrain():
    model = ConstrainsInForward()
    updater = _updater(model)
    try:
        with pytest.raises(WorkerError, match=r'^replica 1 ') as e:
            run_updates(updater, model, 1)
    finally:
        updater.finalize()
    text = str(e.value)
    assert 'ValueError: output array is read-only' in text
    assert text.rstrip().endswith(
        "(On a worker the model's parameters are read-only views of the master's: a "
        'forward that writes a parameter in place, such as a max-norm constraint, would '
        "change every replica's, and runs once per micro-batch where StandardUpdater's runs "
        'once per update. If the array is a parameter, constrain it after the step instead, '
        "once per update on the master: optimizer.add_hook(hook, timing='post').)")

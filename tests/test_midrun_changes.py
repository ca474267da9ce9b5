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

import os
import signal
import warnings

import numpy as np
import pytest

import chainer
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, _unsent_state, shard_iterators
from mgpu_updater.errors import WorkerRestartWarning

from _models import (GrowsPersistent, classifier, dataset, params, run_updates,
                     setup_optimizer)

B = 4


def _updater(model, n, **kwargs):
    its = shard_iterators(dataset(8 * B * n, seed=1), n, B, seed=None, shuffle=False)
    return its, ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                            devices=['@numpy'] * n, **kwargs)


def _assert_same_weights(one, other):
    for name, value in one.items():
        np.testing.assert_array_equal(other[name], value)


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


@pytest.mark.parametrize('n', [1, 2])
@pytest.mark.parametrize('entry', ['optimizer', 'iterator'])
def test_another_optimizer_or_iterator_in_standard_updaters_dicts_raises_at_the_next_update(
        n, entry):
    """Third-party code swaps Adam for SGD through ``updater._optimizers['main']``, or
    the data through ``updater._iterators['main']``, which StandardUpdater reads at every
    update. Here the old optimizer went on stepping (its t, its hooks) and the old
    iterator on loading: refused instead, saying what to do."""
    model = classifier()
    its, updater = _updater(model, n)
    try:
        run_updates(updater, model, 1)
        if entry == 'optimizer':
            updater._optimizers['main'] = setup_optimizer('sgd', model)
        else:
            updater._iterators['main'] = shard_iterators(dataset(8 * B, seed=2), 1, B)[0]
        before = params(model)
        for _ in range(2):   # each time, the replicas untouched
            with pytest.raises(RuntimeError, match=(
                    r"^updater\._" + entry + r"s\['main'\] was given another " + entry
                    + ' after the first update')):
                run_updates(updater, model, 1)
        for name, value in params(model).items():
            np.testing.assert_array_equal(value, before[name])   # no step taken
        # put back, the run goes on as it would have
        if entry == 'optimizer':
            updater._optimizers['main'] = updater._taken_at_start[2]
        else:
            updater._iterators['main'] = its[0]
        run_updates(updater, model, 1)
        assert updater.iteration == 2 and updater.get_optimizer('main').t == 2
        assert its[0].current_position == 2 * B
    finally:
        updater.finalize()


def test_a_main_iterator_replaced_before_the_first_update_is_read_by_one_replica_only():
    """With one replica the master's iterator is all of it, read as StandardUpdater reads
    it; with two, the workers' shards go with the one the updater was built with, so
    another is refused before any process starts."""
    model = classifier()
    _, updater = _updater(model, 1)
    other = shard_iterators(dataset(8 * B, seed=2), 1, B, seed=None, shuffle=False)[0]
    try:
        updater._iterators['main'] = other
        run_updates(updater, model, 1)
        assert other.current_position == B
    finally:
        updater.finalize()
    _, updater = _updater(model, 2)
    updater._iterators['main'] = shard_iterators(dataset(8 * B, seed=2), 1, B)[0]
    try:
        with pytest.raises(RuntimeError, match=r"^updater\._iterators\['main'\] was given "
                                               r"another iterator than the master's shard"):
            run_updates(updater, model, 1)
        assert updater.worker_pids() == []
    finally:
        updater.finalize()


@pytest.mark.parametrize('to', [50, 0, 51, 2])
def test_iteration_set_between_pipelined_updates_leaves_the_training_alone(to):
    """``updater.iteration`` is a counter under StandardUpdater. Pipelined, the gradient
    buffers went by its parity: set to a number of the other parity, the next update
    reduced onto the gradient still in flight (weights 0.07 off, silently)."""
    ends = []
    for change in (False, True):
        model = classifier()
        _, updater = _updater(model, 2, pipelined=True)
        try:
            run_updates(updater, model, 3)
            if change:
                updater.iteration = to
            run_updates(updater, model, 3)
            assert updater.iteration == (to if change else 3) + 3
            assert updater.get_optimizer('main').t == 5
        finally:
            updater.finalize()
        ends.append(params(model))
    _assert_same_weights(*ends)


def test_another_main_iterator_refused_at_a_restart_keeps_the_pipelined_step_in_flight():
    """After finalize() the step in flight is kept for the restart; a main iterator
    replaced meanwhile is refused before anything is torn down, so once put back the
    run is the one without the refusal (the step was dropped: one step short)."""
    ends = []
    for refuse in (False, True):
        model = classifier()
        its, updater = _updater(model, 2, pipelined=True)
        try:
            run_updates(updater, model, 3)
            updater.finalize()
            if refuse:
                updater._iterators['main'] = shard_iterators(dataset(8 * B, seed=2), 1, B)[0]
                with pytest.raises(RuntimeError, match=r"^updater\._iterators\['main'\] was "
                                                       r"given another iterator than"):
                    run_updates(updater, model, 1)
                updater._iterators['main'] = its[0]
            run_updates(updater, model, 3)
            assert updater.get_optimizer('main').t == 5
        finally:
            updater.finalize()
        ends.append(params(model))
    _assert_same_weights(*ends)


def test_another_main_iterator_refused_at_the_end_of_the_data_starts_no_new_pass():
    """At the end of the data (``repeat=False``) another iterator put into
    ``updater._iterators['main']`` is refused; it started a new pass on the workers
    first, so with the original put back, not reset, the updates went on with the
    workers' shards alone (StandardUpdater raises StopIteration again)."""
    model = classifier()
    its = shard_iterators(dataset(6 * B, seed=1), 2, B, seed=None, shuffle=False,
                          repeat=False)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        run_updates(updater, model, 3)
        with pytest.raises(StopIteration):
            run_updates(updater, model, 1)
        updater._iterators['main'] = shard_iterators(dataset(6 * B, seed=2), 1, B)[0]
        with pytest.raises(RuntimeError, match=r"^updater\._iterators\['main'\] was "
                                               r"given another iterator"):
            run_updates(updater, model, 1)
        updater._iterators['main'] = its[0]
        before = params(model)
        for _ in range(2):
            with pytest.raises(StopIteration):
                run_updates(updater, model, 1)
        assert updater.iteration == 3 and updater.get_optimizer('main').t == 3
        for name, value in params(model).items():
            np.testing.assert_array_equal(value, before[name])
        its[0].reset()   # the next pass, on every replica
        run_updates(updater, model, 3)
        assert updater.get_optimizer('main').t == 6
    finally:
        updater.finalize()


def test_the_end_of_the_data_met_again_leaves_the_pipelined_step_in_flight():
    """``update()`` called again at the end of the data (``repeat=False``) raises
    StopIteration again and changes nothing, as under StandardUpdater: the gradient in
    flight, stepped on in the next pass, stays (an empty update reduced onto it)."""
    ends = []
    for stops in (1, 3):
        model = classifier()
        its = shard_iterators(dataset(6 * B, seed=1), 2, B, seed=None, shuffle=False,
                              repeat=False)
        updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                              devices=['@numpy'] * 2, pipelined=True)
        try:
            run_updates(updater, model, 3)
            for _ in range(stops):
                with pytest.raises(StopIteration):
                    run_updates(updater, model, 1)
            updater.get_iterator('main').reset()
            run_updates(updater, model, 2)
            assert updater.get_optimizer('main').t == 4
        finally:
            updater.finalize()
        ends.append(params(model))
    _assert_same_weights(*ends)


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


class Scaled(chainer.Chain):
    """A linear layer whose output a persistent scales (``beta``, a number an extension
    anneals) and shifts (``shift``, an array), and a parameter ``w`` of its own."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)
            self.w = chainer.Parameter(np.ones(3, np.float32))
        self.add_persistent('beta', 1.0)
        self.add_persistent('shift', np.zeros(3, np.float32))

    def forward(self, x, t):
        w = chainer.functions.cast(self.w, np.float32)
        y = self.l(x) * float(self.beta) + self.shift + w
        return chainer.functions.softmax_cross_entropy(y, t)


@pytest.mark.parametrize('value', [np.array(0.5), np.array(0.5, np.float32), np.float32(0.5)])
def test_a_number_persistent_set_to_a_0d_array_reaches_every_replica(value):
    """``model.beta = numpy.array(0.5)`` between updates, where ``beta`` was a number: the
    workers kept 1.0 with no word (0.03 off in four updates); it travels as the number it
    replaced did, as StandardUpdater reads it."""
    model, ref = Scaled(), Scaled()
    ref.copyparams(model)
    its, updater = _updater(model, 2)
    try:
        for u in range(4):
            run_updates(updater, model, 1)
            if u == 0:
                model.beta = value
    finally:
        updater.finalize()
    ref_opt = setup_optimizer('sgd', ref)
    data = dataset(8 * B * 2, seed=1)
    reference = StandardUpdater(chainer.iterators.SerialIterator(
        sum([data[i:i + B] + data[i + 8 * B:i + 9 * B] for i in range(0, 4 * B, B)], []),
        2 * B, shuffle=False), ref_opt)
    for u in range(4):
        reference.update()
        if u == 0:
            ref.beta = value
    for name, array in params(ref).items():
        np.testing.assert_allclose(params(model)[name], array, rtol=1e-5, atol=1e-7,
                                   err_msg=name)


def test_an_array_persistent_set_to_a_number_raises_naming_it():
    model = Scaled()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 1)
        model.shift = 0.7
        with pytest.raises(RuntimeError, match=r'the persistent /shift held a \(3,\) array '
                                               r'when the replicas were built and holds no '
                                               r'array now.*link\.shift\[\.\.\.\] = value'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_a_parameter_given_an_array_of_another_dtype_raises_naming_it():
    """Chainer's own error said 'Dtype of data and grad mismatch', naming nothing."""
    model = Scaled()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 1)
        model.w.array = model.w.array.astype(np.float64)
        with pytest.raises(RuntimeError, match=r'the parameter /w holds a float64 array now, '
                                               r'where the replicas and the buffers that '
                                               r'carry its gradient hold float32'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


class ResetState(chainer.Chain):
    """A persistent state that ``reset_state()`` sets to None and the forward makes again."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)
        self.add_persistent('h', np.zeros(3, np.float32))

    def reset_state(self):
        self.h = None

    def forward(self, x, t):
        if self.h is None:
            self.h = np.zeros(3, np.float32)
        y = self.l(x) + self.h
        self.h = self.h * 0.5 + y.array.mean(axis=0) * 0.5
        return chainer.functions.softmax_cross_entropy(y, t)


@pytest.mark.parametrize('kwargs', [{'nonfinite': 'skip'}, {'micro_batch_size': 'auto'}])
def test_one_replica_takes_a_persistent_reset_to_none_as_standard_updater(kwargs):
    """One replica has no buffers: a state reset to None between updates trains on, also
    where the persistents are kept to be set back. Several replicas raise, naming it."""
    model, ref = ResetState(), ResetState()
    ref.copyparams(model)
    _, updater = _updater(model, 1, **kwargs)
    reference = StandardUpdater(chainer.iterators.SerialIterator(
        dataset(8 * B, seed=1), B, shuffle=False), setup_optimizer('sgd', ref))
    try:
        for u in range(3):
            run_updates(updater, model, 1)
            reference.update()
            model.reset_state()
            ref.reset_state()
    finally:
        updater.finalize()
    for name, array in params(ref).items():
        np.testing.assert_allclose(params(model)[name], array, rtol=1e-6, err_msg=name)
    model = ResetState()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 1)
        model.reset_state()
        with pytest.raises(RuntimeError, match=r'the persistent /h held a \(3,\) array when '
                                               r'the replicas were built and holds no array'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


class IntCount(chainer.Chain):
    """A persistent int array a user's code sets between updates (a step count)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)
        self.add_persistent('shift', np.zeros(3, np.int32))

    def forward(self, x, t):
        return chainer.functions.softmax_cross_entropy(self.l(x) + self.shift, t)


def test_an_int_persistent_given_a_float_array_raises_naming_it():
    """The slot is int32: 0.5 became 0 in the workers, with no word, while the master used
    0.5 (0.04 off in three updates)."""
    model = IntCount()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 1)
        model.shift = np.full(3, 0.5, np.float32)
        with pytest.raises(RuntimeError, match=r'/shift holds a float32 array now, where the '
                                               r'slot that carries it between the replicas '
                                               r'holds int32'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def _train_scaled(kill):
    """Scaled on two replicas, beta given a 0-d array after update 1; ``kill``: the update
    before which the worker is SIGKILLed (and replaced)."""
    np.random.seed(0)
    model = Scaled()
    _, updater = _updater(model, 2, max_worker_restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', WorkerRestartWarning)
        try:
            for u in range(4):
                if u == kill:
                    os.kill(updater.worker_pids()[0], signal.SIGKILL)
                run_updates(updater, model, 1)
                if u == 0:
                    model.beta = np.array(0.5)
            assert updater.worker_restarts == (kill is not None)
        finally:
            updater.finalize()
    return params(model)


def test_a_worker_replaced_after_a_number_persistent_was_given_a_0d_array_takes_it():
    """The replacement starts from the start's payload, where beta was a number, and takes
    the 0-d array with the update's values: its first window's look at what its model
    started with took that for an array persistent its forward made, and the update
    failed ('not restarted')."""
    whole, restarted = _train_scaled(None), _train_scaled(2)
    for name, array in whole.items():
        np.testing.assert_array_equal(restarted[name], array, err_msg=name)


class SumsOnTheDevice(chainer.Chain):
    """A number persistent the forward makes a 0-d array at its first call (a sum kept as
    ``total = total + xp.sum(...)``, which CuPy returns as a 0-d array; numpy's own
    arithmetic gives a scalar, hence the ``numpy.array``)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)
        self.add_persistent('total', 0.0)

    def forward(self, x, t):
        self.total = np.array(self.total + np.abs(x).sum())
        return chainer.functions.softmax_cross_entropy(self.l(x), t)


def test_a_number_persistent_the_first_forward_makes_a_0d_array_travels_as_a_number():
    """It was refused after the first window, as a persistent that 'was None' and became
    an array; it travels as the number did (the master's, each update)."""
    model = SumsOnTheDevice()
    _, updater = _updater(model, 2)
    try:
        run_updates(updater, model, 3)
    finally:
        updater.finalize()
    assert isinstance(model.total, np.ndarray) and model.total.shape == ()


class RunningMeanFromANumber(chainer.Chain):
    """A persistent that starts as the number 0.0 and that the forward makes a running
    mean of its outputs, a (3,) array: each replica's own statistic."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(5, 3)
        self.add_persistent('run', 0.0)

    def forward(self, x, t):
        y = self.l(x)
        self.run = 0.9 * self.run + 0.1 * y.array.mean(axis=0)
        return chainer.functions.softmax_cross_entropy(y, t)


def test_a_number_persistent_the_first_forward_makes_an_array_of_a_shape_is_refused():
    """Only a 0-d array may stand for the number it replaced."""
    model = RunningMeanFromANumber()
    _, updater = _updater(model, 2)
    try:
        with pytest.raises(RuntimeError, match=r"the persistents \['/run'\] held no array "
                                               r'\(None, or a number\)'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()

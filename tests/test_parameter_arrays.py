"""A parameter's array object is the model's as under StandardUpdater, before and between
updates.

With CPU replicas the master's parameters are views of the shared slot the workers read
(``tests/test_buffer_views.py``). What the user does to the array objects must still
train as ``StandardUpdater`` trains: a read-only array (its in-place step fails alike, an
update rule that assigns a new array trains it), an array an extension replaces with its
own buffer and then writes through, two parameters tied by one array between updates, an
array a link also holds for its forward. Two replicas, each update compared with
``StandardUpdater`` on one batch of the same samples.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import dataset, params, run_updates

N, B, UPDATES = 2, 4, 4


class _Two(chainer.Chain):
    """Two square layers, and an output layer."""

    def __init__(self, dtype=np.float32):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(5, 5)
            self.b = L.Linear(5, 5)
            self.out = L.Linear(5, 3)
        for param in self.params():
            param.array = param.array.astype(dtype)
        self.held = None   # an array the forward reads, where set

    def forward(self, x):
        h = self.b(F.tanh(self.a(F.cast(x, self.a.W.dtype))))
        if self.held is not None:
            h = h + F.sum(self.held) * 0.1
        return F.cast(self.out(F.tanh(h)), np.float32)


def _make(dtype=np.float32):
    np.random.seed(7)
    return L.Classifier(_Two(dtype))


def _train_both(prepare=lambda model: None, between=lambda model, u, updater: None,
                optimizer=lambda: chainer.optimizers.SGD(lr=0.5), dtype=np.float32,
                only=None):
    """Ours on two replicas and StandardUpdater on the global batches, ``prepare(model)``
    after the optimizer's setup and ``between(model, u, updater)`` after update u of
    each."""
    shards = [dataset(B * UPDATES, seed=40 + r) for r in range(N)]
    models = []
    for ours in (True, False):
        if only is not None and ours == only:
            continue   # only=True: StandardUpdater's run alone; False: ours alone
        model = _make(dtype)
        opt = optimizer()
        opt.setup(model)
        prepare(model)
        if ours:
            updater = ParallelAccumulatingUpdater(
                [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in shards],
                opt, devices=['@numpy'] * N)
        else:
            batches = [d[i] for u in range(UPDATES) for d in shards
                       for i in range(u * B, (u + 1) * B)]
            updater = StandardUpdater(
                chainer.iterators.SerialIterator(batches, N * B, shuffle=False), opt)
        try:
            for u in range(UPDATES):
                run_updates(updater, model, 1)
                between(model, u, updater)
        finally:
            updater.finalize()
        models.append(model)
    return models


def _same(ours, ref, rtol=1e-5, atol=1e-6):
    start = params(_make())
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=rtol, atol=atol,
                                   err_msg=name)
        assert not np.allclose(value, start[name].astype(value.dtype)), f'{name} still'


def _read_only(model):
    model.predictor.a.W.array.flags.writeable = False


def test_a_read_only_parameter_fails_its_in_place_step_as_under_standard_updater():
    """The slot took its values into writable memory, and the step trained it."""
    for standard in (True, False):
        model = _make()
        _read_only(model)
        opt = chainer.optimizers.SGD()
        opt.setup(model)
        shards = [dataset(B, seed=40 + r) for r in range(N)]
        if standard:
            updater = StandardUpdater(chainer.iterators.SerialIterator(
                list(shards[0]) + list(shards[1]), N * B, shuffle=False), opt)
        else:
            updater = ParallelAccumulatingUpdater(
                [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in shards],
                opt, devices=['@numpy'] * N)
        try:
            with pytest.raises(ValueError, match='read-only'):
                run_updates(updater, model, 1)
        finally:
            updater.finalize()


def test_a_read_only_float16_parameter_trains_under_an_fp32_update_as_under_standard_updater():
    """``use_fp32_update()`` assigns the parameter a new array at each step."""
    def optimizer():
        opt = chainer.optimizers.SGD(lr=0.5)
        opt.use_fp32_update()
        return opt
    ours, ref = _train_both(prepare=_read_only, optimizer=optimizer, dtype=np.float16)
    _same(ours, ref, rtol=2e-3, atol=2e-3)


def test_a_frozen_read_only_parameter_is_left_as_it_is():
    """(Bound to the slot once, as any parameter: a large frozen embedding read from a
    read-only memory map is not copied every update.)"""
    def prepare(model):
        _read_only(model)
        model.predictor.a.disable_update()
    before = _make().predictor.a.W.array.copy()
    ours, ref = _train_both(prepare=prepare)
    np.testing.assert_array_equal(ours.predictor.a.W.array, before)


def test_an_extensions_own_buffer_stays_the_parameters_array():
    """An extension gives a parameter its own array, then clips through it in place: the
    next update bound the parameter to the slot again, and the clip was lost (the loss
    1.45 against 1.15)."""
    buffers = {}

    def between(model, u, updater):
        layer = model.predictor.b
        if u == 0:
            buffers[id(model)] = layer.W.array.copy()
            layer.W.array = buffers[id(model)]
        elif u == 2:
            np.clip(buffers[id(model)], -0.05, 0.05, out=buffers[id(model)])
        assert layer.W.array is buffers[id(model)]
    ours, ref = _train_both(between=between)
    _same(ours, ref)


def test_two_parameters_tied_between_updates_stay_tied():
    def between(model, u, updater):
        if u == 1:
            model.predictor.b.W.array = model.predictor.a.W.array
        if u >= 1:
            assert model.predictor.b.W.array is model.predictor.a.W.array
    ours, ref = _train_both(between=between)
    _same(ours, ref)


def test_two_parameters_tied_at_the_start_and_untied_later_are_refused():
    """The slot carries their one array once: the next update tied them again."""
    def prepare(model):
        model.predictor.b.W.array = model.predictor.a.W.array

    def between(model, u, updater):
        if u == 1:
            model.predictor.b.W.array = model.predictor.a.W.array.copy()
    with pytest.raises(RuntimeError, match=r"parameters \['/predictor/a/W', "
                                           r"'/predictor/b/W'\] held one array when the "
                                           r'updater started, and now hold different ones'):
        _train_both(prepare=prepare, between=between)


def test_an_array_a_link_holds_for_its_forward_stays_the_parameters_on_every_replica():
    """``self.held = self.a.W.array``: the master's stayed, a worker's kept the values it
    was unpickled with (0.005-0.009 off in four updates, no warning)."""
    def prepare(model):
        model.predictor.held = model.predictor.a.W.array
    ours, ref = _train_both(prepare=prepare)
    _same(ours, ref)
    assert ours.predictor.held is ours.predictor.a.W.array


def _restart(updater, how, path):
    """What starts the workers anew at the next update: ``finalize()`` (training goes on
    after it), or a snapshot saved and loaded into the running updater."""
    if how == 'finalize':
        updater.finalize()
    else:
        chainer.serializers.save_npz(path, updater)
        chainer.serializers.load_npz(path, updater)


@pytest.mark.parametrize('restart', ['finalize', 'snapshot'])
def test_arrays_given_and_ties_made_between_updates_outlast_a_restart(restart, tmp_path):
    """``finalize()`` (training goes on after it) and a snapshot loaded into the running
    updater start the workers anew: the new start bound the parameters to the slot
    again, dropping an extension's buffer (0.77 off), and finalize() gave two parameters
    tied between updates a copy each (0.09 off)."""
    buffers = {}

    def between(model, u, updater):
        net = model.predictor
        if u == 0:
            buffers[id(model)] = net.b.W.array.copy()
            net.b.W.array = buffers[id(model)]
            net.b.b.array = net.a.b.array
        elif u == 1:
            _restart(updater, restart, str(tmp_path / f'{id(model)}.npz'))
        elif u == 2:
            np.clip(buffers[id(model)], -0.05, 0.05, out=buffers[id(model)])
        assert net.b.W.array is buffers[id(model)]
        assert net.b.b.array is net.a.b.array
    ours, ref = _train_both(between=between)
    _same(ours, ref)


@pytest.mark.parametrize('restart', ['finalize', 'snapshot'])
def test_a_buffer_two_parameters_share_outlasts_a_restart(restart, tmp_path):
    """Parameters tied on the user's own buffer lost it at the next start (0.90 off): a
    parameter keeps any array that is not the copy the last close gave it."""
    buffers = {}

    def between(model, u, updater):
        net = model.predictor
        if u == 0:
            buffers[id(model)] = net.a.W.array.copy()
            net.a.W.array = net.b.W.array = buffers[id(model)]
            buffers[id(model), 'b'] = net.out.b.array.copy()
            net.out.b.array = buffers[id(model), 'b']
        elif u == 1:
            _restart(updater, restart, str(tmp_path / f'{id(model)}.npz'))
        elif u == 2:
            np.clip(buffers[id(model)], -0.05, 0.05, out=buffers[id(model)])
            buffers[id(model), 'b'][...] = 0.5
        assert net.a.W.array is net.b.W.array is buffers[id(model)]
        assert net.out.b.array is buffers[id(model), 'b']
    ours, ref = _train_both(between=between)
    _same(ours, ref)


def test_a_frozen_read_only_parameter_enabled_later_fails_its_step_as_alone():
    """Bound to the slot while frozen (not copied every update), it became writable:
    enabled later, it trained where StandardUpdater's step fails."""
    def prepare(model):
        _read_only(model)
        model.predictor.a.disable_update()

    def between(model, u, updater):
        if u == 1:
            model.predictor.a.enable_update()
    for standard in (True, False):
        with pytest.raises(ValueError, match='read-only'):
            _train_both(prepare=prepare, between=between, only=standard)


@pytest.mark.parametrize('restart', ['finalize', 'snapshot'])
def test_a_frozen_read_only_parameter_stays_read_only_past_a_restart(restart, tmp_path):
    """The close gave it a writable copy: enabled after the restart, it trained where
    StandardUpdater's step fails (and it is bound again, not copied every update)."""
    def prepare(model):
        _read_only(model)
        model.predictor.a.disable_update()

    def between(model, u, updater):
        if u == 1:
            if isinstance(updater, ParallelAccumulatingUpdater):
                _restart(updater, restart, str(tmp_path / 'snapshot.npz'))
            assert not model.predictor.a.W.array.flags.writeable
        if u == 2:
            if isinstance(updater, ParallelAccumulatingUpdater):
                assert '/predictor/a/W' in updater._group.params._every
            model.predictor.a.enable_update()
    for standard in (True, False):
        with pytest.raises(ValueError, match='read-only'):
            _train_both(prepare=prepare, between=between, only=standard)


def test_a_run_closed_before_its_first_update_keeps_what_the_last_close_gave():
    """A close before any parameter was bound (an interrupt at the start) recorded that
    it gave nothing: every later start took every array for the user's, and copied each
    parameter every update for good."""
    model = _make()
    opt = chainer.optimizers.SGD()
    opt.setup(model)
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(dataset(B * 4, seed=40 + r), B) for r in range(N)],
        opt, devices=['@numpy'] * N)
    try:
        run_updates(updater, model, 1)
        updater.finalize()
        updater._start()   # the workers started, then stopped before any update
        updater.finalize()
        run_updates(updater, model, 1)
        names = {name for name, _ in model.namedparams()}
        assert updater._group.params._every == names
    finally:
        updater.finalize()

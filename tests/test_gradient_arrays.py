"""Gradient arrays as Chainer's backward leaves them are scaled and received correctly.

Chainer hands a parameter whatever array its gradient came out as. Two cases are not
plain arrays of their own:

- two parameters added together (``a + b``) hold one array: Add's backward gives ``gy``
  to both (``a.grad is b.grad``);
- a parameter that is only summed whole (``F.sum(c)``) holds a read-only broadcast of one
  element (a zero stride).

StandardUpdater never writes a gradient. The updater does: where an update or a window
held fewer samples than nominal (the last of an epoch, ``repeat=False``) it scales the
gradient by a factor, which must scale a shared array once and cannot write a broadcast
in place; and pipelined mode copies the summed gradient into the model's arrays. Each
model below is trained against its *twin*, the
same function written so that every parameter gets an array of its own (``a * 1.0 + b``,
``F.sum(c * 1.0)``: the same values, bitwise), under each configuration, over an epoch
whose last update is short; and against StandardUpdater on one batch of the same samples.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
import chainer.functions as F
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._groups import ensure_grads
from mgpu_updater._replica import scale_gradients, writable_in_place

N_SAMPLES, BATCH = 10, 4   # updates of 4, 4 and 2 samples


class SharedGradient(chainer.Chain):
    """``a`` and ``b`` enter as their sum: one gradient array for both (``twin``: not)."""

    def __init__(self, twin=False):
        super().__init__()
        self.twin = twin
        with self.init_scope():
            self.a = chainer.Parameter(np.linspace(0.1, 0.7, 4).astype(np.float32))
            self.b = chainer.Parameter(np.linspace(-0.3, 0.2, 4).astype(np.float32))

    def forward(self, x, t):
        a = self.a * 1.0 if self.twin else self.a
        return F.mean((x * (a + self.b) - t) ** 2)


class SummedWhole(chainer.Chain):
    """``c`` appears only summed whole: a read-only broadcast gradient (``twin``: not)."""

    def __init__(self, twin=False):
        super().__init__()
        self.twin = twin
        with self.init_scope():
            self.w = chainer.Parameter(np.linspace(0.1, 0.7, 4).astype(np.float32))
            self.c = chainer.Parameter(np.linspace(-0.3, 0.2, 4).astype(np.float32))

    def forward(self, x, t):
        c = self.c * 1.0 if self.twin else self.c
        return F.mean((x * self.w - t) ** 2) + 0.25 * F.sum(c)


MODELS = {'shared': SharedGradient, 'summed_whole': SummedWhole}


def _data():
    rng = np.random.RandomState(0)
    return (rng.rand(N_SAMPLES, 4).astype(np.float32),
            rng.rand(N_SAMPLES, 4).astype(np.float32))


def _iterator(x, t, batch):
    return chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), batch,
                                            repeat=False, shuffle=False)


def _shards():
    """Two replicas: each global batch is the first replica's window and the second's,
    of 2, 2 and 1 samples (every window of the last update short)."""
    x, t = _data()
    return [(x[ix], t[ix]) for ix in ([0, 1, 4, 5, 8], [2, 3, 6, 7, 9])]


CONFIGS = {
    'one': dict(devices=['@numpy']),
    'one_k2': dict(devices=['@numpy'], accumulate_steps=2),
    'two': dict(devices=['@numpy'] * 2),
    'two_sum': dict(devices=['@numpy'] * 2, replica_reduction='sum'),
    'two_pipelined': dict(devices=['@numpy'] * 2, pipelined=True),
}


def _train(model, config):
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    kwargs = dict(CONFIGS[config])
    micro = BATCH // (len(kwargs['devices']) * kwargs.get('accumulate_steps', 1))
    if len(kwargs['devices']) == 1:
        iterators = _iterator(*_data(), micro)
    else:
        iterators = [_iterator(x, t, micro) for x, t in _shards()]
    updater = ParallelAccumulatingUpdater(iterators, optimizer, loss_func=model, **kwargs)
    updates = 0
    try:
        while True:
            try:
                updater.update()
            except StopIteration:
                break
            updates += 1
    finally:
        updater.finalize()
    assert updates == 3
    return {name: p.array.copy() for name, p in model.namedparams()}


def _standard(model):
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    updater = StandardUpdater(_iterator(*_data(), BATCH), optimizer, loss_func=model)
    for _ in range(3):
        updater.update()
    return {name: p.array.copy() for name, p in model.namedparams()}


@pytest.mark.parametrize('kind', sorted(MODELS))
def test_the_models_hold_the_gradients_they_are_about(kind):
    """The premise, on this Chainer: the shared array and the read-only broadcast."""
    model = MODELS[kind]()
    x, t = _data()
    model(x[:4], t[:4]).backward()
    if kind == 'shared':
        assert model.a.grad is model.b.grad
    else:
        assert not writable_in_place(model.c.grad) and not model.c.grad.flags.writeable
    twin = MODELS[kind](twin=True)
    twin(x[:4], t[:4]).backward()
    for (name, p), (_, q) in zip(sorted(model.namedparams()), sorted(twin.namedparams())):
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=name)
        assert writable_in_place(q.grad), name


@pytest.mark.parametrize('config', sorted(CONFIGS))
@pytest.mark.parametrize('kind', sorted(MODELS))
def test_a_short_last_update_trains_as_the_twin_with_arrays_of_its_own(kind, config):
    got = _train(MODELS[kind](), config)
    expected = _train(MODELS[kind](twin=True), config)
    start = {name: p.array for name, p in MODELS[kind]().namedparams()}
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert not np.array_equal(value, start[name]), f'{name} did not move'


@pytest.mark.parametrize('config', ['one', 'one_k2', 'two'])
@pytest.mark.parametrize('kind', sorted(MODELS))
def test_a_short_last_update_trains_as_standard_updater_on_one_batch(kind, config):
    got = _train(MODELS[kind](), config)
    expected = _standard(MODELS[kind]())
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _param(values):
    return chainer.Parameter(np.asarray(values, dtype=np.float32))


def test_scale_gradients_scales_a_shared_array_once_and_keeps_it_shared():
    a, b, c = _param([1, 2]), _param([3, 4]), _param([5, 6])
    shared = np.array([1.0, -2.0], np.float32)
    a.grad, b.grad = shared, shared
    c.grad = None
    scale_gradients([('a', a), ('b', b), ('c', c)], 0.5)
    assert a.grad is shared and b.grad is shared and c.grad is None
    np.testing.assert_array_equal(shared, [0.5, -1.0])


def test_scale_gradients_replaces_a_read_only_broadcast_for_every_holder():
    a, b = _param([1, 2, 3]), _param([4, 5, 6])
    broadcast = np.broadcast_to(np.float32(2.0), (3,))
    a.grad, b.grad = broadcast, broadcast
    scale_gradients([('a', a), ('b', b)], 3.0)
    assert a.grad is b.grad and a.grad is not broadcast
    assert writable_in_place(a.grad) and a.grad.dtype == np.float32
    np.testing.assert_array_equal(a.grad, [6.0, 6.0, 6.0])
    np.testing.assert_array_equal(broadcast, [2.0, 2.0, 2.0])


def test_writable_in_place_refuses_a_zero_stride_even_where_numpy_would_write():
    """CuPy has no read-only flag: a zero stride alone must say no."""
    base = np.zeros((1, 3), np.float32)
    strided = np.lib.stride_tricks.as_strided(base, shape=(4, 3), strides=(0, 4))
    assert strided.flags.writeable   # numpy would write it, each element four times
    assert not writable_in_place(strided)
    assert writable_in_place(np.zeros((4, 3), np.float32))
    assert not writable_in_place(np.broadcast_to(np.float32(1.0), (2,)))


def test_ensure_grads_copies_a_broadcast_keeping_its_values_and_fills_none():
    link = chainer.Link()
    with link.init_scope():
        link.p = _param([1, 2, 3])
        link.q = _param([4, 5, 6])
        link.r = _param([7, 8, 9])
    link.p.grad = np.broadcast_to(np.float32(2.5), (3,))
    own = np.array([1.0, 2.0, 3.0], np.float32)
    link.q.grad = own
    link.r.grad = None
    ensure_grads(link)
    assert writable_in_place(link.p.grad)
    np.testing.assert_array_equal(link.p.grad, [2.5, 2.5, 2.5])
    assert link.q.grad is own
    np.testing.assert_array_equal(link.r.grad, [0.0, 0.0, 0.0])


@pytest.mark.parametrize('config', ['one', 'two'])
def test_parameters_holding_one_gradient_array_keep_one_summed_array(config):
    """StandardUpdater steps ``a`` and ``b`` of ``a + b`` on one array, so an optimizer
    hook that writes it in place (WeightDecay) acts on it for both: so do ours, the summed
    gradient being one array for both (on two CPU replicas, one view of the master's
    slot, copied once at finalize). With ``accumulate_steps`` > 1 Chainer's own
    accumulation gives each its own array, as in a hand-written loop."""
    def optimizer(model):
        opt = chainer.optimizers.SGD(0.1)
        opt.setup(model)
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(0.1))
        return opt

    ref = SharedGradient()
    updater = StandardUpdater(_iterator(*_data(), BATCH), optimizer(ref), loss_func=ref)
    for _ in range(2):
        updater.update()
    model = SharedGradient()
    kwargs = dict(CONFIGS[config])
    if len(kwargs['devices']) == 1:
        iterators = _iterator(*_data(), BATCH)
    else:
        iterators = [_iterator(x, t, BATCH // 2) for x, t in _shards()]
    updater = ParallelAccumulatingUpdater(iterators, optimizer(model), loss_func=model,
                                          **kwargs)
    try:
        for _ in range(2):
            updater.update()
        assert model.a.grad is model.b.grad
    finally:
        updater.finalize()
    assert model.a.grad is model.b.grad   # after finalize too (a copy, once)
    for name, p in ref.namedparams():
        np.testing.assert_allclose(getattr(model, name[1:]).array, p.array, rtol=1e-6,
                                   atol=1e-7, err_msg=name)

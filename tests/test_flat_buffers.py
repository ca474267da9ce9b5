"""The flat layouts (mgpu_updater/_flat_buffers.py) on their own: where each named array
lives in the one buffer per dtype, pack/unpack round trips (float16 and the ``scale`` path
included), and which of a model's arrays each of ``ModelLayouts``' three layouts holds.
"""
from __future__ import annotations

import numpy
import pytest

import chainer
import chainer.links as L

import _models
from mgpu_updater._flat_buffers import (FlatLayout, ModelLayouts, grad_arrays,
                                        persistent_arrays, persistent_scalars,
                                        set_persistent_scalars, state_arrays)


def arrays():
    """Mixed dtypes, given out of name order, a 0-d array among them."""
    rng = numpy.random.RandomState(0)
    return {
        'c': rng.randn(5).astype(numpy.float32),
        'a': rng.randn(4).astype(numpy.float16),
        'b': rng.randn(2, 3).astype(numpy.float32),
        'd': numpy.array(rng.randn(), dtype=numpy.float64),
        'e': rng.randint(-9, 9, size=(3, 1)).astype(numpy.int32),
    }


def buffers_for(layout, fill=None):
    """What a communicator would allocate from ``layout.spec()``; ``fill``: garbage first."""
    bufs = {name: numpy.zeros(n, dtype) for name, (dtype, n) in layout.spec().items()}
    if fill is not None:
        for b in bufs.values():
            b[...] = fill
    return bufs


def test_sorted_names_grouped_by_dtype_with_offsets():
    data = arrays()
    layout = FlatLayout('grad', list(data.items()))
    assert {d: [tuple(e) for e in g] for d, g in layout.groups.items()} == {
        '<f2': [('a', 0, 4, (4,))],
        '<f4': [('b', 0, 6, (2, 3)), ('c', 6, 5, (5,))],
        '<f8': [('d', 0, 1, ())],
        '<i4': [('e', 0, 3, (3, 1))],
    }
    assert layout.sizes == {'<f2': 4, '<f4': 11, '<f8': 1, '<i4': 3}
    assert layout.spec() == {'grad/<f2': ('<f2', 4), 'grad/<f4': ('<f4', 11),
                             'grad/<f8': ('<f8', 1), 'grad/<i4': ('<i4', 3)}
    assert layout.buffer_names() == {'<f2': 'grad/<f2', '<f4': 'grad/<f4',
                                     '<f8': 'grad/<f8', '<i4': 'grad/<i4'}
    assert len(layout) == 5
    # the order the arrays come in does not matter: every rank gets the same layout
    again = FlatLayout('grad', list(reversed(list(data.items()))))
    assert again.groups == layout.groups and again.sizes == layout.sizes


def test_pack_then_unpack_round_trips_bitwise_in_place():
    data = arrays()
    layout = FlatLayout('x', list(data.items()))
    bufs = buffers_for(layout, fill=7)
    layout.pack(data, bufs.__getitem__)
    numpy.testing.assert_array_equal(
        bufs['x/<f4'], numpy.concatenate([data['b'].ravel(), data['c']]))
    assert bufs['x/<f2'].dtype == numpy.float16
    out = {k: numpy.full_like(v, 3) for k, v in data.items()}
    ids = {k: id(v) for k, v in out.items()}
    layout.unpack(bufs.__getitem__, out)
    for k, v in data.items():
        assert {id(out[k])} == {ids[k]}          # the same arrays, written in place
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert out[k].tobytes() == v.tobytes()   # bitwise


def test_pack_writes_zeros_where_an_array_is_none():
    data = arrays()
    layout = FlatLayout('grad', list(data.items()))
    bufs = buffers_for(layout, fill=5)
    data['b'] = None   # a parameter without a gradient
    layout.pack(data, bufs.__getitem__)
    assert (bufs['grad/<f4'][:6] == 0).all()
    numpy.testing.assert_array_equal(bufs['grad/<f4'][6:], data['c'])


@pytest.mark.parametrize('scale', [0.25, numpy.float64(0.25), numpy.float32(0.25)])
def test_scale_keeps_float16_as_float16(scale):
    """The ``scale`` path (a multiply with ``casting='unsafe'``) writes float16 into the
    float16 buffer and back, whatever the type of the scale (a Python float, a numpy
    float64 or float32 scalar)."""
    data = {'h': numpy.array([1.5, -2.0, 65504.0, 0.0625], numpy.float16),
            'f': numpy.array([3.0, -0.5], numpy.float32)}
    layout = FlatLayout('grad', list(data.items()))
    bufs = buffers_for(layout)
    layout.pack(data, bufs.__getitem__, scale=scale)
    assert bufs['grad/<f2'].dtype == numpy.float16
    # a power of two: the product is exact in float16, whatever type computed it
    assert bufs['grad/<f2'].tobytes() == (data['h'] / numpy.float16(4)).tobytes()
    assert bufs['grad/<f4'].tobytes() == (data['f'] / numpy.float32(4)).tobytes()
    out = {'h': numpy.zeros(4, numpy.float16), 'f': numpy.zeros(2, numpy.float32)}
    layout.unpack(bufs.__getitem__, out, scale=1 / scale)
    assert out['h'].dtype == numpy.float16
    assert out['h'].tobytes() == data['h'].tobytes()
    assert out['f'].tobytes() == data['f'].tobytes()


def test_renamed_is_the_same_layout_under_other_buffer_names():
    data = arrays()
    layout = FlatLayout('grad', list(data.items()))
    other = layout.renamed('grad1')
    assert layout.prefix == 'grad' and other.prefix == 'grad1'
    assert other.groups == layout.groups and other.sizes == layout.sizes
    assert set(other.spec()) == {k.replace('grad/', 'grad1/') for k in layout.spec()}
    bufs = buffers_for(other)
    other.pack(data, bufs.__getitem__)
    numpy.testing.assert_array_equal(bufs['grad1/<f2'], data['a'])
    with pytest.raises(KeyError, match='grad/<f2'):   # the original's names are not its
        layout.pack(data, bufs.__getitem__)


class _WithPersistents(chainer.Chain):
    """A BatchNorm model plus an integer array persistent and a scalar one at the root."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.predictor = _models.MLP(batchnorm=True)
        self.add_persistent('counts', numpy.arange(3, dtype=numpy.int32))
        self.add_persistent('steps', 7)


def test_model_layouts_grad_stat_state():
    model = _WithPersistents()
    layouts = ModelLayouts(model)
    params = sorted(name for name, _ in model.namedparams())
    assert [e.name for g in layouts.grad.groups.values() for e in g] == params
    # stat: the float array persistents only (BatchNorm's running statistics)
    assert [e.name for g in layouts.stat.groups.values() for e in g] == [
        '/predictor/bn/avg_mean', '/predictor/bn/avg_var']
    # state: every parameter and array persistent, the integer one too; wire name 'param'
    state_names = sorted(e.name for g in layouts.state.groups.values() for e in g)
    assert state_names == sorted(params + ['/counts', '/predictor/bn/avg_mean',
                                           '/predictor/bn/avg_var'])
    assert layouts.state.groups['<i4'] == [('/counts', 0, 3, (3,))]
    assert set(layouts.spec()) == {'grad/<f4', 'stat/<f4', 'param/<f4', 'param/<i4'}
    n_params = sum(p.size for p in model.params())
    assert layouts.spec()['grad/<f4'] == ('<f4', n_params)
    assert layouts.spec()['param/<f4'] == ('<f4', n_params + 2 * 16)


def test_model_layouts_double_buffered_grad_sets():
    model = _models.classifier(batchnorm=True)
    single = ModelLayouts(model)
    double = ModelLayouts(model, double_buffered=True)
    assert single.grad_set(None) is single.grad
    assert 'grad0/<f4' not in single.spec()
    assert {'grad/<f4', 'grad0/<f4', 'grad1/<f4'} <= set(double.spec())
    for parity in (0, 1):
        grads = double.grad_set(parity)
        assert grads.prefix == f'grad{parity}' and grads is double.grad_set(parity)
        assert grads.groups == double.grad.groups
        assert double.spec()[f'grad{parity}/<f4'] == double.spec()['grad/<f4']


def test_model_layouts_leave_out_parameters_without_an_array():
    """A lazy link no forward called has no array and no gradient to share (the replicas'
    windows refuse one a later call initialises)."""
    model = _models.classifier(lazy=True)
    layouts = ModelLayouts(model)
    assert '/predictor/l1/W' not in layouts.grad.names | layouts.state.names
    assert '/predictor/l1/b' in layouts.grad.names & layouts.state.names


def test_state_travels_from_one_replica_to_another():
    """The master's state (parameters, array persistents), packed, unpacked into another
    replica, and the scalar persistents beside it: the replica then equals the master."""
    master, replica = _WithPersistents(), _WithPersistents()
    rng = numpy.random.RandomState(1)
    for _, a in state_arrays(master).items():
        a[...] = rng.randint(-50, 50, a.shape).astype(a.dtype)
    master.steps = 11
    master.predictor.bn.N = 4
    for p in master.params():
        p.grad = numpy.ones_like(p.array)
    layouts = ModelLayouts(master)
    bufs = buffers_for(layouts.state)
    layouts.state.pack(state_arrays(master), bufs.__getitem__)
    layouts.state.unpack(bufs.__getitem__, state_arrays(replica))
    set_persistent_scalars(replica, persistent_scalars(master))
    for (name, a), (_, b) in zip(sorted(state_arrays(master).items()),
                                 sorted(state_arrays(replica).items())):
        assert a.tobytes() == b.tobytes(), name
    assert persistent_scalars(replica) == {'/steps': 11, '/predictor/bn/N': 4}
    assert dict(persistent_arrays(replica)).keys() == {
        '/counts', '/predictor/bn/avg_mean', '/predictor/bn/avg_var'}
    # gradients are not state: the master's (all ones) did not travel
    assert not any(g is not None and (g == 1).all() for g in grad_arrays(replica).values())


def test_persistent_helpers_on_a_batchnorm_link():
    bn = L.BatchNormalization(3)
    assert [name for name, _ in persistent_arrays(bn)] == ['/avg_mean', '/avg_var']
    assert persistent_scalars(bn) == {'/N': 0}
    set_persistent_scalars(bn, {'/N': 5})
    assert bn.N == 5


def test_the_index_reads_what_a_fresh_walk_reads_after_arrays_change():
    """``ModelLayouts.index`` keeps the parameters and each persistent's owner, found once;
    every read is of the current arrays and values: after the arrays and persistents were
    replaced (as a deserializer does) and changed, it gives what walking the model anew
    gives, and setting scalars through it sets them on the model."""
    model = _WithPersistents()
    layouts = ModelLayouts(model)
    index = layouts.index_of(model)
    assert index is layouts.index and index.link is model
    rng = numpy.random.RandomState(2)
    for p in model.params():
        p.array = rng.randn(*p.shape).astype(p.dtype)       # a new array, not in place
        p.grad = rng.randn(*p.shape).astype(p.dtype)
    bn = model.predictor.bn
    bn.__dict__['avg_mean'] = rng.randn(16).astype(numpy.float32)   # as serialize loads it
    model.steps = 13
    bn.N = 9

    def same(a, b):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name] is b[name], name
    same(index.param_arrays(), {n: p.array for n, p in model.namedparams()})
    same(index.grad_arrays(), grad_arrays(model))
    same(index.state_arrays(), state_arrays(model))
    same(dict(index.persistent_arrays()), dict(persistent_arrays(model)))
    assert dict(index.persistent_arrays())['/predictor/bn/avg_mean'] is bn.avg_mean
    assert index.persistent_scalars() == persistent_scalars(model) == {
        '/steps': 13, '/predictor/bn/N': 9}
    index.set_persistent_scalars({'/steps': 21, '/predictor/bn/N': 3})
    assert (model.steps, bn.N) == (21, 3)


def test_the_index_of_another_model_is_that_models():
    """A model that is not the one the layouts were built from gets a walk of its own."""
    model, other = _WithPersistents(), _WithPersistents()
    layouts = ModelLayouts(model)
    other.steps = 5
    index = layouts.index_of(other)
    assert index is not layouts.index and index.link is other
    assert index.persistent_scalars()['/steps'] == 5
    assert all(a is p.array for (_, a), p in zip(sorted(index.param_arrays().items()),
                                                 [p for _, p in sorted(other.namedparams())]))

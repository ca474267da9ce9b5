"""A skipped update (``nonfinite='skip'``) leaves the model as it was before it.

Its forward passes moved the model's persistents already: BatchNorm's running statistics,
which a NaN sample makes NaN, for good (every evaluation after it is NaN while training
goes on finite). The step is not taken, and the persistents are set back with it: after
the skipped update the model is bitwise what it was after the update before, on one
replica (StandardUpdater's way, ``_update_direct``, and a window of micro-batches) and on
two (the NaN in the worker's shard: the master's statistics are the replicas' mean).
Under ``'raise'`` the error says that the persistents moved.
"""
import warnings

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from mgpu_updater import NonFiniteLossError, ParallelAccumulatingUpdater

BATCH = 4
BAD_UPDATE = 3


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 8)
            self.bn = L.BatchNormalization(8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x):
        return self.l2(F.relu(self.bn(self.l1(x))))


def make_model():
    numpy.random.seed(0)
    return L.Classifier(Net())


def dataset(n_replicas, k):
    """Per replica's shard ``data[r::n]``: a NaN in the last replica's first sample of
    update BAD_UPDATE."""
    rng = numpy.random.RandomState(1)
    per_update = n_replicas * k * BATCH
    x = rng.normal(size=(per_update * 6, 4)).astype(numpy.float32)
    t = rng.randint(0, 3, len(x)).astype(numpy.int32)
    row = ((BAD_UPDATE - 1) * k * BATCH) * n_replicas + (n_replicas - 1)
    x[row, 0] = numpy.nan
    return x, t


def build(n_replicas, k, nonfinite, **kwargs):
    x, t = dataset(n_replicas, k)
    data = chainer.datasets.TupleDataset(x, t)
    its = [chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x[r::n_replicas], t[r::n_replicas]), BATCH,
        shuffle=False) for r in range(n_replicas)]
    assert len(data) == sum(len(it.dataset) for it in its)
    model = make_model()
    optimizer = chainer.optimizers.MomentumSGD(0.1)
    optimizer.setup(model)
    return ParallelAccumulatingUpdater(
        its if n_replicas > 1 else its[0], optimizer, devices=['@numpy'] * n_replicas,
        accumulate_steps=k, nonfinite=nonfinite, prefetch=0, **kwargs)


def state(model):
    out = {name: p.array.copy() for name, p in model.namedparams()}
    out.update({'bn/avg_mean': model.predictor.bn.avg_mean.copy(),
                'bn/avg_var': model.predictor.bn.avg_var.copy(),
                'bn/N': model.predictor.bn.N})
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        numpy.testing.assert_array_equal(a[name], b[name], err_msg=name)


def run(updater, model, updates):
    """The model's state after each update, and the skips warned about."""
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(updates):
            updater.update()
            states.append(state(model))
    return states, [str(w.message) for w in caught if 'skipping' in str(w.message)]


@pytest.mark.parametrize('n_replicas,k', [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_a_skipped_update_sets_the_statistics_back(n_replicas, k):
    updater = build(n_replicas, k, 'skip')
    model = updater.get_optimizer('main').target
    try:
        states, skipped = run(updater, model, BAD_UPDATE + 2)
        assert skipped == [f'skipping update {BAD_UPDATE}: the loss is nan']
        # the skipped update left everything as the update before it did
        assert_same(states[BAD_UPDATE - 1], states[BAD_UPDATE - 2])
        # and training went on from there: it moved, and nothing is NaN
        assert not numpy.array_equal(states[-1]['bn/avg_mean'],
                                     states[BAD_UPDATE - 1]['bn/avg_mean'])
        for name, value in states[-1].items():
            assert numpy.isfinite(value).all(), name
        # the test-mode forward of the master's model is finite
        x, t = dataset(n_replicas, k)
        with chainer.using_config('train', False):
            loss = model(x[:8], t[:8])
        assert numpy.isfinite(float(loss.array))
    finally:
        updater.finalize()


@pytest.mark.parametrize('n_replicas', [1, 2])
def test_pipelined_skips_an_update_late_and_leaves_the_statistics(n_replicas):
    """``pipelined=True`` steps on each update's gradient at the next update, so the NaN
    of update 3 is skipped at update 4; a snapshot may lie between the two, so the
    statistics are not set back there (docs/pipelined.md): they keep the NaN, and the
    parameters are those of update 3 (update 2's gradient, stepped then)."""
    updater = build(n_replicas, 1, 'skip', pipelined=True)
    model = updater.get_optimizer('main').target
    try:
        states, skipped = run(updater, model, BAD_UPDATE + 1)
        assert skipped == [f'skipping the step of update {BAD_UPDATE}, due at update '
                           f'{BAD_UPDATE + 1} (pipelined): the loss is nan']
        after_skip = states[BAD_UPDATE]
        assert numpy.isnan(after_skip['bn/avg_mean']).all()
        for name in after_skip:
            if not name.startswith('bn/'):
                numpy.testing.assert_array_equal(after_skip[name],
                                                 states[BAD_UPDATE - 1][name], err_msg=name)
    finally:
        updater.finalize()


def test_without_the_fix_the_statistics_would_be_nan():
    """What the test above guards against: the skipped update's NaN statistics (here
    read before they are set back, at the step's decision)."""
    updater = build(2, 1, 'skip')
    model = updater.get_optimizer('main').target
    seen = []
    restore = updater._set_back

    def look(of_update):
        seen.append(model.predictor.bn.avg_mean.copy())
        restore(of_update)
    updater._set_back = look
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)
            for _ in range(BAD_UPDATE):
                updater.update()
        assert len(seen) == 1 and numpy.isnan(seen[0]).all()
        assert numpy.isfinite(model.predictor.bn.avg_mean).all()
    finally:
        updater.finalize()


@pytest.mark.parametrize('n_replicas', [1, 2])
def test_raise_says_that_the_statistics_moved(n_replicas):
    updater = build(n_replicas, 1, 'raise')
    try:
        with pytest.raises(NonFiniteLossError) as info:
            for _ in range(BAD_UPDATE):
                updater.update()
        assert info.value.iteration == BAD_UPDATE and not info.value.applied
        assert any("The model's persistents (BatchNorm's running statistics) hold what "
                   "this update's forward passes made of them" in note
                   for note in getattr(info.value, '__notes__', []))
    finally:
        updater.finalize()

"""Each worker's copy of the model holds what the model holds, or the start says why not.

A worker gets the model as ``copy.deepcopy`` and then pickling make it. A link's own
``__reduce__``, ``__getstate__`` or ``__deepcopy__`` decides what that copy holds: one that
rebuilds the link from its constructor's arguments leaves out a parameter added after it,
or breaks a tie, and every replica lays out its buffers from its own copy, so every
parameter after the one missing was summed at another's offset (0.07-0.12 off in three
updates, no error). One that returns ``self`` made the master's own model the workers'
"copy", and preparing it removed the master's update rules. Both are refused at the
start, naming what differs; a copy that fails names the link it fails on.
"""
import copy

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from mgpu_updater import ParallelAccumulatingUpdater


class RebuiltLinear(L.Linear):
    """Pickled (and deep-copied) by rebuilding from its constructor's arguments."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self._args = (n_in, n_out)

    def __reduce__(self):
        return type(self), self._args


class RebuiltWhenPickled(RebuiltLinear):
    """Deep-copied whole, but pickled by rebuilding: only the worker's copy differs."""

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class SharedOnCopy(L.Linear):
    def __deepcopy__(self, memo):
        return self


class RefusesCopy(L.Linear):
    def __deepcopy__(self, memo):
        raise RuntimeError('this link is not to be copied')


class Net(chainer.Chain):
    def __init__(self, first=L.Linear):
        super().__init__()
        with self.init_scope():
            self.l1 = first(5, 6)
            self.l2 = L.Linear(6, 3)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def build(net, n_replicas=2):
    numpy.random.seed(0)
    model = L.Classifier(net)
    rng = numpy.random.RandomState(0)
    x = rng.normal(size=(64, 5)).astype(numpy.float32)
    t = rng.randint(0, 3, 64).astype(numpy.int32)
    its = [chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x[r::n_replicas], t[r::n_replicas]), 4)
        for r in range(n_replicas)]
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    return ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * n_replicas)


def start(updater):
    try:
        updater.update()
    finally:
        updater.finalize()


def with_added_param(first):
    net = Net(first)
    with net.l1.init_scope():
        net.l1.g = chainer.Parameter(numpy.zeros(2, numpy.float32))
    return net


def test_a_parameter_the_copy_leaves_out_is_refused():
    updater = build(with_added_param(RebuiltLinear))
    with pytest.raises(RuntimeError, match=(
            r"^the copy of the model for the worker processes differs from the model "
            r"\(only in the model: \['/predictor/l1/g'\]\)\. .*rebuilds it from its "
            r"constructor's arguments leaves out what was added to it after")):
        start(updater)


def test_a_copy_that_unpickling_changes_is_refused_by_the_worker():
    """Deep-copied whole (the master's look passes), pickled without ``g``: the worker
    compares what it unpickled with the master's model and fails its start."""
    updater = build(with_added_param(RebuiltWhenPickled))
    with pytest.raises(Exception) as info:
        start(updater)
    text = str(info.value)
    assert 'the copy of the model for the worker processes differs from the model' in text
    assert "only in the model: ['/predictor/l1/g']" in text


def test_a_tie_the_copy_breaks_is_refused():
    net = Net(RebuiltLinear)
    with net.init_scope():
        net.l3 = L.Linear(5, 6)
    net.l3.W = net.l1.W   # tied: one parameter, which the rebuilt l1 does not keep
    updater = build(net)
    with pytest.raises(RuntimeError, match=r"only in the copy: \['/predictor/l3/W'\]"):
        start(updater)


def test_the_same_link_rebuilt_whole_trains():
    """The check refuses only what differs: a rebuilt link with nothing added trains."""
    updater = build(Net(RebuiltLinear))
    model = updater.get_optimizer('main').target
    before = model.predictor.l2.W.array.copy()
    try:
        updater.update()
        updater.update()
    finally:
        updater.finalize()
    assert not numpy.array_equal(before, model.predictor.l2.W.array)


def test_a_deepcopy_that_returns_the_link_itself_is_refused_and_the_model_kept():
    updater = build(Net(SharedOnCopy))
    model = updater.get_optimizer('main').target
    with pytest.raises(TypeError, match=(
            r"^copy\.deepcopy\(model\) returned model\.predictor\.l1 \(SharedOnCopy\) "
            r"itself, not a copy")):
        start(updater)
    # the master's parameters keep their update rules: its optimizer still steps
    assert all(p.update_rule is not None for p in model.params())


def test_a_copy_that_fails_names_the_link_and_no_lazy_pass():
    updater = build(Net(RefusesCopy))
    with pytest.raises(TypeError) as info:
        start(updater)
    text = str(info.value)
    assert text.startswith('the model (Classifier) cannot be copied for the worker '
                           'processes: RuntimeError: this link is not to be copied; the '
                           'culprit is model.predictor.l1 (')
    assert 'lazy' not in text

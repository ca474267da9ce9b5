"""``shard_iterators``' shards: a partition of the dataset that indexes as SubDataset does."""
from __future__ import annotations

import pickle

import numpy
import numpy as np
import pytest

import chainer

from mgpu_updater import shard_iterators
from mgpu_updater._iterators import Shard

from _models import dataset


def _shards(data, n, seed=0):
    return [it.dataset for it in shard_iterators(data, n, 4, seed=seed)]


def _same(a, b):
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize('seed', [0, None])
def test_shards_partition_the_dataset(seed):
    data = dataset(23, seed=3)
    shards = _shards(data, 3, seed)
    assert sorted(len(s) for s in shards) == [7, 8, 8]
    seen = [tuple(np.asarray(s[i][0]).tolist()) for s in shards for i in range(len(s))]
    everything = [tuple(np.asarray(data[i][0]).tolist()) for i in range(len(data))]
    assert sorted(seen) == sorted(everything)


def test_a_shard_indexes_exactly_as_the_sub_dataset_it_is():
    data = dataset(23, seed=3)
    order = np.random.RandomState(0).permutation(len(data))
    shard = Shard(data, 8, 16, order=order)
    reference = chainer.datasets.SubDataset(data, 8, 16, order=order)
    assert isinstance(shard, chainer.datasets.SubDataset) and len(shard) == len(reference)
    for i in list(range(-8, 8)) + [np.int64(3), np.int32(-2), np.intp(-8), np.int16(5),
                                   np.uint8(7), True, False]:
        _same(shard[i], reference[i])
    for index in (slice(1, 6, 2), [0, 7, -1], np.array([5, 2])):
        _same(shard[index], reference[index])
    for bad in (8, -9, np.int64(100), np.int32(-9), np.uint16(8)):
        with pytest.raises(IndexError):
            reference[bad]
        with pytest.raises(IndexError):
            shard[bad]
    copy = pickle.loads(pickle.dumps(shard))
    _same([copy[i] for i in range(8)], [shard[i] for i in range(8)])


def test_shard_iterators_batches_follow_the_shard_order():
    data = dataset(16, seed=4)
    it = shard_iterators(data, 2, 4, seed=5)[1]
    order = np.random.RandomState(5).permutation(16)
    batch = it.next()
    within = it._state.order[:4]   # the iterator's own shuffle of its shard
    _same(batch, [data[int(order[8 + j])] for j in within])


class _NoSampler(chainer.iterators.SerialIterator):
    """An iterator class of one's own that takes no order_sampler."""

    def __init__(self, dataset, batch_size, repeat=True, shuffle=None):
        super().__init__(dataset, batch_size, repeat=repeat, shuffle=shuffle)


@pytest.mark.parametrize('iterator_class', [
    chainer.iterators.SerialIterator, chainer.iterators.MultithreadIterator,
    chainer.iterators.MultiprocessIterator])
def test_shard_iterators_shuffle_with_their_seed_whatever_chainer_iterator(iterator_class):
    """The same seed gives the same batches, whatever numpy's global generator does
    between the calls (MultithreadIterator shuffled with numpy's global generator)."""
    firsts = []
    for draw in range(2):
        np.random.seed(draw)
        its = shard_iterators(np.arange(40), 2, 4, iterator_class=iterator_class, seed=0)
        try:
            firsts.append([list(it.next()) for it in its for _ in range(3)])
        finally:
            for it in its:
                it.finalize()
    assert firsts[0] == firsts[1]


def test_shard_iterators_give_a_class_without_order_sampler_shuffle():
    its = shard_iterators(np.arange(40), 2, 4, iterator_class=_NoSampler, seed=0)
    assert [it.order_sampler is not None for it in its] == [True, True]   # shuffle=True


@pytest.mark.parametrize('kwargs, error, said', [
    (dict(shuffle='no'), TypeError, r"^shuffle must be True or False \('no' of type str"),
    (dict(shuffle=None), TypeError, r'^shuffle must be True or False \(None'),
    (dict(seed='abc'), TypeError, r"^seed must be None or an int from 0 to 2\*\*32 - 1 "
                                  r"\('abc' of type str given\); pass e\.g\. seed=0"),
    (dict(seed=True), TypeError, r'^seed must be None or an int'),
    (dict(seed=-1), ValueError, r'^seed must be None or an int from 0 to 2\*\*32 - 1 \(-1'),
    (dict(seed=2 ** 32), ValueError, r'^seed must be None or an int'),
])
def test_shard_iterators_refuse_what_would_train_otherwise_naming_it(kwargs, error, said):
    with pytest.raises(error, match=said):
        shard_iterators(dataset(20, seed=0), 2, 4, **kwargs)


def test_shard_iterators_take_the_largest_seed():
    """Each iterator shuffles with a seed derived from ``seed``: within numpy's range."""
    first = [next(it) for it in shard_iterators(dataset(20, seed=0), 2, 4, seed=2 ** 32 - 1)]
    assert [len(b) for b in first] == [4, 4]


def test_shard_iterators_name_a_dataset_without_a_length():
    with pytest.raises(TypeError, match=r'^dataset must have a length and be indexable, as a '
                                        r'TupleDataset, a list or an array is \(.*given\); '
                                        r'pass the dataset itself, not an iterator over it'):
        shard_iterators(chainer.iterators.SerialIterator(dataset(20, seed=0), 4), 2, 4)
    with pytest.raises(ValueError, match=r'fewer than the 32 shards asked for \(shard_iterators'
                                         r'\(dataset, n, batch_size\): n is the number of '
                                         r'devices\)'):
        shard_iterators(dataset(20, seed=0), 32, 2)


def test_shard_iterators_take_what_chainer_and_numpy_take_for_flags_and_seeds():
    """shuffle=0 or 1 (argparse's type=int), a seed as a 0-d numpy array: as before."""
    def first(**kwargs):
        return [next(it)[0][0].tolist() for it in shard_iterators(dataset(20, seed=0), 2, 4,
                                                                   **kwargs)]
    assert first(shuffle=1, seed=numpy.array(3)) == first(shuffle=True, seed=3)
    assert first(shuffle=0) == first(shuffle=False)


def test_a_datasets_own_error_in_its_length_is_its_own():
    class Broken:
        def __len__(self):
            raise TypeError('the dataset could not count its files')

        def __getitem__(self, i):
            return i
    with pytest.raises(TypeError, match='^the dataset could not count its files$'):
        shard_iterators(Broken(), 2, 4)


def test_an_order_sampler_given_is_each_shards_own_copy():
    """One sampler object for every shard drew for each shard in turn in one process
    (StandardUpdater over these iterators), while a worker process's shard drew from its
    own pickled copy: each shard then read other samples than in that process, from the
    second epoch on. Each shard now has its own copy, in the state given."""
    sampler = chainer.iterators.ShuffleOrderSampler(np.random.RandomState(3))
    its = shard_iterators(dataset(16, seed=1), 2, 4, order_sampler=sampler)
    assert its[0].order_sampler is sampler and its[1].order_sampler is not sampler
    in_a_worker = pickle.loads(pickle.dumps(its[1]))   # what the worker process gets

    def seen(it):
        return [float(x[0]) for x, _ in it.next()]

    together = [(seen(its[0]), seen(its[1])) for _ in range(6)]   # three epochs
    assert [second for _, second in together] == [seen(in_a_worker) for _ in range(6)]
    # each in the state given: the first shard's first draw came before no copy
    fresh = shard_iterators(dataset(16, seed=1), 2, 4, order_sampler=(
        chainer.iterators.ShuffleOrderSampler(np.random.RandomState(3))))
    states = [it.order_sampler._random.get_state() for it in fresh]
    assert np.array_equal(states[0][1], states[1][1]) and states[0][2] == states[1][2]

"""Each worker receives only its shard of the dataset (``shard_iterators``).

A worker's iterator travels pickled (:mod:`mgpu_updater._payload`); its ``Shard`` used to
carry the whole base dataset, so every worker received every replica's data. Now, for the
datasets that hold their examples in memory, it carries a copy of its own examples in its
order: the pickle is about the shard's share, every index gives the same example, the
iterator draws the same batches and its snapshots resume exactly; training is what it was
(bit for bit) and what StandardUpdater does on the global batch.
"""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import chainer
from chainer.iterators import MultiprocessIterator, SerialIterator
from chainer.serializers import NpzDeserializer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, _payload, shard_iterators
from mgpu_updater._checkpoint import capture_state, load_state
from mgpu_updater._iterators import Shard, compact
from mgpu_updater._local.group import Payload

from _models import classifier, params, run_updates, setup_optimizer

N, FEATURES, SHARDS = 300, 64, 3


def _arrays(n=N, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, FEATURES).astype(np.float32),
            rng.randint(0, 3, n).astype(np.int32))


def _double(example):
    x, t = example
    return x * 2, t


def _datasets():
    """Every kind whose shards travel alone, by name (built afresh for each test)."""
    x, t = _arrays()
    return {
        'array': lambda: x.copy(),
        'list': lambda: [(row, label) for row, label in zip(x, t)],
        'tuple': lambda: tuple(zip(x, t)),
        'TupleDataset': lambda: chainer.datasets.TupleDataset(x.copy(), t.copy()),
        'DictDataset': lambda: chainer.datasets.DictDataset(x=x.copy(), t=t.copy()),
        'split_dataset_random': lambda: chainer.datasets.split_dataset_random(
            chainer.datasets.TupleDataset(x.copy(), t.copy()), N, seed=3)[0],
        'SubDataset of SubDataset': lambda: chainer.datasets.SubDataset(
            chainer.datasets.split_dataset_random(
                chainer.datasets.TupleDataset(x.copy(), t.copy()), N // 5,
                seed=4)[1], 10, N - N // 5 - 10),
        'TransformDataset': lambda: chainer.datasets.TransformDataset(
            chainer.datasets.TupleDataset(x.copy(), t.copy()), _double),
        'TupleDataset of lists': lambda: chainer.datasets.TupleDataset(list(x), list(t)),
    }


KINDS = sorted(_datasets())


class FromMemory(chainer.dataset.DatasetMixin):
    """A dataset of the user's own, holding its examples in memory: it travels whole."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def get_example(self, i):
        return self.x[i]


def _size(obj):
    return len(_payload.dumps(obj))


def _same(a, b):
    """The same example (or batch): equal values of the same types, recursively."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    else:
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('kind', KINDS)
def test_a_workers_iterator_pickles_about_its_shards_share(kind):
    dataset = _datasets()[kind]()
    whole = _size(dataset)
    for it in shard_iterators(dataset, SHARDS, 4):
        assert _size(it) < 0.6 * whole, kind


@pytest.mark.parametrize('kind', KINDS)
def test_the_travelled_shard_holds_the_same_examples_in_the_same_order(kind):
    dataset = _datasets()[kind]()
    for shard in (it.dataset for it in shard_iterators(dataset, SHARDS, 4, seed=7)):
        travelled = pickle.loads(_payload.dumps(shard))
        assert type(travelled) is Shard and len(travelled) == len(shard)
        for i in list(range(len(shard))) + [-1, -len(shard), np.int64(5)]:
            _same(travelled[i], shard[i])
        for index in (slice(2, 9, 3), [4, 0, -1], np.array([7, 1])):
            _same(travelled[index], shard[index])
        with pytest.raises(IndexError):
            travelled[len(shard)]


@pytest.mark.parametrize('kind', ['TupleDataset', 'list', 'split_dataset_random'])
@pytest.mark.parametrize('iterator_class', [SerialIterator, MultiprocessIterator])
def test_the_travelled_iterator_draws_and_resumes_as_the_original(kind, iterator_class,
                                                                    monkeypatch):
    """Three epochs of batches (reshuffled each epoch), a snapshot in the middle, and a
    resume from it, against a twin that never travelled (a SerialIterator) or travelled
    whole, as before (a MultiprocessIterator: Chainer's ``__setstate__`` draws one order
    from the shuffling generator before restoring the pickled one, so any unpickled copy
    shuffles its second epoch differently from the original,
    chainer/iterators/multiprocess_iterator.py:290-298)."""
    kwargs = dict(n_processes=1, n_prefetch=1) if iterator_class is MultiprocessIterator \
        else {}
    dataset = _datasets()[kind]()
    twins = shard_iterators(dataset, SHARDS, 8, seed=5, iterator_class=iterator_class,
                            **kwargs)
    unused = []
    if iterator_class is MultiprocessIterator:
        with monkeypatch.context() as patch:
            patch.setattr(Shard, '__reduce_ex__', object.__reduce_ex__)
            unused, twins = twins, [pickle.loads(_payload.dumps(it)) for it in twins]
            assert all(_size(it) > _size(dataset) for it in twins)
    sent = shard_iterators(dataset, SHARDS, 8, seed=5, iterator_class=iterator_class,
                           **kwargs)
    travelled = [pickle.loads(_payload.dumps(it)) for it in sent]
    resumed = []
    try:
        for twin, original, it in zip(twins, sent, travelled):
            assert _size(it) < 0.6 * _size(dataset)
            for _ in range(17):   # 100 examples a shard, batches of 8: 2 epochs and more
                _same(it.next(), twin.next())
            assert it.epoch == twin.epoch == 1
            # a snapshot as the updater takes it (the shuffling generator included)
            snapshot = capture_state(it)
            _same(snapshot, capture_state(twin))
            again = pickle.loads(_payload.dumps(original))   # a fresh start, then resume
            resumed.append(again)
            load_state(again, NpzDeserializer(snapshot))
            for _ in range(13):
                batch = twin.next()
                _same(it.next(), batch)
                _same(again.next(), batch)
    finally:
        for it in unused + twins + sent + travelled + resumed:
            it.finalize()


def test_a_memmap_travels_as_its_shard_as_it_travelled_whole(tmp_path, monkeypatch):
    """A memory-mapped array pickles its contents (all of them, before): each worker now
    gets its shard's rows, as the ndarray rows an unpickled memmap gives."""
    x, t = _arrays()
    np.save(tmp_path / 'x.npy', x)
    mapped = np.load(tmp_path / 'x.npy', mmap_mode='r')
    dataset = chainer.datasets.TupleDataset(mapped, t)
    shards = [it.dataset for it in shard_iterators(dataset, SHARDS, 4)]
    with monkeypatch.context() as patch:
        patch.setattr(Shard, '__reduce_ex__', object.__reduce_ex__)
        before = [pickle.loads(_payload.dumps(s)) for s in shards]
        assert all(_size(s) > _size(x) for s in shards)
    for shard, old in zip(shards, before):
        assert _size(shard) < 0.6 * _size(x)
        travelled = pickle.loads(_payload.dumps(shard))
        for i in range(len(shard)):
            _same(travelled[i], old[i])


def test_a_dataset_of_another_kind_travels_whole_and_works():
    x, _ = _arrays()
    dataset = FromMemory(x)
    assert compact(dataset, np.arange(3)) is None
    whole = _size(dataset)
    for it in shard_iterators(dataset, SHARDS, 4):
        assert _size(it) > whole            # what the docstring says it costs
        travelled = pickle.loads(_payload.dumps(it))
        _same(travelled.next(), it.next())


def test_a_tuple_dataset_with_one_column_of_another_kind_travels_whole():
    """A column that is not known to hold its examples (it may read files) is never
    indexed in bulk: the whole dataset travels, unread."""
    x, t = _arrays()
    reads = []

    class Counted(FromMemory):
        def get_example(self, i):
            reads.append(i)
            return super().get_example(i)

    dataset = chainer.datasets.TupleDataset(Counted(x), t)
    shard = shard_iterators(dataset, SHARDS, 4)[1].dataset
    assert compact(dataset, np.arange(5)) is None
    travelled = pickle.loads(_payload.dumps(shard))
    assert reads == []
    _same(travelled[3], shard[3])


def test_a_shard_of_the_whole_dataset_in_order_pickles_as_it_is():
    x, t = _arrays(12)
    (it,) = shard_iterators(chainer.datasets.TupleDataset(x, t), 1, 4, seed=None)
    travelled = pickle.loads(pickle.dumps(it.dataset))
    assert len(travelled) == 12 and travelled._indices == list(range(12))
    _same(travelled[5], it.dataset[5])


# ------------------------------------------------------------------ training
def _train(monkeypatch, travel_whole, updates=4, k=2):
    """Three '@numpy' replicas over shards of one TupleDataset: the parameters after
    ``updates``, and the size of each worker's start-up payload."""
    if travel_whole:   # what the shards did before: pickle the whole base dataset
        monkeypatch.setattr(Shard, '__reduce_ex__', object.__reduce_ex__)
    sizes = []
    pickled = Payload.__call__

    def measured(payload, *args, **kwargs):
        data = pickled(payload, *args, **kwargs)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(Payload, '__call__', measured)
    x, t = _arrays()
    model = classifier(seed=3, n_in=FEATURES)
    its = shard_iterators(chainer.datasets.TupleDataset(x, t), SHARDS, 4, seed=11)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('momentum+decay', model),
                                          devices=['@numpy'] * SHARDS, accumulate_steps=k)
    try:
        run_updates(updater, model, updates)
    finally:
        updater.finalize()
        monkeypatch.undo()
    return params(model), sizes


def test_training_is_what_it_was_bit_for_bit_and_standard_updaters(monkeypatch):
    ours, sizes = _train(monkeypatch, travel_whole=False)
    before, whole_sizes = _train(monkeypatch, travel_whole=True)
    assert len(sizes) == len(whole_sizes) == SHARDS - 1   # one payload per worker
    assert max(sizes) < 0.6 * min(whole_sizes)
    for name in ours:
        assert np.array_equal(ours[name], before[name]), name

    # StandardUpdater on the global batch: each update, every replica's 2 micro-batches
    x, t = _arrays()
    twins = shard_iterators(chainer.datasets.TupleDataset(x, t), SHARDS, 4, seed=11)
    model = classifier(seed=3, n_in=FEATURES)
    optimizer = setup_optimizer('momentum+decay', model)
    for _ in range(4):
        batch = [example for it in twins for _ in range(2) for example in it.next()]
        run_updates(StandardUpdater(SerialIterator(batch, len(batch), shuffle=False),
                                    optimizer), model, 1)
    reference = params(model)
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert not np.allclose(ours['/predictor/l1/W'],
                           params(classifier(seed=3, n_in=FEATURES))['/predictor/l1/W'])


def test_deepcopy_of_a_shard_is_its_own_examples():
    x, t = _arrays()
    shard = shard_iterators(chainer.datasets.TupleDataset(x, t), SHARDS, 4)[2].dataset
    copied = copy.deepcopy(shard)
    assert len(copied) == len(shard)
    _same([copied[i] for i in range(len(shard))], [shard[i] for i in range(len(shard))])

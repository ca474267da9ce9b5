"""How many samples a batch holds, as the iterator returned it (``prefetch.sample_count``).

Micro-batches are weighted by their sample counts, so a short batch must count what it
holds. Chainer's iterators return a list of examples: its length. A custom iterator may
return columns instead (Chainer's word2vec ``WindowIterator`` returns ``(centers,
contexts)``): a tuple (or dict) of arrays counts the rows of its first array, not 2; a
column of sequences as a list (text), or a number, before it is passed over.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._loader import TupleOfLists, sample_count

from _models import params, setup_optimizer


class ColumnIterator(chainer.dataset.Iterator):
    """Walks ``(x, t)`` once, ``batch_size`` rows at a time, returning the columns."""

    def __init__(self, x, t, batch_size, as_list=False):
        self.x, self.t, self.batch_size = x, t, batch_size
        # x's rows as a list, first (as sequences of text would be); 'all': every column
        # a list (a seq2seq iterator's (xs, ys))
        self.as_list = as_list
        self.current_position = 0
        self.epoch = 0
        self.is_new_epoch = False

    def __next__(self):
        if self.epoch > 0:
            raise StopIteration
        i, end = self.current_position, self.current_position + self.batch_size
        batch = self.x[i:end], self.t[i:end]
        if self.as_list == 'all':
            batch = list(batch[0]), list(batch[1])
        elif self.as_list:
            batch = list(batch[0]), batch[1]
        self.is_new_epoch = end >= len(self.x)
        self.epoch += int(self.is_new_epoch)
        self.current_position = 0 if self.is_new_epoch else end
        return batch

    next = __next__

    @property
    def epoch_detail(self):
        return self.epoch + self.current_position / len(self.x)

    def serialize(self, serializer):
        self.current_position = serializer('current_position', self.current_position)
        self.epoch = serializer('epoch', self.epoch)
        self.is_new_epoch = serializer('is_new_epoch', self.is_new_epoch)


@chainer.dataset.converter()
def columns(batch, device):
    batch = tuple(np.stack(a) if type(a) is list else a for a in batch)
    return tuple(a if device is None else device.send(a) for a in batch)


class Regressor(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 1)

    def forward(self, x, t):
        return F.mean_squared_error(self.l1(x)[:, 0], t)


def _data(n):
    rng = np.random.RandomState(0)
    return rng.randn(n, 5).astype(np.float32), rng.randn(n).astype(np.float32)


def test_sample_count_rule():
    x, t = _data(4)
    assert sample_count([(x[0], t[0]), (x[1], t[1]), (x[2], t[2])]) == 3   # examples
    assert sample_count((x[:3], t[:3])) == 3                             # columns
    assert sample_count({'x': x[:3], 't': t[:3]}) == 3
    assert sample_count(x[:2]) == 2
    assert sample_count((x[:1], t[:1])) == 1
    assert sample_count((list(x[:3]), t[:3])) == 3                      # a list first
    assert sample_count({'text': ['a', 'bc', 'd'], 't': t[:3]}) == 3
    assert sample_count((np.float32(0.5), x[:3], t[:3])) == 3            # a number first
    assert sample_count({'text': ['a', 'bc', 'd'], 't': [0, 1, 0]}) == 3  # lists only
    assert sample_count(((x[0], t[0]), (x[1], t[1]), (x[2], t[2]))) == 3  # examples
    assert sample_count(([x[0], t[0]], [x[1], t[1]], [x[2], t[2]])) == 3  # ... as lists
    many = {f'c{i}': ['a'] * 5 for i in range(9)}
    many['x'] = x[:3]   # a dict's columns are all looked at
    assert sample_count(many) == 3


@pytest.mark.parametrize('as_list', [False, True, 'all'])
@pytest.mark.parametrize('devices,steps', [(['@numpy'], 2), (['@numpy', '@numpy'], 2)])
def test_short_column_batches_weigh_as_in_standard_updater(devices, steps, as_list):
    """Each replica's shard of 4 rows loads as batches of 3 and 1: one update over all
    rows must equal StandardUpdater's step on one batch of every row."""
    x, t = _data(4 * len(devices))
    np.random.seed(0)
    ours = Regressor()
    np.random.seed(0)
    reference = Regressor()
    its = [ColumnIterator(x[4 * r:4 * r + 4], t[4 * r:4 * r + 4], 3, as_list)
           for r in range(len(devices))]
    updater = ParallelAccumulatingUpdater(its if len(its) > 1 else its[0],
                                          setup_optimizer('sgd', ours), devices=devices,
                                          accumulate_steps=steps, converter=columns,
                                          loss_func=ours)
    try:
        updater.update()
    finally:
        updater.finalize()
    StandardUpdater(ColumnIterator(x, t, len(x)), setup_optimizer('sgd', reference),
                    converter=columns, loss_func=reference).update()
    got, expected = params(ours), params(reference)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


class _Sized:
    def __init__(self, batch_size):
        self.batch_size = batch_size


def test_a_tuple_of_lists_is_read_by_what_it_holds_then_by_the_batch_size():
    """Columns ``(xs, ts)`` and examples ``([x0, t0], [x1, t1], [x2, t2])`` are both a
    tuple of lists of one length (columns counted 2 whatever their length, silently). A
    column holds one kind of value, an example one of each field; where both readings
    hold, the iterator's batch size tells. A short batch after the first that told is
    read alike, and so is a first that is short (a resumed run's)."""
    x, t = _data(4)
    columns = TupleOfLists()
    assert columns.count((list(x[:4]), list(t[:4])), _Sized(4)) == 4
    assert columns.count((list(x[:1]), list(t[:1])), _Sized(4)) == 1   # the short last
    examples = TupleOfLists()
    assert examples.count(([x[0], t[0]], [x[1], t[1]], [x[2], t[2]]), _Sized(3)) == 3
    assert examples.count(([x[0], t[0]],), _Sized(3)) == 1
    # as many columns as rows: either reading counts alike, and nothing is decided; a
    # short batch then is read by its values, also where its other count is the size
    square = TupleOfLists()
    assert square.count((list(x[:2]), list(t[:2])), _Sized(2)) == 2
    assert square.columns is None
    assert square.count((list(x[:1]), list(t[:1])), _Sized(2)) == 1
    fields = TupleOfLists()
    assert fields.count(([x[0], t[0]],), _Sized(2)) == 1
    # a first batch that is short, no batch size: read by its values
    assert TupleOfLists().count((list(x[:3]), list(t[:3])), object()) == 3
    # kinds are broad: ints beside floats, numpy scalars, None, arrays of other ranks
    # read alike either way, and the batch size tells (a strict look misread them)
    assert TupleOfLists().count(([1, 2], [0.5, 1.5], [3, 4]), _Sized(3)) == 3
    assert TupleOfLists().count(([1, 2.5, 3], [2, 5.0, 6]), _Sized(3)) == 3
    assert TupleOfLists().count(([np.float32(1), 2.5, 3.0], [np.int64(0), 1, None]),
                                _Sized(3)) == 3
    images = [np.zeros((2, 2), np.float32), np.zeros((1, 2, 2), np.float32)]
    assert TupleOfLists().count((images, images[::-1], images), _Sized(3)) == 3
    # token sequences: both readings hold; the batch size tells, or it is refused
    tokens = [np.arange(n, dtype=np.int32) for n in (3, 5, 2, 4, 1, 6)]
    pairs = (tokens[:3], tokens[3:])   # 3 sources, 3 targets
    assert TupleOfLists().count(pairs, _Sized(3)) == 3
    assert TupleOfLists().count((tokens[:2], tokens[2:4], tokens[4:]), _Sized(2)) == 2
    assert TupleOfLists().count((tokens[:2], tokens[2:4], tokens[4:]), _Sized(3)) == 3
    with pytest.raises(ValueError, match=r"a tuple of 3 lists of 2 entries each: 2 samples "
                       r"in 3 columns, or 3 samples of 2 fields each; their values read "
                       r"alike either way, and its batch_size \(None\) tells neither"):
        TupleOfLists().count((tokens[:2], tokens[2:4], tokens[4:]), object())


def test_a_reading_as_columns_that_a_later_batch_contradicts_is_refused():
    """Token sequences read alike either way, and a first batch that is not of the
    iterator's size decides by a coincidence: 3 examples ``((x, t), ...)`` read as 2
    columns by a ``batch_size`` of 2 (their fields), so counted 2. Columns do not change
    in number: a later batch of 4 shows the reading wrong. (Examples read as such may be
    sequences of any length: a bucketing iterator's, which no later batch contradicts.)"""
    tokens = [np.arange(n, dtype=np.int32) for n in (3, 5, 2, 4, 1, 6, 2, 3, 4)]
    as_examples = TupleOfLists()
    first = tuple([tokens[i], tokens[i + 1]] for i in range(0, 6, 2))   # 3 examples
    assert as_examples.count(first, _Sized(2)) == 2   # misread as 2 columns
    with pytest.raises(ValueError, match=(
            r"returned a batch that is a tuple of 4 lists, where its first such batch, a "
            r"tuple of 3 lists of 2 entries each, was read as 3 columns of 2 samples \(by "
            r"its batch_size, 2, and what the lists hold\): columns do not change in "
            r"number, so these were examples")):
        as_examples.count(first + ([tokens[6], tokens[7]],), _Sized(2))
    # read right, batches of any size follow
    right = TupleOfLists()
    assert right.count((tokens[:3], tokens[3:6]), _Sized(3)) == 3
    assert right.count((tokens[:5], tokens[4:9]), _Sized(3)) == 5
    # examples that are sequences, bucketed by length: 4 of 5 tokens, then 4 of 9
    bucketed = TupleOfLists()
    assert bucketed.count(tuple([1, 2, 3, 4, 5] for _ in range(4)), _Sized(4)) == 4
    assert bucketed.count(tuple(list(range(9)) for _ in range(4)), _Sized(4)) == 4

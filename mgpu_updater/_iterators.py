"""Building one iterator per device from one dataset."""
from __future__ import annotations

from typing import Any, List, Optional

import numpy

import chainer


class Shard(chainer.datasets.SubDataset):
    """A :class:`chainer.datasets.SubDataset` that indexes one example in one step.

    ``SerialIterator`` and ``MultiprocessIterator`` read a batch one integer index at a
    time; through ``SubDataset`` each goes ``DatasetMixin.__getitem__`` ->
    ``get_example`` -> the base dataset (chainer/dataset/dataset_mixin.py,
    chainer/datasets/sub_dataset.py), about a microsecond each that a host-bound GPU
    update pays per sample. Here an integer index (Python or numpy) goes straight to the
    base dataset through the shard's own index list, with a list's bounds and negative
    indices, which are ``SubDataset``'s; anything else is ``SubDataset``'s.
    """

    def __init__(self, dataset: Any, start: int, finish: int, order: Any) -> None:
        super().__init__(dataset, start, finish, order=order)
        self._indices = [int(i) for i in order[start:finish]]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, numpy.integer)):
            return self._dataset[self._indices[index]]
        return super().__getitem__(index)


def shard_iterators(dataset: Any, n: int, batch_size: int, *,
                    iterator_class: Any = chainer.iterators.SerialIterator,
                    shuffle: bool = True, seed: Optional[int] = 0,
                    **iterator_kwargs: Any) -> List[Any]:
    """Split ``dataset`` into ``n`` disjoint shards and wrap each in an iterator.

    Shards are a random partition (``seed``; ``None`` keeps the original order, cut into
    contiguous pieces) whose sizes differ by at most one. ``batch_size`` is the
    micro-batch of each device; extra keyword arguments go to ``iterator_class``
    (``repeat``, ``n_processes`` for ``MultiprocessIterator``...). Each iterator shuffles
    with its own seed derived from ``seed``, so runs are reproducible.

    Example: ``shard_iterators(train, 2, 32, iterator_class=MultiprocessIterator,
    n_processes=2)``.
    """
    from ._validate import positive_int
    n = positive_int('n', n)
    batch_size = positive_int('batch_size', batch_size)
    if len(dataset) < n:
        raise ValueError(f'dataset has {len(dataset)} example(s), fewer than the {n} shards '
                         'asked for; use fewer devices or a larger dataset')
    if seed is None:
        order = numpy.arange(len(dataset))
    else:
        order = numpy.random.RandomState(seed).permutation(len(dataset))
    shards = []
    bounds = numpy.cumsum([0] + [len(p) for p in numpy.array_split(order, n)])
    for i in range(n):
        sub = Shard(dataset, int(bounds[i]), int(bounds[i + 1]), order=order)
        kwargs = dict(iterator_kwargs)
        if shuffle and seed is not None and iterator_class in (
                chainer.iterators.SerialIterator, chainer.iterators.MultiprocessIterator):
            kwargs.setdefault('order_sampler', chainer.iterators.ShuffleOrderSampler(
                numpy.random.RandomState(seed + 1 + i)))
        else:
            kwargs.setdefault('shuffle', shuffle)
        shards.append(iterator_class(sub, batch_size, **kwargs))
    return shards

"""Building one iterator per device from one dataset."""
from __future__ import annotations

from typing import Any, List, Optional

import numpy

import chainer


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
        sub = chainer.datasets.SubDataset(dataset, int(bounds[i]), int(bounds[i + 1]),
                                          order=order)
        kwargs = dict(iterator_kwargs)
        if shuffle and seed is not None and iterator_class in (
                chainer.iterators.SerialIterator, chainer.iterators.MultiprocessIterator):
            kwargs.setdefault('order_sampler', chainer.iterators.ShuffleOrderSampler(
                numpy.random.RandomState(seed + 1 + i)))
        else:
            kwargs.setdefault('shuffle', shuffle)
        shards.append(iterator_class(sub, batch_size, **kwargs))
    return shards

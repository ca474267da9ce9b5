"""Building one iterator per device from one dataset; each worker gets only its shard."""
from __future__ import annotations

import copy
import inspect
import numbers
from typing import Any, List, Optional

import numpy

import chainer

from ._chainer_private import (dict_dataset_columns, sub_dataset_indices,
                               transform_dataset_parts, tuple_dataset_columns)


#: integer types a shard looks up in one step (:meth:`Shard.__getitem__`)
_FAST_INDEX = frozenset((int, numpy.int64, numpy.int32, numpy.intp))


class Shard(chainer.datasets.SubDataset):
    """A :class:`chainer.datasets.SubDataset` that indexes one example in one step, and
    pickles (to a worker process) only its own examples where the dataset allows.

    ``SerialIterator`` and ``MultiprocessIterator`` read a batch one integer index at a
    time; through ``SubDataset`` each goes ``DatasetMixin.__getitem__`` ->
    ``get_example`` -> the base dataset (chainer/dataset/dataset_mixin.py,
    chainer/datasets/sub_dataset.py), about a microsecond each that a host-bound GPU
    update pays per sample. Here an integer index (Python's, or numpy's int64 and int32
    that an order array yields) goes straight to the base dataset through the shard's own
    index list, with a list's bounds and negative indices, which are ``SubDataset``'s;
    anything else is ``SubDataset``'s.

    Pickled (a worker's payload, ``copy.deepcopy``), a shard whose base dataset
    :func:`compact` knows becomes a shard over a copy of its own examples, in its order:
    the same length, the same example at every index, so every iterator over it draws
    the same batches and its snapshots hold the same state. Any other base is pickled
    whole (see :func:`shard_iterators`).
    """

    def __init__(self, dataset: Any, start: int, finish: int, order: Any = None) -> None:
        super().__init__(dataset, start, finish, order=order)
        self._indices = [int(i) for i in (range(start, finish) if order is None
                                          else order[start:finish])]

    def __getitem__(self, index: Any) -> Any:
        # the exact types the iterators pass (a Python int; numpy's from an order array):
        # an isinstance against numpy.integer took 40% of what a shard adds per sample
        if type(index) in _FAST_INDEX:
            return self._dataset[self._indices[index]]
        return super().__getitem__(index)   # (any other integer: the same example)

    def __reduce_ex__(self, protocol: Any) -> Any:
        indices = numpy.asarray(self._indices, dtype=numpy.int64)
        whole = len(indices) == len(self._dataset) and numpy.array_equal(
            indices, numpy.arange(len(indices)))
        own = None if whole else compact(self._dataset, indices)
        if own is None:
            return super().__reduce_ex__(protocol)
        return Shard, (own, 0, len(indices))


def compact(dataset: Any, indices: numpy.ndarray) -> Any:
    """A dataset of ``len(indices)`` examples whose ``k``-th is ``dataset[indices[k]]``
    (the same values, of the same types), holding nothing else; or None where
    ``dataset`` is not one of the kinds known to hold its examples in memory: a numpy
    array (a ``numpy.memmap`` too, which pickles whole), a list or tuple, a
    ``TupleDataset`` or ``DictDataset`` of those, and a ``SubDataset``
    (``split_dataset_random``) or ``TransformDataset`` over any of these. ``indices`` are
    non-negative and below ``len(dataset)``.
    """
    kind = type(dataset)
    if kind in (numpy.ndarray, numpy.memmap) and dataset.ndim >= 1:
        return dataset[indices]   # a memmap's: an ndarray, as a pickled memmap's rows are
    if kind in (list, tuple):
        return [dataset[i] for i in indices.tolist()]
    if kind is chainer.datasets.TupleDataset:
        columns = [compact(c, indices) for c in tuple_dataset_columns(dataset)]
        return None if any(c is None for c in columns) else \
            chainer.datasets.TupleDataset(*columns)
    if kind is chainer.datasets.DictDataset:
        named = {k: compact(c, indices) for k, c in dict_dataset_columns(dataset).items()}
        return None if any(c is None for c in named.values()) else \
            chainer.datasets.DictDataset(**named)
    if kind in (chainer.datasets.SubDataset, Shard):
        base, inner = sub_dataset_indices(dataset, indices)
        return compact(base, inner)
    if kind is chainer.datasets.TransformDataset:
        base, transform = transform_dataset_parts(dataset)
        inner = compact(base, indices)
        return None if inner is None else chainer.datasets.TransformDataset(inner, transform)
    return None


def shard_iterators(dataset: Any, n: int, batch_size: int, *,
                    iterator_class: Any = chainer.iterators.SerialIterator,
                    shuffle: bool = True, seed: Optional[int] = 0,
                    **iterator_kwargs: Any) -> List[Any]:
    """Split ``dataset`` into ``n`` disjoint shards and wrap each in an iterator.

    Shards are a random partition (``seed``; ``None`` keeps the original order, cut into
    contiguous pieces) whose sizes differ by at most one. ``batch_size`` is the
    micro-batch of each device; extra keyword arguments go to ``iterator_class``
    (``repeat``, ``n_processes`` for ``MultiprocessIterator``...). Each iterator shuffles
    with its own seed derived from ``seed`` (an ``order_sampler``: Chainer's
    ``SerialIterator``, ``MultithreadIterator`` and ``MultiprocessIterator`` take one), so
    runs are reproducible; a class that takes no ``order_sampler`` gets ``shuffle``.

    An ``order_sampler`` passed here goes to the first shard, and a copy of it, in the
    state given, to each other shard (so the shards' iterators draw alike whether they run
    in one process or in several): shards of one size then shuffle alike, each epoch.
    Pass ``seed`` instead for shards that shuffle apart.

    Example: ``shard_iterators(train, 2, 32, iterator_class=MultiprocessIterator,
    n_processes=2)``.

    Memory: each worker process receives only its shard's examples (a copy of them, made
    while its start-up payload is pickled) when ``dataset`` is a numpy array (or a
    ``numpy.memmap``, which would otherwise be read whole into each payload), a list or
    tuple, a ``TupleDataset`` or ``DictDataset`` of those, or a ``SubDataset`` (e.g. from
    ``split_dataset_random``) or ``TransformDataset`` over any of these. Any other dataset
    (a class of your own, a ``ConcatenatedDataset``...) reaches every worker whole, as its
    pickle holds it: little for one that reads its examples from files in
    ``get_example`` (``ImageDataset`` holds the paths), but N devices hold N copies of
    one that keeps them in memory. Where that does not fit, make such a dataset read
    lazily, or build one iterator per device yourself, each over a dataset that holds
    only its part.
    """
    from ._validate import _show, flag, positive_int
    n = positive_int('n', n)
    batch_size = positive_int('batch_size', batch_size)
    shuffle = flag('shuffle', shuffle, ints=True)
    if isinstance(seed, numpy.ndarray) and seed.ndim == 0 and seed.dtype.kind in 'iu':
        seed = int(seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= seed < 2 ** 32):
        raise (ValueError if isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
               else TypeError)(
            f'seed must be None or an int from 0 to 2**32 - 1 ({_show(seed)} given); pass '
            'e.g. seed=0 (None keeps the dataset\'s order, cut into contiguous shards)')
    if not hasattr(type(dataset), '__len__'):
        raise TypeError(f'dataset must have a length and be indexable, as a TupleDataset, a '
                        f'list or an array is ({_show(dataset)} given); pass the dataset '
                        'itself, not an iterator over it')
    size = len(dataset)
    if size < n:
        raise ValueError(f'dataset has {size} example(s), fewer than the {n} shards asked '
                         f'for (shard_iterators(dataset, n, batch_size): n is the number of '
                         'devices); use fewer devices or a larger dataset')
    if seed is None:
        order = numpy.arange(len(dataset))
    else:
        order = numpy.random.RandomState(seed).permutation(len(dataset))
    shards = []
    bounds = numpy.cumsum([0] + [len(p) for p in numpy.array_split(order, n)])
    # One of the user's, for every shard: each its own copy, in the state given (made
    # before the first shard's iterator draws its first order), as each worker process
    # has one (one object drew for every shard in turn in one process, and a worker's
    # copy drew from where it was: other orders than that process's)
    given = iterator_kwargs.get('order_sampler')
    samplers = [given] + [copy.deepcopy(given) for _ in range(n - 1)]
    for i in range(n):
        sub = Shard(dataset, int(bounds[i]), int(bounds[i + 1]), order=order)
        kwargs = dict(iterator_kwargs)
        if given is not None:
            kwargs['order_sampler'] = samplers[i]
        if shuffle and seed is not None and _takes_order_sampler(iterator_class):
            kwargs.setdefault('order_sampler', chainer.iterators.ShuffleOrderSampler(
                numpy.random.RandomState((seed + 1 + i) % 2 ** 32)))
        else:
            kwargs.setdefault('shuffle', shuffle)
        shards.append(iterator_class(sub, batch_size, **kwargs))
    return shards


def _takes_order_sampler(iterator_class: Any) -> bool:
    """Whether ``iterator_class(dataset, batch_size, order_sampler=...)`` is accepted."""
    try:
        parameters = inspect.signature(iterator_class).parameters
    except (TypeError, ValueError):   # no signature to read
        return False
    return 'order_sampler' in parameters

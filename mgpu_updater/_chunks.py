"""Splitting a loaded micro-batch into chunks of at most ``micro_batch_size`` samples.

With ``micro_batch_size='auto'`` the size starts at the whole batch and is halved each
time a window runs out of memory (see :meth:`mgpu_updater._replica.Replica.run_window`).
The split works on what the converter returned: an array (or list) with one entry per
sample, or a tuple or dict of them, each cut along its first axis. A chunk is a smaller
micro-batch of the same samples, so the gradient it adds (scaled by its own sample count,
see :class:`mgpu_updater._replica.Scaling`) keeps the update exact.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Iterator, NamedTuple, Optional, Tuple

import numpy


class Chunking(NamedTuple):
    """How a replica splits its loaded micro-batches."""
    size: Optional[int] = None   # most samples per forward/backward (None: whole batch)
    auto: bool = False           # halve ``size`` and redo the window on out-of-memory


def splits(chunking: Optional[Chunking]) -> bool:
    """Whether a replica chunking so may split a batch (and check its first cut against
    the batch's examples, which its loader then keeps)."""
    return chunking is not None and (chunking.size is not None or chunking.auto)


def split(arrays: Any, size: int, chunk: Optional[int]) -> Iterator[Tuple[int, Any]]:
    """``(samples, arrays)`` of each chunk of the ``size`` samples in ``arrays``, in order;
    the whole batch when ``chunk`` is None or not smaller than ``size``."""
    if chunk is None or chunk >= size:
        yield size, arrays
        return
    for start in range(0, size, chunk):
        stop = min(start + chunk, size)
        yield stop - start, _cut(arrays, size, start, stop)


class NotCallableAside(Exception):
    """The converter cannot be called aside without moving what it draws from or counts
    (a generator or an object that cannot be copied): the split is not compared."""


def check_split(convert: Callable[[Any], Any], examples: Any, arrays: Any, size: int,
                chunk: int) -> bool:
    """Raise if the first chunk :func:`split` cuts from ``arrays`` (the converter's output
    for the list ``examples``) is not laid out as the converter's own output for the
    first ``chunk`` examples: the same elements or keys, each as long. A value whose first
    axis is no sample axis (a time-major ``(T, B)`` array, a flat tuple of one array per
    sample) would otherwise be cut where its length only happens to equal the batch's.
    ``convert(examples)`` runs once (a shallow copy of a converter object, drawing from
    copies of the generators it reaches: ``Loader.convert_aside``), with numpy's and
    Python's global generators set back after it (a converter that draws must not move
    the training's draws). Batches the
    iterator gave as columns, not a list, are not checked. Returns False where the
    examples were not kept (``None``: a batch loaded before they were asked for)."""
    if examples is None:
        return False
    if not isinstance(examples, list) or len(examples) != size:
        return True
    states = numpy.random.get_state(), random.getstate()
    try:
        alone = convert(examples[:chunk])
    except NotCallableAside:
        return True   # not compared: the converter's own draws must not move
    except Exception as exc:
        exc.add_note(f'(raised by the converter given the first {chunk} of a batch of {size} '
                     f'samples, which micro_batch_size={chunk} compares with its first cut '
                     'of the whole batch: a converter that takes only whole batches cannot '
                     'be split; use micro_batch_size=None)')
        raise
    finally:
        numpy.random.set_state(states[0])
        random.setstate(states[1])
    cut = _cut(arrays, size, 0, chunk)
    if _layout(cut) != _layout(alone):
        raise TypeError(
            f'micro_batch_size cannot split this batch of {size} samples: cut into chunks '
            f'of {chunk} along the first axis of what the converter returned, the first '
            f'chunk is {_describe(cut)}, but the converter given those {chunk} samples '
            f'returns {_describe(alone)}: what it returns does not hold one entry per '
            'sample along its first axis (a time-major array, a flat tuple of one array '
            'per sample). Use micro_batch_size=None, or a converter that returns '
            'per-sample arrays (a tuple or dict of them, samples first)')
    return True


def _length(value: Any) -> Optional[int]:
    try:
        return len(value)
    except TypeError:
        return None


def _layout(arrays: Any) -> Any:
    if isinstance(arrays, tuple):
        return ('tuple', tuple(_length(a) for a in arrays))
    if isinstance(arrays, dict):
        return ('dict', tuple(sorted((str(k), _length(a)) for k, a in arrays.items())))
    return ('one', _length(arrays))


def _describe(arrays: Any) -> str:
    kind, lengths = _layout(arrays)
    if kind == 'tuple':
        return f'a tuple of {len(lengths)} elements of lengths {list(lengths)}'
    if kind == 'dict':
        return 'a dict of lengths ' + ', '.join(f'{k!r}: {n}' for k, n in lengths)
    return f'{type(arrays).__name__} of length {lengths}'


def _cut(arrays: Any, size: int, start: int, stop: int) -> Any:
    if isinstance(arrays, tuple):
        return tuple(_one(a, size, start, stop, f'element {i}') for i, a in enumerate(arrays))
    if isinstance(arrays, dict):
        return {k: _one(a, size, start, stop, f'key {k!r}') for k, a in arrays.items()}
    return _one(arrays, size, start, stop, 'it')


def _one(value: Any, size: int, start: int, stop: int, where: str) -> Any:
    try:
        length = len(value)
    except TypeError:
        length = None
    if length != size or not hasattr(value, '__getitem__'):
        raise TypeError(
            f'micro_batch_size cannot split this batch of {size} samples: the converter '
            f'returned {where} as {type(value).__name__}'
            + ('' if length is None else f' of length {length}') + ', not an array or list '
            'with one entry per sample (one that drops or adds rows, or lays out another '
            'axis first, cannot be cut by sample). Use micro_batch_size=None, or a '
            'converter that returns one row per example (a tuple or dict of such arrays)')
    return value[start:stop]

"""Splitting a loaded micro-batch into chunks of at most ``micro_batch_size`` samples.

With ``micro_batch_size='auto'`` the size starts at the whole batch and is halved each
time a window runs out of memory (see :meth:`mgpu_updater._replica.Replica.run_window`).
The split works on what the converter returned: an array (or list) with one entry per
sample, or a tuple or dict of them, each cut along its first axis. A chunk is a smaller
micro-batch of the same samples, so the gradient it adds (scaled by its own sample count,
see :class:`mgpu_updater._replica.Scaling`) keeps the update exact.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional, Tuple


class Chunking(NamedTuple):
    """How a replica splits its loaded micro-batches."""
    size: Optional[int] = None   # most samples per forward/backward (None: whole batch)
    auto: bool = False           # halve ``size`` and redo the window on out-of-memory


def split(arrays: Any, size: int, chunk: Optional[int]) -> Iterator[Tuple[int, Any]]:
    """``(samples, arrays)`` of each chunk of the ``size`` samples in ``arrays``, in order;
    the whole batch when ``chunk`` is None or not smaller than ``size``."""
    if chunk is None or chunk >= size:
        yield size, arrays
        return
    for start in range(0, size, chunk):
        stop = min(start + chunk, size)
        yield stop - start, _cut(arrays, size, start, stop)


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
            'with one entry per sample. Use micro_batch_size=None, or a converter that '
            'returns per-sample arrays (a tuple or dict of them)')
    return value[start:stop]

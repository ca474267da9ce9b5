"""What a snapshot holds beyond the model and the optimizer, and how it is restored.

- Iterator state: :func:`capture_state` reads an iterator's serialized state into a flat
  dict of numpy arrays (the loader keeps one per batch loaded ahead, see
  :mod:`mgpu_updater._loader`), :func:`write_state` replays it into a serializer,
  :func:`load_state` restores it. The shuffling order sampler's generator is saved too
  (:func:`serialize_order_rng`), which Chainer's iterators leave out.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy

import chainer
from chainer.serializers import DictionarySerializer


class _Copying(DictionarySerializer):
    """A DictionarySerializer that copies (the iterator may mutate its arrays later)."""

    def __call__(self, key, value):
        key = key.lstrip('/')
        self.target[self.path + key] = numpy.array(
            chainer.backend.CpuDevice().send(value) if value is not None else None)
        return value

    def __getitem__(self, key):
        key = key.strip('/')
        return _Copying(self.target, self.path + key + '/')


def serialize_order_rng(iterator: Any, serializer: Any) -> None:
    """Save or load the random state of the iterator's shuffling order sampler.

    Chainer's iterators save their current order but not the generator that draws the
    next epoch's order, so a resumed run would shuffle differently from the uninterrupted
    one. This adds that state under ``order_sampler_rng/`` (numpy ``RandomState`` only).
    """
    rng = getattr(getattr(iterator, 'order_sampler', None), '_random', None)
    if not isinstance(rng, numpy.random.RandomState):
        return
    name, keys, pos, has_gauss, cached = rng.get_state()
    node = serializer['order_sampler_rng']
    keys = node('keys', keys)
    pos = node('pos', pos)
    has_gauss = node('has_gauss', has_gauss)
    cached = node('cached_gaussian', cached)
    if isinstance(serializer, chainer.serializer.Deserializer):
        rng.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), int(pos),
                       int(has_gauss), float(cached)))


def load_state(iterator: Any, serializer: Any) -> None:
    """Load an iterator (and its shuffling generator) from a Chainer deserializer."""
    iterator.serialize(serializer)
    serialize_order_rng(iterator, serializer)


def capture_state(iterator: Any) -> Dict[str, numpy.ndarray]:
    """The iterator's serialized state as a flat dict of numpy arrays."""
    target: Dict[str, numpy.ndarray] = _capture_iterator(iterator)
    serialize_order_rng(iterator, _Copying(target))
    return target


def _capture_iterator(iterator: Any) -> Dict[str, numpy.ndarray]:
    if isinstance(iterator, chainer.iterators.MultiprocessIterator):
        # Its serialize() resets its worker pool (discarding what it prefetched); read
        # the same keys it would write instead.
        state = iterator._state
        return {'current_position': numpy.array(state.current_position),
                'epoch': numpy.array(state.epoch),
                'is_new_epoch': numpy.array(state.is_new_epoch),
                'order': numpy.array(state.order),
                'previous_epoch_detail': numpy.array(iterator._previous_epoch_detail)}
    target: Dict[str, numpy.ndarray] = {}
    iterator.serialize(_Copying(target))
    return target


def write_state(serializer: Any, state: Dict[str, numpy.ndarray]) -> None:
    """Replay a captured state into any Chainer serializer (nested keys included)."""
    for key, value in state.items():
        node = serializer
        parts = key.split('/')
        for part in parts[:-1]:
            node = node[part]
        node(parts[-1], value)

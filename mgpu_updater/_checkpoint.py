"""What a snapshot holds beyond the model and the optimizer, and how it is restored.

- Iterator state: :func:`capture_state` reads an iterator's serialized state into a flat
  dict of numpy arrays (the loader keeps one per batch loaded ahead, see
  :mod:`mgpu_updater._loader`), :func:`write_state` replays it into a serializer,
  :func:`load_state` restores it from a deserializer and :func:`restore_state` from the
  flat dict. The shuffling order sampler's generator is saved too
  (:func:`serialize_order_rng`), which Chainer's iterators leave out.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import numpy

import chainer
from chainer.serializers import DictionarySerializer, NpzDeserializer

from ._chainer_private import (fresh_rule_state, load_unshuffled_multiprocess_iterator,
                               multiprocess_iterator_state, multithread_iterator_state,
                               order_sampler_rng)
from ._warning import warn


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


class _CopyingArrays(chainer.serializer.Serializer):
    """A saving serializer that hands on a copy of each numpy array it is given. A
    ``Serializer`` itself: a link's ``serialize`` that tells saving from loading as
    Chainer's own code does (``isinstance(serializer, chainer.serializer.Serializer)``,
    ``LogReport``'s way) must save through it, not load (a snapshot then wiped what it
    saved, in the snapshot and in the model)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, key: str, value: Any) -> Any:
        self.inner(key, value.copy() if isinstance(value, numpy.ndarray) else value)
        return value

    def __getitem__(self, key: str) -> '_CopyingArrays':
        return _CopyingArrays(self.inner[key])


def serialize_order_rng(iterator: Any, serializer: Any) -> None:
    """Save or load the random state of the iterator's shuffling order sampler.

    Chainer's iterators save their current order but not the generator that draws the
    next epoch's order, so a resumed run would shuffle differently from the uninterrupted
    one. This adds that state under ``order_sampler_rng/`` (numpy ``RandomState`` only).
    """
    rng = order_sampler_rng(iterator)
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


def load_state(iterator: Any, serializer: Any, generator: bool = True) -> None:
    """Load an iterator (and its shuffling generator, unless not ``generator``) from a
    Chainer deserializer."""
    if not (isinstance(iterator, chainer.iterators.MultiprocessIterator)
            and load_unshuffled_multiprocess_iterator(iterator, serializer)):
        with _standing_in(iterator, _StateReader):
            iterator.serialize(serializer)
    if generator:
        serialize_order_rng(iterator, serializer)


def restore_state(iterator: Any, state: Dict[str, numpy.ndarray],
                  generator: bool = True) -> None:
    """Load a state :func:`capture_state` gave back into ``iterator`` (and its shuffling
    generator, unless not ``generator``): what a snapshot's load does, from the flat
    dict."""
    load_state(iterator, NpzDeserializer(state), generator)


def saves_nothing(state: Dict[str, Any]) -> bool:
    """Whether a state :func:`capture_state` gave back holds nothing of the iterator's
    own: its ``serialize`` saved nothing (the generator of its order sampler, which
    :func:`serialize_order_rng` adds, aside)."""
    return all(key.startswith('order_sampler_rng/') for key in state)


def same_state(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two states :func:`capture_state` gave back are equal."""
    return a.keys() == b.keys() and all(numpy.array_equal(a[k], b[k]) for k in a)


def set_back(iterator: Any, state: Dict[str, numpy.ndarray]) -> None:
    """Put ``iterator`` back where ``state`` (:func:`capture_state`'s) had it, where a
    loader read on since: numpy's global generator, where it shuffles with it, is left as
    it is (the model and the script drew from it since)."""
    if not same_state(capture_state(iterator), state):
        restore_state(iterator, state, generator=not shuffles_with_numpys_global(iterator))


def shuffles_with_numpys_global(iterator: Any) -> bool:
    """Whether ``iterator``'s order sampler draws from numpy's global generator, which
    the model and the script draw from too (Chainer's default ``ShuffleOrderSampler()``)."""
    return order_sampler_rng(iterator) is numpy.random.random.__self__


def capture_state(iterator: Any) -> Dict[str, numpy.ndarray]:
    """The iterator's serialized state as a flat dict of numpy arrays. Where its
    ``serialize`` fails, an error of the same type that says why the updater calls it
    (StandardUpdater calls it for a snapshot only), raised from the original."""
    try:
        target: Dict[str, numpy.ndarray] = _capture_iterator(iterator)
    except Exception as exc:  # noqa: BLE001 - said again, with the reason, from it
        raise _not_captured(iterator, exc) from exc
    serialize_order_rng(iterator, _Copying(target))
    return target


def _not_captured(iterator: Any, exc: Exception) -> Exception:
    message = (
        f'{type(iterator).__name__}.serialize() failed while the updater read the '
        f"iterator's position ({type(exc).__name__}: {exc}). The updater reads it, "
        'through serialize into a dictionary as a snapshot does, before each batch it '
        'loads ahead of the update (prefetch), at the end of the data and where worker '
        'processes stop, so that the iterator and a snapshot hold the position of the '
        'last batch used (StandardUpdater calls it for a snapshot only). Make serialize() '
        'save its position as numbers or arrays; prefetch=0 avoids the reads before the '
        'batches loaded ahead only (not those at the end of the data, repeat=False, or '
        'at a start under max_worker_restarts)')
    try:
        better = type(exc)(message)
    except Exception:  # noqa: BLE001 - a type that takes other arguments
        return RuntimeError(message)
    return better if str(better) == message else RuntimeError(message)


def _capture_iterator(iterator: Any) -> Dict[str, numpy.ndarray]:
    # Their serialize() discards what they loaded ahead (MultiprocessIterator's resets its
    # worker pool too); read the same keys it would write instead (the order copied).
    if isinstance(iterator, chainer.iterators.MultiprocessIterator):
        return {key: numpy.asarray(value)
                for key, value in multiprocess_iterator_state(iterator).items()}
    if isinstance(iterator, chainer.iterators.MultithreadIterator):
        return {key: numpy.asarray(value)
                for key, value in multithread_iterator_state(iterator).items()}
    target: Dict[str, numpy.ndarray] = {}
    with _standing_in(iterator, _StateWriter):   # read as for a bare one, no side effect
        iterator.serialize(_Copying(target))
    return target


_READ_AHEAD = (chainer.iterators.MultiprocessIterator, chainer.iterators.MultithreadIterator)
_WRAPPED_DEPTH = 3   # iterators within iterators looked into, at most
_WRAPPED_ITEMS = 16  # items of a list, tuple or dict of them looked at, at most


def _wrapped_read_ahead(iterator: Any, depth: int = _WRAPPED_DEPTH) -> List[Any]:
    """The ``MultiprocessIterator`` and ``MultithreadIterator`` objects an iterator of the
    user's own holds (a wrapper that adds to each batch and saves the inner one in its
    ``serialize``; an attribute, or an item of a list, tuple or dict attribute; through
    other iterators of the user's, a few deep). Their ``serialize`` discards what they
    loaded ahead, and ``MultiprocessIterator``'s draws the order anew: called through the
    wrapper at each batch the loader reads ahead, it trained on other samples than
    StandardUpdater, and on other samples in each run."""
    found: List[Any] = []
    for value in list(getattr(iterator, '__dict__', {}).values()):
        items = (list(value.values()) if isinstance(value, dict) else
                 value if isinstance(value, (list, tuple)) else [value])
        for item in items[:_WRAPPED_ITEMS]:
            if isinstance(item, _READ_AHEAD):
                if 'serialize' not in vars(item) and all(item is not f for f in found):
                    found.append(item)
            elif depth > 1 and isinstance(item, chainer.dataset.Iterator):
                found.extend(it for it in _wrapped_read_ahead(item, depth - 1)
                             if all(it is not f for f in found))
    return found


@contextlib.contextmanager
def _standing_in(iterator: Any, kind: Any) -> Iterator[None]:
    """While an iterator of the user's own saves or loads: each ``MultiprocessIterator``
    or ``MultithreadIterator`` it wraps (:func:`_wrapped_read_ahead`) saves or loads
    through ``kind`` (an instance attribute ``serialize``, removed after)."""
    inner = [] if isinstance(iterator, _READ_AHEAD) else _wrapped_read_ahead(iterator)
    for it in inner:
        it.serialize = kind(it)
    try:
        yield
    finally:
        for it in inner:
            vars(it).pop('serialize', None)


class _StateWriter:
    """Stands for a ``MultiprocessIterator``'s or ``MultithreadIterator``'s ``serialize``
    while an iterator that wraps it is captured: writes the keys it would write."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator

    def __call__(self, serializer: Any) -> None:
        it = self.iterator
        state = (multiprocess_iterator_state(it)
                 if isinstance(it, chainer.iterators.MultiprocessIterator)
                 else multithread_iterator_state(it))
        for key, value in state.items():
            serializer(key, value)


class _StateReader:
    """Stands for a ``MultiprocessIterator``'s ``serialize`` while an iterator that wraps
    it is loaded: one that does not shuffle is loaded as its own ``serialize`` fails to
    (:func:`load_unshuffled_multiprocess_iterator`); otherwise its own loads."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator

    def __call__(self, deserializer: Any) -> None:
        it = self.iterator
        if not (isinstance(it, chainer.iterators.MultiprocessIterator)
                and isinstance(deserializer, chainer.serializer.Deserializer)
                and load_unshuffled_multiprocess_iterator(it, deserializer)):
            type(it).serialize(it, deserializer)


def write_state(serializer: Any, state: Dict[str, numpy.ndarray]) -> None:
    """Replay a captured state into any Chainer serializer (nested keys included)."""
    for key, value in state.items():
        node = serializer
        parts = key.split('/')
        for part in parts[:-1]:
            node = node[part]
        node(parts[-1], value)


# ---------------------------------------------------------------------- the updater's state
def saving(serializer: Any) -> bool:
    return isinstance(serializer, chainer.serializer.Serializer)


def serialize_counters(updater: Any, serializer: Any) -> None:
    """The model, the optimizer, the counters, the step in flight and the chunk sizes
    'auto' found; on load, first refuse (before anything is loaded) a snapshot of another
    layout (number of devices, ``accumulate_steps``: the shards and the batch composition
    depend on both) or of another updater (:func:`check_layout`).

    Keys: ``optimizer:main/``, ``model:main/``, ``iteration``, ``n_devices``,
    ``accumulate_steps``, ``skipped_updates``, ``micro_batch_sizes`` (under ``'auto'``
    only), ``pending/`` (see :mod:`._step`); since 0.1.0's development also ``pipelined``
    (a snapshot without it is not checked for it).
    """
    if not saving(serializer):
        check_layout(updater, serializer)
    optimizer = updater.get_optimizer('main')
    optimizer.serialize(serializer['optimizer:main'])
    if saving(serializer):
        _save_fresh_states(optimizer, serializer['optimizer:main'])
    model = serializer['model:main']
    if saving(serializer) and updater.n_devices > 1:
        # The master's parameters are views of the memory the workers read, which the
        # next steps change in place: a snapshot's dict (Chainer's snapshot() serializes
        # before its writer saves, a ProcessWriter from a fork) gets copies.
        model = _CopyingArrays(model)
    optimizer.target.serialize(model)
    updater.iteration = serializer('iteration', updater.iteration)
    if saving(serializer):   # read (first) by check_layout on load
        serializer('n_devices', updater.n_devices)
        serializer('accumulate_steps', updater.accumulate_steps)
        serializer('pipelined', int(updater.pipelined))
        if updater._communicator is not None:   # its iterator state is this rank's
            serializer('rank', updater._communicator.rank)
    updater._skipped = serializer('skipped_updates', updater._skipped)
    if updater.micro_batch_size == 'auto':
        _serialize_micro_batch_sizes(updater, serializer)
    if saving(serializer):
        updater._step.save(serializer['pending'], optimizer.target)
        return
    updater._step.load(serializer['pending'], optimizer.target)


def _save_fresh_states(optimizer: Any, serializer: Any) -> None:
    """The state entries of the update rules that have not stepped yet, as their first step
    would make them (zeros, mostly): a snapshot taken before the optimizer's first step
    (pipelined's first update takes none; nor does a skipped one) held none, and loading it
    failed (``UpdateRule.serialize`` looks up each entry of a rule that is enabled: a
    KeyError, ``.../W/m is not a file in the archive``). The rules themselves keep none,
    so the run goes on as it would have."""
    for name, param in optimizer.target.namedparams():
        rule = getattr(param, 'update_rule', None)
        if rule is None or not rule.enabled or rule.state is not None or param.array is None:
            continue
        node = serializer[name]
        for key, value in fresh_rule_state(rule, param).items():
            node(key, value)


def save_epoch_flags(serializer: Any, view: Any) -> None:
    """The update's own ``is_new_epoch`` and ``previous_epoch_detail`` (``view``: the
    updater's epoch bookkeeping): over a window of several micro-batches they are the
    whole update's, not its last micro-batch's, which is all the iterator's state holds."""
    previous = getattr(view, 'previous_epoch_detail', None)
    serializer('is_new_epoch', int(bool(view.is_new_epoch)))
    serializer('previous_epoch_detail', -1.0 if previous is None else float(previous))


def load_epoch_flags(deserializer: Any) -> Any:
    """``(is_new_epoch, previous_epoch_detail)`` as :func:`save_epoch_flags` saved them, or
    None (a snapshot without them)."""
    try:
        new, previous = (deserializer('is_new_epoch', None),
                         deserializer('previous_epoch_detail', None))
    except KeyError:
        return None
    if new is None or previous is None:
        return None
    previous = float(numpy.asarray(previous))
    return bool(numpy.asarray(new)), None if previous < 0 else previous


def check_layout(updater: Any, deserializer: Any) -> None:
    """Refuse a snapshot this updater cannot resume from, reading only ``n_devices``,
    ``accumulate_steps`` and ``pipelined`` (so that nothing is overwritten): one taken with
    another layout or mode, or by another updater (``StandardUpdater``'s has none of the
    keys). Each error says how to start from the snapshot's model and optimizer alone."""
    n_devices = _read_int(deserializer, 'n_devices')
    steps = _read_int(deserializer, 'accumulate_steps')
    where = _path(deserializer)
    alone = (f"chainer.serializers.load_npz(snapshot, model, path='{where}model:main/') and "
             f"chainer.serializers.load_npz(snapshot, optimizer, "
             f"path='{where}optimizer:main/')")
    if n_devices is None or steps is None:
        raise ValueError(
            'this snapshot was not taken by ParallelAccumulatingUpdater (it has no '
            f'{where}n_devices or {where}accumulate_steps: a StandardUpdater snapshot?); '
            'nothing was loaded. Its iteration and iterator state belong to another '
            'updater; start from its model and optimizer alone, loading them before '
            f'training: {alone}')
    if n_devices != updater.n_devices or steps != updater.accumulate_steps:
        raise ValueError(
            f'this snapshot was taken with {n_devices} device(s) and '
            f'accumulate_steps={steps}, but this updater has {updater.n_devices} and '
            f'accumulate_steps={updater.accumulate_steps}; nothing was loaded. Resume with '
            'the same devices and accumulate_steps (the iterator shards and the batch '
            'composition depend on both), or start from its model and optimizer alone, '
            f'loading them before training: {alone}')
    rank = _read_int(deserializer, 'rank')
    own = None if updater._communicator is None else updater._communicator.rank
    if rank is not None and own is not None and rank != own:
        warn(f'rank {own} loads a snapshot that rank {rank} saved: its iterator state (the '
             f"position in the shard, its shuffled order) is rank {rank}'s, so rank {own} "
             'resumes in another order than the run it continues had. Save a snapshot on '
             'every rank and load its own: extensions.snapshot(filename='
             "f'snapshot_iter_{{.updater.iteration}}_rank{comm.rank}') on every rank (not "
             "one file for all ranks, nor ChainerMN's multi_node_snapshot with ranks in one "
             'replica set)', RuntimeWarning, stacklevel=5)
    pipelined = _read_int(deserializer, 'pipelined')
    if pipelined is not None and bool(pipelined) != updater.pipelined:
        raise ValueError(
            f'this snapshot was taken with pipelined={bool(pipelined)}, but this updater '
            f'has pipelined={updater.pipelined}; nothing was loaded. A pipelined snapshot '
            'holds its last update\'s gradient, still to be applied, which a synchronous '
            'updater would drop; a synchronous one holds none, so a pipelined updater '
            'would take no step at its first update. Resume with '
            f'pipelined={bool(pipelined)}, or start from its model and optimizer alone, '
            f'loading them before training: {alone}')


def _read_int(deserializer: Any, key: str) -> Any:
    """The integer stored under ``key``, or None when the snapshot has none (a strict
    deserializer raises KeyError, a lenient one hands back the None it was given)."""
    try:
        value = deserializer(key, None)
    except KeyError:
        return None
    return None if value is None else int(numpy.asarray(value))


def _path(deserializer: Any) -> str:
    """Where the updater sits in the snapshot: ``'updater/'`` in a Trainer's (what
    ``NpzDeserializer`` keeps as ``path``; else that default)."""
    path = getattr(deserializer, 'path', None)
    return path.lstrip('/') if isinstance(path, str) else 'updater/'


def _serialize_micro_batch_sizes(updater: Any, serializer: Any) -> None:
    """What 'auto' found, so that a resumed run starts at the sizes that fit: the size
    each replica splits its batches into, 0 where it takes them whole (not the largest
    batch so far, which a resumed run would split later, larger batches into)."""
    sizes = numpy.asarray(updater._chunk_limits or [0] * updater.n_devices, numpy.int64)
    try:
        sizes = serializer('micro_batch_sizes', sizes if saving(serializer) else None)
    except KeyError:   # a snapshot taken without 'auto': start from whole batches
        return
    if not saving(serializer):
        updater._chunk_limits = [int(v) for v in numpy.asarray(sizes).ravel()]
        updater.micro_batch_sizes = list(updater._chunk_limits)


def save_iterators(serializer: Any, main_state: Dict[str, numpy.ndarray],
                   worker_iterators: List[Any], worker_states: Dict[int, Any]) -> None:
    """Every replica's iterator as of the last batch it used: ``iterator:main`` and
    ``iterator:replica<rank>`` (a worker's own state when it runs, else its iterator's)."""
    write_state(serializer['iterator:main'], main_state)
    for rank, it in enumerate(worker_iterators, start=1):
        write_state(serializer[f'iterator:replica{rank}'],
                    worker_states[rank] if rank in worker_states else capture_state(it))


def keep_positions(main: Any, worker_iterators: List[Any],
                   worker_states: Dict[int, Any]) -> None:
    """Put the workers' iterator states (as of the last batch each used) into the
    iterators the master holds for them, which never moved (their processes read copies):
    what a snapshot taken later, or another updater built on them, reads."""
    kept: Dict[str, Any] = {}
    save_iterators(chainer.serializers.DictionarySerializer(kept), capture_state(main),
                   worker_iterators, worker_states)
    load_iterators(NpzDeserializer(kept), main, worker_iterators)


def load_iterators(serializer: Any, main: Any, worker_iterators: List[Any]) -> None:
    """Every replica's iterator from ``iterator:main`` and ``iterator:replica<rank>``.

    The master holds the workers' iterators too, and where they shuffle with one
    generator (numpy's global one: Chainer's default ``ShuffleOrderSampler()``), that one
    object cannot hold each process's state: the worker's copies drew apart from the
    master's wherever the shards' epochs end at different updates, and loading each into
    the shared object left the last replica's state for all (the master's next order was
    a worker's). So a worker's iterator whose ``ShuffleOrderSampler`` draws from a
    generator an earlier replica's draws from gets a sampler with a generator of its own
    first, which its saved state then fills; the worker gets that one.
    """
    load_state(main, serializer['iterator:main'])
    taken = {id(order_sampler_rng(main))}
    for rank, it in enumerate(worker_iterators, start=1):
        rng = order_sampler_rng(it)
        if (isinstance(rng, numpy.random.RandomState) and id(rng) in taken
                and type(it.order_sampler) is chainer.iterators.ShuffleOrderSampler):
            it.order_sampler = chainer.iterators.ShuffleOrderSampler(
                numpy.random.RandomState())
        load_state(it, serializer[f'iterator:replica{rank}'])
        taken.add(id(order_sampler_rng(it)))

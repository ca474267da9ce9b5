"""Iterators of the user's own: one without ``epoch_detail``, and one whose ``serialize``
fails (``_checkpoint.capture_state``).

``StandardUpdater`` calls an iterator's ``serialize`` for a snapshot only. The updater reads
the position through it before each batch it loads ahead, at the end of the data and where
worker processes stop. One that raises (an iterator that cannot be snapshotted) or saves
what a dictionary cannot hold (a ragged list) failed there with the iterator's bare error,
and the teardown that followed read it again, before stopping anything: the workers and
the shared memory stayed until the interpreter's exit, and every ``finalize()`` raised.
"""
from __future__ import annotations

import os
from multiprocessing import shared_memory

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import classifier, dataset, params, run_updates, setup_optimizer
from _processes import gone_within


class _Unsaved(chainer.iterators.SerialIterator):
    def serialize(self, serializer):
        raise NotImplementedError('this iterator cannot be snapshotted')


class _Ragged(chainer.iterators.SerialIterator):
    """Saves a history of ragged lists, which a dictionary of arrays cannot take once
    two of them differ in length (after its second batch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = []

    def __next__(self):
        self.history.append(list(range(len(self.history) + 1)))
        return super().__next__()

    next = __next__

    def serialize(self, serializer):
        super().serialize(serializer)
        self.history = serializer('history', self.history)


def _its(kind, n):
    return [kind(dataset(32, seed=r), 4, shuffle=False) for r in range(n)]


@pytest.mark.parametrize('kind', [_Unsaved, _Ragged])
def test_a_failing_serialize_is_said_and_the_replicas_stop(kind, monkeypatch):
    made = []
    make = shared_memory.SharedMemory.__init__

    def recording(self, name=None, create=False, size=0, **kwargs):
        make(self, name, create, size, **kwargs)
        if create:
            made.append(self.name)
    monkeypatch.setattr(shared_memory.SharedMemory, '__init__', recording)
    model = classifier()
    updater = ParallelAccumulatingUpdater(_its(kind, 2), setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, prefetch=2)
    pids = []
    try:
        with pytest.raises(Exception) as info:
            for _ in range(4):
                run_updates(updater, model, 1)
                pids = pids or updater.worker_pids()
        message = str(info.value)
        assert (f'{kind.__name__}.serialize() failed while the updater read the '
                "iterator's position") in message, message
        assert 'prefetch=0 avoids the reads before the batches loaded ahead only' in message
        if kind is _Unsaved:
            assert type(info.value) is NotImplementedError
    finally:
        updater.finalize()
    updater.finalize()   # raised again, each time, from the teardown's read
    assert updater.worker_pids() == []
    assert gone_within(pids, 10)
    # (_Unsaved fails at the start, before anything is made; _Ragged at its third batch)
    assert bool(made) is (kind is _Ragged)
    assert [name for name in made if os.path.exists('/dev/shm/' + name.lstrip('/'))] == []


@pytest.mark.parametrize('n', [1, 2])
def test_with_prefetch_0_such_an_iterator_trains_as_standard_updater(n):
    model, reference_model = classifier(seed=3), classifier(seed=3)
    updater = ParallelAccumulatingUpdater(_its(_Unsaved, n), setup_optimizer('sgd', model),
                                          devices=['@numpy'] * n, prefetch=0,
                                          accumulate_steps=3 - n)
    try:
        run_updates(updater, model, 3)
    finally:
        updater.finalize()
    data = [dataset(32, seed=r) for r in range(n)]
    batches = [sum((list(d[i * 4 * (3 - n):(i + 1) * 4 * (3 - n)]) for d in data), [])
               for i in range(3)]
    reference = StandardUpdater(
        chainer.iterators.SerialIterator(sum(batches, []), 8, shuffle=False),
        setup_optimizer('sgd', reference_model))
    run_updates(reference, reference_model, 3)
    for name, value in params(reference_model).items():
        np.testing.assert_allclose(params(model)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


class _Minimal(chainer.dataset.Iterator):
    """What StandardUpdater needs of an iterator, for a run stopped in iterations: the
    batches, ``epoch`` (for LogReport) and ``is_new_epoch``."""

    def __init__(self, data, batch_size):
        self.data, self.batch_size, self.position, self.epoch = data, batch_size, 0, 0
        self.is_new_epoch = False

    def __next__(self):
        batch = [self.data[(self.position + i) % len(self.data)]
                 for i in range(self.batch_size)]
        self.position += self.batch_size
        self.is_new_epoch = self.position // len(self.data) > self.epoch
        self.epoch = self.position // len(self.data)
        return batch


@pytest.mark.parametrize('n, prefetch', [(2, 'auto'), (1, 0)])
def test_an_iterator_without_epoch_detail_trains_as_under_standard_updater(n, prefetch):
    """It failed at the first update with a bare AttributeError from the loader, where
    StandardUpdater trains (and raises only where epoch_detail is asked for)."""
    model = classifier(seed=3)
    its = [_Minimal(dataset(12, seed=r), 4) for r in range(n)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * n, prefetch=prefetch)
    try:
        run_updates(updater, model, 4)
        assert (updater.iteration, updater.epoch, updater.is_new_epoch) == (4, 1, False)
        with pytest.raises(AttributeError, match="'_Minimal' object has no attribute "
                                                 "'epoch_detail'"):
            updater.epoch_detail   # as StandardUpdater's, read from the iterator
    finally:
        updater.finalize()


class _MinimalWithASampler(_Minimal):
    """Saves nothing either, but holds an order sampler with a generator of its own, whose
    state the updater adds to what it captures."""

    def __init__(self, data, batch_size):
        super().__init__(data, batch_size)
        self.order_sampler = chainer.iterators.ShuffleOrderSampler(np.random.RandomState(0))


@pytest.mark.parametrize('kind', [_Minimal, _MinimalWithASampler])
def test_an_iterator_that_saves_nothing_is_not_read_ahead_by_default(kind):
    """Its serialize saves nothing (Chainer's Iterator's own): batches loaded ahead could
    not be put back where the updater stopped, so the iterator, used again, skipped them.
    prefetch='auto' loads it inline; a prefetch asked for says so."""
    model = classifier(seed=3)
    its = [kind(dataset(48, seed=0), 4)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'])
    try:
        run_updates(updater, model, 3)
        assert updater.loading_modes == ['none']
    finally:
        updater.finalize()
    assert its[0].position == 12   # three batches used, none read ahead
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=2)
    try:
        with pytest.warns(RuntimeWarning, match=rf"^{kind.__name__}\.serialize\(\) saves "
                                                r'nothing, so the batches that prefetch=2 '
                                                r'loads ahead'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_a_workers_iterator_that_saves_nothing_is_named_when_it_is_read_again():
    """Its position could not come back from the worker process: a restart (trainer.run()
    again) read its shard from where it stood at the start again, silently."""
    model = classifier(seed=3)
    its = [_Minimal(dataset(48, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, prefetch=0)
    try:
        run_updates(updater, model, 2)
        updater.finalize()
        with pytest.warns(RuntimeWarning, match=r"iterator 1 \(worker 1's\) may not stand "
                                                r'where its replica stopped reading: its '
                                                r'serialize\(\) \(_Minimal\) saves nothing'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()

"""Where an iterator reads its first batch: in the thread that builds the loader.

``MultiprocessIterator`` forks its pool of loader processes at its first ``next()``. Forked
from the prefetch thread while the main thread is inside an OpenBLAS call (the lazy
parameters' forward pass, the first window), that call never returns: the master or a
worker hangs at start (the slow ``test_chainer_style`` stress shows it). So the loader
reads the first batch itself, before its thread starts and before any BLAS work, on the
master and in every worker; no later read may start the pool again.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import chainer
from chainer.iterators import MultiprocessIterator, SerialIterator

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._checkpoint import load_state
from mgpu_updater._loader import make_loader

from _models import RaisesAt, classifier, dataset, params, setup_optimizer
from _processes import children


class RecordingIterator(SerialIterator):
    """Records the thread of each read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads = []

    def __next__(self):
        self.threads.append(threading.current_thread().name)
        return super().__next__()

    next = __next__


class PoolRecordingIterator(MultiprocessIterator):
    """Records the thread of each read that starts the loader pool (Chainer 7.8.1
    ``iterators/multiprocess_iterator.py``:147-152)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool_started_in = []

    def __next__(self):
        if self._prefetch_loop.thread is None:
            self.pool_started_in.append(threading.current_thread().name)
        return super().__next__()

    next = __next__


class FirstReadOnMainThread(SerialIterator):
    """Fails the way a hang would be found out: its first read off the main thread."""

    def __next__(self):
        if not getattr(self, '_read_once', False):
            self._read_once = True
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError('first batch read in thread '
                                   f'{threading.current_thread().name!r}')
        return super().__next__()

    next = __next__


def test_first_batch_is_read_by_the_thread_that_builds_the_loader():
    it = RecordingIterator(dataset(12, seed=0), 3, shuffle=False)
    loader = make_loader(it, chainer.dataset.concat_examples, None, 2)
    try:
        assert it.threads[:1] == [threading.current_thread().name]
        got = [loader.get() for _ in range(5)]
    finally:
        loader.close()
    assert set(it.threads[1:]) == {'mgpu-prefetch'}   # the rest ahead, in the thread
    expected = chainer.dataset.concat_examples(dataset(12, seed=0)[:])[0]
    np.testing.assert_array_equal(np.concatenate([b.arrays[0] for b in got[:4]]), expected)
    assert [b.epoch.epoch for b in got] == [0, 0, 0, 1, 1]


def test_multiprocess_iterator_pool_starts_once_in_the_building_thread():
    it = PoolRecordingIterator(dataset(12, seed=0), 3, n_processes=2)
    try:
        loader = make_loader(it, chainer.dataset.concat_examples, None, 2)
        try:
            assert it.pool_started_in == [threading.current_thread().name]
            for _ in range(3):
                loader.get()
            state = loader.state()
        finally:
            loader.close()
        load_state(it, _Deserializer(state))   # as a resume into a running updater does
        loader = make_loader(it, chainer.dataset.concat_examples, None, 2)
        try:
            for _ in range(6):                 # across epochs
                loader.get()
        finally:
            loader.close()
        assert it.pool_started_in == [threading.current_thread().name]
    finally:
        it.finalize()


def test_master_and_workers_read_their_first_batch_on_the_main_thread():
    """On the master before the lazy parameters' forward pass, in each worker before it
    computes: with the read in the prefetch thread both fail here."""
    model = classifier(seed=0, lazy=True)
    data = dataset(24, seed=1)
    its = [FirstReadOnMainThread(data[r::2], 3, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy', '@numpy'], accumulate_steps=2)
    try:
        for _ in range(2):
            updater.update()
    finally:
        updater.finalize()
    assert all(np.isfinite(v).all() for v in params(model).values())


class _Deserializer(chainer.serializer.Deserializer):
    def __init__(self, target, path=''):
        self.target, self.path = target, path

    def __getitem__(self, key):
        return _Deserializer(self.target, self.path + key.strip('/') + '/')

    def __call__(self, key, value):
        return self.target[self.path + key.lstrip('/')]


def _workers():
    """This process's children but multiprocessing's resource tracker."""
    out = []
    for pid in children(os.getpid()):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if b'resource_tracker' not in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def _alive_loaders():
    return [t for t in threading.enumerate() if t.name == 'mgpu-prefetch' and t.is_alive()]


@pytest.mark.parametrize('prefetch', [2, 'auto'])
def test_a_start_interrupted_leaves_the_main_iterator_where_it_was(prefetch, monkeypatch):
    """Ctrl-C while the workers start (seconds of spawning), then an update again, as a
    notebook's ``trainer.run()`` again: the loader had read ahead of the master's first
    batch, which was never trained (prefetch=2: three batches lost)."""
    from mgpu_updater._local import group
    model = classifier()
    its = [SerialIterator(dataset(16, seed=r), 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, prefetch=prefetch)
    pickled = group._pickled

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(group, '_pickled', interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            updater.update()
        assert its[0].current_position == 0 and its[0].epoch == 0
        monkeypatch.setattr(group, '_pickled', pickled)
        updater.update()
    finally:
        updater.finalize()
    assert its[0].current_position == 2   # (as of the last batch used, after finalize)


def test_a_ctrl_c_as_the_loader_thread_starts_leaves_no_thread(monkeypatch):
    """The thread ran on, holding the main iterator and reading it beside the next
    loader (batches skipped), for the life of the process: nobody held its loader."""
    model = classifier()
    it = SerialIterator(dataset(32, seed=1), 2, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=2)
    start = threading.Thread.start
    armed = [True]

    def interrupted_start(self):
        start(self)
        if armed[0] and self.name == 'mgpu-prefetch':
            armed[0] = False
            raise KeyboardInterrupt   # a SIGINT in start()'s wait for the thread
    monkeypatch.setattr(threading.Thread, 'start', interrupted_start)
    before = _alive_loaders()
    try:
        with pytest.raises(KeyboardInterrupt):
            updater.update()
        assert [t for t in _alive_loaders() if t not in before] == []
        assert it.current_position == 0
        updater.update()
    finally:
        updater.finalize()
    assert it.current_position == 2


@pytest.mark.parametrize('prefetch', [0, 2])
def test_an_update_again_after_a_dataset_error_goes_on_past_the_batch_as_standard_updater(
        prefetch):
    """SerialIterator moves before it reads the dataset: StandardUpdater's next update
    trains the batch after the one that failed. Loading ahead, the loader's state put the
    iterator back before it, so every retry raised the same error."""
    data = RaisesAt(dataset(32, seed=1), 9, ValueError('sample 9 is corrupt'))
    positions = []
    for make in ('standard', 'ours'):
        model = classifier()
        it = SerialIterator(data, 2, shuffle=False)
        if make == 'standard':
            updater = chainer.training.updaters.StandardUpdater(
                it, setup_optimizer('sgd', model), loss_func=model)
        else:
            updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                                  devices=['@numpy'], prefetch=prefetch)
        try:
            for _ in range(4):
                updater.update()
            with pytest.raises(ValueError, match='sample 9 is corrupt'):
                updater.update()
            updater.update()
        finally:
            updater.finalize()
        positions.append(it.current_position)   # (as of the last batch used)
    assert positions[1] == positions[0] == 12


@pytest.mark.parametrize('devices', [1, 2])
def test_a_ctrl_c_as_the_start_returns_leaves_no_thread_and_no_batch_read(devices,
                                                                          monkeypatch):
    """The start's last step, outside what it cleaned up after: the loader thread ran on
    (three batches skipped), and with workers these ran on too."""
    from mgpu_updater import _startup
    model = classifier()
    its = [SerialIterator(dataset(16, seed=r), 2, shuffle=False) for r in range(devices)]
    updater = ParallelAccumulatingUpdater(its if devices > 1 else its[0],
                                          setup_optimizer('sgd', model),
                                          devices=['@numpy'] * devices, prefetch=2)
    started = _startup.Started

    def interrupted(*args):
        monkeypatch.setattr(_startup, 'Started', started)
        raise KeyboardInterrupt
    monkeypatch.setattr(_startup, 'Started', interrupted)
    before = _alive_loaders()
    try:
        with pytest.raises(KeyboardInterrupt):
            updater.update()
        assert [t for t in _alive_loaders() if t not in before] == []
        assert its[0].current_position == 0
        assert _workers() == []   # the workers it started are stopped
        updater.update()
    finally:
        updater.finalize()
    assert its[0].current_position == 2


def test_a_second_ctrl_c_in_the_starts_cleanup_still_sets_back_and_stops(monkeypatch):
    """The cleanup of a start that failed waits up to seconds for the loader's thread; a
    second Ctrl-C there skipped setting the iterator back and stopping the workers."""
    from mgpu_updater import _loader, _startup
    model = classifier()
    its = [SerialIterator(dataset(16, seed=r), 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, prefetch=2)
    started, close = _startup.Started, _loader.Prefetcher.close

    def interrupted(*args):
        monkeypatch.setattr(_startup, 'Started', started)
        raise KeyboardInterrupt

    def close_interrupted(self):
        close(self)
        raise KeyboardInterrupt   # the second Ctrl-C, in the bounded wait
    monkeypatch.setattr(_startup, 'Started', interrupted)
    monkeypatch.setattr(_loader.Prefetcher, 'close', close_interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            updater.update()
        assert its[0].current_position == 0
        assert _workers() == []
        monkeypatch.setattr(_loader.Prefetcher, 'close', close)
        updater.update()
    finally:
        updater.finalize()
    assert its[0].current_position == 2


def test_a_second_ctrl_c_as_the_loader_closes_after_a_failed_update_leaves_it_usable(
        monkeypatch):
    """The teardown after a failed update: a second Ctrl-C in the loader's wait left the
    closed loader recorded, and every later update raised 'this loader was closed'."""
    from mgpu_updater import _loader
    model = classifier()
    it = SerialIterator(dataset(32, seed=1), 2, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=2)
    close = _loader.Prefetcher.close

    def close_interrupted(self):
        close(self)
        raise KeyboardInterrupt
    try:
        updater.update()
        monkeypatch.setattr(_loader.Prefetcher, 'close', close_interrupted)
        monkeypatch.setattr(model, 'forward', lambda *a: (_ for _ in ()).throw(
            KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            updater.update()
        monkeypatch.undo()
        updater.update()
        assert updater.iteration == 2
    finally:
        monkeypatch.undo()
        updater.finalize()

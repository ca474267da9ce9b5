"""The loader: exact state with batches in flight, errors with their traceback, shutdown."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

import chainer

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._checkpoint import capture_state, load_state
from mgpu_updater._loader import Prefetcher, make_loader

from _models import classifier, dataset, setup_optimizer


def _iterator(n=20, b=3, **kwargs):
    return chainer.iterators.SerialIterator(dataset(n, seed=1), b, **kwargs)


@pytest.mark.parametrize('depth', [0, 1, 3])
def test_state_is_that_of_the_last_batch_handed_out(depth):
    it = _iterator(shuffle=True)
    loader = make_loader(it, chainer.dataset.concat_examples, None, depth)
    try:
        for _ in range(4):
            loader.get()
        time.sleep(0.05)                       # let the thread run ahead
        state = loader.state()
        expected = [loader.get().arrays[0] for _ in range(5)]
    finally:
        loader.close()
    fresh = _iterator(shuffle=True)
    load_state(fresh, _Deserializer(state))
    replay = [chainer.dataset.concat_examples(fresh.next())[0] for _ in range(5)]
    for a, b in zip(expected, replay):
        np.testing.assert_array_equal(a, b)


class _Deserializer(chainer.serializers.NpzDeserializer):
    pass


def test_repeat_false_ends_with_none_and_stays_ended():
    loader = make_loader(_iterator(n=7, b=3, repeat=False, shuffle=False),
                         chainer.dataset.concat_examples, None, 2)
    try:
        sizes = []
        while True:
            batch = loader.get()
            if batch is None:
                break
            sizes.append(batch.size)
        assert sizes == [3, 3, 1]
        assert loader.get() is None
    finally:
        loader.close()


def _failing_converter(batch, device=None):
    raise KeyError('broken example in the converter')


def test_an_error_in_the_loader_surfaces_with_its_traceback():
    loader = make_loader(_iterator(), _failing_converter, None, 2)
    try:
        with pytest.raises(KeyError, match='broken example') as info:
            loader.get()
        frames = ''.join(traceback.format_tb(info.value.__traceback__))
        assert '_failing_converter' in frames
    finally:
        loader.close()


class _SlowDataset(chainer.dataset.DatasetMixin):
    def __len__(self):
        return 1000

    def get_example(self, i):
        time.sleep(0.2)
        return np.zeros(5, np.float32), np.int32(0)


def test_close_stops_the_thread_promptly():
    loader = Prefetcher(chainer.iterators.SerialIterator(_SlowDataset(), 2),
                        chainer.dataset.concat_examples, None, 2)
    loader.get()
    t0 = time.monotonic()
    loader.close()
    loader.close()                            # twice is fine
    assert time.monotonic() - t0 < 2.0
    assert not any(t.name == 'mgpu-prefetch' and t.is_alive() for t in threading.enumerate())


def test_get_runs_no_python_code_of_threading_or_queue():
    """Ctrl-C lands in the master's main thread at CPython's next signal check, which can
    be the entry of any Python function. Where that function is one of ``threading``'s
    lock wrappers (``Condition.__exit__`` before its release, which ``queue.Queue.get``
    runs), the lock stays held, or the interrupt turns into ``RuntimeError: release
    unlocked lock``; the master's teardown then hung on that lock (CI,
    ``test_faults[master_sigint_mpit]``). So the consumer's ``get()`` runs only C calls
    there: no Python function of ``threading`` or ``queue`` is entered."""
    loader = Prefetcher(chainer.iterators.SerialIterator(dataset(40, seed=1), 2),
                        chainer.dataset.concat_examples, None, 2)
    entered = []

    def profile(frame, event, arg):
        if event == 'call' and frame.f_code.co_filename in (threading.__file__,
                                                            queue.__file__):
            entered.append(f'{frame.f_code.co_filename}:{frame.f_code.co_name}')
    try:
        loader.get()
        sys.setprofile(profile)
        try:
            for _ in range(8):
                loader.get()
        finally:
            sys.setprofile(None)
    finally:
        loader.close()
    assert entered == []


@pytest.mark.slow
def test_interrupted_gets_stay_keyboard_interrupts_and_close_promptly():
    """2000 interrupts of a get() loop (``scripts/interrupted_loader.py``, a SIGALRM
    handler raising KeyboardInterrupt at CPython's signal check, as Ctrl-C does): every
    one surfaces as KeyboardInterrupt and every close ends within 1 s. With queue.Queue
    this run hung in close() (a mutex left held), on Python 3.11 and 3.12."""
    script = Path(__file__).resolve().parent / 'scripts' / 'interrupted_loader.py'
    try:
        done = subprocess.run([sys.executable, str(script), '2000'], capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f'the interrupted loader hung (a lock left held?): {exc.stderr}')
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report['trials'] == 2000
    assert report['n_other_errors'] == 0, report['other_errors']
    assert report['slow_closes'] == 0, report


@pytest.mark.parametrize('prefetch', [0, 2, 'auto'])
def test_one_device_epoch_bookkeeping_is_standard_updaters_after_every_update(prefetch):
    """One device, one micro-batch per update: after every update the updater's epoch,
    epoch_detail, previous_epoch_detail and is_new_epoch, and its optimizer's epoch, are
    StandardUpdater's on the same data, with epochs that end inside a batch; loading
    inline (where the updater reads them from the iterator when asked, as
    StandardUpdater does) and ahead (where the iterator has moved on), and through
    'auto''s trial, which switches between the two, and past it."""
    def iterator():
        return chainer.iterators.SerialIterator(dataset(10, seed=1), 3, shuffle=False)
    reference_model, model = classifier(seed=1), classifier(seed=1)
    reference = chainer.training.updaters.StandardUpdater(
        iterator(), setup_optimizer('sgd', reference_model))
    updater = ParallelAccumulatingUpdater(iterator(), setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=prefetch)

    def bookkeeping(u):
        return (u.epoch, u.epoch_detail, u.previous_epoch_detail, u.is_new_epoch,
                u.get_optimizer('main').epoch)
    try:
        assert bookkeeping(updater) == bookkeeping(reference)
        for i in range(300 if prefetch == 'auto' else 40):
            reference.update()
            updater.update()
            assert bookkeeping(updater) == bookkeeping(reference), i
        assert updater.loading_modes != ['trial']
    finally:
        updater.finalize()


def test_works_with_multiprocess_iterator():
    train = dataset(40, seed=3)
    model = classifier(seed=3)
    its = [chainer.iterators.MultiprocessIterator(train, 4, n_processes=1, shuffle=False)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'], accumulate_steps=2)
    try:
        for _ in range(3):
            updater.update()
        # 3 updates x 2 micro-batches x 4 samples, as of the batches used, not prefetched
        assert updater.epoch_detail == pytest.approx(24 / 40)
        assert int(capture_state(its[0])['current_position']) >= 24
    finally:
        updater.finalize()


class _Counted(chainer.dataset.DatasetMixin):
    """A dataset that counts its reads."""

    def __init__(self, base):
        self.base, self.reads = base, 0

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        self.reads += 1
        return self.base[i]


def _multithread(data, seed=5):
    return chainer.iterators.MultithreadIterator(
        data, 3, n_threads=2,
        order_sampler=chainer.iterators.ShuffleOrderSampler(np.random.RandomState(seed)))


def test_capturing_a_multithread_iterators_state_leaves_its_batches_and_reads_alone():
    """Its serialize drops the batch it loaded ahead (Chainer's MultithreadIterator): the
    loader, which captures the state before every batch it loads, read each example
    twice and drew the next epoch's order twice."""
    data = dataset(10, seed=2)
    runs = []
    for capture in (False, True):
        counted = _Counted(data)
        it = _multithread(counted)
        seen = []
        try:
            for _ in range(12):   # into the fourth epoch
                if capture:
                    capture_state(it)
                seen.append([float(x[0]) for x, _ in it.next()])
        finally:
            it.finalize()
        runs.append((seen, counted.reads))
    assert runs[1][0] == runs[0][0]
    # 12 batches of 3, and the one it loads ahead (or part of it: finalize stops its
    # threads); capturing before each batch read every batch twice
    assert runs[1][1] <= 13 * 3


class _Wraps(chainer.dataset.Iterator):
    """An iterator of the user's own around one of Chainer's, which it saves in its own
    ``serialize`` (composition, not a subclass)."""

    def __init__(self, inner):
        self.inner = inner

    def __next__(self):
        return self.inner.next()

    epoch = property(lambda self: self.inner.epoch)
    epoch_detail = property(lambda self: self.inner.epoch_detail)
    previous_epoch_detail = property(lambda self: self.inner.previous_epoch_detail)
    is_new_epoch = property(lambda self: self.inner.is_new_epoch)
    batch_size = property(lambda self: self.inner.batch_size)

    def serialize(self, serializer):
        self.inner.serialize(serializer['inner'])

    def finalize(self):
        self.inner.finalize()


class _WrapsInAList(_Wraps):
    """The same, holding the inner one in a list (one of several sources)."""

    def __init__(self, inner):
        self.sources = [inner]

    inner = property(lambda self: self.sources[0])

    def serialize(self, serializer):
        self.sources[0].serialize(serializer['inner'])


@pytest.mark.parametrize('kind, wrap', [
    ('multiprocess', _Wraps), ('multithread', _Wraps),
    ('multiprocess', lambda it: _Wraps(_Wraps(it))), ('multiprocess', _WrapsInAList)])
def test_capturing_an_iterator_that_wraps_one_reading_ahead_leaves_its_batches_alone(
        kind, wrap):
    """The loader captures the wrapper's state before each batch it loads ahead, and the
    wrapper's serialize called the inner one's, which discards what it loaded ahead and
    (MultiprocessIterator) drew the order anew: the run read other samples than the
    iterator left alone, and other samples in each run."""
    data = dataset(10, seed=2)
    runs = []
    for capture in (False, True):
        sampler = chainer.iterators.ShuffleOrderSampler(np.random.RandomState(5))
        inner = (chainer.iterators.MultiprocessIterator(data, 3, n_processes=1,
                                                        order_sampler=sampler)
                 if kind == 'multiprocess' else
                 chainer.iterators.MultithreadIterator(data, 3, n_threads=2,
                                                       order_sampler=sampler))
        it = wrap(inner)
        seen = []
        try:
            for _ in range(12):   # into the fourth epoch
                if capture:
                    state = capture_state(it)
                    assert int(next(v for k, v in state.items()
                                    if k.endswith('current_position'))) == \
                        inner.current_position
                seen.append(sorted(float(x[0]) for x, _ in it.next()))
        finally:
            it.finalize()
        assert 'serialize' not in vars(inner)   # its own method again
        runs.append(seen)
    assert runs[1] == runs[0]


def test_an_iterator_that_wraps_a_multiprocess_one_without_shuffle_is_set_back():
    """Chainer's MultiprocessIterator without shuffle cannot load its own state (its
    serialize copies an order it does not have): through a wrapper, setting it back where
    the loader had read ahead raised at finalize() and left it read ahead."""
    model, reference_model = classifier(seed=4), classifier(seed=4)
    its = [_Wraps(chainer.iterators.MultiprocessIterator(dataset(20, seed=3), 4,
                                                         n_processes=1, shuffle=False))]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=2)
    try:
        for _ in range(3):
            updater.update()
    finally:
        updater.finalize()
    try:
        assert its[0].epoch_detail == pytest.approx(12 / 20)   # where the last batch left it
        reference = chainer.training.updaters.StandardUpdater(
            chainer.iterators.SerialIterator(dataset(20, seed=3), 4, shuffle=False),
            setup_optimizer('sgd', reference_model))
        for _ in range(3):
            reference.update()
        for (name, ours), (_, theirs) in zip(sorted(model.namedparams()),
                                             sorted(reference_model.namedparams())):
            np.testing.assert_array_equal(ours.array, theirs.array, err_msg=name)
    finally:
        its[0].finalize()


@pytest.mark.parametrize('prefetch', [2, 'auto'])
def test_one_device_with_a_multithread_iterator_is_standard_updater(prefetch):
    model, reference_model = classifier(seed=4), classifier(seed=4)
    reference = chainer.training.updaters.StandardUpdater(
        _multithread(dataset(10, seed=3)), setup_optimizer('sgd', reference_model))
    updater = ParallelAccumulatingUpdater(_multithread(dataset(10, seed=3)),
                                          setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=prefetch)
    try:
        for _ in range(20):
            reference.update()
            updater.update()
    finally:
        updater.finalize()
        reference.finalize()
    for (name, ours), (_, theirs) in zip(sorted(model.namedparams()),
                                         sorted(reference_model.namedparams())):
        np.testing.assert_array_equal(ours.array, theirs.array, err_msg=name)


class _GatedDataset(chainer.dataset.DatasetMixin):
    """Example 0 loads at once; every later example waits for ``gate``."""

    def __init__(self):
        self.gate = threading.Event()

    def __len__(self):
        return 10

    def get_example(self, i):
        if i > 0:
            self.gate.wait(10)
        return np.full(5, i, np.float32), np.int32(i)


def test_a_loaded_batch_is_handed_out_while_the_next_one_is_still_loading():
    data = _GatedDataset()
    loader = Prefetcher(chainer.iterators.SerialIterator(data, 1, shuffle=False),
                        chainer.dataset.concat_examples, None, 2)
    got = []
    consumer = threading.Thread(target=lambda: got.append(loader.get()))
    try:
        consumer.start()
        consumer.join(5)              # the loader is now blocked inside example 1
        assert got and got[0].arrays[1][0] == 0, 'get() waited for the load in progress'
        state = loader.state()        # and the state is that before example 1
        assert int(state['current_position']) == 1
    finally:
        data.gate.set()
        consumer.join(5)
        loader.close()


class _Watched(chainer.dataset.DatasetMixin):
    """Records the thread and the phase (in an update or between two) of every read."""

    def __init__(self, base, phase, reads):
        self.base, self.phase, self.reads = base, phase, reads

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        time.sleep(0.002)   # a read that waits (a file): loading ahead pays
        self.reads.append((threading.current_thread().name, self.phase[0]))
        return self.base[i]


@pytest.mark.parametrize('devices', [['@numpy'], ['@numpy', '@numpy']])
def test_no_read_ahead_while_the_code_between_updates_runs(devices):
    """Loading ahead read the dataset while an Evaluator (the code between updates) read
    the same object: a dataset over one file handle (seek, then read) returned records
    from the wrong place. The master's thread now reads only while an update runs, and
    waits for a read under way at its end."""
    phase, reads = ['between'], []
    its = [chainer.iterators.SerialIterator(_Watched(dataset(64, seed=r), phase, reads), 4)
           for r in range(len(devices))]
    model = classifier()
    updater = ParallelAccumulatingUpdater(its if len(devices) > 1 else its[0],
                                          setup_optimizer('sgd', model), devices=devices,
                                          prefetch=2)
    try:
        for _ in range(6):
            phase[0] = 'update'
            updater.update()
            phase[0] = 'between'
            time.sleep(0.03)   # an Evaluator's time
    finally:
        updater.finalize()
    ahead = [p for thread, p in reads if thread == 'mgpu-prefetch']
    assert ahead, 'no read ahead at all: nothing was tested'
    assert 'between' not in ahead


class _HangsAfter(chainer.dataset.DatasetMixin):
    """Reads in the loader's thread hang (8 s: a dead network mount) once ``hang`` is set."""

    def __init__(self, base, hang, inside):
        self.base, self.hang, self.inside = base, hang, inside

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        if self.hang.is_set() and threading.current_thread().name == 'mgpu-prefetch':
            self.inside.set()
            time.sleep(8)
        return self.base[i]


class _RaisesWhen(chainer.Chain):
    """Raises once the loader's thread is inside its read that hangs."""

    def __init__(self, hang, inside):
        super().__init__()
        self.hang, self.inside = hang, inside
        with self.init_scope():
            self.inner = classifier()

    def forward(self, x, t):
        if self.hang.is_set():
            assert self.inside.wait(5)
            raise ValueError('the forward failed')
        return self.inner(x, t)


def test_an_error_in_an_update_is_not_held_up_by_a_read_under_way():
    """An update that raises while the loader's thread is inside a read that does not
    return: the error reaches the caller once the teardown's bounded wait for the thread
    is over (5 s), not after the read (the end of an update waits for a read under way
    only where the update succeeded)."""
    hang, inside = threading.Event(), threading.Event()
    model = _RaisesWhen(hang, inside)
    it = chainer.iterators.SerialIterator(_HangsAfter(dataset(64, seed=3), hang, inside), 4)
    updater = ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=2)
    try:
        for _ in range(2):
            updater.update()
        hang.set()
        began = time.monotonic()
        with pytest.raises(ValueError, match='the forward failed'):
            updater.update()
        assert time.monotonic() - began < 7.5
    finally:
        updater.finalize()

"""A gated loader loads only while its replica waits (``prefetch='auto'``; issue 15).

On CPU replicas with workers, a load in the background thread during forward/backward takes
the GIL from it: the window's compute read 1.020x the hand-written loop's with the thread
loading meanwhile, 1.002x without. A gated prefetcher starts a load only while its consumer
does not hold the gate (a worker releases it while it waits for the master) or waits in
``get`` for a batch not loaded yet; one whose loads keep the consumer waiting (files, a
``MultiprocessIterator``) opens for good. The contract: no load starts while held; nothing
waits on a closed gate; the batches, their order and the exact state are the ungated
loader's; ``'auto'`` gates exactly where the replicas are on the CPU with workers.
"""
from __future__ import annotations

import threading
import time

import chainer
import pytest

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater import _loader as loader_module
from mgpu_updater._load_trial import LoadTrial
from mgpu_updater._loader import Prefetcher, plan

from _models import classifier, dataset


class _Counting(chainer.dataset.DatasetMixin):
    """A dataset that records when each example is read (and may take its time)."""

    def __init__(self, n=40, latency=0.0):
        self.base = dataset(n, seed=1)
        self.reads = []
        self.threads = []   # the thread that read each example
        self.latency = latency

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        self.reads.append(time.perf_counter())
        self.threads.append(threading.get_ident())
        if self.latency:
            time.sleep(self.latency)
        return self.base[i]


def _loader(data, depth=2, gated=True, b=2):
    return Prefetcher(chainer.iterators.SerialIterator(data, b, shuffle=False),
                      chainer.dataset.concat_examples, None, depth, gated=gated)


def _settle(data, at_least=0, quiet=0.1, timeout=5.0):
    """Wait until ``at_least`` examples were read (a loaded machine may start the thread
    late), then until none was read for ``quiet`` seconds; how many were read."""
    deadline = time.perf_counter() + timeout
    while len(data.reads) < at_least and time.perf_counter() < deadline:
        time.sleep(0.005)
    while time.perf_counter() < deadline:
        n = len(data.reads)
        time.sleep(quiet)
        if len(data.reads) == n:
            return n
    raise AssertionError('the loader kept reading')


def _parked(loader, timeout=5.0):
    """Wait until the thread has handed on its first batch and waits at the gate."""
    deadline = time.perf_counter() + timeout
    while not loader._parked:
        assert time.perf_counter() < deadline, 'the thread never reached the gate'
        time.sleep(0.01)


def test_a_gated_loader_starts_held_and_loads_only_when_released():
    data = _Counting()
    loader = _loader(data)
    try:
        first = _settle(data, 2)       # the first batch (read in the constructor) only
        assert first == 2
        loader.release()               # the replica waits: the thread loads ahead
        full = _settle(data, first + 2 * 2)
        assert full == first + 2 * 2   # its depth: two more batches of two
        loader.hold()                  # busy again
        loader.get()                   # a place frees up ...
        held = time.perf_counter()
        assert _settle(data) == full   # ... but nothing is read while held
        loader.release()
        assert _settle(data, full + 1) > full
        assert min(data.reads[full:]) > held
    finally:
        loader.close()


def _labels(batch):
    return batch.arrays[1].tolist()


def _expected(data, j, b=2):
    return [int(data.base[i][1]) for i in range(b * j, b * j + b)]


def test_a_batch_taken_under_a_held_gate_wakes_the_thread_only_when_it_is_let_go():
    """After a wait the queue is full and the thread waits, a batch loaded ahead in hand,
    for a place. A batch taken while the gate is held frees one, but it is handed back
    when the gate is let go: handed back at once, it woke the thread in the middle of the
    window to take the GIL from it (a window 0.2 ms slower, of 0.8 ms, with its threads
    on no core of their own) and park at the gate again."""
    data = _Counting()
    loader = _loader(data)
    try:
        _settle(data)
        loader.release()
        # two batches queued, one waiting for a place
        assert _settle(data, 2 + 2 * 2) == 2 + 2 * 2
        loader.hold()
        assert _labels(loader.get()) == _expected(data, 0)
        time.sleep(0.3)
        assert loader._items.qsize() == 1   # the waiting batch is not put: still asleep
        loader.release()
        assert _settle(data, 2 + 3 * 2) == 2 + 3 * 2   # now it puts that batch and loads the next
        loader.hold()
        assert [_labels(loader.get()) for _ in range(4)] == [
            _expected(data, j) for j in (1, 2, 3, 4)]
    finally:
        loader.close()


def test_a_held_gate_hands_out_every_batch_loaded_ahead_then_loads_in_place():
    """A window of more micro-batches than are queued: the batch the thread waits to put
    is handed a place and taken (no wait on a place owed until release), then the caller
    loads the rest itself, in order."""
    data = _Counting()
    loader = _loader(data)
    try:
        _settle(data, 2)
        loader.release()
        _settle(data, 2 + 2 * 2)
        loader.hold()
        got = [_labels(loader.get()) for _ in range(6)]
        assert got == [_expected(data, j) for j in range(6)]
        here = threading.get_ident()
        assert data.threads[8:12] == [here] * 4   # batches 4 and 5: read by the caller
        assert loader._holding
    finally:
        loader.close()


def test_a_get_that_finds_nothing_loaded_loads_it_itself_and_holds_again(monkeypatch):
    """The thread parked at the held gate, a get with nothing loaded reads the iterator in
    the caller's thread (no hand-off to the thread and back), in order, gate still held."""
    data = _Counting()
    loader = _loader(data, depth=1)
    try:
        _parked(loader)
        got = [loader.get() for _ in range(4)]   # held throughout
        assert [b.arrays[1].tolist() for b in got] == [
            [int(data.base[i][1]) for i in (2 * j, 2 * j + 1)] for j in range(4)]
        here = threading.get_ident()
        assert data.threads[2:] == [here] * 6    # batches 2-4: read by the caller itself
        assert data.threads[0] == here           # the first: read in the constructor
        assert loader.gated and loader._holding and loader._parked
        assert len(data.reads) == 8              # and the thread loaded nothing meanwhile
        loader.release()                         # a wait: the thread loads ahead again
        _settle(data, 9)
        assert len(data.reads) > 8 and here not in data.threads[8:]
        loader.hold()
        assert [loader.get().arrays[1].tolist() for _ in range(2)] == [
            [int(data.base[i][1]) for i in (2 * j, 2 * j + 1)] for j in (4, 5)]
    finally:
        loader.close()


def test_an_error_loading_in_the_callers_thread_is_raised_there_with_its_traceback():
    class Broken(_Counting):
        def get_example(self, i):
            if i == 2:
                raise ValueError('example 2 is broken')
            return super().get_example(i)
    data = Broken()
    loader = _loader(data, depth=1)
    try:
        _parked(loader)
        loader.get()                   # the first batch, the thread's
        with pytest.raises(ValueError, match='example 2 is broken') as info:
            loader.get()
        assert any(entry.name == 'get_example' for entry in info.traceback)
    finally:
        loader.close()


def test_a_slow_load_keeps_the_gate_held_it_is_the_trials_to_open_it():
    """A gated loader whose loads keep its consumer waiting stays gated: whether loading
    ahead pays is the trial's to measure (:mod:`mgpu_updater._load_trial`)."""
    data = _Counting(latency=0.005)
    loader = _loader(data)
    try:
        for _ in range(4):
            loader.get()
        assert loader.gated and loader._holding and loader.mode == 'inline'
    finally:
        loader.close()


class _Scripted(LoadTrial):
    """A trial that decides after ``after`` windows, as told."""

    def __init__(self, after, decision):
        super().__init__()
        self.after, self.told, self.seen = after, decision, []

    def window(self, now):
        self.seen.append(now)
        if len(self.seen) > self.after:
            self.decision = self.told
            return self.told
        return 'inline' if len(self.seen) % 2 else 'ahead'


@pytest.mark.parametrize('decision', ['ahead', 'inline'])
def test_the_trial_switches_the_gate_and_its_decision_stays(decision):
    """Each window asks the trial the way to load: 'ahead' opens the gate (the thread
    loads meanwhile), 'inline' holds it; once decided the trial is dropped and the
    batches are those of a loader that never switched."""
    data = _Counting()
    loader = _loader(data, depth=2)
    loader.trial = _Scripted(4, decision)
    reference = _loader(_Counting(), depth=2, gated=False)
    try:
        got, want = [], []
        for i in range(10):
            loader.window_started()
            expected = ('inline' if (i + 1) % 2 else 'ahead') if i < 4 else decision
            assert loader.gated is (expected == 'inline')
            assert loader.mode == ('trial' if i < 4 else decision)
            got.append(loader.get().arrays[1].tolist())
            want.append(reference.get().arrays[1].tolist())
        assert got == want
        assert loader.trial is None
        if decision == 'ahead':   # the thread loads meanwhile
            before = _settle(data)
            loader.get()
            assert _settle(data, before + 1) > before
    finally:
        loader.close()
        reference.close()


@pytest.mark.parametrize('depth', [1, 3])
def test_a_gated_loader_gives_the_batches_and_states_of_an_ungated_one(depth):
    def run(gated):
        loader = _loader(_Counting(), depth=depth, gated=gated, b=3)
        out = []
        try:
            for i in range(12):
                if i % 3 == 0:
                    loader.release()   # a wait between updates
                    loader.hold()
                batch = loader.get()
                out.append((batch.arrays[1].tolist(), batch.epoch,
                            {k: v.tolist() for k, v in loader.state().items()}))
        finally:
            loader.close()
        return out
    assert run(True) == run(False)


def test_close_while_held_stops_the_thread_promptly():
    data = _Counting()
    loader = _loader(data)
    _settle(data)
    start = time.perf_counter()
    loader.close()
    assert time.perf_counter() - start < 1.0
    assert not loader._thread.is_alive()


def test_auto_starts_inline_with_a_trial_an_int_loads_ahead():
    assert plan('auto') == (loader_module.AUTO_DEPTH, True, True)
    assert plan(3) == (3, False, False)    # an int: as asked
    assert plan(0) == (0, False, False)


@pytest.mark.parametrize('prefetch, gated', [('auto', True), (2, False)])
def test_the_masters_loader_follows_the_plan(prefetch, gated):
    model = classifier(seed=3)
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(32, seed=10 + r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          prefetch=prefetch)
    try:
        updater.update()
        assert isinstance(updater._loader, Prefetcher)
        assert updater._loader.planned_gated is gated
        assert updater.loading_modes == (['trial'] * 2 if gated else ['ahead'] * 2)
    finally:
        updater.finalize()


def test_a_worker_releases_its_loader_only_while_it_waits_for_the_master():
    """``worker._answer``: the gate is released around each wait for the master's next
    message and held while the worker serves one."""
    from mgpu_updater._local import worker as worker_module
    from mgpu_updater._local.protocol import Encoder, StateRequest, Stop
    events = []
    encoder = Encoder()
    messages = [encoder.encode(StateRequest()), encoder.encode(Stop())]

    class Conn:
        def recv_bytes(self):
            events.append('wait')
            return messages.pop(0)

        def send(self, msg):
            events.append('send ' + msg[0])

        def poll(self, timeout=0):
            return False

    class Loader:
        def hold(self):
            events.append('hold')

        def release(self):
            events.append('release')

        def state(self):
            events.append('state')
            return {}

    class Replica:
        loader = Loader()
    worker_module._answer(Conn(), None, Replica(), None, None, None, None)
    assert events == ['release', 'wait', 'hold', 'state', 'send state',
                      'release', 'wait', 'hold']


def test_the_master_loads_in_its_own_thread_only_from_an_iterator_that_takes_no_lock():
    """Ctrl-C reaches the master's main thread: inside ``MultiprocessIterator.next`` it
    can leave that iterator's prefetch thread waiting for good (the teardown then hangs),
    so the master reads such an iterator through its loader thread; workers ignore
    SIGINT and load in their own thread whatever the iterator."""
    serial = chainer.iterators.SerialIterator(dataset(8, seed=1), 2)
    assert loader_module.reads_in_caller_safely(serial)
    mp = chainer.iterators.MultiprocessIterator(dataset(8, seed=1), 2, n_processes=1)
    mt = chainer.iterators.MultithreadIterator(dataset(8, seed=1), 2, n_threads=1)
    try:
        assert not loader_module.reads_in_caller_safely(mp)
        assert not loader_module.reads_in_caller_safely(mt)
    finally:
        mp.finalize()
        mt.finalize()

    class OwnNext(chainer.iterators.SerialIterator):   # its next is not known: the thread
        def __next__(self):
            return super().__next__()
        next = __next__
    assert not loader_module.reads_in_caller_safely(OwnNext(dataset(8, seed=1), 2))

    its = [chainer.iterators.MultiprocessIterator(dataset(32, seed=10 + r), 4,
                                                  n_processes=1) for r in range(2)]
    model = classifier(seed=3)
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2)
    try:
        for _ in range(3):
            updater.update()
        loader = updater._loader
        assert loader.planned_gated and not loader.load_here
    finally:
        updater.finalize()


def test_a_loader_that_may_not_load_here_hands_each_load_to_its_thread():
    data = _Counting()
    loader = Prefetcher(chainer.iterators.SerialIterator(data, 2, shuffle=False),
                        chainer.dataset.concat_examples, None, 1, gated=True,
                        load_here=False)
    try:
        _parked(loader)
        got = [loader.get().arrays[1].tolist() for _ in range(4)]
        assert got == [[int(data.base[i][1]) for i in (2 * j, 2 * j + 1)] for j in range(4)]
        assert threading.get_ident() not in data.threads[2:]   # the thread read them all
        assert loader.gated and loader._holding
    finally:
        loader.close()


class _Lingering(Prefetcher):
    """A loader whose thread lingers after handing a batch on (a thread switch there)."""

    def _put(self, entry):
        super()._put(entry)
        time.sleep(0.02)


@pytest.mark.parametrize('load_here', [False, True])
def test_a_get_never_waits_on_a_thread_that_lingers_after_handing_a_batch_on(load_here):
    """The consumer takes the batch just handed on and asks again before the thread has
    gone on to the gate: that get must still let it through (a master reading a
    MultiprocessIterator once waited there for good: CI, Python 3.13, 2026-12-03)."""
    data = _Counting(n=200)
    loader = _Lingering(chainer.iterators.SerialIterator(data, 2, shuffle=False),
                        chainer.dataset.concat_examples, None, 2, gated=True,
                        load_here=load_here)
    got = []

    def consume():
        for _ in range(20):
            got.append(loader.get().arrays[1].tolist())

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(10.0)
    hung = consumer.is_alive()
    loader.close()   # ends a hung consumer's wait too (the thread stops)
    assert not hung, f'a get waited for good after {len(got)} batches'
    assert got == [[int(data.base[i][1]) for i in (2 * j, 2 * j + 1)] for j in range(20)]

"""While a loader thread loads, a thread done waiting gets the GIL back soon (_gil_handoff).

CPython hands the GIL from a thread that runs Python to one that asks for it only after
the switch interval (5 ms unless set), so a replica's compute that waits (BLAS, a GPU)
waited up to 5 ms after each wait for a loader thread running a dataset's Python.
The contract: inside a load of a loader thread that loads ahead the interval is at most
``HANDOFF`` (a gated loader's loads leave it alone); outside every load it is the user's
again; a user's shorter interval, or one the user sets meanwhile, is left alone; several
loads at once (several loaders) share one count; a forked child starts with none. How
much it buys is ``bench/overlap.py``'s to say, not a test's.
"""
from __future__ import annotations

import os
import sys
import threading

import chainer
import pytest

from mgpu_updater import _gil_handoff
from mgpu_updater._gil_handoff import HANDOFF, HANDOFF_WHILE_LOADING
from mgpu_updater._loader import Prefetcher

from _models import dataset

DEFAULT = 0.005


@pytest.fixture(autouse=True)
def _interval():
    """Every test starts at CPython's default interval and leaves it there."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT)
    yield
    sys.setswitchinterval(before)
    assert _gil_handoff._loading == 0


class _Blocking(chainer.dataset.DatasetMixin):
    """A dataset whose example ``stop_at`` blocks until :attr:`go` is set, saying when it
    got there (:attr:`inside`) and what the switch interval was then."""

    def __init__(self, stop_at):
        self.base = dataset(40, seed=1)
        self.stop_at = stop_at
        self.inside, self.go = threading.Event(), threading.Event()
        self.seen = None

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        if i == self.stop_at and not self.go.is_set():
            self.seen = sys.getswitchinterval()
            self.inside.set()
            assert self.go.wait(10)
        return self.base[i]


def test_a_loader_thread_shortens_the_interval_only_while_it_loads():
    data = _Blocking(stop_at=2)   # the second batch of two: read by the thread
    loader = Prefetcher(chainer.iterators.SerialIterator(data, 2, shuffle=False),
                        chainer.dataset.concat_examples, None, 1, gated=False)
    try:
        assert data.inside.wait(10), 'the loader thread never read its second batch'
        assert data.seen <= HANDOFF          # inside its load
        assert sys.getswitchinterval() <= HANDOFF
        data.go.set()
        first, second = loader.get(), loader.get()
        assert first.size == second.size == 2
    finally:
        data.go.set()   # (a failed assert above must not leave the thread blocked)
        loader.close()
    assert sys.getswitchinterval() == DEFAULT   # no load in progress: the user's again


def test_a_gated_loaders_loads_leave_the_interval_alone():
    """A gated loader loads only while its consumer waits for something else (a worker,
    for the master's next message), never beside its compute."""
    data = _Blocking(stop_at=2)
    loader = Prefetcher(chainer.iterators.SerialIterator(data, 2, shuffle=False),
                        chainer.dataset.concat_examples, None, 1, gated=True)
    try:
        loader.release()   # the consumer waits: the thread may load its next batch
        assert data.inside.wait(10), 'the released loader never read its second batch'
        assert data.seen == DEFAULT
        data.go.set()
        loader.hold()
        assert loader.get().size == loader.get().size == 2
    finally:
        data.go.set()   # (a failed assert above must not leave the thread blocked)
        loader.close()
    assert sys.getswitchinterval() == DEFAULT


def test_the_interval_comes_back_when_a_load_raises():
    with pytest.raises(ZeroDivisionError):
        with HANDOFF_WHILE_LOADING:
            assert sys.getswitchinterval() <= HANDOFF
            1 / 0
    assert sys.getswitchinterval() == DEFAULT


def test_a_users_shorter_interval_is_left_as_it_is():
    sys.setswitchinterval(HANDOFF / 2)
    short = sys.getswitchinterval()
    with HANDOFF_WHILE_LOADING:
        assert sys.getswitchinterval() == short
    assert sys.getswitchinterval() == short


def test_an_interval_the_user_sets_during_a_load_is_kept():
    with HANDOFF_WHILE_LOADING:
        sys.setswitchinterval(0.01)
    assert sys.getswitchinterval() == 0.01


def test_loads_in_several_threads_share_one_count():
    """Two loaders' loads overlapping in time: the interval stays short until the last
    ends, and is then the user's (each load setting back what it found would leave it at
    the short one)."""
    first_in, second_in, first_may_leave = (threading.Event() for _ in range(3))
    seen = {}

    def first():
        with HANDOFF_WHILE_LOADING:
            first_in.set()
            assert second_in.wait(10)
            assert first_may_leave.wait(10)
        seen['after first'] = sys.getswitchinterval()

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(10)
    with HANDOFF_WHILE_LOADING:
        second_in.set()
        first_may_leave.set()
        thread.join(10)
        assert seen['after first'] <= HANDOFF   # the second still loads
    assert sys.getswitchinterval() == DEFAULT


def test_after_training_with_a_loader_thread_the_interval_is_the_users():
    """A Trainer-less run as a script has it: one replica loading ahead (prefetch=2), a
    few updates, finalize: no load is left holding the interval down."""
    from mgpu_updater import ParallelAccumulatingUpdater
    from _models import classifier
    model = classifier()
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    it = chainer.iterators.SerialIterator(dataset(64, seed=2), 8)
    updater = ParallelAccumulatingUpdater(it, optimizer, devices=['@numpy'], prefetch=2)
    try:
        for _ in range(5):
            updater.update()
        assert updater.loading_modes == ['ahead']
    finally:
        updater.finalize()
    assert sys.getswitchinterval() == DEFAULT


@pytest.mark.skipif(not hasattr(os, 'fork'), reason='no os.fork on this platform')
def test_a_child_forked_during_a_load_starts_with_none():
    """A ``MultiprocessIterator`` forks its processes inside the loader's first read: the
    child has no loader thread, so no load in progress and the user's interval."""
    read, write = os.pipe()
    with HANDOFF_WHILE_LOADING:
        pid = os.fork()
        if pid == 0:   # the child: report, and leave at once
            try:
                with HANDOFF_WHILE_LOADING:   # (the lock is usable in the child)
                    inside = sys.getswitchinterval()
                os.write(write, repr((_gil_handoff._loading, sys.getswitchinterval(),
                                      inside)).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            loading, after, inside = eval(pipe.read())
        os.waitpid(pid, 0)
        assert sys.getswitchinterval() <= HANDOFF   # the parent's load goes on
    assert (loading, after) == (0, DEFAULT)
    assert inside <= HANDOFF
    assert sys.getswitchinterval() == DEFAULT

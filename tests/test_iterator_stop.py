"""A StopIteration out of an iterator that repeats is an error, not one replica's end.

Under ``StandardUpdater`` a ``StopIteration`` raised inside the dataset of a
``repeat=True`` iterator propagates and ends the loop. Here it once looked like the end of
that replica's data: the replica dropped out for the rest of the run while the others
trained on. Now it raises, naming the replica and the iterator, on the master and on a
worker alike; with ``repeat=False`` the end of the data is still the end.
"""
from __future__ import annotations

import pytest

import chainer

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError

from _models import StopsAt, classifier, dataset, run_updates, setup_optimizer

B = 4


def _updater(stopping_replica, repeat=True, prefetch='auto'):
    model = classifier(seed=0)
    its = []
    for r in range(2):
        data = dataset(32, seed=r)
        if r == stopping_replica:
            data = StopsAt(data, at=10)   # read in the third update
        its.append(chainer.iterators.SerialIterator(data, B, repeat=repeat, shuffle=False))
    return model, ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                              devices=['@numpy'] * 2, prefetch=prefetch)


@pytest.mark.parametrize('prefetch', ['auto', 0])
def test_on_the_master_it_raises_naming_replica_0(prefetch):
    model, updater = _updater(0, prefetch=prefetch)
    try:
        with pytest.raises(RuntimeError, match=r'^replica 0 \(@numpy\): its iterator '
                                               r'\(SerialIterator, repeat=True\) raised '
                                               r'StopIteration') as info:
            run_updates(updater, model, 4)
        assert updater.iteration == 2
        assert isinstance(info.value.__cause__.__cause__, StopIteration)
    finally:
        updater.finalize()
    assert updater.worker_pids() == []


def test_on_a_worker_it_is_a_worker_error_naming_replica_1():
    model, updater = _updater(1)
    try:
        with pytest.raises(WorkerError, match=r"^replica 1 on device '@numpy'") as info:
            run_updates(updater, model, 4)
        assert updater.iteration == 2
        assert ('replica 1 (@numpy): its iterator (SerialIterator, repeat=True) raised '
                'StopIteration' in info.value.remote_traceback)
    finally:
        updater.finalize()


def test_without_repeat_it_ends_the_data_as_before():
    """``repeat=False``: a StopIteration is the end of that replica's data (the update
    holds what the others got), as Chainer's iterators signal it."""
    model, updater = _updater(0, repeat=False)
    try:
        run_updates(updater, model, 4)
        assert updater.iteration == 4
    finally:
        updater.finalize()

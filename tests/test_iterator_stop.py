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


class SumsIds(chainer.Chain):
    """A loss that is the sum of its samples' ids (their first feature), for
    ``loss_reduction='sum'``: an update's ``main/loss`` is the sum of the ids it trained
    on, over every replica."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = chainer.links.Linear(2, 3)

    def forward(self, x, t):
        loss = chainer.functions.sum(x[:, 0]) + 0 * chainer.functions.sum(self.l1(x))
        chainer.report({'loss': loss}, self)
        return loss


def _passes(devices, shuffle, passes=3, snapshot=None, tmp_path=None):
    """The sums of the ids each update of each pass trained on, in a loop that calls update() itself and
    resets the main iterator at the end of the data (repeat=False)."""
    import numpy as np
    from mgpu_updater import shard_iterators
    n = 13
    data = chainer.datasets.TupleDataset(
        np.stack([np.arange(n), np.zeros(n)], axis=1).astype(np.float32),
        np.zeros(n, dtype=np.int32))
    def build():
        model = SumsIds()
        its = shard_iterators(data, devices, 2, repeat=False, shuffle=shuffle, seed=0)
        return model, ParallelAccumulatingUpdater(
            its, setup_optimizer('sgd', model), devices=['@numpy'] * devices,
            accumulate_steps=2, loss_reduction='sum')

    model, updater = build()
    out = []
    try:
        for i in range(passes):
            sums = []
            while True:
                try:
                    obs, = run_updates(updater, model, 1)
                except StopIteration:
                    break
                sums.append(float(obs['main/loss']))
            out.append(sums)
            if snapshot == 'before_reset' and i == 0:
                model, updater = _resumed(build, updater, tmp_path)
            updater.get_iterator('main').reset()
            if snapshot == 'after_reset' and i == 0:
                model, updater = _resumed(build, updater, tmp_path)
    finally:
        updater.finalize()
    return out


def _resumed(build, updater, tmp_path):
    """The updater saved, finalized, and loaded into a new one (a run resumed)."""
    path = str(tmp_path / 'between.npz')
    chainer.serializers.save_npz(path, updater)
    updater.finalize()
    model, fresh = build()
    chainer.serializers.load_npz(path, fresh)
    return model, fresh


@pytest.mark.parametrize('devices', [1, 2])
@pytest.mark.parametrize('shuffle', [False, True])
def test_a_reset_after_the_end_of_the_data_starts_a_new_pass_on_every_replica(devices,
                                                                              shuffle):
    """A loop that calls update() itself and resets the iterator for its next epoch, as
    StandardUpdater's one iterator takes it: every pass trains on every sample once. The
    workers' iterators are copies in their processes; the second pass trained on nothing
    (StopIteration at once), and a reset while data is left reached the master only."""
    first, second, third = _passes(devices, shuffle)
    for ids in (first, second, third):
        assert sum(ids) == sum(range(13))   # every sample, once
    if not shuffle:
        assert first == second == third
    else:
        assert first != second   # a new order, each replica from its own sampler


@pytest.mark.parametrize('snapshot', ['before_reset', 'after_reset'])
def test_a_pass_after_a_snapshot_between_passes_trains_on_every_replica(tmp_path, snapshot):
    """Saved at the end of the data, before or after the main iterator's reset, and
    resumed: the workers' iterators were saved as they ended, and the next pass trained
    on the master's shard alone (7 of 13 samples)."""
    first, second, third = _passes(2, True, snapshot=snapshot, tmp_path=tmp_path)
    for ids in (first, second, third):
        assert sum(ids) == sum(range(13))

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


N_IDS = 13


def _build(devices, shuffle, its=None, **kwargs):
    """A model whose loss sums the ids of its samples, on ``devices`` replicas reading
    ``its`` (default: new shards of the 13 ids, repeat=False) in micro-batches of 2, two
    a window."""
    import numpy as np
    from mgpu_updater import shard_iterators
    data = chainer.datasets.TupleDataset(
        np.stack([np.arange(N_IDS), np.zeros(N_IDS)], axis=1).astype(np.float32),
        np.zeros(N_IDS, dtype=np.int32))
    model = SumsIds()
    if its is None:
        its = shard_iterators(data, devices, 2, repeat=False, shuffle=shuffle, seed=0)
    return model, ParallelAccumulatingUpdater(
        its, setup_optimizer('sgd', model), devices=['@numpy'] * devices,
        accumulate_steps=2, loss_reduction='sum', **kwargs)


def _one_pass(updater, model):
    """The sums of the ids of each update until the StopIteration."""
    sums = []
    while True:
        try:
            obs, = run_updates(updater, model, 1)
        except StopIteration:
            return sums
        sums.append(float(obs['main/loss']))


def _passes(devices, shuffle, passes=3, snapshot=None, tmp_path=None, rebuild=None,
            reset_all=False):
    """The sums of the ids each update of each pass trained on, in a loop that calls
    update() itself and resets the main iterator at the end of the data (repeat=False).
    After the first pass: ``snapshot`` (before or after the reset) resumes from a
    snapshot; ``rebuild`` (before or after the reset) finalizes the updater and builds a
    new one on the same iterators."""
    def build():
        return _build(devices, shuffle)

    model, updater = build()
    out = []
    try:
        for i in range(passes):
            out.append(_one_pass(updater, model))
            if snapshot == 'before_reset' and i == 0:
                model, updater = _resumed(build, updater, tmp_path)
            if rebuild == 'before_reset' and i == 0:
                model, updater = _rebuilt(devices, updater)
            if reset_all:   # after finalize(), as a Trainer's run ends
                updater.finalize()
                for it in [updater.get_iterator('main')] + list(updater._worker_iterators):
                    it.reset()
            else:
                updater.get_iterator('main').reset()
            if snapshot == 'after_reset' and i == 0:
                model, updater = _resumed(build, updater, tmp_path)
            if rebuild == 'after_reset' and i == 0:
                model, updater = _rebuilt(devices, updater)
    finally:
        updater.finalize()
    return out


def _rebuilt(devices, updater):
    """The updater finalized, and a new one built on its iterators (the same objects)."""
    its = [updater.get_iterator('main')] + list(updater._worker_iterators)
    updater.finalize()
    return _build(devices, False, its=its)


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


@pytest.mark.parametrize('rebuild', ['before_reset', 'after_reset'])
def test_a_pass_after_a_new_updater_on_the_same_iterators_trains_on_every_replica(rebuild):
    """The main iterator reset after the end of the data and a new updater built on the
    same iterators (the first finalized): the workers' iterators, put back as they ended,
    start the new pass with the main one. The second pass trained on the master's shard
    alone."""
    first, second, third = _passes(2, True, rebuild=rebuild)
    for ids in (first, second, third):
        assert sum(ids) == sum(range(N_IDS))


@pytest.mark.parametrize('prefetch', ['auto', 0])
def test_a_snapshot_of_the_last_update_before_its_stop_iteration_stops_every_call(
        tmp_path, prefetch):
    """Saved after the pass's last update, before any StopIteration, and loaded into a new
    updater: every update() raises StopIteration, as StandardUpdater's does, with its
    epoch read off the iterator as it ended, until the main iterator is reset; the next
    pass trains on every sample. Chainer's iterators move previous_epoch_detail as they
    raise: the second call took that for a reset and trained on the worker's shard
    alone, at every call."""
    model, updater = _build(2, True, prefetch=prefetch)
    try:
        assert sum(_one_pass_of_updates(updater, model, 2)) == sum(range(N_IDS))
        model, updater = _resumed(lambda: _build(2, True, prefetch=prefetch), updater,
                                  tmp_path)
        main = updater.get_iterator('main')
        for _ in range(3):
            with pytest.raises(StopIteration):
                run_updates(updater, model, 1)
            assert updater.iteration == 2
            assert (updater.epoch, updater.epoch_detail, updater.previous_epoch_detail,
                    updater.is_new_epoch) == (main.epoch, main.epoch_detail,
                                              main.previous_epoch_detail, main.is_new_epoch)
        main.reset()
        assert (updater.epoch, updater.epoch_detail, updater.is_new_epoch) == (0, 0.0, False)
        assert sum(_one_pass(updater, model)) == sum(range(N_IDS))
    finally:
        updater.finalize()


def _one_pass_of_updates(updater, model, n):
    return [float(obs['main/loss']) for obs in run_updates(updater, model, n)]


def test_every_iterator_reset_by_the_script_starts_the_next_pass_once():
    """After the end of the data and finalize() (a Trainer's run), the script resets every
    shard's iterator: each is reset once, and the passes read as where the main one alone
    was reset. The workers' were reset a second time, and shuffled anew."""
    assert _passes(2, True, reset_all=True) == _passes(2, True)


def test_a_new_updater_after_a_mid_pass_reset_of_the_main_iterator_starts_every_shard():
    """The main iterator reset in the middle of a pass and a new updater built on the same
    iterators (the first finalized): every replica starts the pass, as the main one does.
    Before, the shards that had ended were reset and the others went on."""
    model, updater = _build(2, False)
    its = [updater.get_iterator('main')] + list(updater._worker_iterators)
    try:
        run_updates(updater, model, 1)
        updater.finalize()
        its[0].reset()
        model, updater = _build(2, False, its=its)
        assert sum(_one_pass(updater, model)) == sum(range(N_IDS))
    finally:
        updater.finalize()


def test_a_snapshot_before_the_first_update_names_iterators_another_updater_read():
    """A new updater on the iterators of one dropped without finalize(), saved before its
    first update: the snapshot would hold the workers' positions as that updater found
    them, and says so, as the first update does."""
    import gc
    model, updater = _build(2, False)
    its = [updater.get_iterator('main')] + list(updater._worker_iterators)
    run_updates(updater, model, 1)
    del updater
    gc.collect()
    model, updater = _build(2, False, its=its)
    try:
        with pytest.warns(RuntimeWarning, match='iterator 1 .* may not stand where'):
            updater.serialize(chainer.serializers.DictionarySerializer())
    finally:
        updater.finalize()

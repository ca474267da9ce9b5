"""Once the updater has stopped, a snapshot holds what one taken before would, and training
goes on from where it was.

After ``finalize()`` (``trainer.run()`` returned, by an exception too) the worker processes
are gone: their iterators' positions are put into the iterators the master holds for them,
so a snapshot then, another updater built on them, or a next ``update()`` (``trainer.run()``
again, as Chainer allows after an exception) goes on where each replica was. After an
update failed they went with it: a snapshot (the Trainer's ``snapshot_on_error``) and a
next update are refused rather than run with the workers back at the start of their
shards.
"""
from __future__ import annotations

import gc
import os
import re
import signal
import time

import numpy as np
import pytest

import chainer
from chainer.serializers import DictionarySerializer

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError, shard_iterators

from _models import RaisesAtCall, classifier, dataset, run_updates, setup_optimizer

B, K = 4, 2


def _updater(model, n=2, **kwargs):
    its = shard_iterators(dataset(40, seed=3), n, B, seed=1)
    return ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                       devices=['@numpy'] * n, accumulate_steps=K, **kwargs)


def _saved(updater):
    target = {}
    updater.serialize(DictionarySerializer(target))
    return target


@pytest.mark.parametrize('n', [1, 2])
@pytest.mark.parametrize('prefetch', ['auto', 0, 2])
def test_a_snapshot_after_finalize_holds_every_replicas_position(n, prefetch):
    """The workers' positions, and the main iterator's as of the last batch used (a
    loader that loaded ahead read further)."""
    model = classifier()
    updater = _updater(model, n, prefetch=prefetch)
    try:
        run_updates(updater, model, 3)   # 24 samples of a shard: into its second epoch
        live = _saved(updater)
    finally:
        updater.finalize()
    after = _saved(updater)
    keys = [k for k in live if k.startswith('iterator:')]
    position = 'iterator:replica1/current_position' if n == 2 else \
        'iterator:main/current_position'
    assert int(live[position]) == 24 % (40 // n)
    for key in keys:
        np.testing.assert_array_equal(after[key], live[key], err_msg=key)


def test_a_snapshot_after_an_update_interrupted_in_the_master_says_so():
    """Ctrl-C in the master's forward (a notebook): the workers' positions went with the
    update all the same."""
    model = RaisesAtCall(at=5, error=KeyboardInterrupt)
    updater = _updater(model)
    try:
        run_updates(updater, model, 2)
        with pytest.raises(KeyboardInterrupt):
            run_updates(updater, model, 1)
        with pytest.raises(RuntimeError, match=r'^update 3 was interrupted, and the worker'):
            _saved(updater)
    finally:
        updater.finalize()


def test_after_a_failed_update_a_snapshot_and_an_update_are_refused_saying_why():
    model = RaisesAtCall(at=5)   # the third update's first forward, on every replica
    updater = _updater(model)
    try:
        run_updates(updater, model, 2)
        with pytest.raises((ValueError, WorkerError), match='forward call 5'):
            run_updates(updater, model, 1)
        with pytest.raises(RuntimeError, match=r"^update 3 failed, and the worker "
                                               r"processes' iterator positions went with "
                                               r'it: a snapshot now would put replicas 1 '
                                               r'and up back at the start'):
            _saved(updater)
        with pytest.raises(RuntimeError, match=r"^this updater stopped: update 3 failed, and "
                                               r"the worker processes' iterator positions "
                                               r'went with it\. Load a snapshot'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()
    with pytest.raises(RuntimeError, match='^update 3 failed'):
        chainer.serializers.save_npz('/dev/null', updater)


@pytest.mark.parametrize('n', [1, 2])
def test_updates_after_finalize_go_on_as_if_it_had_not_stopped(n):
    """finalize() between updates 2 and 3 (a Trainer's run ended by an extension's
    exception, then run again) changes nothing: bitwise the run without it."""
    runs = []
    for stop in (True, False):
        model = classifier()
        updater = _updater(model, n)
        try:
            observed = run_updates(updater, model, 2)
            if stop:
                updater.finalize()
            observed += run_updates(updater, model, 2)
        finally:
            updater.finalize()
        runs.append(({k: v.copy() for k, v in _saved(updater).items()},
                     [o['main/loss'] for o in observed]))
    (stopped, stopped_losses), (straight, straight_losses) = runs
    assert stopped_losses == straight_losses
    assert stopped.keys() == straight.keys()
    for key, value in straight.items():
        np.testing.assert_array_equal(stopped[key], value, err_msg=key)


def _second_updater(its, model):
    return ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                       devices=['@numpy'] * 2, accumulate_steps=K)


@pytest.mark.parametrize('how, why', [
    ('alive', 'another ParallelAccumulatingUpdater that was not finalized reads it'),
    ('dropped', 'the updater that read it was dropped without finalize()'),
    ('failed', 'the updater that read it stopped: update 3 failed'),
])
def test_a_second_updater_on_iterators_whose_positions_are_not_put_back_warns(how, why):
    """The worker's iterator object stands where the first updater found it; a second one
    built on it would read its samples again (StandardUpdater's one object moves)."""
    model = RaisesAtCall(at=5) if how == 'failed' else classifier()
    its = shard_iterators(dataset(40, seed=3), 2, B, seed=1)
    first = ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                        devices=['@numpy'] * 2, accumulate_steps=K)
    run_updates(first, model, 2)
    if how == 'failed':
        with pytest.raises((ValueError, WorkerError)):
            run_updates(first, model, 1)
    elif how == 'dropped':
        del first
        gc.collect()
    second = _second_updater(its, classifier())
    try:
        with pytest.warns(RuntimeWarning, match=r"^iterator 1 \(worker 1's\) may not stand "
                                                r'where its replica stopped reading: '
                                                + re.escape(why)):
            run_updates(second, second.get_optimizer('main').target, 1)
    finally:
        second.finalize()
        if how == 'alive':
            first.finalize()


def test_a_second_updater_after_finalize_or_a_snapshot_loaded_does_not_warn(tmp_path):
    model = classifier()
    its = shard_iterators(dataset(40, seed=3), 2, B, seed=1)
    first = _second_updater(its, model)
    try:
        run_updates(first, model, 2)
        snapshot = _saved(first)
    finally:
        first.finalize()
    for load in (False, True):   # warnings are errors here
        second = _second_updater(its, classifier())
        try:
            if load:
                second.serialize(chainer.serializers.NpzDeserializer(snapshot))
            run_updates(second, second.get_optimizer('main').target, 1)
        finally:
            second.finalize()


def test_finalize_with_a_worker_that_does_not_answer_stops_it_within_seconds():
    """A stopped worker (SIGSTOP) does not give its position: finalize() asks for a few
    seconds only, stops every worker, and a snapshot then says what went missing."""
    model = classifier()
    updater = _updater(model)
    run_updates(updater, model, 2)
    pid = updater.worker_pids()[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        updater.finalize()
        assert time.monotonic() - start < 30.0
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert updater.worker_pids() == []
    with pytest.raises(RuntimeError, match='^a worker did not give its iterator position at '
                                           'the end'):
        _saved(updater)


def test_an_interrupt_while_finalize_asks_for_the_positions_still_stops_the_workers(
        monkeypatch):
    model = classifier()
    updater = _updater(model)
    run_updates(updater, model, 1)
    pids = updater.worker_pids()

    def interrupted(self, timeout=60.0):
        raise KeyboardInterrupt
    monkeypatch.setattr(type(updater._group), 'states', interrupted)
    with pytest.raises(KeyboardInterrupt):
        updater.finalize()
    assert updater.worker_pids() == []
    for pid in pids:   # gone (reaped by the pool's close)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_finalize_leaves_numpys_global_generator_where_it_is():
    """The main iterator set back past what it loaded ahead keeps its order, but numpy's
    global generator it shuffles with (Chainer's default) drew for the model and the
    script since: it is not set back."""
    model = classifier()
    its = chainer.iterators.SerialIterator(dataset(8, seed=3), B)   # shuffles: numpy's
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                          devices=['@numpy'], prefetch=2)
    try:
        run_updates(updater, model, 3)
        time.sleep(0.3)   # the loader reads two batches ahead, into the next epoch
        assert int(_saved(updater)['iterator:main/current_position']) == 4
        before = np.random.get_state()
    finally:
        updater.finalize()
    after = np.random.get_state()
    assert after[2] == before[2]
    np.testing.assert_array_equal(after[1], before[1])
    assert its.current_position == 4

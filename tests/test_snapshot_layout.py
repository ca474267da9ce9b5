"""A snapshot this updater cannot resume from is refused before anything is loaded.

Real ``extensions.snapshot()`` files written by a Trainer: one with ``StandardUpdater``, one
with this updater at another layout (number of devices, ``accumulate_steps``). Loading one
into a Trainer with this updater raises, naming the layout, and leaves the model, the
optimizer, ``iteration`` and the iterators exactly as they were; the message's command for
starting from the snapshot's model and optimizer alone works as written. A snapshot of the
other ``pipelined`` mode is refused the same way; two that Chainer alone could not load
(before the optimizer's first step; a ``MultiprocessIterator`` that does not shuffle)
resume exactly.
"""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest

import chainer
from chainer import training
from chainer.iterators import SerialIterator
from chainer.serializers import DictionarySerializer
from chainer.training import extensions
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators

from _models import classifier, dataset, params, run_updates, setup_optimizer

ITERATIONS = 3


def _snapshot(out, updater, iterations=ITERATIONS):
    """Run ``updater`` in a Trainer for ``iterations`` updates, snapshotting at the end."""
    trainer = training.Trainer(updater, (iterations, 'iteration'), out=str(out))
    trainer.extend(extensions.snapshot(filename='snap'), trigger=(iterations, 'iteration'))
    try:
        trainer.run()
    finally:
        updater.finalize()
    return str(out / 'snap')


def _standard_snapshot(out):
    model = classifier(seed=1)
    optimizer = setup_optimizer('momentum+decay', model)
    path = _snapshot(out, StandardUpdater(SerialIterator(dataset(48, seed=1), 8), optimizer))
    return path, model, optimizer


def _ours(devices=1, accumulate_steps=1, seed=2, run=1):
    """A Trainer with this updater whose model differs from any snapshot's, after ``run``
    updates (so that its optimizer has state: momentum, ``t``)."""
    model = classifier(seed=seed)
    optimizer = setup_optimizer('momentum+decay', model)
    its = shard_iterators(dataset(48, seed=seed), devices, 4)
    updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * devices,
                                          accumulate_steps=accumulate_steps)
    run_updates(updater, model, run)
    trainer = training.Trainer(updater, (10, 'iteration'))
    return trainer, updater, model, optimizer


def _state(updater, optimizer):
    """Everything a load would overwrite, as the updater itself saves it: the model, the
    optimizer (its ``t`` and every parameter's momentum), ``iteration``, every replica's
    iterator as of the last batch used (the loader reads ahead in a thread)."""
    target = {}
    updater.serialize(DictionarySerializer(target))
    assert {'iteration', 'optimizer:main/t', 'iterator:main/current_position'} <= set(target)
    assert any(k.startswith('optimizer:main/') and k.endswith('/v') for k in target)
    return copy.deepcopy(target)


def _assert_untouched(before, after):
    assert before.keys() == after.keys()
    for key in before:
        if before[key] is None:
            assert after[key] is None, key
        else:
            np.testing.assert_array_equal(np.asarray(before[key]), np.asarray(after[key]),
                                          err_msg=key)


def test_a_standard_updater_snapshot_is_refused_before_anything_is_loaded(tmp_path):
    path, standard_model, standard_optimizer = _standard_snapshot(tmp_path / 'standard')
    trainer, updater, model, optimizer = _ours()
    before = _state(updater, optimizer)
    assert not np.array_equal(params(model)['/predictor/l1/W'],
                              params(standard_model)['/predictor/l1/W'])
    try:
        with pytest.raises(ValueError, match=re.escape(
                'this snapshot was not taken by ParallelAccumulatingUpdater (it has no '
                'updater/n_devices or updater/accumulate_steps: a StandardUpdater '
                'snapshot?); nothing was loaded. Its iteration and iterator state belong to '
                'another updater; start from its model and optimizer alone, loading them '
                'before training: chainer.serializers.load_npz(snapshot, model, '
                "path='updater/model:main/') and chainer.serializers.load_npz(snapshot, "
                "optimizer, path='updater/optimizer:main/')") + '$'):
            chainer.serializers.load_npz(path, trainer)
        _assert_untouched(before, _state(updater, optimizer))
        assert updater.iteration == 1 and optimizer.t == 1
    finally:
        updater.finalize()


def test_the_command_the_message_gives_starts_from_the_standard_snapshot(tmp_path):
    """``load_npz(snapshot, model, path='updater/model:main/')`` and the optimizer's, as the
    message says: the model and the optimizer's state (``t``, momentum) are the
    StandardUpdater's, and training goes on from there."""
    path, standard_model, standard_optimizer = _standard_snapshot(tmp_path / 'standard')
    model = classifier(seed=2)
    optimizer = setup_optimizer('momentum+decay', model)
    chainer.serializers.load_npz(path, model, path='updater/model:main/')
    chainer.serializers.load_npz(path, optimizer, path='updater/optimizer:main/')
    for name, value in params(standard_model).items():
        np.testing.assert_array_equal(params(model)[name], value, err_msg=name)
    assert optimizer.t == standard_optimizer.t == ITERATIONS
    theirs = dict(standard_model.namedparams())
    for name, param in model.namedparams():
        np.testing.assert_array_equal(param.update_rule.state['v'],
                                      theirs[name].update_rule.state['v'], err_msg=name)
    its = shard_iterators(dataset(48, seed=1), 2, 4)
    updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * 2)
    try:
        run_updates(updater, model, 1)
    finally:
        updater.finalize()
    assert optimizer.t == ITERATIONS + 1 and updater.iteration == 1


@pytest.mark.parametrize('devices, accumulate_steps', [(2, 1), (1, 2)])
def test_a_snapshot_of_another_layout_is_refused_before_anything_is_loaded(
        tmp_path, devices, accumulate_steps):
    """Taken with one device and accumulate_steps=1; loaded into two devices, or into
    accumulate_steps=2 (after an update on either, so that there is state to keep)."""
    model = classifier(seed=1)
    its = shard_iterators(dataset(48, seed=1), 1, 4)
    path = _snapshot(tmp_path / 'one', ParallelAccumulatingUpdater(
        its, setup_optimizer('momentum+decay', model), devices=['@numpy']))
    trainer, updater, model, optimizer = _ours(devices, accumulate_steps)
    pids = updater.worker_pids()
    assert len(pids) == devices - 1
    before = _state(updater, optimizer)
    try:
        with pytest.raises(ValueError, match=re.escape(
                'this snapshot was taken with 1 device(s) and accumulate_steps=1, but this '
                f'updater has {devices} and accumulate_steps={accumulate_steps}; nothing was '
                'loaded. Resume with the same devices and accumulate_steps (the iterator '
                'shards and the batch composition depend on both), or start from its model '
                'and optimizer alone, loading them before training: '
                "chainer.serializers.load_npz(snapshot, model, path='updater/model:main/') "
                'and chainer.serializers.load_npz(snapshot, optimizer, '
                "path='updater/optimizer:main/')") + '$'):
            chainer.serializers.load_npz(path, trainer)
        _assert_untouched(before, _state(updater, optimizer))
        # the running workers were left alone, and training goes on
        assert updater.worker_pids() == pids
        run_updates(updater, model, 1)
        assert updater.iteration == 2
    finally:
        updater.finalize()


def test_a_lenient_load_of_a_standard_snapshot_is_refused_too(tmp_path):
    """``strict=False`` hands back the value given for a missing key: still refused."""
    path, _, _ = _standard_snapshot(tmp_path / 'standard')
    trainer, updater, model, optimizer = _ours()
    before = _state(updater, optimizer)
    try:
        with pytest.raises(ValueError, match=r'^this snapshot was not taken by '
                                             r'ParallelAccumulatingUpdater'):
            chainer.serializers.load_npz(path, trainer, strict=False)
        _assert_untouched(before, _state(updater, optimizer))
    finally:
        updater.finalize()


def test_the_updater_alone_names_its_own_path(tmp_path):
    """Saved with ``save_npz(path, updater)`` (no Trainer): the paths have no 'updater/'."""
    model = classifier(seed=1)
    optimizer = setup_optimizer('sgd', model)
    standard = StandardUpdater(SerialIterator(dataset(16, seed=1), 4), optimizer)
    standard.update()
    chainer.serializers.save_npz(str(tmp_path / 'u.npz'), standard)
    trainer, updater, model, optimizer = _ours()
    try:
        with pytest.raises(ValueError, match=r"load_npz\(snapshot, model, "
                                             r"path='model:main/'\) and .*"
                                             r"path='optimizer:main/'\)$"):
            chainer.serializers.load_npz(str(tmp_path / 'u.npz'), updater)
    finally:
        updater.finalize()


@pytest.mark.parametrize('saved', [True, False])
def test_a_snapshot_of_the_other_pipelined_mode_is_refused(tmp_path, saved):
    """A pipelined snapshot holds its last update's gradient, still to be applied: loaded
    into a synchronous updater it was dropped (those samples never trained); a synchronous
    one loaded into a pipelined updater took no step at the first update."""
    model = classifier(seed=1)
    path = _snapshot(tmp_path / 'mode', ParallelAccumulatingUpdater(
        shard_iterators(dataset(48, seed=1), 1, 4), setup_optimizer('momentum+decay', model),
        devices=['@numpy'], pipelined=saved))
    model = classifier(seed=2)
    optimizer = setup_optimizer('momentum+decay', model)
    updater = ParallelAccumulatingUpdater(shard_iterators(dataset(48, seed=2), 1, 4),
                                          optimizer, devices=['@numpy'], pipelined=not saved)
    trainer = training.Trainer(updater, (10, 'iteration'))
    try:
        with pytest.raises(ValueError, match=re.escape(
                f'this snapshot was taken with pipelined={saved}, but this updater has '
                f'pipelined={not saved}; nothing was loaded.')):
            chainer.serializers.load_npz(path, trainer)
        assert updater.iteration == 0
    finally:
        updater.finalize()


def _resumed_run(tmp_path, make, at, total):
    """Parameters after ``total`` updates of ``make()``'s updater, run straight through,
    and run ``at`` updates, snapshotted, loaded into a new one and run to ``total``."""
    straight = make()
    try:
        run_updates(straight, straight.get_optimizer('main').target, total)
    finally:
        straight.finalize()
    path = _snapshot(tmp_path, make(), at)
    second = make(seed=5)   # another model: all of it comes from the snapshot
    trainer = training.Trainer(second, (total, 'iteration'))
    chainer.serializers.load_npz(path, trainer)
    try:
        run_updates(second, second.get_optimizer('main').target, total - at)
    finally:
        second.finalize()
    return (params(straight.get_optimizer('main').target),
            params(second.get_optimizer('main').target))


@pytest.mark.parametrize('kind', ['adam', 'momentum+decay'])
def test_a_snapshot_before_the_optimizers_first_step_resumes_exactly(tmp_path, kind):
    """Pipelined, the first update takes no step: the optimizer had no state yet, the
    snapshot held none, and loading it failed (KeyError: .../W/m is not a file in the
    archive), where StandardUpdater's snapshot after one update resumes."""
    def make(seed=1):
        model = classifier(seed=seed)
        return ParallelAccumulatingUpdater(
            shard_iterators(dataset(48, seed=1), 2, 4),
            setup_optimizer(kind, model), devices=['@numpy'] * 2, pipelined=True)
    straight, resumed = _resumed_run(tmp_path, make, at=1, total=3)
    for name, value in straight.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def test_a_multiprocess_iterator_that_does_not_shuffle_resumes_exactly(tmp_path):
    """Its own serialize() copies its order, which it has none of without shuffling, also
    to load: a snapshot (and a worker's restart) failed to load with AttributeError."""
    def make(seed=1):
        model = classifier(seed=seed)
        its = [chainer.iterators.MultiprocessIterator(dataset(24, seed=r), 4, shuffle=False,
                                                      n_processes=1) for r in range(2)]
        return ParallelAccumulatingUpdater(its, setup_optimizer('momentum+decay', model),
                                           devices=['@numpy'] * 2)
    straight, resumed = _resumed_run(tmp_path, make, at=2, total=5)
    for name, value in straight.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def test_the_updates_epoch_flags_hold_after_a_load(tmp_path):
    """Over a window of several micro-batches the update's ``is_new_epoch`` is whether any
    of them began an epoch, and its ``previous_epoch_detail`` the first's; the iterator's
    state holds its last micro-batch's. Loaded, the updater read the iterator's until its
    next update (False and 1.0 here, for True and 0.857), as an extension's
    ``initialize`` or a hand-written resume would see them."""
    def ours():
        model = classifier(seed=0)
        it = SerialIterator(dataset(21, seed=1), 3, shuffle=False)   # 7 micro-batches
        return ParallelAccumulatingUpdater(it, setup_optimizer('sgd', model),
                                           devices=['@numpy'], accumulate_steps=2)
    updater = ours()
    seen = []
    trainer = training.Trainer(updater, (4, 'iteration'), out=str(tmp_path))
    trainer.extend(lambda t: seen.append((t.updater.is_new_epoch,
                                          t.updater.previous_epoch_detail)),
                   trigger=(1, 'iteration'))
    trainer.extend(extensions.snapshot(filename='snap'), trigger=(4, 'iteration'))
    try:
        trainer.run()
    finally:
        updater.finalize()
    path = str(tmp_path / 'snap')
    assert seen[-1] == (True, 6 / 7)   # update 4 began epoch 1 at its first micro-batch
    loaded = ours()
    try:
        chainer.serializers.load_npz(path, loaded, path='updater/')
        assert (loaded.is_new_epoch, loaded.previous_epoch_detail) == seen[-1]
        assert loaded.epoch_detail == 8 / 7
        run_updates(loaded, loaded.get_optimizer('main').target, 1)
        assert (loaded.is_new_epoch, loaded.previous_epoch_detail) == (False, 8 / 7)
    finally:
        loaded.finalize()

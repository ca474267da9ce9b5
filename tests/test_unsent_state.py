"""Plain values of the model, loss_func and converter that the workers never receive: named.

Each worker unpickles the model, ``loss_func`` and the converter once; every update sends
it only the parameters and the persistents. A plain value the master's copy holds and
that changes during training (an annealed coefficient, a mask, a closure's dict) would
leave the replicas computing with different values. ``_unsent_state`` warns, naming the
value and the fix; what every update sends, and what a forward changes on every replica,
is not named.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import types
import warnings

import numpy as np
import pytest

import chainer
import chainer.link_hooks
from chainer import training
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater import _unsent_state
from mgpu_updater._unsent_state import UnsentState

from _models import Annealed, dataset, params, setup_optimizer


def _caught(call):
    """The message of the one RuntimeWarning ``call()`` gives ('' for none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        call()
    named = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(named) <= 1
    return named[0] if named else ''


def _update(watch, forward=lambda: None):
    """One update as the updater drives the watch; the warning's message, or ''."""
    def run():
        if watch.due():
            watch.at_begin()
        forward()
        if watch.watching:
            watch.after_window()
    return _caught(run)


def _calls(model):
    def forward():
        model.calls += 1   # a forward's own count, as each replica keeps one
    return forward


def test_a_plain_attribute_changed_between_updates_is_named_once_with_the_fix():
    model = Annealed()
    model.calls = 0
    watch = UnsentState({'model': model})
    forward = _calls(model)
    assert _update(watch, forward) == ''    # the first window: what every replica holds
    model.beta = 0.5                        # an extension, between updates 1 and 2
    assert _update(watch, forward) == ''    # update 2: the check begins
    message = _update(watch, forward)       # update 3: it ends, naming what changed
    assert 'changed between updates' in message and 'model.beta: 0.0 -> 0.5' in message
    assert "add_persistent('beta'" in message
    assert 'model.calls' not in message     # the forward's: each replica counts its own
    assert watch.forward == {'model.calls'}
    model.beta = 0.25                       # named once
    assert _caught(watch.finish) == ''
    assert watch.named == ['model.beta']


def test_a_change_between_the_windows_of_a_check_is_named_too():
    model = Annealed()
    watch = UnsentState({'model': model})
    _update(watch)
    _update(watch)                          # update 2: the check begins
    model.beta = 1.0                        # between updates 2 and 3
    assert 'model.beta: 0.0 -> 1.0' in _update(watch)


def test_what_every_update_sends_is_not_named():
    model = Annealed(persistent=True)
    link = model.inner.predictor
    link.add_persistent('mean', np.zeros(3, np.float32))
    model.alias = link.mean                 # the same array, held where no link says so
    link.l1.W.grad = np.zeros_like(link.l1.W.array)
    model.held = [link.l1.W.array, link.l1.W.grad]   # a parameter's arrays held elsewhere
    watch = UnsentState({'model': model})
    _update(watch)
    model.beta = 2.0                        # a persistent scalar
    link.mean[...] = 1.0                    # a persistent array, in place (and the alias)
    link.l1.W.array[...] = 3.0              # a parameter (and the list's)
    link.l1.W.grad[...] = 1.0               # its gradient (and the list's)
    model.shape = model.shape               # the same value
    assert _update(watch) == '' and _update(watch) == ''
    assert _caught(watch.finish) == ''


def test_an_array_edited_in_place_and_a_closure_value_are_named_by_path():
    model = Annealed()
    model.mask = np.ones(4, np.float32)
    state = {'beta': 1.0}

    def loss_func(x, t):
        return model(x, t) * state['beta']

    watch = UnsentState({'model': model, 'loss_func': loss_func})
    _update(watch)
    model.mask[0] = 0.0
    state['beta'] = 2.0
    _update(watch)                          # a run of two updates: named when finalized
    message = _caught(watch.finish)
    assert 'changed during training' in message
    assert 'model.mask: an array (4,) float32 -> an array (4,) float32' in message
    assert "loss_func.state['beta']: 1.0 -> 2.0" in message


class _Distill:
    """A loss_func holding the model and a teacher link outside it."""

    def __init__(self, student, teacher):
        self.student, self.teacher = student, teacher

    def __call__(self, x, t):
        with chainer.no_backprop_mode():
            soft = chainer.functions.softmax(self.teacher(x)).array
        y = self.student(x)
        return chainer.functions.mean_squared_error(chainer.functions.softmax(y), soft)


def test_a_parameter_of_a_link_outside_the_model_changed_between_updates_is_named():
    """A teacher an extension moves towards the student: no update sends its parameters
    (the workers would distil from the teacher they started with); the model's own
    parameters changing is no news."""
    student, teacher = chainer.links.Linear(3, 2), chainer.links.Linear(3, 2)
    watch = UnsentState({'model': student, 'loss_func': _Distill(student, teacher)})
    _update(watch)
    student.W.array[...] += 1.0             # the step
    teacher.W.array[...] = 0.5 * teacher.W.array + 0.5 * student.W.array   # the extension
    assert _update(watch) == ''
    message = _update(watch)
    assert 'loss_func.teacher.W: ' in message and 'loss_func.student' not in message
    assert ('A teacher that no optimizer trains (an extension moves it): make it a child '
            'of the model, with disable_update()' in message)
    # not for a GAN's other network: disable_update() would stop its own optimizer too
    assert ('The other network of a GAN, which another optimizer trains: disable_update() '
            'would stop that optimizer too' in message)


def test_two_replicas_name_a_teacher_an_extension_moves(tmp_path):
    student, teacher = chainer.links.Linear(5, 3), chainer.links.Linear(5, 3)
    shards = [dataset(16, seed=3 + r) for r in range(2)]
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, 4) for d in shards],
        setup_optimizer('sgd', student), devices=['@numpy'] * 2,
        loss_func=_Distill(student, teacher))
    trainer = training.Trainer(updater, (4, 'iteration'), out=str(tmp_path))
    trainer.extend(lambda t: teacher.W.array.__setitem__(
        Ellipsis, 0.5 * teacher.W.array + 0.5 * student.W.array), trigger=(1, 'iteration'))
    with pytest.warns(RuntimeWarning, match=r'do not receive them: loss_func\.teacher\.W: '):
        trainer.run()


def test_after_the_first_check_the_next_is_due_after_the_interval():
    now = [100.0]
    watch = UnsentState({'model': Annealed()}, clock=lambda: now[0])
    assert not watch.due()                  # nothing before the first window
    for _ in range(3):                      # the first window, then the first check
        _update(watch)
    assert not watch.due()
    now[0] += _unsent_state.INTERVAL - 0.01
    assert not watch.due()
    now[0] += 0.02
    assert watch.due()


def _train(devices, persistent, extension=True):
    model = Annealed(seed=0, persistent=persistent)
    optimizer = setup_optimizer('sgd', model)
    shards = [dataset(16, seed=3 + r) for r in range(2)]
    if devices is None:   # each batch: the two replicas' micro-batches of the update
        batches = [shards[0][i:i + 4] + shards[1][i:i + 4] for i in range(0, 16, 4)]
        updater = StandardUpdater(
            chainer.iterators.SerialIterator(sum(batches, []), 8, shuffle=False), optimizer)
    else:
        its = [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in shards]
        updater = ParallelAccumulatingUpdater(its, optimizer, devices=devices)
    with tempfile.TemporaryDirectory() as out:
        trainer = training.Trainer(updater, (4, 'iteration'), out=out)
        if extension:
            trainer.extend(lambda t: setattr(model, 'beta', 0.5 * t.updater.iteration),
                           trigger=(1, 'iteration'))
        trainer.run()
    return params(model)


def test_two_replicas_name_an_attribute_an_extension_anneals():
    with pytest.warns(RuntimeWarning,
                      match=r"between updates, and the worker processes do not receive "
                            r"them: model\.beta"):
        _train(['@numpy', '@numpy'], persistent=False)


def test_two_replicas_train_a_persistent_an_extension_anneals_as_standard_updater():
    # warnings are errors here: a warning fails the test
    ours = _train(['@numpy', '@numpy'], persistent=True)
    reference = _train(None, persistent=True)
    for name in reference:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)


def test_one_replica_has_no_workers_to_watch():
    model = Annealed()
    optimizer = setup_optimizer('sgd', model)
    updater = ParallelAccumulatingUpdater(
        chainer.iterators.SerialIterator(dataset(16, seed=3), 4), optimizer,
        devices=['@numpy'])
    updater.update()
    assert updater._unsent is None
    model.beta = 1.0
    updater.update()
    updater.finalize()


def test_a_dataset_or_a_long_list_a_closure_holds_is_not_gone_through():
    model = Annealed()
    samples = [(np.zeros(3, np.float32), 1) for _ in range(_unsent_state.MAX_ITEMS + 1)]
    data = chainer.datasets.TupleDataset(np.zeros((50, 4), np.float32),
                                         np.zeros(50, np.int32))

    def loss_func(x, t):
        return model(x, t) + 0 * len(samples) + 0 * len(data)

    snapshot, _ = UnsentState({'model': model, 'loss_func': loss_func})._walk()
    assert snapshot['loss_func.samples'] == ('list', _unsent_state.MAX_ITEMS + 1)
    assert not [path for path in snapshot if path.startswith('loss_func.data')]


class _Curriculum:
    """A converter whose setting an extension raises (a curriculum)."""

    def __init__(self):
        self.noise = 0.0

    def __call__(self, batch, device=None):
        return chainer.dataset.concat_examples(batch, device)


def test_a_converters_setting_is_named_too():
    converter = _Curriculum()
    watch = UnsentState({'model': Annealed(), 'converter': converter})
    _update(watch)
    converter.noise = 0.1
    _update(watch)
    assert 'converter.noise: 0.0 -> 0.1' in _caught(watch.finish)


class _DeviceArray:
    """Stands for a GPU array: reducing it (what pickling does) would read it on the host."""
    shape, dtype = (2, 3), 'float32'

    def __reduce__(self):
        raise AssertionError('a device array was read on the host')


def test_a_device_array_is_compared_by_identity_shape_and_dtype_without_a_read(monkeypatch):
    monkeypatch.setattr(chainer, 'get_array_types', lambda: (np.ndarray, _DeviceArray))
    model = Annealed()
    model.mask = _DeviceArray()
    snapshot, _ = UnsentState({'model': model})._walk()
    assert snapshot['model.mask'] == ('array', id(model.mask), (2, 3), 'float32')


def test_a_warning_made_an_error_at_finalize_leaves_no_worker_behind():
    model = Annealed()
    optimizer = setup_optimizer('sgd', model)
    its = [chainer.iterators.SerialIterator(dataset(16, seed=3 + r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy', '@numpy'])
    updater.update()
    pids = updater.worker_pids()
    model.beta = 1.0
    updater.update()   # an update after the change (after none, it reached none)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(RuntimeWarning, match='do not receive them'):
            updater.finalize()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _ScaleW(chainer.LinkHook):
    """A user's link hook: the link computes with ``alpha * W``."""
    name = 'ScaleW'

    def __init__(self, alpha):
        self.alpha = alpha

    def forward_preprocess(self, cb_args):
        self._kept = cb_args.link.W
        cb_args.link.W = self.alpha * cb_args.link.W

    def forward_postprocess(self, cb_args):
        cb_args.link.W = self._kept


def _linear_with_hooks():
    link = chainer.links.Linear(4, 3)
    link.add_hook(_ScaleW(1.0))
    link.add_hook(chainer.link_hooks.SpectralNormalization())

    def forward():
        with chainer.using_config('train', True):
            link(np.ones((2, 4), np.float32))   # moves the spectral norm's vectors
    return link, forward


def test_a_link_hooks_attribute_changed_between_updates_is_named():
    """A hook's values are the forward's as much as the link's own (an annealed
    multiplier); Chainer's own hooks' vectors, which each forward moves, are not named."""
    link, forward = _linear_with_hooks()
    watch = UnsentState({'model': link})
    _update(watch, forward)
    link.local_link_hooks['ScaleW'].alpha = 3.0
    _update(watch, forward)
    message = _update(watch, forward)
    assert "model._local_link_hooks['ScaleW'].alpha: 1.0 -> 3.0" in message
    assert 'SpectralNormalization' not in message


def test_spectral_normalisations_vector_v_an_evaluator_moves_is_not_named():
    """SpectralNormalization writes its ``v`` at every call, in test mode too (where ``u``
    stays), and reads it back only while recomputing that call: an Evaluator's forward
    between updates moved it, and it was named as a value the workers do not receive.
    Its settings are still watched."""
    link, forward = _linear_with_hooks()
    watch = UnsentState({'model': link})

    def evaluate():
        with chainer.using_config('train', False):
            link(np.full((2, 4), 3.0, np.float32))
    for _ in range(3):
        assert _update(watch, forward) == ''
        evaluate()
    link.local_link_hooks['SpectralNormalization'].factor = 2.0
    _update(watch, forward)
    message = _update(watch, forward) or _caught(watch.finish)
    assert "['SpectralNormalization'].factor: None -> 2.0" in message
    assert '.v:' not in message


def test_a_change_after_the_last_window_is_not_named_at_finalize():
    """``L.Classifier`` writes ``y``, ``loss`` and ``accuracy`` at every call: after one
    update, an Evaluator's call and ``finalize()`` (a snapshot loaded one update before the
    end) named them, no check having seen a window write them. No update ran after the
    change: it reached none, whoever made it."""
    model = Annealed()
    model.accuracy = None

    def forward():
        model.accuracy = chainer.Variable(np.asarray(np.random.rand(), np.float32))
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == ''   # the first window
    forward()   # as an Evaluator's call would
    model.beta = 0.5
    assert _caught(watch.finish) == ''
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == ''
    model.beta = 0.25   # an update runs after it: named at finalize
    assert _update(watch) == ''
    assert 'model.beta: 0.5 -> 0.25' in _caught(watch.finish)


def test_a_value_the_first_call_makes_and_an_extension_changes_is_named():
    """A mask made at the forward's first call (its size known only then), or a default
    set there, then changed by an extension between updates: the replicas compute with
    different values (0.09 and 0.75 off in four updates)."""
    model = Annealed()
    model.mask = None

    def forward():
        if model.mask is None:
            model.mask = np.ones(4, np.float32)
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == ''
    model.mask[0] = 0.0
    message = _update(watch, forward) or _update(watch, forward)
    assert 'model.mask: an array (4,) float32 -> an array (4,) float32' in message


def test_a_classifiers_outputs_an_evaluation_writes_between_updates_are_named():
    """A ``loss_func`` that trains through the Classifier's predictor, and an Evaluator on
    the Classifier: only the Evaluator's call writes ``y``, ``loss`` and ``accuracy``,
    between updates, on the master's copy alone. Named, though Chainer's forward writes
    them before it reads them: a ``loss_func`` (or a hook) that reads ``accuracy`` would
    see the evaluation's on the master and None on the workers."""
    model = chainer.links.Classifier(chainer.links.Linear(5, 3))
    x, t = chainer.dataset.concat_examples(dataset(4, seed=9))

    def evaluate():
        with chainer.using_config('train', False), chainer.no_backprop_mode():
            model(x, t)
    watch = UnsentState({'model': model})
    messages = []
    for _ in range(4):
        messages.append(_update(watch, lambda: model.predictor(x)))
        evaluate()
    messages.append(_caught(watch.finish))
    assert any('model.accuracy: None -> ' in m for m in messages)


def test_two_replicas_name_nothing_after_one_update_and_an_evaluation():
    model = chainer.links.Classifier(chainer.links.Linear(5, 3))
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(dataset(8, seed=r), 4) for r in range(2)],
        setup_optimizer('sgd', model), devices=['@numpy', '@numpy'])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        try:
            updater.update()
            with chainer.using_config('train', False), chainer.no_backprop_mode():
                model(*chainer.dataset.concat_examples(dataset(4, seed=9)))
        finally:
            updater.finalize()


class _Slope:
    """A callable object between a Sequential's links: an activation with a slope."""

    def __init__(self, slope):
        self.slope = slope
        self.calls = 0

    def __call__(self, x):
        self.calls += 1   # the forward's own count
        return x * self.slope


def test_a_value_of_a_callable_between_a_sequentials_links_is_named():
    """What a ``chainer.Sequential`` calls between its links sits in Chainer's private
    ``_layers``: its values are the model's as much as a link's attribute. Chainer's
    functions there (``F.relu``, pickled by name) hold nothing to watch."""
    slope = _Slope(1.0)
    model = chainer.Sequential(chainer.links.Linear(4, 3), chainer.functions.relu, slope)

    def forward():
        model(np.ones((2, 4), np.float32))
    watch = UnsentState({'model': model})
    _update(watch, forward)
    slope.slope = 0.5                       # an extension anneals it
    _update(watch, forward)
    message = _update(watch, forward)
    assert 'model._layers[2].slope: 1.0 -> 0.5' in message
    assert 'calls' not in message           # each replica's forward counts its own


def test_a_link_hook_added_or_removed_between_updates_is_warned_about():
    link, forward = _linear_with_hooks()
    watch = UnsentState({'model': link})
    _update(watch, forward)
    link.delete_hook('ScaleW')
    link.add_hook(chainer.link_hooks.WeightStandardization())
    _update(watch, forward)
    message = _update(watch, forward)
    assert ("link hooks of the master's model changed between updates: added model/ "
            "'WeightStandardization'; removed model/ 'ScaleW'") in message


def test_a_parameter_added_between_updates_raises_and_at_finalize_warns():
    """The workers' replicas and the flat buffers keep the parameters they started with:
    the gradients of two different models would be summed."""
    model = chainer.Sequential(chainer.links.Linear(4, 3))
    watch = UnsentState({'model': model})
    _update(watch)
    model.append(chainer.links.Linear(3, 3))
    _update(watch)
    with pytest.raises(RuntimeError, match=r"the model's parameters or persistents changed "
                                           r'between updates: added model/1/W \(3, 3\), '
                                           r'model/1/b \(3,\)\. '):
        _update(watch)
    late = UnsentState({'model': chainer.Sequential(chainer.links.Linear(4, 3))})
    _update(late)
    late.roots['model'][0].add_persistent('seen', 0)
    _update(late)
    assert "added model/0/seen. The worker" in _caught(late.finish)


def test_a_parameter_replaced_by_one_of_another_shape_is_named_as_reshaped():
    """Pruning by a smaller array between updates read 'added W (6, 5); removed W (8, 5)'
    and spoke of summing the gradients of two models."""
    model = chainer.Sequential(chainer.links.Linear(5, 8), chainer.links.Linear(8, 3))
    watch = UnsentState({'model': model})
    _update(watch)
    model[0].W.array = model[0].W.array[:6].copy()
    model[0].b.array = model[0].b.array[:6].copy()
    _update(watch)
    with pytest.raises(RuntimeError) as info:
        _update(watch)
    message = str(info.value)
    assert ('changed between updates: reshaped model/0/W (8, 5) -> (6, 5), model/0/b (8,) '
            '-> (6,). The worker') in message
    assert 'added' not in message and 'removed' not in message


def test_a_config_entry_changed_between_updates_is_named_once_and_a_scoped_one_not():
    """The workers take chainer.config once, at their start (_inherit): an extension that
    sets an entry a forward reads (chainer.config.x = v, global or this thread's) leaves
    them computing with the old value, which StandardUpdater's one process would not.
    An extension's own chainer.using_config is over before the next update."""
    model = Annealed()
    try:
        chainer.global_config.mgpu_test_temp = 1.0
        chainer.config.mgpu_test_mine = 'a'
        watch = UnsentState({'model': model})
        _update(watch)
        with chainer.using_config('train', False):   # an evaluation's, between updates
            pass
        assert _update(watch) == '' and _update(watch) == ''
        chainer.global_config.mgpu_test_temp = 2.0   # an extension, between updates
        chainer.config.mgpu_test_mine = 'b'
        chainer.config.mgpu_test_new = 0
        watch._next = 0.0                            # the next check is due now
        assert _update(watch) == ''
        message = _update(watch)
        assert message.startswith('chainer.config changed between updates: mgpu_test_mine: '
                                  "'a' -> 'b'; mgpu_test_new: (not set) -> 0; "
                                  'mgpu_test_temp: 1.0 -> 2.0. The worker processes took')
        chainer.global_config.mgpu_test_temp = 3.0   # named once
        assert _caught(watch.finish) == ''
    finally:
        for name in ('mgpu_test_temp',):
            delattr(chainer.global_config, name)
        for name in ('mgpu_test_mine', 'mgpu_test_new'):
            delattr(chainer.config._local, name)


def test_a_config_value_changed_in_place_is_named_and_another_threads_look_is_not():
    """A curriculum kept in chainer.config (a dict an extension changes in place): the
    watch held the live dict and saw no change. A finalize() from another thread reads
    that thread's configuration, not the training thread's: nothing to name there."""
    import threading
    model = Annealed()
    try:
        chainer.global_config.mgpu_test_curriculum = {'scale': 1.0}
        chainer.config.mgpu_test_mine = 'a'   # this thread's own
        watch = UnsentState({'model': model})
        _update(watch)
        chainer.global_config.mgpu_test_curriculum['scale'] = 3.0
        watch._next = 0.0
        assert _update(watch) == ''
        assert ("mgpu_test_curriculum: {'scale': 1.0} -> {'scale': 3.0}"
                in _update(watch))
        later = UnsentState({'model': model})
        _update(later)
        said = []
        finisher = threading.Thread(target=lambda: said.append(_caught(later.finish)))
        finisher.start()
        finisher.join()
        assert said == ['']
    finally:
        delattr(chainer.global_config, 'mgpu_test_curriculum')
        delattr(chainer.config._local, 'mgpu_test_mine')


def _set_weight(weights):
    weights[1] = 3.0


def _set_scale(args):
    args.scale = 3.0


def _set_class_weight(args):
    args.class_weight[1] = 3.0


class _Options:
    """An object of the script's own, without __eq__ (a copy of it differs from it)."""

    def __init__(self, depth):
        self.depth = depth


def test_a_lambda_whose_constant_something_else_holds_for_a_while_is_not_named():
    """chainercv's ResNet pools with ``lambda x: F.average(x, axis=(2, 3))``: a graph's
    node held the tuple for a while, and marshal (version 3 and up) marks a constant by
    whether anything else holds it, so the bytes of the unchanged code differed."""
    model = Annealed()
    namespace = {}
    exec(compile('pool = lambda x: (x, (7, 9))', '<script>', 'exec'), namespace)
    model.pool = namespace['pool']
    watch = UnsentState({'model': model})
    _update(watch)
    held = [c for c in model.pool.__code__.co_consts if isinstance(c, tuple)]
    watch._next = 0.0
    assert _update(watch) == '' and _update(watch) == ''
    del held
    watch._next = 0.0
    assert _update(watch) == '' and _update(watch) == ''
    assert _caught(watch.finish) == ''


def test_an_unchanged_config_entry_holding_objects_of_the_users_is_not_named():
    """The watch compared a copy of a namespace or dict with the live one: an object of
    the script's own in it (no __eq__), a generator, compared unequal at once."""
    model = Annealed()
    try:
        chainer.global_config.mgpu_test_args = argparse.Namespace(
            lr=0.1, opts=_Options(3), rng=np.random.RandomState(0))
        chainer.global_config.mgpu_test_table = {'opts': _Options(2), 'n': 1,
                                                 'floor': np.float32('nan')}
        chainer.global_config.mgpu_test_floor = np.float64('nan')
        watch = UnsentState({'model': model})
        for _ in range(3):
            watch._next = 0.0
            assert _update(watch) == '' and _update(watch) == ''
        assert _caught(watch.finish) == ''
    finally:
        delattr(chainer.global_config, 'mgpu_test_args')
        delattr(chainer.global_config, 'mgpu_test_table')
        delattr(chainer.global_config, 'mgpu_test_floor')


@pytest.mark.parametrize('value, change, said', [
    (np.ones(3, np.float32), _set_weight, 'an array (3,) float32 -> an array (3,) float32'),
    (argparse.Namespace(scale=1.0), _set_scale,
     'Namespace(scale=1.0) -> Namespace(scale=3.0)'),
    (types.SimpleNamespace(scale=1.0), _set_scale,
     'namespace(scale=1.0) -> namespace(scale=3.0)'),
    (argparse.Namespace(lr=0.1, class_weight=np.ones(3), floor=np.float32('nan')),
     _set_class_weight,
     'Namespace(lr=0.1, class_weight=array(... -> Namespace(lr=0.1, class_weight=array(...'),
])
def test_an_array_or_namespace_in_config_changed_in_place_is_named(value, change, said):
    """Class weights kept in chainer.config as an array, or the script's argparse
    namespace, that an extension changes in place: the watch compared the live object
    with itself and saw no change, while the workers kept the old values."""
    model = Annealed()
    try:
        chainer.global_config.mgpu_test_kept = value
        watch = UnsentState({'model': model})
        _update(watch)
        watch._next = 0.0
        assert _update(watch) == '' and _update(watch) == ''
        change(value)
        watch._next = 0.0
        assert f'mgpu_test_kept: {said}. The worker' in _update(watch) + _update(watch)
    finally:
        delattr(chainer.global_config, 'mgpu_test_kept')


def test_a_config_change_not_yet_named_is_noted_on_an_update_that_fails():
    """An extension turns on chainer.set_debug(True) to find a NaN, and the next update
    fails: the warning that the workers kept the old value comes at a look, never with
    an exception on its way, so the failure (a worker's NaN, not named by debug mode)
    came without it."""
    from _models import RaisesAt, classifier
    model = classifier()
    its = [chainer.iterators.SerialIterator(
        RaisesAt(dataset(8, seed=r), 2, ValueError('a bad sample')), 2, shuffle=False)
        for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        updater.update()
        chainer.set_debug(True)
        with pytest.raises(ValueError, match='a bad sample') as info:
            updater.update()
    finally:
        chainer.set_debug(False)
        updater.finalize()
    assert any(note.startswith('chainer.config changed during training: debug: False -> '
                               'True. The worker processes took')
               for note in getattr(info.value, '__notes__', [])), info.value


class _Plain:
    """An object hashed by identity, as a link is."""


@pytest.mark.parametrize('items, hash_seed, named', [
    ({'a', 'b'}, None, True),            # strings: each process's own hash order
    (frozenset({b'a', b'b'}), None, True),
    ({'a', 'b'}, '0', None),             # ... unless the master and the workers hash with 0
    ({'a', 'b'}, '123', True),           # (another seed set after the master started: not)
    ({'a', 'b'}, 'random', True),
    ({_Plain(), _Plain()}, '0', True),   # by identity: never the same
    ({1, 2.5, None}, None, False),       # numbers hash alike everywhere
    ({(1, 2), frozenset({3})}, None, False),   # ... in tuples and frozensets too
    ({('a', 1), ('b', 2)}, None, True),  # strings in tuples: the process's own
    ({'a'}, None, False),                # one item has one order
    (set(map(str, range(1500))), None, True),   # a large vocabulary too
])
def test_a_set_each_process_iterates_in_its_own_order_is_named_once(monkeypatch, items,
                                                                    hash_seed, named):
    """Spawned workers rebuild a set in their own hash order: a forward that iterates a
    set of layer names ran the layers in another order on each worker."""
    if hash_seed is None:
        monkeypatch.delenv('PYTHONHASHSEED', raising=False)
    else:
        monkeypatch.setenv('PYTHONHASHSEED', hash_seed)
    if named is None:   # named unless this process started with PYTHONHASHSEED=0
        named = sys.flags.hash_randomization != 0
    model = Annealed()
    model.order = items
    message = _caught(lambda: UnsentState({'model': model}))   # at once, before a window
    watch = UnsentState({'model': model}) if not message else None
    if named:
        assert message.startswith('model.order: a set that each process iterates in its '
                                  'own order'), message
        assert 'Iterate a list, or sorted(...), instead' in message
    else:
        assert message == ''
        assert _update(watch) == _update(watch) == ''


def test_a_set_the_first_forward_makes_is_named_after_it(monkeypatch):
    monkeypatch.delenv('PYTHONHASHSEED', raising=False)
    model = Annealed()
    model.heads = set()

    def forward():
        model.heads.update({'cls', 'aux', 'reg'})   # made by the first call

    watch = UnsentState({'model': model})
    message = _update(watch, forward)
    assert message.startswith('model.heads: a set that each process iterates'), message
    assert _update(watch, forward) == ''


def test_string_like_items_hash_alike_under_a_zero_seed():
    """In a process started with PYTHONHASHSEED=0 (the workers inherit it), strings, their
    subclasses and enum members of them order alike: not named; objects by identity are."""
    import subprocess
    code = ('import enum\n'
            'from mgpu_updater._unsent_state import unordered_set\n'
            'class Head(str, enum.Enum):\n'
            "    CLS = 'cls'\n"
            "    AUX = 'aux'\n"
            'class Name(str):\n'
            '    pass\n'
            'print(unordered_set({Head.CLS, Head.AUX}), '
            "unordered_set({Name('a'), Name('b')}), unordered_set({object(), object()}))\n")
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONHASHSEED='0'), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ['False', 'False', 'True']


def test_a_number_the_forward_writes_alike_in_the_window_watched_is_the_forwards():
    """A metric a forward keeps as a float (chainer-chemistry's Classifier), the same
    value through the first check's window, then another (a later batch, an Evaluator's
    call between updates): the forward's, not named."""
    model = Annealed()
    model.metrics = {'accuracy': 0.25}
    values = iter([0.25, 0.25, 0.25, 0.25, 0.75])

    def forward():   # a new float object at every call, as float(array) makes
        model.metrics = {'accuracy': np.float64(next(values)).item()}
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == ''
    assert _update(watch, forward) == ''   # the check begins
    assert _update(watch, forward) == ''   # ... and ends: the window wrote it
    assert 'model.metrics' in str(watch.forward)
    model.metrics = {'accuracy': np.float64(0.5).item()}   # as an Evaluator's call would
    assert _caught(watch.finish) == ''


def test_a_numpy_scalar_an_extension_anneals_is_named():
    """A numpy scalar is read anew at each look: its identity tells nothing of who wrote
    it, and one nothing wrote in the window is not the forward's."""
    model = Annealed()
    model.beta = np.float32(0.0)
    watch = UnsentState({'model': model})
    assert _update(watch) == _update(watch) == _update(watch) == ''
    assert 'model.beta' not in watch.forward
    model.beta = np.linspace(0, 1, 5)[2]
    assert 'model.beta: 0.0 -> 0.5' in _caught(watch.finish)


@pytest.mark.parametrize('change', ['in place', 'array set', 'replaced'])
def test_a_mask_held_as_a_variable_changed_between_updates_is_named(change):
    """A constant kept as a ``chainer.Variable`` that is no parameter (a mask, with
    ``requires_grad=False``): no update sends it, as no update sends a numpy array kept
    so (two replicas trained 0.17 apart, without a word)."""
    model = Annealed()
    model.mask = chainer.Variable(np.ones(4, np.float32), requires_grad=False)
    watch = UnsentState({'model': model})
    assert _update(watch) == _update(watch) == ''   # the first window; the check begins
    if change == 'in place':
        model.mask.array[0] = 0.0
    elif change == 'array set':
        model.mask.array = np.zeros(4, np.float32)
    else:
        model.mask = chainer.Variable(np.zeros(4, np.float32), requires_grad=False)
    assert 'model.mask: an array (4,) float32 -> an array (4,) float32' in _update(watch)


def test_a_variable_the_forward_keeps_is_the_forwards_though_its_value_repeats():
    """A forward that keeps its results as Variables (``L.Classifier``'s ``self.y``,
    ``self.accuracy``) makes new ones at every call, of the same value here through the
    first check's window; another value later (an Evaluator's call between updates) is
    the forward's, not named."""
    model = Annealed()
    model.accuracy = None
    values = iter([1.0, 1.0, 1.0, 1.0, 0.5])

    def forward():
        model.accuracy = None   # as L.Classifier does first: the next may take its address
        model.accuracy = chainer.Variable(np.asarray(next(values), np.float32))
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == _update(watch, forward) == ''
    assert _update(watch, forward) == ''
    assert 'model.accuracy' in watch.forward
    forward()   # as an Evaluator's call would
    assert _caught(watch.finish) == ''


def test_an_array_the_forward_makes_anew_is_the_forwards_though_its_value_repeats():
    """A forward that keeps an array it makes (a mask of ones the size of its batch,
    pooling indices for a decoder), the same in every window: an Evaluator's call between
    updates, on a batch of another size, is the forward's, not named (it was, as a value
    the replicas no longer shared). An array nothing in the window wrote is still named."""
    model = Annealed()
    model.mask = None
    model.kept = np.ones(3, np.float32)
    size = [3]

    def forward():
        model.mask = None   # the next may take its address
        model.mask = np.ones((size[0], 1), np.float32)
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == _update(watch, forward) == ''
    assert _update(watch, forward) == ''
    assert 'model.mask' in watch.forward and 'model.kept' not in watch.forward
    size[0] = 4
    forward()   # as an Evaluator's call would
    model.kept = np.ones(4, np.float32)   # as an extension would
    named = _caught(watch.finish)
    assert 'model.kept: an array (3,) float32 -> an array (4,) float32' in named
    assert 'model.mask' not in named


class _ArraysOnPickling:
    """Holds a list and pickles it as an array, made anew at each reduction."""

    def __init__(self):
        self.values = [0.0, 0.0]

    def __getstate__(self):
        return {'values': np.asarray(self.values)}


def test_an_array_the_look_itself_makes_is_no_forwards_and_its_change_is_named():
    """Arrays the walk makes (a generator's state, an array a ``__getstate__`` returns)
    are new at every look, and yet nothing in the window wrote them: a change between
    updates is named (it was not: read as the forward's)."""
    model = Annealed()
    model.rng = np.random.RandomState(0)
    model.holder = _ArraysOnPickling()
    watch = UnsentState({'model': model})
    assert _update(watch) == _update(watch) == _update(watch) == ''
    model.rng.seed(123)
    model.holder.values[1] = 5.0
    named = _caught(watch.finish)
    assert "model.rng.state['key']" in named and 'model.holder.values' in named


@pytest.mark.parametrize('mask_kind', ['array', 'Variable'])
def test_a_forwards_large_result_takes_nothing_from_a_masks_look(monkeypatch, mask_kind):
    """The walk copies numpy arrays up to a budget; a Variable's array it compares by a
    digest of its bytes. ``L.Classifier`` keeps its ``y`` before its predictor's
    attributes: a large one took the budget (or, given a share of it, took the share a
    mask held as a Variable then went without, or came to a mask now and then, which was
    then named as changed though nothing changed it)."""
    monkeypatch.setattr(_unsent_state, 'ARRAY_BYTES', 4000)
    model = Annealed()
    sizes = iter([750, 750, 750, 1500, 1500, 250])

    def forward():   # a result whose size varies (an Evaluator's batch, a sequence)
        model.accuracy = chainer.Variable(np.zeros(next(sizes), np.float32))
    model.accuracy = None
    mask = np.ones(500, np.float32)                                 # 2000 bytes
    model.mask = mask if mask_kind == 'array' else chainer.Variable(mask)
    watch = UnsentState({'model': model})
    assert _update(watch, forward) == _update(watch, forward) == ''
    forward()                               # between updates: nothing changes the mask
    assert _update(watch, forward) == ''
    mask[0] = 0.0                           # an extension edits it in place
    assert 'model.mask: an array (500,) float32 -> an array (500,) float32' in \
        _caught(watch.finish)


def test_a_value_of_a_chain_lists_link_is_named():
    """A ``chainer.ChainList`` keeps its links in its private ``_children`` alone (a
    ``Chain`` keeps them as attributes too): their values were not watched at all."""
    model = chainer.ChainList(chainer.links.Linear(4, 3))
    model[0].beta = 0.5
    watch = UnsentState({'model': model})
    assert _update(watch) == _update(watch) == ''
    model[0].beta = 1.0
    assert 'model._children[0].beta: 0.5 -> 1.0' in _update(watch)

"""Arrays read in place from the communicator's buffers instead of copied every update.

- A worker's parameters (``protocol.ParamViews``): on the shared-memory backend the
  parameter buffer is one slot that the master writes before every Step; a worker's
  parameter arrays are read-only views of it. Persistents (which the forward updates) are
  still copied. A backend without a shared slot binds nothing and copies as before.
- The master's parameters (``group.SlotParams``): on the shared-memory backend they are
  views of that same slot, so the optimizer steps them in place and Step copies nothing;
  a parameter whose array was replaced between updates keeps it and is copied each update;
  finalize copies the views off.
- A view the user kept past finalize (``g = param.grad`` during training) stays readable:
  the segment stays mapped until the last view is gone (``comm.shm._array``).
- The master's summed gradient (``group.SummedGrads``): on the CPU each ``param.grad`` is
  a view of the master's slot, where the reduction left the sum, until the next update's
  window clears it; finalize copies the views off the buffers.
"""
from __future__ import annotations

import copy
import functools
import multiprocessing
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chainer

from mgpu_updater import WorkerError
from mgpu_updater._flat_buffers import ModelLayouts, persistent_arrays
from mgpu_updater._local.group import SlotParams
from mgpu_updater._local.protocol import (ParamViews, broadcast_only, master_begin,
                                          master_finish, worker_step)
from mgpu_updater._replica import Replica, Scaling
from mgpu_updater._loader import make_loader
from mgpu_updater.comm.shm import ShmCommunicator

import _models


class _Workers:
    """The master's view of no worker at all: Step goes nowhere (the test runs the worker)."""

    def send(self, msg):
        self.last = msg

    def gather(self, kind):
        return {}


def _pair(shared=True):
    master_model = _models.classifier(seed=3, batchnorm=True)
    worker_model = copy.deepcopy(master_model)
    layouts = ModelLayouts(master_model)
    master = ShmCommunicator.create(2, layouts.spec(),
                                    broadcast=broadcast_only(layouts) if shared else ())
    worker = ShmCommunicator.attach(master.handle, 1)
    return master_model, worker_model, layouts, master, worker


def _perturb(model, seed):
    rng = np.random.RandomState(seed)
    for p in model.params():
        p.array[...] = rng.standard_normal(p.shape).astype(p.dtype)
    for _, a in persistent_arrays(model):
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)


def _replica(model):
    it = chainer.iterators.SerialIterator(_models.dataset(16, seed=1), 4, shuffle=False)
    loader = make_loader(it, chainer.dataset.concat_examples, chainer.get_device('@numpy'), 0)
    return Replica(model, None, loader, accumulate_steps=1,
                   scaling=Scaling('mean', 'mean', update_norm=8.0, window_norm=4.0))


def _one_update(master_model, layouts, master, worker, worker_model, views, in_place=()):
    workers = _Workers()
    master_begin(workers, master, layouts, master_model, None, None, in_place=in_place)
    worker_step(workers.last, _replica(worker_model), worker, ModelLayouts(worker_model), 2,
                views)
    master_finish(workers, master, layouts, master_model, None, 2)


def test_worker_parameters_are_read_only_views_of_the_shared_slot():
    master_model, worker_model, layouts, master, worker = _pair()
    try:
        views = ParamViews(worker, ModelLayouts(worker_model), worker_model)
        assert views.names == {name for name, _ in worker_model.namedparams()}
        for rounds in range(2):
            _perturb(master_model, seed=rounds)
            _one_update(master_model, layouts, master, worker, worker_model, views)
            slot = worker.buffer('param/<f4')
            for (name, p), (_, q) in zip(sorted(worker_model.namedparams()),
                                         sorted(master_model.namedparams())):
                assert np.shares_memory(p.array, slot), name
                assert not p.array.flags.writeable, name
                np.testing.assert_array_equal(p.array, q.array)
            # persistents are the worker's own arrays, copied, and writable
            for (name, a), (_, b) in zip(persistent_arrays(worker_model),
                                         persistent_arrays(master_model)):
                assert not np.shares_memory(a, slot) and a.flags.writeable, name
        with pytest.raises(ValueError, match='read-only'):
            next(worker_model.params()).array[...] = 0
    finally:
        worker.finalize()
        master.finalize()


def test_a_replaced_parameter_array_is_bound_again():
    master_model, worker_model, layouts, master, worker = _pair()
    try:
        views = ParamViews(worker, ModelLayouts(worker_model), worker_model)
        param = next(worker_model.params())
        param.array = np.zeros_like(param.array)        # e.g. a load that rebinds
        _perturb(master_model, seed=5)
        _one_update(master_model, layouts, master, worker, worker_model, views)
        assert np.shares_memory(param.array, worker.buffer('param/<f4'))
        np.testing.assert_array_equal(
            param.array, dict(master_model.namedparams())[
                dict((id(p), n) for n, p in worker_model.namedparams())[id(param)]].array)
    finally:
        worker.finalize()
        master.finalize()


def test_without_a_shared_slot_nothing_is_bound_and_parameters_are_copied():
    master_model, worker_model, layouts, master, worker = _pair(shared=False)
    try:
        views = ParamViews(worker, ModelLayouts(worker_model), worker_model)
        assert views.names == frozenset()
        _perturb(master_model, seed=7)
        _one_update(master_model, layouts, master, worker, worker_model, views)
        slot = worker.buffer('param/<f4')
        for (name, p), (_, q) in zip(sorted(worker_model.namedparams()),
                                     sorted(master_model.namedparams())):
            assert not np.shares_memory(p.array, slot) and p.array.flags.writeable, name
            np.testing.assert_array_equal(p.array, q.array)
    finally:
        worker.finalize()
        master.finalize()


class _WritesItsWeight(chainer.Chain):
    """A model whose forward changes a parameter in place: a worker must not do that to
    the slot every worker reads."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = chainer.links.Linear(5, 3)

    def forward(self, x, t):
        self.l.W.array[...] = self.l.W.array * 1.0
        return chainer.functions.softmax_cross_entropy(self.l(x), t)


def test_a_worker_writing_its_parameters_fails_loudly():
    model, updater = _models.two_cpu_replicas(16, model=_WritesItsWeight())
    try:
        with pytest.raises(WorkerError, match='read-only') as info:
            _models.run_updates(updater, model, 1)
        assert 'replica 1' in str(info.value) and 'forward' in str(info.value)
    finally:
        updater.finalize()


def test_master_gradients_are_its_own_arrays_that_the_sums_went_onto():
    model, updater = _models.two_cpu_replicas()
    try:
        _models.run_updates(updater, model, 2)
        assert updater._group.grads.summed_in_place
        comm = updater._group.comm
        for name, p in model.namedparams():
            for buffer in ('grad/<f4', 'param/<f4'):
                assert not np.shares_memory(p.grad, comm.buffer(buffer)), (name, buffer)
    finally:
        updater.finalize()


def test_master_gradients_that_cannot_take_the_sums_are_the_summed_slot_until_finalize():
    """A read-only gradient (``F.sum(c)``) is packed with the others, and the sums are
    views of the master's slot, until finalize copies them off."""
    model, updater = _models.two_cpu_replicas(model=_models.SummedPrior())
    try:
        _models.run_updates(updater, model, 2)
        assert not updater._group.grads.summed_in_place
        slot = updater._group.comm.buffer('grad/<f4')
        grads = {name: p.grad for name, p in model.namedparams()}
        for name, g in grads.items():
            assert np.shares_memory(g, slot), name
        kept = {name: g.copy() for name, g in grads.items()}
    finally:
        updater.finalize()
    for name, p in model.namedparams():
        assert p.grad is not grads[name] and not np.shares_memory(p.grad, slot), name
        np.testing.assert_array_equal(p.grad, kept[name])


def _worker_sees_master(master_model, worker_model):
    for (name, p), (_, q) in zip(sorted(worker_model.namedparams()),
                                 sorted(master_model.namedparams())):
        np.testing.assert_array_equal(p.array, q.array, err_msg=name)


def test_master_parameters_are_views_of_the_slot_until_finalize_copies_them():
    model, updater = _models.two_cpu_replicas()
    try:
        before = {name: p.array.copy() for name, p in model.namedparams()}
        _models.run_updates(updater, model, 2)
        slot = updater._group.comm.buffer('param/<f4')
        arrays = {name: p.array for name, p in model.namedparams()}
        for name, a in arrays.items():
            # the optimizer stepped the parameters where the workers read them
            assert np.shares_memory(a, slot) and a.flags.writeable, name
            assert not np.array_equal(a, before[name]), name
        kept = {name: a.copy() for name, a in arrays.items()}
    finally:
        updater.finalize()
    for name, p in model.namedparams():
        assert p.array is not arrays[name] and not np.shares_memory(p.array, slot), name
        assert p.array.flags.writeable, name
        np.testing.assert_array_equal(p.array, kept[name])


def _save_when_released(path, target, released=None):
    released.wait(60)
    chainer.serializers.save_npz(path, target)


def test_a_snapshot_saved_from_a_fork_holds_the_parameters_of_its_update(tmp_path,
                                                                          monkeypatch):
    """Chainer's snapshot() serializes the trainer into a dict, then a ProcessWriter saves
    the dict from a fork. The master's parameters are views of shared memory that the next
    steps change in place, so the dict holds copies of them (0.036 off the update the
    snapshot named otherwise, with a slow save)."""
    from chainer import training
    from chainer.training import extensions
    from chainer.training.extensions import snapshot_writers
    fork = multiprocessing.get_context('fork')
    monkeypatch.setattr(snapshot_writers.multiprocessing, 'Process', fork.Process)
    released = fork.Event()
    model, updater = _models.two_cpu_replicas()
    trainer = training.Trainer(updater, (4, 'iteration'), out=str(tmp_path))
    at_two = {}
    second = training.triggers.ManualScheduleTrigger([2], 'iteration')
    trainer.extend(lambda t: at_two.update(
        {name: p.array.copy() for name, p in model.namedparams()}), trigger=second)
    trainer.extend(extensions.snapshot(filename='snap', writer=snapshot_writers.ProcessWriter(
        savefun=functools.partial(_save_when_released, released=released))),
        trigger=training.triggers.ManualScheduleTrigger([2], 'iteration'))
    trainer.extend(lambda t: released.set(), trigger=(4, 'iteration'))
    trainer.run()
    saved = np.load(str(tmp_path / 'snap'))
    assert int(saved['updater/iteration']) == 2
    for name, value in at_two.items():
        np.testing.assert_array_equal(saved['updater/model:main' + name], value,
                                      err_msg=name)
        assert not np.array_equal(value, dict(model.namedparams())[name].array), name


def test_a_snapshot_saves_what_a_links_own_serialize_saves():
    """The snapshot's copies of the master's parameters go through a serializer of the
    package's: a link's ``serialize`` that saves only where it is given a Chainer
    ``Serializer`` (``LogReport``'s idiom) took the load branch there, and the snapshot
    and the live model lost the link's state (a count of 3 saved and left as 0)."""
    from chainer.serializers import DictionarySerializer
    np.random.seed(0)
    model = chainer.links.Classifier(_models.SavesExtraState())
    model.predictor.count = 3   # as the workers hold it too
    _, updater = _models.two_cpu_replicas(model=model)
    try:
        updater.update()
        saved = DictionarySerializer()
        updater.serialize(saved)
    finally:
        updater.finalize()
    assert model.predictor.count == 3
    assert int(saved.target['model:main/predictor/count']) == 3


def test_a_master_parameter_replaced_between_updates_keeps_its_array_and_is_copied():
    master_model, worker_model, layouts, master, worker = _pair()
    try:
        params = SlotParams(layouts, master, master_model)
        views = ParamViews(worker, ModelLayouts(worker_model), worker_model)
        _perturb(master_model, seed=1)
        _one_update(master_model, layouts, master, worker, worker_model, views,
                    in_place=params.bind())
        _worker_sees_master(master_model, worker_model)
        slot = master.buffer('param/<f4')
        param = next(master_model.params())
        assert np.shares_memory(param.array, slot)
        # between updates, something assigns a new array (a deserializer, an update rule
        # with use_fp32_update, ...): its values must reach the workers at the next Step
        # (or the user's own array, as under StandardUpdater the parameter's from now on)
        replaced = param.array = param.array * 2 + 1
        assert not np.shares_memory(param.array, slot)
        for _ in range(2):
            _one_update(master_model, layouts, master, worker, worker_model, views,
                        in_place=params.bind())
            assert param.array is replaced
            _worker_sees_master(master_model, worker_model)
            replaced += 1   # written through the user's array: reaches the workers
    finally:
        worker.finalize()
        master.finalize()


def test_a_master_parameter_that_cannot_be_a_view_is_copied_as_before():
    master_model, worker_model, layouts, master, worker = _pair()
    try:
        params = SlotParams(layouts, master, master_model)
        views = ParamViews(worker, ModelLayouts(worker_model), worker_model)
        param = next(master_model.params())
        # not a float32 array like its slice (as a device array on a host buffer is not):
        # the master keeps it, and begin copies its values into the slot
        other = np.arange(param.size, dtype=np.float64).reshape(param.shape) / 7
        param.array = other
        every = len(params.views)
        in_place = params.bind()
        assert param.array is other and len(in_place) == every - 1
        _one_update(master_model, layouts, master, worker, worker_model, views,
                    in_place=in_place)
        assert param.array is other
        for (name, p), (_, q) in zip(sorted(worker_model.namedparams()),
                                     sorted(master_model.namedparams())):
            np.testing.assert_array_equal(p.array, q.array.astype(p.dtype), err_msg=name)
    finally:
        worker.finalize()
        master.finalize()


def test_without_a_shared_slot_the_master_parameters_stay_its_own():
    master_model, worker_model, layouts, master, worker = _pair(shared=False)
    try:
        params = SlotParams(layouts, master, master_model)
        assert params.bind() == frozenset()
        arrays = [p.array for p in master_model.params()]
        _perturb(master_model, seed=2)
        _one_update(master_model, layouts, master, worker, worker_model,
                    ParamViews(worker, ModelLayouts(worker_model), worker_model))
        assert [p.array for p in master_model.params()] == arrays
        _worker_sees_master(master_model, worker_model)
    finally:
        worker.finalize()
        master.finalize()


_KEPT_PAST_FINALIZE = textwrap.dedent('''
    import gc, os, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import _models

    def mapped(names):
        with open('/proc/self/maps') as f:
            return [line for line in f if any(n in line for n in names)]

    if __name__ == '__main__':
        model, updater = _models.two_cpu_replicas()
        _models.run_updates(updater, model, 2)
        names = updater._group.comm.owned_segments
        kept = [(p.array, p.grad) for p in model.params()]   # views of the slots
        copies = [(a.copy(), g.copy()) for a, g in kept]
        updater.finalize()
        assert not any(os.path.exists('/dev/shm/' + n) for n in names), 'not unlinked'
        assert mapped(names), 'the views outlived their mapping'
        for (a, g), (a0, g0) in zip(kept, copies):
            a[...] += 1      # reading and writing a kept view must not crash
            np.testing.assert_array_equal(a, a0 + 1)
            np.testing.assert_array_equal(g, g0)
        del kept, a, g
        gc.collect()
        assert not mapped(names), mapped(names)
        print('OK')
''')


def test_views_kept_past_finalize_stay_readable_until_the_last_one_goes(tmp_path):
    """A subprocess, because the failure this guards against is a segfault."""
    script = tmp_path / 'kept_past_finalize.py'
    script.write_text(_KEPT_PAST_FINALIZE)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(tests), tests, os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, str(script), tests], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and 'OK' in proc.stdout, (proc.returncode, proc.stderr[-3000:])
    assert 'Exception ignored' not in proc.stderr, proc.stderr[-3000:]


def test_a_model_copied_before_training_sees_the_trained_parameters():
    """Chainer's PTB example evaluates ``eval_model = model.copy()``, made before training:
    its parameters share their array with the model's, and must follow it into the slot
    at the first update and out of it at finalize, as under StandardUpdater."""
    model, updater = _models.two_cpu_replicas()
    eval_model = model.copy()
    try:
        _models.run_updates(updater, model, 2)
        slot = updater._group.comm.buffer('param/<f4')
        for (name, p), (_, q) in zip(sorted(model.namedparams()),
                                     sorted(eval_model.namedparams())):
            assert q.array is p.array and np.shares_memory(q.array, slot), name
    finally:
        updater.finalize()
    for (name, p), (_, q) in zip(sorted(model.namedparams()), sorted(eval_model.namedparams())):
        assert q.array is p.array and not np.shares_memory(q.array, slot), name

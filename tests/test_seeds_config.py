"""What the script sets up in its own process reaches the workers: seeds and configuration.

Under StandardUpdater, ``numpy.random.seed(s)`` makes a run with dropout reproducible, and
``chainer.global_config`` / ``chainer.config`` settings hold for every gradient. The
workers are fresh processes: the master sends them one seed each (drawn from its own
seeded ``numpy.random``) and its configuration, applied before they build.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from mgpu_updater import ParallelAccumulatingUpdater

from _models import dataset, params, run_updates, setup_optimizer

DEVICES = ['@numpy', '@numpy']


class DropoutMLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 16)
            self.l2 = L.Linear(16, 3)

    def forward(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), ratio=0.5))


class PythonRandomNoise(chainer.Chain):
    """Draws from Python's ``random`` in forward (as some augmentations do)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x):
        return self.l1(x * np.float32(random.random()))


def _train(seed, model_class=DropoutMLP, updates=3):
    np.random.seed(0)                    # the same initial parameters in every run
    model = L.Classifier(model_class())
    data = dataset(24, seed=1)
    its = [chainer.iterators.SerialIterator(data[r::2], 3, shuffle=False) for r in range(2)]
    np.random.seed(seed)                 # the script's seeds, set before training
    random.seed(seed)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=DEVICES,
                                          accumulate_steps=2)
    try:
        run_updates(updater, model, updates)
    finally:
        updater.finalize()
    return params(model)


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize('model_class', [DropoutMLP, PythonRandomNoise])
def test_the_same_numpy_seed_gives_bitwise_the_same_run(model_class):
    first, second = _train(7, model_class), _train(7, model_class)
    assert _same(first, second)
    assert not _same(first, _train(8, model_class))


class ReportsConfig(chainer.Chain):
    """Reports, from every replica, the configuration it computes under."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x, t):
        x = x.astype(chainer.get_dtype())
        y = self.l1(x)
        chainer.report({
            'debug': float(chainer.is_debug()),
            'float64': float(chainer.get_dtype() == np.float64),
            'flag': float(getattr(chainer.config, 'mgpu_test_flag', 0.0)),
            'type_check': float(chainer.config.type_check),
        }, self)
        return F.softmax_cross_entropy(y, t)


@pytest.fixture
def restore_config():
    saved_global = dict(vars(chainer.global_config))
    saved_local = dict(vars(chainer.config._local))
    yield
    for name in set(vars(chainer.global_config)) - set(saved_global):
        delattr(chainer.global_config, name)
    vars(chainer.global_config).update(saved_global)
    for name in set(vars(chainer.config._local)) - set(saved_local):
        delattr(chainer.config._local, name)
    vars(chainer.config._local).update(saved_local)


def test_workers_compute_under_the_masters_configuration(restore_config):
    chainer.global_config.dtype = np.dtype(np.float64)   # global, before the model
    chainer.global_config.mgpu_test_flag = 3.0           # a user's own entry
    chainer.global_config.type_check = False
    chainer.set_debug(True)                              # this thread's own entry
    np.random.seed(0)
    model = ReportsConfig()
    assert model.l1.W.dtype == np.float64
    data = dataset(16, seed=1)
    its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=DEVICES,
                                          accumulate_steps=2)
    try:
        observations = run_updates(updater, model, 2)
    finally:
        updater.finalize()
    # The mean over every micro-batch of both replicas: 1 only if the worker's are 1 too.
    for obs in observations:
        assert float(obs['main/debug']) == 1.0
        assert float(obs['main/float64']) == 1.0
        assert float(obs['main/flag']) == 3.0
        assert float(obs['main/type_check']) == 0.0


def test_a_config_value_that_cannot_travel_is_left_out_with_a_warning(restore_config):
    import threading
    chainer.global_config.mgpu_test_lock = threading.Lock()
    np.random.seed(0)
    model = L.Classifier(DropoutMLP())
    data = dataset(8, seed=1)
    its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=DEVICES)
    try:
        with pytest.warns(UserWarning, match=r'chainer\.config\.mgpu_test_lock = .*cannot be '
                          r'sent to the worker'):
            run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_runtime_entries_and_graph_keeping_stay_on_the_master(restore_config):
    from mgpu_updater import _inherit
    chainer.config.keep_graph_on_report = True     # as DumpGraph sets it, for the master
    chainer.config.mgpu_test_local = 'x'
    sent = _inherit.master_config()
    assert sent['mgpu_test_local'] == 'x' and sent['train'] is True
    assert not {'keep_graph_on_report', 'schedule_func', 'in_recomputing'} & set(sent)

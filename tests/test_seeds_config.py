"""What the script sets up in its own process reaches the workers: seeds and configuration.

Under StandardUpdater, ``numpy.random.seed(s)`` makes a run with dropout reproducible, and
``chainer.global_config`` / ``chainer.config`` settings hold for every gradient. The
workers are fresh processes: the master sends them one seed each (drawn from its own
seeded ``numpy.random``) and its configuration, applied before they unpickle their copies.
"""
from __future__ import annotations

import contextlib
import random
import warnings

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


class ScaleDrawnOnUnpickling(chainer.Chain):
    """Draws an input scale from ``numpy.random`` in ``__init__`` and again in
    ``__setstate__``: each worker draws its own when its copy is unpickled (the replicas
    then differ, which the package warns of), from its seeded stream."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)
        self._draw()

    def _draw(self):
        self.scale = np.random.rand(5).astype(np.float32)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._draw()

    def forward(self, x):
        return self.l1(x * self.scale)


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


@pytest.mark.parametrize('model_class', [
    DropoutMLP, PythonRandomNoise,
    pytest.param(ScaleDrawnOnUnpickling, marks=pytest.mark.filterwarnings(
        'ignore:the replicas hold different arrays:RuntimeWarning'))])
def test_the_same_numpy_seed_gives_bitwise_the_same_run(model_class):
    """A draw at unpickling too: each worker seeds before it unpickles its copies."""
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


def _two_updates(model, data, **kwargs):
    """The observations of two updates on two replicas, each reading every other sample
    of ``data``, two at a time."""
    its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=DEVICES,
                                          **kwargs)
    try:
        return run_updates(updater, model, 2)
    finally:
        updater.finalize()


def test_workers_compute_under_the_masters_configuration(restore_config):
    chainer.global_config.dtype = np.dtype(np.float64)   # global, before the model
    chainer.global_config.mgpu_test_flag = 3.0           # a user's own entry
    chainer.global_config.type_check = False
    chainer.set_debug(True)                              # this thread's own entry
    np.random.seed(0)
    model = ReportsConfig()
    assert model.l1.W.dtype == np.float64
    observations = _two_updates(model, dataset(16, seed=1), accumulate_steps=2)
    # The mean over every micro-batch of both replicas: 1 only if the worker's are 1 too.
    for obs in observations:
        assert float(obs['main/debug']) == 1.0
        assert float(obs['main/float64']) == 1.0
        assert float(obs['main/flag']) == 3.0
        assert float(obs['main/type_check']) == 0.0


_SETS_CONFIG_ON_IMPORT = '''
import chainer
import chainer.functions as F
import chainer.links as L
chainer.config.mgpu_test_flag = 1.0   # defaults, which the script's main() changes
chainer.set_debug(True)


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x, t):
        chainer.report({'flag': float(chainer.config.mgpu_test_flag),
                        'debug': float(chainer.is_debug())}, self)
        return F.softmax_cross_entropy(self.l1(x), t)
'''


def test_config_a_module_sets_at_import_gives_way_to_the_masters_in_workers(
        tmp_path, monkeypatch, restore_config):
    """A module sets configuration defaults at import, which the script's main() then
    changes: a worker imports the module again, into its own thread's entries, which hid
    the master's values (a scale of 1.0 where the master trained with 0.25, silently)."""
    import importlib
    import sys
    (tmp_path / 'sets_config_mod.py').write_text(_SETS_CONFIG_ON_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))   # the spawned workers take sys.path
    module = importlib.import_module('sets_config_mod')
    try:
        chainer.config.mgpu_test_flag = 0.25
        chainer.set_debug(False)
        model = module.Net()
        observations = _two_updates(model, dataset(8, seed=1))
        # the mean over both replicas: the master's values only if the worker's are too
        for obs in observations:
            assert float(obs['main/flag']) == 0.25
            assert float(obs['main/debug']) == 0.0
    finally:
        sys.modules.pop('sets_config_mod', None)


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


class ChecksItsThread(chainer.dataset.DatasetMixin):
    """A dataset that refuses to load where the script's own settings do not hold: the
    thread that runs training's configuration entry and numpy error handling. Under
    StandardUpdater it loads in that thread."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def get_example(self, i):
        flag = getattr(chainer.config, 'mgpu_test_loader', None)
        divide = np.geterr()['divide']
        if flag != 'set' or divide != 'raise':
            raise AssertionError(f'loading without the script\'s settings: '
                                 f'mgpu_test_loader={flag!r}, divide={divide!r}')
        return self.data[i]


@pytest.mark.parametrize('prefetch', [2, 'auto'])
def test_the_loader_thread_loads_under_the_settings_of_the_thread_that_trains(
        restore_config, prefetch):
    """chainer.config.x = v, chainer.using_config and numpy.errstate hold for the thread
    that sets them only; the master's loader thread runs the dataset and the converter,
    and must see what the thread that runs training sees (a transform reading
    chainer.config trained on other data, a dtype set there crashed the converter's
    output against the model's)."""
    np.random.seed(0)
    model = L.Classifier(DropoutMLP())
    data = ChecksItsThread(dataset(48, seed=1))
    it = chainer.iterators.SerialIterator(data, 2, shuffle=False)
    updater = ParallelAccumulatingUpdater([it], setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=prefetch)
    try:
        with chainer.using_config('mgpu_test_loader', 'set'), np.errstate(divide='raise'):
            run_updates(updater, model, 14)   # 'auto': its trial loads ahead too
        assert updater.loading_modes == (['ahead'] if prefetch == 2 else ['trial'])
    finally:
        updater.finalize()


class LogOfItsInput(chainer.Chain):
    """log(|x|) in forward: a division by zero for a sample that is 0, which numpy warns
    about, or raises under numpy.seterr(divide='raise') or warnings.simplefilter('error')."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x):
        return self.l1(x + np.log(np.abs(x)).min() * 0)


@pytest.mark.parametrize('how', ['numpy', 'warnings'])
def test_workers_raise_where_the_master_would_on_a_floating_point_error(how):
    """The worker's shard holds the sample that divides by zero: StandardUpdater raises
    there, under the master's numpy error handling or warning filters, so must the worker
    (it warned and trained on)."""
    from mgpu_updater import WorkerError
    np.random.seed(0)
    model = L.Classifier(LogOfItsInput())
    data = dataset(8, seed=1)
    worker_shard = [(np.zeros_like(x), t) for x, t in data[1::2]]
    its = [chainer.iterators.SerialIterator(data[0::2], 2, shuffle=False),
           chainer.iterators.SerialIterator(worker_shard, 2, shuffle=False)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=DEVICES)
    saved = np.geterr()
    try:
        with warnings.catch_warnings():
            if how == 'numpy':
                np.seterr(divide='raise')
                expected = 'FloatingPointError: divide by zero'
            else:
                warnings.simplefilter('error')
                expected = 'RuntimeWarning: divide by zero'
            with pytest.raises(WorkerError) as info:
                run_updates(updater, model, 1)
        assert info.value.replica == 1
        assert expected in info.value.remote_traceback
    finally:
        np.seterr(**saved)
        updater.finalize()


_WARNS_ON_IMPORT = '''
import warnings
import chainer
import chainer.functions as F
import chainer.links as L
warnings.warn('this module is deprecated', DeprecationWarning)


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l1(x), t)
'''


def test_a_module_that_warns_on_import_before_the_filters_are_set_trains(tmp_path,
                                                                         monkeypatch):
    """The script imports a module that warns (a deprecation) and then turns warnings
    into errors, as StandardUpdater trains under: each worker imports the module as it
    unpickles its copy of the model, before it takes the master's filters."""
    import importlib
    (tmp_path / 'warns_on_import_mod.py').write_text(_WARNS_ON_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))   # the spawned workers take sys.path
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        module = importlib.import_module('warns_on_import_mod')
    try:
        np.random.seed(0)
        model = module.Net()
        data = dataset(8, seed=1)
        its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False)
               for r in range(2)]
        updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                              devices=DEVICES)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter('error')
                run_updates(updater, model, 1)
        finally:
            updater.finalize()
        assert updater.iteration == 1
    finally:
        import sys
        sys.modules.pop('warns_on_import_mod', None)


class DeepRecursion(chainer.Chain):
    """A forward that recurses ``depth`` calls deep, as a recursive network over a deep
    tree does (past Python's default limit of 1000)."""

    def __init__(self, depth=1500):
        super().__init__()
        self.depth = depth
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def _down(self, h, n):
        return h if n == 0 else self._down(h, n - 1)

    def forward(self, x):
        return self.l1(self._down(x, self.depth))


def test_workers_take_the_masters_recursion_limit():
    """The script raises it in main(), where StandardUpdater trains: so do the workers
    (they raised RecursionError)."""
    import sys
    np.random.seed(0)
    model = L.Classifier(DeepRecursion())
    data = dataset(8, seed=1)
    its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model), devices=DEVICES)
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(4000)
    try:
        run_updates(updater, model, 2)
    finally:
        sys.setrecursionlimit(saved)
        updater.finalize()
    assert updater.iteration == 2


class LazyMask(chainer.Chain):
    """Draws a fixed mask from a generator of its own at its first forward, as a random
    projection or a fixed feature mask is made: part of the model, the same in every
    replica as in StandardUpdater's one model."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)
        self.rng = np.random.RandomState(123)
        self.mask = None

    def forward(self, x, t):
        if self.mask is None:
            self.mask = (self.rng.rand(x.shape[1]) > 0.5).astype(np.float32)
        return F.softmax_cross_entropy(self.l1(x * self.mask), t)


def test_a_generator_the_model_holds_reaches_each_worker_in_the_masters_state():
    """Each worker's copy of the model's own generator starts where the master's was, so
    what the model draws once (a mask) is the same in every replica and the updates are
    StandardUpdater's on the global batch. (A generator reseeded per replica drew a
    different mask in each: 0.02 apart after 3 updates.) Per-sample randomness from such
    a generator repeats across replicas: semantics.md says to draw it from numpy.random."""
    from chainer.training.updaters import StandardUpdater
    data = dataset(24, seed=1)
    np.random.seed(0)
    ours, theirs = LazyMask(), LazyMask()
    theirs.copyparams(ours)
    its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', ours), devices=DEVICES)
    merged = [x for pair in zip(data[0::2], data[1::2]) for x in pair]
    reference = StandardUpdater(chainer.iterators.SerialIterator(
        [merged[i] for i in range(len(merged))], 4, shuffle=False),
        setup_optimizer('sgd', theirs))
    try:
        run_updates(updater, ours, 3)
    finally:
        updater.finalize()
    run_updates(reference, theirs, 3)
    for name, value in params(theirs).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=0, atol=1e-6,
                                   err_msg=name)


class _ScaleLinearInputs(chainer.LinkHook):
    """A link hook that changes the computation: every Linear's input doubled."""
    name = 'ScaleLinearInputs'

    def forward_preprocess(self, args):
        if isinstance(args.link, L.Linear):
            args.args = (args.args[0] * 2,) + tuple(args.args[1:])


class _Counting(chainer.FunctionHook):
    """A function hook that only looks: it counts the rows through each linear."""
    name = 'Counting'

    def __init__(self):
        self.rows = 0

    def forward_preprocess(self, function, in_data):
        if function.label == 'LinearFunction':
            self.rows += len(in_data[0])


def test_hooks_registered_in_the_training_thread_are_named_as_the_masters_alone():
    """``with hook:`` registers a hook in the calling thread only (Chainer keeps global
    hooks per thread): the master's replica runs it, no worker does. A hook that changes
    the computation then trains otherwise than StandardUpdater; one that looks sees the
    master's share. Both are named at the first update."""
    def train(*hooks):
        model = L.Classifier(L.Linear(5, 3))
        updater = ParallelAccumulatingUpdater(
            [chainer.iterators.SerialIterator(dataset(8, seed=r), 4, shuffle=False)
             for r in range(2)], setup_optimizer('sgd', model), devices=DEVICES)
        try:
            with contextlib.ExitStack() as stack:
                for hook in hooks:
                    stack.enter_context(hook)
                run_updates(updater, model, 1)
        finally:
            updater.finalize()

    counting = _Counting()
    with pytest.warns(RuntimeWarning, match=r"hooks registered in this thread .* act on the "
                      r"master's replica only: function hook 'Counting', link hook "
                      r"'ScaleLinearInputs'\. .* the worker process runs none"):
        train(counting, _ScaleLinearInputs())
    assert counting.rows == 4   # the master's batch; the worker's 4 rows went unseen
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        train()   # none registered: nothing said

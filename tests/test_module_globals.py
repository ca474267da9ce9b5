"""What the workers' copies read in the user's modules, which each worker imports again.

A model class defined in an imported module (``models.py``) travels to the workers by
name, and each imports that module again from its file: a global the script set at run
time there (``config.SCALE = args.scale``), or the file edited since, held in the master
only, and the replicas computed otherwise without a word. Each worker now compares what
the copies' code reads there with the master's, and the master warns, naming it.
"""
from __future__ import annotations

import importlib
import sys
import uuid

import numpy as np
import pytest

import chainer

from mgpu_updater import ParallelAccumulatingUpdater

from _models import dataset, run_updates, setup_optimizer

CONFIG = '''
SCALE = 1.0
'''

MODEL = '''
import chainer
import chainer.functions as F
import chainer.links as L

import {config}


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l1(x) * {config}.SCALE, t)
'''


NOISY = """
import time

import chainer
import chainer.functions as F
import chainer.links as L

STARTED = time.time()        # differs in every process; read off the forward's way only
FILL = float('nan')          # read by the forward: a NaN is the same NaN
PARAMS = {'scale': 1.0}      # a setting the script may change in place


class _Unbound:
    \"\"\"A context-local proxy, as werkzeug's: looking at its class raises.\"\"\"
    @property
    def __class__(self):
        raise RuntimeError('working outside of a context')


current = _Unbound()


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)
        self.act = 'relu'

    def describe(self):
        return f'started at {STARTED}'

    def helper(self, h):
        if self.act in {'relu', 'elu', 'gelu', 'selu'}:   # a frozenset constant
            return F.relu(h) * PARAMS['scale']
        return h

    def forward(self, x, t):
        if FILL == 0:
            print(current)
        return F.softmax_cross_entropy(self.helper(self.l1(x)), t)
"""


#: MODEL without the config module, with an assert in its forward (which pytest rewrites)
ASSERTING = MODEL.replace('import {config}\n', '').replace(
    '        return F.softmax_cross_entropy(self.l1(x) * {config}.SCALE, t)',
    '        assert len(x) == len(t)\n        return F.softmax_cross_entropy(self.l1(x), t)')


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """A config module and a model module that reads it, importable by the workers (the
    master's sys.path reaches them)."""
    tag = uuid.uuid4().hex[:8]
    config, model = f'cfg_{tag}', f'net_{tag}'
    (tmp_path / f'{config}.py').write_text(CONFIG)
    (tmp_path / f'{model}.py').write_text(MODEL.format(config=config))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module(config), importlib.import_module(model), tmp_path
    for name in (config, model):
        sys.modules.pop(name, None)


@pytest.fixture
def noisy(tmp_path, monkeypatch):
    """A model module with what differs or cannot be looked at, harmlessly."""
    name = f'noisy_{uuid.uuid4().hex[:8]}'
    (tmp_path / f'{name}.py').write_text(NOISY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def test_what_differs_harmlessly_or_cannot_be_read_says_nothing(noisy, monkeypatch):
    """An import-time value read off the forward's way, a NaN, a set literal (its order is
    each process's hash seed's), a proxy whose class raises: no warning, no error."""
    monkeypatch.delenv('PYTHONHASHSEED', raising=False)
    _one_update(noisy)   # warnings are errors here


def test_a_setting_changed_in_place_is_named(noisy):
    noisy.PARAMS['scale'] = 3.0
    with pytest.warns(RuntimeWarning, match=rf"{noisy.__name__}\.PARAMS: {{'scale': 3\.0}} in "
                                            r"the master, {'scale': 1\.0} in the worker"):
        _one_update(noisy)


def _one_update(net_module):
    np.random.seed(0)
    model = net_module.Net()
    its = [chainer.iterators.SerialIterator(dataset(8, seed=r), 2) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        run_updates(updater, model, 1)
    finally:
        updater.finalize()


def test_a_module_the_workers_import_as_the_master_has_it_says_nothing(modules):
    config, net, _ = modules
    _one_update(net)   # warnings are errors here


def test_a_global_the_script_set_in_a_module_is_named(modules):
    config, net, _ = modules
    config.SCALE = 3.0   # as a script sets it from its arguments
    with pytest.warns(RuntimeWarning, match=rf'{config.__name__}\.SCALE: 3\.0 in the master, '
                                            r'1\.0 in the worker \(replica 1\)\. The '
                                            r'replicas compute with different values'):
        _one_update(net)


def test_a_module_file_edited_since_the_master_imported_it_is_named(modules):
    config, net, folder = modules
    source = folder / f'{config.__name__}.py'
    source.write_text(source.read_text().replace('1.0', '2.0'))
    importlib.invalidate_caches()
    with pytest.warns(RuntimeWarning, match=rf'{config.__name__}\.SCALE: 1\.0 in the '
                                            r'master, 2\.0 in the worker'):
        _one_update(net)


def test_a_function_edited_in_its_file_since_the_master_imported_it_is_named(modules):
    """A notebook's kernel keeps the class it imported; each worker imports the file as it
    is now and runs the new code."""
    config, net, folder = modules
    source = folder / f'{net.__name__}.py'
    source.write_text(source.read_text().replace('self.l1(x) *',
                                                  'F.sigmoid(self.l1(x)) * 4 *'))
    importlib.invalidate_caches()
    name = net.__name__
    said = (rf'{name}\.Net\.forward: {name}\.py was changed since the master imported it '
            r'\(the worker runs the file as it is now, the master its old code\) '
            r'\(replica 1\)\..* restart the process .*importlib\.reload')
    with pytest.warns(RuntimeWarning, match=said):
        _one_update(net)


def _scaled_forward(self, x, t):
    return chainer.functions.softmax_cross_entropy(self.l1(x) * 3.0, t)


def test_a_method_replaced_at_run_time_is_named(modules, monkeypatch):
    """``Net.forward = f`` in the script (a notebook's cell): the master's class runs
    ``f``, each worker's, imported again, the method of the file."""
    config, net, _ = modules
    monkeypatch.setattr(net.Net, 'forward', _scaled_forward)
    name = net.__name__
    said = (rf'{name}\.Net\.forward: function {__name__}\._scaled_forward in the master, '
            rf'function {name}\.Net\.forward in the worker \(replica 1\)')
    with pytest.warns(RuntimeWarning, match=said):
        _one_update(net)


@pytest.mark.parametrize('edit', [
    ('    def forward', '    # a comment, and a blank line\n\n    def forward'),
    ('(self, x, t):\n', '(self, x, t):\n        """A docstring."""\n'),
], ids=['comment', 'docstring'])
def test_a_file_edited_where_the_code_does_not_change_says_nothing(modules, edit):
    """Line numbers and docstrings are not compared: only what the code does."""
    config, net, folder = modules
    source = folder / f'{net.__name__}.py'
    text = source.read_text()
    assert edit[0] in text
    source.write_text(text.replace(edit[0], edit[1]))
    importlib.invalidate_caches()
    _one_update(net)   # warnings are errors here


def test_code_an_import_hook_changed_in_the_master_alone_says_nothing(tmp_path, monkeypatch):
    """pytest rewrites the asserts of the master's module; the workers import it plainly."""
    name = f'asserting_{uuid.uuid4().hex[:8]}'
    (tmp_path / f'{name}.py').write_text(ASSERTING)
    monkeypatch.syspath_prepend(str(tmp_path))
    pytest.register_assert_rewrite(name)
    try:
        module = importlib.import_module(name)
        assert type(module.__loader__).__name__ == 'AssertionRewritingHook'
        _one_update(module)   # warnings are errors here
    finally:
        sys.modules.pop(name, None)


def test_the_fingerprint_leaves_out_chainer_numpy_and_the_main_module(modules):
    from mgpu_updater._module_globals import fingerprints
    config, net, _ = modules
    found = fingerprints({'model': net.Net(), 'loss_func': None,
                          'converter': chainer.dataset.concat_examples})
    assert set(found) == {config.__name__, net.__name__}
    assert found[config.__name__] == {'SCALE': 1.0}
    assert {'F', config.__name__} <= set(found[net.__name__])
    assert 'L' not in found[net.__name__]   # read by __init__ only, not on the forward's way
    assert ('code', 'Net.forward') in found[net.__name__]
    assert ('code', 'Net.__init__') not in found[net.__name__]
    assert found[net.__name__][('member', 'Net.__init__')] == (
        'function', net.__name__, 'Net.__init__')

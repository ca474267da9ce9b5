"""Whatever StandardUpdater accepts travels to the workers (issue 10, item 2).

Lambdas and closures as ``loss_func`` (``model.get_loss_func()`` as in Chainer's VAE
example), converters made with ``@chainer.dataset.converter()``, a model holding a lambda,
``TransformDataset`` with a nested transform, and what a script defines in ``__main__``
(``tests/scripts/main_objects.py``, run as ``python script.py``): each travels, and training
with two CPU replicas matches ``StandardUpdater`` on the same samples. So do module
objects of ``ModuleType`` subclasses that can be imported by name (the real ``six.moves``,
lazy modules), by reference (issue 37). What cannot travel is refused with a message naming
it and the path to it (tests/test_validation.py, tests/test_pickle_path.py).
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import re
import subprocess
import sys
import types
import urllib.parse
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import six

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, _payload, _validate

from _models import dataset, params, run_updates

ROOT = Path(__file__).resolve().parent.parent
UPDATES = 2


class LambdaNet(chainer.Chain):
    """Holds a lambda attribute; its loss is a closure over the model, as in Chainer's
    VAE example (``AvgELBOLoss.get_loss_func``)."""

    def __init__(self, seed=0):
        super().__init__()
        np.random.seed(seed)
        with self.init_scope():
            self.enc = L.Linear(5, 8)
            self.dec = L.Linear(8, 3)
        self.activation = lambda h: F.tanh(h)

    def forward(self, x):
        return self.dec(self.activation(self.enc(x)))

    def get_loss_func(self, scale=1.0):
        def lf(x, t):
            loss = F.softmax_cross_entropy(self(x), t) * scale
            chainer.report({'loss': loss}, self)
            return loss
        return lf


@chainer.dataset.converter()
def to_arrays(batch, device):
    """A decorated converter: the module attribute is the wrapper, not this function, so
    pickle refuses it by reference ("not the same object")."""
    return chainer.dataset.concat_examples(batch, device)


def shifted(n, seed, shift=0.5):
    """A TransformDataset whose transform is a closure."""
    offset = np.float32(shift)

    def transform(example):
        x, t = example
        return x + offset, t
    return chainer.datasets.TransformDataset(dataset(n, seed), transform)


def kinds():
    model = LambdaNet()
    return {
        'lambda loss_func': lambda x, t: F.softmax_cross_entropy(x, t),
        'closure loss_func': model.get_loss_func(2.0),
        'decorated converter': to_arrays,
        'model with a lambda attribute': model,
        'TransformDataset with a nested transform': shifted(8, 0),
    }


@pytest.mark.parametrize('kind', sorted(kinds()))
def test_each_kind_passes_the_check_and_round_trips(kind):
    obj = kinds()[kind]
    _validate.picklable(kind, obj, '')          # refused before, with a TypeError
    copy = pickle.loads(_payload.dumps(obj))
    assert type(copy) is type(obj) and copy is not obj


def test_decorated_converter_fails_plain_pickle():
    """The case the old hint ("use a module-level function") got wrong: it is one."""
    with pytest.raises(pickle.PicklingError, match='not the same object'):
        pickle.dumps(to_arrays)


def _window(datasets, batch, k, update):
    out = []
    for d in datasets:
        out.extend(d[update * k * batch:(update + 1) * k * batch])
    return out


def test_closure_lambda_converter_transform_train_like_standard_updater():
    """All of them at once on 2 workers x accumulate_steps=2 against the reference. The
    closure captures the master's model: in the worker it must mean the replica (else
    its gradients are lost and its report has no observer)."""
    k, b = 2, 4
    datasets = [shifted(k * b * UPDATES, seed=10 + r) for r in range(2)]
    ours, ref = LambdaNet(seed=3), LambdaNet(seed=3)
    opt = chainer.optimizers.MomentumSGD(0.1)
    opt.setup(ours)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          accumulate_steps=k, loss_func=ours.get_loss_func(2.0),
                                          converter=to_arrays)
    try:
        obs = run_updates(updater, ours, UPDATES)
    finally:
        updater.finalize()
    ref_opt = chainer.optimizers.MomentumSGD(0.1)
    ref_opt.setup(ref)
    ref_losses = []
    for u in range(UPDATES):
        batch = _window(datasets, b, k, u)
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        ref_updater = StandardUpdater(it, ref_opt, converter=to_arrays,
                                      loss_func=ref.get_loss_func(2.0))
        ref_losses.append(float(run_updates(ref_updater, ref, 1)[0]['main/loss'].array))
    np.testing.assert_allclose([o['main/loss'] for o in obs], ref_losses, rtol=1e-5)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert not np.allclose(params(ours)['/enc/W'], params(LambdaNet(seed=3))['/enc/W'])


def test_loss_func_that_is_the_model_trains_the_replica():
    """``loss_func=model`` (Chainer's VAE example passes the model itself): each worker
    calls its replica, not a copy that nothing updates."""
    k, b = 1, 4
    datasets = [dataset(b * UPDATES, seed=20 + r) for r in range(2)]
    np.random.seed(5)
    ours = L.Classifier(L.Linear(5, 3))
    ref = ours.copy(mode='copy')
    opt = chainer.optimizers.SGD(0.5)
    opt.setup(ours)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2, loss_func=ours)
    try:
        run_updates(updater, ours, UPDATES)
    finally:
        updater.finalize()
    ref_opt = chainer.optimizers.SGD(0.5)
    ref_opt.setup(ref)
    for u in range(UPDATES):
        batch = _window(datasets, b, k, u)
        run_updates(StandardUpdater(chainer.iterators.SerialIterator(batch, len(batch),
                                                                     shuffle=False),
                                    ref_opt, loss_func=ref), ref, 1)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize('mode', [[], ['global']])
def test_script_defining_its_objects_in_main(mode):
    """``python script.py`` under spawn: a class and a lambda defined inside the main
    guard, where a worker re-importing the script never sees them; and a ``loss_func``
    reading the model from a global of the script, set in the guard (docs/semantics.md:
    it travels with the function and is each worker's replica)."""
    script = ROOT / 'tests' / 'scripts' / 'main_objects.py'
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)] + mode, capture_output=True,
                          text=True, timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = float(re.search(r'MAX_ABS_DIFF (\S+)', proc.stdout).group(1))
    moved = float(re.search(r'MOVED (\S+)', proc.stdout).group(1))
    assert diff < 1e-6 and moved > 1e-3, proc.stdout


# ------------------------------------------------------------------ importable by name
# six.moves is a module object of a ModuleType subclass (six._MovedItems), which cloudpickle
# cannot pickle by value: "TypeError: cannot pickle '_MovedItems' object" (six issue 194).
# Whatever can be imported by name travels by reference; tested with the real six.
SIX_MODULES = {
    'six.moves': lambda: six.moves,
    'six.moves.urllib': lambda: six.moves.urllib,
    'six.moves.urllib.parse': lambda: six.moves.urllib.parse,   # __name__ six.moves.urllib_parse
}


def _in_fresh_interpreter(payload: bytes, code: str) -> str:
    """Run ``code`` with ``obj`` unpickled from ``payload`` in a new interpreter (as a
    worker, which has imported nothing of the master's)."""
    prelude = 'import pickle, sys\nobj = pickle.loads(sys.stdin.buffer.read())\n'
    proc = subprocess.run([sys.executable, '-c', prelude + code], input=payload,
                          capture_output=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc.stdout.decode()


def test_code_by_value_keeps_its_file_and_lines_for_the_workers_tracebacks():
    """cloudpickle names the file of code it pickles by value '<dynamic-code>'; ours keeps
    the script's, nested functions' too, so a worker's traceback shows where and what."""
    namespace = {'__name__': 'not_an_importable_module'}
    source = 'def outer(x):\n    def inner(y):\n        raise ValueError(y)\n    return inner(x)\n'
    exec(compile(source, '/somewhere/train.py', 'exec'), namespace)
    assert cloudpickle.loads(cloudpickle.dumps(namespace['outer'])).__code__.co_filename \
        == '<dynamic-code>'
    outer = pickle.loads(_payload.dumps(namespace['outer']))
    with pytest.raises(ValueError) as e:
        outer(3)
    frames = [(str(f.path), f.lineno + 1, f.name) for f in e.traceback[1:]]
    assert frames == [('/somewhere/train.py', 4, 'outer'), ('/somewhere/train.py', 3, 'inner')]


@pytest.mark.parametrize('name', sorted(SIX_MODULES))
def test_six_module_objects_travel_by_name(name):
    module = SIX_MODULES[name]()
    assert type(module) is not types.ModuleType
    with pytest.raises(TypeError, match=r'cannot pickle'):
        cloudpickle.dumps(module)             # what cloudpickle alone does
    payload = _payload.dumps(module)
    assert pickle.loads(payload) is module
    out = _in_fresh_interpreter(payload, 'print(type(obj).__qualname__, obj.__name__)')
    assert out.split() == [type(module).__qualname__, module.__name__]


def test_six_moves_before_anything_imports_it(monkeypatch):
    """``import six`` alone leaves six.moves out of sys.modules: it travels as the
    attribute ``moves`` of the module ``six``."""
    monkeypatch.delitem(sys.modules, 'six.moves')
    reduced = _payload.reduction(six.moves)
    assert reduced[0] is getattr and reduced[1] == (six, 'moves')
    assert pickle.loads(_payload.dumps(six.moves)) is six.moves


def test_six_submodule_found_by_its_importer(monkeypatch):
    """six.moves.urllib.parse is named six.moves.urllib_parse; until imported by that name
    it is in no sys.modules entry nor an attribute of six.moves (whose ``urllib_parse``,
    when six has resolved it, is the standard urllib.parse): six's importer finds it."""
    module = six.moves.urllib.parse
    monkeypatch.delitem(sys.modules, 'six.moves.urllib_parse', raising=False)
    monkeypatch.delitem(vars(six.moves), 'urllib_parse', raising=False)  # set by an import
    assert _payload.reduction(module)[1] == ('six.moves.urllib_parse',)
    assert pickle.loads(_payload.dumps(module)) is module


@pytest.mark.parametrize('name', ['range', 'zip', 'map', 'filter', 'reduce', 'input'])
def test_attributes_reached_through_six_moves(name):
    """``six.moves.zip`` and the like are the builtins and standard functions six
    re-exports: they travel by reference, and arrive as the same objects."""
    obj = getattr(six.moves, name)
    assert pickle.loads(_payload.dumps(obj)) is obj
    assert pickle.loads(_payload.dumps(six.moves.urllib.parse.quote)) is urllib.parse.quote


def test_function_by_value_using_six_moves():
    """A closure (pickled by value) whose code reads ``six.moves.range``: cloudpickle lists
    six.moves among the submodules it imports, and pickled it by value before."""
    def make(k):
        def total(xs):
            return sum(x * l for l in six.moves.range(k) for x in six.moves.map(int, xs))
        return total
    payload = _payload.dumps(make(3))
    assert pickle.loads(payload)(['1', '2']) == make(3)(['1', '2']) == 9
    assert _in_fresh_interpreter(payload, "print(obj(['1', '2']))").strip() == '9'


def test_lazy_module_travels_by_name_unloaded(tmp_path, monkeypatch):
    """A module made by ``importlib.util.LazyLoader`` (a ``ModuleType`` subclass until
    first used) travels by its name; pickling does not load it in the master."""
    (tmp_path / 'lazily_loaded.py').write_text("print('LOADED')\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec('lazily_loaded')
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, 'lazily_loaded', module)
    spec.loader.exec_module(module)
    assert type(module) is importlib.util._LazyModule
    payload = _payload.dumps([module])
    assert type(module) is importlib.util._LazyModule          # still not loaded
    assert _in_fresh_interpreter(payload, 'print(obj[0].VALUE)').split() == ['LOADED', '7']


def test_module_subclass_under_another_name(monkeypatch):
    """An alias in sys.modules (the module's own name is not there): the alias will do."""
    module = type(six.moves)('not_registered_by_this_name')
    monkeypatch.setitem(sys.modules, 'payload_test_alias', module)
    assert _payload.reduction(module)[1] == ('payload_test_alias',)
    assert pickle.loads(_payload.dumps(module)) is module


def test_six_moves_through_the_updater_in_main():
    """A tagger defined in a script run as ``__main__`` whose ``forward`` iterates
    ``six.moves.zip``, its loss closure looping over ``six.moves.range``, and a converter
    using six.moves: two CPU replicas match StandardUpdater (tests/scripts/six_moves_main.py)."""
    script = ROOT / 'tests' / 'scripts' / 'six_moves_main.py'
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for loss in ('model', 'closure'):
        proc = subprocess.run([sys.executable, str(script), loss], capture_output=True,
                              text=True, timeout=120, env=env, cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr[-3000:]
        values = dict(re.findall(r'^(MAX_ABS_DIFF|LOSS_DIFF|MOVED) (\S+)$', proc.stdout,
                                 re.MULTILINE))
        assert float(values['MAX_ABS_DIFF']) < 1e-6, (loss, proc.stdout)
        assert float(values['LOSS_DIFF']) < 1e-5, (loss, proc.stdout)
        assert float(values['MOVED']) > 1e-3, (loss, proc.stdout)


class HoldsAModule(chainer.Chain):
    """Keeps a module as an attribute (``self.cfg = config``), as configuration code does:
    the workers' pickling takes it by reference; ``copy.deepcopy`` cannot copy it."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)
        self.cfg = urllib.parse

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l1(x), t)


def test_a_model_that_holds_a_module_trains_as_standard_updater():
    """The copy for the workers' payload was a deepcopy, which failed at the first update
    with a TypeError that blamed lazy input sizes the model did not have."""
    np.random.seed(0)
    ours, theirs = HoldsAModule(), HoldsAModule()
    theirs.copyparams(ours)
    data = dataset(16, seed=1)
    its = [chainer.iterators.SerialIterator(data[r::2], 2, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, _sgd(ours), devices=['@numpy'] * 2)
    merged = [x for pair in zip(data[0::2], data[1::2]) for x in pair]
    reference = StandardUpdater(chainer.iterators.SerialIterator(merged, 4, shuffle=False),
                                _sgd(theirs))
    try:
        run_updates(updater, ours, 2)
    finally:
        updater.finalize()
    run_updates(reference, theirs, 2)
    assert ours.cfg is urllib.parse
    for name, value in params(theirs).items():
        np.testing.assert_allclose(params(ours)[name], value, rtol=0, atol=1e-6,
                                   err_msg=name)


def _sgd(model):
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    return optimizer


def test_a_workers_payload_carries_no_gradient(monkeypatch):
    """Chainer fills a new parameter's gradient with NaN, and the workers' copy of the
    model carried it: a payload twice the parameters' bytes, pickled, held and sent once
    per worker. A worker's window clears the gradients before its first backward."""
    from mgpu_updater._local import group
    sizes = []
    pickled = group._pickled

    def recording(*args, **kwargs):
        out = pickled(*args, **kwargs)
        sizes.extend(len(data) for data in out.values())
        return out
    monkeypatch.setattr(group, '_pickled', recording)
    model = L.Classifier(L.Linear(5, 3))
    with model.predictor.init_scope():
        model.predictor.big = chainer.Parameter(chainer.initializers.Zero(), (1 << 20,))
    assert model.predictor.big.grad is not None   # (NaN, as Chainer initialises it)
    data = dataset(16, seed=0)
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    from mgpu_updater import shard_iterators
    updater = ParallelAccumulatingUpdater(shard_iterators(data, 2, 4), optimizer,
                                          devices=['@numpy'] * 2)
    try:
        run_updates(updater, model, 1)
    finally:
        updater.finalize()
    assert sizes and max(sizes) < 1.25 * (4 << 20), sizes


class _ReadsGradients(chainer.Chain):
    """Reports whether the gradient its first layer holds when its forward runs is
    Chainer's NaN one (before the first backward), as a forward may read it."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x, t):
        grad = self.l1.W.grad
        chainer.report({'grad_nan': float(np.isnan(grad).all())}, self)
        return F.softmax_cross_entropy(self.l2(F.tanh(self.l1(x))), t)


def test_a_forward_that_reads_gradients_before_the_first_backward_sees_nan_on_every_replica():
    """The payload carries no gradient; a worker gives its parameters Chainer's NaN ones,
    as the master's are (a worker's forward got None, and raised in its first window)."""
    from mgpu_updater import shard_iterators
    model = _ReadsGradients()
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    updater = ParallelAccumulatingUpdater(shard_iterators(dataset(32, seed=0), 2, 4),
                                          optimizer, loss_func=model, devices=['@numpy'] * 2)
    try:
        seen = [float(o['main/grad_nan']) for o in run_updates(updater, model, 3)]
    finally:
        updater.finalize()
    assert seen == [1.0, 0.0, 0.0]   # the mean over the replicas: each saw NaN, then not

"""Whatever StandardUpdater accepts travels to the workers (issue 10, item 2).

Lambdas and closures as ``loss_func`` (``model.get_loss_func()`` as in Chainer's VAE
example), converters made with ``@chainer.dataset.converter()``, a model holding a lambda,
``TransformDataset`` with a nested transform, and what a script defines in ``__main__``
(``tests/scripts/main_objects.py``, run as ``python script.py``): each travels, and training
with two CPU replicas matches ``StandardUpdater`` on the same samples. What cannot travel
is refused with a message naming it (tests/test_validation.py).
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def test_script_defining_its_objects_in_main():
    """``python script.py`` under spawn: a class and a lambda defined inside the main
    guard, where a worker re-importing the script never sees them."""
    script = ROOT / 'tests' / 'scripts' / 'main_objects.py'
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = float(re.search(r'MAX_ABS_DIFF (\S+)', proc.stdout).group(1))
    moved = float(re.search(r'MOVED (\S+)', proc.stdout).group(1))
    assert diff < 1e-6 and moved > 1e-3, proc.stdout

"""The Chainer compat shim, each case in a fresh interpreter (patches are process-wide).

The shim module is loaded there on its own, from its file, so that nothing has imported
Chainer (or run the shim through ``import mgpu_updater``) before the case starts.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy
import pytest

from mgpu_updater import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Loads the shim in isolation and turns warnings into errors except its own filters,
# the way pytest does with pyproject's filterwarnings.
_PRELUDE = '''
import builtins, importlib.util, json, sys, warnings
spec = importlib.util.spec_from_file_location('compat_under_test', {path!r})
compat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)
warnings.simplefilter('error')
for line in compat.warning_filters():
    action, message, category = line.split(':')[:3]
    warnings.filterwarnings(action, message, getattr(builtins, category))
assert 'chainer' not in sys.modules
'''


def run_fresh(code, expect_ok=True, path=(), env=None):
    """Run ``code`` after the prelude in a new interpreter; return its last stdout line.

    ``path``: directories put first on ``sys.path`` (fake distributions); ``env``: variables
    set. ``CHAINER_CUDNN`` is not inherited (this process's shim may have set it), and the
    import hook is off (it would apply the shim on ``import chainer``; see
    tests/test_import_hook.py).
    """
    source = _PRELUDE.format(path=_compat.__file__) + textwrap.dedent(code)
    env = dict({k: v for k, v in os.environ.items() if k != 'CHAINER_CUDNN'},
               PYTHONPATH=os.pathsep.join(filter(None, [*map(str, path), str(ROOT),
                                                        os.environ.get('PYTHONPATH')])),
               MGPU_UPDATER_NO_IMPORT_HOOK='1', **(env or {}))
    proc = subprocess.run([sys.executable, '-c', source], capture_output=True, text=True,
                          timeout=240, env=env)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.strip().splitlines()[-1]
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


@pytest.fixture(scope='module')
def needed_here():
    """The patches this Python/numpy needs, asked before anything was patched."""
    return json.loads(run_fresh('print(json.dumps(compat.needed()))'))


def _cupy_major():
    from importlib.metadata import PackageNotFoundError, version
    for name in ('cupy', 'cupy-cuda12x', 'cupy-cuda13x'):
        try:
            return int(version(name).split('.')[0])
        except PackageNotFoundError:
            pass
    return None


def test_needed_matches_the_stack(needed_here):
    expected = []
    if sys.version_info >= (3, 12):
        expected.append('numpy.distutils')   # removed from numpy for Python >= 3.12
    if int(numpy.__version__.split('.')[0]) >= 2:
        expected.append('numpy.sctypes')     # removed in numpy 2.0
    if (_cupy_major() or 0) >= 14:
        expected.append('CHAINER_CUDNN=0')   # CuPy 14 has no cuDNN: Chainer would warn
    assert needed_here == expected


def test_each_patch_is_needed_for_import_chainer(needed_here):
    # Leave one patch out at a time: ``import chainer`` must fail on exactly that one.
    if not needed_here:
        pytest.skip('this stack (Python 3.11, numpy 1.x) needs no patch')
    for left_out in needed_here:
        stderr = run_fresh(f'''
            for name in compat.needed():
                if name != {left_out!r}:
                    compat._PATCHES[name]()
            import chainer
        ''', expect_ok=False)
        assert {'numpy.distutils': "No module named 'numpy.distutils'",
                'numpy.sctypes': 'np.sctypes',
                'CHAINER_CUDNN=0': 'UserWarning: cuDNN is not enabled'}[left_out] in stderr, \
            stderr


def test_apply_then_train_cnn_with_resume_under_warnings_as_errors(needed_here):
    # BatchNorm, Adam with weight decay, Evaluator, snapshot and resume, and the
    # as_strided backward that reads numpy.sctypes: the paths Chainer takes in practice.
    out = run_fresh('''
        applied = compat.apply()
        import os, tempfile
        import numpy as np
        import chainer, chainer.functions as F, chainer.links as L
        from chainer import training
        from chainer.training import extensions

        class CNN(chainer.Chain):
            def __init__(self):
                super().__init__()
                with self.init_scope():
                    self.conv = L.Convolution2D(1, 4, 3, pad=1)
                    self.bn = L.BatchNormalization(4)
                    self.fc = L.Linear(None, 3)

            def forward(self, x):
                return self.fc(F.max_pooling_2d(F.relu(self.bn(self.conv(x))), 2))

        rng = np.random.RandomState(0)
        data = chainer.datasets.TupleDataset(rng.rand(24, 1, 6, 6).astype(np.float32),
                                             rng.randint(0, 3, 24).astype(np.int32))

        def trainer(out):
            model = L.Classifier(CNN())
            opt = chainer.optimizers.Adam()
            opt.setup(model)
            opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
            it = chainer.iterators.SerialIterator(data, 8, shuffle=True)
            tr = training.Trainer(training.updaters.StandardUpdater(it, opt),
                                  (4, 'iteration'), out=out)
            test_it = chainer.iterators.SerialIterator(data, 8, repeat=False, shuffle=False)
            tr.extend(extensions.Evaluator(test_it, model), trigger=(2, 'iteration'))
            tr.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                      trigger=(2, 'iteration'))
            tr.extend(extensions.LogReport(trigger=(1, 'iteration')))
            return tr

        with tempfile.TemporaryDirectory() as out:
            trainer(out).run()
            resumed = trainer(out)
            chainer.serializers.load_npz(os.path.join(out, 'snap_2'), resumed)
            assert resumed.updater.iteration == 2
            resumed.run()
            log = resumed.get_extension('LogReport').log
        assert resumed.updater.iteration == 4
        assert all(np.isfinite(entry['main/loss']) for entry in log)
        assert np.isfinite(log[-1]['validation/main/loss'])

        x = chainer.Variable(np.arange(6, dtype=np.float32))
        F.sum(F.as_strided(x, (3,), (2,))).backward()
        assert x.grad.tolist() == [1, 0, 1, 0, 1, 0]
        print(json.dumps(applied))
    ''')
    assert json.loads(out) == needed_here


def test_apply_is_idempotent():
    out = run_fresh('''
        first = compat.apply()
        state = (sys.modules.get('numpy.distutils.system_info'),
                 getattr(sys.modules['numpy'], 'sctypes', None))
        second = compat.apply()
        assert second == [], second
        assert state == (sys.modules.get('numpy.distutils.system_info'),
                         getattr(sys.modules['numpy'], 'sctypes', None))
        import chainer
        print('ok')
    ''')
    assert out == 'ok'


def test_apply_leaves_what_exists_alone():
    # Whatever is there already (numpy's own, or a user's) is never replaced.
    out = run_fresh('''
        import types
        import numpy
        mine = {'int': [numpy.int64]}
        if not hasattr(numpy, 'sctypes'):
            numpy.sctypes = mine
        theirs = types.ModuleType('numpy.distutils.system_info')
        sys.modules.setdefault('numpy.distutils.system_info', theirs)
        before = (numpy.sctypes, sys.modules['numpy.distutils.system_info'])
        assert [n for n in compat.apply() if n.startswith('numpy.')] == []
        assert (numpy.sctypes, sys.modules['numpy.distutils.system_info']) == before
        print('ok')
    ''')
    assert out == 'ok'


def test_apply_is_a_no_op_where_nothing_is_missing(needed_here):
    if needed_here:
        pytest.skip(f'this stack needs {needed_here}')
    out = run_fresh('''
        import numpy
        sctypes = numpy.sctypes
        assert compat.apply() == []
        import chainer
        import numpy.distutils.system_info as si
        assert numpy.sctypes is sctypes
        assert not hasattr(si, compat.STUB_MARK)
        print('ok')
    ''')
    assert out == 'ok'


def test_distutils_stub_reports_no_blas_and_has_a_spec():
    out = run_fresh('''
        compat._install_distutils_stub()
        import numpy.distutils.system_info as si
        assert getattr(si, compat.STUB_MARK) and si.get_info('blas_opt') == {}
        print(importlib.util.find_spec('numpy.distutils').origin)
    ''')
    assert out == 'mgpu_updater._compat'


def test_sctypes_is_what_numpy_1_26_had():
    expected = {
        'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
        'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
        'float': [numpy.float16, numpy.float32, numpy.float64, numpy.longdouble],
        'complex': [numpy.complex64, numpy.complex128, numpy.clongdouble],
        'others': [bool, object, bytes, str, numpy.void],
    }
    assert _compat.sctypes_numpy126() == expected
    # Here numpy's own (numpy 1.x) or the restored one (numpy 2, conftest applied it).
    assert numpy.sctypes == expected


def test_warning_filters_are_narrow_and_listed_in_pyproject():
    tomllib = pytest.importorskip('tomllib')
    pyproject = ROOT / 'pyproject.toml'
    if not pyproject.exists():
        pytest.skip('not running from a source checkout')
    with open(pyproject, 'rb') as f:
        listed = tomllib.load(f)['tool']['pytest']['ini_options']['filterwarnings']
    assert listed[0] == 'error'
    for line in _compat.warning_filters():
        action, message, category = line.split(':')[:3]
        assert action == 'ignore' and message.strip() and category != 'Warning', line
        assert line in listed[1:], line


def test_import_mgpu_updater_applies_the_shim_first():
    out = run_fresh('''
        import mgpu_updater
        import chainer
        assert compat.needed() == []
        print(chainer.__version__)
    ''')
    assert out == '7.8.1'


def _fake_distribution(root, name, version):
    """A ``.dist-info`` that importlib.metadata finds on ``sys.path``; no code behind it."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    return root


_CUDNN_PROBE = textwrap.dedent('''
    import os
    applied = compat.apply()
    print(json.dumps([applied, os.environ.get('CHAINER_CUDNN'),
                      compat.installed_cupy_without_cudnn(),
                      sorted(m for m in sys.modules if m.split('.')[0] == 'cupy')]))
''')


@pytest.mark.parametrize('name, version, switched', [
    ('cupy-cuda13x', '14.2.0', True), ('cupy-cuda12x', '14.0.0rc1', True),
    ('cupy', '15.0.0', True), ('cupy_rocm_6_0', '14.1.0', True),
    ('cupy-cuda12x', '13.6.0', False), ('cupyx-tools', '14.0.0', False)])
def test_cupy_14_sets_chainer_cudnn_0_read_from_metadata(tmp_path, name, version, switched):
    if _cupy_major() is not None:
        pytest.skip('a real CuPy is installed here: test_needed_matches_the_stack checks it')
    out = run_fresh(_CUDNN_PROBE,
                    path=[_fake_distribution(tmp_path, name, version)])
    applied, value, found, cupy_modules = json.loads(out)
    assert cupy_modules == []   # read from metadata: CuPy is never imported
    if switched:
        assert 'CHAINER_CUDNN=0' in applied and value == '0'
        assert found == f'{name} {version}'
    else:
        assert 'CHAINER_CUDNN=0' not in applied and value is None and found is None


@pytest.mark.parametrize('user_value', ['1', '0'])
def test_a_users_chainer_cudnn_is_kept(tmp_path, user_value):
    out = run_fresh(_CUDNN_PROBE, env={'CHAINER_CUDNN': user_value},
                    path=[_fake_distribution(tmp_path, 'cupy-cuda13x', '14.2.0')])
    applied, value, found, _ = json.loads(out)
    assert 'CHAINER_CUDNN=0' not in applied and value == user_value


def test_no_switch_once_chainer_has_read_it(tmp_path):
    out = run_fresh(textwrap.dedent('''
        import types
        sys.modules['chainer.backends.cuda'] = types.ModuleType('chainer.backends.cuda')
    ''') + _CUDNN_PROBE, path=[_fake_distribution(tmp_path, 'cupy-cuda13x', '14.2.0')])
    applied, value, _, _ = json.loads(out)
    assert 'CHAINER_CUDNN=0' not in applied and value is None


def test_chainer_on_cupy_14_imports_under_warnings_as_errors():
    """Only with the real CuPy >= 14 (make test-cupy14): no shim, Chainer's check warns;
    with the shim, it passes and Chainer sees CUDA without cuDNN."""
    if (_cupy_major() or 0) < 14:
        pytest.skip(f'needs the real CuPy >= 14 installed (found major {_cupy_major()})')
    check = textwrap.dedent('''
        import os
        from chainer.backends import cuda
        cuda.check_cuda_available()   # raises without CUDA libraries, warns without cuDNN
        print(json.dumps([cuda.available, cuda.cudnn_enabled, os.environ.get('CHAINER_CUDNN')]))
    ''')
    stderr = run_fresh(textwrap.dedent('''
        for name in compat.needed():
            if name != 'CHAINER_CUDNN=0':
                compat._PATCHES[name]()
    ''') + check, expect_ok=False)
    assert 'UserWarning: cuDNN is not enabled' in stderr, stderr
    out = run_fresh('compat.apply()\n' + check)
    assert json.loads(out) == [True, False, '0']

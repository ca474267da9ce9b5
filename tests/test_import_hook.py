"""The import hook: a script that imports Chainer before mgpu_updater works once
mgpu_updater is installed (``mgpu_updater-chainer-hook.pth`` + ``_mgpu_updater_hook.py``).

Every case runs in a new interpreter. The fast ones use this test's own environment
(installed with ``make setup*``, editable); the slow one builds fresh virtual environments
and installs the project into them, editable and not. On Python 3.11 with numpy 1.x and no
CuPy >= 14 the shim has nothing to patch: there the hook's mechanics are checked, and on
Python 3.12/3.13 with numpy 2 also that ``import chainer`` fails without it.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata

import pytest

from mgpu_updater import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
PTH_NAME = 'mgpu_updater-chainer-hook.pth'

# Warnings are errors, with the project's filters, as pytest has them.
_WARNINGS = '''
import builtins, json, sys, warnings
warnings.simplefilter('error')
for line in {filters!r}:
    action, message, category = line.split(':')[:3]
    warnings.filterwarnings(action, message, getattr(builtins, category))
'''.format(filters=_compat.warning_filters())


def run(code, python=sys.executable, env=None, cwd=None, expect_ok=True, timeout=240):
    """Run ``code`` in a new interpreter (no PYTHONPATH, no CHAINER_CUDNN inherited)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ('PYTHONPATH', 'CHAINER_CUDNN', 'MGPU_UPDATER_NO_IMPORT_HOOK')}
    environ.update(env or {})
    proc = subprocess.run([str(python), '-c', textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=environ, cwd=cwd or '/')
    if expect_ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.strip().splitlines()[-1]
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


PURELIB = pathlib.Path(sysconfig.get_paths()['purelib'])


def _installed_here():
    """Whether mgpu_updater is installed in this environment's site-packages."""
    return any(metadata.distributions(name='mgpu_updater', path=[str(PURELIB)]))


@pytest.fixture(scope='module')
def installed():
    """This environment's site-packages, which must hold the .pth file."""
    if not _installed_here():
        pytest.skip('mgpu_updater is not installed in this environment (make setup does)')
    assert (PURELIB / PTH_NAME).is_file(), (
        f'{PTH_NAME} is not in {PURELIB}: reinstall mgpu_updater (make setup)')
    return PURELIB


@pytest.fixture(scope='module')
def stack_needs_the_shim():
    """The patches a fresh interpreter needs here, asked with the hook off."""
    return json.loads(run('''
        import importlib.util, json
        spec = importlib.util.spec_from_file_location('c', {path!r})
        c = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(c)
        print(json.dumps(c.needed()))
    '''.format(path=_compat.__file__), env={'MGPU_UPDATER_NO_IMPORT_HOOK': '1'}))


_STARTUP = '''
    import json, sys
    import _mgpu_updater_hook as hook
    print(json.dumps([hook.installed(),
                      sorted(m for m in sys.modules if m.split('.')[0] in
                             ('numpy', 'chainer', 'mgpu_updater', 'cupy'))]))
'''


def test_start_up_installs_the_hook_and_imports_nothing_else(installed):
    assert json.loads(run(_STARTUP)) == [True, []]


def test_the_hook_can_be_switched_off(installed):
    assert json.loads(run(_STARTUP, env={'MGPU_UPDATER_NO_IMPORT_HOOK': '1'})) == [False, []]


_CHAINER_FIRST = _WARNINGS + '''
import chainer   # first, as in every Chainer script
import numpy as np
import chainer.functions as F
import chainer.links as L
import _mgpu_updater_hook as hook
shim = sys.modules.get('mgpu_updater._compat')
state = {'hook_left': hook.installed(), 'shim_loaded': shim is not None,
         'package_imported': 'mgpu_updater' in sys.modules,
         'still_needed': shim.needed() if shim else None}

# a small Chainer program: an update with StandardUpdater, and the as_strided backward
# that reads numpy.sctypes
model = L.Classifier(L.Linear(4, 3))
opt = chainer.optimizers.SGD(0.1)
opt.setup(model)
data = chainer.datasets.TupleDataset(np.random.RandomState(0).rand(8, 4).astype(np.float32),
                                     np.arange(8, dtype=np.int32) % 3)
it = chainer.iterators.SerialIterator(data, 4)
chainer.training.updaters.StandardUpdater(it, opt).update()
x = chainer.Variable(np.arange(6, dtype=np.float32))
F.sum(F.as_strided(x, (3,), (2,))).backward()
assert x.grad.tolist() == [1, 0, 1, 0, 1, 0]

import mgpu_updater   # afterwards: the same shim module, nothing left to do
state['same_shim'] = mgpu_updater._compat is shim
state['applied_again'] = mgpu_updater._compat.apply()
print(json.dumps(state))
'''


def test_a_script_that_imports_chainer_first_works(installed):
    state = json.loads(run(_CHAINER_FIRST))
    assert state == {'hook_left': False, 'shim_loaded': True, 'package_imported': False,
                     'still_needed': [], 'same_shim': True, 'applied_again': []}


def test_without_the_hook_chainer_first_fails_where_the_stack_needs_the_shim(
        installed, stack_needs_the_shim):
    if not stack_needs_the_shim:
        pytest.skip('this stack (Python 3.11, numpy 1.x, no CuPy >= 14) needs no patch')
    stderr = run(_CHAINER_FIRST, env={'MGPU_UPDATER_NO_IMPORT_HOOK': '1'}, expect_ok=False)
    assert ("No module named 'numpy.distutils'" in stderr or 'np.sctypes' in stderr
            or 'cuDNN is not enabled' in stderr), stderr


def test_a_shim_that_fails_says_so_and_how_to_go_without(installed, tmp_path):
    broken = tmp_path / 'mgpu_updater'
    broken.mkdir()
    (broken / '__init__.py').write_text('raise AssertionError("the package must not load")\n')
    (broken / '_compat.py').write_text('raise RuntimeError("shim exploded")\n')
    stderr = run('import chainer', env={'PYTHONPATH': str(tmp_path)}, expect_ok=False)
    assert ('ImportError: mgpu_updater could not apply its Chainer compat shim before '
            'importing Chainer (RuntimeError: shim exploded); set '
            'MGPU_UPDATER_NO_IMPORT_HOOK=1 to import Chainer without it') in stderr, stderr


def test_the_hook_leaves_other_imports_alone_and_goes_after_chainer(installed):
    out = run('''
        import json, sys
        import _mgpu_updater_hook as hook
        import json, email.parser   # anything else: the hook stays, does nothing
        before = hook.installed(), 'mgpu_updater._compat' in sys.modules
        import chainer.links        # a submodule first: the hook sees 'chainer' first
        print(json.dumps([before, hook.installed(), 'mgpu_updater._compat' in sys.modules]))
    ''', env={'PYTHONWARNINGS': 'ignore'})
    assert json.loads(out) == [[True, False], False, True]


# -- fresh virtual environments ---------------------------------------------------------------

def _project_copy(dest):
    """The files a build needs, copied (a build writes build/ and egg-info beside them)."""
    dest.mkdir()
    for name in ('pyproject.toml', 'setup.py', '_mgpu_updater_hook.py'):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / 'mgpu_updater', dest / 'mgpu_updater',
                    ignore=shutil.ignore_patterns('__pycache__'))
    return dest


def _can_build_wheels_here():
    import importlib.util
    import setuptools
    version = tuple(int(p) for p in setuptools.__version__.split('.')[:2])
    return version >= (70, 1) or importlib.util.find_spec('wheel') is not None


@pytest.mark.slow   # ~1 min: two virtual environments, two builds, workers spawned
@pytest.mark.parametrize('editable', [True, False], ids=['editable', 'regular'])
def test_fresh_venv_install_then_a_chainer_first_script_runs_the_updater(tmp_path, editable):
    if not _installed_here():
        pytest.skip('needs this environment installed (its Chainer and numpy are reused)')
    project = _project_copy(tmp_path / 'src')
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True,
                   timeout=120)
    python = venv / 'bin' / 'python'
    purelib = pathlib.Path(run('import sysconfig; print(sysconfig.get_paths()["purelib"])',
                               python=python))
    # Chainer, numpy and setuptools from this environment (a plain path line: .pth files
    # there, this environment's own hook included, are not run)
    (purelib / '_deps.pth').write_text(str(PURELIB) + '\n')
    # ... and setuptools' distutils-precedence.pth, which that environment runs at start-up
    for pth in PURELIB.glob('*.pth'):
        if not pth.name.startswith(('__editable__', 'mgpu_updater')):
            shutil.copy2(pth, purelib / pth.name)
    install = [sys.executable, '-m', 'pip', '--python', str(python), 'install', '-q',
               '--no-deps']
    if _can_build_wheels_here():   # offline, with this environment's setuptools
        install += ['--no-build-isolation', '--no-index']
    proc = subprocess.run(install + (['-e', str(project)] if editable else [str(project)]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (purelib / PTH_NAME).is_file()
    assert (purelib / '_mgpu_updater_hook.py').is_file() != editable

    script = tmp_path / 'train_chainer_first.py'
    script.write_text(_WARNINGS + textwrap.dedent('''
        import chainer   # the unmodified Chainer script's first line
        import chainer.links as L
        import numpy as np
        from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators


        def main():
            rng = np.random.RandomState(0)
            data = chainer.datasets.TupleDataset(rng.rand(32, 4).astype(np.float32),
                                                 rng.randint(0, 3, 32).astype(np.int32))
            model = L.Classifier(L.Linear(4, 3))
            opt = chainer.optimizers.SGD(0.1)
            opt.setup(model)
            its = shard_iterators(data, 2, 4)
            updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy', '@numpy'],
                                                  accumulate_steps=2)
            try:
                for _ in range(2):
                    updater.update()
            finally:
                updater.finalize()
            print(json.dumps([updater.iteration, float(model.predictor.W.array.sum())]))


        if __name__ == '__main__':
            main()
    '''))
    out = subprocess.run([str(python), str(script)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items()
                              if k not in ('PYTHONPATH', 'CHAINER_CUDNN')})
    assert out.returncode == 0, out.stdout + out.stderr
    iteration, _ = json.loads(out.stdout.strip().splitlines()[-1])
    assert iteration == 2

    # uninstalling takes the hook away with it
    proc = subprocess.run([sys.executable, '-m', 'pip', '--python', str(python), 'uninstall',
                           '-q', '-y', 'mgpu_updater'], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (purelib / PTH_NAME).exists()
    assert not (purelib / '_mgpu_updater_hook.py').exists()

"""README's first Install block, run verbatim in a fresh virtual environment.

Each case copies the working tree (what git tracks, plus untracked files it does not
ignore) into a temporary folder, puts the chosen interpreter first on PATH as ``python3``
and runs the block with ``bash -e`` there, with no pip cache: Chainer's sdist is built for
real, as on a user's machine. Each takes 1-3 minutes (numpy and Chainer are downloaded), so
they are marked slow; `make test-install` and CI run them.

The Python versions come from pyenv (``pyenv root``) or ``pythonX.Y`` on PATH; a version
that is not installed is skipped, saying so. The last case upgrades pip to the newest
release before the block runs (the block's ``python3 -m venv .venv`` keeps it), because
pip 26.2 changed which variable reaches Chainer's isolated build.
"""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
# Never copied: environments and build output (when git cannot list the tree).
IGNORE = shutil.ignore_patterns('.git', '.venv*', 'build', 'dist', '*.egg-info', '__pycache__',
                                '.pytest_cache', 'result', 'results-*', '.whl', '_build')


def install_block():
    """The first ```bash block of README's "## Install" section."""
    text = README.read_text()
    section = re.search(r'^## Install\n(.*?)(?=^## |\Z)', text, re.S | re.M)
    assert section, 'README.md has no "## Install" section'
    block = re.search(r'^```bash\n(.*?)^```', section.group(1), re.S | re.M)
    assert block, 'README\'s Install section has no ```bash block'
    return block.group(1)


def find_python(version):
    """The newest pyenv build of ``version`` (pyenv's shims refuse unselected versions),
    else ``pythonX.Y`` on PATH, else None."""
    try:
        root = subprocess.run(['pyenv', 'root'], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        root = None
    if root:
        builds = sorted(pathlib.Path(root, 'versions').glob(f'{version}.*/bin/python3'),
                        key=lambda p: [int(x) for x in p.parent.parent.name.split('.')
                                       if x.isdigit()])
        if builds:
            return str(builds[-1])
    return shutil.which(f'python{version}')


def copy_tree(dest):
    """The working tree as a user's clone would have it."""
    try:
        listed = subprocess.run(
            ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
            cwd=ROOT, capture_output=True, check=True).stdout.decode().split('\0')
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, ignore=IGNORE)
        return
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def clean_env(bin_dir):
    """The caller's environment (pip's index and certificates stay as configured) without
    what would decide the outcome for the block: an active venv, Python paths, constraints
    or build settings of pip's."""
    drop = ('VIRTUAL_ENV', 'PYTHONPATH', 'PYTHONHOME', 'PIP_CONSTRAINT', 'PIP_BUILD_CONSTRAINT',
            'PIP_NO_BUILD_ISOLATION', 'PIP_REQUIRE_VIRTUALENV', 'PIP_USER', 'PIP_TARGET',
            'PIP_PREFIX')
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', PIP_NO_CACHE_DIR='1')
    return env


def test_the_install_block_is_plain_commands():
    """What the slow cases run: a venv, the install, the check; no make, no sudo."""
    block = install_block()
    assert 'python3 -m venv .venv' in block
    assert 'pip install .' in block
    assert 'import chainer, mgpu_updater' in block
    assert not re.search(r'\b(make|sudo)\b', block), block


# (Python, pip, where the venv is: README's .venv in the clone, or one elsewhere, as a
# user's own environment is)
CASES = [('3.11', 'bundled', 'clone'), ('3.12', 'bundled', 'clone'),
         ('3.13', 'bundled', 'clone'), ('3.13', 'newest', 'clone'),
         ('3.13', 'bundled', 'elsewhere')]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize('version,pip,where', CASES,
                         ids=[f'py{v}-{p}-pip' + ('' if w == 'clone' else f'-venv-{w}')
                              for v, p, w in CASES])
def test_readme_install_block_in_a_fresh_venv(tmp_path, version, pip, where):
    python = find_python(version)
    if python is None:
        pytest.skip(f'Python {version} is not installed (neither pyenv nor python{version})')
    tree = tmp_path / 'mgpu_updater'
    copy_tree(tree)
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'python3').symlink_to(python)
    env = clean_env(bin_dir)
    if pip == 'newest':
        subprocess.run([python, '-m', 'venv', '.venv'], cwd=tree, check=True, env=env)
        subprocess.run(['.venv/bin/python', '-m', 'pip', 'install', '-q', '--upgrade', 'pip'],
                       cwd=tree, check=True, env=env)
    block = install_block()
    if where == 'elsewhere':
        assert block.count('.venv') == 2, block   # made, then activated
        block = block.replace('.venv', '../venv')
    script = tmp_path / 'install.sh'
    script.write_text(block)
    proc = subprocess.run(['bash', '-e', str(script)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=1100)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert re.search(r'^mgpu_updater \S+ on Chainer 7\.8\.1$', proc.stdout, re.M), output[-3000:]
    assert 'pkg_resources is deprecated' not in proc.stderr, output[-3000:]   # the check is quiet
    # ... of any Python warning (pip's own say 'WARNING:'): pkg_resources' about a build's
    # egg-info in the tree the check runs in, with the venv elsewhere, was one
    assert not re.search(r'\w+Warning: ', proc.stderr), output[-3000:]

    # What the constraints and dependencies promise: numpy 2.x (CuPy 14 needs it); setuptools
    # with pkg_resources and without its UserWarning (< 80.9; < 74 on 3.11, for
    # numpy.distutils).
    venv_python = (tree / '.venv' if where == 'clone' else tmp_path / 'venv') / 'bin' / 'python'
    probe = subprocess.run(
        [str(venv_python), '-c', 'import sys, numpy, setuptools, pip; '
         'print(sys.version_info[0], sys.version_info[1], numpy.__version__, '
         'setuptools.__version__, pip.__version__)'],
        capture_output=True, text=True, env=env, check=True).stdout.split()
    major, minor, numpy_version, setuptools_version, pip_version = probe
    assert f'{major}.{minor}' == version
    numpy_major = int(numpy_version.split('.')[0])
    setuptools_release = tuple(int(p) for p in setuptools_version.split('.')[:2])
    assert numpy_major == 2, probe
    assert setuptools_release < ((74, 0) if version == '3.11' else (80, 9)), probe
    if pip == 'newest':
        assert int(pip_version.split('.')[0]) >= 26, probe

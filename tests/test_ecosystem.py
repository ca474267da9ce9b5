"""Code nobody here wrote: training scripts from Chainer's examples, each run with only its
updater statement changed, on two CPU replicas, for a few updates (issue 37, item 3).

The scripts are in ``tests/ecosystem/`` (what each is, where it comes from, what runs and
what does not, and why: ``tests/ecosystem/README.md``). Each is a fresh interpreter running
the script as ``__main__`` in a directory of its own, where the data it would download is
written synthetic, in the format it reads (``tests/ecosystem/synthetic.py``). A run must
exit 0 after the number of updates its data makes, leave the files its extensions write,
and leave no process behind; the scripts that are not drop-in must fail as the README's
table says, fast.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest

from test_chainer_style import Run, _group_members

ECOSYSTEM = Path(__file__).resolve().parent / 'ecosystem'
sys.path.insert(0, str(ECOSYSTEM))
import synthetic  # noqa: E402

TIMEOUT = 240.0           # seconds for one run, every process included
FAIL_FAST = 60.0          # the scripts that must fail, fail within this


def run(script: str, args: Tuple[str, ...], cwd: Path, env: Dict[str, str],
        timeout: float = TIMEOUT) -> Run:
    """``python tests/ecosystem/<script> args`` in ``cwd``, in a process group of its own
    that is killed on timeout; output goes to files, so that nothing left holding a pipe
    can block."""
    argv = [sys.executable, str(ECOSYSTEM / script), *args]
    env = dict(os.environ, MPLBACKEND='Agg', PYTHONUNBUFFERED='1', **env)
    with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=str(cwd), env=env,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        seconds = time.monotonic() - start
        deadline = time.monotonic() + 5.0       # a moment for exits already under way
        leftover = _group_members(proc.pid)
        while leftover and time.monotonic() < deadline:
            time.sleep(0.1)
            leftover = _group_members(proc.pid)
        if leftover:
            os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        return Run(argv[1:], proc.returncode, out.read(), err.read(), seconds, timed_out,
                   leftover)


def _mnist(cwd: Path) -> Dict[str, str]:
    synthetic.mnist(cwd / 'datasets')
    return {'CHAINER_DATASET_ROOT': str(cwd / 'datasets')}


def _nltk(cwd: Path) -> Dict[str, str]:
    path = [str(ECOSYSTEM / 'stand_ins'), os.environ.get('PYTHONPATH', '')]
    return {'PYTHONPATH': os.pathsep.join(p for p in path if p)}


def _files(writer: Callable[[Path], None]) -> Callable[[Path], Dict[str, str]]:
    def prepare(cwd: Path) -> Dict[str, str]:
        writer(cwd)
        return {}
    return prepare


@dataclasses.dataclass(frozen=True)
class Example:
    key: str
    script: str
    args: Tuple[str, ...]
    prepare: Callable[[Path], Dict[str, str]]   # writes the data, returns env entries
    iterations: Tuple[int, ...]                  # the log's iterations, in order
    outputs: Tuple[str, ...] = ()                # files the extensions write in result/


RUNS = [
    # 3400 synthetic sentences: 3060 for training, 15 a replica an update: 102 updates;
    # LogReport writes at 100.
    Example('pos_crf_six_moves', 'pos/postagging.py', ('--epoch', '1'), _nltk, (100,)),
    # 32 trees, 4 a replica an update: 4 updates an epoch, evaluated and logged each epoch.
    Example('sentiment_recursive_sum_loss', 'sentiment/train_sentiment.py',
            ('--epoch', '2', '--epocheval', '1', '--batchsize', '8'),
            _files(synthetic.sentiment_trees), (4, 8), ('snapshot_epoch_2',)),
    # --test keeps 100 samples: 2 replicas x 2 micro-batches of 5: 5 updates an epoch.
    Example('vae_closure_six_moves_range', 'vae/train_vae.py',
            ('--epoch', '2', '--batchsize', '20', '--test'), _mnist, (5, 10),
            ('cg.dot', 'snapshot_iter_10', 'train_reconstructed.png', 'sampled.png')),
    # 8 images, 2 a replica an update; --test logs, evaluates and snapshots every update.
    Example('imagenet_nin_multiprocess_iterator', 'imagenet/train_imagenet.py',
            ('train.txt', 'val.txt', '--arch', 'nin', '--batchsize', '4',
             '--val_batchsize', '2', '--epoch', '1', '--loaderjob', '1', '--test',
             '--device', '@numpy'),
            _files(synthetic.imagenet), (1, 2), ('cg.dot', 'snapshot_iter_2', 'model_iter_2')),
    # 200 synthetic digits, 10 a replica an update: 10 updates an epoch, logged each epoch.
    Example('static_graph_lazy_links', 'static_graph_mnist/train_mnist.py',
            ('--epoch', '2', '--batchsize', '20', '--unit', '50'), _mnist, (10, 20)),
]


def _log(cwd: Path) -> List[dict]:
    path = cwd / 'result' / 'log'
    return json.loads(path.read_text()) if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize('example', RUNS, ids=[e.key for e in RUNS])
def test_runs_with_only_the_updater_changed(example, tmp_path):
    result = run(example.script, example.args, tmp_path, example.prepare(tmp_path))
    result.check()
    log = _log(tmp_path)
    assert [entry['iteration'] for entry in log] == list(example.iterations), \
        result.describe()
    for entry in log:
        assert math.isfinite(entry['main/loss']), entry
        assert entry['main/time/comm'] > 0, entry     # the workers took part
    for name in example.outputs:
        assert (tmp_path / 'result' / name).exists(), (name, result.describe())


@pytest.mark.slow
def test_glance_without_a_main_guard_fails_fast_saying_so(tmp_path):
    """Chainer's "at a glance" example trains at module level: every spawned worker
    imports it again. The first update stops with a WorkerError that names the fix."""
    synthetic.mushrooms(tmp_path)
    result = run('glance/glance.py', (), tmp_path, {}, timeout=FAIL_FAST)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert result.seconds < FAIL_FAST / 2, result.describe()
    assert result.leftover == [], result.describe()
    assert re.search(r"WorkerError: replica 1 on device '@numpy': the worker process "
                     r"\(pid \d+\) re-ran the training code while importing .*glance\.py"
                     r".* the script needs `if __name__ == '__main__':`", result.stderr), \
        result.describe()


SCRIPTS = sorted(p.relative_to(ECOSYSTEM).as_posix() for p in ECOSYSTEM.glob('*/*.py')
                 if not p.parent.name == 'stand_ins')
MAIN_SCRIPTS = ['glance/glance.py', 'imagenet/train_imagenet.py', 'pos/postagging.py',
                'sentiment/train_sentiment.py', 'static_graph_mnist/train_mnist.py',
                'vae/train_vae.py']


@pytest.mark.parametrize('script', SCRIPTS)
def test_each_file_credits_its_source(script):
    """Every file names the example file it comes from, the commit, the license; the
    helpers are unchanged, the scripts say what changed."""
    text = (ECOSYSTEM / script).read_text()
    head = text[:1500]
    assert re.search(r'From Chainer\'s examples: examples/\S+ of\s+(# )?'
                     r'https://github\.com/chainer/chainer', head), head
    assert re.search(r'commit\s+(# )?[0-9a-f]{40}', head), head
    assert 'MIT License, see tests/ecosystem/LICENSE.chainer' in head
    if script in MAIN_SCRIPTS:
        assert 'Changed, and nothing else: the updater statement' in head
    else:
        assert 'unchanged' in head


@pytest.mark.parametrize('script', MAIN_SCRIPTS)
def test_only_the_updater_statement_changed(script):
    """Two marked changes, the import and the updater statement; Chainer's updater is gone
    from the code (it is only quoted in the header)."""
    lines = (ECOSYSTEM / script).read_text().splitlines()
    code = [line for line in lines if not line.lstrip().startswith('#')]
    assert [line for line in code if 'CHANGED' in line] == [
        next(line for line in code if line.startswith('import mgpu_updater')),
        next(line for line in code if 'mgpu_updater.ParallelAccumulatingUpdater(' in line)]
    assert not any('StandardUpdater(' in line for line in code)
    assert (ECOSYSTEM / 'LICENSE.chainer').read_text().startswith(
        'Copyright (c) 2015 Preferred Infrastructure, Inc.')

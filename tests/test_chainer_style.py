"""Drop-in for real Chainer scripts: scripts written as Chainer 7.8.1's examples are run
unchanged but for the updater construction (issue 10).

Each script in ``chainer_style/`` is a standalone program in the style of Chainer's
examples (argparse, ``main()`` under ``if __name__ == '__main__':``, ``import chainer``
before ``mgpu_updater``, a Trainer with Evaluator, DumpGraph, snapshot, LogReport,
PlotReport, PrintReport and ProgressBar, ``--resume``). ``--updater ours`` builds
``ParallelAccumulatingUpdater`` on ``['@numpy', '@numpy']`` with ``accumulate_steps=2``;
``--updater standard`` (or ``parallel``) builds the Chainer updater the script came from,
on one batch holding the samples of one of our updates.

Every run is a fresh interpreter running the script as ``__main__`` (workers start with
``spawn`` and import it again), under a hard timeout that kills its whole process group,
so a hang fails instead of stalling the suite; no process of the group may outlive it.
Each script trains, then a second process resumes from its snapshot; where the script is
deterministic, the resumed run's parameters and log equal the reference updater's
uninterrupted run.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent / 'chainer_style'
RUN_TIMEOUT = 150.0       # seconds for one script run, every process included
NO_GUARD_TIMEOUT = 60.0   # hard limit for the script that must fail fast
NO_GUARD_LIMIT = 30.0     # ... and how fast it must fail
RTOL, ATOL = 1e-4, 1e-5   # float32, 8-16 updates, summation order differs


# ------------------------------------------------------------------ running a script
@dataclasses.dataclass
class Run:
    """One finished (or killed) run of a script."""
    argv: List[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    leftover: List[str]     # processes of its group still alive after it exited

    def describe(self) -> str:
        return (f'{" ".join(self.argv)}\nexit status {self.returncode} after '
                f'{self.seconds:.1f} s{" (killed: timeout)" if self.timed_out else ""}\n'
                f'--- stdout (tail) ---\n{self.stdout[-2000:]}\n'
                f'--- stderr (tail) ---\n{self.stderr[-4000:]}')

    def check(self) -> None:
        """The run exited 0 and left no process behind."""
        assert not self.timed_out and self.returncode == 0, self.describe()
        assert self.leftover == [], (f'processes left behind: {self.leftover}\n'
                                     + self.describe())
        # Chainer's example patterns change nothing between updates that the workers miss
        # (mgpu_updater._unsent_state); a warning here would be one users see for nothing
        assert 'worker processes do not receive them' not in self.stderr, self.describe()


def _group_members(pgid: int) -> List[str]:
    """'pid command' of every live process in process group ``pgid``."""
    members = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / 'stat').read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(')') + 2:].split()
        if fields[0] != 'Z' and int(fields[2]) == pgid:
            members.append(f'{entry.name} {stat[stat.index("(") + 1:stat.rindex(")")]}')
    return members


def run_script(script: str, *args: str, timeout: float = RUN_TIMEOUT) -> Run:
    """Run ``chainer_style/<script> args`` in a fresh process group; kill the group on
    timeout. Output goes to files, so a process left holding the pipes cannot block."""
    argv = [sys.executable, str(SCRIPTS / script), *args]
    env = dict(os.environ, MPLBACKEND='Agg', PYTHONUNBUFFERED='1')
    with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=str(SCRIPTS.parent),
                                env=env, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        seconds = time.monotonic() - start
        leftover = _group_members(proc.pid)
        deadline = time.monotonic() + 5.0      # a moment for exits already under way
        while leftover and time.monotonic() < deadline:
            time.sleep(0.1)
            leftover = _group_members(proc.pid)
        if leftover:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        return Run(argv[1:], proc.returncode, out.read(), err.read(), seconds, timed_out,
                   leftover)


# ------------------------------------------------------------------ the scripts
@dataclasses.dataclass(frozen=True)
class Script:
    key: str
    file: str
    args: Tuple[str, ...]
    functions: Tuple[str, ...]      # function nodes DumpGraph must show
    micro_batch_label: str          # a variable of one micro-batch in that graph
    updates_per_epoch: int
    reference: Optional[str]        # --updater of the equal Chainer run; None: not equal
    compared: Tuple[str, ...]       # log keys equal to the reference's


SCRIPT_SPECS = [
    Script('mnist', 'train_mnist.py', (),
           ('LinearFunction', 'ReLU', 'SoftmaxCrossEntropy'), '(8, 784), float32', 8,
           'standard', ('main/loss', 'main/accuracy', 'validation/main/loss',
                        'validation/main/accuracy')),
    Script('mnist_multiprocess', 'train_mnist_multiprocess.py', (),
           ('LinearFunction', 'ReLU', 'SoftmaxCrossEntropy'), '(8, 784), float32', 8,
           'standard', ('main/loss', 'main/accuracy', 'validation/main/loss', 'lr')),
    Script('mnist_parallel_updater', 'train_mnist_data_parallel.py', (),
           ('LinearFunction', 'ReLU', 'SoftmaxCrossEntropy'), '(8, 784), float32', 8,
           # ParallelUpdater logs the main device's half-batch as main/loss
           'parallel', ('validation/main/loss', 'validation/main/accuracy')),
    Script('vae_model_as_loss_func', 'train_vae.py', ('--loss', 'model', '--no-sample'),
           ('LinearFunction', 'Tanh', 'Softplus'), '(8, 16), float32', 4,
           'standard', ('main/loss', 'main/reconstr', 'main/kl_penalty',
                        'validation/main/loss')),
    Script('vae_closure_loss_func', 'train_vae.py', ('--loss', 'closure', '--no-sample'),
           ('LinearFunction', 'Tanh', 'Softplus'), '(8, 16), float32', 4,
           'standard', ('main/loss', 'main/rec_loss', 'validation/main/loss',
                        'validation/main/rec_loss')),
    Script('text_classifier', 'train_text_classifier.py', (),
           ('EmbedIDFunction', 'LSTM', 'SoftmaxCrossEntropy'), '(4, 2), float32', 4,
           'standard', ('main/loss', 'main/accuracy', 'validation/main/loss')),
    Script('word2vec_sum_loss', 'train_word2vec.py', (),
           ('EmbedIDFunction', 'BinaryHierarchicalSoftmaxFunction'), '(8, 4, 8), float32',
           4, 'standard', ('main/loss', 'validation/main/loss')),
    Script('transform_lambda_main', 'train_transform.py', (),
           ('Convolution2DFunction', 'LeakyReLU', 'MaxPoolingND'), '(8, 10), float32', 4,
           'standard', ('main/loss', 'main/accuracy', 'validation/main/loss')),
    # BatchNorm normalises each micro-batch: not equal to one large batch by design.
    Script('cifar_batchnorm', 'train_cifar.py', (),
           ('Convolution2DFunction', 'BatchNormalization', 'ReLU'), '(8, 16), float32', 4,
           None, ()),
]
SPECS = {spec.key: spec for spec in SCRIPT_SPECS}
# In `make test`: DumpGraph, scripts importing chainer first, classes, a decorated converter
# and an iterator defined in __main__, the model as loss_func, a summed loss (issue 10's
# items 1, 2, 4, 6, 7; the main guard, item 5, below). The rest is marked slow: about 15 s
# a script on 2 cores.
FAST = ('mnist', 'vae_model_as_loss_func', 'word2vec_sum_loss')


def _param(key):
    return pytest.param(SPECS[key], id=key,
                        marks=() if key in FAST else pytest.mark.slow)


ALL = [_param(spec.key) for spec in SCRIPT_SPECS]
COMPARED = [_param(spec.key) for spec in SCRIPT_SPECS if spec.reference]


# What the first run's extensions wrote is kept apart, so that the resumed run must write
# its own plot.
FIRST_RUN_SUFFIX = '.first-run'
PER_RUN_OUTPUTS = ('cg.dot', 'loss.png')


@dataclasses.dataclass
class Trained:
    out: Path
    first: Run                  # --epoch 1
    resumed: Optional[Run]      # --epoch 2 --resume out/snapshot_epoch_1 (if first ran)
    first_log: Optional[list]   # the log as the first run left it


def train_and_resume(spec: Script, out: Path) -> Trained:
    first = run_script(spec.file, *spec.args, '--updater', 'ours', '--epoch', '1',
                       '--out', str(out))
    first_log = _read_log(out)
    for name in PER_RUN_OUTPUTS:
        if (out / name).exists():
            (out / name).rename(out / (name + FIRST_RUN_SUFFIX))
    resumed = None
    if first.returncode == 0:
        resumed = run_script(spec.file, *spec.args, '--updater', 'ours', '--epoch', '2',
                             '--resume', str(out / 'snapshot_epoch_1'), '--out', str(out))
    return Trained(out, first, resumed, first_log)


@dataclasses.dataclass
class Reference:
    out: Path
    run: Run                    # --updater <the Chainer updater> --epoch 2


def train_reference(spec: Script, out: Path) -> Reference:
    return Reference(out, run_script(spec.file, *spec.args, '--updater', spec.reference,
                                     '--epoch', '2', '--out', str(out)))


def _npz(path: Path) -> Dict[str, np.ndarray]:
    with np.load(path) as arrays:
        return dict(arrays)


def _read_log(out: Path) -> Optional[list]:
    path = out / 'log'
    return json.loads(path.read_text()) if path.exists() else None


class Runs:
    """Script runs, started in the background as soon as the module asks (they are
    mostly process start-up), each computed once for every test that reads it."""

    def __init__(self, base: Path, width: int) -> None:
        self.base = base
        self.pool = concurrent.futures.ThreadPoolExecutor(width)
        self.futures: Dict[Tuple[str, str], concurrent.futures.Future] = {}

    def submit(self, kind: str, key: str) -> concurrent.futures.Future:
        if (kind, key) not in self.futures:
            spec = SPECS[key]
            out = self.base / f'{key}-{kind}'
            fn = train_and_resume if kind == 'ours' else train_reference
            self.futures[kind, key] = self.pool.submit(fn, spec, out)
        return self.futures[kind, key]

    def ours(self, spec: Script) -> Trained:
        return self.submit('ours', spec.key).result()

    def reference(self, spec: Script) -> Reference:
        return self.submit('reference', spec.key).result()


@pytest.fixture(scope='module')
def runs(request, tmp_path_factory):
    runner = Runs(tmp_path_factory.mktemp('chainer_style'), width=3)
    this = request.module.__name__
    for item in request.session.items:   # start what the selected tests will read
        if item.module.__name__ != this or not hasattr(item, 'callspec'):
            continue
        spec = item.callspec.params.get('spec')
        if spec is not None:
            runner.submit('ours', spec.key)
            if (item.originalname == 'test_script_equals_its_reference_updater'
                    and spec.reference):
                runner.submit('reference', spec.key)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ checks
def assert_outputs(spec: Script, out: Path, run: Run, suffix: str = '',
                   graph: bool = True) -> None:
    """What the Trainer's extensions leave behind, as under StandardUpdater."""
    if graph:
        dot = (out / ('cg.dot' + suffix)).read_text()
        for name in spec.functions:
            assert f'label="{name}"' in dot, f'{name} not in the dumped graph'
        # the graph is that of one micro-batch computed on the master
        assert f'label="{spec.micro_batch_label}"' in dot, dot[:2000]
    png = (out / ('loss.png' + suffix)).read_bytes()
    assert png.startswith(b'\x89PNG'), 'PlotReport wrote no PNG'
    assert 'main/loss' in run.stdout and 'validation/main/loss' in run.stdout  # PrintReport
    assert 'iters/sec' in run.stdout                                           # ProgressBar


@pytest.mark.parametrize('spec', ALL)
def test_script_trains_with_the_usual_extensions_and_resumes(spec, runs):
    trained = runs.ours(spec)
    trained.first.check()
    out = trained.out
    n = spec.updates_per_epoch
    assert [(e['epoch'], e['iteration']) for e in trained.first_log] == [(1, n)]
    for key in ('main/loss', 'validation/main/loss'):
        assert np.isfinite(trained.first_log[0][key]), key
    assert (out / 'snapshot_epoch_1').exists()
    assert_outputs(spec, out, trained.first, suffix=FIRST_RUN_SUFFIX)

    trained.resumed.check()
    assert f'# resumed at iteration {n}' in trained.resumed.stdout
    log = _read_log(out)
    assert [(e['epoch'], e['iteration']) for e in log] == [(1, n), (2, 2 * n)]
    assert log[0] == trained.first_log[0]     # the first epoch came back from the snapshot
    assert (out / 'snapshot_epoch_2').exists()
    # DumpGraph saves that it has dumped: a resumed run does not dump again (Chainer 7.8.1)
    assert_outputs(spec, out, trained.resumed, graph=False)


@pytest.mark.parametrize('spec', COMPARED)
def test_script_equals_its_reference_updater(spec, runs):
    """Train 1 epoch, resume for a 2nd: same parameters and log as the reference
    Chainer updater's uninterrupted 2 epochs on the same samples."""
    trained = runs.ours(spec)
    reference = runs.reference(spec)
    reference.run.check()
    trained.first.check()
    trained.resumed.check()
    ours_params = _npz(trained.out / 'model_final.npz')
    ref_params = _npz(reference.out / 'model_final.npz')
    assert sorted(ours_params) == sorted(ref_params)
    for name in ref_params:
        np.testing.assert_allclose(ours_params[name], ref_params[name], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
    ours_log, ref_log = _read_log(trained.out), _read_log(reference.out)
    assert len(ours_log) == len(ref_log) == 2
    for ours_entry, ref_entry in zip(ours_log, ref_log):
        for key in spec.compared:
            np.testing.assert_allclose(ours_entry[key], ref_entry[key], rtol=RTOL,
                                       err_msg=f'{key} at epoch {ref_entry["epoch"]}')


@pytest.mark.slow
def test_cifar_learning_rate_schedule_and_batchnorm_statistics_survive_resume(runs):
    spec = SPECS['cifar_batchnorm']
    trained = runs.ours(spec)
    trained.first.check()
    trained.resumed.check()
    log = _read_log(trained.out)
    # ExponentialShift halved lr after epoch 1; observe_lr logs the lr in use
    assert [e['lr'] for e in log] == [0.05, 0.025]
    mean = _npz(trained.out / 'model_final.npz')['predictor/block1_1/bn/avg_mean']
    assert np.all(np.isfinite(mean)) and np.any(mean != 0)   # running statistics moved


def test_script_without_main_guard_fails_fast_saying_why(tmp_path):
    """Spawned workers import the main module again; without the guard the script must
    fail within seconds with a WorkerError that names the fix, not hang."""
    run = run_script('train_no_guard.py', '--out', str(tmp_path), timeout=NO_GUARD_TIMEOUT)
    assert not run.timed_out, 'the script hung:\n' + run.describe()
    assert run.returncode != 0, run.describe()
    assert run.seconds < NO_GUARD_LIMIT, run.describe()
    # the master's own error (the last one it raised), naming the fix; Python's message in
    # the child shows the idiom too, so that one does not count
    raised = [m.start() for m in re.finditer(r'^\S*WorkerError: ', run.stderr, re.MULTILINE)]
    assert raised, run.describe()
    assert "__name__ == '__main__'" in run.stderr[raised[-1]:], run.describe()
    assert run.leftover == [], run.describe()


@pytest.mark.slow
def test_multiprocess_iterator_script_never_hangs_at_start(tmp_path):
    """MultiprocessIterator forks its loader pool at its first batch. With prefetch that
    happens in a background thread, possibly while the main thread is inside a BLAS call,
    which then never returns (OpenBLAS stops its threads around fork). Seen in about one
    run in three on 2 cores; a few runs make a hang very likely to show."""
    for attempt in range(4):
        run = run_script('train_mnist_multiprocess.py', '--updater', 'ours', '--epoch', '1',
                         '--out', str(tmp_path / str(attempt)), timeout=90)
        assert not run.timed_out, f'run {attempt + 1} hung:\n' + run.describe()
        run.check()

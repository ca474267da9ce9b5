"""A script without ``if __name__ == '__main__':`` gets a WorkerError that says so, fast.

Every worker process imports the main module again (``spawn``, ``forkserver``), so such
a script trains again in each worker. Python used to write the whole payload (model and
data shard) as the worker's start-up argument into a pipe nobody would read once the
worker died, and the master hung for good above the pipe's 64 KiB. The payload now goes
over the worker's own pipe after the worker said hello (``mgpu_updater._local.pool``).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'tests' / 'scripts' / 'no_guard.py'
HARD_TIMEOUT = 90.0   # the old code hung here for good: fail instead of stalling


def run_script(n_samples, start_method='spawn'):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), str(n_samples), start_method],
                              capture_output=True, text=True, timeout=HARD_TIMEOUT,
                              env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        pytest.fail(f'the master hung: no error within {HARD_TIMEOUT:.0f} s')
    return proc


@pytest.mark.parametrize('n_samples, min_bytes', [(4, 0), (2000, 1 << 20)])
def test_no_main_guard_raises(n_samples, min_bytes):
    """Small payload and one of 2 MB (30 times the pipe buffer)."""
    proc = run_script(n_samples)
    out = proc.stdout
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert int(re.search(r'PAYLOAD_BYTES (\d+)', out).group(1)) >= min_bytes
    error = re.search(r'^ERROR (.*)$', out, re.M).group(1)
    assert re.match(r"replica 1 on device '@numpy': the worker process \(pid \d+\) re-ran "
                    r"the training code while importing '.*no_guard\.py' and stopped: the "
                    r"script needs `if __name__ == '__main__':` around the code that builds "
                    r'and runs the updater', error), error
    # from update() to the error: the worker's start-up and its own import of the script
    assert float(re.search(r'SECONDS_TO_ERROR ([\d.]+)', out).group(1)) < 30.0
    # the worker said why on its stderr too
    assert "re-ran the training code while importing '" in proc.stderr
    assert 'NO ERROR' not in out


@pytest.mark.slow
def test_no_main_guard_forkserver():
    """Under forkserver the fork server imports the script and dies; the error says why."""
    proc = run_script(2000, 'forkserver')
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = re.search(r'^ERROR (.*)$', proc.stdout, re.M).group(1)
    assert "the script needs `if __name__ == '__main__':`" in error
    assert "(start method 'forkserver')" in error


GUARDED_FROM_STDIN = '''
import numpy, chainer, chainer.links as L
from mgpu_updater import ParallelAccumulatingUpdater, WorkerError, shard_iterators

if __name__ == '__main__':
    data = chainer.datasets.TupleDataset(numpy.zeros((8, 4), numpy.float32),
                                         numpy.zeros(8, numpy.int32))
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(L.Classifier(L.Linear(4, 3)))
    try:
        ParallelAccumulatingUpdater(shard_iterators(data, 2, 4), optimizer,
                                    devices=['@numpy', '@numpy']).update()
    except WorkerError as exc:
        print('ERROR', str(exc).replace(chr(10), ' '))
'''


def test_a_script_read_from_stdin_is_told_to_be_a_file():
    """``python - < script.py``: the script has its guard, but a spawned worker cannot
    import a main module that has no file; the error says that, not to add a guard."""
    proc = subprocess.run([sys.executable, '-'], input=GUARDED_FROM_STDIN, capture_output=True,
                          text=True, timeout=HARD_TIMEOUT, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    error = re.search(r'^ERROR (.*)$', proc.stdout, re.M)
    assert error, proc.stderr[-3000:]
    assert "the main module has no file to import ('<stdin>'" in error.group(1)
    assert 'Save the script to a file' in error.group(1)
    assert '__main__' not in error.group(1)


def test_a_script_deleted_after_it_started_is_told_so(tmp_path):
    """Its file removed before the first update (a notebook's export, an editor's save
    that replaces the file, a cleanup): the error says the file is gone, not that the
    script reads from standard input or lacks its guard."""
    script = tmp_path / 'train_once.py'
    script.write_text(GUARDED_FROM_STDIN.replace(
        "if __name__ == '__main__':", "if __name__ == '__main__':\n    os.remove(__file__)"
    ).replace('import numpy,', 'import os, numpy,'))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=HARD_TIMEOUT, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    error = re.search(r'^ERROR (.*)$', proc.stdout, re.M)
    assert error, proc.stderr[-3000:]
    assert (f"the main module's file ('{script}') is gone: deleted or renamed since the "
            'script started') in error.group(1)
    assert 'Leave the script where it is' in error.group(1)
    assert '__main__' not in error.group(1)

"""A worker whose master died unlinks the master's segments once, however many paths ask.

Two threads of a worker notice the master's death (the watch thread and the main loop's
exit) and both clean up; the second cleanup must not unregister the names from the
resource tracker again, which then prints a KeyError traceback for each name. And a
master whose start fails after its segments are made and before its workers run removes
them at once.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import chainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import os, threading
    from multiprocessing import shared_memory
    from mgpu_updater.comm.shm import unlink_quietly
    seg = shared_memory.SharedMemory(create=True, size=64)   # registered with the tracker
    name = seg.name
    seg.close()
    threads = [threading.Thread(target=unlink_quietly, args=(name,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    unlink_quietly(name)
    print('GONE', not os.path.exists('/dev/shm/' + name.lstrip('/')))
''')


def test_unlinking_a_segment_twice_does_not_upset_the_resource_tracker():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert 'GONE True' in proc.stdout
    assert 'resource_tracker' not in proc.stderr and 'KeyError' not in proc.stderr, proc.stderr


def _segments():
    return {name for name in os.listdir('/dev/shm') if name.startswith('mgpu_')}


def _no_temporary_directory(*args, **kwargs):
    raise FileNotFoundError(2, 'No usable temporary directory found')


def _no_memory(*args, **kwargs):
    raise MemoryError('no room for the board')


@pytest.mark.parametrize('where, failure', [
    ('mgpu_updater._local.stall.tempfile.mkdtemp', _no_temporary_directory),
    ('mgpu_updater._local.group.SlotParams.__init__', _no_memory)])
def test_a_start_that_fails_before_the_workers_leaves_no_segment(monkeypatch, where,
                                                                 failure):
    """The master's shared memory is made before its workers start; a failure in between
    (no usable temporary directory for the stack files, memory) left the segments until
    the process exited, where the resource tracker warned of leaked objects: a notebook
    kept them."""
    from mgpu_updater import ParallelAccumulatingUpdater
    from _models import classifier, dataset, setup_optimizer
    before = _segments()
    monkeypatch.setattr(where, failure)
    model = classifier()
    its = [chainer.iterators.SerialIterator(dataset(8, seed=r), 2) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        with pytest.raises((FileNotFoundError, MemoryError)):
            updater.update()
        assert _segments() - before == set()
    finally:
        updater.finalize()
    assert updater.worker_pids() == []


FORKSERVER_SCRIPT = r'''
import os
from multiprocessing import shared_memory
import chainer
from mgpu_updater import ParallelAccumulatingUpdater
from _models import classifier, dataset, setup_optimizer
made = []
_init = shared_memory.SharedMemory.__init__
def _recording(self, name=None, create=False, size=0, **kwargs):
    _init(self, name, create, size, **kwargs)
    if create:
        made.append(self.name)
shared_memory.SharedMemory.__init__ = _recording
if __name__ == '__main__':
    model = classifier()
    its = [chainer.iterators.SerialIterator(dataset(8, seed=r), 2) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, start_method='forkserver')
    try:
        updater.update()
    except OSError as exc:
        print('ERROR', exc)
    finally:
        updater.finalize()
    print('PIDS', updater.worker_pids())
    print('MADE', len(made), 'LEFT', [n for n in made if os.path.exists('/dev/shm/' + n)])
'''


def test_forkserver_under_a_temporary_directory_too_long_for_a_socket_says_so(tmp_path):
    """Python's forkserver listens on a socket under the temporary directory, whose path
    may have 107 characters; past that Python says only 'AF_UNIX path too long'."""
    long_dir = tmp_path / ('t' * 60) / ('m' * 60)
    long_dir.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]),
               TMPDIR=str(long_dir))
    proc = subprocess.run([sys.executable, '-c', FORKSERVER_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = next(line for line in proc.stdout.splitlines() if line.startswith('ERROR '))
    assert f"the temporary directory ('{long_dir}', {len(str(long_dir))} characters)" in error
    assert 'Set TMPDIR to a shorter directory' in error and 'AF_UNIX path too long' in error
    assert 'PIDS []' in proc.stdout
    assert re.search(r'MADE [1-9]\d* LEFT \[\]', proc.stdout), proc.stdout


def test_a_ctrl_c_while_a_segment_is_made_leaves_none(monkeypatch):
    """Python's SharedMemory makes the segment, then registers it with the resource
    tracker (starting it on first use, tens of milliseconds): a Ctrl-C there left a
    segment that nothing removed. Here the registration is interrupted every time."""
    from multiprocessing import resource_tracker
    from mgpu_updater.comm import shm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    before = _segments()
    monkeypatch.setattr(resource_tracker, 'register', interrupted)
    with pytest.raises(KeyboardInterrupt):
        shm._open('mgpu_test_' + os.urandom(4).hex(), 4096, create=True)
    assert _segments() - before == set()

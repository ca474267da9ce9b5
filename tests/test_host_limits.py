"""The host's limits, named where the replicas' start runs into one (``_limits``).

Under a shell's or a container's limits the start of CPU replicas failed deep inside
the standard library, with a bare ``OSError: [Errno 24] Too many open files``, ``can't
start new thread``, ``[Errno 27] File too large`` (a ``ulimit -f`` caps /dev/shm segments
too), an empty ``MemoryError`` under ``ulimit -v``, or a ``FileNotFoundError`` with no path
where the current directory was removed; ``StandardUpdater`` trained there. Now each says
which limit, its value and the fix, as an error of the same type raised from the original.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mgpu_updater import ParallelAccumulatingUpdater, _limits, shard_iterators

from _models import classifier, dataset, run_updates, setup_optimizer

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(_limits.resource is None, reason='no POSIX resource limits')


@pytest.mark.parametrize('error, kind, says', [
    (OSError(errno.EMFILE, 'Too many open files'), OSError, 'ulimit -n'),
    (OSError(errno.ENFILE, 'Too many open files in system'), OSError, 'ulimit -n'),
    (RuntimeError("can't start new thread"), RuntimeError, 'ulimit -u'),
    (BlockingIOError(errno.EAGAIN, 'Resource temporarily unavailable'), BlockingIOError,
     'ulimit -u'),
    (OSError(errno.EFBIG, 'File too large'), OSError, 'ulimit -f'),
])
def test_an_error_of_a_limit_is_named_with_its_fix(error, kind, says):
    better = _limits.explained(error)
    assert type(better) is kind and says in str(better), better
    assert 'the replicas could not start: ' in str(better)
    assert getattr(better, 'errno', None) == getattr(error, 'errno', None)


def test_memory_is_named_only_under_an_address_space_limit(monkeypatch):
    assert _limits.explained(MemoryError()) is None or _limits._soft('RLIMIT_AS') is not None
    monkeypatch.setattr(_limits, '_soft', lambda name: 900 * 2**20)
    better = _limits.explained(MemoryError())
    assert type(better) is MemoryError and 'ulimit -v' in str(better) and '900 MiB' in str(better)
    better = _limits.explained(OSError(errno.ENOMEM, 'Cannot allocate memory'))
    assert type(better) is OSError and better.errno == errno.ENOMEM


@pytest.mark.parametrize('error', [
    OSError(errno.EACCES, 'Permission denied'), RuntimeError('a bug'), ValueError('x'),
    FileNotFoundError(errno.ENOENT, 'No such file', 'data.npz'),   # the cwd is there
])
def test_other_errors_stand_as_they_are(error):
    assert _limits.explained(error) is None


_SCRIPT = textwrap.dedent('''
    import os, sys, tempfile
    sys.path[:0] = [{root!r}, {tests!r}]
    from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators
    from _models import classifier, dataset, run_updates, setup_optimizer

    if __name__ == '__main__':
        model = classifier()
        updater = ParallelAccumulatingUpdater(
            shard_iterators(dataset(32, seed=1), 2, 4), setup_optimizer('sgd', model),
            devices=['@numpy'] * 2)
        if sys.argv[1] == 'files':   # a few more than this process has open now
            import resource
            top = max(int(fd) for fd in os.listdir('/proc/self/fd'))
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 5, hard))
        if sys.argv[1] == 'cwd':
            gone = tempfile.mkdtemp()
            os.chdir(gone)
            os.rmdir(gone)
        try:
            run_updates(updater, model, 1)
        except BaseException as exc:
            print('RAISED', type(exc).__name__, exc, flush=True)
        finally:
            updater.finalize()
''')


@pytest.mark.skipif(not os.path.isdir('/proc/self/fd'), reason='no /proc/self/fd to count')
@pytest.mark.parametrize('case, says', [
    ('files', ('OSError', 'too many open files', 'ulimit -n')),
    ('cwd', ('FileNotFoundError', 'the current directory was removed')),
])
def test_a_start_under_the_limit_says_so(tmp_path, case, says):
    script = tmp_path / 'limited.py'
    script.write_text(_SCRIPT.format(root=str(ROOT), tests=str(ROOT / 'tests')))
    run = subprocess.run([sys.executable, str(script), case], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    line = [x for x in run.stdout.splitlines() if x.startswith('RAISED')]
    assert line, run.stdout + run.stderr
    for text in says:
        assert text in line[0], line[0]


def test_an_update_that_failed_is_raised_though_stopping_the_replicas_failed_too(
        monkeypatch):
    """Out of memory in an update, copying the parameters off shared memory ran out too:
    that second error was raised in place of the update's."""
    model = classifier()
    updater = ParallelAccumulatingUpdater(shard_iterators(dataset(32, seed=1), 2, 4),
                                          setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        run_updates(updater, model, 1)
        teardown = updater._teardown

        def failing(abort, by_interrupt=False):
            teardown(abort, by_interrupt)
            raise MemoryError('copying a parameter')
        monkeypatch.setattr(updater, '_teardown', failing)
        monkeypatch.setattr(model, 'forward', lambda *a: (_ for _ in ()).throw(
            ValueError('the forward failed')))
        with pytest.raises(ValueError, match='the forward failed') as info:
            run_updates(updater, model, 1)
        assert any('MemoryError: copying a parameter' in note
                   for note in getattr(info.value, '__notes__', [])), info.value
    finally:
        monkeypatch.undo()
        updater.finalize()


class _NoDescriptorLeft:
    """Every file descriptor this process may have taken (the soft ``ulimit -n`` lowered
    to a few above those open, the rest filled with /dev/null), for a block."""

    def __enter__(self):
        import resource
        self._resource = resource
        self._limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        top = max(int(fd) for fd in os.listdir('/proc/self/fd'))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 4, self._limits[1]))
        self._fillers = []
        try:
            while True:
                self._fillers.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
        return self

    def __exit__(self, *exc_info):
        for fd in self._fillers:
            os.close(fd)
        self._resource.setrlimit(self._resource.RLIMIT_NOFILE, self._limits)


@pytest.mark.skipif(not os.path.isdir('/proc/self/fd'), reason='no /proc/self/fd to count')
def test_the_stack_folder_goes_though_no_file_descriptor_is_left(tmp_path, monkeypatch):
    """A start that failed for want of descriptors (``ulimit -n``) left its stall watch's
    folder in the temporary directory: removing it needs a descriptor to list it, and a
    pool whose output relay could not be made never closed it."""
    from mgpu_updater._local.pool import WorkerPool
    from mgpu_updater._local.stall import StackFiles
    monkeypatch.setattr('tempfile.tempdir', str(tmp_path))
    stacks = StackFiles()
    for rank in (1, 2):
        with open(stacks.path(rank), 'w') as f:
            f.write('a stack\n')
    with _NoDescriptorLeft():
        stacks.close()
        with pytest.raises(OSError) as info:
            WorkerPool(['@numpy'] * 2, 'fork')
    assert info.value.errno == errno.EMFILE, info.value
    assert os.listdir(tmp_path) == []

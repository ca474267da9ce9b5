"""A /dev/shm too small for the replicas' buffers fails at the start, saying so.

A segment is a file of its size in a tmpfs that holds no page until it is written, and a
write the tmpfs has no room for is a SIGBUS: the master died with a bare "Bus error" (no
exception, no snapshot on error) at its first update, or whenever a page was first
written, or a worker was killed by SIGBUS with no word of shared memory (a Docker
container's /dev/shm is 64 MB unless told). The pages are reserved when a segment is made.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from mgpu_updater.comm import shm


def _segments():
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith('mgpu_')}


def test_a_segment_with_no_room_is_refused_naming_dev_shm_and_left_nowhere(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(shm.os, 'posix_fallocate', full)
    before = _segments()
    with pytest.raises(OSError, match=r'not enough shared memory in /dev/shm \(.* MiB free '
                       r'of .* MiB\) for a buffer of the replicas of 1\.0 MiB') as e:
        shm._open('mgpu_' + 'ab' * 16, 1 << 20, create=True)
    assert e.value.errno == errno.ENOSPC
    assert '--shm-size' in str(e.value)
    assert _segments() == before   # unlinked


def test_a_file_system_that_cannot_reserve_is_used_as_it_is(monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(shm.os, 'posix_fallocate', unsupported)
    segment = shm._open('mgpu_' + 'cd' * 16, 4096, create=True)
    try:
        segment.buf[:4] = b'abcd'
    finally:
        segment.close()
        segment.unlink()


SCRIPT = textwrap.dedent('''
    import chainer, numpy as np
    import chainer.links as L
    from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators

    if __name__ == '__main__':
        model = L.Classifier(L.Linear(1500, 1500))   # 9 MB of parameters
        x = np.zeros((16, 1500), np.float32)
        t = np.zeros(16, np.int32)
        optimizer = chainer.optimizers.SGD()
        optimizer.setup(model)
        its = shard_iterators(chainer.datasets.TupleDataset(x, t), 2, 4)
        updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * 2)
        try:
            updater.update()
        except OSError as e:
            print('REFUSED', e)
        finally:
            updater.finalize()
''')


def test_a_small_dev_shm_is_refused_at_the_first_update_not_a_bus_error(tmp_path):
    """In a mount namespace of its own, a /dev/shm of 8 MiB, where the buffers need about
    27 MB (a master that wrote its 9 MB of parameters there died of a SIGBUS): the first
    update raises, naming /dev/shm, and nothing is left there."""
    unshare = shutil.which('unshare')
    if unshare is None:
        pytest.skip('unshare(1) not found: no private /dev/shm to size')
    probe = subprocess.run([unshare, '-m', 'true'], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f'a mount namespace is not permitted here (unshare -m: '
                    f'{probe.stderr.decode().strip()})')
    script = tmp_path / 'train.py'
    script.write_text(SCRIPT)
    inside = (f'mount -t tmpfs -o size=8m tmpfs /dev/shm && {sys.executable} {script}; '
              'echo RC=$?; echo LEFT:$(ls -A /dev/shm)')
    done = subprocess.run([unshare, '-m', 'sh', '-c', inside], capture_output=True,
                          text=True, timeout=240, cwd=str(tmp_path))
    if 'mount: ' in done.stderr and 'REFUSED' not in done.stdout:
        pytest.skip(f'mounting a tmpfs is not permitted here: {done.stderr.strip()}')
    assert 'RC=0' in done.stdout, done.stdout + done.stderr
    assert 'REFUSED [Errno 28] not enough shared memory in /dev/shm' in done.stdout, (
        done.stdout + done.stderr)
    assert 'LEFT:\n' in done.stdout or done.stdout.rstrip().endswith('LEFT:'), done.stdout


def test_the_masters_slot_of_a_summed_buffer_is_reserved_at_its_first_use(monkeypatch):
    """Every slot the workers write, and a broadcast buffer's one, are reserved when made;
    the master's own slot of a summed buffer when it is first used: the gradients' is
    never written where the sums go onto the master's arrays, and reserving it took one
    more model's bytes of /dev/shm (191 MiB became 287 for a 96 MiB model, 2 replicas)."""
    reserved = []

    def record(fd, offset, length):
        reserved.append((fd, offset, length))
    monkeypatch.setattr(shm.os, 'posix_fallocate', record)
    spec = {'grad/<f4': ('<f4', 1000), 'param/<f4': ('<f4', 1000)}
    comm = shm.ShmCommunicator.create(3, spec, broadcast=['param/<f4'])
    try:
        made = sorted((offset, length) for _, offset, length in reserved)
        # the gradient's slots 1 and 2, the parameters' one slot, the ledger
        assert (4000, 8000) in made and made.count((0, 4000)) == 1, made
        before = len(reserved)
        comm.buffer('param/<f4')
        assert len(reserved) == before
        comm.buffer('grad/<f4')[:] = 1.0   # the master packs: its slot, at its first use
        assert reserved[before:] and reserved[before][1:] == (0, 4000)
        comm.buffer('grad/<f4')
        assert len(reserved) == before + 1   # once
    finally:
        comm.finalize()

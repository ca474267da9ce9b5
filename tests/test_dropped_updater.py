"""An updater dropped without ``finalize()`` leaves nothing behind.

``del updater`` (and garbage collection) stops its workers and releases every
shared-memory segment at once, not at the interpreter's exit; a script that exits with
the updater still referenced releases them too, without the resource tracker's warning
of leaked segments.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators

from _processes import alive
from _models import classifier, dataset, setup_optimizer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'tests' / 'scripts' / 'dropped_updater.py'


def _run(mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / 'tests')]))
    proc = subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True,
                          text=True, timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def line(key):
        return json.loads(proc.stdout.split(key + ' ', 1)[1].splitlines()[0])
    return proc, line


def test_del_stops_the_workers_and_releases_the_shared_memory_at_once():
    proc, line = _run('del')
    workers, segments = line('WORKERS'), line('SEGMENTS')
    assert len(workers) == 1 and segments
    assert line('DROPPED') == {'left': []}
    assert 'leaked' not in proc.stderr, proc.stderr[-2000:]


def test_an_exit_without_finalize_leaves_no_process_no_segment_and_no_warning():
    proc, line = _run('exit')
    workers, segments = line('WORKERS'), line('SEGMENTS')
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(map(alive, workers)):
        time.sleep(0.05)
    assert not any(map(alive, workers))
    assert [s for s in segments if os.path.exists('/dev/shm/' + s)] == []
    assert 'resource_tracker' not in proc.stderr and 'leaked' not in proc.stderr, \
        proc.stderr[-2000:]


def _descriptors_of_removed_segments():
    """This process's open descriptors of ``mgpu_`` segments that were unlinked."""
    found = []
    for fd in os.listdir('/proc/self/fd'):
        try:
            target = os.readlink(f'/proc/self/fd/{fd}')
        except OSError:
            continue
        if target.startswith('/dev/shm/mgpu_') and target.endswith('(deleted)'):
            found.append(target)
    return sorted(found)


def _mappings_of_removed_segments():
    """This process's mappings of ``mgpu_`` segments that were unlinked."""
    with open('/proc/self/maps') as f:
        return sorted(line.split(None, 5)[-1].strip() for line in f
                      if '/dev/shm/mgpu_' in line and line.rstrip().endswith('(deleted)'))


@pytest.mark.parametrize('how', ['finalize', 'drop'])
def test_updater_after_updater_leaves_no_descriptor_of_a_removed_segment(how):
    """The model keeps views of the segments after its updater is gone (its arrays live
    there); the descriptors must not stay with them, nor the memory after the model. And
    all goes as the updater goes, without the garbage collector: a sweep that builds
    updater after updater kept each one's segments mapped until a collection happened to
    run (a 4M-parameter model: 46 MiB of memory, 31 MiB of /dev/shm per updater), the
    master's buffer views held by its group, which its communicator points back to."""
    before = set(_descriptors_of_removed_segments())   # an earlier test's may go meanwhile
    mapped_before = set(_mappings_of_removed_segments())
    cores = os.sched_getaffinity(0)
    models = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            model = classifier(seed=0)
            models.append(model)
            updater = ParallelAccumulatingUpdater(
                shard_iterators(dataset(16, seed=0), 2, 4), setup_optimizer('sgd', model),
                devices=['@numpy'] * 2)
            updater.update()
            if how == 'finalize':
                updater.finalize()
            del updater
        assert set(_descriptors_of_removed_segments()) - before == set()
        assert set(_mappings_of_removed_segments()) - mapped_before == set()
    finally:
        gc.enable()
    # the master's thread bound to its share of the cores while the updater ran, and
    # given them back however the updater went
    assert os.sched_getaffinity(0) == cores

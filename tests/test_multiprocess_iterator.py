"""MultiprocessIterator in the worker replicas (issue 10, item 3).

Every MultiprocessParallelUpdater script, and the README's ``shard_iterators(...,
iterator_class=MultiprocessIterator)``: the constructor's check used to break the user's
iterator (``MultiprocessIterator.__getstate__`` sets its position and epoch to None), and
the workers, daemonic, could not start its pool. Two replicas x ``n_processes=2`` must
train as ``StandardUpdater`` does, snapshot and resume exactly, and leave no process
behind, also when a worker or the master is SIGKILLed while the iterator's processes are
busy (``tests/scripts/faults`` runs the fault scenarios with it too).
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import chainer
from chainer import training
from chainer.iterators import MultiprocessIterator
from chainer.training import extensions
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError, _payload, shard_iterators

from _models import classifier, dataset, params, run_updates, setup_optimizer
from _processes import children

ROOT = Path(__file__).resolve().parent.parent


def _state(it):
    order = it._state.order
    return (it.current_position, it.epoch, it.is_new_epoch, it.previous_epoch_detail,
            None if order is None else order.tolist())


def test_construction_and_start_leave_the_users_iterators_untouched():
    """Checking and sending an iterator must not change it (the state the worker gets,
    and the one a snapshot of a not yet started updater saves)."""
    datasets = [dataset(24, seed=r) for r in range(3)]
    its = [MultiprocessIterator(datasets[0], 4, n_processes=2),
           MultiprocessIterator(datasets[1], 4, n_processes=2, shuffle=False),
           MultiprocessIterator(datasets[2], 4, n_processes=2,
                                order_sampler=chainer.iterators.ShuffleOrderSampler(
                                    np.random.RandomState(3)))]
    before = [_state(it) for it in its]
    assert before[1][:4] == (0, 0, False, None)
    model = classifier(seed=0)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 3)
    try:
        assert [_state(it) for it in its] == before          # None, None, None before
        # the copy a worker gets carries the very same state
        for it in its[1:]:
            copy = pickle.loads(_payload.dumps(it))
            assert _state(copy) == _state(it)
            copy.finalize()
        updater.update()                                     # pickles the payloads
        assert [_state(it) for it in its[1:]] == before[1:]
    finally:
        updater.finalize()


def test_the_copy_a_worker_gets_shuffles_its_next_epochs_as_the_original():
    """Chainer's __setstate__ calls reset(), which draws an order from the sampler's
    generator: the copy shuffled its second epoch as the original its third."""
    def make():
        return MultiprocessIterator(dataset(8, seed=0), 4, n_processes=1,
                                    order_sampler=chainer.iterators.ShuffleOrderSampler(
                                        np.random.RandomState(7)))
    original = make()
    copy = pickle.loads(_payload.dumps(make()))
    try:
        orders = [[float(x[0]) for _ in range(8) for x, _ in it.next()]
                  for it in (original, copy)]
    finally:
        original.finalize()
        copy.finalize()
    assert orders[1] == orders[0]


def test_two_replicas_match_standard_updater():
    n, b, k, updates = 2, 4, 2, 3
    datasets = [dataset(b * k * updates, seed=10 + r) for r in range(n)]
    model, ref = classifier(seed=1), classifier(seed=1)
    its = [MultiprocessIterator(d, b, shuffle=False, n_processes=2) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('momentum+decay', model),
                                          devices=['@numpy'] * n, accumulate_steps=k)
    try:
        obs = run_updates(updater, model, updates)
    finally:
        updater.finalize()
    ref_opt = setup_optimizer('momentum+decay', ref)
    expected = []
    for u in range(updates):
        batch = [x for d in datasets for x in d[u * k * b:(u + 1) * k * b]]
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        expected.append(float(run_updates(StandardUpdater(it, ref_opt), ref, 1)[0]
                              ['main/loss'].array))
    np.testing.assert_allclose([o['main/loss'] for o in obs], expected, rtol=1e-5)
    for name, value in params(ref).items():
        np.testing.assert_allclose(params(model)[name], value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


class RollingOrder:
    """A new order each epoch, drawn from the current order alone: no random state.

    Chainer's MultiprocessIterator draws the next epoch's order in its prefetch thread,
    ahead of the batches handed out, and saves no generator state; so only an order
    sampler without state of its own resumes exactly, on one device as on several.
    """

    def __call__(self, current_order, current_position):
        return np.roll(current_order, 5)


def _trainer(out, stop):
    """The README's set-up: shard_iterators(..., iterator_class=MultiprocessIterator)."""
    model = classifier(seed=5)
    its = shard_iterators(dataset(44, seed=5), 2, 4, iterator_class=MultiprocessIterator,
                          n_processes=2, seed=7, order_sampler=RollingOrder())
    # 22 per shard, micro-batch 4, accumulate_steps 2: epochs end mid-window
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                          devices=['@numpy'] * 2, accumulate_steps=2)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=str(out))
    trainer.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                   trigger=(4, 'iteration'))
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    return trainer, model


def test_snapshot_and_resume_match_the_uninterrupted_run(tmp_path):
    straight, model_a = _trainer(tmp_path / 'a', 8)
    straight.run()
    first, _ = _trainer(tmp_path / 'b', 4)
    first.run()
    resumed, model_b = _trainer(tmp_path / 'b', 8)
    chainer.serializers.load_npz(str(tmp_path / 'b' / 'snap_4'), resumed)
    assert resumed.updater.iteration == 4
    resumed.run()
    for name, value in params(model_a).items():
        assert np.array_equal(params(model_b)[name], value), name
    assert straight.updater.epoch_detail == resumed.updater.epoch_detail
    losses_a = [e['main/loss'] for e in json.loads((tmp_path / 'a' / 'log').read_text())]
    losses_b = [e['main/loss'] for e in json.loads((tmp_path / 'b' / 'log').read_text())]
    assert losses_b[-4:] == losses_a[-4:]


# ------------------------------------------------------------------ no process left
class StallingDataset:
    """Rows of ``base``; once ``flag`` exists, each read stalls for a minute: the
    iterator's processes are busy when their worker is killed, and would outlive it."""

    def __init__(self, base, flag):
        self.base, self.flag = base, flag

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if os.path.exists(self.flag):
            time.sleep(60)
        return self.base[i]


def _running(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
    except (FileNotFoundError, ProcessLookupError):
        return False



def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _running(p)]


def _wait_children(pid, n, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        kids = children(pid)
        if len(kids) >= n:
            return kids
        time.sleep(0.05)
    raise AssertionError(f'process {pid} has {children(pid)}, expected {n} children')


def test_killed_worker_takes_its_busy_iterator_processes_along(tmp_path):
    flag = str(tmp_path / 'stall')
    model = classifier(seed=2)
    its = [MultiprocessIterator(dataset(32, seed=0), 4, n_processes=2, shuffle=False),
           MultiprocessIterator(StallingDataset(dataset(32, seed=1), flag), 4,
                                n_processes=2, shuffle=False)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        updater.update()
        worker, = updater.worker_pids()
        grandchildren = _wait_children(worker, 2)
        open(flag, 'w').close()
        time.sleep(0.5)            # they pick up the next reads, and stall
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r'was killed by SIGKILL'):
            for _ in range(5):
                updater.update()
        assert time.monotonic() - t0 < 10.0
    finally:
        t0 = time.monotonic()
        updater.finalize()
        finalize_seconds = time.monotonic() - t0
    assert _wait_gone(grandchildren, 5.0) == []
    assert finalize_seconds < 10.0


@pytest.mark.parametrize('how', ['finalize', 'master_sigkill'])
def test_no_iterator_process_outlives_a_stop_or_a_killed_master(tmp_path, how):
    """A master in a subprocess; its worker's iterator processes stall in a read. After
    ``finalize()``, or the master's SIGKILL, the worker and its processes are gone."""
    script = ROOT / 'tests' / 'scripts' / 'stalled_iterator.py'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / 'tests')]))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / 'stall'), how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT), start_new_session=True)
    try:
        line = ''
        deadline = time.monotonic() + 90
        while not line.startswith('READY') and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith('READY'), proc.stderr.read()[-3000:]
        pids = json.loads(line.split(' ', 1)[1])
        if how == 'master_sigkill':
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            everything = pids['workers'] + pids['grandchildren']
            assert _wait_gone(everything, 10.0) == []
            print('gone after the master SIGKILL:', round(time.monotonic() - t0, 2), 's')
        else:
            out, err = proc.communicate(timeout=60)
            result = json.loads(out.split('RESULT ', 1)[1])
            print('finalize with stalled iterator processes:', result['finalize_s'], 's')
            assert proc.returncode == 0, err[-3000:]
            assert result['finalize_s'] < 10.0
            assert _wait_gone(pids['workers'] + pids['grandchildren'], 5.0) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_a_script_that_never_finalizes_still_exits():
    """Workers are not daemonic now (so that they may start processes), and Python joins
    non-daemonic children at exit: the pools left open are closed before that."""
    script = ROOT / 'tests' / 'scripts' / 'no_finalize.py'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / 'tests')]))
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=90, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        pytest.fail('the script never exited: the workers held it up')
    print('script run and exit:', round(time.monotonic() - t0, 2), 's')
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = json.loads(proc.stdout.split('WORKERS ', 1)[1].splitlines()[0])
    grandchildren = json.loads(proc.stdout.split('GRANDCHILDREN ', 1)[1].splitlines()[0])
    assert len(grandchildren) == 2
    assert _wait_gone(workers + grandchildren, 5.0) == []

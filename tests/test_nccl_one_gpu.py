"""Several NCCL ranks on one GPU, through the test mode (docs/gpu.md): real NCCL, real
streams, real processes, on a machine with one GPU.

NCCL refuses two ranks on one device unless they look like two hosts: under the test
switch (``MGPU_TEST_NCCL_RANKS_ON_ONE_GPU=1``) the local backend takes a GPU listed several
times with NCCL, each rank with an ``NCCL_HOSTID`` of its own, talking over NCCL's socket
transport on the loopback interface (slow, but NCCL's own code paths). With 2 and 3 ranks:

- the communicator contract (every verb, every dtype, finalize), and persistents NCCL
  cannot sum (bool, int16, uint16) reaching every worker as bytes;
- the declared collective order with a BatchNorm model, synchronous and pipelined: the
  same parameters and statistics as the same replicas on the CPU, where the shared-memory
  backend checks the order of every update;
- the whole updater against StandardUpdater on the global batch: accumulate_steps 1 and 3,
  float32, float16 with dynamic loss scaling, ``micro_batch_size``, snapshot and resume,
  a master that is not device 0 (where two devices exist);
- a worker SIGKILLed in each window where NCCL would keep the master waiting for good
  (after Step before its bcast; after Done with its reduce in flight): WorkerError within
  10 s, every process gone; a worker raising from user code;
- under ``max_worker_restarts=1``, a worker SIGKILLed between updates or after its Done
  with 3 ranks (a survivor rejoins): the NCCL communicator is rebuilt with a fresh
  unique id, and the parameters and losses are bitwise those of the uninterrupted run.

Marked ``gpu``: each skips with the reason when CuPy, a CUDA device or NCCL is missing.
``bench/gpu_check.sh`` runs this file on its own (its section ``nccl_ranks_on_one_gpu``);
where ``MGPU_NCCL_REPORT`` names a file, the comparisons append their largest parameter
difference to it, one JSON line each. Chainer's MultiprocessParallelUpdater, run the same
way, is the anchor of ``bench/gpu_nccl_anchor.py``.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np
import pytest

# mgpu_updater before chainer: its compat shim lets Chainer 7.8.1 import under numpy 2,
# and the spawned ranks import this module on their own, without pytest's conftest
import mgpu_updater  # noqa: F401,I100  isort:skip
import chainer
import chainer.links as L

from mgpu_updater import (ParallelAccumulatingUpdater, WorkerError, WorkerRestartWarning,
                          comm as comms)
from mgpu_updater.comm.nccl import TEST_SWITCH, NcclCommunicator, act_as_own_host

from _models import MLP, classifier, dataset, run_updates, setup_optimizer
from _processes import gone_within

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'scripts'))
import comm_contract as contract  # noqa: E402

pytestmark = pytest.mark.gpu

RANKS = [2, 3]
TIMEOUT = 120.0   # start_timeout, and the bound on a contract rank


@pytest.fixture
def one_gpu(nccl_gpu, monkeypatch):
    """The test mode on: the updater's NCCL ranks all on GPU 0, each its own host."""
    monkeypatch.setenv(TEST_SWITCH, '1')
    return nccl_gpu


def record(test, **values):
    """Append what a comparison measured to $MGPU_NCCL_REPORT (bench/gpu_check.py)."""
    path = os.environ.get('MGPU_NCCL_REPORT')
    if path:
        with open(path, 'a') as f:
            f.write(json.dumps({'test': test, **values}) + '\n')


def host_params(model):
    return {name: chainer.backends.cuda.to_cpu(p.array).astype(np.float64)
            for name, p in model.namedparams()}


def max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


# ------------------------------------------------------------------ the contract
def _contract_rank(rank, size, uid_queue, reports):
    """One rank of the contract, in its own process, as a worker would be."""
    try:
        import cupy
        act_as_own_host(rank)   # before this process's first NCCL call
        if rank == 0:
            uid = NcclCommunicator.new_unique_id()
            for _ in range(size - 1):
                uid_queue.put(uid)
        else:
            uid = uid_queue.get(timeout=TIMEOUT)
        cupy.cuda.Device(0).use()
        comm = NcclCommunicator(rank, size, 0, contract.SPEC, uid, timeout=TIMEOUT)
        out = contract.guarded(lambda: contract.run(comm, lambda step: None, allreduce=True))
        out['rank'] = rank
        out['after_finalize'] = contract.after_finalize(comm)
        reports.put(out)
    except BaseException as e:  # reported to the test
        reports.put({'rank': rank, 'traceback': f'{type(e).__name__}: {e}'})


@pytest.mark.parametrize('size', RANKS)
def test_the_communicator_contract(one_gpu, size):
    ctx = multiprocessing.get_context('spawn')
    uid_queue, reports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_contract_rank, args=(r, size, uid_queue, reports))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = [reports.get(timeout=TIMEOUT) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    failed = [f"rank {r['rank']}: {r['traceback']}" for r in got if 'traceback' in r]
    assert not failed, '\n'.join(failed)
    got = sorted(got, key=lambda r: r['rank'])
    for name in contract.NAMES:
        dtype = np.dtype(contract.SPEC[name][0])
        want = contract.rank_order_sum(name, size, wide=True)
        reduced = got[0]['reduce'][name]
        assert reduced.dtype == dtype
        if dtype.kind == 'f' and dtype != np.float16:   # NCCL's ring adds in its own order
            np.testing.assert_allclose(reduced, want, rtol=1e-6 if dtype.itemsize == 4
                                       else 1e-14, err_msg=name)
        else:   # integers, and float16 summed exactly in float32
            assert reduced.tobytes() == want.tobytes(), (name, reduced, want)
        sent = contract.rank_data(name, contract.BCAST_SEED)
        for r in got:
            assert r['bcast'][name].tobytes() == sent.tobytes(), (r['rank'], name)
            np.testing.assert_allclose(r['allreduce'][name].astype(np.float64),
                                       want.astype(np.float64), rtol=1e-6, err_msg=name)
    for r in got:
        after = r['after_finalize']
        assert after['finalize twice'] is None and after['finalized'] is True
        for verb in ('buffer', 'reduce', 'bcast', 'allreduce'):
            assert after[verb][0] == 'RuntimeError' and 'finalized' in after[verb][1]


# ------------------------------------------------------------------ the declared order
def _bn_run(devices, pipelined, updates=3, b=4):
    np.random.seed(11)
    model = L.Classifier(MLP(batchnorm=True))
    opt = setup_optimizer('momentum+decay', model)
    its = [chainer.iterators.SerialIterator(dataset(b * updates, seed=20 + r), b,
                                            shuffle=False) for r in range(len(devices))]
    updater = ParallelAccumulatingUpdater(its, opt, devices=devices, pipelined=pipelined,
                                          start_timeout=TIMEOUT)
    try:
        run_updates(updater, model, updates)
    finally:
        updater.finalize()
    model.to_device('@numpy')
    bn = model.predictor.bn
    return host_params(model), {'avg_mean': np.array(bn.avg_mean, np.float64),
                                'avg_var': np.array(bn.avg_var, np.float64)}


@pytest.mark.parametrize('pipelined', [False, True], ids=['sync', 'pipelined'])
@pytest.mark.parametrize('size', RANKS)
def test_the_declared_order_with_batchnorm(one_gpu, size, pipelined):
    """Each collective pairs with the same one on every rank (NCCL pairs by issue order):
    parameters, BatchNorm's averaged statistics and gradients come out as with the same
    replicas on the CPU, where the shared-memory backend checks the order every update."""
    assert comms.backend_for([chainer.get_device('@cupy:0')] * size) == 'nccl'
    gpu_params, gpu_stats = _bn_run(['@cupy:0'] * size, pipelined)
    cpu_params, cpu_stats = _bn_run(['@numpy'] * size, pipelined)
    diff = max(max_diff(gpu_params, cpu_params), max_diff(gpu_stats, cpu_stats))
    record(f'declared_order[{size}-{"pipelined" if pipelined else "sync"}]', max_diff=diff)
    for name in cpu_params:
        np.testing.assert_allclose(gpu_params[name], cpu_params[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    for name in cpu_stats:
        np.testing.assert_allclose(gpu_stats[name], cpu_stats[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


# ------------------------------------------------------------------ against StandardUpdater
def _standard(ref, opt, datasets, b, k, updates, device):
    losses = []
    for u in range(updates):
        batch = [s for d in datasets for s in d[u * k * b:(u + 1) * k * b]]
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        updater = chainer.training.updaters.StandardUpdater(it, opt, device=device)
        losses.append(float(run_updates(updater, ref, 1)[0]['main/loss'].array))
    return losses


def _compare(name, devices, k=1, b=4, updates=3, dtype=np.float32, scaling=False,
             micro_batch_size=None, rtol=1e-5, atol=1e-6):
    """Ours on ``devices`` against StandardUpdater on the global batch; returns the
    largest parameter difference (also recorded)."""
    size = len(devices)
    datasets = [dataset(b * k * updates, seed=30 + r, dtype=dtype) for r in range(size)]
    with chainer.using_config('dtype', dtype):
        model, ref = classifier(seed=7), classifier(seed=7)

    def optimizer(m):
        opt = setup_optimizer('momentum+decay', m)
        if scaling:
            opt.use_fp32_update()
            opt.loss_scaling(interval=2)
        return opt
    opt = optimizer(model)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, opt, devices=devices, accumulate_steps=k,
                                          micro_batch_size=micro_batch_size,
                                          start_timeout=TIMEOUT)
    ref_opt = optimizer(ref)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', 'Non finite number found in param.grad')
        try:
            losses = [o['main/loss'] for o in run_updates(updater, model, updates)]
        finally:
            updater.finalize()
        ref_losses = _standard(ref, ref_opt, datasets, b, k, updates, devices[0])
    got, want = host_params(model), host_params(ref)
    diff = max_diff(got, want)
    record(name, max_diff=diff)
    if scaling:
        assert opt._loss_scale == ref_opt._loss_scale
    np.testing.assert_allclose(losses, ref_losses, rtol=max(rtol, 1e-5))
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=key)
    return diff


@pytest.mark.parametrize('size, k', [(2, 1), (3, 3)])
def test_float32_matches_standard_updater_on_the_global_batch(one_gpu, size, k):
    _compare(f'float32[{size}-k{k}]', ['@cupy:0'] * size, k=k)


@pytest.mark.parametrize('size, k', [(2, 3), (3, 1)])
def test_float16_with_dynamic_loss_scaling_matches_standard_updater(one_gpu, size, k):
    _compare(f'float16[{size}-k{k}]', ['@cupy:0'] * size, k=k, dtype=np.float16,
             scaling=True, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize('size', RANKS)
def test_micro_batch_size_matches_standard_updater(one_gpu, size):
    _compare(f'micro_batch_size[{size}]', ['@cupy:0'] * size, k=2, b=6, micro_batch_size=4)


def test_a_master_that_is_not_device_0(one_gpu):
    count = one_gpu.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip(f'needs two CUDA devices to put the master on device 1 with device 0 '
                    f'current (this machine has {count})')
    with one_gpu.cuda.Device(0):
        _compare('master_on_device_1', ['@cupy:1', '@cupy:0', '@cupy:0'], k=2)


@pytest.mark.parametrize('size', RANKS)
def test_snapshot_and_resume(one_gpu, size, tmp_path):
    b, k = 4, 2
    datasets = [dataset(b * k * 4, seed=40 + r) for r in range(size)]

    def make():
        model = classifier(seed=8)
        its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
        return model, ParallelAccumulatingUpdater(
            its, setup_optimizer('momentum+decay', model), devices=['@cupy:0'] * size,
            accumulate_steps=k, start_timeout=TIMEOUT)

    model, updater = make()
    try:
        run_updates(updater, model, 2)
        chainer.serializers.save_npz(str(tmp_path / 'snap.npz'), updater)
        expected = [o['main/loss'] for o in run_updates(updater, model, 2)]
    finally:
        updater.finalize()
    resumed_model, resumed = make()
    try:
        chainer.serializers.load_npz(str(tmp_path / 'snap.npz'), resumed)
        assert resumed.iteration == 2
        got = [o['main/loss'] for o in run_updates(resumed, resumed_model, 2)]
    finally:
        resumed.finalize()
    diff = max_diff(host_params(resumed_model), host_params(model))
    record(f'resume[{size}]', max_diff=diff)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert diff <= 1e-6


FLAGS = [[True, False, True], [7, -3], [65535, 1]]


class Flagged(chainer.Chain):
    """A classifier with persistents of dtypes NCCL cannot sum (bool, int16, uint16),
    zeros at first; a worker's forward from its second call on checks that they hold
    :data:`FLAGS`, which the master sets after the first update (they travel as bytes)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed=12)
        self.add_persistent('mask', np.zeros(3, dtype=np.bool_))
        self.add_persistent('steps', np.zeros(2, dtype=np.int16))
        self.add_persistent('bins', np.zeros(2, dtype=np.uint16))
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        if self.calls >= 2 and multiprocessing.current_process().name.startswith(
                'mgpu-worker'):
            got = [chainer.backends.cuda.to_cpu(a).tolist()
                   for a in (self.mask, self.steps, self.bins)]
            if got != FLAGS:
                raise AssertionError(f'the worker holds {got}, the master sent {FLAGS}')
        return self.inner(x, t)


@pytest.mark.parametrize('size', RANKS)
def test_persistents_nccl_cannot_sum_reach_every_worker(one_gpu, size):
    model = Flagged()
    its = [chainer.iterators.SerialIterator(dataset(32, seed=60 + r), 4) for r in range(size)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@cupy:0'] * size, start_timeout=TIMEOUT)
    try:
        run_updates(updater, model, 1)
        xp = model.xp
        model.mask = xp.asarray(FLAGS[0])
        model.steps = xp.asarray(FLAGS[1], dtype=np.int16)
        model.bins = xp.asarray(FLAGS[2], dtype=np.uint16)
        run_updates(updater, model, 2)   # a worker that got other values raises
    finally:
        updater.finalize()


# ------------------------------------------------------------------ failures
def _kill_later(pid, seconds):
    timer = threading.Timer(seconds, lambda: os.kill(pid, signal.SIGKILL))
    timer.start()
    return timer


MARK = 999.0   # a worker whose batch holds this value raises (RaisesInWorker)


class Planted(chainer.Chain):
    """A classifier that sleeps ``nap`` seconds in forward (set on the master's copy
    only: it does not travel) and raises in a worker whose batch holds :data:`MARK`."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed=9)
        self.nap = 0.0

    def forward(self, x, t):
        if self.nap:
            time.sleep(self.nap)
        if multiprocessing.current_process().name.startswith('mgpu-worker') and \
                float(chainer.backends.cuda.to_cpu(x).max()) == MARK:
            raise ValueError('planted in the worker')
        return self.inner(x, t)


def _two_updates_then(size, fail, marked=False):
    """Start, one good update, then ``fail(updater, model, worker_pids)`` around the
    second: it must raise WorkerError within 10 s, and every worker be gone 10 s later.
    ``marked``: the second update's first sample of every worker holds :data:`MARK`."""
    model = Planted()
    data = [dataset(64, seed=50 + r) for r in range(size)]
    if marked:
        for d in data[1:]:
            d._datasets[0][4, 0] = MARK
    its = [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in data]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@cupy:0'] * size, start_timeout=TIMEOUT)
    try:
        run_updates(updater, model, 1)
        pids = updater.worker_pids()
        assert len(pids) == size - 1
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as info:
            fail(updater, model, pids)
        elapsed = time.monotonic() - t0
    finally:
        updater.finalize()
    assert elapsed < 10, f'the WorkerError took {elapsed:.1f} s'
    assert gone_within(pids, 10), 'a worker outlived the updater'
    return info.value


@pytest.mark.parametrize('size', RANKS)
def test_a_worker_killed_after_step_before_its_bcast(one_gpu, size):
    """The worker is stopped before the update (so it never reaches its bcast) and
    killed a second into it: the master's window waits on a bcast that never ends."""
    def fail(updater, model, pids):
        victim = pids[-1]
        os.kill(victim, signal.SIGSTOP)
        timer = _kill_later(victim, 1.0)
        try:
            run_updates(updater, model, 1)
        finally:
            timer.cancel()
    error = _two_updates_then(size, fail)
    assert error.replica == size - 1 and error.exitcode == -signal.SIGKILL


@pytest.mark.parametrize('size', RANKS)
def test_a_worker_killed_after_done_with_its_reduce_in_flight(one_gpu, size):
    """The master's own window sleeps 3 s; meanwhile the worker finished, enqueued its
    reduce, sent Done, and is killed: the master's reduce may then wait on a dead peer.

    Over NCCL's socket transport the worker's part of the reduce (its data, a few KB) can
    have left before it died (on an H200, NCCL 2.28, it had, at 2 and 3 ranks): then the
    master's update completes with the worker's contribution, and the next update must
    raise. Either way: a WorkerError within 10 s, every process gone."""
    def fail(updater, model, pids):
        model.nap = 3.0
        timer = _kill_later(pids[-1], 1.5)
        try:
            run_updates(updater, model, 1)
            model.nap = 0.0
            run_updates(updater, model, 1)
        finally:
            timer.cancel()
    error = _two_updates_then(size, fail)
    assert error.replica == size - 1


@pytest.mark.parametrize('size', RANKS)
def test_a_worker_raising_from_user_code(one_gpu, size):
    def fail(updater, model, pids):
        run_updates(updater, model, 1)
    error = _two_updates_then(size, fail, marked=True)
    assert 'planted in the worker' in (error.remote_traceback or '')


# ------------------------------------------------------------------ restarts
_UNINTERRUPTED = {}


def _restart_run(size, kill=None, updates=4, device='@cupy:0'):
    """``updates`` updates under ``max_worker_restarts=1`` (the Planted classifier, its
    master's nap as set, SGD); ``kill``: (update index, seconds into it) at which the last
    worker is SIGKILLed. Returns the parameters, the losses and the restarts."""
    model = Planted()
    data = [dataset(4 * updates, seed=70 + r) for r in range(size)]
    its = [chainer.iterators.SerialIterator(d, 4, shuffle=False) for d in data]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=[device] * size, start_timeout=TIMEOUT,
                                          max_worker_restarts=1)
    losses = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', WorkerRestartWarning)
            for u in range(updates):
                timer = None
                if kill is not None and u == kill[0]:
                    victim = updater.worker_pids()[-1]
                    if kill[1]:
                        model.nap = 2 * kill[1]   # the master's window outlasts the kill
                        timer = _kill_later(victim, kill[1])
                    else:
                        os.kill(victim, signal.SIGKILL)
                        time.sleep(0.2)   # dead, not noticed yet
                try:
                    loss = run_updates(updater, model, 1)[0]['main/inner/loss']
                    losses.append(float(chainer.backends.cuda.to_cpu(
                        getattr(loss, 'array', loss))))
                finally:
                    model.nap = 0.0
                    if timer is not None:
                        timer.cancel()
        restarts = updater.worker_restarts
        pids = updater.worker_pids()
    finally:
        updater.finalize()
    assert gone_within(pids, 10), 'a worker outlived the updater'
    return {name: chainer.backends.cuda.to_cpu(p.array).copy()
            for name, p in model.namedparams()}, losses, restarts


@pytest.mark.parametrize('when', ['between_updates', 'after_done'])
def test_a_worker_killed_is_replaced(one_gpu, when):
    """3 ranks; the last worker SIGKILLed before update 2 (the master's Step finds it), or
    1 s into it while the master's window sleeps 2 s (it has sent Done, its reduce in
    flight): replaced, the survivor rejoining the rebuilt communicator, the update redone;
    bitwise the uninterrupted run."""
    if 'want' not in _UNINTERRUPTED:
        _UNINTERRUPTED['want'] = _restart_run(3)
    want_params, want_losses, none = _UNINTERRUPTED['want']
    t0 = time.monotonic()
    params, losses, restarts = _restart_run(3, kill=(2, 0.0 if when == 'between_updates'
                                                     else 1.0))
    record(f'restart_{when}', max_diff=max_diff(params, want_params),
           seconds=round(time.monotonic() - t0, 1))
    assert none == 0 and restarts == 1
    assert losses == want_losses
    assert sorted(params) == sorted(want_params)
    for name in want_params:
        assert params[name].tobytes() == want_params[name].tobytes(), name

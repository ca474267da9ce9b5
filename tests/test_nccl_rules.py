"""The NCCL path's rules, on the CuPy-14 stand-in (``_fakecupy.py``), without a GPU.

A review of the NCCL path (issue 34) found where it broke NCCL's or CuPy's rules; each test
here pins one rule, with the stand-in modelling what a GPU would do (devices and streams,
host reads that block, a connected world of NCCL ranks with lazy connection). What only a
GPU shows is in tests/test_nccl_one_gpu.py.

1. A host read during an update waits first, bounded, watching the workers: a dead worker
   (after Step before its bcast; after Done with its reduce in flight) is a WorkerError,
   never a read that blocks for good.
2. Start-up is bounded: the handle carries the timeout and a check of the master; the
   master joins NCCL's rendezvous only once every worker says it joins, within
   ``start_timeout``; a worker that fails or hangs in its build is a WorkerError.
3. The master's kernels (pack, unpack, receiving the sum, the factor, a pipelined
   gradient) run with the master's device current, whichever device is current outside.
4. Buffers that are only broadcast may have dtypes NCCL cannot sum (bool, int16, uint16):
   they move as bytes.
5. The warm-up connects every verb, so the master's first bcast does not wait (on the
   host) for workers that wait for its Step.
6. ``abort()`` returns within a bound even when ncclCommAbort hangs.
7. Teardown waits for the master's collectives in flight before the workers stop.
8. float16 is summed in float32; under a static loss scale a non-finite gradient stops
   the step.
9. A failed start leaves no thread in NCCL's initialisation (the master never entered it).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import types

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import _fakecupy
from mgpu_updater import ParallelAccumulatingUpdater, comm as comms
from mgpu_updater._flat_buffers import ModelLayouts
from mgpu_updater._local import group as group_module
from mgpu_updater._local.protocol import Done, Joining
from mgpu_updater._replica import WindowResult
from mgpu_updater.comm import nccl as nccl_module
from mgpu_updater.comm.nccl import NcclCommunicator, TEST_SWITCH
from mgpu_updater.errors import NonFiniteGradientError, WorkerError

SPEC = {'grad/<f4': ('float32', 5), 'grad/<f2': ('float16', 3)}
MASTER, OTHER = 1, 0   # the master's GPU, and the device current around it


@pytest.fixture
def fake(monkeypatch):
    for name in ('NCCL_HOSTID', 'NCCL_SOCKET_IFNAME', 'NCCL_IB_DISABLE', TEST_SWITCH):
        monkeypatch.delenv(name, raising=False)   # restored after the test
    return _fakecupy.install(monkeypatch)


def gpu(device_id):
    """What the communicator factory reads of a Chainer GpuDevice."""
    return types.SimpleNamespace(xp=object(), device=types.SimpleNamespace(id=device_id))


# ------------------------------------------------------------------ the master's group
class FakePool:
    """The worker pool, as the local group uses it, with no process behind it: what each
    worker says is scripted. ``dead``: ranks whose process is gone (``check_alive``
    raises, as the real pool's does); ``failed``: ranks that sent Failed (``check``
    raises); ``silent``: ranks that never say Joining (stuck in their build);
    ``on_done``: called once the Done messages are taken."""

    def __init__(self, devices, start_method):
        self.devices = list(devices)
        self.ranks = list(range(1, len(devices)))
        self.sent, self.events = [], []
        self.dead, self.failed, self.silent = set(), {}, set()
        self.on_done = None
        self.fake = None

    def start(self, target, payloads, shm_names, timeout, before_ready=None):
        self.events.append('start')
        before_ready()
        return {r: None for r in self.ranks}

    def gather(self, kind, timeout=None, what='update', ranks=None):
        self.events.append(('gather', kind))
        self.check(what)
        if kind == Joining.KIND and self.silent:
            time.sleep(timeout)
            late = sorted(self.silent)
            raise WorkerError(f'no answer within {timeout:.0f} s during {what} (still '
                              f'waiting for replicas {late})', replica=late[0],
                              device=self.devices[late[0]])
        out = {r: result(r) if kind == Done.KIND else None for r in ranks or self.ranks}
        if kind == Done.KIND and self.on_done is not None:
            self.on_done()
        return out

    def send(self, msg, ranks=None):
        self.sent.append(msg[0])

    def check(self, what='update', waiting=()):
        for rank, tb in sorted(self.failed.items()):
            raise WorkerError(f'failed during {what}', replica=rank,
                              device=self.devices[rank], remote_traceback=tb)
        self.check_alive()

    def check_alive(self):
        for rank in sorted(self.dead):
            raise WorkerError('the worker process (pid 4242) was killed by SIGKILL',
                              replica=rank, device=self.devices[rank], exitcode=-9)

    def pids(self):
        return []

    def close(self):
        self.events.append(('close', self.fake.pending_polls if self.fake else None))


def result(rank, count=4, loss=0.5):
    return WindowResult(count=count, loss_sum=loss * count, sums={}, weights={}, times={},
                        epochs=[])


def on_gpu(fake, model, device):
    """Give every parameter (and its gradient) and every array persistent a stand-in array
    on ``device``, as Chainer's ``to_device`` moves both."""
    def moved(host):
        array = fake.zeros(host.shape, host.dtype)
        numpy.ndarray.__setitem__(array, Ellipsis, host)
        return array

    with fake.cuda.Device(device):
        for param in model.params():
            param.array = moved(param.array)
            param.grad = fake.zeros(param.shape, param.dtype)
        for link in model.links():
            for name in link._persistent:
                value = link.__dict__[name]
                if isinstance(value, numpy.ndarray):
                    link.__dict__[name] = moved(value)
    return model


def master_group(fake, monkeypatch, model=None, size=2, start_timeout=5.0, pipelined=False,
                 pool=None):
    """A local group on the NCCL backend whose master is on device 1, with a FakePool."""
    model = model if model is not None else on_gpu(fake, L.Linear(3, 2), MASTER)
    pool = pool or FakePool([f'@cupy:{MASTER}'] + ['@cupy:0'] * (size - 1), 'spawn')
    pool.fake = fake
    monkeypatch.setattr(group_module, 'WorkerPool', lambda devices, method, *stall: pool)
    layouts = ModelLayouts(model, double_buffered=pipelined)
    group = group_module.LocalGroup(
        model, layouts, 'nccl', gpu(MASTER), pool.devices,
        {r: (lambda handle, board, announce: b'') for r in pool.ranks}, 'spawn',
        start_timeout)
    return group, pool, model


def test_1_a_worker_dead_after_step_is_an_error_before_the_window_is_read(fake, monkeypatch):
    group, pool, _ = master_group(fake, monkeypatch)
    group.begin(None)   # parameters broadcast (enqueued), Step sent
    assert pool.sent == ['step']
    pool.dead.add(1)    # the worker dies before its bcast: ours never completes
    fake.hang = True
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r'replica 1 .*killed by SIGKILL'):
        group.settle()  # what the master's replica calls before it reads its values
    assert time.monotonic() - t0 < 5
    assert fake.comms[0].calls[-1] == ('abort',) and not group.comm.initialized
    with pytest.raises(RuntimeError, match='abandoned after a peer failed'):
        group.comm.bcast(sorted(group.layouts.spec())[0])   # no lazy init into a dead world
    group.close(abort=True)
    assert group.comm.finalized


def test_1_a_worker_dead_after_done_stops_the_update_before_the_step(fake, monkeypatch):
    group, pool, model = master_group(fake, monkeypatch)

    def dies():   # the worker sent Done (its reduce enqueued), then was killed
        pool.dead.add(1)
        fake.hang = True
    pool.on_done = dies
    stepped = []

    def step(count, loss):   # a step that reads on the host (GradientClipping, scaling)
        stepped.append(float(model.W.grad.get().sum()))
    group.begin(None)
    with pytest.raises(WorkerError, match=r'replica 1 .*killed by SIGKILL'):
        group.finish_stepping(result(0), step)
    assert stepped == []
    group.close(abort=True)


def test_1_pipelined_the_update_ends_with_the_reductions_done(fake, monkeypatch):
    group, pool, _ = master_group(fake, monkeypatch, pipelined=True)

    def dies():
        pool.dead.add(1)
        fake.hang = True
    pool.on_done = dies
    group.begin(None, parity=0)
    with pytest.raises(WorkerError, match=r'replica 1 .*killed by SIGKILL'):
        group.finish_async(result(0), 0)   # extensions and the next step read after it
    group.close(abort=True)


def test_1_the_master_settles_just_before_it_reads_its_window_values(monkeypatch):
    """Through the updater (CPU replicas, where settle returns at once): every update
    settles the group right before the master's window values are read."""
    from mgpu_updater import _replica
    from _models import classifier, dataset, setup_optimizer
    calls = []
    read = _replica.read_on_host
    monkeypatch.setattr(_replica, 'read_on_host',
                        lambda values: (calls.append('read'), read(values))[1])
    monkeypatch.setattr(group_module.LocalGroup, 'settle',
                        lambda self: calls.append('settle'))
    model = classifier(seed=0)
    its = [chainer.iterators.SerialIterator(dataset(16, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy', '@numpy'])
    try:
        updater.update()
        updater.update()
    finally:
        updater.finalize()
    reads = [i for i, c in enumerate(calls) if c == 'read']
    assert len(reads) == 2 and all(calls[i - 1] == 'settle' for i in reads), calls


# ------------------------------------------------------------------ 2 and 9: start-up
def test_2_create_and_attach_bound_every_wait_and_watch_the_master(fake):
    master, handle = comms.create('nccl', 2, SPEC, gpu(0), timeout=7.0)
    handle = pickle.loads(pickle.dumps(handle))   # as the spawn payload carries it
    worker = comms.attach('nccl', handle, 1, gpu(1))
    assert master.timeout == worker.timeout == 7.0
    assert handle.master_pid == os.getpid()
    worker.check_peer_alive()   # the master (this process) is alive
    gone = subprocess.Popen([sys.executable, '-c', 'pass'])
    gone.wait()
    orphan = comms.attach('nccl', handle._replace(master_pid=gone.pid), 1, gpu(1))
    with pytest.raises(RuntimeError, match=rf'the master process \(pid {gone.pid}\) is gone'):
        orphan.check_peer_alive()
    for comm in (master, worker, orphan):
        comm.finalize()


def test_2_the_masters_rendezvous_is_within_start_timeout(fake, monkeypatch):
    fake.cuda.nccl.NcclCommunicator.block = threading.Event()   # a worker never joins
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r'NCCL initialisation .* within 0.[0-9]+ s on '
                                           r'rank 0'):
        master_group(fake, monkeypatch, start_timeout=0.6)
    assert time.monotonic() - t0 < 4
    fake.cuda.nccl.NcclCommunicator.block.set()


def test_2_a_worker_failing_in_its_build_is_an_error_at_once(fake, monkeypatch):
    pool = FakePool([f'@cupy:{MASTER}', '@cupy:0'], 'spawn')
    pool.failed[1] = 'Traceback (most recent call last):\nValueError: bad dataset\n'
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r'(?s)replica 1 .*failed during start.*bad dataset'):
        master_group(fake, monkeypatch, pool=pool, start_timeout=30)
    assert time.monotonic() - t0 < 4
    assert fake.comms == []   # the master never entered NCCL's rendezvous


def test_9_a_worker_stuck_in_its_build_leaves_no_thread_in_nccl_init(fake, monkeypatch):
    fake.cuda.nccl.NcclCommunicator.block = threading.Event()   # NCCL would wait for good
    pool = FakePool([f'@cupy:{MASTER}', '@cupy:0'], 'spawn')
    pool.silent.add(1)
    with pytest.raises(WorkerError, match=r'no answer within 1 s during start'):
        master_group(fake, monkeypatch, pool=pool, start_timeout=0.6)
    assert fake.comms == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith('nccl-init')]
    assert pool.events[-1][0] == 'close'
    fake.cuda.nccl.NcclCommunicator.block.set()


# ------------------------------------------------------------------ 3: the current device
def test_3_every_master_kernel_runs_on_the_masters_device(fake, monkeypatch):
    group, pool, model = master_group(fake, monkeypatch)
    seen = []

    def step(count, loss):   # the updater's step: the factor on param.grad, then the rule
        seen.append(fake.cuda.Device().id)
        for param in model.params():
            param.grad *= 0.5
    with fake.cuda.Device(OTHER):   # another device current outside, as with devices=[1, 0]
        for _ in range(2):
            group.begin(None)
            group.finish_stepping(result(0), step)
        group.finish(result(0)) if False else None
    assert seen == [MASTER, MASTER]
    assert fake.kernels and fake.cross_device() == []
    group.close()


def test_3_pipelined_gradients_are_copied_on_the_masters_device(fake, monkeypatch):
    group, pool, model = master_group(fake, monkeypatch, pipelined=True)
    with fake.cuda.Device(OTHER):
        group.begin(None, parity=0)
        _, handle = group.finish_async(result(0), 0)
        handle.apply(model)
        kept = handle.detached()
        assert {g._device for g in kept.wait().values()} == {MASTER}
        kept.apply(model)
    assert fake.cross_device() == []
    group.close()


# ------------------------------------------------------------------ 4: dtypes NCCL cannot sum
class WithFlags(chainer.Link):
    """A link with persistents of dtypes NCCL cannot sum."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)
        self.add_persistent('mask', numpy.array([True, False, True]))
        self.add_persistent('steps', numpy.array([7, -3], dtype=numpy.int16))
        self.add_persistent('bins', numpy.array([65535, 1], dtype=numpy.uint16))


def test_4_broadcast_only_buffers_of_any_dtype_move_as_bytes(fake):
    _fakecupy.connect_ranks(fake, timeout=10)
    spec = {'param/|b1': ('bool', 3), 'param/<i2': ('int16', 2), 'param/<u2': ('uint16', 2),
            'grad/<f4': ('float32', 2)}
    bcast_only = ['param/<i2', 'param/<u2', 'param/|b1']
    master, handle = comms.create('nccl', 2, spec, gpu(0), broadcast=bcast_only, timeout=10)
    worker = comms.attach('nccl', handle, 1, gpu(1))
    sent = {'param/|b1': [True, False, True], 'param/<i2': [7, -3],
            'param/<u2': [65535, 1]}
    got = {}

    def run(comm):
        comm.init()
        for name in sorted(sent):
            if comm.rank == 0:
                comm.buffer(name)[...] = sent[name]
            comm.bcast(name)
        got[comm.rank] = {n: comm.buffer(n).tolist() for n in sorted(sent)}

    threads = [threading.Thread(target=run, args=(c,)) for c in (master, worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got[0] == got[1] == sent
    with pytest.raises(TypeError, match=r"buffer 'param/<i2' was created broadcast-only "
                                        r'\(its dtype int16 moves as bytes\): it cannot be '
                                        r'reduced'):
        master.reduce('param/<i2')
    master.finalize()
    worker.finalize()


def test_4_a_model_with_bool_and_int16_persistents_gets_a_group(fake, monkeypatch):
    model = on_gpu(fake, WithFlags(), MASTER)
    group, pool, _ = master_group(fake, monkeypatch, model=model)
    group.begin(None)
    group.finish_stepping(result(0), lambda count, loss: None)
    group.close()


# ------------------------------------------------------------------ 5: warm-up and Step
def test_5_the_first_bcast_does_not_wait_on_the_host_for_the_step(fake):
    """NCCL >= 2.22 connects lazily: the master's first bcast of update 1 would connect
    the rings, on the host, with workers that only call bcast once they have its Step."""
    _fakecupy.connect_ranks(fake, asynchronous=True, timeout=3)
    uid = NcclCommunicator.new_unique_id()
    master, worker = (NcclCommunicator(r, 2, r, SPEC, uid, timeout=10) for r in (0, 1))
    step = threading.Event()
    errors = []

    def rank(comm):
        try:
            comm.init()                     # the start-up handshake: every rank is there
            if comm.rank == 0:
                comm.bcast('grad/<f4')      # master_begin: parameters out ...
                step.set()                  # ... then Step
            else:
                assert step.wait(10)        # the worker's bcast comes after Step
                comm.bcast('grad/<f4')
            comm.wait()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(c,)) for c in (master, worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    master.finalize()
    worker.finalize()


# ------------------------------------------------------------------ 6: abort, bounded
def test_6_abort_returns_when_nccl_comm_abort_hangs(fake, monkeypatch):
    monkeypatch.setattr(nccl_module, '_ABORT_TIMEOUT', 0.3, raising=False)
    fake.cuda.nccl.NcclCommunicator.abort_block = threading.Event()
    comm = NcclCommunicator(0, 1, 0, SPEC, bytes(128))
    comm.init()
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r'ncclCommAbort on rank 0 did not return within '
                                            r'0.3 s; leaving it to process exit'):
        comm.abort()
    assert time.monotonic() - t0 < 2 and comm.finalized
    fake.cuda.nccl.NcclCommunicator.abort_block.set()


# ------------------------------------------------------------------ 7: teardown order
def test_7_teardown_waits_for_the_masters_collectives_before_stopping_workers(fake,
                                                                              monkeypatch):
    group, pool, _ = master_group(fake, monkeypatch)
    group.begin(None)          # the parameters' bcast is in flight
    fake.pending_polls = 5     # ... for a while yet
    group.close()
    assert pool.events[-1] == ('close', 0)   # done before the workers were told to stop


# ------------------------------------------------------------------ 8: float16, inf
def test_8_float16_is_summed_in_float32(fake):
    """Three float16 gradients whose partial sum overflows float16 (65504) in NCCL's
    ring: summed in float32 the total is exact."""
    _fakecupy.connect_ranks(fake, timeout=10)
    uid = NcclCommunicator.new_unique_id()
    values = {0: 40000.0, 1: 40000.0, 2: -40000.0}
    out = {}

    def rank(r):
        comm = NcclCommunicator(r, 3, r, {'grad/<f2': ('float16', 2)}, uid, timeout=10)
        comm.buffer('grad/<f2')[...] = values[r]
        comm.reduce('grad/<f2')
        out[r] = comm.buffer('grad/<f2').copy()
        comm.finalize()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert out[0].dtype == numpy.float16 and out[0].tolist() == [40000.0, 40000.0]
    assert fake.comms[0].calls[-2][4] == fake.cuda.nccl.NCCL_FLOAT32   # then destroy


def _overflowing_updater(nonfinite):
    """One CPU replica whose gradient overflows float32 under a static loss scale while
    its loss stays finite."""
    model = L.Classifier(L.Linear(2, 2), lossfun=lambda y, t: F.sum(y) * 0 + F.sum(y[:, 0]))
    opt = chainer.optimizers.SGD(0.1).setup(model)
    opt.loss_scaling(scale=1e38)   # static
    x = numpy.full((4, 2), 1e3, dtype=numpy.float32)
    data = chainer.datasets.TupleDataset(x, numpy.zeros(4, dtype=numpy.int32))
    it = chainer.iterators.SerialIterator(data, 4)
    return ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], nonfinite=nonfinite), model


@pytest.mark.parametrize('nonfinite', ['raise', 'skip'])
def test_8_a_static_loss_scale_never_lets_inf_reach_the_parameters(nonfinite):
    updater, model = _overflowing_updater(nonfinite)
    before = model.predictor.W.array.copy()
    try:
        with numpy.errstate(over='ignore', invalid='ignore'):
            if nonfinite == 'raise':
                with pytest.raises(NonFiniteGradientError,
                                   match=r'summed gradient of update 1 holds inf or NaN under '
                                         r'the static loss scale 1e\+38'):
                    updater.update()
            else:
                with pytest.warns(RuntimeWarning, match=r'skipping update 1: the summed '
                                                        r'gradient holds inf or NaN'):
                    updater.update()
    finally:
        updater.finalize()
    numpy.testing.assert_array_equal(model.predictor.W.array, before)


# ------------------------------------------------------------------ (b) the test mode
def test_without_the_switch_a_repeated_gpu_stays_on_shared_memory(fake, monkeypatch):
    devices = [gpu(0), gpu(0)]
    assert comms.backend_for(devices) == 'shm'
    monkeypatch.setenv(TEST_SWITCH, '0')
    assert comms.backend_for(devices) == 'shm'
    master, handle = comms.create('nccl', 2, SPEC, gpu(0))   # distinct GPUs: as before
    assert not handle.as_hosts and 'NCCL_HOSTID' not in os.environ
    assert 'NCCL_SOCKET_IFNAME' not in os.environ
    master.finalize()


def test_with_the_switch_a_repeated_gpu_takes_nccl(fake, monkeypatch):
    monkeypatch.setenv(TEST_SWITCH, '1')
    assert comms.backend_for([gpu(0), gpu(0), gpu(0)]) == 'nccl'


def _ranks_on_one_gpu(fake, size):
    """Every rank on GPU 0, in threads, each created (and its environment read) in turn,
    as separate processes would: the master by ``comm.create``, workers by
    ``comm.attach``. Returns each rank's communicator and what failed."""
    _fakecupy.connect_ranks(fake, timeout=5)
    master, handle = comms.create('nccl', size, SPEC, gpu(0), timeout=10)
    handle = pickle.loads(pickle.dumps(handle))
    made, errors, threads = {0: master}, [], []

    def join(comm):
        try:
            comm.init()
        except BaseException as e:
            errors.append(e)

    for rank in range(size):
        if rank:
            made[rank] = comms.attach('nccl', handle, rank, gpu(0))
        threads.append(threading.Thread(target=join, args=(made[rank],)))
        threads[-1].start()
        for _ in range(500):   # its NCCL communicator read the environment
            if len(fake.comms) > rank or errors:
                break
            time.sleep(0.01)
    for t in threads:
        t.join(20)
    return made, errors


def test_nccl_refuses_ranks_that_share_a_gpu_and_a_host(fake, monkeypatch):
    _, errors = _ranks_on_one_gpu(fake, 2)
    assert errors and all(isinstance(e, RuntimeError) for e in errors)
    assert any('NCCL_ERROR_INVALID_USAGE' in str(e.__cause__) for e in errors)


@pytest.mark.parametrize('size', [2, 3])
def test_with_the_switch_each_rank_acts_as_its_own_host(fake, monkeypatch, size):
    monkeypatch.setenv(TEST_SWITCH, '1')
    made, errors = _ranks_on_one_gpu(fake, size)
    assert not errors, errors
    assert [c.host_id for c in fake.comms] == [f'mgpu-test-rank-{r}' for r in range(size)]
    assert os.environ['NCCL_SOCKET_IFNAME'] == 'lo' and os.environ['NCCL_IB_DISABLE'] == '1'
    for comm in made.values():
        comm.finalize()


def test_the_master_decides_the_mode_for_its_workers(fake, monkeypatch):
    """A worker follows the handle, not its own environment: spawn copied the master's."""
    monkeypatch.setenv(TEST_SWITCH, '1')
    _, handle = comms.create('nccl', 2, SPEC, gpu(0))
    monkeypatch.delenv(TEST_SWITCH)
    monkeypatch.delenv('NCCL_HOSTID')
    comms.attach('nccl', handle, 1, gpu(0))
    assert os.environ['NCCL_HOSTID'] == 'mgpu-test-rank-1'

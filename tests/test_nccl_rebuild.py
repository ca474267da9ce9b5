"""A worker that dies on the NCCL backend, under ``max_worker_restarts``, on the CuPy-14
stand-in (``_fakecupy.py``), without a GPU.

A dead rank leaves an NCCL communicator unusable, and the collectives that wait for it
stuck on the GPU of every other rank. What must happen (``_local/recovery.py``):

1. The communicator: every surviving rank aborts its NCCL communicator (which ends its
   stuck collectives, so its streams go on and its host can read again) and keeps its
   buffers; none issues a collective (no lazy init into the dead world) until the master
   rebuilds with a fresh unique id and the survivors rejoin, all at once with the new
   rank; then the collectives of the new world give the right values.
2. The master's group: a death found while the master's window waits for its bcast is
   kept and recovered after the window; the master abandons, rewinds the survivors,
   rebuilds, starts the replacement with the new handle, tells the survivors to rejoin
   with that handle, joins itself, and redoes the update, whose step runs once.
3. The worker: its wait before it reads its window's values gives the window up when the
   master sends a message (a Rewind) or NCCL reports a failed peer; a Rewind abandons the
   communicator before the iterator goes back, a Rejoin joins the new one.

What only real NCCL shows (ranks on one GPU, a SIGKILLed worker, bitwise equal to the
uninterrupted run) is tests/test_nccl_one_gpu.py::test_a_worker_killed_is_replaced.
"""
from __future__ import annotations

import pickle
import threading
import types

import numpy
import pytest

import chainer
import chainer.links as L

import _fakecupy
from mgpu_updater import comm as comms
from mgpu_updater._flat_buffers import ModelLayouts
from mgpu_updater._local import group as group_module
from mgpu_updater._local import worker as worker_module
from mgpu_updater._local.protocol import (Abandoned, Done, Joining, Rejoin, Rejoined, Rewind,
                                          Rewound, Shipment, Stop)
from mgpu_updater._local.resume import Change
from mgpu_updater._replica import WindowResult
from mgpu_updater._restarts import RestartLog
from mgpu_updater.comm.nccl import TEST_SWITCH
from mgpu_updater.errors import WorkerError

SPEC = {'param/<f4': ('float32', 3), 'grad/<f4': ('float32', 4)}
BCAST = ['param/<f4']


@pytest.fixture
def fake(monkeypatch):
    for name in ('NCCL_HOSTID', 'NCCL_SOCKET_IFNAME', 'NCCL_IB_DISABLE', TEST_SWITCH):
        monkeypatch.delenv(name, raising=False)
    return _fakecupy.install(monkeypatch)


def gpu(device_id):
    return types.SimpleNamespace(xp=object(), device=types.SimpleNamespace(id=device_id))


def at_once(*calls, timeout=20):
    """Run each call in a thread of its own (a rank each), all at once; re-raise the
    first error."""
    errors = []

    def run(call):
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), 'a rank is still waiting'
    if errors:
        raise errors[0]


def nccl_comm_of(fake, unique_id, rank):
    [comm] = [c for c in fake.comms if c.args[1] == unique_id and c.args[2] == rank]
    return comm


# ------------------------------------------------------------------ 1: the communicator
def test_a_dead_rank_is_replaced_by_a_rebuilt_communicator(fake):
    _fakecupy.connect_ranks(fake, asynchronous=True, timeout=5)
    master, handle = comms.create('nccl', 3, SPEC, gpu(0), broadcast=BCAST, timeout=10)
    handle = pickle.loads(pickle.dumps(handle))   # as the payload carries it
    one, two = (comms.attach('nccl', handle, r, gpu(r)) for r in (1, 2))
    at_once(master.init, one.init, two.init)
    old = handle.unique_id

    # rank 2 dies before its bcast: the master's and rank 1's never finish
    master.buffer('param/<f4')[...] = [1.0, 2.0, 3.0]
    master.bcast('param/<f4')
    one.bcast('param/<f4')
    assert not master.poll() and not one.poll()

    def dead():
        raise WorkerError('the worker process (pid 7) was killed by SIGKILL', replica=2,
                          device='@cupy:2', exitcode=-9)
    master.check_peer_alive = dead
    with pytest.raises(WorkerError, match='killed by SIGKILL'):
        master.wait()
    assert nccl_comm_of(fake, old, 0).calls[-1] == ('abort',)

    def told():   # the master's Rewind came (the worker's check, worker._give_up_on_message)
        raise Abandoned('the master sent a message during the update')
    one.check_peer_alive = told
    with pytest.raises(Abandoned):
        one.wait()
    assert nccl_comm_of(fake, old, 1).calls[-1] == ('abort',)
    # the aborts ended the stuck bcasts: the hosts read the buffers again (the stand-in's
    # default stream is one for every device, so this needs both aborts)
    assert master.buffer('param/<f4').get().tolist() == [1.0, 2.0, 3.0]
    for comm in (master, one):   # no collective, above all no lazy init into the old world
        assert not comm.initialized and not comm.finalized
        with pytest.raises(RuntimeError, match=r'abandoned after a peer failed'):
            comm.reduce('grad/<f4')

    renewed = master.rebuild()
    assert renewed.unique_id != old and type(renewed.unique_id) is bytes
    assert renewed._replace(unique_id=old) == handle   # all else as the first handle
    with pytest.raises(RuntimeError, match="rebuild\\(\\) is the master's"):
        one.rebuild()
    master.check_peer_alive = one.check_peer_alive = None
    new = comms.attach('nccl', pickle.loads(pickle.dumps(renewed)), 2, gpu(2))
    at_once(master.init, lambda: one.rejoin(renewed), new.init)
    assert {c.args[2] for c in fake.comms if c.args[1] == renewed.unique_id} == {0, 1, 2}

    ranks = [master, one, new]
    for rank, comm in enumerate(ranks):
        comm.buffer('grad/<f4')[...] = rank + 1

    def update(comm):
        comm.bcast('param/<f4')
        comm.reduce('grad/<f4')
        comm.wait()
    at_once(*[lambda c=c: update(c) for c in ranks])
    assert master.buffer('grad/<f4').get().tolist() == [6.0] * 4
    assert new.buffer('param/<f4').get().tolist() == [1.0, 2.0, 3.0]
    assert one.buffer('param/<f4').get().tolist() == [1.0, 2.0, 3.0]
    for comm in ranks:
        comm.finalize()
    assert two.initialized   # the dead rank's own object was never touched


def test_a_rejoin_refuses_a_handle_that_is_no_unique_id(fake):
    master, handle = comms.create('nccl', 2, SPEC, gpu(0), timeout=5)
    worker = comms.attach('nccl', handle, 1, gpu(1))
    with pytest.raises(TypeError, match=r"the rebuilt handle's unique_id must be the 128 "
                                        r'bytes'):
        worker.rejoin(handle._replace(unique_id=tuple(handle.unique_id)))
    master.finalize()
    worker.finalize()


# ------------------------------------------------------------------ 2: the master's group
class RestartingPool:
    """The worker pool as the local group uses it under max_worker_restarts, with no
    process behind it: ``dead`` ranks' processes are gone (``check`` raises as the real
    pool's does); what each worker says is scripted, and every call logged."""

    def __init__(self, devices):
        self.devices = list(devices)
        self.ranks = list(range(1, len(devices)))
        self.dead = set()
        self.log = []
        self.gather_hook = None   # called as each Done is taken
        self.replaced_ready = {}  # what each replacement's Ready said (nothing differs)

    def start(self, target, payloads, shm_names, timeout, before_ready=None):
        before_ready()
        return {r: () for r in self.ranks}   # each Ready's differences: none

    def gather(self, kind, timeout=None, what='update', ranks=None):
        self.check(what)
        ranks = list(ranks or self.ranks)
        self.log.append(('gather', kind, ranks))
        if kind == Done.KIND and self.gather_hook is not None:
            self.gather_hook()
        # under restarts a Done carries a Shipment: the result, and where the next starts
        return {r: Shipment(result(r), Change(False, {})) if kind == Done.KIND else None
                for r in ranks}

    def send(self, msg, ranks=None):
        self.check()
        self.log.append(('send', msg, list(ranks or self.ranks)))

    def check(self, what='update', waiting=()):
        for rank in sorted(self.dead):
            raise self.death(rank)

    def check_alive(self):
        self.check()

    def dead_ranks(self):
        return sorted(self.dead)

    def death(self, rank):
        return WorkerError('the worker process (pid 4242) was killed by SIGKILL',
                           replica=rank, device=self.devices[rank], exitcode=-9)

    def rewind(self, ranks, message, reply, drop):
        self.log.append(('rewind', message, list(ranks), reply))
        return []

    def replace(self, target, payloads, shm_names, timeout, before_ready=None):
        self.log.append(('replace', sorted(payloads)))
        self.dead.clear()
        before_ready()
        self.replaced_ready = {rank: () for rank in payloads}
        return {rank: 5000 + rank for rank in payloads}

    def pids(self):
        return []

    def close(self):
        self.log.append(('close',))


def result(rank, count=4, loss=0.5):
    return WindowResult(count=count, loss_sum=loss * count, sums={}, weights={}, times={},
                        epochs=[])


class Payload:
    """A worker's payload: records the handle each pickling was given."""

    def __init__(self):
        self.iterator = chainer.iterators.SerialIterator(list(range(8)), 2, shuffle=False)
        self.handles = []

    def __call__(self, handle, board=None, announce_packs=False, resume=None,
                 chunk_size=None):
        self.handles.append(handle)
        return b''


class WithStats(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(3, 2)
            self.bn = L.BatchNormalization(2)


def restarting_group(fake, monkeypatch):
    """The master's group of 3 ranks on NCCL (the master on device 1) under
    ``max_worker_restarts=1``, its model's parameters, gradients and statistics on the
    stand-in's device 1; ``fake.hang``, global in the stand-in, ends where an NCCL
    communicator is aborted, as ncclCommAbort ends the collectives stuck on a dead rank."""
    model = WithStats()
    with fake.cuda.Device(1):
        for param in model.params():
            array = fake.zeros(param.shape, param.dtype)
            numpy.ndarray.__setitem__(array, Ellipsis, param.array)
            grad = fake.zeros(param.shape, param.dtype)
            numpy.ndarray.__setitem__(grad, Ellipsis, numpy.arange(param.size).reshape(
                param.shape) + 1)
            param.array, param.grad = array, grad
        for name in ('avg_mean', 'avg_var'):
            array = fake.zeros((2,), numpy.float32)
            numpy.ndarray.__setitem__(array, Ellipsis, [0.25, 0.5])
            setattr(model.bn, name, array)
    abort = fake.cuda.nccl.NcclCommunicator.abort

    def aborted(comm):
        abort(comm)
        fake.hang = False
    monkeypatch.setattr(fake.cuda.nccl.NcclCommunicator, 'abort', aborted)
    pool = RestartingPool(['@cupy:1', '@cupy:0', '@cupy:0'])
    monkeypatch.setattr(group_module, 'WorkerPool', lambda devices, method, *stall: pool)
    payloads = {1: Payload(), 2: Payload()}
    group = group_module.LocalGroup(
        model, ModelLayouts(model), 'nccl', gpu(1), pool.devices, payloads, 'spawn', 5.0,
        restarts=RestartLog(1))
    group.recovery.log.update = 1
    pool.log.clear()   # the start's
    return group, pool, payloads, model


def test_the_master_rebuilds_with_a_fresh_id_and_redoes_the_update(fake, monkeypatch):
    group, pool, payloads, model = restarting_group(fake, monkeypatch)
    first = group.comm.handle
    assert [p.handles for p in payloads.values()] == [[first], [first]]

    group.begin(None)
    pool.dead.add(1)    # replica 1 dies before its bcast: the master's never finishes
    fake.hang = True
    group.settle()      # the master's window reads its values: the death is kept
    assert nccl_comm_of(fake, first.unique_id, 0).calls[-1] == ('abort',)
    assert not fake.hang   # ncclCommAbort ended the bcast
    steps = []
    with pytest.warns(Warning, match='replica 1'):
        others = group.finish_stepping(result(0), lambda count, loss: steps.append(count))
    assert steps == [12] and len(others) == 3   # the update, redone, stepped once

    renewed = group.comm.handle
    assert renewed.unique_id != first.unique_id
    assert payloads[1].handles == [first, renewed] and payloads[2].handles == [first]
    events = [e[:2] if e[0] != 'send' else ('send', e[1][0], e[2]) for e in pool.log]
    assert events == [
        ('send', 'step', [1, 2]),
        ('rewind', Rewind()),                 # the survivor goes back ...
        ('replace', [1]),                     # ... the dead rank's replacement starts,
        ('gather', Joining.KIND),             # says it joins,
        ('send', 'rejoin', [2]),              # the survivor is told to rejoin,
        ('gather', Rejoined.KIND),            # (the master joined meanwhile)
        ('send', 'step', [1, 2]),             # and the update is redone
        ('gather', Done.KIND)], pool.log
    rejoin = [e[1] for e in pool.log if e[0] == 'send' and e[1][0] == 'rejoin'][0]
    assert rejoin == Rejoin(renewed)
    assert nccl_comm_of(fake, renewed.unique_id, 0).args[0] == 3   # the master joined it
    assert [r.replica for r in group.recovery.log.restarts] == [1]
    group.close()


def test_a_death_found_after_the_reductions_leaves_the_masters_gradient_for_the_redo(
        fake, monkeypatch):
    """Replica 2 dies after its Done, its reduce in flight: the master's reductions never
    finish, and an aborted in-place reduce leaves the master's buffers undefined. The
    master finds the death in its wait for them, before their sums reach its model, so
    the redo packs its own gradient and statistics again (the stand-in's reduce of an
    unconnected rank leaves the buffer as packed: the step sees the master's own)."""
    group, pool, payloads, model = restarting_group(fake, monkeypatch)
    own = {name: numpy.asarray(p.grad).copy() for name, p in model.namedparams()}
    stats = numpy.asarray(model.bn.avg_mean).copy()
    comm = group.comm

    def dies():
        if pool.dead or len([e for e in pool.log if e[:2] == ('gather', Done.KIND)]) > 1:
            return
        pool.dead.add(2)
        fake.hang = True
        for name in group.layouts.spec():   # what an aborted reduce may leave
            if not name.startswith('param'):
                numpy.ndarray.__setitem__(comm.buffer(name), Ellipsis, 1e6)
    pool.gather_hook = dies
    seen = {}

    def step(count, loss):
        seen.update({name: numpy.asarray(p.grad).copy() for name, p in model.namedparams()})
    group.begin(None)
    with pytest.warns(Warning, match='replica 2'):
        group.finish_stepping(result(0), step)
    assert [r.replica for r in group.recovery.log.restarts] == [2]
    assert [e[0] for e in pool.log].count('replace') == 1
    for name in own:
        assert seen[name].tolist() == own[name].tolist(), name
    assert numpy.all(numpy.abs(numpy.asarray(model.bn.avg_mean)) <= numpy.abs(stats))
    group.close()


# ------------------------------------------------------------------ 3: the worker
class Conn:
    """A worker's end of the pipe: ``messages`` to read (pickled as the master's Encoder
    sends them); ``ready`` says whether a message waits; what the worker sends is kept."""

    def __init__(self, messages=(), ready=False):
        self.messages = [pickle.dumps(m) for m in messages]
        self.ready = ready
        self.sent = []

    def poll(self, timeout=0):
        return self.ready or bool(self.messages)

    def recv_bytes(self):
        return self.messages.pop(0)

    def send(self, msg):
        self.sent.append(msg)


def two_ranks(fake):
    _fakecupy.connect_ranks(fake, asynchronous=True, timeout=5)
    master, handle = comms.create('nccl', 2, SPEC, gpu(0), broadcast=BCAST, timeout=10)
    worker = comms.attach('nccl', handle, 1, gpu(1))
    at_once(master.init, worker.init)
    return master, worker, handle


def test_a_worker_waiting_on_a_dead_peer_gives_its_window_up_at_the_masters_message(fake):
    master, worker, handle = two_ranks(fake)
    replica = types.SimpleNamespace(before_read=None)
    conn = Conn()
    worker_module._give_up_on_message(conn, replica, worker)
    worker.bcast('param/<f4')   # the master never issues its own: stuck
    conn.ready = True           # its Rewind arrives
    with pytest.raises(Abandoned):
        replica.before_read()
    assert nccl_comm_of(fake, handle.unique_id, 1).calls[-1] == ('abort',)
    assert not worker.initialized and not worker.finalized
    master.abort()
    worker.finalize()


def test_a_worker_told_by_nccl_that_a_peer_failed_gives_its_window_up(fake):
    master, worker, handle = two_ranks(fake)
    replica = types.SimpleNamespace(before_read=None)
    worker_module._give_up_on_message(Conn(), replica, worker)
    worker.bcast('param/<f4')
    nccl_comm_of(fake, handle.unique_id, 1).async_error = 'NCCL_ERROR_REMOTE_ERROR'
    with pytest.raises(Abandoned, match='asynchronous error on rank 1'):
        replica.before_read()
    assert not worker.initialized
    master.abort()
    worker.finalize()


class Recorder:
    """A communicator, a keeper and a loader that log what the worker calls."""

    def __init__(self):
        self.log = []
        self.rejoins = True

    def abandon(self):
        self.log.append('abandon')

    def rejoin(self, handle):
        self.log.append(('rejoin', handle))

    def rewind(self, replica, make_loader):
        self.log.append('rewind')

    def release(self):
        pass

    def hold(self):
        pass


def test_a_worker_abandons_before_it_rewinds_and_rejoins_with_the_masters_handle():
    rec = Recorder()
    replica = types.SimpleNamespace(loader=types.SimpleNamespace(
        release=rec.release, hold=rec.hold, device=None),
        look_again=lambda: rec.log.append('look again'))
    init = types.SimpleNamespace(size=3, announce_packs=False)
    conn = Conn([Rewind(), Rejoin('the new handle'), Stop()])
    worker_module._answer(conn, init, replica, rec, layouts=None, views=None, board=None,
                          keeper=rec)
    assert rec.log == ['abandon', 'rewind', 'look again', ('rejoin', 'the new handle')]
    assert [m[0] for m in conn.sent] == [Rewound.KIND, Rejoined.KIND]

"""``max_worker_restarts`` in one process: the argument, snapshots across restarts, the
path without a board, and the pieces (resume points, the board, the ledger).

The fault scenarios in fresh processes (a worker SIGKILLed in its window, its reduce, after
its post, between updates; bitwise against the run uninterrupted; nothing left behind)
are in ``test_faults.py``. Here the workers are SIGKILLed by the test, between updates, or
by a planted fault (``scripts/faults/faulty.py``) once.
"""
from __future__ import annotations

import copy
import os
import pickle
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy
import pytest

import chainer
from chainer.serializers import DictionarySerializer, NpzDeserializer

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError, WorkerRestartWarning
from mgpu_updater._checkpoint import capture_state
from mgpu_updater._local import group as group_module
from mgpu_updater._local.board import Board
from mgpu_updater._local.protocol import Shipment
from mgpu_updater._local.resume import (Change, Keeper, Records, ResumePoint, apply, capture,
                                        difference, restore)
from mgpu_updater._chunks import Chunking
from mgpu_updater._local.group import payload_factory
from mgpu_updater._local.worker import unpickle_payload
from mgpu_updater._replica import WindowResult
from mgpu_updater.comm.shm import ShmCommunicator

sys.path.insert(0, str(Path(__file__).resolve().parent / 'scripts' / 'faults'))
import faulty  # noqa: E402  (spawned workers import it through the same sys.path)


def train(updates, restarts=1, fault=None, kill=None, snapshot_after=None, load=None,
          **kwargs):
    """``updates`` updates of ``faulty.build()`` (2 CPU replicas, shards shuffled each by
    its own generator: a resumed run's master draws the workers' seeds from numpy's global
    one, which Chainer's default shuffling shares in the master); ``kill``
    maps an update index to the replica (or replicas) SIGKILLed just before it. Returns the parameters,
    every reported loss, the updater's iteration and restarts, and the snapshot (a dict)
    taken after ``snapshot_after`` updates; ``load``: a snapshot to resume from first."""
    numpy.random.seed(0)
    updater = faulty.build(fault=fault, max_worker_restarts=restarts, own_orders=True,
                           **kwargs)
    out = {'losses': [], 'snapshot': None}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always', WorkerRestartWarning)
            _train(updater, updates, kill, snapshot_after, load, out)
        out['warnings'] = [str(w.message) for w in caught
                           if issubclass(w.category, WorkerRestartWarning)]
        assert len(out['warnings']) == updater.worker_restarts
        model = updater.get_optimizer('main').target
        out['params'] = {name: p.array.copy() for name, p in model.namedparams()}
        out['iteration'], out['restarts'] = updater.iteration, updater.worker_restarts
        out['epoch_detail'] = updater.epoch_detail
    finally:
        updater.finalize()
    return out


def _train(updater, updates, kill, snapshot_after, load, out):
    if load is not None:
        updater.serialize(NpzDeserializer(load))
    while updater.iteration < updates:
        victims = (kill or {}).get(updater.iteration, ())
        for victim in (victims,) if isinstance(victims, int) else victims:
            os.kill(updater.worker_pids()[victim - 1], signal.SIGKILL)
        if victims:
            time.sleep(0.2)   # dead, not noticed yet
        observation = {}
        with chainer.Reporter().scope(observation):
            updater.update()
        out['losses'].append(observation['main/loss'])
        if updater.iteration == snapshot_after:
            out['snapshot'] = snapshot(updater)


def snapshot(updater):
    """The updater's snapshot, as a dict of copies (a DictionarySerializer keeps the
    arrays it is given, which go on changing)."""
    target = {}
    updater.serialize(DictionarySerializer(target))
    return {key: numpy.array(value, copy=True) for key, value in target.items()}


def same_params(a, b):
    return sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.fixture(scope='module')
def uninterrupted():
    """12 updates (one and a half epochs) without a restart: the reference."""
    return train(12, restarts=0)


# ------------------------------------------------------------------ the argument
class _ChainerMnLike:
    """ChainerMN's shape (``rank``, ``size``, ``mpi_comm`` with the verbs, ``bcast_obj``)."""
    rank, size = 0, 1

    class mpi_comm:
        def Allreduce(self, *args, **kwargs):
            raise AssertionError('not called')
        Bcast = Reduce = allgather = Allreduce
    mpi_comm = mpi_comm()

    def bcast_obj(self, obj, root=0):
        raise AssertionError('not called')


def _build(**kwargs):
    model = faulty.Net()
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    return ParallelAccumulatingUpdater(
        chainer.iterators.SerialIterator(faulty.Dataset(8), 2), optimizer,
        devices=['@numpy'], **kwargs)


@pytest.mark.parametrize('value, error, message', [
    (-1, ValueError, r'^max_worker_restarts must be an int >= 0 \(-1 given\); pass e\.g\. '
                     r'max_worker_restarts=1$'),
    (1.5, TypeError, r'^max_worker_restarts must be an int >= 0 \(1\.5 of type float given\)'),
    (True, TypeError, r'^max_worker_restarts must be an int >= 0 \(True of type bool given\)'),
])
def test_max_worker_restarts_must_be_a_count(value, error, message):
    with pytest.raises(error, match=message):
        _build(max_worker_restarts=value)


def test_max_worker_restarts_is_refused_across_mpi_ranks():
    with pytest.raises(ValueError, match=r'^max_worker_restarts=2 does not apply across MPI '
                                         r'ranks \(communicator given\): mpiexec starts and '
                                         r'owns the ranks.*pass max_worker_restarts=0'):
        _build(max_worker_restarts=2, communicator=_ChainerMnLike())


def test_one_device_has_nothing_to_restart_and_reports_none():
    updater = _build(max_worker_restarts=3)
    reporter = chainer.Reporter()   # the model reports here, named as the Trainer names it
    reporter.add_observer('main', updater.get_optimizer('main').target)
    observation = {}
    with reporter.scope(observation):
        updater.update()
    assert observation['main/worker_restarts'] == 0 and updater.worker_restarts == 0
    updater.finalize()


def test_without_restarts_nothing_is_kept_and_nothing_reported():
    """The default path: no recovery, the workers keep no resume points, no report key."""
    updater = faulty.build()
    try:
        observation = {}
        with chainer.Reporter().scope(observation):
            updater.update()
        assert updater._group.recovery is None
        assert 'main/worker_restarts' not in observation and updater.worker_restarts == 0
    finally:
        updater.finalize()


# ------------------------------------------------------------------ snapshots
def test_a_snapshot_after_a_restart_resumes_exactly(uninterrupted):
    """A worker SIGKILLed before update 4, a snapshot after update 6: the run resumed from
    it in fresh objects ends bitwise where the uninterrupted one does, and so does the run
    that went on."""
    went_on = train(12, kill={3: 1}, snapshot_after=6)
    assert went_on['restarts'] == 1
    assert same_params(went_on['params'], uninterrupted['params'])
    assert went_on['losses'] == uninterrupted['losses']
    resumed = train(12, load=went_on['snapshot'])
    assert resumed['restarts'] == 0 and resumed['iteration'] == 12
    assert same_params(resumed['params'], uninterrupted['params'])
    assert resumed['losses'] == uninterrupted['losses'][6:]
    assert resumed['epoch_detail'] == uninterrupted['epoch_detail']


def test_a_snapshot_taken_while_a_worker_is_dead_resumes_exactly(uninterrupted):
    """The master holds every worker's iterator state: a snapshot needs no worker, and the
    dead one is replaced at the next update."""
    numpy.random.seed(0)
    updater = faulty.build(max_worker_restarts=1, own_orders=True)
    try:
        for _ in range(5):
            updater.update()
        os.kill(updater.worker_pids()[0], signal.SIGKILL)
        time.sleep(0.2)
        target = snapshot(updater)
        with pytest.warns(WorkerRestartWarning, match=r'found in update 6;'):
            updater.update()
        assert updater.worker_restarts == 1
    finally:
        updater.finalize()
    resumed = train(12, load=target)
    assert same_params(resumed['params'], uninterrupted['params'])


# ------------------------------------------------------------------ two at once
def test_two_workers_dead_together_are_both_replaced():
    """Three replicas, both workers SIGKILLed before update 5: two restarts in one
    recovery, and the run bitwise the uninterrupted one."""
    reference = train(8, restarts=0, n_replicas=3)
    out = train(8, restarts=2, kill={4: (1, 2)}, n_replicas=3)
    assert out['restarts'] == 2 and len(out['warnings']) == 2
    assert all('found in update 5;' in w for w in out['warnings'])
    assert same_params(out['params'], reference['params'])
    assert out['losses'] == reference['losses']


def test_two_deaths_beyond_the_restarts_left_raise_naming_both():
    with pytest.raises(WorkerError, match=r"^replica 2 on device '@numpy': the worker process "
                                          r'\(pid \d+\) was killed by SIGKILL; not restarted: '
                                          r'max_worker_restarts=1 allows 1 restart over the run '
                                          r'and none took place before, and with it died '
                                          r'replica 1$') as info:
        train(8, restarts=1, kill={4: (1, 2)}, n_replicas=3)
    assert info.value.died


# ------------------------------------------------------------------ without a board
def test_without_a_board_the_done_messages_carry_the_resume_points(uninterrupted,
                                                                   monkeypatch):
    """Where the ranks do not meet at the board (another memory order, or a backend
    without shared packs), the results and resume points come as Done messages: a worker
    killed in its window, then another between updates, and the run is bitwise the same."""
    monkeypatch.setattr(group_module, 'STORE_ORDER', False)
    stamp = Path(os.environ.get('TMPDIR', '/tmp')) / f'mgpu-restart-{os.getpid()}'
    stamp.unlink(missing_ok=True)
    try:
        out = train(12, restarts=2, kill={7: 1},
                    fault=faulty.Fault('forward', 'kill', replica=1, at=5, stamp=str(stamp),
                                       once=True))
    finally:
        stamp.unlink(missing_ok=True)
    assert out['restarts'] == 2
    assert same_params(out['params'], uninterrupted['params'])
    assert out['losses'] == uninterrupted['losses']


def test_pipelined_a_worker_killed_between_updates(monkeypatch):
    """The gradient in flight (pipelined) survives a restart: bitwise the same run."""
    reference = train(8, restarts=0, pipelined=True)
    out = train(8, kill={4: 1}, pipelined=True)
    assert out['restarts'] == 1
    assert same_params(out['params'], reference['params'])
    assert out['losses'] == reference['losses']


# ------------------------------------------------------------------ resume points
def _iterator(seed=0):
    return chainer.iterators.SerialIterator(
        list(range(10)), 3, order_sampler=chainer.iterators.ShuffleOrderSampler(
            numpy.random.RandomState(seed)))


def _point(iterator):
    return ResumePoint(capture_state(iterator), numpy.random.get_state(), random.getstate())


def test_a_change_holds_what_moved_and_applies_back():
    it = _iterator()
    first = _point(it)
    it.next()
    second = _point(it)
    change = difference(first, second)
    assert not change.full
    assert set(change.iterator) == {'current_position', 'previous_epoch_detail'}
    assert change.numpy_random is None and change.python_random is None
    moved = apply(first, change)
    assert {k: v.tolist() for k, v in moved.iterator.items()} == \
        {k: v.tolist() for k, v in second.iterator.items()}
    for _ in range(4):   # into the next epoch: a new order, its generator moved
        it.next()
    numpy.random.rand()
    third = _point(it)
    change = difference(second, third)
    assert {'order', 'epoch', 'order_sampler_rng/pos'} <= set(change.iterator)
    assert change.numpy_random is not None and change.python_random is None
    assert difference(None, third).full
    assert len(pickle.dumps(difference(third, third))) < 300   # nothing moved: small


def test_restore_sets_the_random_state_then_the_iterator():
    it = _iterator()
    it.next()
    numpy.random.seed(5)
    random.seed(5)
    point = _point(it)
    expected = ([it.next() for _ in range(5)], numpy.random.rand(3).tolist(), random.random())
    other = _iterator(seed=9)
    numpy.random.seed(1)
    random.seed(1)
    restore(point, other)
    assert ([other.next() for _ in range(5)], numpy.random.rand(3).tolist(),
            random.random()) == expected


def _result(micro_batch_size, chunk_limit=None):
    return WindowResult(count=4, loss_sum=1.0, sums={}, weights={}, times={}, epochs=[],
                        micro_batch_size=micro_batch_size, chunk_limit=chunk_limit)


def test_records_apply_a_change_once_the_update_completes():
    records = Records({1: ResumePoint(capture_state(_iterator()))})
    moved = Change(False, {'current_position': numpy.asarray(3)})
    assert records.unwrap(1, Shipment(_result(2, 2), moved)) == _result(2, 2)
    records.discard()   # abandoned
    assert int(records.points[1].iterator['current_position']) == 0
    assert records.chunk_sizes == {1: None}
    records.unwrap(1, Shipment(_result(2, 2), moved))
    records.commit()
    assert int(records.points[1].iterator['current_position']) == 3
    assert records.chunk_sizes == {1: 2}


def test_records_keep_no_chunk_size_where_the_worker_takes_whole_batches():
    """A window of 7 samples taken whole is no size to split a replacement's batches
    into: under 'auto' it starts from whole batches, as the lost worker had."""
    records = Records({1: ResumePoint(capture_state(_iterator()))})
    records.unwrap(1, Shipment(_result(7), Change(False, {})))
    records.commit()
    assert records.chunk_sizes == {1: None}


@pytest.mark.parametrize('auto, expected', [(True, 2), (False, None)])
def test_a_replacement_payload_starts_at_the_chunk_size_auto_found(auto, expected):
    """Under micro_batch_size='auto' the new worker starts where the lost one had come
    to (as a resumed run does); a fixed size stays as given."""
    model = faulty.Net()
    payload = payload_factory(dict(
        rank=1, size=2, device='@numpy', model=copy.deepcopy(model), loss_func=None,
        bind_loss_to_model=None, converter=faulty.Converter(), iterator=_iterator(),
        prefetch=0, accumulate_steps=1, scaling=None, comm_name='shm',
        chunking=Chunking(None, auto=auto)), model)
    def unpickled(data):
        return unpickle_payload(data, lambda setup: setup)[1]
    init = unpickled(payload(None, resume='here', chunk_size=2))
    assert init.chunking == Chunking(expected, auto=auto) and init.resume == 'here'
    assert unpickled(payload(None)).chunking == Chunking(None, auto=auto)


class _Loader:
    """What a Keeper needs of a loader: its state, its iterator, close."""

    def __init__(self, iterator):
        self.iterator, self.closed = iterator, False

    def state(self):
        return capture_state(self.iterator)

    def close(self):
        self.closed = True


class _Replica:
    def __init__(self, loader):
        self.loader = loader


def test_a_keeper_rewinds_to_where_its_window_started():
    """An abandoned window: its batches and its random numbers come again, with a new
    loader; the next change goes whole (the master applied none of that window's)."""
    it = _iterator()
    replica = _Replica(_Loader(it))
    numpy.random.seed(3)
    keeper = Keeper(replica.loader)
    keeper.window_starts()
    it.next(), numpy.random.rand()
    assert keeper.window_ended(replica.loader).full   # the first one sent
    keeper.window_starts()   # the update that will be abandoned
    lost = ([it.next(), it.next()], numpy.random.rand(2).tolist())
    assert not keeper.window_ended(replica.loader).full
    old = replica.loader
    keeper.rewind(replica, lambda: _Loader(it))
    assert old.closed and replica.loader is not old
    assert ([it.next(), it.next()], numpy.random.rand(2).tolist()) == lost
    assert keeper.window_ended(replica.loader).full
    keeper.window_starts()
    keeper.rewind(replica, lambda: _Loader(it))
    again = replica.loader
    keeper.rewind(replica, lambda: _Loader(it))   # twice: already there, nothing done
    assert replica.loader is again and not again.closed


def test_a_keeper_rewinds_a_window_given_up_half_way():
    """A worker on NCCL gives its window up at the master's Rewind (its wait saw the
    message) before the window ended: the batches it read come again all the same."""
    it = _iterator()
    replica = _Replica(_Loader(it))
    numpy.random.seed(4)
    keeper = Keeper(replica.loader)
    keeper.window_starts()
    lost = ([it.next()], numpy.random.rand(2).tolist())   # ... then Abandoned
    old = replica.loader
    keeper.rewind(replica, lambda: _Loader(it))
    assert old.closed and replica.loader is not old
    assert ([it.next()], numpy.random.rand(2).tolist()) == lost


def test_capture_reads_the_loader_and_both_generators():
    it = _iterator()
    point = capture(_Loader(it))
    assert point.iterator.keys() == capture_state(it).keys()
    assert point.numpy_random[0] == 'MT19937' and point.python_random[0] == 3


# ------------------------------------------------------------------ the board, the ledger
def test_a_result_delivered_ahead_is_there_when_the_post_is_seen():
    master = Board.create(2)
    worker = Board.attach(master.name, 2, 1)
    try:
        worker.post_result(b'the result', ahead=True)
        assert master.behind() == []   # nothing posted yet, nothing awaited
        worker.post(4, 1.5)
        master.post(2, 0.5)
        master.wait(lambda: None)
        assert master.result(1, lambda: pytest.fail('waited')) == b'the result'
        worker.start_over()
        master.start_over()
        assert master.behind() == [] and master.posted() == [(0, 0.0), (0, 0.0)]
        worker.post(1, 2.0)   # round 1 again, for both
        master.post(1, 1.0)
        master.wait(lambda: None)
        assert master.posted() == [(1, 1.0), (1, 2.0)]
    finally:
        worker.close()
        master.close()


def test_rebuild_clears_the_ledger_so_that_every_rank_starts_again():
    """A rank that died mid-update left its ledger row at another update than the others:
    after rebuild every rank counts from its first update and the order checks pass."""
    spec = {'grad/<f4': ('<f4', 4)}
    master = ShmCommunicator.create(3, spec)
    ranks = [ShmCommunicator.attach(master.handle, r) for r in (1, 2)]
    try:
        for comm in [master] + ranks:   # an update the third rank died in
            comm.begin_update()
        ranks[1].begin_update()
        assert master.rebuild() == master.handle
        for comm in [master] + ranks:
            comm.begin_update()
        for comm in ranks + [master]:
            comm.reduce('grad/<f4')
        master.end_update()
        with pytest.raises(RuntimeError, match=r"rebuild\(\) is the master's"):
            ranks[0].rebuild()
    finally:
        for comm in ranks:
            comm.finalize()
        master.finalize()


def test_the_restart_error_keeps_what_it_says_when_pickled():
    error = WorkerError('the worker process (pid 1) was killed by SIGKILL', replica=1,
                        device='@numpy', exitcode=-9)
    again = pickle.loads(pickle.dumps(error))
    assert again.died and again.reason == error.reason and str(again) == str(error)


# ------------------------------------------------------------------ what is not restarted
class _Comm:
    rejoins = False

    def __init__(self, name, rebuilds):
        self.name, self.rebuilds, self.rebuilt, self.abandoned = name, rebuilds, 0, 0

    def abandon(self):
        self.abandoned += 1

    def rebuild(self):
        self.rebuilt += 1
        return ('handle', self.rebuilt)


def _recovery(comm, limit=1):
    from mgpu_updater._local.recovery import Recovery
    from mgpu_updater._restarts import RestartLog
    records = Records({1: ResumePoint({})})
    return Recovery(RestartLog(limit), records, pool=None, comm=comm, board=None,
                    payload=lambda *a: pytest.fail('no payload'),
                    start=lambda *a: pytest.fail('no start'))


def test_a_backend_that_cannot_take_a_new_rank_raises_saying_so():
    """A communicator without rebuild (the interface's default): a death raises as
    without restarts, saying why (nothing is rewound, nothing started)."""
    death = WorkerError('the worker process (pid 7) was killed by SIGKILL', replica=1,
                        device='@cupy:1', exitcode=-9)
    with pytest.raises(WorkerError, match=r"^replica 1 on device '@cupy:1': the worker "
                                          r'process \(pid 7\) was killed by SIGKILL; not '
                                          r'restarted: the custom communicator cannot take a '
                                          r'new rank$') as info:
        _recovery(_Comm('custom', rebuilds=False)).recover(death, lambda: None)
    assert info.value.exitcode == -9


def test_a_stall_is_not_a_death():
    """update_timeout's error (the process lives) is raised as it is."""
    stalled = WorkerError('did not finish update 3 within update_timeout=1 s', replica=1,
                          device='@numpy')
    with pytest.raises(WorkerError) as info:
        _recovery(_Comm('shm', rebuilds=True)).recover(stalled, lambda: None)
    assert info.value is stalled


def test_every_local_backend_rebuilds_and_nccls_ranks_rejoin():
    from mgpu_updater.comm.base import Communicator
    from mgpu_updater.comm.nccl import NcclCommunicator
    from mgpu_updater.comm.staged import HostStagedCommunicator
    assert ShmCommunicator.rebuilds and HostStagedCommunicator.rebuilds
    assert NcclCommunicator.rebuilds and not Communicator.rebuilds
    assert NcclCommunicator.rejoins
    assert not (ShmCommunicator.rejoins or HostStagedCommunicator.rejoins)


class _Pool:
    """What Recovery asks of the pool: rank 1 died, rank 2 rewinds."""
    ranks = [1, 2]

    def __init__(self):
        self.rewound = []

    def dead_ranks(self):
        return [1]

    def death(self, rank):
        return WorkerError('the worker process (pid 7) was killed by SIGKILL', replica=rank,
                           device='@numpy', exitcode=-9)

    def rewind(self, ranks, message, reply, drop):
        self.rewound.append(list(ranks))
        return []


def test_a_replacement_that_fails_to_start_raises_saying_both():
    from mgpu_updater._local.recovery import Recovery
    from mgpu_updater._restarts import RestartLog

    def start(payloads, survivors, handle):
        assert sorted(payloads) == [1] and survivors == [2] and handle == ('handle', 1)
        raise WorkerError('failed during restart', replica=1, device='@numpy',
                          remote_traceback='Traceback (most recent call last):\n  planted\n')
    pool = _Pool()
    comm = _Comm('shm', rebuilds=True)
    recovery = Recovery(RestartLog(3), Records({1: ResumePoint({}), 2: ResumePoint({})}),
                        pool, comm, board=None,
                        payload=lambda rank, point, size, handle: b'payload', start=start)
    with pytest.raises(WorkerError, match=r"^replica 1 on device '@numpy': failed during "
                                          r'restart, while it was started in place of a worker '
                                          r'process that died \(the worker process \(pid 7\) '
                                          r'was killed by SIGKILL\): not restarted again'
                       ) as info:
        recovery.recover(pool.death(1), lambda: pytest.fail('no redo'))
    assert pool.rewound == [[2]] and 'planted' in info.value.remote_traceback
    assert comm.abandoned == 1 and comm.rebuilt == 1   # given up, then rebuilt, before


@pytest.mark.parametrize('action, how', [('kill', r'was killed by SIGKILL'),
                                         ('raise', r'failed during start')])
def test_a_worker_that_ends_while_the_workers_start_says_why_it_is_not_restarted(action,
                                                                                   how):
    """Under max_worker_restarts a worker that dies (or raises) while starting ends the
    run, as without restarts, and the message says so and why."""
    updater = faulty.build(fault=faulty.Fault('start', action=action),
                           max_worker_restarts=1)
    try:
        with pytest.raises(WorkerError, match=rf"(?s){how}.*\(not restarted: this happened "
                                              r"while the workers started, before the first "
                                              r"update ran; max_worker_restarts replaces"):
            updater.update()
    finally:
        updater.finalize()

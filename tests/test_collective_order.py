"""The issue order of the collectives: one declared list, both halves follow it, shm checks it.

NCCL pairs collectives by the order each rank issues them. Before this check existed the
master reduced the BatchNorm statistics before the gradients and the workers the other way
round; the shared-memory backend sums slots whatever the order, so nothing noticed. Now that
backend records every rank's collectives of an update and raises CollectiveOrderError, naming
both sequences, when they differ: the tests below reintroduce that order and see it fail.
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

import chainer
import chainer.functions as F

from mgpu_updater import ParallelAccumulatingUpdater, WorkerError
from mgpu_updater._local import protocol as _protocol
from mgpu_updater._flat_buffers import (ModelLayouts, grad_arrays, persistent_arrays,
                                set_persistent_scalars, state_arrays)
from mgpu_updater._local.protocol import (Done, Failed, Ready, State, StateRequest,
                                    Step, Stop, collective_order, master_begin,
                                    master_finish, worker_step)
from mgpu_updater._replica import Replica, Scaling
from mgpu_updater.comm.base import CollectiveOrderError, check_same_order
from mgpu_updater.comm.shm import ShmCommunicator
from mgpu_updater._loader import make_loader

from _models import MLP, classifier, dataset, setup_optimizer
from _processes import gone_within

SYNC_AND_PARITIES = [None, 0, 1]


def _grad_name(parity):
    return 'grad' if parity is None else f'grad{parity}'


# ------------------------------------------------------------------------ the declaration
@pytest.mark.parametrize('parity', SYNC_AND_PARITIES)
def test_the_declared_order_bcasts_then_reduces_statistics_then_gradients(parity):
    layouts = ModelLayouts(classifier(batchnorm=True), double_buffered=True)
    assert collective_order(layouts, parity) == (
        ('bcast', 'param/<f4'), ('reduce', 'stat/<f4'), ('reduce', f'{_grad_name(parity)}/<f4'))
    assert collective_order(layouts, across_hosts=True) == (
        ('allreduce', 'stat/<f4'), ('allreduce', 'grad/<f4'))


def test_the_order_is_declared_once_per_layouts_and_arguments():
    """Every rank asks for the order twice an update; it is declared once per layouts and
    arguments (the layouts do not change after construction), and each form is its own."""
    layouts = ModelLayouts(classifier(batchnorm=True), double_buffered=True)
    forms = [dict(parity=p) for p in SYNC_AND_PARITIES] + [
        dict(across_hosts=True)]
    first = [collective_order(layouts, **kw) for kw in forms]
    assert [collective_order(layouts, **kw) for kw in forms] == first
    assert all(collective_order(layouts, **kw) is order for kw, order in zip(forms, first))
    assert len(set(first)) == len(forms)
    other = ModelLayouts(MLP())   # another model's layouts: its own declaration
    assert collective_order(other) == (('bcast', 'param/<f4'), ('reduce', 'grad/<f4'))


def test_several_dtypes_go_in_sorted_buffer_order():
    layouts = ModelLayouts(_MixedDtypes())
    assert collective_order(layouts) == (
        ('bcast', 'param/<f4'), ('bcast', 'param/<f8'), ('reduce', 'stat/<f4'),
        ('reduce', 'grad/<f4'), ('reduce', 'grad/<f8'))


def test_messages_are_named_tuples_whose_first_field_is_the_kind():
    import pickle
    step = Step(0.5, {'/bn/N': 3}, 1)
    assert step == ('step', 0.5, {'/bn/N': 3}, 1) and step[0] == step.kind == 'step'
    assert (step.loss_scale, step.scalars, step.parity) == (0.5, {'/bn/N': 3}, 1)
    again = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(again) is Step and again == step
    assert [m[0] for m in (StateRequest(), Stop(), Ready(), Done(None), State({}),
                           Failed('tb'))] == [
        'state', 'stop', 'ready', 'done', 'state', 'error']
    assert Failed('tb')[1] == 'tb' and Done('r').result == 'r'


def test_the_worker_does_not_import_the_master_group():
    """The old cycle group -> pool -> worker -> group is gone on the worker side."""
    import ast
    import mgpu_updater._local.worker as worker
    with open(worker.__file__) as f:
        tree = ast.parse(f.read())
    imported = {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module}
    assert not {'_group', '.group', 'group'} & imported and 'protocol' in imported


# ------------------------------------------------------------------------ the shm ledger
SPEC = {'param/<f4': ('<f4', 3), 'stat/<f4': ('<f4', 2), 'grad/<f4': ('<f4', 4)}


@pytest.fixture
def two_ranks():
    """Rank 0 and rank 1 of one shared-memory communicator, in this process."""
    root = ShmCommunicator.create(2, SPEC)
    other = ShmCommunicator.attach(root.handle, 1)
    yield root, other
    other.finalize()
    root.finalize()


def _one_update(root, other, root_order, other_order):
    """As the local protocol runs them: root's bcasts, then the other rank's whole update,
    then the root's reductions (the control channel's order)."""
    root.begin_update()
    for verb, name in root_order:
        if verb == 'bcast':
            root.bcast(name)
    other.begin_update()
    for verb, name in other_order:
        getattr(other, verb)(name)
    other.end_update()
    for verb, name in root_order:
        if verb != 'bcast':
            getattr(root, verb)(name)
    root.end_update()


ORDER = [('bcast', 'param/<f4'), ('reduce', 'stat/<f4'), ('reduce', 'grad/<f4')]


def test_shm_same_order_passes_every_update_and_sums(two_ranks):
    root, other = two_ranks
    for update in range(3):
        root.buffer('grad/<f4')[...] = 1 + update
        other.buffer('grad/<f4')[...] = 10
        _one_update(root, other, ORDER, ORDER)
        np.testing.assert_array_equal(root.buffer('grad/<f4'), 11 + update)
        assert root.issued() == other.issued() == ORDER


def test_shm_root_reduce_out_of_order_raises_naming_both_before_summing(two_ranks):
    root, other = two_ranks
    root.buffer('stat/<f4')[...] = 1
    other.buffer('stat/<f4')[...] = 5
    today_worker = [ORDER[0], ORDER[2], ORDER[1]]
    with pytest.raises(CollectiveOrderError) as info:
        _one_update(root, other, ORDER, today_worker)
    message = str(info.value)
    assert ("collective #1 is ('reduce', 'stat/<f4') on rank 0 but ('reduce', 'grad/<f4') "
            'on rank 1') in message
    assert "rank 0 issued [('bcast', 'param/<f4'), ('reduce', 'stat/<f4')]" in message
    assert ("rank 1 issued [('bcast', 'param/<f4'), ('reduce', 'grad/<f4'), "
            "('reduce', 'stat/<f4')]") in message
    assert info.value.update == 1
    np.testing.assert_array_equal(root.buffer('stat/<f4'), 1)   # nothing summed


def test_shm_non_root_bcast_of_another_buffer_raises_on_that_rank(two_ranks):
    root, other = two_ranks
    root.begin_update()
    root.bcast('param/<f4')
    other.begin_update()
    with pytest.raises(CollectiveOrderError, match=r"collective #0 is \('bcast', 'param/<f4'\) "
                       r"on rank 0 but \('bcast', 'stat/<f4'\) on rank 1"):
        other.bcast('stat/<f4')


def test_shm_a_collective_missing_on_a_worker_raises_at_the_root(two_ranks):
    root, other = two_ranks
    with pytest.raises(CollectiveOrderError,
                       match=r'rank 1 issued 2 collective\(s\) where the other issued 3'):
        _one_update(root, other, ORDER, ORDER[:2])


def test_shm_an_extra_trailing_collective_is_caught_when_rank_0_ends_the_update(two_ranks):
    root, other = two_ranks
    with pytest.raises(CollectiveOrderError,
                       match=r'rank 0 issued 3 collective\(s\) where the other issued 4'):
        _one_update(root, other, ORDER, ORDER + [('reduce', 'stat/<f4')])


def test_shm_the_same_count_of_other_collectives_is_caught_when_rank_0_ends_the_update(
        two_ranks):
    """A difference no verb compares (the root's bcast against a worker's reduce at one
    position, the counts equal) is found by end_update's comparison of the update's
    ring, also once the ring has wrapped."""
    root, other = two_ranks
    for n in (1, 70):
        with pytest.raises(CollectiveOrderError, match=r"collective #%d is \('bcast', "
                           r"'param/<f4'\) on rank 0 but \('reduce', 'grad/<f4'\) on rank 1"
                           % (n - 1)):
            _one_update(root, other, [('bcast', 'param/<f4')] * n,
                        [('bcast', 'param/<f4')] * (n - 1) + [('reduce', 'grad/<f4')])


def test_shm_a_rank_that_skipped_begin_update_is_named(two_ranks):
    root, other = two_ranks
    _one_update(root, other, ORDER, ORDER)
    root.begin_update()
    root.bcast('param/<f4')
    with pytest.raises(CollectiveOrderError, match='rank 0 is in its update 2 but rank 1 in '
                       'its update 1'):
        other.bcast('param/<f4')


def test_shm_long_updates_wrap_the_ledger_and_are_still_compared(two_ranks):
    root, other = two_ranks
    long = [('reduce', 'grad/<f4')] * 150
    _one_update(root, other, long, long)
    assert len(root.issued()) == 64   # the ledger's latest entries
    wrong = long[:140] + [('reduce', 'stat/<f4')] + long[141:]
    with pytest.raises(CollectiveOrderError, match=r"collective #140 is \('reduce', 'grad/<f4'\) "
                       r"on rank 0 but \('reduce', 'stat/<f4'\) on rank 1\. rank 0 issued "
                       r'\(from collective #86 on\)'):
        _one_update(root, other, long, wrong)


def test_check_same_order_names_the_first_rank_that_differs():
    check_same_order({0: ORDER, 1: ORDER, 2: ORDER})
    with pytest.raises(CollectiveOrderError, match=r'rank 0 and rank 2 .* in update 7: '
                       r"collective #2 is \('reduce', 'grad/<f4'\) on rank 0"):
        check_same_order({0: ORDER, 1: ORDER, 2: ORDER[:2] + [('reduce', 'x')]}, 7)


# ------------------------------------------------------------------------ both halves
def todays_replica_step(msg, replica, comm, layouts, size):
    """The worker's step as it was (mgpu_updater/_local/group.py before the protocol module):
    gradients reduced before the statistics, where the master reduces the statistics first.
    Only the update's brackets (begin_update, end_update) are new."""
    _, loss_scale, scalars, parity = msg[:4]
    model = replica.model
    comm.begin_update()
    for name in layouts.state.buffer_names().values():
        comm.bcast(name)
    layouts.state.unpack(comm.buffer, state_arrays(model))
    set_persistent_scalars(model, scalars)
    result = replica.run_window(loss_scale)
    grads = layouts.grad_set(parity)
    grads.pack(grad_arrays(model), comm.buffer)
    layouts.stat.pack(dict(persistent_arrays(model)), comm.buffer, scale=1.0 / size)
    for name in list(grads.buffer_names().values()) + list(layouts.stat.buffer_names().values()):
        comm.reduce(name)
    comm.end_update()
    return result


class InProcessWorker:
    """One worker in this process, for the master's half: ``send`` runs its whole step at
    once (after the master's broadcast, before the master's reductions: the control
    channel's order), ``gather`` hands back its Done or raises what it raised."""

    def __init__(self, step, replica, comm, layouts, size):
        self.step, self.replica, self.comm, self.layouts, self.size = (
            step, replica, comm, layouts, size)
        self.answer = None

    def send(self, msg):
        try:
            self.answer = Done(self.step(msg, self.replica, self.comm, self.layouts, self.size))
        except CollectiveOrderError as e:
            self.answer = e

    def gather(self, kind):
        assert kind == 'done'
        if isinstance(self.answer, BaseException):
            raise self.answer
        return {1: self.answer.result}


def _replica(model, seed, b=4):
    it = chainer.iterators.SerialIterator(dataset(64, seed=seed), b, shuffle=False)
    loader = make_loader(it, chainer.dataset.concat_examples, chainer.get_device('@numpy'), 0)
    return Replica(model, None, loader, accumulate_steps=2,
                   scaling=Scaling('mean', 'mean', update_norm=16.0, window_norm=8.0))


def _run_halves(worker_half, parity, updates=2):
    """``updates`` updates of master + one in-process worker on a BatchNorm model."""
    master_model = classifier(seed=3, batchnorm=True)
    worker_model = copy.deepcopy(master_model)
    layouts = ModelLayouts(master_model, double_buffered=parity is not None)
    master_comm = ShmCommunicator.create(2, layouts.spec())
    worker_comm = ShmCommunicator.attach(master_comm.handle, 1)
    master, worker = _replica(master_model, 30), _replica(worker_model, 31)
    workers = InProcessWorker(worker_half, worker, worker_comm, ModelLayouts(
        worker_model, double_buffered=parity is not None), 2)
    try:
        for _ in range(updates):
            master_begin(workers, master_comm, layouts, master_model, None, parity)
            master.run_window(None)
            master_finish(workers, master_comm, layouts, master_model, parity, 2)
        return master_model, worker_model, master_comm.issued(), worker_comm.issued()
    finally:
        worker_comm.finalize()
        master_comm.finalize()


@pytest.mark.parametrize('parity', SYNC_AND_PARITIES)
def test_todays_worker_order_fails_the_check_naming_both_sequences(parity):
    grad = f'{_grad_name(parity)}/<f4'
    with pytest.raises(CollectiveOrderError) as info:
        _run_halves(todays_replica_step, parity)
    message = str(info.value)
    assert info.value.update == 1
    assert "rank 0 issued [('bcast', 'param/<f4'), ('reduce', 'stat/<f4')]" in message
    assert (f"rank 1 issued [('bcast', 'param/<f4'), ('reduce', '{grad}'), "
            f"('reduce', 'stat/<f4')]") in message


@pytest.mark.parametrize('parity', SYNC_AND_PARITIES)
def test_both_halves_issue_the_declared_order(parity):
    master_model, _, master_seq, worker_seq = _run_halves(worker_step, parity)
    declared = list(collective_order(ModelLayouts(master_model, True), parity))
    assert master_seq == worker_seq == declared


# ------------------------------------------------------------------------ end to end (spawn)
class _MixedDtypes(chainer.Chain):
    """A BatchNorm classifier with an extra float64 parameter: two param and grad buffers."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.predictor = MLP(batchnorm=True)
            self.extra = chainer.Parameter(np.zeros(3, np.float64))

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.predictor(x), t)


def _updater(model, pipelined, n=2):
    its = [chainer.iterators.SerialIterator(dataset(64, seed=50 + r), 4, shuffle=False)
           for r in range(n)]
    return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                       devices=['@numpy'] * n, pipelined=pipelined)


def _misorder_master(monkeypatch, parity, reorder):
    """From now on the master (this process) issues ``reorder(declared)`` in updates of
    this parity; the workers keep the declared order."""
    declared = _protocol.collective_order

    def order(layouts, p=None, across_hosts=False):
        out = declared(layouts, p, across_hosts)
        return tuple(reorder(out)) if p == parity else out
    monkeypatch.setattr(_protocol, 'collective_order', order)


def _grads_first(order):     # the workers' order before the fix
    return ([c for c in order if c.verb == 'bcast'] + [c for c in order if 'grad' in c.buffer]
            + [c for c in order if c.buffer.startswith('stat')])


@pytest.mark.parametrize('parity', SYNC_AND_PARITIES)
def test_updater_with_the_old_order_raises_and_every_worker_is_stopped(monkeypatch, parity):
    model = classifier(seed=4, batchnorm=True)
    updater = _updater(model, pipelined=parity is not None)
    try:
        updater.update()       # the declared order on every rank: passes (parity 0)
        pids = updater.worker_pids()
        assert len(pids) == 1
        _misorder_master(monkeypatch, parity, _grads_first)
        grad = f'{_grad_name(parity)}/<f4'
        with pytest.raises(CollectiveOrderError) as info:
            for _ in range(2):   # the misordered parity comes within two updates
                updater.update()
        message = str(info.value)
        assert (f"rank 0 issued [('bcast', 'param/<f4'), ('reduce', '{grad}')]" in message)
        assert (f"rank 1 issued [('bcast', 'param/<f4'), ('reduce', 'stat/<f4'), "
                f"('reduce', '{grad}')]") in message
        assert gone_within(pids, 10.0), 'a worker outlived the failed update'
    finally:
        updater.finalize()


def test_a_worker_that_sees_another_broadcast_order_fails_in_the_master(monkeypatch):
    model = _MixedDtypes()
    updater = _updater(model, pipelined=False)
    try:
        updater.update()
        pids = updater.worker_pids()
        _misorder_master(monkeypatch, None, lambda order: [order[1], order[0]] + list(order[2:]))
        with pytest.raises(WorkerError) as info:
            updater.update()
        assert info.value.replica == 1
        tb = info.value.remote_traceback
        assert 'CollectiveOrderError' in tb
        assert ("collective #0 is ('bcast', 'param/<f8') on rank 0 but ('bcast', 'param/<f4') "
                'on rank 1') in tb
        assert "rank 0 issued [('bcast', 'param/<f8'), ('bcast', 'param/<f4')]" in tb
        assert gone_within(pids, 10.0)
    finally:
        updater.finalize()


def test_mixed_dtypes_train_with_the_declared_order():
    """Two parameter dtypes: every update passes the check (the positive control)."""
    model = _MixedDtypes()
    updater = _updater(model, pipelined=True)
    try:
        for _ in range(3):
            updater.update()
    finally:
        updater.finalize()
    assert updater.iteration == 3


# ------------------------------------------------------------------------ what a group asks
def test_every_backend_answers_what_the_group_asks_by_default():
    from mgpu_updater.comm.base import Communicator

    class Minimal(Communicator):
        def buffer(self, name):
            return np.zeros(1)

        def reduce(self, name, root=0):
            pass

        def bcast(self, name, root=0):
            pass

    comm = Minimal(0, 1)
    comm.init()
    comm.begin_update()
    comm.end_update()
    assert comm.owned_segments == [] and comm.check_peer_alive is None

    def check_alive():
        raise RuntimeError('a peer died')
    comm.watch_peers(check_alive)
    assert comm.check_peer_alive is check_alive


def test_shm_owns_its_buffers_and_its_ledger_and_finalize_removes_them():
    root = ShmCommunicator.create(2, SPEC)
    other = ShmCommunicator.attach(root.handle, 1)
    names = root.owned_segments
    assert len(set(names)) == len(SPEC) + 1 and other.owned_segments == names
    assert all(os.path.exists(f'/dev/shm/{name}') for name in names)
    other.finalize()
    assert all(os.path.exists(f'/dev/shm/{name}') for name in names)   # the master's
    root.finalize()
    assert not any(os.path.exists(f'/dev/shm/{name}') for name in names)


def test_shm_buffer_roles_come_from_the_declared_order_not_from_names():
    layouts = ModelLayouts(classifier(batchnorm=True))
    assert _protocol.broadcast_only(layouts) == ['param/<f4']
    spec = {'weights': ('<f4', 3), 'sums': ('<f4', 3)}   # no 'param' prefix to guess from
    root = ShmCommunicator.create(2, spec, broadcast=['weights'])
    other = ShmCommunicator.attach(root.handle, 1)
    try:
        root.buffer('weights')[...] = [1, 2, 3]
        root.buffer('sums')[...] = 4
        other.buffer('sums')[...] = 5
        root.bcast('weights')
        root.bcast('sums')
        other.bcast('weights')           # one shared slot: the root's values, no copy
        np.testing.assert_array_equal(other.buffer('weights'), [1, 2, 3])
        other.bcast('sums')              # a per-rank buffer may be broadcast too: a copy
        np.testing.assert_array_equal(other.buffer('sums'), 4)
        other.buffer('sums')[...] = 5
        other.reduce('sums')
        root.reduce('sums')
        np.testing.assert_array_equal(root.buffer('sums'), 9)
        with pytest.raises(ValueError, match="buffer 'weights' was created broadcast-only"):
            root.reduce('weights')
    finally:
        other.finalize()
        root.finalize()
    with pytest.raises(ValueError, match=r"broadcast names buffers that the spec has not: "
                       r"\['param/x'\]"):
        ShmCommunicator.create(2, spec, broadcast=['param/x'])


def test_pipelined_master_issues_every_collective_from_its_own_thread(monkeypatch):
    """No background thread issues a collective: a thread's verb could land between the
    next update's and reorder this rank's sequence."""
    import threading
    threads = []
    issue = ShmCommunicator._issue

    def recording(self, verb, name, root):
        threads.append((threading.current_thread().name, verb, name))
        return issue(self, verb, name, root)
    monkeypatch.setattr(ShmCommunicator, '_issue', recording)
    model = classifier(seed=5, batchnorm=True)
    updater = _updater(model, pipelined=True)
    try:
        for _ in range(3):
            updater.update()
    finally:
        updater.finalize()
    main = threading.current_thread().name
    assert [t for t, _, _ in threads] == [main] * 9
    assert [n for _, _, n in threads] == ['param/<f4', 'stat/<f4', 'grad0/<f4',
                                          'param/<f4', 'stat/<f4', 'grad1/<f4',
                                          'param/<f4', 'stat/<f4', 'grad0/<f4']

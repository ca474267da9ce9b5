"""Window results in the board's mailboxes, and how long a waiter spins (issue 15).

Where the ranks post at the board (:mod:`mgpu_updater._local.board`), each worker puts its
window result into its mailbox there right after its post, and the master reads it there
instead of receiving a Done through the pipe (0.2-0.25 ms of every update, on the critical
path, after the step). The contract: what the master reads is what the worker's window
returned; a result too large for the mailbox still arrives, as a Done through the pipe;
the master waits for a result of the current round only, runs its health check while it
waits, and with the board no Done crosses a pipe in an update. A waiter spins long only
where every rank of the host has a core.
"""
from __future__ import annotations

import gc
import multiprocessing
import pickle
import time

import chainer
import pytest
from chainer import optimizers

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._local import board as board_module
from mgpu_updater._local import group as group_module
from mgpu_updater._local import pool as pool_module
from mgpu_updater._local.board import MAILBOX, Board, spin_for
from mgpu_updater._local.protocol import (Done, Shipment, deliver, pack_result, take_results,
                                          unpack_result)
from mgpu_updater._loader import EpochInfo
from mgpu_updater._replica import WindowResult

from _models import classifier, dataset


def _result(count=8, extra=0):
    """A window result as a replica makes one; ``extra`` reported keys make it larger."""
    sums = {'main/loss': 2.5 * count, 'main/accuracy': 0.25 * count}
    sums.update({f'main/extra{i:05d}': float(i) for i in range(extra)})
    return WindowResult(count, 2.5 * count, sums, {key: float(count) for key in sums},
                        {'data': 1e-4, 'compute': 0.03}, [EpochInfo(0, 0.1, 0.05, False)],
                        (), count)


class _Pipe:
    """The master's view of one worker (rank 1) whose Done, if any, is in its pipe."""

    ranks = [1]

    def __init__(self):
        self.done = None
        self.checks = 0
        self.gathered = []

    def check(self, what='update', waiting=()):
        self.checks += 1
        self.waiting = tuple(waiting)

    def gather(self, kind, ranks=None):
        self.gathered.append((kind, ranks))
        assert self.done is not None, 'nothing was sent through the pipe'
        return {1: self.done}


def _pair():
    master = Board.create(2)
    return master, Board.attach(master.name, 2, 1)


def test_a_result_in_the_mailbox_is_what_the_worker_delivered_and_no_pipe_is_read():
    master, worker = _pair()
    pipe = _Pipe()
    try:
        for count in (8, 3):   # two rounds: each reads that round's result
            master.post(count, 0.0)
            worker.post(count, 2.5 * count)
            deliver(worker, _result(count), lambda r: setattr(pipe, 'done', r))
            assert take_results(pipe, master) == {1: _result(count)}
        assert pipe.done is None and pipe.gathered == []
    finally:
        worker.close()
        master.close()


def test_a_mailbox_result_is_read_back_with_its_types():
    """The mailbox carries a result as plain tuples (cheaper to read on the master's
    critical path); what comes out is the named tuples and value types that went in,
    not just equal tuples, and anything else (a Shipment under max_worker_restarts)
    passes as it is."""
    import numpy
    result = WindowResult(16, numpy.float64(3.5), {'main/loss': 1.0, 'x': numpy.float32(2)},
                          {'main/loss': 16.0, 'x': 16.0}, {'data': 1e-5},
                          [EpochInfo(1, 1.5, 1.25, True), EpochInfo(2, 2.0, None, False)],
                          ('main/loss',), 8, 'inline')
    back = unpack_result(pack_result(result))
    assert back == result and type(back) is WindowResult
    assert [type(e) for e in back.epochs] == [EpochInfo, EpochInfo]
    assert type(back.loss_sum) is numpy.float64 and type(back.sums['x']) is numpy.float32
    shipment = Shipment(result, {'position': 3})
    again = unpack_result(pack_result(shipment))
    assert again == shipment and type(again) is Shipment and type(again.result) is WindowResult


def test_a_result_too_large_for_the_mailbox_comes_through_the_pipe():
    big = _result(extra=2000)
    assert len(pickle.dumps(big, protocol=pickle.HIGHEST_PROTOCOL)) > MAILBOX
    master, worker = _pair()
    pipe = _Pipe()
    try:
        master.post(8, 0.0)
        worker.post(8, 20.0)
        deliver(worker, big, lambda r: setattr(pipe, 'done', r))
        assert pipe.done == big                        # sent through the pipe ...
        assert master.result(1, pipe.check) is None    # ... and the mailbox says so
        assert take_results(pipe, master) == {1: big}
        assert pipe.gathered == [(Done.KIND, [1])]     # only the ranks that used the pipe
    finally:
        worker.close()
        master.close()


def test_the_master_waits_for_this_rounds_result_running_its_check():
    """A result of an earlier round is not taken for this one: the master waits (running
    its health check) until the worker puts this round's, from another process."""
    def rank1(name, ready):
        board = Board.attach(name, 2, 1)
        board.post(8, 20.0)
        board.post_result(pickle.dumps(_result(8)))      # round 1
        ready.wait(30)
        time.sleep(0.05)
        board.post(3, 7.5)
        board.post_result(pickle.dumps(_result(3)))      # round 2, late
        board.close()
    master = Board.create(2)
    ctx = multiprocessing.get_context('fork')
    ready = ctx.Event()
    proc = ctx.Process(target=rank1, args=(master.name, ready))
    proc.start()
    pipe = _Pipe()
    try:
        master.post(8, 0.0)
        assert take_results(pipe, master) == {1: _result(8)}
        master.post(3, 0.0)
        checks = pipe.checks
        ready.set()
        assert take_results(pipe, master) == {1: _result(3)}
        assert pipe.checks > checks        # it waited, and checked while waiting
        assert pipe.waiting == (1,)        # ... naming the rank it waited for (a stall)
    finally:
        proc.join(30)
        master.close()
    assert proc.exitcode == 0


def test_a_failing_check_ends_the_wait_for_a_result():
    master, worker = _pair()
    try:
        master.post(8, 0.0)
        worker.post(8, 20.0)      # posted, but no result follows (the worker failed)

        def check():
            raise RuntimeError('replica 1 failed')
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match='replica 1 failed'):
            master.result(1, check)
        assert time.perf_counter() - start < 1.0
    finally:
        worker.close()
        master.close()


def _start(**kwargs):
    model = classifier(seed=3)
    opt = optimizers.MomentumSGD(0.05)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(64, seed=10 + r), 4, shuffle=False)
           for r in range(2)]
    return model, ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                              accumulate_steps=2, **kwargs)


def test_with_the_board_no_done_crosses_a_pipe_and_the_results_are_reported(monkeypatch):
    """With the board, the workers' results of every update come from the mailboxes (the
    master never gathers a Done); without it (a weaker memory order), through the pipes.
    Both report the same values."""
    gathered = []
    real_gather = pool_module.WorkerPool.gather

    def gather(self, kind, *args, **kwargs):
        gathered.append(kind)
        return real_gather(self, kind, *args, **kwargs)
    monkeypatch.setattr(pool_module.WorkerPool, 'gather', gather)

    def train():
        model, updater = _start()
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        observations = []
        try:
            for _ in range(3):
                observation = {}
                with reporter.scope(observation):
                    updater.update()
                observations.append({k: float(getattr(v, 'array', v))
                                     for k, v in observation.items() if '/time/' not in k})
            board = updater._group.board
        finally:
            updater.finalize()
        return observations, board is not None
    by_board, had_board = train()
    assert had_board and Done.KIND not in gathered
    monkeypatch.setattr(group_module, 'STORE_ORDER', False)   # as on a weaker memory order
    gathered.clear()
    by_pipe, had_board = train()
    assert not had_board and gathered.count(Done.KIND) == 3
    assert by_board == by_pipe


def test_a_waiter_spins_long_only_where_every_rank_has_a_core(monkeypatch):
    assert spin_for(2, 2) == board_module.SPIN_LONG
    assert spin_for(3, 2) == board_module.SPIN
    master = Board.create(3, spin=spin_for(3, 2))
    worker = Board.attach(master.name, 3, 1)    # the spin travels with the board
    try:
        assert master.spin == worker.spin == pytest.approx(board_module.SPIN)
    finally:
        worker.close()
        master.close()


def test_a_spinning_waiter_yields_and_does_not_sleep_before_its_spin_is_over(monkeypatch):
    sleeps, yields = [], []
    monkeypatch.setattr(board_module.time, 'sleep', sleeps.append)
    real_yield = board_module.os.sched_yield
    monkeypatch.setattr(board_module.os, 'sched_yield',
                        lambda: (yields.append(time.perf_counter()), real_yield()))
    board = Board.create(2, spin=0.02)
    gc.disable()   # a collection inside the spin would read as spinning too long
    start = time.perf_counter()

    def check():
        if time.perf_counter() - start > 0.03:
            raise TimeoutError('done')
    try:
        with pytest.raises(TimeoutError):
            board.meet(1, 0.0, check)
    finally:
        gc.enable()
        board.close()
    assert yields and max(yields) - start <= 0.02 + 0.01
    assert sleeps    # after its spin, it sleeps between looks again


class _SlowWorkers(chainer.Chain):
    """A classifier whose forward takes 200 ms longer outside the master's process."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inner = classifier(seed=3)

    def forward(self, x, t):
        import os
        if str(os.getpid()) != os.environ.get('MGPU_TEST_MASTER_PID'):
            time.sleep(0.2)
        return self.inner(x, t)


def test_every_replica_reports_its_own_window_times(monkeypatch):
    """``updater.last_replica_times``: each replica's own 'data' and 'compute', in replica
    order (the workers' come from their results at the board)."""
    import os
    monkeypatch.setenv('MGPU_TEST_MASTER_PID', str(os.getpid()))
    model = _SlowWorkers()
    opt = optimizers.SGD(0.1)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(32, seed=10 + r), 4) for r in range(3)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 3)
    try:
        assert updater.last_replica_times == []
        for _ in range(2):
            updater.update()
            times = updater.last_replica_times
            assert [sorted(t) for t in times] == [['compute', 'data']] * 3
            assert times[0]['compute'] == updater.last_times['compute']
            fastest_worker = min(t['compute'] for t in times[1:])
            assert times[0]['compute'] < 0.2 <= fastest_worker   # the workers slept 200 ms
    finally:
        updater.finalize()

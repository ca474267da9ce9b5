"""The sharded optimizer step (``mgpu_updater._local.sharded_step``, issue 15).

Its contract: bitwise the master's step (``shard_optimizer=False``), which the
equivalence tests hold to a large-batch ``StandardUpdater``. Every test compares the two in
one process, on CPU replicas, and checks that the sharded run really sharded (or, for what it
must not shard, that it said why and still matched). The master-step run is the reference.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks, optimizers, serializers

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater._local.sharded_step import ELEMENTWISE_RULES, pieces
from mgpu_updater._flat_buffers import FlatLayout
from mgpu_updater.comm.base import SHARD_ALIGN, shard_range

from _models import classifier, dataset


# --------------------------------------------------------------------------------------
# The slices


@pytest.mark.parametrize('count', [0, 1, 15, 16, 17, 147, 596042])
@pytest.mark.parametrize('size', [1, 2, 3, 7])
def test_each_rank_owns_a_contiguous_aligned_slice_and_together_they_cover_the_buffer(
        count, size):
    ranges = [shard_range(count, size, r) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi == lo
    for lo, hi in ranges:
        assert lo <= hi
        assert lo % SHARD_ALIGN == 0 or lo == count
    if count >= SHARD_ALIGN * size * 4:   # large buffers: near-equal shares
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 2 * SHARD_ALIGN


def test_the_pieces_of_all_ranks_partition_every_parameter():
    arrays = [('a', np.zeros((3, 7), 'f')), ('b', np.zeros(5, 'f')),
              ('c', np.zeros(40, 'f')), ('d', np.zeros(9, 'd'))]
    layout = FlatLayout('grad', arrays)
    for size in (1, 2, 3, 5):
        covered = {name: np.zeros(a.size, int) for name, a in arrays}
        for rank in range(size):
            for p in pieces(layout, size, rank):
                covered[p.name][p.lo:p.hi] += 1
        for name, hits in covered.items():
            assert (hits == 1).all(), (size, name, hits)


# --------------------------------------------------------------------------------------
# Bitwise the master's step


def _run(make_opt, shard, n=2, k=2, updates=4, between=None, setup=None, model=None,
         data=None, **kwargs):
    """``updates`` updates of ``n`` CPU replicas; returns what the optimizer and the
    model hold afterwards, and whether each update was sharded. ``data(r)``: replica r's
    dataset; ``kwargs``: the updater's."""
    model = classifier(seed=3) if model is None else model()
    opt = make_opt()
    opt.setup(model)
    if setup is not None:
        setup(model, opt)
    data = data or (lambda r: dataset(64, seed=10 + r))
    its = [chainer.iterators.SerialIterator(data(r), 4, shuffle=False) for r in range(n)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n,
                                          accumulate_steps=k, shard_optimizer=shard,
                                          **kwargs)
    sharded = []
    try:
        for u in range(updates):
            if between is not None:
                between(u, model, opt)
            updater.update()
            shards = getattr(updater._group, 'shards', None)
            sharded.append(shards is not None and shards.reason is None)
    finally:
        updater.finalize()
    out = {'t': opt.t}
    for name, p in model.namedparams():
        out[f'{name}/param'] = np.array(p.array)
        out[f'{name}/grad'] = np.array(p.grad)
        rule = p.update_rule
        out[f'{name}/t'] = rule.t
        for key, value in (rule.state or {}).items():
            out[f'{name}/state/{key}'] = np.array(value)
    return out, sharded


def _assert_bitwise(a, b):
    """Equal bit for bit (NaN where the other has NaN)."""
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key, strict=True)


_OPTIMIZERS = {
    'SGD': lambda: optimizers.SGD(0.1),
    'MomentumSGD': lambda: optimizers.MomentumSGD(0.05),
    'NesterovAG': lambda: optimizers.NesterovAG(0.05),
    'CorrectedMomentumSGD': lambda: optimizers.CorrectedMomentumSGD(0.05),
    'Adam': lambda: optimizers.Adam(1e-2),
    'AdamW': lambda: optimizers.AdamW(1e-2, weight_decay_rate=0.01),
    'AMSBound': lambda: optimizers.AMSBound(1e-2),
    'AdaGrad': lambda: optimizers.AdaGrad(0.05),
    'AdaDelta': lambda: optimizers.AdaDelta(),
    'RMSprop': lambda: optimizers.RMSprop(0.01),
    'RMSpropGraves': lambda: optimizers.RMSpropGraves(0.01),
    'SMORMS3': lambda: optimizers.SMORMS3(0.01),
}


def test_every_rule_chainer_declares_elementwise_is_tested_or_left_out_for_a_reason():
    declared = {getattr(optimizers, name)().create_update_rule().__class__
                for name in dir(optimizers) if name[0].isupper()
                and getattr(getattr(optimizers, name)().create_update_rule(),
                            'is_elementwise', False)}
    tested = {f().create_update_rule().__class__ for f in _OPTIMIZERS.values()}
    assert ELEMENTWISE_RULES == tested
    assert declared - ELEMENTWISE_RULES == {optimizers.msvag.MSVAGRule}


@pytest.mark.parametrize('name', ['SGD', 'MomentumSGD', 'Adam'])
def test_the_sharded_step_is_bitwise_the_masters_step(name):
    sharded, flags = _run(_OPTIMIZERS[name], True)
    master, master_flags = _run(_OPTIMIZERS[name], False)
    assert all(flags) and not any(master_flags)
    _assert_bitwise(sharded, master)


def _tower():
    """A classifier of 12 small layers, one per rule of ``_OPTIMIZERS``."""
    np.random.seed(5)
    layers = []
    for _ in range(len(_OPTIMIZERS)):
        layers += [L.Linear(5, 5), F.tanh]
    return L.Classifier(chainer.Sequential(*layers, L.Linear(5, 3)))


def _every_rule(model, opt):
    links = [link for link in model.predictor if isinstance(link, L.Linear)]
    for link, name in zip(links, sorted(_OPTIMIZERS)):
        for param in link.params():
            param.update_rule = _OPTIMIZERS[name]().create_update_rule()


@pytest.mark.parametrize('n', [2, 3])
def test_every_elementwise_rule_is_bitwise_the_masters_step_wherever_the_slices_cut(n):
    """One model, each layer stepped by another rule (each with its own optimizer's
    hyperparameters), cut into 2 and 3 slices at several places inside layers."""
    sharded, flags = _run(_OPTIMIZERS['SGD'], True, n=n, setup=_every_rule, model=_tower)
    master, _ = _run(_OPTIMIZERS['SGD'], False, n=n, setup=_every_rule, model=_tower)
    assert all(flags)
    _assert_bitwise(sharded, master)
    assert {k.rsplit('/', 1)[-1] for k in sharded if '/state/' in k} >= {
        'v', 'm', 'h', 'msg', 'msdx', 'ms', 'delta', 'n', 'g', 'g2', 'mem', 'vhat'}


@pytest.mark.parametrize('hooks', [
    [optimizer_hooks.WeightDecay(1e-2)],
    [optimizer_hooks.Lasso(1e-3), optimizer_hooks.GradientHardClipping(-0.02, 0.02)],
], ids=['WeightDecay', 'Lasso+GradientHardClipping'])
def test_elementwise_hooks_run_on_each_slice_as_on_the_whole(hooks):
    def setup(model, opt):
        for hook in hooks:
            opt.add_hook(hook)
    sharded, flags = _run(_OPTIMIZERS['MomentumSGD'], True, setup=setup)
    master, _ = _run(_OPTIMIZERS['MomentumSGD'], False, setup=setup)
    assert all(flags)
    _assert_bitwise(sharded, master)


def test_hyperparameters_changed_between_updates_reach_every_slice():
    """What ExponentialShift and a per-parameter override do, and a frozen link."""
    def between(u, model, opt):
        opt.lr = 0.05 * 0.5 ** u                                   # ExponentialShift('lr')
        model.predictor.l2.W.update_rule.hyperparam.lr = 0.01 * (u + 1)   # its own value
        if u == 2:
            model.predictor.l1.disable_update()
    sharded, flags = _run(_OPTIMIZERS['MomentumSGD'], True, between=between, updates=5)
    master, _ = _run(_OPTIMIZERS['MomentumSGD'], False, between=between, updates=5)
    assert all(flags)
    _assert_bitwise(sharded, master)
    assert sharded['/predictor/l1/W/t'] == 2 and sharded['/predictor/l2/W/t'] == 5


@pytest.mark.parametrize('case', ['GradientClipping', 'MSVAG', 'rule hook', 'loss scaling'])
def test_what_is_not_elementwise_is_the_masters_step_and_says_why(case):
    make = _OPTIMIZERS['SGD']
    setup = None
    if case == 'GradientClipping':
        def setup(model, opt):
            opt.add_hook(optimizer_hooks.GradientClipping(0.05))
    elif case == 'MSVAG':
        def make():
            return optimizers.MSVAG(0.01)
    elif case == 'rule hook':
        def setup(model, opt):
            model.predictor.l2.W.update_rule.add_hook(optimizer_hooks.WeightDecay(1e-2))
    else:
        def setup(model, opt):
            opt.loss_scaling(scale=8.0)
    sharded, flags = _run(make, True, setup=setup)
    master, _ = _run(make, False, setup=setup)
    assert not any(flags)
    _assert_bitwise(sharded, master)


def _poisoned(replica, update, k=2, b=4):
    """Replica ``replica``'s dataset with an infinite input in update ``update`` (0-based):
    its loss, and so the update's, is not finite."""
    def data(r):
        d = dataset(64, seed=10 + r)
        if r == replica:
            x, t = d._datasets
            x = x.copy()
            x[update * k * b] = np.inf
            d = chainer.datasets.TupleDataset(x, t)
        return d
    return data


def _inf_is_fine():
    """numpy's warnings about the infinite input (numpy 2 warns in ``dot``), which the
    suite turns into errors, in this process: the master's window and step."""
    return np.errstate(invalid='ignore', over='ignore', divide='ignore')


@pytest.mark.parametrize('poisoned', [0, 1])
def test_under_skip_no_rank_steps_on_a_non_finite_loss(poisoned):
    """Every rank decides the factor itself, from the posts at the board: a non-finite loss
    in any replica skips the step on every slice, as the master's step skips it."""
    data = _poisoned(poisoned, update=1)
    with _inf_is_fine(), pytest.warns(RuntimeWarning, match='skipping update 2'):
        sharded, flags = _run(_OPTIMIZERS['MomentumSGD'], True, data=data, nonfinite='skip')
    with _inf_is_fine(), pytest.warns(RuntimeWarning, match='skipping update 2'):
        master, _ = _run(_OPTIMIZERS['MomentumSGD'], False, data=data, nonfinite='skip')
    assert all(flags)
    _assert_bitwise(sharded, master)
    assert sharded['t'] == 3 and all(np.isfinite(v).all() for k, v in sharded.items()
                                     if k.endswith('/param'))


def test_under_ignore_every_rank_steps_on_a_non_finite_loss():
    data = _poisoned(1, update=1)
    with _inf_is_fine():
        sharded, flags = _run(_OPTIMIZERS['SGD'], True, data=data, nonfinite='ignore')
        master, _ = _run(_OPTIMIZERS['SGD'], False, data=data, nonfinite='ignore')
    assert all(flags)
    _assert_bitwise(sharded, master)
    assert sharded['t'] == 4 and np.isnan(sharded['/predictor/l1/W/param']).all()


def test_under_raise_a_non_finite_loss_raises_and_the_workers_stop():
    import multiprocessing
    from mgpu_updater import NonFiniteLossError
    model = classifier(seed=3)
    opt = optimizers.SGD(0.1)
    opt.setup(model)
    data = _poisoned(1, update=1)
    its = [chainer.iterators.SerialIterator(data(r), 4, shuffle=False) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          accumulate_steps=2, shard_optimizer=True)
    try:
        updater.update()
        assert updater._group.shards.reason is None
        before = {name: p.array.copy() for name, p in model.namedparams()}
        with pytest.raises(NonFiniteLossError, match='update 2'):
            updater.update()
        assert [p for p in multiprocessing.active_children()
                if p.name.startswith('mgpu-worker-')] == []
        for name, p in model.namedparams():   # the master's slice was not stepped either
            np.testing.assert_array_equal(p.array, before[name], err_msg=name)
    finally:
        updater.finalize()


def test_the_board_gives_every_rank_every_post_in_rank_order_round_by_round():
    """Rounds as a sharded update uses them: a round with values (count, loss), then one
    without ("my slice is stepped"), which keeps them readable; only then new values."""
    import multiprocessing
    from mgpu_updater._local.board import Board

    def rank1(name, out):
        board = Board.attach(name, 2, 1)
        for count, loss in ((3, 1.5), (0, float('inf'))):
            out.put(board.meet(count, loss, lambda: None))
            board.post()
            board.wait(lambda: None)
            out.put(board.posted())
        board.close()
    board = Board.create(2)
    ctx = multiprocessing.get_context('fork')
    out = ctx.Queue()
    proc = ctx.Process(target=rank1, args=(board.name, out))
    proc.start()
    try:
        for count, loss, expected in ((5, 2.5, [(5, 2.5), (3, 1.5)]),
                                      (7, -1.0, [(7, -1.0), (0, float('inf'))])):
            assert board.meet(count, loss, lambda: None) == expected
            # (read before this rank's next post: then rank 1 may post new values)
            board.post()
            board.wait(lambda: None)
            # rank 1 read its values after the round without values too: kept
            assert out.get(timeout=30) == expected == out.get(timeout=30)
    finally:
        proc.join(30)
        board.close()
    assert proc.exitcode == 0


def test_a_rank_waiting_at_the_board_runs_its_check_and_stops_when_it_raises():
    import time
    from mgpu_updater._local.board import CHECK_EVERY, Board
    board = Board.create(2)
    calls = []

    def check():
        calls.append(time.perf_counter())
        if len(calls) == 3:
            raise RuntimeError('the peer is gone')
    try:
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match='the peer is gone'):
            board.meet(1, 0.0, check)
        assert len(calls) == 3 and calls[-1] - start >= 2 * CHECK_EVERY
        assert time.perf_counter() - start < 2.0
    finally:
        board.close()


def test_a_long_wait_at_the_board_sleeps_longer_between_looks(monkeypatch):
    """A waiter sleeps ``time.sleep(0)`` (about 60 us) at first, then longer, growing with
    the wait and at most LONGEST_SLEEP: a peer's long window costs the waiter little CPU
    (``time.sleep(0)`` alone kept it at about 20% of a core)."""
    import time
    from mgpu_updater._local import board as board_module
    sleeps = []
    real_sleep = time.sleep

    def sleep(seconds):
        sleeps.append(seconds)
        real_sleep(seconds)
    monkeypatch.setattr(board_module.time, 'sleep', sleep)
    board = board_module.Board.create(2)
    deadline = time.perf_counter() + 0.1

    def check():
        if time.perf_counter() > deadline:
            raise TimeoutError('done')
    try:
        with pytest.raises(TimeoutError):
            board.meet(1, 0.0, check)
    finally:
        board.close()
    assert sleeps[0] == 0 and 0 < max(sleeps) <= board_module.LONGEST_SLEEP
    longer = [s for s in sleeps if s > 0]
    assert longer == sorted(longer)          # growing with the time waited
    assert len(sleeps) < 500                 # sleep(0) alone: about 1,600 looks in 0.1 s


def test_where_stores_may_be_seen_out_of_order_the_step_is_not_sharded(monkeypatch):
    """The board publishes a post by the order of stores (x86-64's); on a CPU without
    that order the master steps, and says why."""
    from mgpu_updater._local import sharded_step
    monkeypatch.setattr(sharded_step, 'STORE_ORDER', False)
    sharded, flags = _run(_OPTIMIZERS['SGD'], True, updates=2)
    master, _ = _run(_OPTIMIZERS['SGD'], False, updates=2)
    assert not any(flags)
    _assert_bitwise(sharded, master)
    assert 'store order' in sharded_step.why_not(optimizers.SGD(), None, ())


def test_why_an_update_is_not_sharded_is_said():
    model = classifier(seed=3)
    opt = optimizers.SGD(0.1)
    opt.setup(model)
    opt.add_hook(optimizer_hooks.GradientClipping(0.05))
    its = [chainer.iterators.SerialIterator(dataset(32, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          shard_optimizer=True)
    try:
        updater.update()
        assert "'GradientClipping' is not elementwise" in updater._group.shards.reason
    finally:
        updater.finalize()


def test_the_default_is_the_trial():
    """``'auto'``: the first updates try both steps (tests/test_step_trial.py)."""
    model = classifier(seed=3)
    opt = optimizers.SGD(0.1)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(32, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2)
    try:
        updater.update()
        assert updater.shard_optimizer == 'auto' and updater._group.shards is not None
        assert updater.optimizer_step == 'trial'
    finally:
        updater.finalize()


def test_false_is_the_masters_step():
    model = classifier(seed=3)
    opt = optimizers.SGD(0.1)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(32, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          shard_optimizer=False)
    try:
        updater.update()
        assert updater._group.shards is None and updater.optimizer_step == 'master'
        assert ('reduce', 'grad/<f4') in updater._group.comm.issued()
    finally:
        updater.finalize()


def test_shard_optimizer_must_be_auto_or_a_bool():
    model = classifier(seed=3)
    opt = optimizers.SGD(0.1)
    opt.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(32, seed=r), 4) for r in range(2)]
    with pytest.raises(TypeError, match=r"shard_optimizer must be 'auto', True or False "
                                        r"\('yes' of type str given\); pass 'auto'"):
        ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2, shard_optimizer='yes')

"""``nonfinite='raise'`` where the master's loss is on a GPU: checked one step late.

Reading the loss before the step would make the host wait for the device once per update
(:mod:`mgpu_updater._late_check`). There the check starts the loss's copy to the host, the
update steps, and the next step (or a snapshot, or ``finalize``) looks at it and raises
:class:`NonFiniteLossError` naming the update, whose step was applied.

Two halves, each against what it must match:

- the updater's side runs on the CPU, with :func:`~mgpu_updater._late_check.defers` made
  to say yes for ``'@numpy'`` (its one seam): the master alone then keeps its loss as a
  0-dim array, as on a GPU, and every path of the protocol runs (the next update, a
  snapshot, ``finalize`` alone and in a ``finally`` block, the Trainer; with a worker the
  check stays before the step);
- the copy itself against the CuPy stand-in (tests/_fakecupy.py, which models CuPy 14's
  ``ndarray.get``, events and pinned memory): an asynchronous copy into pinned memory on
  the current stream, an event after it, and the host waits on that event only when the
  value is taken. tests/test_gpu.py runs it on a GPU.
"""
import gc
import multiprocessing
import sys
from pathlib import Path

import chainer
import numpy
import pytest

from mgpu_updater import NonFiniteLossError, _late_check

import _fakecupy

sys.path.insert(0, str(Path(__file__).resolve().parent / 'scripts' / 'faults'))
import faulty  # noqa: E402


def params(updater):
    return {name: p.array.copy() for name, p in
            updater.get_optimizer('main').target.namedparams()}


@pytest.fixture
def late(monkeypatch):
    """The master's loss looked at one step late, as where it is on a GPU."""
    monkeypatch.setattr(_late_check, 'defers', lambda device: True)


def nan_at_update_2(n_replicas, accumulate_steps=2, **kwargs):
    # update 2's first micro-batch: the third forward at accumulate_steps=2, the second at 1
    replica = 1 if n_replicas > 1 else 0
    at = accumulate_steps + 1
    return faulty.build(n_replicas, faulty.Fault('forward', 'nan', replica=replica, at=at),
                        prefetch=0, accumulate_steps=accumulate_steps, **kwargs)


@pytest.mark.parametrize('k', [1, 2])
def test_the_next_update_raises_naming_the_update_whose_step_was_applied(late, k):
    """At k=1 the update is StandardUpdater's (``_update_direct``); at 2 the window's."""
    updater = nan_at_update_2(1, accumulate_steps=k)
    try:
        updater.update()
        assert updater._direct == (k == 1)
        before = params(updater)
        with numpy.errstate(invalid='ignore'):
            updater.update()   # the NaN update returns: its loss is on its way
            assert updater.iteration == 2
            stepped = params(updater)
            assert any(numpy.isnan(a).any() for a in stepped.values())
            with pytest.raises(NonFiniteLossError,
                               match=r"^the loss became nan at update 2; its step was "
                                     r"applied \(on a GPU the check does not wait for the "
                                     r"loss: nonfinite='skip' checks before the step\)\. "
                                     r'Lower the learning rate') as info:
                updater.update()
        assert info.value.iteration == 2 and info.value.applied
        assert numpy.isnan(info.value.loss)
        assert updater.iteration == 2   # update 3 did not complete
        assert all(numpy.array_equal(stepped[k], v, equal_nan=True)
                   for k, v in params(updater).items())   # nor step
        assert not all(numpy.array_equal(before[k], v) for k, v in stepped.items())
    finally:
        updater.finalize()


def test_with_other_replicas_the_check_stays_before_the_step(late):
    """The master waits for the reduction before its step anyway: there the loss is read
    first, and the NaN update itself raises, its step not applied."""
    updater = nan_at_update_2(2)
    try:
        assert updater._loss_first
        updater.update()
        before = params(updater)
        with pytest.raises(NonFiniteLossError, match=r'^the loss became nan at update 2; '
                                                     r'parameters were not updated') as info:
            updater.update()
        assert not info.value.applied
        assert all(numpy.array_equal(before[k], v) for k, v in params(updater).items())
        assert multiprocessing.active_children() == []   # the failed update stopped them
    finally:
        updater.finalize()


@pytest.mark.parametrize('pipelined', [False, True])
@pytest.mark.parametrize('k', [1, 2])
def test_finite_losses_train_as_when_read_before_the_step(late, monkeypatch, pipelined, k):
    """Nothing changes for finite losses: the same parameters and reports as the check
    before the step, update by update (pipelined: the step of the update before, its
    loss then the one on its way; k=1: one whole micro-batch, the loss handed to the
    check as the loss Variable holds it)."""
    runs = {}
    for deferred in (True, False):
        monkeypatch.setattr(_late_check, 'defers', lambda device, d=deferred: d)
        numpy.random.seed(0)   # the model's initial weights
        updater = faulty.build(1, prefetch=0, own_orders=True, pipelined=pipelined,
                               accumulate_steps=k)
        model = updater.get_optimizer('main').target
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        seen = []
        try:
            for _ in range(4):
                observation = {}
                with reporter.scope(observation):
                    updater.update()
                loss = observation['main/loss']   # k=1: the Variable, as reported
                seen.append((float(getattr(loss, 'array', loss)), params(updater)))
            assert updater._late.pending == deferred
        finally:
            updater.finalize()
        runs[deferred] = seen
    for (loss_a, params_a), (loss_b, params_b) in zip(runs[True], runs[False]):
        assert loss_a == loss_b
        assert all(numpy.array_equal(params_a[k], params_b[k]) for k in params_a)


@pytest.mark.parametrize('pipelined', [False, True])
def test_a_lone_master_hands_its_loss_to_the_check_as_it_is(late, monkeypatch, pipelined):
    """At k=1 the loss goes to the check as the loss Variable holds it: on a GPU a cast
    (``keep_on_device``) is a kernel launched on the host every update, for nothing. The
    pipelined step still sums it as every window's values are, in float64."""
    from mgpu_updater import _replica
    casts = []
    real = _replica.keep_on_device
    monkeypatch.setattr(_replica, 'keep_on_device',
                        lambda values: casts.append(len(values)) or real(values))
    updater = faulty.build(1, prefetch=0, accumulate_steps=1, pipelined=pipelined)
    try:
        for _ in range(3):
            updater.update()
        assert updater._late.pending
    finally:
        updater.finalize()
    assert casts == ([1, 1, 1] if pipelined else [])


def test_a_snapshot_is_not_taken_over_an_unchecked_nan_step(late):
    updater = nan_at_update_2(1)
    try:
        updater.update()
        with numpy.errstate(invalid='ignore'):
            updater.update()
        serializer = chainer.serializers.DictionarySerializer()
        with pytest.raises(NonFiniteLossError, match=r'^the loss became nan at update 2; '
                                                     r'its step was applied'):
            updater.serialize(serializer)
        assert serializer.target == {}   # raised before anything was written
    finally:
        updater.finalize()


def test_finalize_raises_for_the_last_update_once_all_is_released(late):
    updater = nan_at_update_2(1)
    updater.update()
    with numpy.errstate(invalid='ignore'):
        updater.update()
    with pytest.raises(NonFiniteLossError, match=r'^the loss became nan at update 2; '
                                                 r'its step was applied') as info:
        updater.finalize()
    assert info.value.iteration == 2
    assert updater._replica is None   # released before it raised
    updater.finalize()   # the loss was taken: nothing pending, nothing raised


def test_finalize_in_a_finally_block_warns_instead_of_hiding_the_error(late):
    """Where another exception is on its way (the Trainer's ``finally``), finalize does
    not replace it: the NaN of the last update becomes a RuntimeWarning."""
    updater = nan_at_update_2(1)
    updater.update()
    with pytest.raises(KeyError, match='elsewhere'), \
            pytest.warns(RuntimeWarning, match=r'^the loss became nan at update 2; its step '
                                               r'was applied'):
        try:
            with numpy.errstate(invalid='ignore'):
                updater.update()
            raise KeyError('elsewhere')
        finally:
            updater.finalize()


def test_an_updater_dropped_without_finalize_warns_of_its_last_nan(late):
    """Nobody to raise to: dropped (garbage), the updater still looks at the loss on its
    way, and a NaN is a RuntimeWarning."""
    updater = nan_at_update_2(1)
    updater.update()
    with numpy.errstate(invalid='ignore'):
        updater.update()
    with pytest.warns(RuntimeWarning, match=r'^the loss became nan at update 2; its step '
                                            r'was applied'):
        del updater
        gc.collect()


def test_a_trainer_whose_last_update_is_nan_raises(late, tmp_path):
    """The NaN in the last update of ``trainer.run()``: its finalize raises it."""
    updater = nan_at_update_2(1)
    trainer = chainer.training.Trainer(updater, (2, 'iteration'), out=str(tmp_path))
    with numpy.errstate(invalid='ignore'), \
            pytest.raises(NonFiniteLossError, match=r'^the loss became nan at update 2; '):
        trainer.run()
    assert updater.iteration == 2


def test_skip_still_reads_before_the_step(late):
    """``'skip'`` must not step on a NaN: it reads the loss first wherever it is."""
    updater = nan_at_update_2(1, nonfinite='skip')
    try:
        assert updater._loss_first
        updater.update()
        before = params(updater)
        with numpy.errstate(invalid='ignore'), \
                pytest.warns(RuntimeWarning, match=r'^skipping update 2: the loss is nan$'):
            updater.update()
        assert all(numpy.array_equal(before[k], v) for k, v in params(updater).items())
    finally:
        updater.finalize()


# ------------------------------------------------------------------ the copy (CuPy stand-in)
def test_the_copy_goes_to_pinned_memory_on_the_stream_and_is_waited_for_when_taken(
        monkeypatch):
    fake = _fakecupy.install(monkeypatch)
    monkeypatch.setattr(chainer.backends.cuda, 'ndarray', fake.FakeArray)
    stream = fake.cuda.Stream(non_blocking=True)
    with fake.cuda.Device(0), stream:
        loss = fake.zeros((), numpy.float64)
        loss[...] = numpy.float64('inf')
        check = _late_check.LateCheck()
        del fake.log[:]
        check.start(7, loss)
    kinds = [entry[0] for entry in fake.log]
    assert kinds == ['d2h', 'record'] and fake.log[1][1] is stream   # copy, then the event
    assert check.pending
    with pytest.raises(RuntimeError, match=r'^the loss of update 7 was not checked yet$'):
        check.start(8, loss)
    fake.pending_polls = 3   # the copy still running: take() waits for the event
    assert check.take() == (7, float('inf'))
    assert fake.pending_polls == 0 and not check.pending
    assert check.take() is None
    with fake.cuda.Device(0):
        check.start(8, fake.zeros((), numpy.float64))
    assert check.take() is None   # finite


@pytest.mark.parametrize('dtype,shape', [(numpy.float32, ()), (numpy.float16, (1,)),
                                         (numpy.float64, ())])
def test_every_update_reuses_one_pinned_buffer_and_one_event(monkeypatch, dtype, shape):
    """What runs every update on the host of a lone GPU master makes nothing new: the
    loss is copied as the loss Variable holds it (its dtype, one element: no cast
    kernel), into the same pinned memory, with the same event recorded after it; each
    update's value is the one taken, a NaN named with its update."""
    fake = _fakecupy.install(monkeypatch)
    monkeypatch.setattr(chainer.backends.cuda, 'ndarray', fake.FakeArray)
    check = _late_check.LateCheck()
    losses = [dtype(1.5), dtype(-2.25), dtype('nan'), dtype(0.125)]
    found = []
    with fake.cuda.Device(0):
        for update, value in enumerate(losses, 1):
            loss = fake.zeros(shape, dtype)
            loss[...] = value
            del fake.log[:]
            check.start(update, loss)
            assert [entry[0] for entry in fake.log] == ['d2h', 'record']
            events = {id(entry[2]) for entry in fake.log if entry[0] == 'record'}
            if update == 1:
                first_event = events
            assert events == first_event
            found.append(check.take())
    assert len(fake.pinned) == 1
    assert found[:2] == [None, None] and found[3] is None
    assert found[2][0] == 3 and numpy.isnan(found[2][1])


def test_a_copy_that_never_finishes_is_an_error_not_a_hang(monkeypatch):
    fake = _fakecupy.install(monkeypatch)
    monkeypatch.setattr(chainer.backends.cuda, 'ndarray', fake.FakeArray)
    monkeypatch.setattr(_late_check, 'TIMEOUT', 0.2)
    with fake.cuda.Device(0):
        check = _late_check.LateCheck()
        check.start(3, fake.zeros((), numpy.float64))
    fake.hang = True
    with pytest.raises(TimeoutError, match=r'^the copy of the loss of update 3 to the host '
                                           r'did not finish within 0.2 s$'):
        check.take()
    assert not check.pending


def test_defers_exactly_where_the_device_is_a_gpu():
    assert not _late_check.defers(chainer.get_device('@numpy'))
    assert _late_check.defers(type('GpuDevice', (), {'xp': object()})())


"""The updater inside chainer.training.Trainer: extensions, reporting, resume, cleanup."""
from __future__ import annotations

import io
import json
import multiprocessing

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators

from _models import classifier, dataset, params, run_updates, setup_optimizer


def _alive(pid):
    try:
        with open(f'/proc/{pid}/status') as f:
            return 'State:\tZ' not in f.read()
    except FileNotFoundError:
        return False


def test_trainer_end_to_end_with_the_usual_extensions(tmp_path, capsys):
    train, test = dataset(96, seed=1), dataset(32, seed=2)
    model = classifier(seed=1)
    opt = setup_optimizer('adam', model)
    its = shard_iterators(train, 2, 8)
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2, accumulate_steps=2,
                                          report_times=True)
    trainer = training.Trainer(updater, (2, 'epoch'), out=str(tmp_path))
    test_it = chainer.iterators.SerialIterator(test, 16, repeat=False, shuffle=False)
    trainer.extend(extensions.Evaluator(test_it, model))
    trainer.extend(extensions.LogReport(trigger=(1, 'epoch')))
    printed = io.StringIO()
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'main/loss', 'main/accuracy', 'validation/main/loss'],
        out=printed))
    trainer.extend(extensions.ProgressBar(update_interval=1))
    pids = []
    trainer.extend(lambda t: pids.extend(t.updater.worker_pids()), trigger=(1, 'iteration'))
    trainer.run()

    log = json.loads((tmp_path / 'log').read_text())
    assert [e['epoch'] for e in log] == [1, 2]
    # 96 samples over 2 shards of 48, micro-batch 8, 2 steps: 3 updates per epoch
    assert [e['iteration'] for e in log] == [3, 6]
    for entry in log:
        for key in ('main/loss', 'main/accuracy', 'validation/main/loss',
                    'main/time/data', 'main/time/compute', 'main/time/comm'):
            assert np.isfinite(entry[key]), key
    assert 'validation/main/loss' in printed.getvalue()
    assert 'this epoch' in capsys.readouterr().out   # ProgressBar writes to stdout
    # every worker is gone once trainer.run() returned, and reaped
    assert pids and not any(_alive(p) for p in set(pids))
    assert multiprocessing.active_children() == []


def test_logreport_main_loss_equals_the_large_batch_loss(tmp_path):
    n, b, k, updates = 2, 4, 3, 4
    datasets = [dataset(b * k * updates, seed=10 + r) for r in range(n)]
    model, ref = classifier(seed=3), classifier(seed=3)
    its = [chainer.iterators.SerialIterator(d, b, shuffle=False) for d in datasets]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('momentum+decay', model),
                                          devices=['@numpy'] * n, accumulate_steps=k)
    trainer = training.Trainer(updater, (updates, 'iteration'), out=str(tmp_path))
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    trainer.run()
    logged = [e['main/loss'] for e in json.loads((tmp_path / 'log').read_text())]

    ref_opt = setup_optimizer('momentum+decay', ref)
    expected = []
    for u in range(updates):
        batch = []
        for d in datasets:
            batch.extend(d[u * k * b:(u + 1) * k * b])
        it = chainer.iterators.SerialIterator(batch, len(batch), shuffle=False)
        expected.append(float(run_updates(StandardUpdater(it, ref_opt), ref, 1)[0]
                              ['main/loss'].array))
    np.testing.assert_allclose(logged, expected, rtol=1e-5)


def _resumable_trainer(out, stop, prefetch):
    train = dataset(130, seed=5)    # 65 per shard, micro-batch 4, k 3: epochs end mid-window
    model = classifier(seed=5, batchnorm=True)
    opt = setup_optimizer('adam', model)
    its = shard_iterators(train, 2, 4, seed=7)
    updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * 2,
                                          accumulate_steps=3, prefetch=prefetch)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=str(out))
    trainer.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                   trigger=(7, 'iteration'))
    return trainer, model


@pytest.mark.parametrize('prefetch', [0, 2])
def test_resume_from_a_snapshot_is_bit_exact(tmp_path, prefetch):
    straight, model_a = _resumable_trainer(tmp_path / 'a', 14, prefetch)
    straight.run()

    first, _ = _resumable_trainer(tmp_path / 'b', 7, prefetch)
    first.run()
    resumed, model_b = _resumable_trainer(tmp_path / 'b', 14, prefetch)
    chainer.serializers.load_npz(str(tmp_path / 'b' / 'snap_7'), resumed)
    assert resumed.updater.iteration == 7
    resumed.run()

    pa, pb = params(model_a), params(model_b)
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name
    assert np.array_equal(model_a.predictor.bn.avg_mean, model_b.predictor.bn.avg_mean)
    assert straight.updater.epoch_detail == resumed.updater.epoch_detail


def test_snapshot_with_other_devices_or_steps_is_refused(tmp_path):
    trainer, _ = _resumable_trainer(tmp_path, 7, 2)
    trainer.run()
    model = classifier(seed=5, batchnorm=True)
    its = shard_iterators(dataset(130, seed=5), 3, 4)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('adam', model),
                                          devices=['@numpy'] * 3, accumulate_steps=3)
    other = training.Trainer(updater, (14, 'iteration'), out=str(tmp_path / 'c'))
    with pytest.raises(ValueError, match=r'taken with 2 device\(s\) and accumulate_steps=3, '
                                         r'but this updater has 3'):
        chainer.serializers.load_npz(str(tmp_path / 'snap_7'), other)
    updater.finalize()


def test_epoch_triggers_fire_when_an_epoch_ends_inside_a_window(tmp_path):
    # shards of 10, micro-batch 4, k 2: every update holds 8 samples per replica, so the
    # epochs end inside windows (after 1.25 updates)
    model = classifier(seed=4)
    its = shard_iterators(dataset(20, seed=4), 2, 4)
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2, accumulate_steps=2)
    trainer = training.Trainer(updater, (3, 'epoch'), out=str(tmp_path))
    trainer.extend(extensions.LogReport(trigger=(1, 'epoch')))
    trainer.run()
    log = json.loads((tmp_path / 'log').read_text())
    assert [e['epoch'] for e in log] == [1, 2, 3]
    assert [e['iteration'] for e in log] == [2, 3, 4]   # 8, 16, 24, 32 samples per shard



def _register_as_gen(reporter, model):
    reporter.add_observer('gen', model)
    reporter.add_observers('gen', model.namedlinks(skipself=True))


def _turns(tmp_path, make_second, second_model=None, register=_register_as_gen):
    """A Trainer running a StandardUpdater, and an extension running a second updater
    (``make_second(model, data)``) whose model the script registers (as 'gen', by
    default; GAN-style turns); the Trainer's observation after each iteration."""
    first_model = classifier(seed=1)
    second_model = classifier(seed=2) if second_model is None else second_model
    first = StandardUpdater(
        chainer.iterators.SerialIterator(dataset(32, seed=1), 8, shuffle=False),
        setup_optimizer('sgd', first_model))
    trainer = training.Trainer(first, (3, 'iteration'), out=str(tmp_path))
    register(trainer.reporter, second_model)
    second = make_second(second_model, dataset(32, seed=3))
    logged = []
    trainer.extend(lambda t: second.update(), trigger=(1, 'iteration'), priority=300,
                   name='second')
    trainer.extend(lambda t: logged.append(dict(t.observation)), trigger=(1, 'iteration'),
                   priority=0, name='record')
    try:
        trainer.run()
    finally:
        second.finalize()
    return logged


@pytest.mark.parametrize('devices, k', [(['@numpy'], 2), (['@numpy', '@numpy'], 1),
                                        (['@numpy'], 1)])
def test_a_second_updater_reports_under_the_name_its_model_is_given(tmp_path, devices, k):
    """Under StandardUpdater the second updater's reports log as gen/*, beside the first
    updater's main/*; here too (they were main/*, in place of the first's), and so do the
    updater's own keys (report_times)."""
    def ours(model, data):   # the same 8 samples an update
        its = [chainer.iterators.SerialIterator(data[i::len(devices)],
                                                8 // len(devices) // k, shuffle=False)
               for i in range(len(devices))]
        return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                           devices=devices, accumulate_steps=k,
                                           report_times=True)

    reference = _turns(tmp_path / 'standard', _standard)
    logged = _turns(tmp_path / 'ours', ours)
    assert len(logged) == len(reference) == 3
    for got, want in zip(logged, reference):
        assert float(chainer.as_array(got['main/loss'])) == float(want['main/loss'].array)
        assert float(chainer.as_array(got['gen/loss'])) == pytest.approx(
            float(want['gen/loss'].array), rel=1e-5)
        assert 'gen/time/update' in got and 'main/time/update' not in got


def _standard(model, data):
    """The second updater of :func:`_turns`: StandardUpdater, 8 samples an update."""
    return StandardUpdater(chainer.iterators.SerialIterator(data, 8, shuffle=False),
                           setup_optimizer('sgd', model))


def _two_replicas(model, data):
    """... this updater on two replicas over the same 8 samples an update."""
    its = [chainer.iterators.SerialIterator(data[i::2], 4, shuffle=False) for i in range(2)]
    return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                       devices=['@numpy', '@numpy'])


class _ReportsThreeWays(chainer.Chain):
    """Its child, an L.Classifier, reports as itself; the model reports as itself, and a
    value without an observer under a key of its own choosing."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c = classifier(seed=2)

    def forward(self, x, t):
        loss = self.c(x, t)
        chainer.report({'twice': 2 * loss}, self)
        chainer.report({'main/raw': loss})
        return loss


def _sublinks_as_gen(reporter, model):
    reporter.add_observer('gen', model)
    reporter.add_observers('gen', model.namedlinks(skipself=True))
    reporter.add_observer('g2', model)   # the model twice: the last name holds


def _only_the_child(reporter, model):
    reporter.add_observers('gen', model.namedlinks(skipself=True))
    reporter.add_observer('top', model)


@pytest.mark.parametrize('register', [_sublinks_as_gen, _only_the_child])
def test_each_link_reports_under_the_name_the_reporter_gives_it(tmp_path, register):
    """Each key is named after the link that reported it, as the reporter names that link
    (the model and its child under different names), and a key reported without an
    observer stays as it is (it was renamed with the model's name)."""
    np.random.seed(0)
    reference = _turns(tmp_path / 'standard', _standard, _ReportsThreeWays(), register)
    np.random.seed(0)
    logged = _turns(tmp_path / 'ours', _two_replicas, _ReportsThreeWays(), register)
    for got, want in zip(logged, reference):
        assert sorted(got) == sorted(want)
        for key in want:
            assert float(chainer.as_array(got[key])) == pytest.approx(
                float(chainer.as_array(want[key])), rel=1e-5), key


def test_a_second_model_not_registered_is_warned_where_its_values_would_take_mains(tmp_path):
    """StandardUpdater's report raises KeyError for a model the reporter was not given;
    here its values would be named main/*, in the place of the Trainer's model's: warned."""
    def unregistered(reporter, model):
        pass

    with pytest.raises(KeyError, match='not registered'):
        _turns(tmp_path / 'standard', _standard, register=unregistered)
    with pytest.warns(RuntimeWarning, match=r"the model is not registered with the reporter "
                                            r"current at this update, which names another "
                                            r"observer 'main'"):
        _turns(tmp_path / 'ours', _two_replicas, register=unregistered)


class _HasAChildCalledTime(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c = classifier(seed=2)
            self.time = L.Linear(5, 3)

    def forward(self, x, t):
        loss = self.c(x, t)
        chainer.report({'x': F.mean(self.time(x))}, self.time)
        return loss


def test_the_updaters_own_keys_take_the_models_name_whatever_its_links_are_called(tmp_path):
    """report_times: main/time/* (or the model's name), also where a child link is called
    'time' and the reporter names it otherwise (its name took the keys)."""
    model = _HasAChildCalledTime()
    its = [chainer.iterators.SerialIterator(dataset(16, seed=r), 4) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy', '@numpy'], report_times=True)
    trainer = training.Trainer(updater, (2, 'iteration'), out=str(tmp_path))
    trainer.reporter.add_observer('clock', model.time)
    logged = []
    trainer.extend(lambda t: logged.append(dict(t.observation)), trigger=(1, 'iteration'))
    trainer.run()
    assert {'main/time/data', 'main/time/update', 'clock/x', 'main/c/loss'} <= set(logged[-1])
    assert not any(key.startswith('clock/') and key != 'clock/x' for key in logged[-1])

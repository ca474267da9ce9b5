"""What the iterator, its dataset and the converter report while a batch loads.

Under ``StandardUpdater`` they load inside the Trainer's reporter scope, so a converter
that reports its batch's length (``chainer.report({'tokens': n})``) logs it. Here a batch
loaded ahead loads in a thread with no reporter, a worker's in another process, and with
``accumulate_steps`` > 1 an inline load ran between two micro-batches, reporting into the
last one's values after they were read: the key was missing from the log, silently, in
every configuration but one device with one micro-batch loaded inline.
"""
from __future__ import annotations

import chainer
import numpy as np
import pytest
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import classifier, dataset, run_updates, setup_optimizer


class _Counted(chainer.dataset.DatasetMixin):
    """Reports each read; the converter below reports each batch's length, and through
    the model as observer, the batch's first label."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        chainer.report({'reads': 1.0})
        return self.base[i]


def _converter_reporting_to(model):
    def convert(batch, device=None):
        chainer.report({'tokens': float(len(batch))})
        chainer.report({'first_label': float(batch[0][1])}, model)
        return chainer.dataset.concat_examples(batch, device)
    return convert


def _iterators(n, batch):
    return [chainer.iterators.SerialIterator(_Counted(dataset(24, seed=r)), batch,
                                             shuffle=False) for r in range(n)]


def _reported(updater, model):
    trainer_like = chainer.Reporter()
    trainer_like.add_observer('main', model)
    out = []
    for _ in range(3):
        observation = {}
        with trainer_like.scope(observation):
            updater.update()
        out.append({k: float(chainer.as_array(v)) for k, v in observation.items()
                    if k in ('reads', 'tokens', 'main/first_label')})
    return out


@pytest.mark.parametrize('n, k, prefetch', [
    (1, 1, 0), (1, 1, 2), (1, 2, 0), (1, 2, 'auto'), (2, 1, 2), (2, 2, 0)])
def test_what_loading_reports_is_reported_with_the_update(n, k, prefetch):
    model = classifier()
    updater = ParallelAccumulatingUpdater(
        _iterators(n, 4), setup_optimizer('sgd', model), devices=['@numpy'] * n,
        accumulate_steps=k, prefetch=prefetch, converter=_converter_reporting_to(model))
    try:
        got = _reported(updater, model)
    finally:
        updater.finalize()
    # each micro-batch of 4 reports 4, each read 1: their sample-weighted means
    labels = [[int(t) for _, t in dataset(24, seed=r)] for r in range(n)]
    for update, values in enumerate(got):
        first = [labels[r][(update * k + i) * 4] for r in range(n) for i in range(k)]
        assert values == {'reads': 1.0, 'tokens': 4.0,
                          'main/first_label': pytest.approx(float(np.mean(first)))}, update


def test_one_device_reports_as_standard_updater():
    """One device, one micro-batch of the global batch: the same values, named alike."""
    logs = []
    for ours in (False, True):
        model = classifier()
        its = _iterators(1, 8)
        optimizer = setup_optimizer('sgd', model)
        converter = _converter_reporting_to(model)
        updater = (ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'],
                                               prefetch=2, converter=converter)
                   if ours else StandardUpdater(its[0], optimizer, converter=converter))
        try:
            logs.append(_reported(updater, model))
        finally:
            updater.finalize()
    assert logs[1] == logs[0] and logs[0][0]['tokens'] == 8.0


def test_a_report_while_loading_a_check_of_the_cut_is_not_the_updates():
    """micro_batch_size cuts a batch: the converter runs once more on a piece, aside, to
    check the cut; what it reports there is not the update's."""
    model = classifier()
    updater = ParallelAccumulatingUpdater(
        _iterators(1, 8), setup_optimizer('sgd', model), devices=['@numpy'],
        micro_batch_size=4, prefetch=0, converter=_converter_reporting_to(model))
    try:
        got = run_updates(updater, model, 2)
    finally:
        updater.finalize()
    assert [float(obs['tokens']) for obs in got] == [8.0, 8.0]


def test_a_report_through_an_observer_the_model_does_not_hold_says_so():
    """Chainer's reporter raises a bare KeyError ('Given observer is not registered');
    where batches load only the model and its links are known."""
    model = classifier()
    stranger = chainer.links.Linear(2, 2)

    def convert(batch, device=None):
        chainer.report({'tokens': float(len(batch))}, stranger)
        return chainer.dataset.concat_examples(batch, device)
    updater = ParallelAccumulatingUpdater(_iterators(1, 4), setup_optimizer('sgd', model),
                                          devices=['@numpy'], prefetch=2, converter=convert)
    try:
        with pytest.raises(KeyError, match=r"that observer is neither the model nor one of "
                                           r'its links'):
            run_updates(updater, model, 2)
    finally:
        updater.finalize()


class _ReportsN(chainer.Chain):
    """Reports ``n`` itself, after the converter did (as StandardUpdater's update runs
    them): the model's value of a name wins."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = chainer.links.Linear(5, 3)

    def forward(self, x, t):
        chainer.report({'n': 100.0}, self)
        return chainer.functions.softmax_cross_entropy(self.l(x), t)


@pytest.mark.parametrize('n, k, kwargs', [
    (1, 1, {}), (1, 1, {'prefetch': 0}), (1, 2, {}), (2, 1, {}), (1, 1, {'pipelined': True})])
def test_the_models_value_of_a_name_wins_over_the_converters(n, k, kwargs):
    model = _ReportsN()

    def convert(batch, device=None):
        chainer.report({'n': float(len(batch))}, model)
        chainer.report({'tokens': float(len(batch))})
        return chainer.dataset.concat_examples(batch, device)
    updater = ParallelAccumulatingUpdater(_iterators(n, 4), setup_optimizer('sgd', model),
                                          devices=['@numpy'] * n, accumulate_steps=k,
                                          converter=convert, **kwargs)
    try:
        got = run_updates(updater, model, 3)
    finally:
        updater.finalize()
    # (pipelined: no step at the first update, its reports all the same)
    assert [float(obs['main/n']) for obs in got] == [100.0] * 3
    assert [float(obs['tokens']) for obs in got] == [4.0] * 3


def test_an_observer_the_trainers_reporter_was_given_names_the_key_as_there():
    """``trainer.reporter.add_observer('aux', link)``, a converter reporting through that
    link: StandardUpdater logs ``aux/tokens``."""
    model = classifier()
    aux = chainer.links.Linear(2, 2)

    def convert(batch, device=None):
        chainer.report({'tokens': float(len(batch))}, aux)
        return chainer.dataset.concat_examples(batch, device)
    for prefetch, k in ((0, 1), (2, 1), (2, 2)):
        updater = ParallelAccumulatingUpdater(
            _iterators(1, 4), setup_optimizer('sgd', model), devices=['@numpy'],
            prefetch=prefetch, accumulate_steps=k, converter=convert)
        trainer_like = chainer.Reporter()
        trainer_like.add_observer('main', model)
        trainer_like.add_observer('aux', aux)
        try:
            for _ in range(3):
                observation = {}
                with trainer_like.scope(observation):
                    updater.update()
                assert float(observation['aux/tokens']) == 4.0, (prefetch, k)
        finally:
            updater.finalize()


class _LazyCounted(_Counted):
    def get_example(self, i):
        chainer.report({f'read_{i}': 1.0})
        return self.base[i]


def test_the_lazy_parameter_pass_reports_nothing_into_the_first_update():
    """The pass that initialises lazy parameters reads the first samples of the dataset
    and converts them outside any update: what those reads reported landed in update 1."""
    model = chainer.links.Classifier(chainer.links.Linear(None, 3))
    def backwards(order, position):   # the first batch: samples 23 to 20
        return np.arange(24)[::-1]
    its = [chainer.iterators.SerialIterator(_LazyCounted(dataset(24, seed=r)), 4,
                                            order_sampler=backwards) for r in range(2)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    try:
        trainer_like = chainer.Reporter()
        trainer_like.add_observer('main', model)
        observation = {}
        with trainer_like.scope(observation):
            updater.update()
    finally:
        updater.finalize()
    # the first update's batch, on either replica; the pass read samples 0 to 3
    assert sorted(k for k in observation if k.startswith('read_')) == [
        f'read_{i}' for i in range(20, 24)]


@pytest.mark.parametrize('micro_batch_size', [None, 4])
def test_a_batch_cut_into_pieces_weights_what_loading_reported_by_its_samples(
        micro_batch_size):
    """Batches of 10 and 6 (the end of the data), their lengths reported: 8.5 by their
    samples, whatever pieces micro_batch_size cuts them into (it weighted by the first
    piece's, 8.0)."""
    model = classifier()
    its = [chainer.iterators.SerialIterator(dataset(16, seed=0), 10, shuffle=False,
                                            repeat=False)]
    updater = ParallelAccumulatingUpdater(
        its, setup_optimizer('sgd', model), devices=['@numpy'], accumulate_steps=2,
        micro_batch_size=micro_batch_size, converter=_converter_reporting_to(model))
    try:
        got = run_updates(updater, model, 1)
    finally:
        updater.finalize()
    assert float(got[0]['tokens']) == pytest.approx(8.5)


def test_outside_any_reporter_a_report_through_another_observer_does_nothing():
    """An update called by hand (a warm-up before trainer.run()), no reporter current:
    chainer.report does nothing under StandardUpdater, whatever the observer."""
    model = classifier()
    aux = chainer.links.Linear(2, 2)

    def convert(batch, device=None):
        chainer.report({'tokens': float(len(batch))}, aux)
        return chainer.dataset.concat_examples(batch, device)
    for kwargs in ({'prefetch': 0}, {'prefetch': 2}, {'accumulate_steps': 2}):
        updater = ParallelAccumulatingUpdater(_iterators(1, 4), setup_optimizer('sgd', model),
                                              devices=['@numpy'], converter=convert,
                                              **kwargs)
        try:
            for _ in range(2):
                updater.update()
        finally:
            updater.finalize()
        assert updater.iteration == 2

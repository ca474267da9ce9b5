"""A resumed run shuffles as the run it resumes, with Chainer's default shuffling.

``SerialIterator(shuffle=True)`` without an order sampler draws each epoch's order from
numpy's global generator, whose state a snapshot saves and a load restores; the workers
start again after the load, and their seeds, drawn from that generator, once moved it: the
next epoch's order differed, and so did the weights. Also: starting the workers leaves the
master's shuffling where StandardUpdater's would be.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer.serializers import DictionarySerializer, NpzDeserializer

from mgpu_updater import ParallelAccumulatingUpdater

from _models import classifier, dataset, params, run_updates, setup_optimizer

UPDATES, CUT = 10, 4   # 24 samples per replica, batch 4: an epoch is 6 updates


def _build(sizes=(24, 24)):
    model = classifier(seed=0)
    its = [chainer.iterators.SerialIterator(dataset(n, seed=r), 4)
           for r, n in enumerate(sizes)]
    return model, ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                              devices=['@numpy'] * len(sizes))


@pytest.mark.parametrize('sizes', [
    (24, 24),
    # a master shard smaller than another's: warned at construction (the epoch is its)
    pytest.param((20, 24), marks=pytest.mark.filterwarnings(
        "ignore:iterators\\[0\\], the master's, makes:RuntimeWarning")),
    (24, 8), (24, 20, 12)])
def test_a_resume_across_an_epoch_boundary_is_exact(sizes):
    """Shards of different lengths draw their next orders at different updates, so each
    process's copy of the generator has its own state, which the master's iterators
    (sharing one generator) cannot all hold: the load restored the last one saved into
    the master's, and the master's next order was the worker's."""
    np.random.seed(5)
    model, updater = _build(sizes)
    try:
        run_updates(updater, model, UPDATES)
    finally:
        updater.finalize()
    whole = params(model)

    np.random.seed(5)
    model, updater = _build(sizes)
    try:
        run_updates(updater, model, CUT)
        saved = {}
        updater.serialize(DictionarySerializer(saved))
    finally:
        updater.finalize()
    np.random.seed(123)   # whatever the new process's generator holds: the snapshot's wins
    model, updater = _build(sizes)
    try:
        updater.serialize(NpzDeserializer(saved))
        run_updates(updater, model, UPDATES - CUT)
        assert updater.iteration == UPDATES
    finally:
        updater.finalize()
    for name, value in whole.items():
        np.testing.assert_array_equal(params(model)[name], value, err_msg=name)


def test_starting_the_workers_leaves_numpys_generator_as_it_was():
    np.random.seed(9)
    model, updater = _build()   # each iterator drew its first order from it
    before = np.random.get_state()
    try:
        updater.update()   # the workers start (no epoch ends, the model draws nothing)
        after = np.random.get_state()
    finally:
        updater.finalize()
    assert np.array_equal(after[1], before[1]) and after[2] == before[2]

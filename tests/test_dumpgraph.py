"""``DumpGraph('main/loss')`` and anything else that reads graphs from the observation.

Chainer's example scripts extend their Trainer with ``DumpGraph('main/loss')``: it turns
on ``chainer.config.keep_graph_on_report`` and, at the first iteration, reads the reported
``main/loss`` as a Variable with a graph. The graph written must be the model's (of one
micro-batch on the master), while ``LogReport`` logs the aggregated loss, unchanged.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import chainer
from chainer import training
from chainer.training import extensions
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import classifier, dataset, setup_optimizer

K, B, ITERATIONS = 2, 4, 3


def _train(out, n, dump_graph, standard=False, extra=()):
    datasets = [dataset(B * K * ITERATIONS, seed=100 + r) for r in range(n)]
    model = classifier(seed=8)
    opt = setup_optimizer('momentum+decay', model)
    if standard:
        batches = []
        for u in range(ITERATIONS):
            for d in datasets:
                batches.extend(d[u * K * B:(u + 1) * K * B])
        updater = StandardUpdater(chainer.iterators.SerialIterator(
            batches, n * K * B, shuffle=False), opt)
    else:
        its = [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in datasets]
        updater = ParallelAccumulatingUpdater(its, opt, devices=['@numpy'] * n,
                                              accumulate_steps=K, report_times=False)
    trainer = training.Trainer(updater, (ITERATIONS, 'iteration'), out=str(out))
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    if dump_graph:
        trainer.extend(extensions.DumpGraph('main/loss'))
    for ext in extra:
        trainer.extend(ext, trigger=(1, 'iteration'))
    trainer.run()
    with open(out / 'log') as f:
        return [entry['main/loss'] for entry in json.load(f)]


@pytest.mark.parametrize('n', [1, 2])
def test_dump_graph_writes_the_model_graph_and_log_keeps_the_aggregate(tmp_path, n):
    flag = chainer.config.keep_graph_on_report
    with_graph = _train(tmp_path / 'dump', n, dump_graph=True)
    dot = (tmp_path / 'dump' / 'cg.dot').read_text()
    assert 'LinearFunction' in dot and 'SoftmaxCrossEntropy' in dot, dot[:500]
    assert 'AggregatedOverUpdate' in dot
    assert chainer.config.keep_graph_on_report == flag    # DumpGraph restored it
    without = _train(tmp_path / 'plain', n, dump_graph=False)
    assert with_graph == without       # bit for bit: the logged loss is the aggregate
    reference = _train(tmp_path / 'standard', n, dump_graph=False, standard=True)
    np.testing.assert_allclose(with_graph, reference, rtol=1e-5)


class _GraphReader(chainer.training.Extension):
    """Reads the graph of ``main/loss`` at every iteration, as extensions relying on
    ``keep_graph_on_report`` do."""

    def __init__(self):
        self.functions = []
        self.values = []

    def initialize(self, trainer):
        chainer.config.keep_graph_on_report = True

    def __call__(self, trainer):
        var = trainer.observation['main/loss']
        names, node = [], var.creator
        while node is not None:
            names.append(type(node).__name__)
            node = node.inputs[0].creator if node.inputs else None
        self.functions.append(names)
        self.values.append(float(var.array))

    def finalize(self):
        chainer.config.keep_graph_on_report = False


def test_keep_graph_on_report_gives_every_iteration_a_graph(tmp_path):
    reader = _GraphReader()
    try:
        logged = _train(tmp_path, 2, dump_graph=False, extra=[reader])
    finally:
        chainer.config.keep_graph_on_report = False
    assert len(reader.functions) == ITERATIONS
    for names in reader.functions:
        assert names[0] == 'AggregatedOverUpdate' and 'SoftmaxCrossEntropy' in names, names
    assert reader.values == logged

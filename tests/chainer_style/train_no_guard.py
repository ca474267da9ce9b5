#!/usr/bin/env python
"""A Chainer-style MNIST script without an ``if __name__ == '__main__':`` guard.

Workers are started with ``spawn``, which imports the main module again in the child; so
this script cannot work with worker processes. It must fail within seconds, saying that
it needs the guard, and never hang. The training data (800 KB) is far larger than a pipe's
buffer.
"""
import argparse

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

from mgpu_updater import ParallelAccumulatingUpdater

import synthetic


class MLP(chainer.Chain):

    def __init__(self, n_units, n_out):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(None, n_out)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


parser = argparse.ArgumentParser(description='Chainer-style example without a main guard')
parser.add_argument('--batchsize', '-b', type=int, default=8)
parser.add_argument('--epoch', '-e', type=int, default=1)
parser.add_argument('--out', '-o', default='result')
args = parser.parse_args()

numpy.random.seed(0)
model = L.Classifier(MLP(32, 10))
optimizer = chainer.optimizers.Adam()
optimizer.setup(model)

train, test = synthetic.mnist(256, 64)
train_iters = [chainer.iterators.SerialIterator(shard, args.batchsize)
               for shard in chainer.datasets.split_dataset_n(train, 2)]
updater = ParallelAccumulatingUpdater(train_iters, optimizer, devices=['@numpy', '@numpy'],
                                      accumulate_steps=2)
trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
test_iter = chainer.iterators.SerialIterator(test, 32, repeat=False, shuffle=False)
trainer.extend(extensions.Evaluator(test_iter, model))
trainer.extend(extensions.DumpGraph('main/loss'))
trainer.extend(extensions.snapshot(), trigger=(1, 'epoch'))
trainer.extend(extensions.LogReport())
trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                     file_name='loss.png'))
trainer.extend(extensions.PrintReport(['epoch', 'main/loss', 'validation/main/loss']))
trainer.extend(extensions.ProgressBar(update_interval=2))
trainer.run()

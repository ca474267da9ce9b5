#!/usr/bin/env python
"""MNIST multi-layer perceptron, written as Chainer's examples/mnist/train_mnist.py is.

It imports chainer before mgpu_updater, as every Chainer script does. ``--updater
standard`` trains with StandardUpdater on one batch of ``batchsize * 2 * 2`` samples;
``--updater ours`` with ParallelAccumulatingUpdater on two CPU replicas, two micro-batches
of ``batchsize`` each per update. Only the updater construction differs. Training data is
not shuffled, so that both see the same samples in the same updates.
"""
import argparse
import os

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

from mgpu_updater import ParallelAccumulatingUpdater

import synthetic

DEVICES = ['@numpy', '@numpy']
ACCUMULATE = 2


# Network definition
class MLP(chainer.Chain):

    def __init__(self, n_units, n_out, n_in=None):
        super(MLP, self).__init__()
        with self.init_scope():
            # the size of the inputs to each layer will be inferred unless n_in is given
            self.l1 = L.Linear(n_in, n_units)
            self.l2 = L.Linear(None if n_in is None else n_units, n_units)
            self.l3 = L.Linear(None if n_in is None else n_units, n_out)

    def forward(self, x):
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        return self.l3(h2)


def main():
    parser = argparse.ArgumentParser(description='Chainer-style example: MNIST')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--batchsize', '-b', type=int, default=8,
                        help='Number of images in each micro-batch of a device')
    parser.add_argument('--epoch', '-e', type=int, default=2,
                        help='Number of sweeps over the dataset to train')
    parser.add_argument('--out', '-o', default='result',
                        help='Directory to output the result')
    parser.add_argument('--resume', '-r', default='',
                        help='Resume the training from snapshot')
    parser.add_argument('--unit', '-u', type=int, default=32,
                        help='Number of units')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    print('# updater: {}'.format(args.updater))
    print('# unit: {}'.format(args.unit))
    print('# Minibatch-size: {}'.format(args.batchsize))
    print('# epoch: {}'.format(args.epoch))
    print('')

    # Set up a neural network to train
    numpy.random.seed(args.seed)
    model = L.Classifier(MLP(args.unit, 10))

    # Setup an optimizer
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)

    # Load the (synthetic) MNIST dataset
    train, test = synthetic.mnist(256, 64)
    test_iter = chainer.iterators.SerialIterator(test, 32, repeat=False, shuffle=False)

    # Set up a trainer
    if args.updater == 'standard':
        train_iter = chainer.iterators.SerialIterator(
            train, args.batchsize * len(DEVICES) * ACCUMULATE, shuffle=False)
        updater = training.updaters.StandardUpdater(train_iter, optimizer, device=-1)
    else:
        train_iters = [
            chainer.iterators.SerialIterator(shard, args.batchsize, shuffle=False)
            for shard in synthetic.shards(train, len(DEVICES), args.batchsize * ACCUMULATE)]
        updater = ParallelAccumulatingUpdater(train_iters, optimizer, devices=DEVICES,
                                              accumulate_steps=ACCUMULATE)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)

    # Evaluate the model with the test dataset for each epoch
    trainer.extend(extensions.Evaluator(test_iter, model))

    # Dump a computational graph from 'loss' variable at the first iteration
    trainer.extend(extensions.DumpGraph('main/loss'))

    # Take a snapshot for each epoch
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))

    # Write a log of evaluation statistics for each epoch
    trainer.extend(extensions.LogReport())

    # Save two plot images to the result dir
    if extensions.PlotReport.available():
        trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'],
                                             'epoch', file_name='loss.png'))
        trainer.extend(extensions.PlotReport(['main/accuracy', 'validation/main/accuracy'],
                                             'epoch', file_name='accuracy.png'))

    # Print selected entries of the log to stdout
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'main/loss', 'validation/main/loss',
         'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))

    # Print a progress bar to stdout
    trainer.extend(extensions.ProgressBar(update_interval=2))

    if args.resume:
        # Resume from a snapshot
        chainer.serializers.load_npz(args.resume, trainer)
        print('# resumed at iteration {}'.format(updater.iteration))

    # Run the training
    trainer.run()
    chainer.serializers.save_npz(os.path.join(args.out, 'model_final.npz'), model)


if __name__ == '__main__':
    main()

#!/usr/bin/env python
"""Chainer-style CIFAR-10 (examples/cifar/train_cifar.py): a small VGG-like network with
BatchNormalization, MomentumSGD with WeightDecay, and the learning rate halved by
ExponentialShift every epoch.

With BatchNormalization each micro-batch is normalised over its own samples, so this
script cannot match StandardUpdater on the large batch; the test checks that it trains,
that the BatchNorm statistics and the learning-rate schedule survive a resume exactly.
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


class Block(chainer.Chain):
    """A convolution, batch normalization, and ReLU block."""

    def __init__(self, out_channels, ksize, pad=1):
        super(Block, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(None, out_channels, ksize, pad=pad, nobias=True)
            self.bn = L.BatchNormalization(out_channels)

    def forward(self, x):
        h = self.conv(x)
        h = self.bn(h)
        return F.relu(h)


class VGG(chainer.Chain):
    """A (very) small VGG-style network for CIFAR."""

    def __init__(self, class_labels=10):
        super(VGG, self).__init__()
        with self.init_scope():
            self.block1_1 = Block(4, 3)
            self.block2_1 = Block(8, 3)
            self.fc1 = L.Linear(None, 16, nobias=True)
            self.bn_fc1 = L.BatchNormalization(16)
            self.fc2 = L.Linear(None, class_labels, nobias=True)

    def forward(self, x):
        h = self.block1_1(x)
        h = F.max_pooling_2d(h, ksize=4, stride=4)
        h = self.block2_1(h)
        h = F.max_pooling_2d(h, ksize=2, stride=2)
        h = F.dropout(h, ratio=0.0)
        h = self.fc1(h)
        h = self.bn_fc1(h)
        h = F.relu(h)
        return self.fc2(h)


def main():
    parser = argparse.ArgumentParser(description='Chainer-style CIFAR example:')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--batchsize', '-b', type=int, default=8,
                        help='Number of images in each micro-batch of a device')
    parser.add_argument('--learnrate', '-l', type=float, default=0.05,
                        help='Learning rate for SGD')
    parser.add_argument('--epoch', '-e', type=int, default=1,
                        help='Number of sweeps over the dataset to train')
    parser.add_argument('--out', '-o', default='result',
                        help='Directory to output the result')
    parser.add_argument('--resume', '-r', default='',
                        help='Resume the training from snapshot')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    print('# Minibatch-size: {}'.format(args.batchsize))
    print('# epoch: {}'.format(args.epoch))
    print('')

    train, test = synthetic.cifar10(128, 32)
    numpy.random.seed(args.seed)
    model = L.Classifier(VGG(10))

    optimizer = chainer.optimizers.MomentumSGD(args.learnrate)
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(5e-4))

    test_iter = chainer.iterators.SerialIterator(test, 16, repeat=False, shuffle=False)
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

    # Reduce the learning rate by half every epoch.
    trainer.extend(extensions.ExponentialShift('lr', 0.5), trigger=(1, 'epoch'))

    trainer.extend(extensions.DumpGraph('main/loss'))
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.observe_lr())
    trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                         file_name='loss.png'))
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'main/accuracy', 'validation/main/accuracy', 'lr', 'elapsed_time']))
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

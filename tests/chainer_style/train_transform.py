#!/usr/bin/env python
"""Chainer-style MNIST with preprocessing in a TransformDataset whose transform is a
closure defined inside ``main()``, and a network class defined in this script that keeps
its activation, a lambda, as an attribute.
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


class ConvNet(chainer.Chain):

    def __init__(self, n_out, activation=None):
        super(ConvNet, self).__init__()
        # a leaky ReLU unless told otherwise
        self.activation = activation or (lambda h: F.leaky_relu(h, slope=0.1))
        with self.init_scope():
            self.conv1 = L.Convolution2D(None, 4, ksize=3, stride=2)
            self.fc = L.Linear(None, n_out)

    def forward(self, x):
        h = self.activation(self.conv1(x))
        h = F.max_pooling_2d(h, 2)
        return self.fc(h)


def main():
    parser = argparse.ArgumentParser(description='Chainer-style example: MNIST transform')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--batchsize', '-b', type=int, default=8)
    parser.add_argument('--epoch', '-e', type=int, default=1)
    parser.add_argument('--out', '-o', default='result')
    parser.add_argument('--resume', '-r', default='')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    train, test = synthetic.mnist(128, 32, ndim=3)
    mean = numpy.mean([x for x, _ in train], axis=0)
    std = numpy.std([x for x, _ in train]) + 1e-6
    shift = 1

    def transform(in_data):
        img, label = in_data
        img = (img - mean) / std
        img = numpy.roll(img, shift, axis=2)   # a fixed translation, for the example
        return img.astype(numpy.float32), label

    train = chainer.datasets.TransformDataset(train, transform)
    test = chainer.datasets.TransformDataset(test, transform)

    numpy.random.seed(args.seed)
    model = L.Classifier(ConvNet(10))
    optimizer = chainer.optimizers.SGD(lr=0.05)
    optimizer.setup(model)

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

    trainer.extend(extensions.Evaluator(test_iter, model))
    trainer.extend(extensions.DumpGraph('main/loss'))
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                         file_name='loss.png'))
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
    trainer.extend(extensions.ProgressBar(update_interval=2))

    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)
        print('# resumed at iteration {}'.format(updater.iteration))

    trainer.run()
    chainer.serializers.save_npz(os.path.join(args.out, 'model_final.npz'), model)


if __name__ == '__main__':
    main()

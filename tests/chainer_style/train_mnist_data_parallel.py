#!/usr/bin/env python
"""Data-parallel MNIST as Chainer's examples/mnist/train_mnist_data_parallel.py is written,
coming from ParallelUpdater.

``--updater parallel``: ParallelUpdater on two CPU devices (``{'main': -1, 'second': -1}``),
one iterator whose batch is split between them, the replicas' gradients summed.
``--updater ours``: ParallelAccumulatingUpdater on two CPU replicas, each running two
micro-batches of half its former share, with ``replica_reduction='sum'``: the option that
keeps ParallelUpdater's dynamics (same learning rate, same hooks).
"""
import argparse
import os

import numpy

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

from mgpu_updater import ParallelAccumulatingUpdater

import synthetic
import train_mnist

ACCUMULATE = 2


def main():
    parser = argparse.ArgumentParser(description='Chainer-style example: MNIST')
    parser.add_argument('--updater', choices=('parallel', 'ours'), default='ours')
    parser.add_argument('--batchsize', '-b', type=int, default=32,
                        help='Number of images in each mini-batch (over both devices)')
    parser.add_argument('--epoch', '-e', type=int, default=1,
                        help='Number of sweeps over the dataset to train')
    parser.add_argument('--out', '-o', default='result_parallel',
                        help='Directory to output the result')
    parser.add_argument('--resume', '-r', default='',
                        help='Resume the training from snapshot')
    parser.add_argument('--unit', '-u', type=int, default=32,
                        help='Number of units')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    numpy.random.seed(args.seed)
    # Sizes given: ParallelUpdater copies the model for each device before the first
    # forward pass, so with lazy sizes every device would draw its own first weights.
    model = L.Classifier(train_mnist.MLP(args.unit, 10, n_in=784))
    optimizer = chainer.optimizers.SGD(lr=0.05)
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-3))
    optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))

    train, test = synthetic.mnist(256, 64)
    test_iter = chainer.iterators.SerialIterator(test, 32, repeat=False, shuffle=False)

    if args.updater == 'parallel':
        # ParallelUpdater implements the data-parallel gradient computation on
        # multiple devices. It accepts "devices" argument that specifies which device to
        # use.
        train_iter = chainer.iterators.SerialIterator(train, args.batchsize, shuffle=False)
        updater = training.updaters.ParallelUpdater(
            train_iter, optimizer, devices={'main': -1, 'second': -1})
    else:
        # each device's share of the batch, in two micro-batches
        train_iters = [
            chainer.iterators.SerialIterator(shard, args.batchsize // 2 // ACCUMULATE,
                                             shuffle=False)
            for shard in synthetic.shards(train, 2, args.batchsize // 2)]
        updater = ParallelAccumulatingUpdater(
            train_iters, optimizer, devices=['@numpy', '@numpy'],
            accumulate_steps=ACCUMULATE, replica_reduction='sum')
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)

    trainer.extend(extensions.Evaluator(test_iter, model))
    trainer.extend(extensions.dump_graph('main/loss'))
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

#!/usr/bin/env python
"""Data-parallel MNIST as Chainer's MultiprocessParallelUpdater scripts are written
(examples/imagenet/train_imagenet_data_parallel.py): one MultiprocessIterator with its own
loader processes per shard, the list of iterators handed to the updater.

MultiprocessParallelUpdater needs GPUs and NCCL, so the reference here (``--updater
standard``) is StandardUpdater on one MultiprocessIterator whose batch holds the samples of
one update of both shards. ``--updater ours`` hands the per-shard iterators to
ParallelAccumulatingUpdater on two CPU replicas with two micro-batches per update.
"""
import argparse
import os

import numpy

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions
from chainer.training import updaters

from mgpu_updater import ParallelAccumulatingUpdater

import synthetic
import train_mnist

DEVICES = ['@numpy', '@numpy']
ACCUMULATE = 2


def main():
    parser = argparse.ArgumentParser(description='Chainer-style example: data-parallel MNIST')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--batchsize', '-B', type=int, default=8,
                        help='Learning minibatch size of one device')
    parser.add_argument('--epoch', '-E', type=int, default=1,
                        help='Number of epochs to train')
    parser.add_argument('--loaderjob', '-j', type=int, default=2,
                        help='Number of parallel data loading processes')
    parser.add_argument('--resume', '-r', default='',
                        help='Initialize the trainer from given file')
    parser.add_argument('--out', '-o', default='result',
                        help='Output directory')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    numpy.random.seed(args.seed)
    model = L.Classifier(train_mnist.MLP(32, 10))

    train, val = synthetic.mnist(256, 64)
    # These iterators load the examples with subprocesses running in parallel to the
    # training/validation (in order, so that both updaters see the same batches).
    train_iters = [
        chainer.iterators.MultiprocessIterator(
            shard, args.batchsize, n_processes=args.loaderjob,
            order_sampler=synthetic.InOrder())
        for shard in synthetic.shards(train, len(DEVICES), args.batchsize * ACCUMULATE)]
    val_iter = chainer.iterators.MultiprocessIterator(
        val, 32, repeat=False, order_sampler=synthetic.InOrder(),
        n_processes=args.loaderjob)

    # Set up an optimizer
    optimizer = chainer.optimizers.MomentumSGD(lr=0.01, momentum=0.9)
    optimizer.setup(model)

    # Set up a trainer
    if args.updater == 'standard':
        train_iter = chainer.iterators.MultiprocessIterator(
            train, args.batchsize * len(DEVICES) * ACCUMULATE, n_processes=args.loaderjob,
            order_sampler=synthetic.InOrder())
        updater = updaters.StandardUpdater(train_iter, optimizer, device=-1)
    else:
        updater = ParallelAccumulatingUpdater(train_iters, optimizer, devices=DEVICES,
                                              accumulate_steps=ACCUMULATE)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), args.out)

    trainer.extend(extensions.Evaluator(val_iter, model), trigger=(1, 'epoch'))
    trainer.extend(extensions.DumpGraph('main/loss'))
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))
    trainer.extend(extensions.snapshot_object(model, 'model_iter_{.updater.iteration}'),
                   trigger=(1, 'epoch'))
    # Be careful to pass the interval directly to LogReport
    # (it determines when to emit log rather than when to read observations)
    trainer.extend(extensions.LogReport(trigger=(1, 'epoch')))
    trainer.extend(extensions.observe_lr(), trigger=(1, 'epoch'))
    trainer.extend(extensions.PrintReport([
        'epoch', 'iteration', 'main/loss', 'validation/main/loss',
        'main/accuracy', 'validation/main/accuracy', 'lr'
    ]), trigger=(1, 'epoch'))
    trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                         file_name='loss.png'))
    trainer.extend(extensions.ProgressBar(update_interval=2))

    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)
        print('# resumed at iteration {}'.format(updater.iteration))

    trainer.run()
    chainer.serializers.save_npz(os.path.join(args.out, 'model_final.npz'), model)


if __name__ == '__main__':
    main()

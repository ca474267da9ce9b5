#!/usr/bin/env python
"""Chainer-style example: train a VAE on (synthetic) MNIST, as examples/vae/train_vae.py.

``--loss closure``: ``loss_func=model.get_loss_func()``, a closure over the model that
reports ``rec_loss`` and ``loss`` with the model as observer (Chainer up to v6).
``--loss model``: the optimizer's target, an ``AvgELBOLoss`` link, is itself the
``loss_func`` (Chainer v7). ``--no-sample`` uses the encoder's mean as the latent code, so
the run is deterministic.
"""
import argparse
import os

import numpy

import chainer
from chainer import training
from chainer.training import extensions

from mgpu_updater import ParallelAccumulatingUpdater

import net
import synthetic

DEVICES = ['@numpy', '@numpy']
ACCUMULATE = 2


def main():
    parser = argparse.ArgumentParser(description='Chainer-style example: VAE')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--loss', choices=('closure', 'model'), default='closure')
    parser.add_argument('--no-sample', dest='sample', action='store_false',
                        help='use the mean of the latent code instead of a sample')
    parser.add_argument('--resume', '-r', default='',
                        help='Resume the optimization from snapshot')
    parser.add_argument('--out', '-o', default='result',
                        help='Directory to output the result')
    parser.add_argument('--epoch', '-e', default=1, type=int,
                        help='number of epochs to learn')
    parser.add_argument('--dimz', '-z', default=4, type=int,
                        help='dimention of encoded vector')
    parser.add_argument('--batchsize', '-b', type=int, default=8,
                        help='learning minibatch size of one device')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    print('# dim z: {}'.format(args.dimz))
    print('# Minibatch-size: {}'.format(args.batchsize))
    print('# epoch: {}'.format(args.epoch))
    print('')

    # Prepare VAE model, defined in net.py
    numpy.random.seed(args.seed)
    model = net.VAE(784, args.dimz, 16)
    if args.loss == 'model':
        model = net.AvgELBOLoss(model, sample=args.sample)
        loss_func = model
        eval_func = model
    else:
        loss_func = model.get_loss_func(sample=args.sample)
        eval_func = model.get_loss_func(sample=args.sample)

    # Setup an optimizer
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)

    # Load the (synthetic) MNIST dataset
    train, test = synthetic.mnist(128, 32, withlabel=False)
    test_iter = chainer.iterators.SerialIterator(test, 16, repeat=False, shuffle=False)

    # Set up an updater. StandardUpdater can explicitly specify a loss function
    # used in the training with 'loss_func' option
    if args.updater == 'standard':
        train_iter = chainer.iterators.SerialIterator(
            train, args.batchsize * len(DEVICES) * ACCUMULATE, shuffle=False)
        updater = training.updaters.StandardUpdater(
            train_iter, optimizer, device=-1, loss_func=loss_func)
    else:
        train_iters = [
            chainer.iterators.SerialIterator(shard, args.batchsize, shuffle=False)
            for shard in synthetic.shards(train, len(DEVICES), args.batchsize * ACCUMULATE)]
        updater = ParallelAccumulatingUpdater(
            train_iters, optimizer, devices=DEVICES, accumulate_steps=ACCUMULATE,
            loss_func=loss_func)

    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    trainer.extend(extensions.Evaluator(test_iter, model, eval_func=eval_func))
    trainer.extend(extensions.DumpGraph('main/loss'))
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                         file_name='loss.png'))
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'main/rec_loss', 'validation/main/rec_loss', 'elapsed_time']))
    trainer.extend(extensions.ProgressBar(update_interval=2))

    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)
        print('# resumed at iteration {}'.format(updater.iteration))

    # Run the training
    trainer.run()
    chainer.serializers.save_npz(os.path.join(args.out, 'model_final.npz'), model)


if __name__ == '__main__':
    main()

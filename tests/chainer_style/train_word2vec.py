#!/usr/bin/env python
"""Chainer-style word2vec (examples/word2vec/train_word2vec.py): a skip-gram model with a
hierarchical softmax, whose loss is a sum over the batch, a custom iterator class and a
custom converter, both defined in this script (``__main__``).

The iterator's batches are ``(centers, contexts)`` pairs of arrays, not lists of
examples. The window is fixed and nothing is shuffled, so that runs are deterministic.
``--updater ours`` passes ``loss_reduction='sum'``: the gradient is then that of the loss
summed over the whole update, as StandardUpdater's is on one batch holding its samples.
"""
import argparse
import collections
import os

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import reporter
from chainer import training
from chainer.training import extensions

from mgpu_updater import ParallelAccumulatingUpdater

import synthetic

DEVICES = ['@numpy', '@numpy']
ACCUMULATE = 2


class SkipGram(chainer.Chain):
    """Definition of Skip-gram Model"""

    def __init__(self, n_vocab, n_units, loss_func):
        super(SkipGram, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(
                n_vocab, n_units, initialW=chainer.initializers.Uniform(1. / n_units))
            self.loss_func = loss_func

    def forward(self, x, contexts):
        e = self.embed(contexts)
        batch_size, n_context, n_units = e.shape
        x = F.broadcast_to(x[:, None], (batch_size, n_context))
        e = F.reshape(e, (batch_size * n_context, n_units))
        x = F.reshape(x, (batch_size * n_context,))
        loss = self.loss_func(e, x)
        reporter.report({'loss': loss}, self)
        return loss


class WindowIterator(chainer.dataset.Iterator):
    """Dataset iterator to create a batch of sequences at different positions.

    Each batch is a pair of arrays: the center words, and their ``window`` words on
    either side. ``positions`` are the center positions it walks through, in order.
    """

    def __init__(self, dataset, window, batch_size, positions=None, repeat=True):
        self.dataset = numpy.array(dataset, numpy.int32)
        self.window = window  # size of context window
        self.batch_size = batch_size
        self._repeat = repeat
        if positions is None:
            positions = numpy.arange(window, len(dataset) - window)
        self.order = numpy.array(positions, numpy.int32)
        self.current_position = 0
        self.epoch = 0
        self.is_new_epoch = False

    def __next__(self):
        """Returns the next batch: (centers, contexts) for each position."""
        if not self._repeat and self.epoch > 0:
            raise StopIteration

        i = self.current_position
        i_end = i + self.batch_size
        position = self.order[i:i_end]
        w = self.window
        offset = numpy.concatenate([numpy.arange(-w, 0), numpy.arange(1, w + 1)])
        pos = position[:, None] + offset[None, :]
        contexts = self.dataset.take(pos)
        center = self.dataset.take(position)

        if i_end >= len(self.order):
            self.epoch += 1
            self.is_new_epoch = True
            self.current_position = 0
        else:
            self.is_new_epoch = False
            self.current_position = i_end

        return center, contexts

    @property
    def epoch_detail(self):
        return self.epoch + float(self.current_position) / len(self.order)

    def serialize(self, serializer):
        self.current_position = serializer('current_position', self.current_position)
        self.epoch = serializer('epoch', self.epoch)
        self.is_new_epoch = serializer('is_new_epoch', self.is_new_epoch)
        if self.order is not None:
            serializer('order', self.order)


@chainer.dataset.converter()
def convert(batch, device):
    center, contexts = batch
    if device is not None:
        center = device.send(center)
        contexts = device.send(contexts)
    return center, contexts


def main():
    parser = argparse.ArgumentParser(description='Chainer-style example: word2vec')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--unit', '-u', default=8, type=int,
                        help='number of units')
    parser.add_argument('--window', '-w', default=2, type=int,
                        help='window size')
    parser.add_argument('--batchsize', '-b', type=int, default=8,
                        help='learning minibatch size of one device')
    parser.add_argument('--epoch', '-e', default=1, type=int,
                        help='number of epochs to learn')
    parser.add_argument('--out', default='result',
                        help='Directory to output the result')
    parser.add_argument('--resume', '-r', default='',
                        help='Resume the training from snapshot')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    print('Window: {}'.format(args.window))
    print('Minibatch-size: {}'.format(args.batchsize))
    print('# epoch: {}'.format(args.epoch))
    print('')

    n_vocab = 30
    train = synthetic.corpus(2 * args.window + 128, n_vocab, seed=1)
    val = synthetic.corpus(2 * args.window + 32, n_vocab, seed=2)
    counts = collections.Counter(train)
    counts.update(collections.Counter(val))
    print('n_vocab: %d' % n_vocab)
    print('data length: %d' % len(train))

    numpy.random.seed(args.seed)
    tree = L.BinaryHierarchicalSoftmax.create_huffman_tree(counts)
    loss_func = L.BinaryHierarchicalSoftmax(args.unit, tree)
    loss_func.W.array[...] = 0
    model = SkipGram(n_vocab, args.unit, loss_func)

    # Set up an optimizer (plain SGD: the size of the gradient matters)
    optimizer = chainer.optimizers.SGD(lr=0.02)
    optimizer.setup(model)

    val_iter = WindowIterator(val, args.window, 16, repeat=False)

    # Set up an updater
    if args.updater == 'standard':
        train_iter = WindowIterator(train, args.window,
                                    args.batchsize * len(DEVICES) * ACCUMULATE)
        updater = training.updaters.StandardUpdater(
            train_iter, optimizer, converter=convert, device=-1)
    else:
        positions = numpy.arange(args.window, len(train) - args.window)
        train_iters = [
            WindowIterator(train, args.window, args.batchsize, positions=shard[:])
            for shard in synthetic.shards(positions, len(DEVICES),
                                          args.batchsize * ACCUMULATE)]
        updater = ParallelAccumulatingUpdater(
            train_iters, optimizer, devices=DEVICES, accumulate_steps=ACCUMULATE,
            converter=convert, loss_reduction='sum')

    # Set up a trainer
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    trainer.extend(extensions.Evaluator(val_iter, model, converter=convert))
    trainer.extend(extensions.DumpGraph('main/loss'))
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                         file_name='loss.png'))
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss']))
    trainer.extend(extensions.ProgressBar(update_interval=2))

    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)
        print('# resumed at iteration {}'.format(updater.iteration))

    trainer.run()
    chainer.serializers.save_npz(os.path.join(args.out, 'model_final.npz'), model)


if __name__ == '__main__':
    main()

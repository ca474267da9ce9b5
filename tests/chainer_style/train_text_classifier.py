#!/usr/bin/env python
"""Chainer-style text classification (examples/text_classification): variable-length
token sequences, an EmbedID + NStepLSTM encoder, and a custom converter made with
``@chainer.dataset.converter()`` that sends each sequence to the device and hands the
model a dict of keyword arguments.
"""
import argparse
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
N_VOCAB = 50


@chainer.dataset.converter()
def convert_seq(batch, device=None, with_label=True):
    def to_device_batch(batch):
        if device is None:
            return batch
        src_xp = chainer.backend.get_array_module(*batch)
        xp = device.xp
        concat = src_xp.concatenate(batch, axis=0)
        sections = list(numpy.cumsum(
            [len(x) for x in batch[:-1]], dtype=numpy.int32))
        concat_dst = device.send(concat)
        batch_dst = xp.split(concat_dst, sections)
        return batch_dst

    if with_label:
        return {'xs': to_device_batch([x for x, _ in batch]),
                'ys': to_device_batch([y for _, y in batch])}
    else:
        return to_device_batch([x for x in batch])


def sequence_embed(embed, xs, dropout=0.):
    """Efficient embedding function for variable-length sequences"""
    x_len = [len(x) for x in xs]
    x_section = numpy.cumsum(x_len[:-1])
    ex = embed(F.concat(xs, axis=0))
    ex = F.dropout(ex, ratio=dropout)
    exs = F.split_axis(ex, x_section, 0)
    return exs


class RNNEncoder(chainer.Chain):
    """A LSTM-RNN Encoder with Word Embedding."""

    def __init__(self, n_layers, n_vocab, n_units, dropout=0.):
        super(RNNEncoder, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units, ignore_label=-1)
            self.encoder = L.NStepLSTM(n_layers, n_units, n_units, dropout)
        self.n_layers = n_layers
        self.out_units = n_units
        self.dropout = dropout

    def forward(self, xs):
        exs = sequence_embed(self.embed, xs, self.dropout)
        last_h, last_c, ys = self.encoder(None, None, exs)
        concat_outputs = last_h[-1]
        return concat_outputs


class TextClassifier(chainer.Chain):
    """A classifier using a given encoder."""

    def __init__(self, encoder, n_class, dropout=0.):
        super(TextClassifier, self).__init__()
        with self.init_scope():
            self.encoder = encoder
            self.output = L.Linear(encoder.out_units, n_class)
        self.dropout = dropout

    def forward(self, xs, ys):
        concat_outputs = self.predict(xs)
        concat_truths = F.concat(ys, axis=0)
        loss = F.softmax_cross_entropy(concat_outputs, concat_truths)
        accuracy = F.accuracy(concat_outputs, concat_truths)
        reporter.report({'loss': loss}, self)
        reporter.report({'accuracy': accuracy}, self)
        return loss

    def predict(self, xs, softmax=False, argmax=False):
        concat_encodings = F.dropout(self.encoder(xs), ratio=self.dropout)
        concat_outputs = self.output(concat_encodings)
        if softmax:
            return F.softmax(concat_outputs).array
        elif argmax:
            return self.xp.argmax(concat_outputs.array, axis=1)
        else:
            return concat_outputs


def main():
    parser = argparse.ArgumentParser(
        description='Chainer-style example: text classification')
    parser.add_argument('--updater', choices=('standard', 'ours'), default='ours')
    parser.add_argument('--batchsize', '-b', type=int, default=4,
                        help='Number of sequences in each micro-batch of a device')
    parser.add_argument('--epoch', '-e', type=int, default=1,
                        help='Number of sweeps over the dataset to train')
    parser.add_argument('--out', '-o', default='result',
                        help='Directory to output the result')
    parser.add_argument('--resume', '-r', default='',
                        help='Resume the training from snapshot')
    parser.add_argument('--unit', '-u', type=int, default=8,
                        help='Number of units')
    parser.add_argument('--layer', '-l', type=int, default=1,
                        help='Number of layers of RNN')
    parser.add_argument('--dropout', '-d', type=float, default=0.0,
                        help='Dropout rate')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    train, test = synthetic.sentences(64, 16, N_VOCAB)
    print('# train data: {}'.format(len(train)))
    print('# test  data: {}'.format(len(test)))
    print('# vocab: {}'.format(N_VOCAB))

    # Setup a model
    numpy.random.seed(args.seed)
    encoder = RNNEncoder(n_layers=args.layer, n_vocab=N_VOCAB, n_units=args.unit,
                         dropout=args.dropout)
    model = TextClassifier(encoder, 2)

    # Setup an optimizer
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))

    test_iter = chainer.iterators.SerialIterator(test, 8, repeat=False, shuffle=False)

    # Set up a trainer
    if args.updater == 'standard':
        train_iter = chainer.iterators.SerialIterator(
            train, args.batchsize * len(DEVICES) * ACCUMULATE, shuffle=False)
        updater = training.updaters.StandardUpdater(
            train_iter, optimizer, converter=convert_seq, device=-1)
    else:
        train_iters = [
            chainer.iterators.SerialIterator(shard, args.batchsize, shuffle=False)
            for shard in synthetic.shards(train, len(DEVICES), args.batchsize * ACCUMULATE)]
        updater = ParallelAccumulatingUpdater(
            train_iters, optimizer, devices=DEVICES, accumulate_steps=ACCUMULATE,
            converter=convert_seq)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)

    # Evaluate the model with the test dataset for each epoch
    trainer.extend(extensions.Evaluator(test_iter, model, converter=convert_seq))
    trainer.extend(extensions.DumpGraph('main/loss'))
    # Take a best snapshot
    record_trigger = training.triggers.MaxValueTrigger(
        'validation/main/accuracy', (1, 'epoch'))
    trainer.extend(extensions.snapshot_object(model, 'best_model.npz'),
                   trigger=record_trigger)
    trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                   trigger=(1, 'epoch'))

    # Write a log of evaluation statistics for each epoch
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
    trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'epoch',
                                         file_name='loss.png'))

    # Print a progress bar to stdout
    trainer.extend(extensions.ProgressBar(update_interval=2))

    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)
        print('# resumed at iteration {}'.format(updater.iteration))

    # Run the training
    trainer.run()
    chainer.serializers.save_npz(os.path.join(args.out, 'model_final.npz'), model)


if __name__ == '__main__':
    main()

"""Chainer-era code that uses the real ``six.moves``, defined in ``__main__``.

    python six_moves_main.py {model,closure}

The tagger class, its loss closure and the converter exist only in the master (defined
under the main guard), so each travels by value, and each reaches ``six.moves`` (a module
object of a ``ModuleType`` subclass, which cloudpickle cannot pickle by value):

- ``model``: the optimizer's target is the loss; its ``forward`` iterates
  ``six.moves.zip`` over the sentences (as Chainer's POS-tagging example's CRF);
- ``closure``: ``loss_func=model.get_loss_func(k)``, a closure that loops
  ``for l in six.moves.range(k)`` (as Chainer 5's VAE example);
- both: a ``@chainer.dataset.converter()`` that splits the batch with ``six.moves.zip``
  and ``six.moves.map``, and a global imported ``from six import moves``.

Two CPU replicas with ``accumulate_steps=2`` against ``StandardUpdater`` on the same
samples; prints ``MAX_ABS_DIFF``, ``LOSS_DIFF`` and ``MOVED``.
"""
import sys

import numpy
import six
from six import moves

import mgpu_updater
import chainer
import chainer.functions as F
import chainer.links as L
from chainer.training.updaters import StandardUpdater

N_VOCAB, N_TAGS = 20, 5


def sentences(n, seed):
    """``n`` (words, tags) pairs of int32 sequences of lengths 2 to 6."""
    rng = numpy.random.RandomState(seed)
    out = []
    for _ in range(n):
        length = rng.randint(2, 7)
        out.append((rng.randint(0, N_VOCAB, length).astype(numpy.int32),
                    rng.randint(0, N_TAGS, length).astype(numpy.int32)))
    return out


if __name__ == '__main__':
    class Tagger(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.embed = L.EmbedID(N_VOCAB, 8)
                self.out = L.Linear(8, N_TAGS)

        def forward(self, xs, ys):
            loss = 0
            for x, y in six.moves.zip(xs, ys):
                loss += F.softmax_cross_entropy(self.out(F.tanh(self.embed(x))), y)
            loss /= len(xs)
            chainer.report({'loss': loss}, self)
            return loss

        def get_loss_func(self, k=2):
            def lf(xs, ys):
                total = 0
                for l in six.moves.range(k):
                    total += (l + 1.0) * self.forward(xs, ys)
                total /= k * (k + 1) / 2.0
                chainer.report({'loss': total}, self)
                return total
            return lf

    @chainer.dataset.converter()
    def convert(batch, device):
        words, tags = moves.zip(*batch)
        to_device = lambda x: chainer.dataset.to_device(device, x)   # noqa: E731
        return {'xs': list(six.moves.map(to_device, words)),
                'ys': list(six.moves.map(to_device, tags))}

    def one_update(updater, model):
        observation = {}
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        with reporter.scope(observation):
            updater.update()
        return float(getattr(observation['main/loss'], 'array', observation['main/loss']))

    def train(model, shards, batch, k, updates, closure):
        """Two replicas, ``k`` micro-batches of ``batch`` each per update."""
        optimizer = chainer.optimizers.SGD(0.5)
        optimizer.setup(model)
        its = [chainer.iterators.SerialIterator(s, batch, shuffle=False) for s in shards]
        updater = mgpu_updater.ParallelAccumulatingUpdater(
            its, optimizer, devices=['@numpy', '@numpy'], accumulate_steps=k,
            converter=convert, loss_func=model.get_loss_func() if closure else None)
        try:
            return [one_update(updater, model) for _ in range(updates)]
        finally:
            updater.finalize()

    def train_reference(model, shards, batch, k, updates, closure):
        """One batch holding the samples of each of ``train``'s updates."""
        optimizer = chainer.optimizers.SGD(0.5)
        optimizer.setup(model)
        losses = []
        for u in range(updates):
            window = [s[i] for s in shards for i in range(u * k * batch, (u + 1) * k * batch)]
            it = chainer.iterators.SerialIterator(window, len(window), shuffle=False)
            updater = StandardUpdater(it, optimizer, converter=convert, loss_func=(
                model.get_loss_func() if closure else None))
            losses.append(one_update(updater, model))
        return losses

    def main():
        closure = sys.argv[1] == 'closure'
        k, batch, updates = 2, 3, 2
        shards = [sentences(k * batch * updates, seed) for seed in (1, 2)]
        numpy.random.seed(0)
        model = Tagger()
        reference = model.copy(mode='copy')
        start = model.out.W.array.copy()
        losses = train(model, shards, batch, k, updates, closure)
        ref_losses = train_reference(reference, shards, batch, k, updates, closure)
        diff = max(float(abs(p.array - q.array).max())
                   for p, q in zip(model.params(), reference.params()))
        print('MAX_ABS_DIFF', diff, flush=True)
        print('LOSS_DIFF', max(abs(a - b) for a, b in zip(losses, ref_losses)), flush=True)
        print('MOVED', float(abs(model.out.W.array - start).max()), flush=True)

    main()

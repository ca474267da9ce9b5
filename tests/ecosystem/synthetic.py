"""Synthetic stand-ins for the data Chainer's examples download, in the very formats the
examples read (nothing here is reachable without the internet, and nothing must be).

Each writer puts files where the unchanged example looks for them:

- ``mnist(root)``: ``root/pfnet/chainer/mnist/{train,test}.npz`` as
  ``chainer.datasets.get_mnist`` caches them (``x``: uint8 ``(N, 784)``, ``y``: uint8
  ``(N,)``); the example finds them with ``CHAINER_DATASET_ROOT=root``.
- ``sentiment_trees(cwd)``: ``trees/{train,dev,test}.txt`` in the Stanford Sentiment
  Treebank's PTB format, one binary tree a line, labels 0-4 on every node.
- ``imagenet(cwd)``: RGB PNG images, the ``path label`` list files that
  ``chainer.datasets.LabeledImageDataset`` reads, and ``mean.npy``.
- ``mushrooms(cwd)``: ``mushrooms.csv``, the UCI Mushroom table's shape (a header, then
  the class letter and 22 attribute letters a row).

The values are random but learnable (a label depends on the input), seeded.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def mnist(root: Path, n_train: int = 200, n_test: int = 100) -> None:
    directory = Path(root) / 'pfnet' / 'chainer' / 'mnist'
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    for name, n in (('train.npz', n_train), ('test.npz', n_test)):
        y = rng.randint(0, 10, n).astype(np.uint8)
        x = rng.randint(0, 64, (n, 784))
        x[np.arange(n), y.astype(np.int64) * 78] = 255     # one bright pixel per class
        np.savez_compressed(directory / name, x=x.astype(np.uint8), y=y)


def _tree(rng: np.random.RandomState, leaves: int) -> tuple:
    """``(text, label)`` of a random binary tree over ``leaves`` words."""
    if leaves == 1:
        word = rng.randint(0, 60)
        label = word % 5
        return f'({label} w{word})', label
    left = rng.randint(1, leaves)
    (ltext, llabel), (rtext, rlabel) = _tree(rng, left), _tree(rng, leaves - left)
    label = (llabel + rlabel + 1) // 2
    return f'({label} {ltext} {rtext})', label


def sentiment_trees(cwd: Path, n_train: int = 32, n_dev: int = 8, n_test: int = 8) -> None:
    directory = Path(cwd) / 'trees'
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    for name, n in (('train.txt', n_train), ('dev.txt', n_dev), ('test.txt', n_test)):
        lines = [_tree(rng, rng.randint(2, 7))[0] for _ in range(n)]
        (directory / name).write_text('\n'.join(lines) + '\n')


def imagenet(cwd: Path, n_train: int = 8, n_val: int = 2, size: int = 240) -> None:
    """Images of ``size`` x ``size`` (the example crops 227 or 224 at random, so more
    than that), labels among the 1000 classes; ``train.txt``, ``val.txt``, ``mean.npy``."""
    from PIL import Image
    cwd = Path(cwd)
    (cwd / 'images').mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    images = []
    for name, n in (('train.txt', n_train), ('val.txt', n_val)):
        lines = []
        for i in range(n):
            label = int(rng.randint(0, 1000))
            pixels = rng.randint(0, 256, (size, size, 3)).astype(np.uint8)
            path = os.path.join('images', f'{name[:-4]}{i}.png')
            Image.fromarray(pixels, 'RGB').save(cwd / path)
            images.append(pixels)
            lines.append(f'{path} {label}')
        (cwd / name).write_text('\n'.join(lines) + '\n')
    mean = np.mean(images, axis=0).transpose(2, 0, 1).astype(np.float32)   # CHW
    np.save(cwd / 'mean.npy', mean)


def mushrooms(cwd: Path, n: int = 200) -> None:
    rng = np.random.RandomState(0)
    letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
    header = ['class'] + [f'attribute-{i}' for i in range(22)]
    rows = [','.join(header)]
    for _ in range(n):
        attributes = letters[rng.randint(0, 6, 22)]
        poisonous = attributes[0] in 'abc'
        rows.append(','.join(['p' if poisonous else 'e'] + list(attributes)))
    (Path(cwd) / 'mushrooms.csv').write_text('\n'.join(rows) + '\n')

"""The example's CNN: conv 3x3 16 -> conv 3x3 32 -> max-pool 2 -> fc 128 -> fc 10.

Input is a float32 batch of shape (N, 1, 28, 28) with values in [0, 1]; output is (N, n_out)
logits. Every layer is given its input size, so the parameters exist as soon as the model is
built: a data-parallel updater copies them to the replicas before the first forward pass.

Stable API (``bench/scaling.py`` imports it): ``CNN``, ``make_model``.
"""
from mgpu_updater import _compat

_compat.apply()  # before Chainer: lets Chainer 7.8.1 import on Python 3.12+ and numpy 2

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

__all__ = ['CNN', 'make_model']

_FLAT = 32 * 12 * 12  # 28 -conv3-> 26 -conv3-> 24 -pool2-> 12, with 32 channels


class CNN(chainer.Chain):
    """Two 3x3 convolutions, one 2x2 max-pool and two fully connected layers, ReLU between.

    With ``batchnorm=True`` a batch normalization follows each hidden layer (its running
    statistics then live in the model; each replica normalizes by its own micro-batch).
    """

    def __init__(self, n_out=10, batchnorm=False):
        super().__init__()
        self.batchnorm = batchnorm
        with self.init_scope():
            self.conv1 = L.Convolution2D(1, 16, ksize=3)
            self.conv2 = L.Convolution2D(16, 32, ksize=3)
            self.fc1 = L.Linear(_FLAT, 128)
            self.fc2 = L.Linear(128, n_out)
            if batchnorm:
                self.bn1 = L.BatchNormalization(16)
                self.bn2 = L.BatchNormalization(32)
                self.bn3 = L.BatchNormalization(128)

    def _norm(self, name, h):
        return getattr(self, name)(h) if self.batchnorm else h

    def forward(self, x):
        h = F.relu(self._norm('bn1', self.conv1(x)))
        h = F.relu(self._norm('bn2', self.conv2(h)))
        h = F.max_pooling_2d(h, 2)
        h = F.relu(self._norm('bn3', self.fc1(h)))
        return self.fc2(h)


def make_model(n_out=10, batchnorm=False):
    """A :class:`chainer.links.Classifier` (softmax cross entropy, reports loss and accuracy)
    around :class:`CNN`."""
    return L.Classifier(CNN(n_out=n_out, batchnorm=batchnorm))

"""Models shaped like Chainer's example scripts' (importable by spawned workers).

Written here, not copied: a VAE-like model passed as its own ``loss_func`` or through a
closure (``get_loss_func``), a chain whose loss lives in a sub-link, and a sum-reduced loss
as word2vec's hierarchical softmax has.
"""
from __future__ import annotations

import numpy as np

import chainer
import chainer.functions as F
import chainer.links as L

from _models import MLP


class SelfLoss(chainer.Chain):
    """Computes and reports its own loss, as the VAE example's model (loss_func=model)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.net = MLP()

    def forward(self, x, t):
        loss = F.softmax_cross_entropy(self.net(x), t)
        chainer.report({'loss': loss}, self)
        return loss

    def get_loss_func(self, weight=1.0):
        """A closure over ``self``, as the VAE example's ``get_loss_func``."""
        def lf(x, t):
            loss = weight * F.softmax_cross_entropy(self.net(x), t)
            chainer.report({'loss': loss}, self)
            return loss
        return lf


class Outer(chainer.Chain):
    """A model whose loss is computed by a sub-link (``loss_func=model.clf``) or by a
    method of a sub-link (``loss_func=model.clf.loss``)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.clf = Head()


class Head(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.net = MLP()

    def forward(self, x, t):
        return self.loss(x, t)

    def loss(self, x, t):
        loss = F.softmax_cross_entropy(self.net(x), t)
        chainer.report({'loss': loss}, self)
        return loss


def loss_of(model, x, t):
    """A module-level loss taking the model first: ``functools.partial(loss_of, model)``."""
    return F.softmax_cross_entropy(model.net(x), t)


class HoldsAModel:
    """A callable object that holds a model: not re-bound, so in a worker it computes with
    its own copy of the model (the guard's case)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, t):
        return F.softmax_cross_entropy(self.model.net(x), t)


class HoldsAReportingModel(HoldsAModel):
    def __call__(self, x, t):
        return self.model(x, t)


class SumLoss(chainer.Chain):
    """A loss summed over the batch (as word2vec's hierarchical softmax), reported as is,
    plus a per-batch mean that is not the loss."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.net = MLP()

    def forward(self, x, t):
        y = self.net(x)
        loss = F.sum(F.softmax_cross_entropy(y, t, reduce='no'))
        chainer.report({'loss': loss, 'accuracy': F.accuracy(y, t)}, self)
        return loss


def seeded(cls, seed=0):
    np.random.seed(seed)
    return cls()


class CappedMLP(chainer.Chain):
    """Raises MemoryError when one forward holds more than ``cap`` samples, as a device
    that runs out of memory would; records the largest forward it ran."""

    def __init__(self, cap):
        super().__init__()
        self.cap = cap
        self.largest = 0
        with self.init_scope():
            self.net = MLP()

    def forward(self, x, t):
        if len(x) > self.cap:
            raise MemoryError(f'{len(x)} samples do not fit (cap {self.cap})')
        self.largest = max(self.largest, len(x))
        y = self.net(x)
        loss = F.softmax_cross_entropy(y, t)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(y, t)}, self)
        return loss

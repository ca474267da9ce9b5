"""Models shaped like Chainer's example scripts' (importable by spawned workers).

Written here, not copied: a VAE-like model passed as its own ``loss_func`` or through a
closure (``get_loss_func``), a chain whose loss lives in a sub-link, and a sum-reduced loss
as word2vec's hierarchical softmax has.
"""
from __future__ import annotations

import os
import types

import numpy as np

import chainer
import chainer.functions as F

from _models import MLP, StaticLazyClassifier


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
    """A callable object that holds a model (it travels with the payload, which maps the
    model to each worker's replica)."""

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
    that runs out of memory would: in forward, or with ``in_backward`` in the middle of
    backward (after the last layer's parameters already got their gradients).
    ``worker_cap`` is the cap in any other process than the one that built the model
    (replicas that settle at different sizes). Records the sizes it was given."""

    def __init__(self, cap, worker_cap=None, in_backward=False):
        super().__init__()
        self.cap = cap
        self.worker_cap = cap if worker_cap is None else worker_cap
        self.in_backward = in_backward
        self.master_pid = os.getpid()
        self.tried = []
        with self.init_scope():
            self.net = MLP()

    @property
    def largest(self):
        return max((n for n in self.tried if n <= self.current_cap), default=0)

    @property
    def current_cap(self):
        return self.cap if os.getpid() == self.master_pid else self.worker_cap

    def forward(self, x, t):
        self.tried.append(len(x))
        if not self.in_backward and len(x) > self.current_cap:
            raise MemoryError(f'{len(x)} samples do not fit (cap {self.current_cap})')
        h = self.net.l1(x)
        if self.in_backward:
            h, = _FailInBackward(self.current_cap).apply((h,))
        y = self.net.l2(F.relu(h))
        loss = F.softmax_cross_entropy(y, t)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(y, t)}, self)
        return loss


class _FailInBackward(chainer.FunctionNode):
    """Identity whose backward runs out of memory above ``cap`` samples."""

    def __init__(self, cap):
        self.cap = cap

    def forward(self, inputs):
        return inputs[0],

    def backward(self, indexes, grad_outputs):
        if len(grad_outputs[0]) > self.cap:
            raise MemoryError(f'{len(grad_outputs[0])} samples do not fit in backward '
                              f'(cap {self.cap})')
        return grad_outputs


# A model reached through a module global: a worker imports this module and gets a model of
# its own there, never its replica (the guard's case; on the master it is the model).
GLOBAL_MODEL = None


def global_loss(x, t):
    return F.softmax_cross_entropy(GLOBAL_MODEL.net(x), t)


def global_forgetting_loss(x, t):
    """``global_loss`` under ``F.forget``, whose node lists only ``x``."""
    return F.forget(lambda x_: F.softmax_cross_entropy(GLOBAL_MODEL.net(x_), t),
                    chainer.Variable(x))


def global_forgetting_through_a_helper(x, t):
    """The same, the global read by another function the forgotten one calls."""
    return F.forget(lambda x_: global_loss(x_, t), chainer.Variable(x))


HOLDER = types.SimpleNamespace(model=None)   # GLOBAL_MODEL, one attribute away


def global_forgetting_through_an_attribute(x, t):
    return F.forget(lambda x_: F.softmax_cross_entropy(HOLDER.model.net(x_), t),
                    chainer.Variable(x))


def global_reporting_loss(x, t):
    return GLOBAL_MODEL(x, t)


# The same through a @static_graph model, whose graph node lists none of its parameters.
GLOBAL_STATIC = None


def global_static_loss(x, t):
    return F.softmax_cross_entropy(GLOBAL_STATIC.predictor(x), t)


def _global_model_for_workers():
    global GLOBAL_MODEL, GLOBAL_STATIC
    if GLOBAL_MODEL is None:
        GLOBAL_MODEL = SelfLoss()
        HOLDER.model = GLOBAL_MODEL
    if GLOBAL_STATIC is None:
        GLOBAL_STATIC = StaticLazyClassifier()


_global_model_for_workers()

"""What a forward makes once and keeps in a plain attribute must be the same in every
replica, as in StandardUpdater's one model; where the replicas hold different ones, the
master says so after their second window (:mod:`mgpu_updater._made_once`).

Each model here has fixed input sizes (no lazy link), so nothing runs a forward before the
replicas are copied: whatever the first call makes, each replica makes for itself.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater
from mgpu_updater import _made_once

from _models import classifier, dataset, params, setup_optimizer

B, N_IN = 4, 5


class FirstCallProjection(chainer.Chain):
    """Draws a projection at its first call (numpy's global generator, which each process
    seeds with its own seed), held as an array, or a Variable, or made the same
    everywhere (the identity)."""

    def __init__(self, kind='random'):
        super().__init__()
        self.kind = kind
        with self.init_scope():
            self.l = L.Linear(N_IN, 3)
        self.proj = None

    def forward(self, x, t):
        if self.proj is None:
            if self.kind == 'identity':
                self.proj = np.eye(x.shape[1], dtype=np.float32)
            else:
                self.proj = np.random.randn(x.shape[1], x.shape[1]).astype(np.float32)
                if self.kind == 'variable':
                    self.proj = chainer.Variable(self.proj, requires_grad=False)
        return F.softmax_cross_entropy(self.l(F.matmul(x, self.proj)), t)


class DrawnOnUnpickling(chainer.Chain):
    """A mask made in ``__init__`` and drawn anew by ``__setstate__`` (each worker draws
    its own when its copy is unpickled)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(N_IN, 3)
        self._draw()

    def _draw(self):
        self.mask = (np.random.rand(N_IN) > 0.5).astype(np.float32)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._draw()

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l(x * self.mask), t)


class MemoryBank(chainer.Chain):
    """Keeps the running mean of the inputs it saw in an array it changes in place: each
    replica's holds its own shard's."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(N_IN, 3)
        self.bank = np.zeros(N_IN, dtype=np.float32)

    def forward(self, x, t):
        self.bank *= 0.5
        self.bank += 0.5 * x.array.mean(axis=0) if isinstance(x, chainer.Variable) else \
            0.5 * x.mean(axis=0)
        return F.softmax_cross_entropy(self.l(x - self.bank), t)


def _shards(n, updates):
    return [dataset(B * updates, seed=90 + r, n_in=N_IN) for r in range(n)]


def _ours(model, n, updates, **kwargs):
    its = [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in _shards(n, updates)]
    return ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                       devices=['@numpy'] * n, **kwargs)


def _run(updater, updates):
    """The updates, with every warning recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            for _ in range(updates):
                updater.update()
        finally:
            updater.finalize()
    return [w for w in caught if 'made one once' in str(w.message)]


def _reference(model, n, updates):
    shards = _shards(n, updates)
    batches = sum([sum((d[i:i + B] for d in shards), []) for i in range(0, B * updates, B)],
                  [])
    updater = StandardUpdater(chainer.iterators.SerialIterator(batches, n * B, shuffle=False),
                              setup_optimizer('sgd', model))
    for _ in range(updates):
        updater.update()
    return params(model)


def _largest_difference(model, reference):
    return max(float(np.abs(value - reference[name]).max())
               for name, value in params(model).items())


@pytest.mark.parametrize('kind', ['random', 'variable'])
def test_a_projection_drawn_at_the_first_call_is_named(kind):
    """Each replica drew its own projection: the model trains apart from StandardUpdater
    (shown here), and the warning names the attribute and the replicas that differ."""
    np.random.seed(0)
    model, reference_model = FirstCallProjection(kind), FirstCallProjection(kind)
    reference_model.copyparams(model)
    found = _run(_ours(model, 3, 3), 3)
    assert len(found) == 1
    assert found[0].category is RuntimeWarning
    text = str(found[0].message)
    assert '/proj in replica 1 (@numpy), replica 2 (@numpy)' in text
    assert 'Make it in __init__' in text
    # what the warning is about: the master's projection is not what the others used
    reference_model.proj = model.proj
    assert _largest_difference(model, _reference(reference_model, 3, 3)) > 1e-3


def test_what_the_first_call_makes_alike_trains_as_standard_updater_and_says_nothing():
    """A value made at the first call that every replica makes alike (here the identity)."""
    model, reference_model = FirstCallProjection('identity'), FirstCallProjection('identity')
    reference_model.copyparams(model)
    assert _run(_ours(model, 2, 3), 3) == []
    assert _largest_difference(model, _reference(reference_model, 2, 3)) < 1e-6


def test_under_accumulation_too():
    """k=2: the projection is drawn at the window's first micro-batch."""
    np.random.seed(0)
    found = _run(_ours(FirstCallProjection(), 2, 4, accumulate_steps=2), 2)
    assert len(found) == 1 and '/proj in replica 1 (@numpy)' in str(found[0].message)


def test_an_array_drawn_anew_by_setstate_is_named():
    np.random.seed(0)
    found = _run(_ours(DrawnOnUnpickling(), 2, 3), 3)
    assert len(found) == 1 and '/mask in replica 1 (@numpy)' in str(found[0].message)


def test_an_array_changed_in_place_from_each_replicas_samples_is_named():
    found = _run(_ours(MemoryBank(), 2, 3), 3)
    assert len(found) == 1 and '/bank in replica 1 (@numpy)' in str(found[0].message)


def test_what_a_classifier_stores_at_every_call_is_not_made_once():
    """``L.Classifier`` stores ``y``, ``loss`` and ``accuracy`` anew at every call: each
    replica's own, never the same object twice, and not named."""
    assert _run(_ours(classifier(seed=0), 2, 3), 3) == []


def test_one_replica_has_nothing_to_compare():
    np.random.seed(0)
    assert _run(_ours(FirstCallProjection(), 1, 3), 3) == []


def test_a_digest_tells_arrays_apart_and_samples_large_ones(monkeypatch):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert _made_once.digest(a) == _made_once.digest(a.copy())
    assert _made_once.digest(a) != _made_once.digest(a.reshape(4, 3))
    assert _made_once.digest(a) != _made_once.digest(a.astype(np.float64))
    b = a.copy()
    b[2, 3] = -1
    assert _made_once.digest(a) != _made_once.digest(b)
    monkeypatch.setattr(_made_once, 'SAMPLE', 4)   # reads elements 0, 3, 6 and 9
    c = a.copy()
    c[0, 1] = -1   # not read
    assert _made_once.digest(a) == _made_once.digest(c)
    c[2, 1] = -1   # element 9: read
    assert _made_once.digest(a) != _made_once.digest(c)


def test_a_value_that_takes_no_weak_reference_is_held_for_one_window():
    """A CuPy array takes no weak reference; the look holds it until the next window."""
    value = object.__new__(type('NoWeakref', (), {'__slots__': ()}))
    assert _made_once._ref(value)() is value

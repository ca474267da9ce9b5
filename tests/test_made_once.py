"""What a forward makes once and keeps in a plain attribute must be the same in every
replica, as in StandardUpdater's one model; where the replicas hold different ones, the
master says so after their first three windows (:mod:`mgpu_updater._made_once`). What
each replica keeps of its own samples is its own, and is not named.

Each model here has fixed input sizes (no lazy link), so nothing runs a forward before the
replicas are copied: whatever the first call makes, each replica makes for itself.
"""
from __future__ import annotations

import os
import signal
import types
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
    its own when its copy is unpickled); real-valued, so that no two draws are alike."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(N_IN, 3)
        self._draw()

    def _draw(self):
        self.mask = np.random.rand(N_IN).astype(np.float32)

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
        self.bank += 0.5 * x.mean(axis=0)
        return F.softmax_cross_entropy(self.l(x - self.bank), t)


class PerSampleState(chainer.Chain):
    """Truncated BPTT over fixed streams: a state per sample, kept in place in one array;
    each replica's rows are its own samples', as StandardUpdater's are the batch's."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(N_IN, N_IN)
            self.out = L.Linear(N_IN, 3)
        self.state = None

    def forward(self, x, t):
        if self.state is None:
            self.state = np.zeros_like(x)
        h = F.tanh(self.l(x) + self.state)
        self.state[...] = h.array
        return F.softmax_cross_entropy(self.out(h), t)


class GrowingCache(chainer.Chain):
    """A table made to the largest input seen so far (a positional encoding to the
    longest sequence), grown anew only when an input needs more: its size is each
    replica's own."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(N_IN, 3)
        self.table = None

    def forward(self, x, t):
        if self.table is None or self.table.shape[0] < len(x):
            self.table = np.sin(np.arange(len(x) * N_IN, dtype=np.float32)).reshape(
                len(x), N_IN)
        return F.softmax_cross_entropy(self.l(x + self.table[:len(x)]), t)


class EveryOtherCall(chainer.Chain):
    """Keeps the last hidden array of every other call (a diagnostic), and an array of
    class names (Python objects)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(N_IN, 3)
        self.calls = 0
        self.names = np.array(['a', 'b', 'c'], dtype=object)

    def forward(self, x, t):
        h = self.l(x)
        if self.calls % 2 == 0:
            self.last_h = h.array
        self.calls += 1
        return F.softmax_cross_entropy(h, t)


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
    found = _run(_ours(FirstCallProjection(), 2, 6, accumulate_steps=2), 3)
    assert len(found) == 1 and '/proj in replica 1 (@numpy)' in str(found[0].message)


def test_not_before_the_third_window():
    np.random.seed(0)
    assert _run(_ours(FirstCallProjection(), 2, 2), 2) == []


@pytest.mark.parametrize('killed_after', [1, 2])
def test_a_worker_replaced_in_the_first_windows_leaves_the_look_whole(killed_after):
    """Three replicas, replica 1's process SIGKILLed after update 1 or 2 and replaced
    (max_worker_restarts): the survivor redoes its window, which its look counted twice
    (its digests went out with the abandoned update, or came early), and nothing was
    named."""
    np.random.seed(0)
    updater = _ours(FirstCallProjection(), 3, 6, max_worker_restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            for i in range(6):
                updater.update()
                if i + 1 == killed_after:
                    os.kill(updater.worker_pids()[0], signal.SIGKILL)
            assert updater.worker_restarts == 1
        finally:
            updater.finalize()
    found = [w for w in caught if 'made one once' in str(w.message)]
    assert len(found) == 1
    assert '/proj in replica 1 (@numpy), replica 2 (@numpy)' in str(found[0].message)


def test_the_masters_comparison_keeps_what_comes_before_its_own():
    def result(made_once):
        return types.SimpleNamespace(made_once=made_once)
    compared = _made_once.Compared(['replica 0', 'replica 1', 'replica 2'])
    mine, other = ('<f4(2,)', 'a'), ('<f4(2,)', 'b')
    assert not compared.take([result(None), result(None), result({'/p': other})])
    with pytest.warns(RuntimeWarning, match=r'/p in replica 1, replica 2'):
        assert compared.take([result({'/p': mine}), result({'/p': other}), result(None)])


def test_an_array_drawn_anew_by_setstate_is_named():
    np.random.seed(0)
    found = _run(_ours(DrawnOnUnpickling(), 2, 3), 3)
    assert len(found) == 1 and '/mask in replica 1 (@numpy)' in str(found[0].message)


@pytest.mark.parametrize('make', [PerSampleState, MemoryBank, GrowingCache, EveryOtherCall])
def test_what_each_replica_keeps_of_its_own_samples_is_not_named(make):
    """State kept per sample, changed in place (it trains as StandardUpdater, shown here),
    a memory bank changed in place, a cache sized to the inputs seen (the replicas' batch
    sizes differ, so do their tables' shapes), an array stored every other call; an
    array of Python objects has nothing to compare (its digest raised TypeError)."""
    model, reference_model = make(), make()
    reference_model.copyparams(model)
    sizes = (B - 1, B) if make is GrowingCache else (B, B)
    its = [chainer.iterators.SerialIterator(d, size, shuffle=False)
           for d, size in zip(_shards(2, 3), sizes)]
    updater = ParallelAccumulatingUpdater(its, setup_optimizer('sgd', model),
                                          devices=['@numpy'] * 2)
    assert _run(updater, 3) == []
    if make is PerSampleState:
        assert _largest_difference(model, _reference(reference_model, 2, 3)) < 1e-6


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
    assert _made_once.digest(a)[0] != _made_once.digest(a.reshape(4, 3))[0]
    assert _made_once.digest(a)[0] != _made_once.digest(a.astype(np.float64))[0]
    b = a.copy()
    b[2, 3] = -1
    assert _made_once.digest(a) != _made_once.digest(b)
    monkeypatch.setattr(_made_once, 'SAMPLE', 4)   # reads elements 0, 3, 6 and 9
    c = a.copy()
    c[0, 1] = -1   # not read
    assert _made_once.digest(a) == _made_once.digest(c)
    c[2, 1] = -1   # element 9: read
    assert _made_once.digest(a) != _made_once.digest(c)
    assert _made_once.digest(a.T) == _made_once.digest(a.T.copy())   # not contiguous
    assert _made_once.digest(np.array(['x'], dtype=object)) is None


def test_a_value_that_takes_no_weak_reference_is_held_until_the_next_window():
    value = object.__new__(type('NoWeakref', (), {'__slots__': ()}))
    assert _made_once._ref(value)() is value

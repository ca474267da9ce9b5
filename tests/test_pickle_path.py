"""A refusal names the real cause: the type that does not pickle and the path to it from
the object handed over, at construction (issue 37, item 2).

The path is found by walking the object graph as the payload is pickled
(``mgpu_updater._pickle_path``); every step is one pickling takes. The advice depends on
what was found: an open file, lock, socket, thread or generator gets the argument's own
advice (tests/test_validation.py pins those); a module that cannot be imported by name, or
any other type, gets advice about that, not a guess about files.
"""
from __future__ import annotations

import functools
import multiprocessing
import sys
import threading

import cloudpickle
import numpy as np
import pytest
import six

import chainer
import chainer.functions as F
import chainer.links as L

from mgpu_updater import ParallelAccumulatingUpdater, _pickle_path, _validate

from _models import classifier, dataset

LOCK = threading.Lock()


def build(model=None, **kwargs):
    model = classifier() if model is None else model
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(model)
    its = [chainer.iterators.SerialIterator(dataset(8, seed), 4) for seed in (1, 2)]
    return ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy', '@numpy'],
                                       **kwargs)


def refused(match, **kwargs):
    """Construction raises TypeError matching ``match``; no process was started."""
    with pytest.raises(TypeError, match=match) as info:
        build(**kwargs)
    assert multiprocessing.active_children() == []
    return str(info.value)


def local_tagger_class():
    """A model class pickled by value (defined in a function, as in ``__main__``) whose
    ``forward`` holds a module-level lock through its globals."""
    class Tagger(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.crf = L.CRF1d(3)
                self.fc = L.Linear(5, 3)

        def forward(self, x, t):
            with LOCK:
                loss = F.softmax_cross_entropy(self.fc(x), t)
            return loss
    return Tagger


class Unpicklable:
    """A type that refuses to be pickled, as a C extension's handle does."""

    def __reduce__(self):
        raise TypeError(f"cannot pickle '{type(self).__name__}' object")


def test_model_class_by_value_with_a_global_lock():
    """The path goes through the class (pickled by value), its method and its globals;
    the type is named; the advice is the model's own for a lock."""
    np.random.seed(0)
    message = refused(
        r"^the model \(Tagger\) cannot be sent to a worker process: TypeError: cannot "
        r"pickle '_thread.lock' object; the culprit is "
        r"model\.__class__\.forward\.__globals__\['LOCK'\] "
        r"\(<unlocked _thread\.lock object at 0x[0-9a-f]+> of type _thread\.lock\)\. "
        r"Create such attributes lazily",
        model=local_tagger_class()())
    assert 'culprit is model.__class__.__init__' not in message   # refers back to the class


def test_closure_over_a_module_that_cannot_be_imported():
    """A ModuleType subclass (six's own) made at run time under no importable name: the
    refusal says so, and names the global the closure reads it through."""
    orphan = type(six.moves)('made_at_run_time')

    def make():
        def loss(x, t):
            return orphan.zip(x, t)
        return loss
    refused(r"^loss_func \(function\) cannot be sent to a worker process: TypeError: cannot "
            r"pickle '_MovedItems' object; the culprit is loss_func\.orphan "
            r"\(<module 'made_at_run_time'> of type six\._MovedItems\)\. A module of type "
            r"six\._MovedItems travels by its name only: this one is not in sys\.modules and "
            r"no importer finds its __name__\. Refer to an importable module, or register "
            r"it in sys\.modules where it is created\.$", loss_func=make())


def test_partial_of_a_bound_method():
    """``functools.partial(model.loss, ...)`` over a model holding an unpicklable object
    in a dict: the path goes through the partial's function, the bound object and the
    dict's key; a type that is not a resource gets advice about that type."""
    model = classifier()
    model.cache = {'handle': Unpicklable()}
    loss = functools.partial(lambda m, x, t: m(x, t), model)
    refused(r"^loss_func \(partial\) cannot be sent to a worker process: TypeError: cannot "
            r"pickle 'Unpicklable' object; the culprit is "
            r"loss_func\.args\[0\]\.cache\['handle'\] \(<test_pickle_path\.Unpicklable "
            r"object at 0x[0-9a-f]+> of type test_pickle_path\.Unpicklable\)\. Objects of "
            r"type test_pickle_path\.Unpicklable do not pickle: keep this one out of what "
            r"is handed to the updater \(create it where it is used\), or make the type "
            r"picklable \(__reduce__, or __getstate__ and __setstate__\)\.$",
            loss_func=loss)


def test_a_type_whose_own_pickling_refuses_is_not_said_not_to_pickle():
    """``chainer.Sequential`` pickles, but refuses where it holds a lambda, saying why:
    the advice points to that error, not to the type."""
    model = L.Classifier(chainer.Sequential(L.Linear(5, 4), lambda h: F.relu(h),
                                            L.Linear(4, 3)))
    refused(r"^the model \(Classifier\) cannot be sent to a worker process: ValueError: "
            r"This Sequential object has at least one lambda function.*; the culprit is "
            r"model\.predictor \(.* of type chainer\.sequential\.Sequential\)\. That error "
            r"comes from the pickling of chainer\.sequential\.Sequential itself: do what it "
            r"says, or keep this one out of what is handed to the updater \(create it where "
            r"it is used\)\.$", model=model)


class _BadReduce:
    def __reduce__(self):
        return 42


def test_a_malformed_reduce_gives_pickles_own_error():
    """A ``__reduce__`` that returns no tuple: pickle's message, not the search's crash on
    it (it raised ``'int' object is not subscriptable``)."""
    model = classifier()
    model.odd = _BadReduce()
    message = refused(r"^the model \(Classifier\) cannot be sent to a worker process: "
                      r"PicklingError: __reduce__ must return a string or tuple", model=model)
    assert 'the culprit' in message


def test_method_of_an_object_holding_a_lock():
    holder = type('Holder', (), {'convert': lambda self, batch, device=None:
                                 chainer.dataset.concat_examples(batch, device)})()
    holder.guard = threading.RLock()
    refused(r"^converter \(method\) cannot be sent to a worker process: TypeError: cannot "
            r"pickle '_thread\.RLock' object; the culprit is converter\.__self__\.guard "
            r"\(<unlocked _thread\.RLock object .* of type _thread\.RLock\)\. Open files, "
            r"locks or sockets inside the call", converter=holder.convert)


def test_the_object_itself_is_the_culprit():
    class Converter(Unpicklable):
        def __call__(self, batch, device=None):
            return chainer.dataset.concat_examples(batch, device)
    refused(r"^converter \(Converter\) cannot be sent to a worker process: TypeError: cannot "
            r"pickle 'Converter' object; the culprit is converter itself \(<test_pickle_path"
            r"\.test_the_object_itself_is_the_culprit\.<locals>\.Converter ob\.\.\. of "
            r"type test_pickle_path\.test_the_object_itself_is_the_culprit"
            r"\.<locals>\.Converter\)\. Objects of type", converter=Converter())


def test_submodule_imported_through_a_global(tmp_path, monkeypatch):
    """A closure reading ``pkg.sub.HANDLE`` where ``pkg.sub`` is registered to be pickled
    by value (cloudpickle.register_pickle_by_value): the path names the global the
    submodule is reached through, as the code spells it."""
    package = tmp_path / 'walked_pkg'
    package.mkdir()
    (package / '__init__.py').write_text('')
    (package / 'sub.py').write_text('import threading\nHANDLE = threading.Lock()\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    import walked_pkg.sub
    monkeypatch.setitem(sys.modules, 'walked_pkg', walked_pkg)
    monkeypatch.setitem(sys.modules, 'walked_pkg.sub', walked_pkg.sub)
    cloudpickle.register_pickle_by_value(walked_pkg.sub)
    try:
        scope = {'walked_pkg': walked_pkg}
        exec('def make():\n    def loss(x, t):\n        return walked_pkg.sub.HANDLE\n'
             '    return loss\n', scope)
        culprit = _pickle_path.find(scope['make'](), 'loss_func')
    finally:
        cloudpickle.unregister_pickle_by_value(walked_pkg.sub)
    assert culprit.path == "loss_func.__globals__['walked_pkg'].sub.HANDLE"
    assert culprit.obj is walked_pkg.sub.HANDLE and culprit.complete


def test_a_bound_stops_the_walk(monkeypatch):
    """Deeper than MAX_DEPTH steps: the message says where the walk stopped."""
    monkeypatch.setattr(_pickle_path, 'MAX_DEPTH', 3)
    nested = [Unpicklable()]
    for _ in range(5):
        nested = [nested]
    with pytest.raises(TypeError, match=r"; the search stopped, the culprit lies within "
                       r"iterators\[1\]\.dataset\[0\]\[0\] \(\[\[\[\[<test_pickle_path"):
        _validate.picklable('iterators[1]', chainer.iterators.SerialIterator(nested, 1), '')


def test_the_walk_leaves_the_objects_as_they_were():
    """Finding the culprit pickles parts on their own: the objects are left as they were."""
    model = classifier()
    model.guard = threading.Lock()
    before = {name: p.array.copy() for name, p in model.namedparams()}
    culprit = _pickle_path.find(model, 'model')
    assert culprit.path == 'model.guard' and culprit.obj is model.guard
    assert all(np.array_equal(p.array, before[name]) for name, p in model.namedparams())


class _LockedDataset(chainer.dataset.DatasetMixin):
    def __init__(self):
        self.guard = threading.Lock()

    def __len__(self):
        return 8

    def get_example(self, i):
        return np.zeros(5, np.float32), np.int32(0)


def test_a_multiprocess_iterators_dataset_is_named_through_its_attributes():
    """MultiprocessIterator is pickled from its attributes (and its generator's state,
    in a key of ours): the path goes through them, not through that state."""
    its = [chainer.iterators.MultiprocessIterator(_LockedDataset(), 4, n_processes=1)
           for _ in range(2)]
    optimizer = chainer.optimizers.SGD(0.1)
    optimizer.setup(classifier())
    try:
        with pytest.raises(TypeError, match=r"the culprit is iterators\[1\]\.init\['dataset'\]"
                                            r"\.guard \(<unlocked _thread\.lock"):
            ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy', '@numpy'])
    finally:
        for it in its:
            it.finalize()
    assert multiprocessing.active_children() == []

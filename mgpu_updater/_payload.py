"""How a worker's start-up payload is pickled: whatever ``StandardUpdater`` accepts travels.

The payload (model, loss function, converter, iterator over the worker's shard) is pickled
with cloudpickle: by reference where the worker can import the object, by value where it
cannot. So lambdas and closures (``loss_func=model.get_loss_func()``), converters made with
``@chainer.dataset.converter()`` (the module attribute is the wrapper, not the function),
``TransformDataset`` with a nested transform, and classes or functions defined in
``__main__`` (also inside ``if __name__ == '__main__':`` or a ``main()``) all reach the
worker. What truly cannot travel (open files, locks, sockets, threads, generators) still
fails, and :mod:`mgpu_updater._pickle_path` finds the path to it from the object handed
over. (cloudpickle would copy a text file opened for reading into the payload: refused
here, as pickle does.)

Whatever can be imported by name travels by reference: cloudpickle does so for module
objects of type ``types.ModuleType``, and here for those of its subclasses too, which it
cannot pickle at all (``TypeError: cannot pickle '_MovedItems' object``): ``six.moves``
and its submodules (six's importer makes them), ``importlib.util.LazyLoader``'s modules.
Such a module travels as its name when ``sys.modules`` holds it under a name, or when it
is the attribute of that name of a module that travels so (``six.moves`` before anything
imports it), or when an importer finds its ``__name__`` (``six.moves.urllib_parse``). A
lazy module is not loaded by being pickled: its name is found by identity in
``sys.modules``. The worker imports it by that name. Functions and classes reached
through such modules (``six.moves.zip``, ``six.moves.range``) are the builtins and
standard-library objects six re-exports, pickled by reference as ever.

Pickling never changes the user's objects. ``MultiprocessIterator.__getstate__`` does
(Chainer 7.8.1 ``chainer/iterators/multiprocess_iterator.py:266-288``: its ``serialize``
call resets ``current_position``, ``epoch`` and ``is_new_epoch`` to None on the original,
and it fails outright without an order, i.e. ``shuffle=False``); it is reduced here from
its attributes into the very state that method would return, read without side effects;
its generator, which Chainer's ``__setstate__`` draws from, is put back after it.
"""
from __future__ import annotations

import copyreg
import importlib
import importlib.util
import io
import marshal
import pickle
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

import chainer
import cloudpickle
import numpy
from chainer.device_resident import DeviceResident
from chainer.iterators import MultiprocessIterator

from ._chainer_private import (LINK_METACLASS, multiprocess_iterator_pickle_state,
                               order_sampler_rng)


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: Any, replace: Optional[Dict[int, Any]] = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._replace = replace or {}
        self._module_names: Optional[Dict[int, str]] = None

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self._replace:
            return _same, (self._replace[id(obj)],)
        kind = type(obj)    # not isinstance: it reads obj.__class__, which loads a lazy module
        if issubclass(kind, types.ModuleType) and kind is not types.ModuleType:
            reduced = self._reduce_module_subclass(obj)
            if reduced is not None:
                return reduced
        if obj is LINK_METACLASS:
            # Made by chainer.utils.enable_final (chainer/utils/meta.py:78), importable
            # by no name: by value, a class in __main__ deriving from chainer.Link would
            # get a copy of it in the worker, and a metaclass conflict.
            return type, (DeviceResident,)
        if kind is types.CodeType:
            # cloudpickle names the file of code it pickles by value '<dynamic-code>': a
            # worker's traceback through the script's own functions then showed neither
            # the script nor its lines. marshal keeps every field (the worker runs this
            # same Python), nested code too.
            # Version 2: no references (3 and up mark a constant by whether anything
            # else holds it at the time, a graph's node its tuple: the bytes of the same
            # code then differed, and the watch of unsent values named it as changed).
            try:
                return marshal.loads, (marshal.dumps(obj, 2),)
            except ValueError:   # a constant marshal cannot write (code built by hand)
                pass
        if isinstance(obj, MultiprocessIterator):
            return _reduce_multiprocess_iterator(obj)
        if isinstance(obj, io.TextIOWrapper) and obj not in (sys.stdout, sys.stderr):
            # cloudpickle would read the whole file into the payload (a silent copy of
            # what may be gigabytes, and a file no longer shared): refuse it as pickle does.
            raise TypeError(f"cannot pickle '{type(obj).__module__}.{type(obj).__name__}' "
                            'object')
        return super().reducer_override(obj)

    def _reduce_module_subclass(self, module: types.ModuleType) -> Optional[Tuple[Any, ...]]:
        """By name, where the worker can import ``module`` by one; else None (it fails)."""
        if self._module_names is None:
            self._module_names = {}
            for key, value in list(sys.modules.items()):
                self._module_names.setdefault(id(value), key)
        name = own_name(module)
        if self._module_names.get(id(module)) is not None:
            if sys.modules.get(name) is not module:      # an alias: any name will do
                name = self._module_names[id(module)]
            return _import_module, (name,)
        if not name:
            return None
        parent, _, attribute = name.rpartition('.')
        holder = sys.modules.get(parent) if parent else None
        if holder is not None and getattr(holder, attribute, None) is module:
            return getattr, (holder, attribute)
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError, AttributeError):   # a parent that is not a package
            found = False
        return (_import_module, (name,)) if found else None


def own_name(module: types.ModuleType) -> str:
    """``module.__name__`` read from its ``__dict__`` without ``getattr`` (which loads a
    lazy module); '' when it has none."""
    name = object.__getattribute__(module, '__dict__').get('__name__')
    return name if isinstance(name, str) else ''


def _import_module(name: str) -> types.ModuleType:
    """The module named ``name``, imported in the worker (``sys.modules[name]``)."""
    return importlib.import_module(name)


def _reduce_multiprocess_iterator(it: MultiprocessIterator) -> Tuple[Any, ...]:
    """``(copyreg.__newobj__, (cls,), state, None, None, setter)``: unpickling calls
    :func:`_set_multiprocess_iterator_state`, which calls Chainer's own ``__setstate__``
    (``multiprocess_iterator.py:290-298``) and then puts the order sampler's generator
    back where it was when pickled: that ``__setstate__`` calls ``reset()``
    (``_initialize_loop``, :133-135), which draws an order it then replaces (:240-245), so
    that the copy would shuffle its next epochs as the original's later ones."""
    rng = order_sampler_rng(it)
    state = multiprocess_iterator_pickle_state(it)
    state[_ORDER_RNG] = rng.get_state() if isinstance(rng, numpy.random.RandomState) else None
    return copyreg.__newobj__, (type(it),), state, None, None, _set_multiprocess_iterator_state


_ORDER_RNG = 'mgpu_updater order_sampler_rng'   # a key of ours in the state: no name of its


def _set_multiprocess_iterator_state(it: MultiprocessIterator, state: Dict[str, Any]) -> None:
    state = dict(state)
    rng_state = state.pop(_ORDER_RNG)
    it.__setstate__(state)
    if rng_state is not None:
        order_sampler_rng(it).set_state(rng_state)


def _same(obj: Any) -> Any:
    return obj


def replica_links(master: chainer.Link, replica: chainer.Link) -> Dict[int, Any]:
    """``{id(master's link or parameter): the replica's}``, for :func:`dumps`'s ``replace``.

    A ``loss_func`` may hold the master's model without being its bound method: a closure
    (``model.get_loss_func()`` in Chainer's VAE example captures the model), the model
    itself, one of its links, a ``functools.partial``. Pickled in one payload with the
    replica's model and these replacements, it holds the worker's replica, whose gradients
    are the ones reduced, instead of a copy of its own that nothing updates.
    """
    out: Dict[int, Any] = {}
    for mine, theirs in ((master.namedlinks(), replica.namedlinks()),
                         (master.namedparams(), replica.namedparams())):
        theirs = dict(theirs)
        out.update({id(obj): theirs[name] for name, obj in mine if name in theirs})
    return out


def dumps(obj: Any, replace: Optional[Dict[int, Any]] = None) -> bytes:
    """``obj`` pickled for a worker process (which unpickles it with ``pickle.load``).

    Every object whose ``id`` is a key of ``replace`` is pickled as that key's value
    (the same object wherever it is referenced).
    """
    return dumps_each([(obj, replace)])


def dumps_each(parts: List[Tuple[Any, Optional[Dict[int, Any]]]]) -> bytes:
    """Each ``(obj, replace)`` pickled as :func:`dumps` pickles it, one after the other in
    one bytes object (read back by as many ``pickle.load`` calls), written into one buffer:
    joining the pickles made would hold a model's payload twice at once."""
    buffer = io.BytesIO()
    for obj, replace in parts:
        _Pickler(buffer, replace).dump(obj)
    return buffer.getvalue()   # the buffer's own bytes, not a copy (CPython's BytesIO)


def reduction(obj: Any) -> Optional[Tuple[Any, ...]]:
    """The reduce tuple :func:`dumps` pickles ``obj`` as, or None where it is pickled
    natively or by name (a class, a function, a builtin); raises what reducing raises."""
    pickler = _Pickler(_Null())
    reduced = pickler.reducer_override(obj)
    if reduced is NotImplemented:
        kind = type(obj)
        if issubclass(kind, type) or kind is types.FunctionType:
            return None                    # by name (by value, reducer_override said so)
        reducer = pickler.dispatch_table.get(kind)
        reduced = reducer(obj) if reducer else obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return None if isinstance(reduced, str) else reduced


def check(obj: Any, replace: Optional[Dict[int, Any]] = None) -> None:
    """Pickle ``obj`` as :func:`dumps` would, keeping nothing; raises what pickling raises."""
    _Pickler(_Null(), replace).dump(obj)


class _Null(io.RawIOBase):
    def write(self, b: Any) -> int:
        return memoryview(b).nbytes

    def writable(self) -> bool:
        return True

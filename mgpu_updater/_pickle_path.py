"""Where pickling fails: the path from the object handed over to the part that does not pickle.

Pickle's error names a type (``cannot pickle '_thread.lock' object``) but not where it
sits. :func:`find` walks the object graph as the payload's pickler
(:mod:`mgpu_updater._payload`) takes it apart: instance attributes (``model.guard``), the
object a method is bound to (``.__self__``), a function's captured variables
(``loss_func.log``), globals (``.__globals__['six']``), defaults and the submodules it
imports (``.__globals__['six'].moves``), a class pickled by value (``.__class__.forward``),
a ``functools.partial``'s function and arguments, container items (``[0]``, ``['key']``).
At each step it goes into the first part that fails to pickle on its own, until no part
of the object in hand fails: that object is the culprit. Nothing is guessed: the path is
one that pickling really takes, and every step is checked by pickling.

The walk runs only after pickling has failed, at construction. It is bounded (``MAX_DEPTH``
steps, ``MAX_CHECKS`` trial picklings); where a bound stops it, the object reached is
reported as the place below which the culprit lies.
"""
from __future__ import annotations

import copyreg
import dataclasses
import functools
import io
import socket
import threading
import types
from typing import Any, Dict, Iterator, Tuple

from . import _payload

MAX_DEPTH = 40        # steps from the object handed over
MAX_CHECKS = 2000     # trial picklings of parts, in all

# Exact types (``isinstance`` would read ``__class__``, which loads a lazy module).
_ATOMIC = frozenset((type(None), bool, int, float, complex, str, bytes, bytearray,
                     type(Ellipsis), type(NotImplemented)))


@dataclasses.dataclass(frozen=True)
class Culprit:
    """``path`` from the object handed over to ``obj``, the part that does not pickle;
    ``complete`` is False where a bound stopped the walk (the culprit is within ``obj``)."""
    path: str
    obj: Any
    complete: bool = True


def find(root: Any, name: str) -> Culprit:
    """The part of ``root`` (called ``name`` in the path) that does not pickle.

    A part fails if it fails to pickle on its own, as the payload is pickled, with the
    objects already on the path taken as pickling (a method refers back to its class, a
    class to its methods: the part fails for what it holds besides them). ``root`` is
    assumed to fail; if no part of it fails, it is the culprit. An object whose parts
    cannot be told (a ``__reduce__`` that returns no tuple) stops the search there.
    """
    path, obj, on_path, checks = name, root, {id(root): None}, 0
    for _ in range(MAX_DEPTH):
        try:
            found = list(parts(obj))
        except Exception:  # noqa: BLE001 - a malformed reduction: pickle's error says it
            return Culprit(path, obj, complete=False)
        for label, part in found:
            if type(part) in _ATOMIC or id(part) in on_path:
                continue
            if checks >= MAX_CHECKS:
                return Culprit(path, obj, complete=False)
            checks += 1
            if _fails(part, on_path):
                path, obj = path + label, part
                on_path[id(part)] = None
                break
        else:
            return Culprit(path, obj)
    return Culprit(path, obj, complete=False)


def _fails(obj: Any, on_path: Dict[int, None]) -> bool:
    try:
        _payload.check(obj, replace=on_path)
    except Exception:  # noqa: BLE001 - pickling raises many types
        return True
    return False


def describe(obj: Any, limit: int = 80) -> str:
    """``repr(obj)`` cut to ``limit`` characters, and its type with its module."""
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the culprit
        text = '<unprintable>'
    if len(text) > limit:
        text = text[:limit - 3] + '...'
    return f'{text} of type {type_name(obj)}'


def type_name(obj: Any) -> str:
    kind = type(obj)
    module = getattr(kind, '__module__', None)
    qualname = getattr(kind, '__qualname__', kind.__name__)
    return qualname if module in (None, 'builtins') else f'{module}.{qualname}'


def resource_kind(obj: Any) -> str:
    """'an open file', 'a lock', 'a socket', 'a thread', 'a generator', 'a module', or ''."""
    kinds = (('an open file', (io.IOBase,)),
             ('a lock', (type(threading.Lock()), type(threading.RLock()))),
             ('a socket', (socket.socket,)),
             ('a thread', (threading.Thread,)),
             ('a generator', (types.GeneratorType, types.AsyncGeneratorType,
                              types.CoroutineType)),
             ('a module', (types.ModuleType,)))
    return next((kind for kind, classes in kinds if issubclass(type(obj), classes)), '')


# ------------------------------------------------------------------ the parts of an object
def parts(obj: Any) -> Iterator[Tuple[str, Any]]:
    """``(label, part)`` for each part pickling ``obj`` pickles, in pickling's order; none
    where ``obj`` is pickled by name or its reduction itself fails (then it is the culprit)."""
    kind = type(obj)
    if kind is dict:
        yield from ((f'[{key!r}]', value) for key, value in list(obj.items()))
        return
    if kind in (list, tuple):
        yield from ((f'[{i}]', item) for i, item in enumerate(obj))
        return
    if kind in (set, frozenset):
        yield from (('.<element>', item) for item in list(obj))
        return
    try:
        reduced = _payload.reduction(obj)
    except Exception:  # noqa: BLE001 - the reduction itself fails: nothing to go into
        return
    if reduced is None:
        return
    if issubclass(kind, functools.partial) and kind.__reduce__ is functools.partial.__reduce__:
        yield from _partial_parts(obj)
        return
    yield from _reduction_parts(obj, reduced)


def _partial_parts(obj: functools.partial) -> Iterator[Tuple[str, Any]]:
    yield '.func', obj.func
    yield from ((f'.args[{i}]', arg) for i, arg in enumerate(obj.args))
    yield from ((f'.keywords[{key!r}]', value) for key, value in obj.keywords.items())
    yield from _state_parts(getattr(obj, '__dict__', None) or {})


def _reduction_parts(obj: Any, reduced: Tuple[Any, ...]) -> Iterator[Tuple[str, Any]]:
    func, args = reduced[0], reduced[1]
    state = reduced[2] if len(reduced) > 2 else None
    kind = type(obj)
    if issubclass(kind, types.FunctionType) and _is_function_state(state):
        yield from _function_parts(obj, *state)
        yield from _generic_args(args)
        return
    if issubclass(kind, type) and _is_pair_of_dicts(state):
        if len(args) > 2 and isinstance(args[2], tuple):     # (metaclass, name, bases, ...)
            yield '.__class__', args[0]
            yield from ((f'.__bases__[{i}]', base) for i, base in enumerate(args[2]))
        else:
            yield from _generic_args(args)
        for part in state:
            yield from _state_parts(part)
        return
    if func is types.MethodType and len(args) == 2:
        yield '.__func__', args[0]
        yield '.__self__', args[1]
        return
    if func in (copyreg.__newobj__, copyreg.__newobj_ex__, copyreg._reconstructor) and args:
        yield '.__class__', args[0]
        yield from ((f'.<new argument {i}>', arg) for i, arg in enumerate(args[1:], 1))
    elif getattr(func, '__name__', '') == 'dynamic_subimport' and len(args) == 2:
        # a module pickled by value: its attributes
        yield from _state_parts(args[1])
        return
    else:
        yield '.<reconstructor>', func
        yield from _generic_args(args)
    if isinstance(state, dict):
        yield from _state_parts(state)
    elif _is_pair_of_dicts(state, allow_none=True):
        for part in state:
            yield from _state_parts(part or {})
    elif state is not None:
        yield '.__getstate__()', state
    if len(reduced) > 3 and reduced[3] is not None:
        yield from ((f'[{i}]', item) for i, item in enumerate(reduced[3]))
    if len(reduced) > 4 and reduced[4] is not None:
        yield from ((f'[{key!r}]', value) for key, value in reduced[4])


def _function_parts(func: types.FunctionType, attributes: dict,
                    members: dict) -> Iterator[Tuple[str, Any]]:
    """A function pickled by value: what it captures, its globals (and the submodules of
    those it imports), defaults, annotations and attributes."""
    for name, cell in zip(func.__code__.co_freevars, members.get('__closure__') or ()):
        try:
            yield f'.{name}', cell.cell_contents
        except ValueError:   # an empty cell
            pass
    global_values = members.get('__globals__') or {}
    yield from ((f'.__globals__[{key!r}]', value) for key, value in global_values.items())
    for module in members.get('_cloudpickle_submodules') or ():
        yield _submodule_label(module, global_values), module
    yield from ((f'.__defaults__[{i}]', value)
                for i, value in enumerate(members.get('__defaults__') or ()))
    yield from ((f'.__kwdefaults__[{key!r}]', value)
                for key, value in (members.get('__kwdefaults__') or {}).items())
    yield from ((f'.__annotations__[{key!r}]', value)
                for key, value in (members.get('__annotations__') or {}).items())
    yield from _state_parts(attributes)


def _submodule_label(module: Any, global_values: dict) -> str:
    """``.__globals__['six'].moves`` for ``six.moves`` imported through the global ``six``."""
    name = _module_name(module)
    best = ''
    for key, value in global_values.items():
        top = _module_name(value)
        if top and name.startswith(top + '.') and len(top) > len(best):
            best, label = top, f'.__globals__[{key!r}].{name[len(top) + 1:]}'
    return label if best else f'.<submodule {name}>'


def _module_name(obj: Any) -> str:
    return _payload.own_name(obj) if issubclass(type(obj), types.ModuleType) else ''


def _state_parts(state: Any) -> Iterator[Tuple[str, Any]]:
    if not isinstance(state, dict):
        yield '.__getstate__()', state
        return
    for key, value in list(state.items()):
        label = f'.{key}' if isinstance(key, str) and key.isidentifier() else f'.__dict__[{key!r}]'
        yield label, value


def _generic_args(args: Any) -> Iterator[Tuple[str, Any]]:
    yield from ((f'.<reduce argument {i}>', arg) for i, arg in enumerate(args or ()))


def _is_function_state(state: Any) -> bool:
    return (isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict)
            and isinstance(state[1], dict) and '__globals__' in state[1])


def _is_pair_of_dicts(state: Any, allow_none: bool = False) -> bool:
    ok = (dict, type(None)) if allow_none else dict
    return (isinstance(state, tuple) and len(state) == 2
            and all(isinstance(part, ok) for part in state))

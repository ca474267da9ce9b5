"""Module globals the workers import afresh: what the master's copies read there, compared.

The model, ``loss_func`` and the converter reach each worker pickled. What the script
defines in its main module travels by value, with the globals its functions read; what
an imported module of the user's defines (``models.py``'s ``Net``) travels by name, and
the worker imports that module again from its file. A global the script set at run time
in such a module (``config.SCALE = args.scale``, argparse style), a function replaced there
(a monkeypatch), or the file edited since the master imported it (a worker restarted
after an edit) then hold in the master only: the replicas compute otherwise, and nothing
fails. Moving the model from ``train.py`` into ``models.py`` changed the result.

So the master takes a fingerprint of what its copies' code reads in the user's modules
(:func:`fingerprints`): the modules that define the classes and functions the payload
holds, and those their globals name, where a module is the user's when its file lies
outside the standard library and the installed packages; of each, the globals that code
names (a plain value, or a function's or class's identity and its code) and the code of
the classes' methods. Each worker compares them with its own import
(:func:`differences`) and says what differs with ``Ready``; the master warns, naming each
(:func:`warn`). Values computed at import (a time, an environment variable) differ too
where the code reads them: named all the same, since the replicas then compute with
different values.
"""
from __future__ import annotations

import hashlib
import importlib
import marshal
import os
import sys
import sysconfig
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
MAX_NODES = 20000   # objects gone into per walk of the payload
MAX_ITEMS = 1000    # a container with more items is not gone into
MAX_NAMED = 5       # differences listed in one warning


def _system_paths() -> Tuple[str, ...]:
    paths = {sysconfig.get_paths().get(key) for key in ('stdlib', 'platstdlib', 'purelib',
                                                         'platlib')}
    paths |= {p for p in sys.path if p and os.path.basename(p) in ('site-packages',
                                                                  'dist-packages')}
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


def _users(module_name: Optional[str], system: Tuple[str, ...]) -> Optional[types.ModuleType]:
    """The module, where it is one of the user's (imported, from a file outside the
    standard library and the installed packages, not the main one)."""
    if not module_name or module_name in ('__main__', '__mp_main__', 'builtins'):
        return None
    module = sys.modules.get(module_name)
    path = getattr(module, '__file__', None)
    if module is None or not isinstance(path, str):
        return None
    real = os.path.realpath(path)
    return None if real.startswith(system) or module_name.startswith('mgpu_updater') \
        else module


def _codes(code: types.CodeType) -> List[types.CodeType]:
    out = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.extend(_codes(const))
    return out


def _code_digest(function: Any) -> str:
    """The code a function runs, without its line numbers (an edit that only moves it
    reads the same)."""
    parts = [(c.co_code, c.co_names, tuple(repr(k) for k in c.co_consts
                                             if not isinstance(k, types.CodeType)))
             for c in _codes(function.__code__)]
    return hashlib.blake2b(marshal.dumps(parts), digest_size=8).hexdigest()


def _token(value: Any) -> Any:
    """What a global is, comparably across processes; None: not compared."""
    if type(value) in _PLAIN:
        return value
    if type(value) is tuple and all(type(v) in _PLAIN for v in value) and len(value) <= 64:
        return value
    if isinstance(value, types.FunctionType):
        return ('function', value.__module__, value.__qualname__, _code_digest(value))
    if isinstance(value, type):
        return ('class', value.__module__, value.__qualname__)
    if isinstance(value, types.ModuleType):
        return ('module', value.__name__)
    return None


def _functions_of(cls: type) -> Dict[str, Any]:
    out = {}
    for name, member in vars(cls).items():
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        elif isinstance(member, property):
            member = member.fget
        if isinstance(member, types.FunctionType):
            out[name] = member
    return out


def _is_data(obj: Any) -> bool:
    """An array, a Variable or a dataset: no code of the user's in it (and an array's
    reduction would copy its data)."""
    import chainer
    return isinstance(obj, chainer.get_array_types() + (
        chainer.Variable, chainer.dataset.DatasetMixin, chainer.dataset.Iterator))


def fingerprints(roots: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Module name -> {global or Class.method: token}: what the code of ``roots`` (the
    model, ``loss_func``, the converter) reads in the user's modules, as the master has
    it now."""
    from ._pickle_path import parts
    system = _system_paths()
    modules: Dict[str, types.ModuleType] = {}
    classes: List[type] = []
    functions: List[Any] = []
    seen: Set[int] = set()
    stack = [obj for obj in roots.values() if obj is not None]
    nodes = 0
    while stack and nodes < MAX_NODES:
        obj = stack.pop()
        if id(obj) in seen or type(obj) in _PLAIN or _is_data(obj):
            continue
        seen.add(id(obj))
        nodes += 1
        kind = obj if isinstance(obj, type) else type(obj)
        for cls in kind.__mro__:
            module = _users(cls.__module__, system)
            if module is not None and cls not in classes:
                modules[module.__name__] = module
                classes.append(cls)
        if isinstance(obj, types.FunctionType):
            module = _users(obj.__module__, system)
            if module is not None:
                modules[module.__name__] = module
                functions.append(obj)
        if type(obj) in (list, tuple, dict, set, frozenset) and len(obj) > MAX_ITEMS:
            continue
        try:
            stack.extend(part for _, part in parts(obj))
        except Exception:  # noqa: BLE001 - what cannot be taken apart is not walked
            continue
    code_of = [f for cls in classes for f in _functions_of(cls).values()] + functions
    names: Set[str] = set()
    for function in code_of:
        for code in _codes(function.__code__):
            names.update(code.co_names)
    for module in list(modules.values()):   # the user's modules those globals name
        for name in names & set(vars(module)):
            other = vars(module)[name]
            if isinstance(other, types.ModuleType):
                found = _users(other.__name__, system)
                if found is not None:
                    modules[found.__name__] = found
    out: Dict[str, Dict[str, Any]] = {}
    for module_name, module in modules.items():
        entries = {name: _token(value) for name, value in vars(module).items()
                   if name in names and not name.startswith('__')}
        for cls in classes:
            if cls.__module__ == module_name:
                entries.update({f'{cls.__qualname__}.{name}': _token(f)
                                for name, f in _functions_of(cls).items()})
        out[module_name] = {k: v for k, v in entries.items() if v is not None}
    return out


def differences(expected: Dict[str, Dict[str, Any]]) -> Tuple[str, ...]:
    """In a worker: what its own import of each module holds otherwise than the master's
    ``expected`` (:func:`fingerprints`), in words."""
    out = []
    for module_name, entries in expected.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - said, as a difference
            out.append(f'{module_name}: not importable here ({type(exc).__name__}: {exc})')
            continue
        for key, token in entries.items():
            holder: Any = module
            for part in key.split('.')[:-1]:   # Class.method
                holder = getattr(holder, part, None)
            value = getattr(holder, key.split('.')[-1], _MISSING) if holder is not None \
                else _MISSING
            if isinstance(holder, type) and value is not _MISSING:
                value = _functions_of(holder).get(key.split('.')[-1], value)
            mine = _MISSING if value is _MISSING else _token(value)
            if mine != token:
                out.append(f'{module_name}.{key}: {_say(token)} in the master, '
                           f'{_say(mine)} in the worker')
    return tuple(out)


class _Missing:
    def __repr__(self) -> str:
        return '(not there)'


_MISSING = _Missing()


def _say(token: Any) -> str:
    if isinstance(token, tuple) and token and token[0] == 'function':
        return f'function {token[1]}.{token[2]} (code {token[3]})'
    if isinstance(token, tuple) and token and token[0] in ('class', 'module'):
        return f'{token[0]} {".".join(str(t) for t in token[1:])}'
    text = repr(token)
    return text if len(text) <= 40 else text[:37] + '...'


def warn(found: Dict[int, Sequence[str]], stacklevel: int = 2) -> None:
    """The master's warning, where any worker found a difference (by rank)."""
    listed = [f'{line} (replica {rank})' for rank, lines in sorted(found.items())
              for line in lines]
    if not listed:
        return
    more = f' (and {len(listed) - MAX_NAMED} more)' if len(listed) > MAX_NAMED else ''
    warnings.warn(
        'the worker processes import your modules again from their files, and their copies '
        'of the model, loss_func and converter read there what the master\'s do not: '
        f'{"; ".join(listed[:MAX_NAMED])}{more}. The replicas compute with different values '
        'or code. A value the script sets at run time in a module (config.SCALE = ...) '
        'reaches them only as an argument of the model (or a persistent of it); a '
        'function replaced in a module at run time, or a file edited since, does not '
        'reach them at all',
        RuntimeWarning, stacklevel=stacklevel)

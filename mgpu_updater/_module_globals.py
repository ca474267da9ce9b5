"""Module globals and code the workers import afresh: what the master's copies read
there, compared.

The model, ``loss_func`` and the converter reach each worker pickled. What the script
defines in its main module travels by value, with the globals its functions read; what
an imported module of the user's defines (``models.py``'s ``Net``) travels by name, and
the worker imports that module again from its file. A global the script set at run time
in such a module (``config.SCALE = args.scale``, argparse style), a function replaced
there (a monkeypatch), or a value or a function's code in the file edited since the
master imported it (a notebook's kernel that keeps running, a worker restarted after an
edit: the workers run the file as it is now, the master its old code) then differ
between the replicas: they compute otherwise, and nothing fails. Moving the model from
``train.py`` into ``models.py`` changed the result.

So the master takes a fingerprint of what its copies' forward reads in the user's modules
(:func:`fingerprints`): the modules that define the classes and functions the payload
holds, and those their globals name, where a module is the user's when its file lies
outside the standard library and the installed packages. The code read is that of the
forward (``forward``, ``__call__``, the ``loss_func`` and converter where they are the
user's module's) and of what it calls by name, followed name by name; of each module, the
globals that code names: a plain value, a small container of them, a numpy scalar, a
``functools.partial``, and a function's, class's or module's identity. The code of each
function followed that a user's module defines (found again there by its qualified name,
outside any ``<locals>``) is fingerprinted too (:func:`_code_token`): what it does only,
the bytecode, names, arguments and constants, into nested code objects, not its line
numbers, file name or docstring (a comment or a blank line added does not count). That
only in a module a plain file loader loaded (``SourceFileLoader``,
``SourcelessFileLoader``), in the master and in the worker: an import hook such as
pytest's assertion rewriting changes the master's code and not the workers'. (The
package's own hook, ``_mgpu_updater_hook``, loads no module itself: it applies the Chainer
compat shim when Chainer is first imported, in the master and the workers alike, and
changes no code of the user's.) And which function each method of the user's classes in
the payload is (``('member', qualname)``): a method replaced at run time (``Net.forward =
f`` in a notebook's cell) is the master's alone. Each worker compares them
with its own import (:func:`differences`) and says what differs with ``Ready``; the master
warns, naming each (:func:`warn`). Values computed at import (a time, an environment
variable) differ too where the forward reads them: named all the same, since the
replicas then compute with different values. The check never stops training: what it
cannot read, it leaves out.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import importlib.machinery
import os
import sys
import sysconfig
import types
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy

from . import _warning

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
MAX_NODES = 20000   # objects gone into per walk of the payload
MAX_ITEMS = 1000    # a container with more items is not gone into
MAX_NAMED = 5       # differences listed in one warning
MAX_SMALL = 64      # items of a container global compared, at most


def _system_paths() -> Tuple[str, ...]:
    paths = {sysconfig.get_paths().get(key) for key in ('stdlib', 'platstdlib', 'purelib',
                                                         'platlib')}
    paths |= {p for p in sys.path if p and os.path.basename(p) in ('site-packages',
                                                                  'dist-packages')}
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


def _users(module_name: Optional[str], system: Tuple[str, ...]) -> Optional[types.ModuleType]:
    """The module, where it is one of the user's (imported, from a file outside the
    standard library and the installed packages, not the main one; not a lazy module,
    which a look would import)."""
    if not isinstance(module_name, str) or module_name in ('__main__', '__mp_main__',
                                                           'builtins'):
        return None
    module = sys.modules.get(module_name)
    if module is None or type(module).__name__ == '_LazyModule':
        return None
    path = vars(module).get('__file__')
    if not isinstance(path, str):
        return None
    real = os.path.realpath(path)
    return None if real.startswith(system) or module_name.startswith('mgpu_updater') \
        else module


def _codes(code: types.CodeType) -> List[types.CodeType]:
    out = [code]
    for const in code.co_consts:
        if type(const) is types.CodeType:
            out.extend(_codes(const))
    return out


_PLAIN_LOADERS = (importlib.machinery.SourceFileLoader,
                  importlib.machinery.SourcelessFileLoader)


def _plainly_loaded(module: types.ModuleType) -> bool:
    """Loaded from its file by Python's own loader: the code is the file's as compiled,
    as a worker's import compiles it (an import hook's loader may change it)."""
    spec = vars(module).get('__spec__')
    loader = getattr(spec, 'loader', None) if spec is not None else None
    return type(loader) in _PLAIN_LOADERS and \
        type(vars(module).get('__loader__')) in _PLAIN_LOADERS


def _constant(value: Any) -> Any:
    """A code constant, comparably across processes (a frozenset, as a set literal in a
    membership test compiles, in an order of its own)."""
    kind = type(value)
    if kind is types.CodeType:
        return _code_parts(value)
    if kind is tuple:
        return ('tuple', tuple(_constant(v) for v in value))
    if kind is frozenset:
        return ('frozenset', tuple(sorted((repr(_constant(v)) for v in value))))
    if kind in _PLAIN or kind is type(Ellipsis):
        return (kind.__name__, repr(value))
    return (kind.__name__,)   # not a literal (set at run time): its repr may be an address


def _code_parts(code: types.CodeType, doc: Any = None) -> Tuple[Any, ...]:
    """What the code does: not its line numbers (``co_firstlineno``, the line table) or
    file name. ``doc``: the function's docstring, left out where it is the first
    constant."""
    consts = code.co_consts
    if doc is not None and consts and consts[0] is doc:
        consts = (None,) + consts[1:]
    return (code.co_code, getattr(code, 'co_exceptiontable', b''), code.co_argcount,
            code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags, code.co_names,
            code.co_varnames, code.co_freevars, code.co_cellvars,
            tuple(_constant(c) for c in consts))


def _code_token(function: types.FunctionType) -> str:
    """A digest of what a function's code does (:func:`_code_parts`), the same in each
    process for the same source."""
    doc = function.__doc__ if type(function.__doc__) is str else None
    text = repr(_code_parts(function.__code__, doc))
    data = text.encode('utf-8', 'backslashreplace')
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _method(member: Any) -> Any:
    """A class's own dict entry as the function it holds, through ``staticmethod`` and
    ``classmethod``."""
    return member.__func__ if type(member) in (staticmethod, classmethod) else member


def _entry(module: types.ModuleType, qualname: str) -> Any:
    """What ``qualname`` names in ``module`` (a method: its class's own dict entry, as
    :func:`_method` gives it); :data:`_MISSING` where it is not there, None where the class
    that would hold it is not."""
    *path, last = qualname.split('.')
    owner: Any = module
    for name in path:
        owner = vars(owner).get(name) if hasattr(owner, '__dict__') else None
        if not issubclass(type(owner), type):
            return None
    return _method(vars(owner).get(last, _MISSING))


def _found(module: types.ModuleType, qualname: str) -> Any:
    """The function ``qualname`` names in ``module`` (a method, or a ``property``'s
    getter), else None."""
    if '<' in qualname:
        return None
    member = _entry(module, qualname)
    if type(member) is property:
        member = member.fget
    return member if type(member) is types.FunctionType else None


def _token(value: Any, depth: int = 0) -> Any:
    """What a global is, comparably across processes; None: not compared. Reads only
    ``type(value)``, never ``value.__class__`` (a proxy's may raise)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if issubclass(kind, numpy.generic):
        return ('numpy', str(value.dtype), value.item())
    if depth < 3 and kind in (tuple, list) and len(value) <= MAX_SMALL:
        items = [_token(v, depth + 1) for v in value]
        return None if any(i is None for i in items) else (kind.__name__, tuple(items))
    if depth < 3 and (kind in (dict, types.SimpleNamespace) or kind is argparse.Namespace):
        items = value if kind is dict else vars(value)
        if len(items) > MAX_SMALL or not all(type(k) is str for k in items):
            return None
        pairs = [(k, _token(v, depth + 1)) for k, v in sorted(items.items())]
        return None if any(t is None for _, t in pairs) else (kind.__name__, tuple(pairs))
    if kind is functools.partial:
        inner = _token(value.func, depth + 1)
        args = _token(tuple(value.args), depth + 1)
        keywords = _token(dict(value.keywords), depth + 1)
        return None if None in (inner, args, keywords) else ('partial', inner, args,
                                                              keywords)
    if kind is types.FunctionType:
        return ('function', value.__module__, value.__qualname__)
    if issubclass(kind, type):
        return ('class', value.__module__, value.__qualname__)
    if issubclass(kind, types.ModuleType):
        name = _module_name(value)
        return None if name is None else ('module', name)
    return None


def _module_name(module: types.ModuleType) -> Optional[str]:
    """Its name; None for a lazy module (``importlib.util.LazyLoader``), which any look
    at it imports."""
    if type(module).__name__ == '_LazyModule':
        return None
    name = module.__name__
    return name if isinstance(name, str) else None


def _same(a: Any, b: Any) -> bool:
    """Tokens equal, a NaN equal to a NaN."""
    if type(a) is float and type(b) is float and a != a and b != b:
        return True
    if type(a) is tuple and type(b) is tuple and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _functions_of(cls: type) -> Dict[str, Any]:
    out = {}
    for name, member in vars(cls).items():
        if type(member) in (staticmethod, classmethod):
            member = member.__func__
        elif type(member) is property:
            member = member.fget
        if type(member) is types.FunctionType:
            out[name] = member
    return out


def _is_data(obj: Any) -> bool:
    """An array, a Variable or a dataset: no code of the user's in it (and an array's
    reduction would copy its data)."""
    import chainer
    return isinstance(obj, chainer.get_array_types() + (
        chainer.Variable, chainer.dataset.DatasetMixin, chainer.dataset.Iterator))


def fingerprints(roots: Dict[str, Any]) -> Dict[str, Dict[Any, Any]]:
    """Module name -> {global: token, ('code', qualname): digest}: what the forward code
    of ``roots`` (the model, ``loss_func``, the converter) reads in the user's modules, and
    that code itself, as the master has it now; empty where it cannot tell (never an
    error)."""
    try:
        return _fingerprints(roots)
    except Exception:  # noqa: BLE001 - a look, not a requirement
        return {}


def _fingerprints(roots: Dict[str, Any]) -> Dict[str, Dict[Any, Any]]:
    from ._pickle_path import parts
    system = _system_paths()
    modules: Dict[str, types.ModuleType] = {}
    classes: List[type] = []
    entries: List[Any] = []   # the code that runs first: forwards, loss_func, converter
    seen: Set[int] = set()
    stack = [obj for obj in roots.values() if obj is not None]
    nodes = 0
    while stack and nodes < MAX_NODES:
        obj = stack.pop()
        if id(obj) in seen or type(obj) in _PLAIN or _is_data(obj):
            continue
        seen.add(id(obj))
        nodes += 1
        kind = obj if issubclass(type(obj), type) else type(obj)
        for cls in kind.__mro__:
            if '<locals>' in cls.__qualname__:
                continue   # travels by value (cloudpickle), with the master's globals
            module = _users(cls.__module__, system)
            if module is not None and cls not in classes:
                modules[module.__name__] = module
                classes.append(cls)
                found = _functions_of(cls)
                entries.extend(found[name] for name in ('forward', '__call__')
                               if name in found)
        if type(obj) is types.FunctionType and '<locals>' not in obj.__qualname__:
            module = _users(obj.__module__, system)
            if module is not None:
                modules[module.__name__] = module
                entries.append(obj)
        if type(obj) in (list, tuple, dict, set, frozenset) and len(obj) > MAX_ITEMS:
            continue
        try:
            stack.extend(part for _, part in parts(obj))
        except Exception:  # noqa: BLE001 - what cannot be taken apart is not walked
            continue
    names, functions = _reached(entries, classes, modules, system)
    out: Dict[str, Dict[Any, Any]] = {}
    for module_name, module in modules.items():
        # (a name that is no identifier is an import hook's: pytest's assertion rewriting
        # adds '@py_builtins' to the master's modules, which a worker imports without it)
        found = {name: _token(value) for name, value in vars(module).items()
                 if name in names and name.isidentifier() and not name.startswith('__')}
        out[module_name] = {k: v for k, v in found.items() if v is not None}
    for cls in classes:
        # which function each of its methods is, under ('member', qualname): a method
        # replaced at run time (Net.forward = f) is the master's alone
        for name, member in vars(cls).items():
            member = _method(member)
            if type(member) is types.FunctionType:
                out.setdefault(cls.__module__, {})[
                    ('member', f'{cls.__qualname__}.{name}')] = _token(member)
    for function in functions:
        # (its code, under ('code', qualname): where the worker finds it again)
        try:
            module = _users(function.__module__, system)
            if module is not None and _plainly_loaded(module) and \
                    _found(module, function.__qualname__) is function:
                out.setdefault(module.__name__, {})[('code', function.__qualname__)] = \
                    _code_token(function)
        except Exception:  # noqa: BLE001 - what cannot be read is left out
            continue
    return {name: found for name, found in out.items() if found}


def _reached(entries: List[Any], classes: List[type], modules: Dict[str, types.ModuleType],
             system: Tuple[str, ...]) -> Tuple[Set[str], List[types.FunctionType]]:
    """The global and attribute names the code from ``entries`` reads, following the
    methods of ``classes`` and the user's modules' functions it names (a helper method a
    forward calls: ``self.helper`` names ``helper``), to a fixed point, and the functions
    so followed. Adds the user's modules those names reach to ``modules``."""
    names: Set[str] = set()
    reached: Set[int] = set()
    functions: List[types.FunctionType] = []
    pending = list(entries)
    while pending:
        function = pending.pop()
        if id(function) in reached:
            continue
        reached.add(id(function))
        functions.append(function)
        new: Set[str] = set()
        for code in _codes(function.__code__):
            new.update(code.co_names)
        new -= names
        names |= new
        for cls in classes:
            pending.extend(f for name, f in _functions_of(cls).items() if name in new)
        for module in list(modules.values()):
            for name in new & set(vars(module)):
                value = vars(module)[name]
                if type(value) is types.FunctionType and _users(value.__module__, system):
                    pending.append(value)
                elif issubclass(type(value), types.ModuleType):
                    other = _users(_module_name(value), system)
                    if other is not None and other.__name__ not in modules:
                        modules[other.__name__] = other
    return names, functions


def differences(expected: Dict[str, Dict[Any, Any]]) -> Tuple[str, ...]:
    """In a worker: what its own import of each module holds otherwise than the master's
    ``expected`` (:func:`fingerprints`), in words; nothing where it cannot tell."""
    try:
        return _differences(expected)
    except Exception:  # noqa: BLE001 - a look, not a requirement
        return ()


def _differences(expected: Dict[str, Dict[Any, Any]]) -> Tuple[str, ...]:
    out = []
    for module_name, entries in expected.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - said, as a difference
            out.append(f'{module_name}: not importable here ({type(exc).__name__}: {exc})')
            continue
        for key, token in entries.items():
            if type(key) is tuple:
                try:
                    out.extend(_code_differs(module, key[1], token) if key[0] == 'code'
                               else _member_differs(module, key[1], token))
                except Exception:  # noqa: BLE001 - what cannot be read is left out
                    pass
                continue
            value = vars(module).get(key, _MISSING)
            mine = _MISSING if value is _MISSING else _token(value)
            if not _same(mine, token):
                out.append(f'{module_name}.{key}: {_say(token)} in the master, '
                           f'{_say(mine)} in the worker')
    return tuple(out)


def _code_differs(module: types.ModuleType, qualname: str, digest: str) -> List[str]:
    """The function's code in the worker's import of ``module``, where it is not the
    master's ``digest``: its file changed since the master imported it."""
    if not _plainly_loaded(module):
        return []
    function = _found(module, qualname)
    if function is not None and _code_token(function) == digest:
        return []
    path = vars(module).get('__file__')
    file = os.path.basename(path) if isinstance(path, str) else module.__name__
    now = 'the worker does not find it in the file as it is now' if function is None else \
        'the worker runs the file as it is now, the master its old code'
    return [f'{module.__name__}.{qualname}: {file} was changed since the master imported '
            f'it ({now})']


def _member_differs(module: types.ModuleType, qualname: str, token: Any) -> List[str]:
    """The method ``qualname`` of a class in the worker's import of ``module``, where it
    is not the function the master's class holds (``token``): replaced in the master at
    run time, or added there."""
    member = _entry(module, qualname)
    if member is None:
        return []   # the class is not where the master's is: not compared
    mine = _MISSING if member is _MISSING else _token(member)
    if _same(mine, token):
        return []
    return [f'{module.__name__}.{qualname}: {_say(token)} in the master, {_say(mine)} in '
            'the worker']


class _Missing:
    def __repr__(self) -> str:
        return '(not there)'


_MISSING = _Missing()


def _plain(token: Any) -> Any:
    """A token as the value it stands for, to show."""
    if type(token) is not tuple or not token or type(token[0]) is not str:
        return token
    head = token[0]
    if head == 'numpy':
        return f'{token[1]}({token[2]!r})'
    if head in ('list', 'tuple'):
        items = [_plain(t) for t in token[1]]
        return items if head == 'list' else tuple(items)
    if head in ('dict', 'SimpleNamespace', 'Namespace'):
        items = {k: _plain(t) for k, t in token[1]}
        return items if head == 'dict' else f'{head}({items})'
    if head in ('function', 'class', 'module'):
        return f'{head} {".".join(str(t) for t in token[1:])}'
    if head == 'partial':
        return f'partial({_plain(token[1])}, ...)'
    return token


def _say(token: Any) -> str:
    value = _plain(token)
    text = value if type(value) is str and type(token) is tuple else repr(value)
    return text if len(text) <= 60 else text[:57] + '...'


def warn(found: Dict[int, Sequence[str]], stacklevel: int = 2) -> None:
    """The master's warning, where any worker found a difference (by rank)."""
    listed = [f'{line} (replica {rank})' for rank, lines in sorted(found.items())
              for line in lines]
    if not listed:
        return
    more = f' (and {len(listed) - MAX_NAMED} more)' if len(listed) > MAX_NAMED else ''
    _warning.warn(
        'the worker processes import your modules again from their files, and their copies '
        'of the model, loss_func and converter read or run there what the master\'s do '
        'not: '
        f'{"; ".join(listed[:MAX_NAMED])}{more}. The replicas compute with different values '
        'or functions. A value the script sets at run time in a module (config.SCALE = ...) '
        'reaches them only as an argument of the model (or a persistent of it), and a '
        'function or method replaced in a module at run time not at all. A module file edited since '
        'the master imported it (its code or its values) reaches the workers alone: restart '
        'the process (the Python kernel), or reload the module (importlib.reload, '
        '%autoreload 2) and build the model again',
        RuntimeWarning, stacklevel=stacklevel)

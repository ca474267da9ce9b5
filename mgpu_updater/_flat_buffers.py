"""Deterministic flat buffers: sorted names, grouped by dtype, packed and unpacked in place.

Every rank builds the same :class:`FlatLayout` from its replica of the model, so the
``i``-th element of a buffer means the same thing on every rank. Buffers are named
``'<prefix>/<dtype>'`` (for example ``'grad/<f4'``) and allocated once by the
communicator; packing and unpacking reuse them across updates.
"""
from __future__ import annotations

import copy
from typing import (Any, Callable, Collection, Dict, Iterable, List, Mapping, NamedTuple,
                    Optional, Tuple)

import numpy

import chainer

from ._chainer_private import persistent_slots, persistent_value, set_persistent


class _Entry(NamedTuple):
    name: str
    offset: int
    size: int
    shape: Tuple[int, ...]


class FlatLayout:
    """Where each named array lives inside one flat buffer per dtype."""

    def __init__(self, prefix: str, arrays: Iterable[Tuple[str, Any]]) -> None:
        self.prefix = prefix
        groups: Dict[str, List[_Entry]] = {}
        sizes: Dict[str, int] = {}
        for name, array in sorted(arrays, key=lambda kv: kv[0]):
            dtype = numpy.dtype(array.dtype).str
            offset = sizes.get(dtype, 0)
            groups.setdefault(dtype, []).append(
                _Entry(name, offset, int(array.size), tuple(array.shape)))
            sizes[dtype] = offset + int(array.size)
        self.groups = groups
        self.sizes = sizes
        #: the names of every entry
        self.names = frozenset(e.name for entries in groups.values() for e in entries)

    def renamed(self, prefix: str) -> 'FlatLayout':
        """The same layout under other buffer names (a second set for double buffering)."""
        other = copy.copy(self)
        other.prefix = prefix
        return other

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def buffer_names(self) -> Dict[str, str]:
        """dtype -> buffer name."""
        return {dtype: f'{self.prefix}/{dtype}' for dtype in self.groups}

    def spec(self) -> Dict[str, Tuple[str, int]]:
        """Buffer name -> (dtype, element count), for the communicator."""
        return {f'{self.prefix}/{dtype}': (dtype, n) for dtype, n in self.sizes.items()}

    def pack(self, arrays: Mapping[str, Any], buffer: Callable[[str], Any],
             scale: Optional[float] = None, skip: Collection[str] = ()) -> None:
        """Copy each array into its slice (zeros where an array is ``None``), but those
        in ``skip``."""
        try:
            for dtype, entries in self.groups.items():
                flat = buffer(f'{self.prefix}/{dtype}')
                for e in entries:
                    if e.name in skip:
                        continue
                    dst = flat[e.offset:e.offset + e.size]
                    src = arrays[e.name]
                    if src is None:
                        dst.fill(0)
                    elif scale is None:
                        if src.dtype != dst.dtype and src.dtype.kind != dst.dtype.kind:
                            _retyped(e, src, dst.dtype)
                        dst[...] = src.reshape(-1)
                    else:
                        # one fused multiply-copy; 'unsafe' keeps float16 as float16
                        _xp(dst).multiply(src.reshape(-1), scale, out=dst, casting='unsafe')
        except ValueError as exc:
            raise self._reshaped(arrays, exc)
        except KeyError as exc:
            raise self._missing(arrays, exc)

    def unpack(self, buffer: Callable[[str], Any], arrays: Mapping[str, Any],
               scale: Optional[float] = None, skip: Collection[str] = ()) -> None:
        """Copy each slice back into the existing arrays, in place (but those in ``skip``)."""
        try:
            for dtype, entries in self.groups.items():
                flat = buffer(f'{self.prefix}/{dtype}')
                for e in entries:
                    if e.name in skip:
                        continue
                    dst = arrays[e.name]
                    src = flat[e.offset:e.offset + e.size].reshape(e.shape)
                    if scale is None:
                        dst[...] = src
                    else:
                        _xp(dst).multiply(src, scale, out=dst, casting='unsafe')
        except ValueError as exc:
            raise self._reshaped(arrays, exc)
        except KeyError as exc:
            raise self._missing(arrays, exc)

    def _missing(self, arrays: Mapping[str, Any], exc: KeyError) -> Exception:
        """The error where an entry has no array: a persistent laid out as an array that
        holds a number or None now is named, with the fix; else ``exc`` as it came."""
        for entries in self.groups.values():
            for e in entries:
                if e.name not in arrays:
                    error = _no_array(e)
                    error.__cause__ = exc
                    return error
        return exc

    def _reshaped(self, arrays: Mapping[str, Any], exc: ValueError) -> Exception:
        """The error where an array no longer fits its slice: one the model changed the
        shape of during training (a persistent a forward grows, a parameter replaced by
        one of another shape) is named, with the fix; else ``exc`` as it came."""
        found = [f'{e.name} {e.shape} -> {tuple(arrays[e.name].shape)}'
                 for entries in self.groups.values() for e in entries
                 if arrays.get(e.name) is not None
                 and tuple(arrays[e.name].shape) != e.shape]
        if not found:
            return exc
        error = RuntimeError(
            f"the model's arrays {'; '.join(found)} changed shape during training (a "
            'persistent the forward grows, a parameter replaced by one of another shape): '
            'each update carries every parameter and persistent between the replicas in a '
            'slot of the shape it had when they were built. Give such an array its full '
            'shape from the start (a buffer of fixed size that the forward fills), or '
            'finalize this updater and build a new one after the change')
        error.__cause__ = exc
        return error


    def views(self, buffer: Callable[[str], Any], names: Collection[str]) -> Dict[str, Any]:
        """The slices of the entries named, shaped as their arrays: views, no copy."""
        out = {}
        for dtype, entries in self.groups.items():
            flat = buffer(f'{self.prefix}/{dtype}')
            for e in entries:
                if e.name in names:
                    out[e.name] = flat[e.offset:e.offset + e.size].reshape(e.shape)
        return out


def _xp(array: Any) -> Any:
    return chainer.backend.get_array_module(array)


# --------------------------------------------------------------------------------------
# What of a model travels


def _retyped(entry: Any, array: Any, dtype: Any) -> None:
    """Raise: ``entry``'s array is of another kind than its slot (floats where integers
    were), so that copying it would cast its values."""
    raise RuntimeError(
        f'{entry.name} holds a {array.dtype} array now, where the slot that carries it '
        f'between the replicas holds {dtype}, its dtype when they were built: its '
        'values would be cast (floats to integers, or back). Give it an array of its '
        f'dtype (new.astype(numpy.{dtype})), or finalize this updater and build a new '
        'one after the change')


def _no_array(entry: Any) -> RuntimeError:
    """The error for ``entry``'s persistent holding no array now (a number given since)."""
    return RuntimeError(
        f'the persistent {entry.name} held a {entry.shape} array when the replicas were '
        'built and holds no array now: the buffers that carry persistents between the '
        f'replicas hold an array for it. Set its elements instead '
        f'(link.{entry.name.rpartition("/")[2]}[...] = value), or finalize this updater '
        'and build a new one after the change')


class ModelLayouts:
    """The three layouts of one model.

    - ``grad``: every parameter's gradient (reduced, summed, onto the master);
    - ``stat``: float array persistents (reduced with weight 1/N: averaged);
    - ``state``: every parameter and array persistent (broadcast from the master; its
      buffers keep the wire name ``param/<dtype>``), a parameter that holds another's
      very array (``copy(mode='share')``, ``repeat(n, mode='share')``) once, under the
      other's name (:attr:`ModelIndex.aliases`).
    """

    def __init__(self, link: chainer.Link, double_buffered: bool = False) -> None:
        #: the link's parameters and persistents, found once (:class:`ModelIndex`)
        self.index = ModelIndex(link)
        params = list(self.index.param_arrays().items())
        persist = self.index.persistent_arrays()
        self.grad = FlatLayout('grad', params)
        self.stat = FlatLayout('stat', [(n, a) for n, a in persist
                                        if numpy.dtype(a.dtype).kind == 'f'])
        aliases = self.index.aliases
        self.state = FlatLayout('param', [(n, a) for n, a in params if n not in aliases]
                                + persist)
        #: the persistents that travel as values, in each update's Step: those that held
        #: no array when laid out, whatever they hold now (a number given a 0-d array)
        self.values = frozenset(self.index.persistent_scalars())
        self._grad_sets: Dict[Optional[int], FlatLayout] = {None: self.grad}
        if double_buffered:
            for parity in (0, 1):
                self.grad_set(parity)

    def grad_set(self, parity: Optional[int]) -> FlatLayout:
        """``grad`` (``None``), or one of the two sets ``grad0``/``grad1`` that the
        pipelined mode alternates between."""
        if parity not in self._grad_sets:
            self._grad_sets[parity] = self.grad.renamed(f'grad{parity}')
        return self._grad_sets[parity]

    def spec(self) -> Dict[str, Tuple[str, int]]:
        spec = {}
        for layout in list(self._grad_sets.values()) + [self.stat, self.state]:
            spec.update(layout.spec())
        return spec

    def step_values(self, link: chainer.Link) -> Dict[str, Any]:
        """What :attr:`values` names, as ``link`` holds them now (the master's Step)."""
        if not self.values:
            return {}
        return {path: value for path, value in self.index_of(link).named_persistents()
                if path in self.values}

    def index_of(self, link: chainer.Link) -> 'ModelIndex':
        """The index of ``link``: the one found at construction where ``link`` is the link
        these layouts were built from (every update's case), else a fresh walk."""
        return self.index if link is self.index.link else ModelIndex(link)


class ModelIndex:
    """One link's parameters and persistent values, found once, read anew at each call.

    Walking a link tree (``namedparams``, ``namedlinks``) took 45-90 us with the caches
    cold after a window (the benchmark's CNN, 4 links, 8 parameters), and one update
    walked it about ten times on every rank, before and after the windows: on the
    critical path. The index keeps the :class:`chainer.Parameter` objects and each
    persistent's owner and name, and every call reads the current arrays and values from
    them, so that an array replaced since (a deserializer, ``to_device``, an update rule
    that assigns a new one) is seen as before. What it does not see is the tree itself
    changing afterwards (a link, parameter or persistent added or removed), which the
    flat layouts built from it (:class:`ModelLayouts`) do not follow either. A parameter
    registered in several links is indexed once (:func:`unique_params`); one that holds
    no array is not indexed (:func:`initialized_params`).

    :attr:`aliases`: parameters of their own that hold the very array of one indexed
    before (Chainer's ``copy(mode='share')``, ``repeat(n, mode='share')``): name -> that
    one's name. Each has its own gradient and update rule, which step the one array in
    turn, so the array is one entry of the ``state`` layout and one view of its slot.
    """

    def __init__(self, link: chainer.Link) -> None:
        self.link = link
        self.params: List[Tuple[str, chainer.Parameter]] = initialized_params(link)
        first: Dict[int, str] = {}
        #: name -> the name of the parameter indexed first whose array it holds
        self.aliases: Dict[str, str] = {}
        for name, param in self.params:
            if param.array is not None:
                held = first.setdefault(id(param.array), name)
                if held != name:
                    self.aliases[name] = held
        self.persistents = persistent_slots(link)   # (path, owner, name)
        self._owners = {path.rpartition('/')[0] or '/': owner
                        for path, owner, _ in self.persistents}

    def param_arrays(self) -> Dict[str, Any]:
        return {name: p.array for name, p in self.params}

    def grad_arrays(self) -> Dict[str, Any]:
        return {name: p.grad for name, p in self.params}

    def named_persistents(self) -> List[Tuple[str, Any]]:
        return [(path, persistent_value(owner, name)) for path, owner, name in self.persistents]

    def persistent_arrays(self) -> List[Tuple[str, Any]]:
        """(path, array) of every array persistent (BatchNorm's running mean, var...)."""
        types = chainer.get_array_types()
        return [(key, value) for key, value in self.named_persistents()
                if isinstance(value, types) and value is not None]

    def persistent_scalars(self) -> Dict[str, Any]:
        """(path -> value) of every non-array persistent (BatchNorm's counter ``N``...)."""
        if not self.persistents:   # (the master's every update, for the Step)
            return {}
        types = chainer.get_array_types()
        return {key: value for key, value in self.named_persistents()
                if not isinstance(value, types)}

    def set_persistent_scalars(self, values: Mapping[str, Any]) -> None:
        """Set each persistent of ``values`` (paths as :meth:`persistent_scalars` gives)."""
        for key, value in values.items():
            path, _, name = key.rpartition('/')
            owner = self._owners.get(path or '/')
            if owner is None:   # a link with no persistent when indexed: find it
                owner = dict(self.link.namedlinks())[path or '/']
            set_persistent(owner, name, value)

    def state_arrays(self) -> Dict[str, Any]:
        arrays = self.param_arrays()
        arrays.update(self.persistent_arrays())
        return arrays


class KeptPersistents:
    """The model's persistents as :class:`ModelIndex` reads them now, kept to be set back:
    a copy of each array (BatchNorm's running statistics) and each other value (its
    counter ``N``; a list, dict or set as a shallow copy), what a window's forwards move
    besides the gradients."""

    def __init__(self, index: ModelIndex) -> None:
        self.index = index
        self.arrays = {path: array.copy() for path, array in index.persistent_arrays()}
        self.scalars = {path: _copied(value)
                        for path, value in index.persistent_scalars().items()}

    def restore(self) -> None:
        """Set every persistent back to what it was (an array in place; may be called
        again). One that was None is None again: a lazy link whose first call made it
        (``L.BatchNormalization()``'s statistics) makes it anew at its next call, with
        the parameters it initialises alongside, as at a first call."""
        for path, array in self.index.persistent_arrays():
            kept = self.arrays.get(path)
            if kept is not None and kept.shape == array.shape:
                array[...] = kept
        self.index.set_persistent_scalars({
            path: _copied(value) for path, value in self.scalars.items()})


def _copied(value: Any) -> Any:
    return copy.copy(value) if isinstance(value, (list, dict, set)) else value


def overlapping(index: 'ModelIndex') -> List[str]:
    """Parameters (by name) whose numpy array shares memory with another parameter's, an
    array persistent's or an array a link holds in a plain attribute, other than the very
    array an alias holds (:attr:`ModelIndex.aliases`): a view (``b.W.array =
    a.W.array.T``), a persistent that holds a parameter's array, parameters that are
    views of one flat array the model keeps (``self.flat``); and the aliases of those.
    Bound to a slice of the broadcast slot of its own, such a parameter would no longer
    share that memory; left as it is, its values are copied into the slot each update and
    the sharing stays."""
    arrays = [(n, a) for n, a in index.param_arrays().items() if n not in index.aliases]
    arrays += index.persistent_arrays()
    arrays += _held_arrays(index.link)
    spans = []
    for name, array in arrays:
        if isinstance(array, numpy.ndarray) and array.size:
            low, high = _byte_bounds(array)
            spans.append((low, high, name, array))
    spans.sort(key=lambda span: span[0])
    params = set(index.param_arrays())
    out = set()
    for i, (low, high, name, array) in enumerate(spans):
        for low2, _, other, array2 in spans[i + 1:]:
            if low2 >= high:
                break
            if array2 is array or numpy.shares_memory(array, array2):
                out.update(n for n in (name, other) if n in params)
    # an alias holds the very array of one left unbound: bound, it would take that one's
    # array with it (Chainer's share mode: one storage) or part from it
    out.update(alias for alias, held in index.aliases.items() if held in out)
    return sorted(out)


def _held_arrays(link: chainer.Link) -> List[Tuple[str, Any]]:
    """The numpy arrays the links of ``link`` hold in plain attributes (``link.__dict__``;
    a persistent's array is one too), by path."""
    return [(f'{path.rstrip("/")}/{name}', value) for path, sub in link.namedlinks()
            for name, value in vars(sub).items() if type(value) is numpy.ndarray]


def _byte_bounds(array: numpy.ndarray) -> Tuple[int, int]:
    bounds = getattr(numpy, 'byte_bounds', None)
    if bounds is None:   # numpy 2 moved it
        from numpy.lib.array_utils import byte_bounds as bounds
    low, high = bounds(array)
    return int(low), int(high)


def unique_params(link: chainer.Link) -> List[Tuple[str, chainer.Parameter]]:
    """``link.namedparams()`` with each :class:`chainer.Parameter` once, under the first
    name Chainer gives it: a parameter registered in several links (tied weights,
    ``self.l3.W = self.l2.W``) is one array with one gradient, packed, summed and sent
    once. Every rank walks its replica alike, so every rank keeps the same name."""
    seen = set()
    out = []
    for name, param in link.namedparams():
        if id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def initialized_params(link: chainer.Link) -> List[Tuple[str, chainer.Parameter]]:
    """:func:`unique_params` that hold an array: what the replicas share. A parameter of
    a lazy link no forward has called (``L.Linear(None, n)`` that a model registers and
    never uses) has none, and no gradient, as under ``StandardUpdater``; the window of
    each replica refuses one that a call initialises after the replicas were copied."""
    return [(name, p) for name, p in unique_params(link) if p.array is not None]


# The same, walking the link anew (callers with no index at hand).
def param_arrays(link: chainer.Link) -> Dict[str, Any]:
    return ModelIndex(link).param_arrays()


def grad_arrays(link: chainer.Link) -> Dict[str, Any]:
    return ModelIndex(link).grad_arrays()


def state_arrays(link: chainer.Link) -> Dict[str, Any]:
    return ModelIndex(link).state_arrays()


def persistent_arrays(link: chainer.Link) -> List[Tuple[str, Any]]:
    return ModelIndex(link).persistent_arrays()


def persistent_scalars(link: chainer.Link) -> Dict[str, Any]:
    return ModelIndex(link).persistent_scalars()


def set_persistent_scalars(link: chainer.Link, values: Mapping[str, Any]) -> None:
    ModelIndex(link).set_persistent_scalars(values)

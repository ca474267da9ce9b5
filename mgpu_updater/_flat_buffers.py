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

from ._chainer_private import named_persistents, set_persistent


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
                    dst[...] = src.reshape(-1)
                else:
                    # one fused multiply-copy; 'unsafe' keeps float16 as float16
                    _xp(dst).multiply(src.reshape(-1), scale, out=dst, casting='unsafe')

    def unpack(self, buffer: Callable[[str], Any], arrays: Mapping[str, Any],
               scale: Optional[float] = None, skip: Collection[str] = ()) -> None:
        """Copy each slice back into the existing arrays, in place (but those in ``skip``)."""
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


def persistent_arrays(link: chainer.Link) -> List[Tuple[str, Any]]:
    """(path, array) of every array persistent (BatchNorm's running mean, var...)."""
    return [(key, value) for key, value in named_persistents(link)
            if isinstance(value, chainer.get_array_types()) and value is not None]


def persistent_scalars(link: chainer.Link) -> Dict[str, Any]:
    """(path -> value) of every non-array persistent (BatchNorm's counter ``N``...)."""
    return {key: value for key, value in named_persistents(link)
            if not isinstance(value, chainer.get_array_types())}


def set_persistent_scalars(link: chainer.Link, values: Mapping[str, Any]) -> None:
    links = dict(link.namedlinks())
    for key, value in values.items():
        path, _, name = key.rpartition('/')
        set_persistent(links[path or '/'], name, value)


class ModelLayouts:
    """The three layouts of one model.

    - ``grad``: every parameter's gradient (reduced, summed, onto the master);
    - ``stat``: float array persistents (reduced with weight 1/N: averaged);
    - ``state``: every parameter and array persistent (broadcast from the master; its
      buffers keep the wire name ``param/<dtype>``).
    """

    def __init__(self, link: chainer.Link, double_buffered: bool = False) -> None:
        params = [(name, p.array) for name, p in link.namedparams()]
        missing = [name for name, a in params if a is None]
        if missing:
            raise RuntimeError(f'parameters {missing} are not initialised yet')
        persist = persistent_arrays(link)
        self.grad = FlatLayout('grad', params)
        self.stat = FlatLayout('stat', [(n, a) for n, a in persist
                                        if numpy.dtype(a.dtype).kind == 'f'])
        self.state = FlatLayout('param', params + persist)
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


def param_arrays(link: chainer.Link) -> Dict[str, Any]:
    return {name: p.array for name, p in link.namedparams()}


def grad_arrays(link: chainer.Link) -> Dict[str, Any]:
    return {name: p.grad for name, p in link.namedparams()}


def state_arrays(link: chainer.Link) -> Dict[str, Any]:
    arrays = param_arrays(link)
    arrays.update(persistent_arrays(link))
    return arrays

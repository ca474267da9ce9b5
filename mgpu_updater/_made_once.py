"""Arrays a forward made once and keeps in a plain attribute: the same in every replica?

A forward that draws a value at its first call and keeps it (``self.proj =
numpy.random.randn(...)`` once the input size is known, a mask, a random projection), or a
``__setstate__`` that draws one anew when the model is unpickled, leaves each replica
with its own: each process draws from its own seed. The replicas then compute with
different models and train apart from ``StandardUpdater``'s one model (0.15 off in three
updates in one such run), and no parameter or persistent shows it.

Each replica of several (:class:`Seen`) looks at the arrays its links hold in plain
attributes (not parameters, child links or persistents; an array, or a Variable that is
not a parameter) after each of its first :data:`WINDOWS` windows that ran a micro-batch.
One that is the same object after each, with the same contents after the last two, was
made once: what a forward stores anew at each call (``L.Classifier``'s ``y``) is another
object each time, and what it changes in place from its own samples (a recurrent state
kept per sample, a memory bank) changes, both each replica's own, as documented. It sends
a digest of each with that window's result
(:attr:`~mgpu_updater._replica.WindowResult.made_once`), and the master
(:class:`Compared`) warns, once, naming every attribute whose contents differ from its
own where dtype and shape are the same (a cache each replica sizes to the longest input
it saw is not made alike). Nothing is looked at after that: the first windows of each
replica cost it one walk of its links each and two reads of such arrays (sampled, where
large).
"""
from __future__ import annotations

import hashlib
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy
import chainer

from ._warning import warn

#: the elements of one array that a digest reads, at most (evenly spaced)
SAMPLE = 1 << 20


def _array_of(value: Any) -> Any:
    """The array a plain attribute holds (itself, or a non-parameter Variable's), or None."""
    if isinstance(value, chainer.Variable):
        if isinstance(value, chainer.Parameter):
            return None
        value = value.array
    return value if isinstance(value, chainer.get_array_types()) else None


#: the windows that ran a micro-batch a replica looks over (see the module's docstring)
WINDOWS = 3


def digest(array: Any) -> Optional[Tuple[str, str]]:
    """``(dtype and shape, a hash of the elements)``, at most :data:`SAMPLE` of them,
    evenly spaced; None for an array of Python objects (no bytes to hash)."""
    if array.dtype.hasobject:
        return None
    flat = array.reshape(-1)
    if flat.size > SAMPLE:
        flat = flat[::-(-flat.size // SAMPLE)]
    data = numpy.ascontiguousarray(chainer.backend.CpuDevice().send(flat))
    return (f'{numpy.dtype(array.dtype).str}{tuple(array.shape)}',
            hashlib.blake2b(data.view(numpy.uint8), digest_size=16).hexdigest())


class Seen:
    """One replica's look at what its links hold, over its first :data:`WINDOWS` windows.

    ``links``: called for ``(path, link, plain attributes)`` of the model's links, as
    :func:`mgpu_updater._replica.kept_between_calls` gives them; ``params``: called for
    the model's parameters. An array that holds a parameter's memory (a flat array whose
    views the parameters are) is the parameters' storage, not something a forward made:
    it is left out (:mod:`mgpu_updater._unsent_state` watches it between updates)."""

    def __init__(self, links: Callable[[], List[Any]],
                 params: Callable[[], List[chainer.Parameter]]) -> None:
        self._links = links
        self._params = params
        self._windows = 0
        # what each window found so far: a reference to each value, and its digest
        self._refs: Dict[str, Callable[[], Any]] = {}
        self._digests: Dict[str, Tuple[str, str]] = {}

    def window_ended(self) -> Optional[Dict[str, Tuple[str, str]]]:
        """After a window that ran a micro-batch: None, until the last one looked at;
        then ``{path/name: digest}`` of the arrays made once (this replica is then done
        with it)."""
        self._windows += 1
        held = {}
        for path, _, values in self._links():
            for name, value in values.items():
                if _array_of(value) is not None:
                    held[f'{path.rstrip("/")}/{name}'] = value
        if self._windows == 1:
            # a weak reference where the value takes one (a Variable: held strongly it
            # would keep its graph's activations alive through the next window)
            self._refs = {key: _ref(value) for key, value in held.items()}
            return None
        kept = {key: _array_of(value) for key, value in held.items()
                if key in self._refs and self._refs[key]() is value}
        if self._windows == 2:
            storage = [p.array for p in self._params() if p.array is not None]
            kept = {key: array for key, array in kept.items()
                    if not _holds_any(array, storage)}
        digests = {key: d for key, d in ((key, digest(array)) for key, array in kept.items())
                   if d is not None}
        if self._windows < WINDOWS:
            self._refs = {key: self._refs[key] for key in digests}
            self._digests = digests
            return None
        out = {key: d for key, d in digests.items() if self._digests.get(key) == d}
        self._refs, self._digests = {}, {}
        return out


def _ref(value: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(value)
    except TypeError:   # one that takes none: held until the next window (no graph)
        return lambda: value


def _holds_any(array: Any, params: List[Any]) -> bool:
    """Whether ``array`` may share memory with one of the parameters' arrays."""
    xp = chainer.backend.get_array_module(array)
    return any(chainer.backend.get_array_module(p) is xp and xp.may_share_memory(array, p)
               for p in params)


class Compared:
    """The master's side: compares the replicas' digests with its own, warns once.

    ``names``: how the warning names each replica, in the order of the results."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)
        self._own: Optional[Dict[str, Tuple[str, str]]] = None
        # each replica's digests, as they came (kept until the master's own are in)
        self._theirs: Dict[int, Dict[str, Tuple[str, str]]] = {}
        self._waiting = set(range(1, len(self._names)))

    def take(self, results: Sequence[Any]) -> bool:
        """Look at one update's results (the master's first); True once every replica's
        digests were compared (the caller then drops this)."""
        if self._own is None:
            self._own = results[0].made_once
        for rank in self._waiting:
            theirs = results[rank].made_once if rank < len(results) else None
            if theirs is not None:
                self._theirs[rank] = theirs
        if self._own is None or len(self._theirs) < len(self._waiting):
            return False
        apart: Dict[str, List[int]] = {}
        for rank, theirs in sorted(self._theirs.items()):
            for key, (kind, value) in theirs.items():
                own = self._own.get(key)
                if own is not None and own[0] == kind and own[1] != value:
                    apart.setdefault(key, []).append(rank)
        if apart:
            self._warn(apart)
        return True

    def _warn(self, apart: Dict[str, List[int]]) -> None:
        where = '; '.join(
            f'{key} in {", ".join(self._names[r] for r in ranks)}'
            for key, ranks in sorted(apart.items()))
        warn('the replicas hold different arrays where their forward made one once and '
             f'kept it (other values than the master\'s: {where}). Where the forward reads '
             'it, each replica computes with its own, and the model trains apart from '
             'StandardUpdater\'s one model. '
             'Such an array is drawn at the first call from each process\'s own random '
             'stream (a projection or mask made once the input size is known), drawn '
             'anew by a __setstate__, or made from the replica\'s own first samples. Make '
             'it in __init__ (it then travels to every replica as it is), draw it from a '
             'generator the link holds, which every replica takes as it is, or make it '
             'from data that is the same on every replica. One the forward never reads (a '
             'copy kept for inspection) does no harm; see docs/semantics.md#seeds',
             RuntimeWarning, stacklevel=4)

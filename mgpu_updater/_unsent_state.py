"""What the workers' copies never receive: plain values of the model, ``loss_func`` and
the converter.

Each worker unpickles the model, the loss function and the converter once, when it starts;
after that every update sends it the parameters and the persistents, and nothing else. A
plain value that the master's copy holds and that changes during training stays on each
worker as it was: an attribute an extension anneals (``model.beta = ...``), a mask edited in
place, a value a ``loss_func`` closure reads (``state['beta']``, an optimizer's ``t``), a
converter's setting that a curriculum raises. The replicas then compute with different
values, where ``StandardUpdater``'s one model would see the change; nothing fails, the
training is just different.

:class:`UnsentState` makes that loud. It collects every plain value (numbers, strings,
None, numpy arrays, and the arrays of parameters of links outside the model: a teacher,
the other network of a GAN) reachable from them the way the workers' payload pickled them
(:func:`mgpu_updater._pickle_path.parts`), Variables that are no parameter by their
arrays (a mask; a forward's results, new Variables at every call, are the forward's),
leaving out what every update sends (the model's parameters, their arrays wherever else
they are held, and persistents), Chainer's own bookkeeping (the private
attributes of its classes: a link hook's scratch vectors; ``@static_graph``'s
schedules), Chainer's datasets and iterators, and what lies inside a container of more
than :data:`MAX_ITEMS` items (its length counts). It takes them after the master's first
window, then, now and then, at the start of an update, after its window and at the start
of the next: what the window changed is the forward's, which every replica does to its
own copy (a counter of calls), and is never named; what changed otherwise since the last
look changed between updates, and is named in a warning, once per value, with the fix (a
persistent of the model, which every update sends).

A walk when the watch is built, before the first window, and the first walk after it
find the sets whose order the workers do not share (:func:`unordered_set`): a set of strings, or of objects hashed by identity, iterates in
another order in each process (Python randomizes string hashes per process unless
``PYTHONHASHSEED`` is set), so a forward that iterates one runs otherwise on each worker:
named in a warning, once.

A walk costs milliseconds for a large model (5 ms for ResNet-50 on a 2-core VM); a check
is three of them, at updates 2 and 3 and then at most every :data:`INTERVAL` seconds and
at most :data:`COST_SHARE` of the time between checks; the other updates read a clock.
"""
from __future__ import annotations

import argparse
import copy
import enum
import itertools
import math
import os
import sys
import threading
import time
import types
import weakref
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import chainer
import numpy
from chainer.link_hooks import SpectralNormalization

from ._chainer_private import (CHAIN_LIST_LINKS, LINK_HOOKS, SEQUENTIAL_LAYERS,
                               is_static_graph_machinery, named_persistents, persistent_names)
from ._inherit import config_values
from ._pickle_path import parts
from ._warning import warn

INTERVAL = 10.0       # seconds between two checks, at least (a change stays: found later)
COST_SHARE = 0.01     # a walk takes at most this share of the time since the last one
MAX_NODES = 20000     # objects gone into per walk; the rest is not watched
MAX_DEPTH = 30
ARRAY_BYTES = 16 << 20   # numpy arrays copied per walk; beyond, compared by id, shape, dtype
#: the array of a Variable that is no parameter, up to this, is compared by a checksum of
#: its bytes, kept instead of a copy (a forward's results, ``L.Classifier``'s ``y``, take
#: none of the copies above); beyond, by identity
VARIABLE_BYTES = 64 << 20

_PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes))
_CONTAINERS = frozenset((list, tuple, dict, set, frozenset))
_NAMESPACES = frozenset((argparse.Namespace, types.SimpleNamespace))   # equal by their items
MAX_ITEMS = 1000      # a container with more items counts by its length only


class UnsentState:
    """The plain values of ``roots`` (name -> object: the master's model, its loss
    function) that the workers' copies do not receive, watched between updates.

    The updater calls :meth:`after_window` after each of the master's windows where
    :attr:`watching`, and :meth:`at_begin` at the start of each update where :meth:`due`.
    A check walks three times: at the start of an update M, after its window, and at the
    start of update M+1. A value the window M changed is the forward's (a counter of
    calls, each replica's own): never named. One that changed between window M and
    update M+1, or since the last check without window M changing it, changed between
    updates: named. The first check runs at once, at updates 2 and 3; then at most every
    :data:`INTERVAL` seconds; :meth:`finish`, when the updater is finalized, ends one in
    progress or looks once more."""

    def __init__(self, roots: Dict[str, Any], clock: Any = time.monotonic,
                 held: Optional['HeldObjects'] = None) -> None:
        self.roots = {name: obj for name, obj in roots.items() if obj is not None}
        #: the objects checked at every update (check_held), if any
        self.held = held
        self._clock = clock
        self._last: Optional[Dict[str, Any]] = None      # as the last check left it
        self._begun: Optional[Dict[str, Any]] = None     # at the start of update M
        self._windowed: Optional[Dict[str, Any]] = None  # after its window
        self._cost = 0.0
        self._next = -math.inf
        self._built: Optional[Dict[str, Any]] = None   # the structure the workers hold
        #: paths a window changes (the forward's), never named
        self.forward: set = set()
        #: paths already warned about (each is named once)
        self.named: List[str] = []
        #: paths of parameters of links outside the model (their own advice)
        self._parameter_paths: set = set()
        #: of the check in progress, the paths of numbers held as found at its start, and
        #: those its window wrote alike (_rewritten)
        self._begun_found: set = set()
        self._rewritten: set = set()
        #: Chainer's configuration as sent to the workers at their start (_inherit), as
        #: the thread that trains sees it (another one sees its own)
        self._config = _copied(config_values())
        self._config_thread = threading.get_ident()
        #: updates begun (counted by due()), and how many of their windows the last look
        #: (_last) came after: a change after the last window reached no update
        self._updates = 0
        self._looked_after = 0
        # the sets the model holds from the start, named before the first window; those
        # its first forward makes, after it (after_window)
        self._unordered: List[str] = []
        self._walk(self._unordered)
        if self._unordered:
            warn(_unordered_message(self._unordered), RuntimeWarning, stacklevel=4)

    def check_held(self) -> None:
        """:meth:`HeldObjects.check`; what it raises about is not warned about again by
        the next look."""
        if self.held is None:
            return
        try:
            self.held.check()
        except RuntimeError:
            if self._built is not None:
                self._built = _structure(self.roots)
            raise

    @property
    def watching(self) -> bool:
        """Whether the next window's end is walked (the first, or a check's)."""
        return self._last is None or (self._begun is not None and self._windowed is None)

    def due(self) -> bool:
        """Whether the start of this update is walked (a clock read at most); asked at
        the start of every update."""
        self._updates += 1
        return self._last is not None and (self._begun is not None
                                           or self._clock() >= self._next)

    def after_window(self) -> None:
        if self._last is None:   # the first: what every replica holds from now on
            unordered: List[str] = []
            self._last, self._cost = self._walk(unordered)
            self._looked_after = self._updates
            self._built = _structure(self.roots)
            made = [path for path in unordered if path not in self._unordered]
            if made:
                warn(_unordered_message(made), RuntimeWarning, stacklevel=4)
        else:
            found: set = set()
            self._windowed, cost = self._walk(as_found=found)
            self._cost += cost
            # now, while what the window left is held (a Variable is held weakly)
            self._rewritten = _rewritten(self._begun or {}, self._windowed,
                                         self._begun_found & found)

    def at_begin(self) -> None:
        if self._begun is None or self._windowed is None:
            self._begun_found, self._rewritten = set(), set()
            # (again, if no window ran since)
            self._begun, self._cost = self._walk(as_found=self._begun_found)
            self._windowed = None
            return
        self._conclude(stacklevel=4)

    def finish(self) -> None:
        """The updater is finalized: end the check in progress, or look once more (a value
        the forward changes is then told apart only if an earlier check saw it), where a
        window ran since the last look."""
        if self._last is None:
            return
        if self._begun is None or self._windowed is None:
            self._begun = self._windowed = None
            if self._updates == self._looked_after:
                # no window since the last look, which came after the last one: what
                # changed since reached no update (an Evaluator's forward after the
                # first, L.Classifier's y; an extension's value set after the last)
                return
            now, _ = self._walk()
            self._report(self._changed(self._last, now), 'during training', stacklevel=4)
            self._check_structure('during training', stacklevel=4, fail=False)
            self._check_config('during training', stacklevel=4)
            return
        self._conclude('during training', stacklevel=4, fail=False)

    def _conclude(self, when: str = 'between updates', stacklevel: int = 3,
                  fail: bool = True) -> None:
        self._check_structure(when, stacklevel + 1, fail)
        self._check_config(when, stacklevel + 1)
        now, cost = self._walk()
        last, begun, windowed = self._last, self._begun, self._windowed
        self.forward.update(self._changed(begun, windowed))   # left out of both below
        self.forward.update(self._rewritten)   # (written alike by the window)
        changed = dict(self._changed(last, begun))
        changed.update(self._changed(windowed, now))
        self._last, self._begun, self._windowed = now, None, None
        self._looked_after = self._updates - 1   # at an update's start: its window to come
        self._next = self._clock() + max(INTERVAL, (self._cost + cost) / COST_SHARE)
        self._report({p: (last.get(p, v[0]), now.get(p, v[1])) for p, v in changed.items()},
                     when, stacklevel)

    def _check_structure(self, when: str, stacklevel: int, fail: bool) -> None:
        """The links' parameters, persistents and link hooks, against what the workers'
        replicas were built with: they follow none of it. A parameter or persistent added,
        removed or reshaped raises (``fail``; else a warning): its gradient or value would
        not be the replicas'. A link hook added or removed is warned about, once: the
        replicas compute without it (or with it), which a hook that only looks (a timer)
        does not mind."""
        if self._built is None:
            return
        now = _structure(self.roots)
        built, self._built = self._built, now
        layout = _differences(built, now, 'layout')
        if layout:
            message = (f"the model's parameters or persistents changed {when}: {layout}. The "
                       "worker processes' replicas, and the buffers that carry parameters, "
                       'gradients and persistents between them, keep those they were built '
                       'with; change the model before the first update, or finalize this '
                       'updater and build a new one after the change')
            if fail:
                raise RuntimeError(message)
            warn(message, RuntimeWarning, stacklevel=stacklevel)
        hooks = _differences(built, now, 'hooks')
        if hooks:
            warn(
                f'link hooks of the master\'s model changed {when}: {hooks}. The worker '
                "processes' replicas keep the hooks they were built with, so they compute "
                'otherwise where a hook changes the forward (WeightStandardization, '
                'SpectralNormalization); add link hooks before the first update, or '
                'finalize this updater and build a new one after the change',
                RuntimeWarning, stacklevel=stacklevel)

    def _check_config(self, when: str, stacklevel: int) -> None:
        """Chainer's configuration entries, against what the workers took at their start:
        one changed since is warned about, once (an extension that sets
        ``chainer.config.train`` or an entry a forward reads)."""
        message = self._config_message(when)
        if message is not None:
            warn(message, RuntimeWarning, stacklevel=stacklevel)

    def config_note(self) -> Optional[str]:
        """For an update that failed: Chainer's configuration entries changed since the
        workers' start and not yet named (the warning that would have said so comes at a
        look, and not while an exception is on its way), or None."""
        return self._config_message('during training')

    def _config_message(self, when: str) -> Optional[str]:
        if threading.get_ident() != self._config_thread:
            return None   # (a finalize() from another thread: its configuration is its own)
        now = config_values()
        sent = self._config
        changed = [(name, sent.get(name, _UNSET), now.get(name, _UNSET))
                   for name in sorted(set(sent) | set(now))
                   if not _same(sent.get(name, _UNSET), now.get(name, _UNSET))
                   and 'chainer.config.' + name not in self.named]
        if not changed:
            return None
        self.named.extend('chainer.config.' + name for name, _, _ in changed)   # once
        listed = '; '.join(f'{name}: {_short(old)} -> {_short(new)}'
                           for name, old, new in changed[:5])
        more = f' (and {len(changed) - 5} more)' if len(changed) > 5 else ''
        return (
            f'chainer.config changed {when}: {listed}{more}. The worker processes took the '
            "master's configuration once, at their start, and compute with it as it was "
            'then. Set the configuration before the first update, or finalize this '
            'updater and build a new one after the change (a value an extension sets '
            'for itself with chainer.using_config is back before the next update: fine)')

    def _changed(self, before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
        """path -> (before, after) of the values that differ (both there, not named)."""
        named = self.named
        return {path: (before[path], value) for path, value in after.items()
                if path in before and path not in named and path not in self.forward
                and not _same(before[path], value)}

    def _report(self, changed: Dict[str, Any], when: str, stacklevel: int) -> None:
        if changed:
            self.named.extend(changed)
            listed = [(path, old, new) for path, (old, new) in changed.items()]
            message = _message(listed, when)
            if any(path in self._parameter_paths for path in changed):
                message += (
                    ' A parameter of a link outside the model is such a value too. A '
                    'teacher that no optimizer trains (an extension moves it): make it a '
                    'child of the model, with disable_update(), so that every update '
                    'sends it. The other network of a GAN, which another optimizer '
                    'trains: disable_update() would stop that optimizer too (a parameter '
                    'has one update rule), so train such a loop with one replica, or '
                    "with ChainerMN's create_multi_node_optimizer for each network")
            warn(message, RuntimeWarning, stacklevel=stacklevel)

    def _walk(self, unordered: Optional[List[str]] = None,
              as_found: Optional[set] = None) -> Tuple[Dict[str, Any], float]:
        """path -> value of every plain value reachable; the paths of the sets
        :func:`unordered_set` finds appended to ``unordered``, and those of the numbers
        :func:`_rewritten` can tell by identity (held as found, not made by the walk
        from a numpy scalar) added to ``as_found``, where given."""
        start = time.perf_counter()
        out: Dict[str, Any] = {}
        sent = _sent_every_update(self.roots)   # ids of the persistents' values
        seen: set = set()
        budget = [ARRAY_BYTES]
        stack: List[Tuple[str, Any, int]] = [(name, obj, 0)
                                            for name, obj in reversed(self.roots.items())]
        nodes = 0
        held: List[str] = []   # paths of the _Held values
        while stack and nodes < MAX_NODES:
            path, obj, depth = stack.pop()
            kind = type(obj)
            if kind in _PLAIN:
                out[path] = obj
                if as_found is not None and kind in _MADE_ANEW:
                    as_found.add(path)
                continue
            if id(obj) in sent:
                continue
            if isinstance(obj, chainer.Variable):
                array = obj.array
                if array is None or id(array) in sent:
                    continue   # the model's parameter, sent every update (or none yet)
                if isinstance(obj, chainer.Parameter):
                    # a parameter of a link outside the model (a teacher, the other
                    # network of a GAN): no update sends it
                    self._parameter_paths.add(path)
                    out[path] = _array_value(array, budget) \
                        if type(array) is numpy.ndarray else _device_array(array)
                else:
                    # a mask or a constant held as a Variable; a forward's result (L.
                    # Classifier's self.y) is a new Variable at every write (_rewritten)
                    out[path] = _Held(weakref.ref(obj), _digest(array))
                    held.append(path)
                continue
            if kind is numpy.ndarray:
                # a mask an extension edits, or one the forward makes anew (_rewritten)
                out[path] = _Held(weakref.ref(obj), _array_value(obj, budget))
                held.append(path)
                continue
            if isinstance(obj, numpy.generic):
                out[path] = obj.item()
                continue
            if isinstance(obj, chainer.get_array_types()):   # on a device: not read here
                out[path] = _device_array(obj)
                continue
            if id(obj) in seen or depth >= MAX_DEPTH:
                continue
            if _is_data(obj):
                continue   # a dataset a closure holds is no value a forward reads
            if is_static_graph_machinery(kind):
                continue   # each replica's own schedules, built by its own forward
            if unordered is not None and kind in (set, frozenset) and unordered_set(obj):
                unordered.append(path)
            if kind in _CONTAINERS and len(obj) > MAX_ITEMS:
                out[path] = (kind.__name__, len(obj))   # too many to look into each time
                continue
            seen.add(id(obj))
            nodes += 1
            # a link's persistents are sent every update; Chainer's own bookkeeping is no
            # value a forward reads from the user
            names = frozenset()
            if isinstance(obj, chainer.Link):   # a ChainList's links are its _children
                names = (_LINK_INTERNALS - _CHAIN_LIST_LINKS if isinstance(
                    obj, chainer.ChainList) else _LINK_INTERNALS) | persistent_names(obj)
            elif isinstance(obj, SpectralNormalization):
                names = _SPECTRAL_NORM_SCRATCH
            private = _of_chainer(kind)
            found = []
            try:
                for label, part in parts(obj):
                    if label[1:] in names or (private and label.startswith('._')
                                              and label not in _WALKED_PRIVATE):
                        continue
                    found.append((path + label, part, depth + 1))
            except Exception:  # noqa: BLE001 - what cannot be taken apart is not watched
                continue
            stack.extend(reversed(found))
        if as_found is not None:
            # Of the _Held values, those something besides this walk holds: one the walk
            # made (an array a __getstate__ returns, a generator's state) is gone now,
            # and would read as written anew by every window (_rewritten)
            obj = part = None
            found, stack = [], []
            as_found.update(path for path in held if out[path].variable() is not None)
        return out, time.perf_counter() - start


_NUMBERS = (type(None), bool, int, float, complex, numpy.number)


def unordered_set(items: Any) -> bool:
    """Whether the set ``items`` may iterate in another order in another process: it has
    two items or more, and one whose hash is the process's own (a string, bytes or an
    enum member, unless this process and the workers hash with ``PYTHONHASHSEED=0``; an
    object hashed by identity, or by a hash of its own), also inside a tuple or frozenset;
    of a large set, its first :data:`MAX_ITEMS` items are looked at. (Numbers hash alike
    everywhere; a set of them that was once larger may still iterate otherwise once
    rebuilt, which is not looked for.)"""
    if len(items) < 2:
        return False
    seeded = sys.flags.hash_randomization == 0 and os.environ.get('PYTHONHASHSEED') == '0'
    return any(not _stable_hash(item, seeded, 0)
               for item in itertools.islice(items, MAX_ITEMS))


def _stable_hash(item: Any, seeded: bool, depth: int) -> bool:
    if isinstance(item, _NUMBERS):
        return True
    if type(item) in (tuple, frozenset):
        return depth >= MAX_DEPTH or all(_stable_hash(part, seeded, depth + 1)
                                         for part in itertools.islice(item, MAX_ITEMS))
    if isinstance(item, (str, bytes)) or (isinstance(item, enum.Enum)
                                          and type(item).__hash__ is enum.Enum.__hash__):
        return seeded
    return False


def _unordered_message(paths: List[str]) -> str:
    listed = ', '.join(paths[:5]) + (f' (and {len(paths) - 5} more)' if len(paths) > 5 else '')
    return (f'{listed}: a set that each process iterates in its own order (the order of '
            "strings' hashes is the process's own unless PYTHONHASHSEED=0, that of "
            "objects hashed by identity always): a forward that iterates it (for x in ...) "
            'runs in another order on each worker than on the master. Iterate a list, or '
            'sorted(...), instead; for strings, PYTHONHASHSEED=0 in the environment before '
            'Python starts does too. A set only tested for membership is fine')


#: what Chainer's Link, Chain and ChainList keep of their own (their parameters and
#: children are walked as what they are); their link hooks are walked (a user's hook
#: holds values its forward reads; Chainer's own hooks' private scratch values are not)
_LINK_INTERNALS = frozenset(
    set(vars(chainer.Chain())) | set(vars(chainer.ChainList()))
    | {'_device'}) - {LINK_HOOKS}

#: what ``SpectralNormalization`` writes at every call, an Evaluator's in test mode too,
#: and reads back only while recomputing that call (``F.forget``): its vector ``v``
#: (chainer/link_hooks/spectral_normalization.py:265, 274); its ``u`` is a persistent
_SPECTRAL_NORM_SCRATCH = frozenset({'v'})

#: Chainer's private attributes that hold the user's objects, walked as theirs: a link's
#: hooks, a ``chainer.ChainList``'s links (a ``Chain``'s are its attributes; its
#: ``_children`` is a set of their names), and what a ``chainer.Sequential`` calls between
#: its links (a callable object with a value an extension anneals is the model's value
#: as much as a link's attribute)
_WALKED_PRIVATE = frozenset('.' + name for name in (LINK_HOOKS, CHAIN_LIST_LINKS,
                                                     SEQUENTIAL_LAYERS))
_CHAIN_LIST_LINKS = frozenset({CHAIN_LIST_LINKS})


class HeldObjects:
    """What the workers' replicas were built from, by identity, checked at the start of
    an update where the caller asks: each parameter object of the master's model (a walk
    of them: 3 us for a 3-layer MLP, 70 us for ResNet-50 on a 2-core VM), and each
    worker's iterator's dataset and batch size as the master holds them.

    A parameter replaced by a new object (``link.W = chainer.Parameter(...)``, a child
    link built anew, then ``optimizer.setup``) is one the worker replicas and the buffers
    that carry parameters to them never see: the workers would go on with the old one's
    values. A worker's iterator object the user holds is not the one its process reads.
    Either raises :class:`RuntimeError`, naming what changed, before the update runs."""

    def __init__(self, model: chainer.Link, worker_iterators: List[Any]) -> None:
        self.model = model
        self._named = list(model.namedparams())   # kept: their ids stay theirs
        self._ids = tuple(id(param) for _, param in self._named)
        self.iterators = list(worker_iterators)
        self._iterating = _iterating(self.iterators)

    def check(self) -> None:
        """Raise if a parameter object or a worker's iterator changed."""
        if tuple(map(id, self.model.params())) != self._ids:
            raise RuntimeError(self._params_message())
        for it, (dataset, batch_size) in zip(self.iterators, self._iterating):
            if getattr(it, 'dataset', None) is not dataset or \
                    getattr(it, 'batch_size', None) != batch_size:
                raise RuntimeError(self._iterators_message())

    def _params_message(self) -> str:
        before = {name: param for name, param in self._named}
        now = dict(self.model.namedparams())
        replaced = sorted(n for n in set(before) & set(now) if before[n] is not now[n])
        added, removed = sorted(set(now) - set(before)), sorted(set(before) - set(now))
        parts = [f'{label} {_few(names)}' for label, names in (
            ('replaced by new Parameter objects:', replaced), ('added:', added),
            ('removed:', removed)) if names]
        return (f"parameters of the master's model changed between updates ("
                f"{'; '.join(parts) or 'their order'}). The worker processes' replicas, "
                'and the buffers that carry parameters to them, keep the ones they were '
                'built with, so the replicas would train apart. Give the parameters the '
                'model has new values instead (link.W.array[...] = value, '
                'link.W.copydata(other), model.copyparams(other), '
                'chainer.serializers.load_npz(path, model)), or finalize this updater and '
                'build a new one after the change')

    def _iterators_message(self) -> str:
        changes = []
        for rank, (it, (dataset, batch_size)) in enumerate(
                zip(self.iterators, self._iterating), start=1):
            if getattr(it, 'dataset', None) is not dataset:
                changes.append(f'the dataset of iterator {rank}')
            now = getattr(it, 'batch_size', None)
            if now != batch_size:
                changes.append(f'the batch_size of iterator {rank} ({batch_size} -> {now})')
        return (f"{', '.join(changes)} changed between updates. Replica i > 0 reads its "
                'own copy of iterator i in its worker process, which this change does '
                'not reach (the master reads the main iterator itself). Set datasets and '
                'batch sizes before the first update, or take a snapshot, finalize this '
                'updater and build a new one with the changed iterators')


def _iterating(iterators: List[Any]) -> List[Tuple[Any, Any]]:
    """Each iterator's dataset (the object, kept) and batch size."""
    return [(getattr(it, 'dataset', None), getattr(it, 'batch_size', None))
            for it in iterators]


def _few(names: List[str]) -> str:
    return ', '.join(names[:5]) + (f' (and {len(names) - 5} more)' if len(names) > 5 else '')


def _structure(roots: Dict[str, Any]) -> Dict[str, Any]:
    """Of every root that is a link: ``layout``, its parameters (path, shape) and
    persistents (path), and ``hooks``, its links' link hooks (link path, hook name)."""
    layout, hooks = set(), set()
    for root, link in roots.items():
        if not isinstance(link, chainer.Link):
            continue
        for path, param in link.namedparams():
            shape = None if param.array is None else tuple(param.shape)
            layout.add((f'{root}{path}', shape))
        layout.update((f'{root}{path}', 'persistent') for path, _ in named_persistents(link))
        for path, sub in link.namedlinks():
            hooks.update((f'{root}{path}', name) for name in sub.local_link_hooks)
    return {'layout': layout, 'hooks': hooks}


def _differences(built: Dict[str, Any], now: Dict[str, Any], key: str) -> str:
    """What was added to, removed from and (a parameter of another shape) reshaped in
    ``built[key]``, in words ('' where nothing)."""
    def listed(names: List[str]) -> str:
        names = sorted(names)
        return ', '.join(names[:5]) + (f' (and {len(names) - 5} more)' if len(names) > 5 else '')

    def named(items: set) -> List[str]:
        return [f'{a} {b!r}' if key == 'hooks' else (a if b == 'persistent' else f'{a} {b}')
                for a, b in items]
    added, removed = now[key] - built[key], built[key] - now[key]
    reshaped = []
    if key == 'layout':
        before = {path: shape for path, shape in removed if shape != 'persistent'}
        for path, shape in sorted(added):
            if path in before and shape != 'persistent':
                reshaped.append(f'{path} {before[path]} -> {shape}')
                added = added - {(path, shape)}
                removed = removed - {(path, before[path])}
    words = ([f'reshaped {listed(reshaped)}'] if reshaped else []) + \
        ([f'added {listed(named(added))}'] if added else []) + \
        ([f'removed {listed(named(removed))}'] if removed else [])
    return '; '.join(words)


def _is_data(obj: Any) -> bool:
    """A Chainer dataset or iterator (the iterators travel on their own)."""
    return isinstance(obj, (chainer.dataset.DatasetMixin, chainer.dataset.Iterator)) or \
        type(obj).__module__.startswith('chainer.datasets')


def _of_chainer(kind: type) -> bool:
    """Whether ``kind`` is Chainer's own (its private attributes are its bookkeeping:
    a link hook's scratch vectors, an optimizer's hook table)."""
    module = getattr(kind, '__module__', '') or ''
    return module == 'chainer' or module.startswith('chainer.')


def _sent_every_update(roots: Dict[str, Any]) -> set:
    """ids of what every update sends or makes on every replica: the persistents' values
    of every link reached from a root that is a link, and its parameters' arrays and
    gradients (the Variables are left out anyway; these arrays may be held elsewhere too,
    as ``@static_graph``'s schedules hold them)."""
    out = set()
    for obj in roots.values():
        if isinstance(obj, chainer.Link):
            for _, value in named_persistents(obj):
                if value is not None and type(value) not in _PLAIN:
                    out.add(id(value))
            for param in obj.params():
                if param.array is not None:   # (an uninitialised one has no gradient to read)
                    out.update(id(a) for a in (param.array, param.grad) if a is not None)
    return out


def _device_array(array: Any) -> Tuple[Any, ...]:
    """An array not read here (on a device, or beyond the walk's copies), by identity."""
    return ('array', id(array), tuple(array.shape), str(array.dtype))


def _digest(array: Any) -> Tuple[Any, ...]:
    """A Variable's array as a value: its shape, dtype and a checksum of its bytes (a
    numpy array of at most :data:`VARIABLE_BYTES`), else by identity."""
    if type(array) is not numpy.ndarray or array.nbytes > VARIABLE_BYTES \
            or array.dtype.hasobject:
        return _device_array(array)
    data = numpy.ascontiguousarray(array)
    return ('digest', tuple(array.shape), array.dtype.str,
            zlib.crc32(memoryview(data).cast('B')))


def _array_value(array: numpy.ndarray, budget: List[int]) -> Any:
    if array.nbytes <= budget[0]:
        budget[0] -= array.nbytes
        return array.copy()
    return _device_array(array)


_MADE_ANEW = (float, complex)   # a new object at every write, whatever its value


class _Held(NamedTuple):
    """A Variable that is not a parameter, or a numpy array, as a watched value: its
    value, and the object itself (weakly: a forward's result holds its graph), which a
    forward that keeps what it makes (``self.y = h``, ``self.mask = xp.ones(...)``) makes
    anew at every call (:func:`_rewritten`; an id would not tell, as CPython gives a new
    object the address of one just freed)."""
    variable: Any   # weakref.ref
    value: Any


def _rewritten(before: Dict[str, Any], after: Dict[str, Any], found: set) -> set:
    """Paths whose value the window wrote anew, equal or not: a metric a forward keeps as
    a float (chainer-chemistry's ``Classifier``: ``self.metrics = {'accuracy': ...}``), or
    an array it keeps (pooling indices, a mask of ones the size of the batch) is a new
    object at each write, where a value nothing writes stays the same object; one that
    kept its value through the window watched would be named at its next change (an
    ``Evaluator`` calls the forward between updates, on batches of its own size). Only the
    ``found`` paths, whose values both walks held as they found them (a numpy scalar is
    read anew each walk)."""
    return {path for path in found
            if path in before and path in after and _written(before[path], after[path])}


def _written(before: Any, after: Any) -> bool:
    if type(before) is _Held and type(after) is _Held:
        held = before.variable()
        return held is None or held is not after.variable()
    return before is not after


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is _Held:
        return _same(a.value, b.value)
    if type(a) is numpy.ndarray:
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            numpy.array_equal(a, b, equal_nan=a.dtype.kind in 'fc'))
    if type(a) is float and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, numpy.inexact) and numpy.isnan(a) and numpy.isnan(b):
        return True   # (numpy.float32('nan'))
    if type(a) is list or type(a) is tuple:   # item by item: arrays among them
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) in _NAMESPACES:
        return _same(vars(a), vars(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd __eq__: count it as the same
        return True


def _copied(values: Dict[str, Any]) -> Dict[str, Any]:
    """Configuration values, a small container, numpy array or namespace among them
    copied: one changed in place (``chainer.config.curriculum['scale'] = 3``,
    ``chainer.config.class_weight[:] = 3``, ``chainer.config.args.scale = 3`` with the
    script's ``argparse`` namespace) is then told apart."""
    out = {}
    for name, value in values.items():
        if not isinstance(value, _SCALARS) and _plain(value, 4, [MAX_ITEMS]):
            try:
                value = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - kept as it is: compared by equality
                pass
        out[name] = value
    return out


_SCALARS = (int, float, complex, str, bytes, type(None), numpy.generic)


def _plain(value: Any, depth: int, budget: List[int]) -> bool:
    """Whether ``value`` holds only numbers, strings, small arrays of numbers and
    containers or namespaces of those (``budget``: items, ``depth``: nesting, at most),
    so that a copy of it is the same (:func:`_same`) while it is unchanged. A copy of any
    other object (a class of the user's without ``__eq__``, a generator) differs from it
    at once: such a value is kept as it is, and compared with itself."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, _SCALARS):
        return True
    if type(value) is numpy.ndarray:
        return value.dtype.kind in 'biufcSU' and value.size <= MAX_ITEMS
    if depth == 0:
        return False
    if type(value) in _NAMESPACES:
        items: Any = vars(value).values()
    elif type(value) is dict:
        items = list(value) + list(value.values())
    elif type(value) in _CONTAINERS:
        items = value
    else:
        return False
    return all(_plain(item, depth - 1, budget) for item in items)


class _Unset:
    """Stands for a configuration entry that is not there."""

    def __repr__(self) -> str:
        return '(not set)'


_UNSET = _Unset()


def _short(value: Any) -> str:
    if type(value) is _Held:
        value = value.value
    if type(value) is numpy.ndarray:
        return f'an array {value.shape} {value.dtype}'
    if type(value) is tuple and value and value[0] == 'array':
        return f'an array {value[2]}'
    if type(value) is tuple and value and value[0] == 'digest':
        return f'an array {value[1]} {numpy.dtype(value[2]).name}'
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + '...'


def _message(changed: List[Tuple[str, Any, Any]], when: str) -> str:
    listed = '; '.join(f'{path}: {_short(old)} -> {_short(new)}'
                       for path, old, new in changed[:5])
    more = f' (and {len(changed) - 5} more)' if len(changed) > 5 else ''
    return (f'values held by the master\'s model, loss_func or converter changed {when}, '
            f'and the worker processes do not receive them: {listed}{more}. Each worker '
            'unpickled the model, loss_func and converter once, at its start; every update '
            'sends it only the parameters and the persistents, so its replica still holds '
            'what it started with (or what its own forward made of it). If the forward or '
            'the loss reads such a value (a coefficient an extension anneals, a mask), the '
            'replicas now compute with different values: keep it in a persistent of a link '
            'of the model (self.add_persistent(\'beta\', 0.0) in __init__, then '
            'model.beta = ...), which every update sends to every replica. (Named once per '
            'value.)')

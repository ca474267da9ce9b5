"""What a worker inherits from the master's process: Chainer's configuration and seeds.

A script configures and seeds the process it runs in (``chainer.global_config.dtype =
...``, ``chainer.set_debug(True)``, ``numpy.random.seed(0)``); under ``StandardUpdater``
that process computes every gradient. Workers are fresh processes (``spawn``), so each
would start from Chainer's defaults and from an OS-entropy random state: a seeded run with
dropout would differ from one run to the next, and a setting such as ``dtype`` would hold
on the master only. So the master sends them:

- its configuration as the thread that starts training sees it (``chainer.config``: the
  global entries and that thread's own, which ``chainer.set_debug`` and ``chainer.config.x
  = v`` set), every entry but those listed in ``_NOT_SENT``, applied to the worker's
  ``chainer.global_config`` before it unpickles its copies (``_local.worker.ProcessSetup``)
  and again after, in place of the worker's main thread's own entries of those names
  (what the script's module-level code set again there);
- one seed per worker, drawn from the master's own ``numpy.random`` global state, so the
  script's seed decides them and the master's stream advances the same way every run;
  each worker seeds ``numpy.random``, Python's ``random`` and, on a GPU, ``cupy.random``;
- numpy's floating-point error handling (``numpy.seterr``) as that thread has it, and the
  warning filters (``warnings.simplefilter('error')``): a division by zero that raises in
  the master raises in a worker too;
- the recursion limit (``sys.setrecursionlimit``, which a script of a tree-structured
  network raises in ``main()``: the workers failed with ``RecursionError`` where the
  master trained).

Not sent: the function and link hooks a ``with hook:`` registers, which Chainer keeps per
thread; the master's replica runs them, and :func:`warn_thread_hooks` says so.

A thread the package starts to run the user's code (the loader thread, which runs the
iterator, the dataset and the converter: ``_loader``) inherits from the thread that starts
it what a new thread does not see: that thread's own configuration entries and its numpy
error handling (:func:`thread_settings`).
"""
from __future__ import annotations

import random
import sys
import warnings
from typing import Any, Dict, List, NamedTuple

import numpy

import chainer

from ._chainer_private import config_entry_names, thread_config_entries, thread_link_hooks
from ._warning import warn

# Not sent: entries Chainer itself sets while it runs (chainer/__init__.py:219, :235-236;
# static graphs and recomputation), not settings of the user's; and keep_graph_on_report,
# which DumpGraph turns on for one iteration on the master (extensions/
# computational_graph.py:120-121, :149): only the master's reports reach extensions, so in
# a worker it would only keep graphs alive.
_NOT_SENT = frozenset({'schedule_func', 'in_recomputing', '_will_recompute',
                       'keep_graph_on_report'})


class _Mixed16:
    """Stands for ``chainer.mixed16`` in transit: Chainer tests it by identity
    (chainer/__init__.py:312), so the worker must get its own module's object back."""


def master_config() -> Dict[str, Any]:
    """The configuration entries the calling thread sees, to apply in a worker."""
    import cloudpickle
    entries: Dict[str, Any] = {}
    for name, value in sorted(config_values().items()):
        if value is chainer.mixed16:
            entries[name] = _Mixed16()
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling failure: not sent
            warn(f'chainer.config.{name} = {value!r} cannot be sent to the worker '
                 f'processes ({type(exc).__name__}: {exc}); each keeps what it has '
                 "for it: Chainer's default, what the script's modules set at their "
                 'import, or, for an entry of the script\'s own, none (reading it then '
                 'raises AttributeError). Set it to a picklable value to have it apply '
                 'there',
                 stacklevel=3)
            continue
        entries[name] = value
    return entries


class ProcessSettings(NamedTuple):
    """What else of the master's process a worker takes on (:func:`process_settings`)."""
    numpy_errors: Dict[str, str]   # numpy.geterr()
    warning_filters: List[Any]     # warnings.filters, those that can be sent
    recursion_limit: int           # sys.getrecursionlimit()


def process_settings() -> ProcessSettings:
    """numpy's error handling as the calling thread has it, the warning filters and the
    recursion limit."""
    import cloudpickle
    filters = []
    for entry in warnings.filters:
        try:
            cloudpickle.dumps(entry)
        except Exception as exc:  # noqa: BLE001 - any pickling failure: not sent
            warn(f'the warning filter {entry!r} cannot be sent to the worker '
                 f'processes ({type(exc).__name__}: {exc}); they go without it',
                 stacklevel=3)
            continue
        filters.append(entry)
    return ProcessSettings(numpy.geterr(), filters, sys.getrecursionlimit())


def apply_process_settings(settings: ProcessSettings) -> None:
    """Take on the master's :class:`ProcessSettings` in this (worker) process."""
    numpy.seterr(**settings.numpy_errors)
    sys.setrecursionlimit(settings.recursion_limit)
    warnings.filters[:] = settings.warning_filters
    warnings._filters_mutated()   # as warnings.simplefilter does after changing the list


def thread_settings() -> Any:
    """What the calling thread has of its own that a thread it starts would not see: its
    own configuration entries and numpy's error handling; for :func:`apply_thread_settings`
    in that thread."""
    return thread_config_entries(), numpy.geterr()


def apply_thread_settings(settings: Any) -> None:
    """In a new thread: what :func:`thread_settings` read in the thread that started it."""
    entries, numpy_errors = settings
    for name, value in entries.items():
        setattr(chainer.config, name, value)   # this thread's own, as there
    numpy.seterr(**numpy_errors)


def warn_thread_hooks(workers: int) -> None:
    """Warn where the calling thread has function or link hooks registered globally
    (``with TimerHook():`` around ``trainer.run()``): Chainer keeps them per thread, so
    they act in the master's replica only and no worker process runs them."""
    hooks = [f'function hook {name!r}' for name in chainer.get_function_hooks()]
    hooks += [f'link hook {name!r}' for name in thread_link_hooks()]
    if not hooks:
        return
    processes = 'worker process runs' if workers == 1 else f'{workers} worker processes run'
    warn(f"hooks registered in this thread (with hook: ...) act on the master's replica "
         f'only: {", ".join(hooks)}. Chainer keeps such hooks per thread, and the '
         f'{processes} none. A hook that only looks (TimerHook, PrintHook) '
         "sees the master's share of each update; one that changes the computation "
         "changes the master's replica alone, so the update is not StandardUpdater's. "
         'Add a link hook to the links of the model instead (link.add_hook(hook) for '
         'each link, before the first update: every replica runs it), or measure with '
         'one device', RuntimeWarning, stacklevel=4)


def config_values() -> Dict[str, Any]:
    """The entries :func:`master_config` sends, as the calling thread sees them now, as
    they are (what it sends, and what ``_unsent_state`` compares to tell a later change)."""
    return {name: getattr(chainer.config, name)
            for name in config_entry_names() - _NOT_SENT}


def apply_config(entries: Dict[str, Any]) -> None:
    """Set the master's entries on this (worker) process's ``chainer.global_config``, and
    drop the calling thread's own entries of those names: the script's module-level code,
    run again in the worker (its ``__main__`` and what it imports), sets them there
    (``chainer.config.x = 1.0``, ``chainer.set_debug(True)`` as defaults that ``main()``
    then changes), and they hid the master's values from the worker's training. Called
    before the worker unpickles its copies and again after (which imports the script's
    modules)."""
    own = thread_config_entries()
    for name, value in entries.items():
        setattr(chainer.global_config, name,
                chainer.mixed16 if isinstance(value, _Mixed16) else value)
        if name in own:
            delattr(chainer.config, name)


def draw_seeds(count: int) -> List[int]:
    """One seed per worker from the master's ``numpy.random`` global state, which is left
    as it was: the user seeds it for reproducible runs, and Chainer's default shuffling
    draws from it (``ShuffleOrderSampler()`` without a generator). A draw here moved every
    later shuffle of the master's iterator, away from StandardUpdater's, and, since a
    snapshot restores that state (:func:`mgpu_updater._checkpoint.serialize_order_rng`)
    and the workers start again after a load, a resumed run shuffled its next epoch
    differently from the run it resumed."""
    state = numpy.random.get_state()
    try:
        return [int(s) for s in
                numpy.random.randint(0, 2 ** 32, size=count, dtype=numpy.int64)]
    finally:
        numpy.random.set_state(state)


def seed_process(seed: int) -> None:
    """Seed this (worker) process's ``numpy.random`` and Python's ``random``."""
    numpy.random.seed(seed)
    random.seed(seed)


def seed_device(seed: int, device: Any) -> None:
    """Seed the device's generator too when it is a GPU (``cupy.random``)."""
    if isinstance(device, chainer.backend.GpuDevice):
        device.xp.random.seed(seed)

"""How many BLAS/OpenMP threads a replica uses, and on which cores its process runs.

Left alone, the BLAS of every replica process (OpenBLAS, MKL, BLIS, OpenMP) starts one
thread per core, so N replicas on C cores run N * C threads and slow each other down.
``blas_threads='auto'`` gives each replica ``max(1, C // N)`` instead, N being the replicas
on this host, unless the user set one of :data:`USER_VARIABLES`: then the libraries stay
as the user configured them. The number is decided once, in the master (or in each MPI
rank), and the workers receive it in their payload.

Where it is applied differs:

- a worker is a process of ours: it limits its libraries once, for its whole life
  (:func:`limit_process`);
- the master is the user's process: its libraries are limited only while it runs its own
  window of micro-batches (:class:`WindowLimit`), and are as the user left them
  everywhere else (the optimizer step, extensions, evaluation, after training); and only
  where that window computes on the host (:func:`master_window`).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from ._warning import warn

#: The environment variables by which a user sets the thread counts of the BLAS and OpenMP
#: libraries. When any is set, ``'auto'`` leaves the libraries as they are.
USER_VARIABLES: Tuple[str, ...] = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS',
                                   'MKL_NUM_THREADS', 'BLIS_NUM_THREADS',
                                   'VECLIB_MAXIMUM_THREADS')


# Per thread (native id) that a ThreadBinding of ours holds: how many are in force on it,
# and its affinity from before the first. An updater built while another one runs here (or
# a bench that keeps several alive) shares out the cores the process had, not the master's
# share of the first, which its workers would inherit (two replicas then ran on one core);
# and each thread gets its own affinity back, whichever thread restores the binding (two
# trainers in two threads, a finalize() from another thread left the main thread on one
# core).
_held: Dict[int, List[Any]] = {}
_held_lock = threading.Lock()


def _process_cores() -> List[int]:
    """The cores this process may run on, as before any binding of ours (raises where
    affinity is unknown: not Linux)."""
    with _held_lock:
        befores = [set(before) for _, before in _held.values()]
    return sorted(set().union(*befores) if befores else os.sched_getaffinity(0))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, as before any binding of ours;
    all cores where unknown)."""
    try:
        return len(_process_cores())
    except (AttributeError, OSError):   # not Linux
        return os.cpu_count() or 1


def user_variables() -> Tuple[str, ...]:
    """Those of :data:`USER_VARIABLES` that are set (to something) in the environment."""
    return tuple(name for name in USER_VARIABLES if os.environ.get(name, '').strip())


def replicas_on_host(n_devices: int, communicator: Any = None) -> int:
    """The replica processes that share this host's cores: the updater's devices, or under
    MPI the ranks on this host (``communicator.intra_size``; 1 where the communicator does
    not say, which leaves the libraries alone under ``'auto'``)."""
    if communicator is None:
        return n_devices
    return int(getattr(communicator, 'intra_size', 1) or 1)


def per_replica(setting: Any, replicas: int) -> Optional[int]:
    """The threads each replica's libraries are limited to, or None to leave them as they are.

    ``setting`` is the validated ``blas_threads``: ``'auto'``, an int >= 1, or None.
    ``'auto'`` on one replica is all the cores: no change.
    """
    if setting is None:
        return None
    if setting == 'auto':
        if replicas <= 1 or user_variables():
            return None
        return max(1, available_cores() // replicas)
    return int(setting)


def limit_process(threads: Optional[int]) -> None:
    """Limit every BLAS/OpenMP library loaded in this process to ``threads``, for good
    (a worker, at start-up). None does nothing."""
    if threads is None:
        return
    import threadpoolctl
    threadpoolctl.threadpool_limits(limits=threads)


class WindowLimit:
    """A context manager that limits the master's libraries to ``threads`` while inside
    and restores what they had on leaving (None: does nothing).

    threadpoolctl finds the loaded libraries once, at the first use, and this keeps their
    controllers: entering reads each library's thread count and sets ``threads`` where it
    differs, leaving sets back what it changed. ``ThreadpoolController.limit`` does that
    and a full ``info()`` of every library each time (its version, architecture and
    configuration string besides the count). Timed around the master's window of two
    replicas of a 64-64-10 MLP on a 2-core VM, OpenBLAS as it comes (two threads), over
    2000 updates: entering and leaving took 14-17 us (median) with ``limit``, 7 us with
    the reads and sets alone, of an update of about 0.85 ms. A library loaded after the
    first use is not limited.
    """

    def __init__(self, threads: Optional[int]) -> None:
        self.threads = threads
        self._libraries: Optional[List[Any]] = None
        self._changed: List[Tuple[Any, int]] = []

    def __enter__(self) -> 'WindowLimit':
        threads = self.threads
        if threads is not None:
            if self._libraries is None:
                import threadpoolctl
                self._libraries = threadpoolctl.ThreadpoolController().lib_controllers
            changed = self._changed = []
            for library in self._libraries:
                count = library.num_threads
                if count is not None and count != threads:   # None: unreadable
                    library.set_num_threads(threads)
                    changed.append((library, count))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        changed, self._changed = self._changed, []
        for library, count in changed:
            library.set_num_threads(count)


def master_window(threads: Optional[int], on_cpu: bool) -> WindowLimit:
    """The master's limit around its own window: ``threads`` where its replica computes
    on the host (``on_cpu``), none on a GPU, whose window runs its model on the device and
    no host BLAS: there the limit would only cost every update its library calls (about
    7 us in an update on a 2-core VM, on the master's critical path)."""
    return WindowLimit(threads if on_cpu else None)


#: (replicas, cores) that bind_cores=True was told it could not bind, in this process
_said_unbound: Set[Tuple[int, Tuple[int, ...]]] = set()


def core_shares(setting: Any, replicas: int, on_cpu: bool) -> Optional[List[Tuple[int, ...]]]:
    """Each local replica's cores under ``bind_cores`` (``'auto'``, True or False): a
    disjoint share of this process's affinity per replica, in rank order, or None to bind
    nothing. ``'auto'`` binds CPU replicas (``on_cpu``); True any; neither where fewer
    cores than replicas are there (a share would be empty; True warns) or on one replica.

    Why: on a 2-core VM two CPU replicas, left to the scheduler, often ran on one core
    (a worker waiting for its next message looks for it for a while, and the master waits
    likewise at the board): two replicas of a 64-64-10 MLP took 3.1-3.2x StandardUpdater's
    time per update with other work on the machine, 1.6-1.7x bound, and 1.5-1.6x when the
    machine was quiet (``bench/overhead.py``)."""
    if setting is False or (setting == 'auto' and not on_cpu) or replicas < 2:
        return None
    try:
        cores = _process_cores()
    except (AttributeError, OSError):   # not Linux
        return None
    if len(cores) < replicas:
        if setting is True and (replicas, tuple(cores)) not in _said_unbound:
            _said_unbound.add((replicas, tuple(cores)))   # once, not at every restart
            warn(
                f'bind_cores=True binds nothing: {replicas} replica processes on this host '
                f'and {len(cores)} core(s) in its affinity ({sorted(cores)}), so a share '
                'would be empty. Give the process more cores (taskset), use fewer '
                "replicas, or pass bind_cores='auto' or False", RuntimeWarning)
        return None
    share = len(cores) // replicas
    return [tuple(cores[r * share:(r + 1) * share]) for r in range(replicas)]


class ThreadBinding:
    """The calling thread (and the threads it starts from then on), and the threads of
    ``also`` (native thread ids), bound to ``cores`` until :meth:`restore` (None:
    nothing); restore, from any thread, gives the thread that bound its cores back. The
    master binds its main thread and its loader's thread so while the updater runs; a
    worker binds itself for its life. While bindings overlap on one thread (two updaters
    alive in one process), it keeps the latest one's cores until the last is restored,
    which gives back its affinity from before the first."""

    def __init__(self, cores: Optional[Tuple[int, ...]], also: Any = ()) -> None:
        self.cores = cores
        self._bound = False
        self._thread = threading.get_native_id()
        if cores:
            try:
                before = os.sched_getaffinity(0)
                os.sched_setaffinity(0, cores)
            except (AttributeError, OSError):   # a container that forbids it: as it is
                return
            with _held_lock:
                _held.setdefault(self._thread, [0, before])[0] += 1
            self._bound = True
            for thread_id in also:   # other threads of ours (native ids)
                if thread_id is not None:
                    try:
                        os.sched_setaffinity(thread_id, cores)
                    except OSError:   # a thread gone: as it is
                        pass

    def restore(self) -> None:
        if not self._bound:
            return
        self._bound = False
        with _held_lock:
            entry = _held[self._thread]
            entry[0] -= 1
            if entry[0]:
                return
            del _held[self._thread]
        try:
            os.sched_setaffinity(self._thread, entry[1])   # from whichever thread
        except OSError:   # the thread is gone
            pass

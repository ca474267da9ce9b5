"""ParallelAccumulatingUpdater: the master side."""
from __future__ import annotations

import inspect
import math
import os
import sys
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import chainer
import numpy
from chainer.dataset import convert
from chainer.training.updaters import StandardUpdater

from . import _chainer_private as chainer_private
from . import (_checkpoint, _host_memory, _inherit, _late_check, _limits, _loss_binding,
               _positions, _startup, _step, _threads, _validate)
from ._checkpoint import capture_state
from ._flat_buffers import KeptPersistents, ModelIndex, unique_params
from ._groups import ClosedGroup, Group, SoloGroup
from ._loader import EpochInfo, Loader
from ._made_once import Compared
from ._replica import (MODEL_OBSERVER, UPDATER_KEYS, Replica, WindowResult, combine,
                       scale_gradients, with_graph)
from ._restarts import RestartLog
from ._unsent_state import HeldObjects, UnsentState
from .errors import NonFiniteGradientError, NonFiniteLossError, _in_gradients
from ._warning import new_updater, warn


class ParallelAccumulatingUpdater(StandardUpdater):
    """Data-parallel updater with gradient accumulation, one process per extra device.

    Each :meth:`update`:

    1. The master broadcasts its parameters and persistents (BatchNorm statistics) to
       every worker (sync point 1).
    2. Every replica, the master included, runs ``accumulate_steps`` micro-batches from
       its own iterator, accumulating gradients with no communication in between. The
       next micro-batches are loaded in a background thread (``prefetch``): meanwhile,
       or on CPU replicas with workers while each waits (``'auto'``).
    3. Gradients are summed onto the master (sync point 2) and scaled so that the result
       is the gradient of the *sample-weighted mean loss over every sample of the update*:
       identical to ``StandardUpdater`` on one batch holding all those samples (with the
       defaults; ``loss_reduction`` and ``replica_reduction`` say otherwise).
    4. The master's optimizer updates once (its hooks run once, on the reduced gradient).
       The optimizer and its hyperparameters are never modified.

    BatchNorm running statistics (float persistents) are averaged over the replicas with
    equal weights after each update; integer and scalar persistents keep the master's
    values. Everything a replica reports (``main/loss``, ``main/accuracy``, any
    ``chainer.report``) reaches the master's reporter as the sample-weighted mean over
    every micro-batch of every replica of the update. When
    ``chainer.config.keep_graph_on_report`` is on (``DumpGraph`` turns it on), a value
    the master's first micro-batch reported as a Variable is reported as a Variable
    holding the aggregate whose graph is that micro-batch's: ``DumpGraph('main/loss')``
    draws the model's graph, ``LogReport`` logs the aggregate.

    When an iterator ends (``repeat=False``) in the middle of a window, that replica
    contributes the micro-batches it got; the update is weighted by the samples it really
    held. When no replica got any sample, :meth:`update` raises ``StopIteration``.

    Args:
        iterators: one iterator per device, each over its own shard (a bare iterator is
            accepted with one device); see :func:`mgpu_updater.shard_iterators`. As
            StandardUpdater's dict, ``{'main': [it0, it1, ...]}`` (or ``{'main': it}``
            with one device); other keys are refused, since only 'main' is read.
        optimizer: a set-up Chainer optimizer; its target is the model. ``{'main':
            optimizer}`` works too; several optimizers (a GAN) need their own updater.
        devices: device specifiers, master first: GPU ids, ``'@cupy:N'``, or ``'@numpy'``
            / ``-1`` (may repeat) for CPU replicas; a dict with a ``'main'`` key works too.
        accumulate_steps: micro-batches per device per update (int >= 1).
        converter, loss_func: as for ``StandardUpdater``. With workers they travel
            with cloudpickle (lambdas, closures, what ``__main__`` defines); open files,
            locks, sockets and threads cannot. A ``loss_func`` that is the model, one of
            its links, a method of either, or a closure / ``functools.partial`` over them
            computes in each worker with that worker's replica (re-bound by link path).
        loss_reduction: what ``loss_func`` returns over its batch: ``'mean'`` (default,
            Chainer's losses) or ``'sum'`` (e.g. ``F.black_out``, a hierarchical softmax,
            a loss accumulated over a tree). Either way the update equals
            ``StandardUpdater`` on one batch of all the update's samples; under
            ``'sum'`` the reported loss is the sum over those samples, as there.
        replica_reduction: how the replicas' gradients combine: ``'mean'`` (default,
            the global batch above; ChainerMN's mean) or ``'sum'``: each replica's
            gradient is that of its window as one batch (its ``accumulate_steps``
            micro-batches), and those are summed, exactly as ``ParallelUpdater`` and
            ``MultiprocessParallelUpdater`` do (N times the default for equal shares).
        micro_batch_size: None (default), an int m, or ``'auto'``. With m every loaded
            micro-batch of ``b`` samples runs as ``ceil(b / m)`` chunks of at most m
            samples, gradients accumulated, so a batch that does not fit in memory at
            once still gives the same update over the same samples (BatchNormalization
            then normalises over each chunk). ``'auto'`` starts with whole batches; a
            replica that runs out of memory in forward or backward (``MemoryError``,
            CuPy's ``OutOfMemoryError``) halves its size and redoes its window from the
            same samples, and keeps that size. Reported as ``main/micro_batch_size`` (the
            smallest over the replicas) and saved in snapshots.
        prefetch: micro-batches loaded ahead per replica by a background thread (0 turns
            it off: each batch is loaded when the window needs it). ``'auto'`` (default):
            each replica tries both ways over its first hundred or so updates and keeps
            the faster (:mod:`mgpu_updater._load_trial`): loading ahead (2 batches) hides
            loading that waits (files, a ``MultiprocessIterator``, a GPU computing while
            the host waits), while where the window is Python (a small model, a fast GPU)
            a thread takes the GIL from it, and each batch is loaded when needed (a
            worker also loads while it waits for the master). ``loading_modes`` says
            what each replica does. While the thread loads ahead, the interpreter's
            switch interval (``sys.setswitchinterval``) is at most 0.2 ms, so that a
            window that waits (BLAS, the GPU) gets the GIL back from it within that, not
            after 5 ms; it is set back once no such load runs
            (:mod:`mgpu_updater._gil_handoff`).
        report_times: report ``main/time/{data,compute,comm,update}`` every update
            (default False: the log has StandardUpdater's keys, and each key reported
            costs every update, in the report and in ``LogReport``). ``last_times`` holds
            the same seconds either way.
        nonfinite: ``'raise'`` (default) raises :class:`NonFiniteLossError` naming the
            update when its loss is NaN or infinite, before the parameters change;
            ``'skip'`` warns and skips that update: the parameters, the optimizer's
            state and the model's persistents (BatchNorm's running statistics, which
            its forward passes moved) stay as they were before it (a copy of the
            persistents is taken before each window for that; not under ``pipelined``,
            which skips a step an update late: there the statistics stay as its windows
            made them); ``'ignore'`` does not look, as
            StandardUpdater does not. Where the master is alone on a GPU (one device),
            reading the loss before the step would make it wait for the device every
            update (about 30% of the speed of a model the GPU is busy with): there
            ``'raise'`` looks at it when the next step is due, or at a snapshot
            (``serialize``), or in :meth:`finalize`, and raises naming the update, whose
            step was applied (the error's ``applied``); ``'skip'`` still reads first (one
            wait per update). Under ``'raise'`` and ``'ignore'`` that master never waits
            for its device during an update, and reports its values as 0-dim float64
            arrays on the device, as StandardUpdater reports device arrays (workers and
            MPI ranks read theirs, to send them, and check before the step). With dynamic
            loss scaling (``optimizer.loss_scaling()``) Chainer itself skips such steps
            and lowers the scale, so the policy does not apply. Under a static loss scale
            (``optimizer.loss_scaling(scale=...)``, on which Chainer steps unchecked) a
            finite loss whose summed gradient is not finite is held to the same policy
            (:class:`NonFiniteGradientError`, a :class:`NonFiniteLossError`, naming the
            parameters); ``'ignore'`` steps on it, as StandardUpdater does. A frozen
            parameter's gradient (``disable_update()``, its update rule disabled) counts
            only where a hook of the optimizer reads every gradient before the step
            (``GradientClipping``).
        pipelined: opt-in (as ChainerMN's ``double_buffering``): the gradient of update
            t is reduced into a second set of buffers and applied one update late, so
            update t+1's gradient was computed on parameters one step stale (no
            overlap is realised yet: see docs/pipelined.md). The first update applies
            nothing. Reports stay those of the window just computed.
        blas_threads: the BLAS/OpenMP threads of each replica, so that N replicas on C
            cores do not run N * C threads. ``'auto'`` (default): ``max(1, C // N)``, N
            being the replicas on this host (under MPI its ranks), unless the environment
            sets ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``,
            ``BLIS_NUM_THREADS`` or ``VECLIB_MAXIMUM_THREADS`` (then the libraries stay as
            those say); on one replica, no change. An int: that many per replica. None:
            the libraries stay as they are. Workers keep the limit for their life; the
            master (your process) only while it computes its own micro-batches.
        reuse_host_memory: whether every replica process keeps the host memory it frees
            for its next micro-batch instead of giving it back to the kernel after each
            one (glibc's malloc thresholds, fixed as a memory pool would; a page fault per
            page saved, which on a virtual machine is worth up to a quarter of a CPU
            update). ``'auto'`` (default): yes, unless the environment configures malloc
            (``MALLOC_*_`` variables, ``MALLOC_ARENA_MAX``, ``glibc.malloc`` tunables).
            True: yes anyway; False: malloc as it is. Workers from their start; the master
            (your process) from the first update on, for the rest of its life (glibc has
            no way back). Results do not change; a process keeps its peak heap. No effect
            where the C library is not glibc.
        stall_warning: seconds (default 60) the master waits in an update for workers
            that have not finished their windows before it warns
            (:class:`~mgpu_updater.StallWarning`), naming them and giving each one's
            Python stack; None: never. The clock starts when the master's own window is
            over.
        update_timeout: seconds after which such a wait gives up: every worker is
            stopped, then :class:`~mgpu_updater.WorkerError` is raised with the same
            information (default None: wait as long as the workers live). Stopping a
            worker that does not answer takes up to 5 s more (asked for 3 s, then
            SIGKILL).
        bind_cores: ``'auto'`` (default), True or False: whether each replica process of
            this host runs on a share of the cores of its own (the master: the thread
            that runs its first update, while the updater runs; restored by
            :meth:`finalize`; a thread or process started from it meanwhile, by an
            extension, inherits that share and keeps it). ``'auto'``:
            CPU replicas, where every replica gets at least one core of this process's
            affinity; True: GPU replicas too (a warning where a share would be empty).
            Left to the scheduler, two CPU replicas of a 2-core VM often shared one
            core. Several trainings on one host: give each its own cores (``taskset``),
            which are then shared, or pass False.
        max_worker_restarts: how many times over the run a worker process that dies (a
            signal such as SIGKILL or SIGSEGV, the out-of-memory killer) is replaced
            instead of ending the run with :class:`~mgpu_updater.WorkerError` (default 0:
            never). The update it died in is abandoned, a new process starts on the same
            device with the same payload, and every worker goes back to where that update
            started (iterator and random state), so that the redone update is the lost
            one, bit for bit (a GPU's random numbers excepted); each restart warns
            (:class:`~mgpu_updater.WorkerRestartWarning`) and every update reports the
            count as ``main/worker_restarts``. The death after the last one allowed
            raises, naming the restarts before it. Never restarted: a worker's own Python
            exception (a bug repeats), a failure while starting, the master, ranks under
            MPI (refused here with a ``communicator``). On NCCL every rank aborts its
            communicator and all join a new one; see docs/reliability.md.
        start_method: ``'spawn'`` (default) or ``'forkserver'``. Python starts one fork
            server per process, at its first use, and every worker after is forked from
            it: with the environment variables it had then (a later updater's workers
            do not see a variable the script set for it since; ``spawn`` does).
        start_timeout: seconds the workers get to start and report ready (default 120;
            finite, at most 2147483, the longest wait the operating system's ``poll()``
            takes).
        communicator: a ChainerMN communicator (``chainermn.create_communicator``): run
            across MPI ranks, one device per rank.
        auto_new_epoch: as for ``StandardUpdater``: when True (default), the optimizer's
            ``new_epoch()`` is called when the master's iterator starts a new epoch (as of
            the last micro-batch used).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> 'ParallelAccumulatingUpdater':
        # before __init__'s arguments are bound, so that a StandardUpdater argument gets
        # its fix; a subclass's own __init__ takes what it takes
        if cls.__init__ is ParallelAccumulatingUpdater.__init__:
            _validate.other_updaters_arguments(args, kwargs)
        return super().__new__(cls)

    def __init__(self, iterators: Any, optimizer: chainer.Optimizer, *,
                 devices: Union[Sequence[Any], Dict[str, Any]],
                 accumulate_steps: int = 1,
                 converter: Callable = convert.concat_examples,
                 loss_func: Optional[Callable] = None,
                 prefetch: Union[int, str] = 'auto',
                 report_times: bool = False,
                 nonfinite: str = 'raise',
                 pipelined: bool = False,
                 start_method: str = 'spawn',
                 start_timeout: float = 120.0,
                 communicator: Any = None,
                 auto_new_epoch: bool = True,
                 loss_reduction: str = 'mean',
                 replica_reduction: str = 'mean',
                 micro_batch_size: Union[None, int, str] = None,
                 blas_threads: Union[None, int, str] = 'auto',
                 reuse_host_memory: Union[bool, str] = 'auto',
                 stall_warning: Optional[float] = 60.0,
                 update_timeout: Optional[float] = None,
                 bind_cores: Union[bool, str] = 'auto',
                 max_worker_restarts: int = 0) -> None:
        new_updater()   # this updater's warnings are shown, whatever an earlier one showed
        self._finalized = False
        self._group: Group = ClosedGroup()
        #: the arrays the last teardown gave the parameters (_local.group.Detached): a
        #: next start of the workers (after finalize(), a snapshot's load) binds those
        #: and leaves any other array a parameter holds (the user's) as it is
        self._detached: Any = None
        self.accumulate_steps = _validate.positive_int('accumulate_steps', accumulate_steps)
        self.prefetch = _validate.prefetch(prefetch)
        self.nonfinite = _validate.non_finite_policy(nonfinite)
        self.loss_reduction = _validate.loss_reduction(loss_reduction)
        self.replica_reduction = _validate.replica_reduction(replica_reduction)
        self.micro_batch_size = _validate.micro_batch_size(micro_batch_size)
        self.blas_threads = _validate.blas_threads(blas_threads)
        self.reuse_host_memory = _validate.reuse_host_memory(reuse_host_memory)
        self.bind_cores = _validate.bind_cores(bind_cores)
        #: under micro_batch_size='auto': every replica's chunk size as of the last
        #: update (0: no micro-batch yet; empty before the first update), in replica
        #: order (MPI: rank order); saved in snapshots
        self.micro_batch_sizes: List[int] = []
        #: ... and the size each splits its batches into (0: whole batches; what 'auto'
        #: halved to after running out of memory), which a snapshot saves and a
        #: restart starts from
        self._chunk_limits: List[int] = []
        self.start_method = _validate.choice('start_method', start_method,
                                             ('spawn', 'forkserver'))
        self.start_timeout = _validate.seconds('start_timeout', start_timeout)
        self.stall_warning = _validate.seconds_or_none('stall_warning', stall_warning)
        self.update_timeout = _validate.seconds_or_none('update_timeout', update_timeout)
        self.max_worker_restarts = _validate.positive_int('max_worker_restarts',
                                                          max_worker_restarts, minimum=0)
        auto_new_epoch = _validate.flag('auto_new_epoch', auto_new_epoch, ints=True)
        self.report_times = _validate.flag('report_times', report_times)
        self.pipelined = _validate.flag('pipelined', pipelined)
        self._step = _step.choose(self.pipelined)
        self._devices, self.device_labels = _validate.devices(devices)
        its = _validate.iterators(iterators, len(self._devices))
        optimizer = _validate.main_optimizer(optimizer)
        model = _validate.optimizer(optimizer)
        _validate.converter(converter)
        _validate.callable_or_none('loss_func', loss_func)
        communicator = _validate.communicator(communicator)
        _validate.one_device_per_rank(communicator, self.device_labels)
        _validate.gradient_reallocation(optimizer, summed=len(self._devices) > 1 or
                                        self.pipelined or communicator is not None)
        if communicator is not None and self.max_worker_restarts:
            raise ValueError(
                f'max_worker_restarts={self.max_worker_restarts} does not apply across MPI '
                'ranks (communicator given): mpiexec starts and owns the ranks, and a rank '
                'that dies ends the job; pass max_worker_restarts=0 and resume the job from '
                'its last snapshot')
        #: the restarts of the run (max_worker_restarts > 0), else None
        self._restart_log: Optional[RestartLog] = (
            RestartLog(self.max_worker_restarts) if self.max_worker_restarts else None)
        self._communicator = communicator
        #: whether the master reads its window's loss on the host before the step: under
        #: 'skip', and under 'raise' unless the master is alone on a GPU (with other
        #: replicas it waits for the reduction anyway); there 'raise' looks at it when the
        #: next step is due, the loss on its way meanwhile in _late (see _late_check)
        self._loss_first = self.nonfinite == 'skip' or (
            self.nonfinite == 'raise' and (len(self._devices) > 1 or communicator is not None
                                           or not _late_check.defers(self._devices[0])))
        self._late = _late_check.LateCheck()
        #: with worker processes: the plain values of the model, loss_func and converter
        #: that they never receive, watched between updates (_unsent_state); else None
        self._unsent: Optional[UnsentState] = None
        #: several replicas: the master's comparison of what each forward made once
        #: (_made_once), until every replica's digests came in
        self._made_once: Optional[Compared] = None
        #: (converter, loss_func, optimizer, main iterator) as the replicas took them
        self._taken_at_start: Optional[Tuple[Any, Any, Any, Any]] = None
        self._t_at_end: Optional[int] = None   # the optimizer's t after the last update
        #: how the reporter current at the last update names the model's links
        #: (:meth:`_named`): it, what each key became, what each link is called there
        self._names_for: Optional[chainer.Reporter] = None
        self._key_names: Dict[str, str] = {}
        self._link_names: Dict[str, str] = {}
        self._observed: Optional[Dict[str, chainer.Link]] = None   # observer name -> link
        #: why the workers' iterator positions are gone (an update failed: no snapshot
        #: holds them after it), else None
        self._positions_lost: Optional[str] = None
        self._core_calls = 0   # of update_core (update: a subclass's must have called it)
        self._core_iteration: Optional[int] = None   # the iteration of its last success
        #: the main iterator's state at the end of the data (StopIteration), else None
        self._ended: Optional[Dict[str, Any]] = None
        self._worker_iterators = its[1:]
        self._main_shard = its[0]   # the master's, whose shard goes with the workers'
        self._bound_loss: Optional[_loss_binding.LossBinding] = None
        if len(self._devices) > 1:
            _validate.may_start_processes(len(self._devices))
            self._bound_loss = _loss_binding.find(loss_func, model)
            _validate.worker_payload(model, None if self._bound_loss else loss_func,
                                     converter, self._worker_iterators)
        super().__init__(its[0], optimizer, converter=converter, device=self._devices[0],
                         loss_func=loss_func, auto_new_epoch=auto_new_epoch)
        self._replica: Optional[Replica] = None
        self._loader: Optional[Loader] = None
        #: the epoch after the last batch used: an EpochInfo, or (_update_direct) the
        #: master's iterator itself, which nothing reads on until the next update
        self._epoch: Any = None
        self._nominal_samples = float(self.accumulate_steps * sum(
            getattr(it, 'batch_size', 1) or 1 for it in its))
        self._skipped = 0
        #: the process that started its workers (finalize: nothing in a child forked from
        #: it); None before the first update
        self._owner: Optional[int] = None
        #: under nonfinite='skip' (not pipelined), the model's persistents (where it has
        #: any), read before each window and set back where the update is skipped; else None
        self._persistents: Optional[ModelIndex] = None
        self._before_window: Optional[KeptPersistents] = None
        self._has_persistents = False
        #: seconds of the last update: 'data', 'compute', 'comm', 'update'
        self.last_times: Dict[str, float] = {}
        #: seconds of the last update's window on each replica, in replica order (MPI:
        #: rank order): 'data' and 'compute', as each replica measured them
        self.last_replica_times: List[Dict[str, float]] = []
        #: how each replica loads, as of the last update, in replica order (MPI: rank
        #: order): 'inline', 'ahead', 'trial' (prefetch='auto' still timing both), or
        #: 'none' (prefetch=0)
        self.loading_modes: List[str] = []

    # ------------------------------------------------------------------ epoch bookkeeping
    # The master's loader runs ahead of training; the epoch is that of the last batch used.
    @property
    def _epoch_view(self) -> Any:
        return self._epoch if self._epoch is not None else self.get_iterator('main')

    @property
    def epoch(self) -> int:
        epoch = self._epoch_view.epoch
        # (an iterator of the user's own without one: read as StandardUpdater reads it)
        return self.get_iterator('main').epoch if epoch is None else epoch

    @property
    def epoch_detail(self) -> float:
        detail = self._epoch_view.epoch_detail
        return self.get_iterator('main').epoch_detail if detail is None else detail

    @property
    def previous_epoch_detail(self) -> Optional[float]:
        return getattr(self._epoch_view, 'previous_epoch_detail', None)

    @property
    def is_new_epoch(self) -> bool:
        return self._epoch_view.is_new_epoch

    @property
    def n_devices(self) -> int:
        return len(self._devices) if self._communicator is None else self._communicator.size

    def worker_pids(self) -> List[int]:
        """Process ids of the running workers (empty before the first update)."""
        return self._group.pids()

    @property
    def worker_restarts(self) -> int:
        """How many worker processes were replaced so far (``max_worker_restarts``)."""
        return len(self._restart_log) if self._restart_log is not None else 0

    # ------------------------------------------------------------------ start-up
    def _start(self) -> None:
        _positions.follow_new_pass(self.get_iterator('main'), self._worker_iterators)
        _positions.warn_if_marked(self._worker_iterators)
        if len(self._devices) > 1 and self._communicator is None:
            _inherit.warn_thread_hooks(len(self._devices) - 1)
        threads = _threads.per_replica(self.blas_threads, _threads.replicas_on_host(
            len(self._devices), self._communicator))
        on_cpu = all(d.xp is numpy for d in self._devices)
        self._window_threads = _threads.master_window(threads, on_cpu)
        shares = None if self._communicator is not None else _threads.core_shares(
            self.bind_cores, len(self._devices), on_cpu=on_cpu)
        reuse = _host_memory.decide(self.reuse_host_memory)
        _host_memory.reuse_freed_memory(reuse)
        try:
            started = _startup.start(_startup.Settings(
                model=self.get_optimizer('main').target, loss_func=self.loss_func,
                bound_loss=self._bound_loss, converter=self.converter,
                iterator=self.get_iterator('main'), worker_iterators=self._worker_iterators,
                devices=self._devices, device_labels=self.device_labels,
                communicator=self._communicator, prefetch=self.prefetch,
                accumulate_steps=self.accumulate_steps, pipelined=self.pipelined,
                start_method=self.start_method, start_timeout=self.start_timeout,
                nominal_samples=self._nominal_samples, loss_reduction=self.loss_reduction,
                replica_reduction=self.replica_reduction,
                micro_batch_size=self.micro_batch_size,
                micro_batch_sizes=list(self._chunk_limits), blas_threads=threads,
                reuse_host_memory=reuse, read_values=self._loss_first,
                stall_warning=self.stall_warning, update_timeout=self.update_timeout,
                core_shares=shares, restarts=self._restart_log, nonfinite=self.nonfinite,
                optimizer=self.get_optimizer('main'), detached=self._detached))
        except BaseException as exc:
            # a limit of the host: named, with its fix
            better = _limits.explained(exc, workers=len(self._worker_iterators))
            if better is None:
                raise
            raise better from exc
        self._loader, self._replica, self._group, self._nominal_samples = started
        # (through a weak reference: the replica holding the updater's bound method kept
        # a dropped updater alive until a collection, with its workers and the cores)
        self._replica.publish_loaded = _publisher_of(weakref.ref(self))
        # after the workers were spawned with all the cores (their libraries size their
        # pools by what a process starts with) and each took its share: the master's main
        # thread and its loader's thread take share 0
        self._binding = _threads.ThreadBinding(
            shares[0] if shares else None, also=[getattr(self._loader, 'thread_id', None)])
        self._optimizer = self.get_optimizer('main')
        self._target = self._optimizer.target   # what every replica is a copy of
        # one device, each gradient stepped on in its own update: _update's short way
        self._alone = isinstance(self._group, SoloGroup) and not self.pipelined
        # ... with one whole micro-batch per update: StandardUpdater's update (_update_direct)
        self._direct = self._alone and self._replica.direct
        self._stamps_clear = False   # the parameters' loss-scale stamps: written at the first step
        index = ModelIndex(self._target)
        self._has_persistents = bool(index.persistents)
        if self.nonfinite == 'skip' and index.persistents and not self.pipelined:
            self._persistents = index
        if len(self._devices) > 1 and self._communicator is None:
            self._unsent = UnsentState({'model': self._optimizer.target,
                                        'loss_func': self.loss_func,
                                        'converter': self.converter},
                                       held=HeldObjects(self._optimizer.target,
                                                        self._worker_iterators))
        if self.n_devices > 1 and (self._communicator is None
                                   or self._communicator.rank == 0):
            self._made_once = Compared(
                [f'replica {i} ({label})' for i, label in enumerate(self.device_labels)]
                if self._communicator is None
                else [f'rank {r}' for r in range(self.n_devices)])
        #: what every replica took at the start (the updater's attributes may be set anew,
        #: and StandardUpdater's dicts, which third-party code reaches into, given others)
        self._taken_at_start = (self.converter, self.loss_func, self._optimizer,
                                self.get_iterator('main'))
        # An updater dropped without finalize() (``del``, garbage collection, the
        # interpreter's exit) still stops its workers and releases its shared memory.
        self._owner = os.getpid()
        self._release_when_dropped = weakref.finalize(self, _release, self._owner, self._group,
                                                      self._loader, self._late, self._binding,
                                                      list(self._worker_iterators))
        _positions.running(self._worker_iterators)

    # ------------------------------------------------------------------ one update
    def update(self) -> None:
        """One update (``StandardUpdater.update``), which must run this class's
        ``update_core``: a subclass's own ``update_core`` that never calls it
        (``super().update_core()``) trains the master's model on the master's shard, as
        ``StandardUpdater`` would, while the workers wait; raised after the first update
        that did not (one that skips an update now and then, having called it before, is
        left alone)."""
        self._core_iteration = None   # (update_core's pipelined check: within this call)
        self.update_core()
        if not self._core_calls:
            alone = ("in the master alone, on the master's shard, with no worker, "
                     if len(self._devices) > 1 else '')
            raise RuntimeError(
                f'{type(self).__name__}.update_core did not call '
                f'ParallelAccumulatingUpdater.update_core: whatever it did ran {alone}'
                "outside this updater's loading (which reads ahead), accumulation and "
                'reduction. Call super().update_core() for each update it makes (do what '
                'comes before or after it around that call); for several optimizers, as '
                'a GAN has, see docs/migration.md')
        self.iteration += 1

    def update_core(self) -> None:
        if self._finalized:
            if self._positions_lost is not None:
                raise RuntimeError(
                    f"this updater stopped: {self._positions_lost}, and the worker processes' "
                    'iterator positions went with it. Load a snapshot taken before (it '
                    'restarts from there), or build a new updater')
            # finalize() (a Trainer's run ended, by an exception too): go on, as
            # StandardUpdater does, from where every replica was (_teardown kept it)
            self._finalized = False
        self._core_calls += 1
        if self.pipelined and self._core_iteration == self.iteration:
            raise RuntimeError(
                f'update_core ran twice in iteration {self.iteration} under pipelined=True, '
                'which steps one update late, once per iteration: a further call would '
                'step on its own gradient at once. Call it once per iteration, or use '
                'pipelined=False')
        if self._ended is not None:
            self._new_pass_if_reset()
        # What the script replaced since the replicas took it is refused here, before the
        # update starts: nothing is torn down (no step in flight dropped), and the run goes
        # on once the script puts it back.
        if self._replica is None:   # (they take what is there now at the start)
            if self._worker_iterators and self.get_iterator('main') is not self._main_shard:
                raise RuntimeError(
                    "updater._iterators['main'] was given another iterator than the "
                    "master's shard the updater was built with: each worker process reads "
                    'its own shard of the iterators given then, so the replicas would train '
                    'on two datasets. Build the updater with shard_iterators over the data '
                    'it is to read')
        else:
            taken = self._taken_at_start
            if (self.converter is not taken[0] or self.loss_func is not taken[1]
                    or self.get_optimizer('main') is not taken[2]
                    or self.get_iterator('main') is not taken[3]
                    or self._optimizer.target is not self._target):
                raise RuntimeError(self._replaced_message(taken))
        try:
            self._update()
            # no reading ahead while the code between updates runs (an Evaluator over the
            # same dataset object): _loader.Loader.pause. (After a failure the teardown
            # closes the loader, waiting a bounded time.)
            self._loader.pause()   # type: ignore[union-attr]
            self._core_iteration = self.iteration
            self._ended = None
        except StopIteration:
            if self._loader is not None:
                self._loader.pause()
            if self._replica is not None or self._ended is not None:
                # the main iterator as this call left it: Chainer's move their
                # previous_epoch_detail as they raise, so one taken before (a snapshot's
                # load at the end) read as a reset at the next call, which started a new
                # pass on the workers alone
                self._ended = capture_state(self._main_read())
            # from now on read as StandardUpdater reads them: off the iterator, as it ended
            # (previous_epoch_detail moved) and as a reset leaves it
            self._epoch = None
            raise
        except BaseException as exc:
            if self._unsent is not None:   # (chainer.set_debug(True) by an extension)
                note = self._unsent.config_note()
                if note is not None:
                    exc.add_note(note)
            try:
                self._teardown(abort=True, by_interrupt=isinstance(exc, KeyboardInterrupt))
            except Exception as late:  # noqa: BLE001 - the update's error is the one raised
                # (copying the parameters off shared memory runs out of the memory the
                # update ran out of): said with it, not in its place
                exc.add_note(f'Then, while the replicas were stopped: '
                             f'{type(late).__name__}: {late}')
            raise

    def _new_pass_if_reset(self) -> None:
        """After the iterators' end (``repeat=False``): a main iterator reset since (the
        next pass of a loop that calls ``update()`` itself) starts a new pass on every
        replica, as ``reset()`` of ``StandardUpdater``'s one iterator does. The workers'
        iterators are copies in their processes: each is brought back here as it ended,
        reset, and sent again with the replicas' restart (as a snapshot's load does).
        While the replicas run, the iterator looked at is the one the master reads: another
        put into ``updater._iterators`` (refused next) started a new pass on the workers,
        and with the original put back, not reset, the workers trained on alone."""
        main = self._main_read() if self._replica is not None else self.get_iterator('main')
        if _checkpoint.same_state(capture_state(main), self._ended):
            return   # still at its end: StopIteration again
        self._ended = None
        self._teardown(abort=False)   # the workers' iterators as they ended, kept
        self._finalized = False
        for it in self._worker_iterators:
            if not _positions.at_pass_start(it):   # (one the script reset too: once)
                it.reset()
        self._epoch = None

    def _update(self) -> None:
        if self._replica is None:
            self._start()
        self._loader.resume()
        if self._restart_log is not None:
            self._restart_log.update = self.iteration + 1
        # This runs every update: where the host decides the speed, each call here is time
        # StandardUpdater does not spend (bench/overhead.py), hence plain clocks.
        clock = time.perf_counter
        optimizer = self._optimizer
        loss_scale = chainer_private.loss_scale(optimizer)
        if self._persistents is not None:   # nonfinite='skip': set back on a skip
            self._before_window = KeptPersistents(self._persistents)
        if self._direct:   # (a batch it loads here reports where its model does)
            self._update_direct(optimizer, loss_scale)
            return
        try:   # what loading reports through an observer the Trainer's reporter knows
            self._loader.reports_under(chainer.reporter.get_current_reporter())
        except IndexError:   # none is current
            self._loader.reports_under(None)
        unsent = self._unsent
        if unsent is not None:
            # What the workers were built from, checked where the optimizer's count moved
            # otherwise than by the last step (optimizer.setup, after a parameter is
            # replaced, sets it to 0) and at each look of the watch (due): raises where
            # the workers' copies would train apart. Checked every update, it cost two
            # replicas of a launch-bound model 1.5% of their time
            # (bench/ab_overhead.py --replicas 2).
            due = unsent.due()
            if due or optimizer.t != self._t_at_end:
                unsent.check_held()
            if due:
                unsent.at_begin()   # now and then, between updates (_unsent_state)
        t0 = clock()
        if self._alone:
            parity = None
        else:
            parity = self._step.parity()
            self._group.begin(loss_scale, parity)
        t1 = clock()
        if self._window_threads.threads is None:
            own = self._replica.run_window(loss_scale)
        else:
            with self._window_threads:
                own = self._replica.run_window(loss_scale)
        t2 = clock()
        if unsent is not None and unsent.watching:
            unsent.after_window()
            t2 = clock()
        if self._alone:
            # One device, stepping now: nothing to reduce, and the gradient is the model's
            # already; the step of ImmediateStep and SoloGroup, without their calls.
            count = own.count
            if count == 0:
                raise StopIteration
            self._apply(optimizer, count, own.loss_sum / count, loss_scale,
                        self.iteration + 1)
            results = [own]
            times = {'comm': t1 - t0, 'update': clock() - t2}
        else:
            self._step_seconds = 0.0
            # The policy hands over this update's gradient step (_on_step) as soon as the
            # group has it in the model: the local group, before it takes the workers'
            # results.
            results, fresh = self._step.reduce(self._group, own, loss_scale, parity,
                                               self._on_step)
            # the step ran inside the reduction: its seconds are 'update', not 'comm'
            times = {'comm': (t1 - t0) + (clock() - t2) - self._step_seconds,
                     'update': self._step_seconds}
            if self._made_once is not None and self._made_once.take(results):
                self._made_once = None
            if fresh.count == 0:
                raise StopIteration
        epochs = own.epochs
        if len(epochs) == 1:
            self._epoch = epochs[0]
        elif epochs:
            # One update spans the window: epoch triggers must see the boundary it crossed.
            first, last = epochs[0], epochs[-1]
            self._epoch = EpochInfo(last.epoch, last.epoch_detail, first.previous_epoch_detail,
                                    any(e.is_new_epoch for e in epochs))
        if self.auto_new_epoch and epochs and self._epoch.is_new_epoch:
            optimizer.new_epoch(auto=True)
        self._report(results, own, times)
        self._t_at_end = optimizer.t

    def _replaced_message(self, taken: Tuple[Any, Any, Any, Any]) -> str:
        if self._optimizer.target is not self._target:
            return (f'the optimizer now updates another model '
                    f'({type(self._optimizer.target).__name__} at '
                    f'{id(self._optimizer.target):#x}, set up after the first update) than '
                    f'the one this updater started with ({type(self._target).__name__} at '
                    f'{id(self._target):#x}): every replica computes with a copy of that '
                    'one, so the step would apply to the new model gradients it never '
                    'computed. finalize() this updater and build a new one with the '
                    'optimizer set up on the new model')
        names = [name for name, now, then in (
            ('converter', self.converter, taken[0]),
            ('loss_func', self.loss_func, taken[1])) if now is not then]
        if names:
            return (f"updater.{' and updater.'.join(names)} was set anew after the first "
                    "update: every replica (the master's loader and window, each worker "
                    'process) took the one given at the start and computes with it, and a '
                    'batch may be converted ahead already. Set it before the first '
                    'update, or finalize this updater and build a new one with it')
        if self.get_optimizer('main') is not taken[2]:
            return ("updater._optimizers['main'] was given another optimizer after the first "
                    f'update: this updater steps with the one it started with '
                    f'({type(taken[2]).__name__} at {id(taken[2]):#x}), whose state (its '
                    "count t, its hooks, each parameter's update rule) the step and the "
                    'snapshots use. Change its hyperparameters in place '
                    "(updater.get_optimizer('main').lr = ..., as extensions.ExponentialShift "
                    'does), or finalize this updater and build a new one with the new '
                    'optimizer')
        return ("updater._iterators['main'] was given another iterator after the first "
                "update: every replica reads its own shard from the iterators given at "
                "the start (the master's loader reads ahead from its own, each worker "
                'from a copy of its shard in its process). To train on other data, '
                'finalize this updater and build a new one with shard_iterators over it')

    def _update_direct(self, optimizer: chainer.Optimizer,
                       loss_scale: Optional[float]) -> None:
        """_update for one device and one whole micro-batch per update, stepping now:
        StandardUpdater's update and this package's bookkeeping, in as few calls and
        objects as it takes. It runs every update of the most common setting; where the
        host decides the speed, each call is time StandardUpdater does not spend
        (bench/overhead.py: this way and _apply's short one took 1.2% off the time of a
        launch-bound update, about 8 us). The epoch is the iterator itself, read when
        asked as StandardUpdater reads it (Loader.get's live_epoch: another 0.5%)."""
        clock = time.perf_counter
        if self._window_threads.threads is None:
            count, loss, epoch, data, compute = self._replica.direct_window(loss_scale, True)
        else:
            with self._window_threads:
                count, loss, epoch, data, compute = self._replica.direct_window(
                    loss_scale, True)
        if not count:
            raise StopIteration
        stepping = clock()
        self._apply(optimizer, count, loss, loss_scale, self.iteration + 1)
        times = {'comm': 0.0, 'update': clock() - stepping, 'data': data, 'compute': compute}
        self._epoch = epoch
        if self.auto_new_epoch and epoch.is_new_epoch:
            optimizer.new_epoch(auto=True)
        self.last_times = times
        self.last_replica_times = [{'data': data, 'compute': compute}]
        self.loading_modes = [self._replica.loader.mode]
        self._publish({}, times)

    def _on_step(self, fresh: '_step.GradientStep') -> None:
        """This update's gradient is in the model: step on what is due now."""
        if fresh.count == 0:
            return   # StopIteration, once the results are in
        optimizer = self._optimizer
        due = self._step.due(fresh, optimizer.target)
        if due is not None:
            start = time.perf_counter()
            # pipelined: the previous update's gradient, and its loss is that update's
            of_update = self.iteration + 1 if due is fresh else self.iteration
            self._apply(optimizer, due.count, due.loss, due.loss_scale, of_update)
            self._step_seconds += time.perf_counter() - start

    def _check_late(self) -> None:
        """Raise :class:`NonFiniteLossError` if the loss of the update stepped last,
        still on its way to the host, is not finite (_late_check)."""
        found = self._late.take()
        if found is not None:
            raise NonFiniteLossError(*found, applied=True)

    def _factor(self, optimizer: chainer.Optimizer, count: int,
                loss: float, of_update: int) -> Optional[float]:
        """The factor on the summed gradient of update ``of_update``, over ``count``
        samples whose loss is ``loss``, or None when it steps on nothing (no sample; the
        nonfinite policy 'skip'). Raises :class:`NonFiniteLossError` under 'raise': before
        the step where the loss is on the host, else when the next step is due."""
        self._check_late()
        dynamic = chainer_private.loss_scaling_is_dynamic(optimizer)
        policy = self.nonfinite
        if policy == 'raise' and count and not dynamic and not self._loss_first:
            self._late.start(of_update, loss)   # looked at by the next step
            policy = 'ignore'
        factor, bad = _step.decide(count, loss, policy, dynamic, self._replica.scaling)
        if bad:
            if self.nonfinite == 'raise':
                raise self._noted(NonFiniteLossError(of_update, loss))
            self._skipped += 1
            self._set_back(of_update)
            warn(f'skipping {self._step_of(of_update)}: the loss is {loss}',
                 RuntimeWarning)
        return factor

    def _set_back(self, of_update: int) -> None:
        """A skipped update leaves the model as it was before it: the persistents its
        windows moved too (BatchNorm's running statistics, which a non-finite forward
        makes NaN for good). Not under ``pipelined``, whose step skips the last update
        a window later, when a snapshot may have been taken between the two (which would
        then have to hold the statistics from before that update as well)."""
        kept = self._before_window
        if kept is not None and of_update == self.iteration + 1:
            kept.restore()

    def _noted(self, exc: NonFiniteLossError) -> NonFiniteLossError:
        """``exc`` raised before the step, noting what its windows changed anyway."""
        if self._has_persistents:
            exc.add_note(
                "The model's persistents (BatchNorm's running statistics) hold what this "
                "update's forward passes made of them" + (
                    '' if self.pipelined else "; nonfinite='skip' sets them back"))
        return exc

    def _step_of(self, of_update: int) -> str:
        """The step a skip leaves out, in words."""
        if of_update == self.iteration + 1:
            return f'update {of_update}'
        return (f'the step of update {of_update}, due at update {self.iteration + 1} '
                '(pipelined)')

    def _apply(self, optimizer: chainer.Optimizer, count: int, loss: float,
               loss_scale: Optional[float], of_update: int) -> None:
        """One optimizer step on the model's summed gradient, that of update
        ``of_update`` over ``count`` samples whose mean loss is ``loss``, taken under the
        optimizer's ``loss_scale``."""
        if (loss_scale is None and type(loss) is float and self._stamps_clear
                and not self._late.pending and math.isfinite(loss)
                and self._replica.scaling.update(count) == 1.0):
            # What the rest decides in the most common step, without its calls: a whole
            # update of a finite loss on the host, no loss scale and none stamped (every
            # update where the host decides the speed; bench/overhead.py).
            optimizer.update()
            return
        model = optimizer.target
        factor = self._factor(optimizer, count, loss, of_update)
        if factor is None or (loss_scale is not None and not self._finite_under_static_scale(
                optimizer, loss, loss_scale, of_update)):
            return
        if factor != 1.0:
            with chainer.using_device(self._devices[0]):   # on the master's stream
                scale_gradients(unique_params(model), factor)   # a tied one once
        # The update rules divide each gradient by its parameter's stamped loss scale. The
        # replicas' backward stamps None (backward_scaled), so the stamps are written once,
        # and then only where the optimizer scales the loss: writing them walks the model.
        stamped = loss_scale is not None
        if stamped or not self._stamps_clear:
            chainer_private.set_update_loss_scale(model, loss_scale)
            self._stamps_clear = not stamped
        optimizer.update()

    def _finite_under_static_scale(self, optimizer: chainer.Optimizer, loss: float,
                                   loss_scale: Optional[float], of_update: int) -> bool:
        """Under a static loss scale, whether the summed gradient is finite (else raise
        or skip, as ``nonfinite`` says); True without looking elsewhere."""
        if (self.nonfinite == 'ignore' or loss_scale is None
                or chainer_private.loss_scaling_is_dynamic(optimizer)):
            return True
        bad = _step.nonfinite_gradients(optimizer)
        if not bad:
            return True
        if self.nonfinite == 'raise':
            raise self._noted(NonFiniteGradientError(of_update, loss, loss_scale, bad))
        self._skipped += 1
        self._set_back(of_update)
        warn(f'skipping {self._step_of(of_update)}: the summed gradient holds inf '
             f'or NaN under the static loss scale {loss_scale:g}'
             f'{_in_gradients(bad)}', RuntimeWarning)
        return False

    def _report(self, results: List[WindowResult], own: WindowResult,
                times: Dict[str, float]) -> None:
        observation = combine(results) if own.sums or len(results) > 1 else {}
        if self.micro_batch_size == 'auto':
            sizes = [r.micro_batch_size or 0 for r in results]
            if any(sizes):   # this update's micro-batches
                observation[UPDATER_KEYS + '/micro_batch_size'] = min(s for s in sizes if s)
            # a replica whose window was empty (its shard ran out) keeps the size it found
            before = self.micro_batch_sizes
            self.micro_batch_sizes = [
                s or (before[i] if i < len(before) else 0) for i, s in enumerate(sizes)]
            limits = self._chunk_limits
            self._chunk_limits = [
                (r.chunk_limit or 0) if r.count else (limits[i] if i < len(limits) else 0)
                for i, r in enumerate(results)]
        roots = self._replica.graph_roots
        if roots:
            for key, root in roots.items():
                if key in observation:
                    observation[key] = with_graph(root, observation[key])
        own_times = own.times
        times['data'] = own_times.get('data', 0.0)
        times['compute'] = own_times.get('compute', 0.0)
        self.last_times = times
        if len(results) == 1:
            self.last_replica_times = [own_times]
            self.loading_modes = [own.loading]
        else:
            self.last_replica_times = [r.times for r in results]
            self.loading_modes = [r.loading for r in results]
        self._publish(observation, times)

    def _publish_loaded(self, values: Dict[str, Any]) -> None:
        """What loading a batch reported (the iterator, the dataset, the converter), into
        the reporter current now, named as it names the model: a one-device window's,
        whose model reports there after it, as under StandardUpdater."""
        try:
            reporter = chainer.reporter.get_current_reporter()
        except IndexError:   # none is current: chainer.report would do nothing either
            return
        reporter.report(self._named(values, reporter))

    def _publish(self, observation: Dict[str, Any], times: Dict[str, float]) -> None:
        """Report the update's ``observation``, with its ``times`` (``report_times``) and
        the restarts so far (``max_worker_restarts``)."""
        if self.report_times:
            for key, value in times.items():
                observation[_TIME_KEYS.get(key) or UPDATER_KEYS + '/time/' + key] = value
        if self._restart_log is not None:
            self._restart_log.report(observation)
        if not observation:
            return
        try:
            reporter = chainer.reporter.get_current_reporter()
        except IndexError:   # none is current: chainer.report would do nothing either
            return
        reporter.report(self._named(observation, reporter))

    def _named(self, observation: Dict[str, Any], reporter: chainer.Reporter
               ) -> Dict[str, Any]:
        """``observation`` with each key the replicas reported through a link of the model
        (``(model)/...``, :data:`~mgpu_updater._replica.MODEL_OBSERVER`) named as
        ``reporter`` names that link: 'main/...' in this updater's Trainer; 'gen/...'
        where the script registered the model so (the model of a second updater that an
        extension runs), as its reports under ``StandardUpdater`` would be named. A key
        reported without an observer stays as it is. Each key's name is found once per
        reporter."""
        if self._names_for is not reporter:
            self._names_for, self._key_names, self._link_names = reporter, {}, {}
        names = self._key_names
        out = {}
        for key, value in observation.items():
            name = names.get(key)
            if name is None:
                name = names[key] = self._key_name(key, reporter)
            out[name] = value
        return out

    def _key_name(self, key: str, reporter: chainer.Reporter) -> str:
        if key.startswith(UPDATER_KEYS + '/'):   # the updater's own: the model's name
            return self._link_name(MODEL_OBSERVER, reporter) + key[len(UPDATER_KEYS):]
        if not key.startswith(MODEL_OBSERVER):
            return key
        prefix = key   # the longest observer name that key starts with: the link's
        while prefix not in self._observer_links():
            prefix = prefix[:max(prefix.rfind('/'), 0)]
            if not prefix:
                return key
        return self._link_name(prefix, reporter) + key[len(prefix):]

    def _observer_links(self) -> Dict[str, chainer.Link]:
        """The replicas' observer names of the model's links -> those links."""
        if self._observed is None:
            self._observed = {MODEL_OBSERVER + (path if path != '/' else ''): link
                              for path, link in self._optimizer.target.namedlinks()}
        return self._observed

    def _link_name(self, observer: str, reporter: chainer.Reporter) -> str:
        """The name ``reporter`` gives the link the replicas name ``observer``; one it was
        not given (where StandardUpdater's report would raise) is named after the model:
        its name, or 'main', and the link's path."""
        name = self._link_names.get(observer)
        if name is None:
            probe: Dict[str, Any] = {}
            with reporter.scope(probe):
                try:
                    reporter.report({'': 0.0}, self._observer_links()[observer])
                except KeyError as exc:
                    if not chainer_private.is_unregistered_observer_error(exc):
                        raise
            if probe:
                name = next(iter(probe))[:-1]
            elif observer == MODEL_OBSERVER:
                name = 'main'
                if name in chainer_private.observer_names(reporter):
                    warn(
                        'the model is not registered with the reporter current at this '
                        "update, which names another observer 'main' (the Trainer's "
                        "updater's model): this update's values are reported as main/*, in "
                        "that one's place, where StandardUpdater's report would raise "
                        "KeyError. Register the model under a name of its own "
                        "(trainer.reporter.add_observer('gen', model) and "
                        "add_observers('gen', model.namedlinks(skipself=True)))",
                        RuntimeWarning, stacklevel=5)
            else:
                name = self._link_name(MODEL_OBSERVER, reporter) + observer[
                    len(MODEL_OBSERVER):]
            self._link_names[observer] = name
        return name

    # ------------------------------------------------------------------ state
    def serialize(self, serializer: Any) -> None:
        """Everything needed for an exact resume (see :mod:`._checkpoint`): the model, the
        optimizer, every replica's iterator (as of the last batch used, prefetch
        notwithstanding), the iteration, the layout (number of devices,
        accumulate_steps), the step in flight (pipelined), the chunk sizes 'auto' found."""
        saving = _checkpoint.saving(serializer)
        if saving and self._ended is not None:
            self._new_pass_if_reset()   # a reset since the end: the replicas' new pass
        if saving:
            self._check_late()   # a snapshot holds no step whose loss was not looked at
            if self._taken_at_start is None:   # never started: of iterators another
                _positions.warn_if_marked(self._worker_iterators)   # updater read?
        else:
            self._late.drop()    # the run it belonged to is replaced
        if saving and self._positions_lost is not None:
            raise RuntimeError(
                f"{self._positions_lost}, and the worker processes' iterator positions "
                'went with it: a snapshot now would put replicas 1 and up back '
                'at the start of their shards, and a run resumed from it would train on '
                'other samples than the run it continues. Resume from a snapshot taken '
                'before the failure')
        _checkpoint.serialize_counters(self, serializer)
        if saving:
            _checkpoint.save_epoch_flags(serializer, self._epoch_view)
            main = self._loader.state() if self._loader else capture_state(
                self.get_iterator('main'))
            _checkpoint.save_iterators(serializer, main, self._worker_iterators,
                                       self._group.states())
            return
        if self._replica is not None:
            # Loading into a running updater: restart so every replica reads the new state.
            self._teardown(abort=False)
            self._finalized = False
        main = self.get_iterator('main')
        _checkpoint.load_iterators(serializer, main, self._worker_iterators)
        _positions.put_back(self._worker_iterators)
        self._positions_lost = None
        self._epoch = None
        flags = _checkpoint.load_epoch_flags(serializer)
        if flags is not None and flags != (main.is_new_epoch,
                                           getattr(main, 'previous_epoch_detail', None)):
            # the update's, over its micro-batches: the iterator holds its last one's
            self._epoch = EpochInfo(getattr(main, 'epoch', None),
                                    getattr(main, 'epoch_detail', None), flags[1], flags[0])
        # taken at the end of the data: a reset of the main iterator next starts a new pass
        # on every replica, as after an end met here
        self._ended = capture_state(main) if (
            getattr(main, 'repeat', True) is False and getattr(main, 'epoch', 0) > 0) \
            else None

    # ------------------------------------------------------------------ shutdown
    def _main_read(self) -> Any:
        """The main iterator the master's replica reads: the one it started with, where
        the script has put another into ``updater._iterators`` since."""
        taken = self._taken_at_start
        return self.get_iterator('main') if taken is None else taken[3]

    def _teardown(self, abort: bool, by_interrupt: bool = False) -> None:
        dropped = getattr(self, '_release_when_dropped', None)
        if dropped is not None:
            dropped.detach()   # released here, now
        if abort:
            self._step.drop()
            self._late.drop()
        else:   # keep the gradient in flight, off the buffers that are about to go
            self._step.detach()
        group, self._group = self._group, ClosedGroup()
        states = None   # the workers' iterator states, asked before they stop
        interrupted: Optional[BaseException] = None
        if self._worker_iterators and not isinstance(group, ClosedGroup):
            if abort:   # they went with the failed update
                self._positions_lost = (f'update {self.iteration + 1} '
                                        f"{'was interrupted' if by_interrupt else 'failed'}")
            else:
                try:   # a worker that does not answer soon is stopped with the rest
                    states = group.states(timeout=_STATES_AT_END_TIMEOUT)
                except BaseException as exc:  # noqa: BLE001 - stop the rest first
                    self._positions_lost = \
                        f'a worker did not give its iterator position at the end ({exc})'
                    if not isinstance(exc, Exception):   # Ctrl-C: after the workers stop
                        interrupted = exc
            if self._positions_lost is not None:
                _positions.lost(self._worker_iterators,
                                f'the updater that read it stopped: {self._positions_lost}')
        loader = self._loader
        try:
            group.close(abort=abort)
            if not isinstance(group, ClosedGroup):
                self._detached = group.detached()
        finally:
            binding = getattr(self, '_binding', None)
            if binding is not None:
                binding.restore()
            # forgotten first: a second Ctrl-C in the loader's bounded wait for its
            # thread left it recorded, closed, and every later update raised
            self._loader, self._replica = None, None
            self._finalized = True
            if loader is not None:
                loader.close()
        # the main iterator as of the last batch used, where the loader read further: its
        # thread stopped (no read between this look and its stop), the state taken as it
        # read (the iterator's serialize is not called before the replicas stop)
        used = loader.read_ahead_state() if loader is not None else None
        # Every iterator the master holds where its replica was (what StandardUpdater's
        # would be): a snapshot taken now, or another updater built on them, reads them.
        # (The one the replica read, where another was put in updater._iterators since.)
        main = self._main_read()
        if used is not None:
            _checkpoint.set_back(main, used)
        if states is not None:
            _checkpoint.keep_positions(main, self._worker_iterators, states)
            _positions.put_back(self._worker_iterators)
            for rank, it in enumerate(self._worker_iterators, start=1):
                state = states.get(rank)
                if state is not None and _checkpoint.saves_nothing(state):
                    # nothing came back: warned at a start
                    _positions.lost([it], f'its serialize() ({type(it).__name__}) saves '
                                    'nothing, so its position could not come back from '
                                    'the worker process (give serialize the position, as '
                                    "SerialIterator's saves current_position, epoch, "
                                    'is_new_epoch and order)')
        if interrupted is not None:
            raise interrupted

    def finalize(self) -> None:
        """Stop every worker (bounded), release shared memory, finalize the iterators.
        Safe to call twice, and after a failure. The iterators are left where each
        replica was; an :meth:`update` after it starts the workers again from there
        (not after a failed update, whose workers' positions went with it). Under ``nonfinite='raise'`` with the
        master's loss on a GPU, the last update's loss is looked at first: a non-finite
        one raises :class:`NonFiniteLossError` once all is released, or, where an
        exception is already on its way (``finalize`` in a ``finally`` block, as the
        Trainer calls it), is a RuntimeWarning. In a child forked (``os.fork``) from the
        process that runs the updater (the Trainer's ``finally`` in a child that an
        extension forked, exiting), nothing: the workers and memory are the parent's."""
        if self._owner is not None and os.getpid() != self._owner:
            return
        in_flight = sys.exc_info()[1] is not None
        found: Optional[tuple] = None
        failed: Optional[BaseException] = None
        unsent, self._unsent = self._unsent, None
        try:
            found = self._late.take()
        except Exception as exc:  # noqa: BLE001 - the copy never came: release all first
            failed = exc
        try:
            self._teardown(abort=False)
        finally:
            # (as StandardUpdater's: also one the script put in updater._iterators since)
            read, now = self._main_read(), self.get_iterator('main')
            for it in [read] + ([now] if now is not read else []) + self._worker_iterators:
                try:
                    it.finalize()
                except Exception:  # noqa: BLE001 - finalize must not fail half-way
                    pass
        if unsent is not None and not in_flight and failed is None:
            # a check in progress, or a run shorter than their interval: after the
            # release, so that a warning turned into an error (-W error) leaves nothing
            unsent.finish()
        if failed is not None and not in_flight:
            raise failed
        if found is not None:
            error = NonFiniteLossError(*found, applied=True)
            if in_flight:
                warn(str(error), RuntimeWarning)
            else:
                raise error


_TIME_KEYS = {key: UPDATER_KEYS + '/time/' + key
              for key in ('data', 'compute', 'comm', 'update')}
#: seconds finalize() waits for the workers' iterator positions before it stops them
_STATES_AT_END_TIMEOUT = 5.0


def _publisher_of(updater: 'weakref.ref[ParallelAccumulatingUpdater]'
                  ) -> Callable[[Dict[str, Any]], None]:
    """The updater's :meth:`~ParallelAccumulatingUpdater._publish_loaded`, held weakly."""
    def publish(values: Dict[str, Any]) -> None:
        held = updater()
        if held is not None:
            held._publish_loaded(values)
    return publish


def _release(owner: int, group: Group, loader: Optional[Loader],
             late: Optional[_late_check.LateCheck] = None,
             binding: Optional[_threads.ThreadBinding] = None,
             worker_iterators: Optional[List[Any]] = None) -> None:
    """What an updater that was dropped without :meth:`~ParallelAccumulatingUpdater.
    finalize` leaves: its workers (stopped as finalize stops them) and its shared memory,
    its loader's thread, the cores it bound the master's thread to (else the process
    went on on one core: the collector runs in the thread that dropped the updater, the
    main thread as a rule); and the loss of its last update where it was still on its way
    (``nonfinite='raise'``, a master alone on a GPU): a non-finite one is a RuntimeWarning,
    there being nobody to raise to. Runs from ``weakref.finalize``: when the updater is
    garbage, or at the interpreter's exit; it must not raise. The workers' iterator
    positions go with it (an updater built on the same iterators warns: _positions).
    The master's iterator stays where its loader read ahead: this runs whenever the
    updater is collected, when the script or another updater may have moved the iterator
    since, which setting it back would undo. Nothing in a child forked from the ``owner``
    process (``os.fork``), which inherited the updater: its workers and shared memory are
    the parent's, still training."""
    if os.getpid() != owner:
        return
    if worker_iterators:
        _positions.lost(worker_iterators, 'the updater that read it was dropped without '
                                          'finalize()')
    found = None
    try:
        found = late.take() if late is not None else None
    except Exception:  # noqa: BLE001 - the device may be gone at the interpreter's exit
        pass
    try:
        group.close(abort=False)
    except Exception:  # noqa: BLE001 - nobody to tell; the pool's own exit hook remains
        pass
    finally:
        if binding is not None:
            binding.restore()
        if loader is not None:
            loader.close()
        if found is not None:
            warn(str(NonFiniteLossError(*found, applied=True)), RuntimeWarning)


# help(), inspect.signature() and the API reference read a class's signature from its
# __new__ where it has one: it is __init__'s
ParallelAccumulatingUpdater.__new__.__signature__ = inspect.signature(  # type: ignore
    ParallelAccumulatingUpdater.__init__)

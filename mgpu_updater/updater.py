"""ParallelAccumulatingUpdater: the master side."""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy

import chainer
from chainer.dataset import convert
from chainer.training.updaters import StandardUpdater

from . import _inherit, _loss_binding, _validate
from ._chunks import Chunking
from ._flat_buffers import ModelLayouts
from ._groups import ClosedGroup, Group, ReduceHandle, SoloGroup
from ._local.group import LocalGroup, payload_factory
from ._replica import (Replica, Scaling, WindowResult, combine, observers, total_loss,
                       with_graph)
from ._checkpoint import capture_state, load_state, write_state
from ._loader import EpochInfo, Loader, make_loader
from ._timing import Stopwatch
from .errors import NonFiniteLossError


class ParallelAccumulatingUpdater(StandardUpdater):
    """Data-parallel updater with gradient accumulation, one process per extra device.

    Each :meth:`update`:

    1. The master broadcasts its parameters and persistents (BatchNorm statistics) to
       every worker (sync point 1).
    2. Every replica, the master included, runs ``accumulate_steps`` micro-batches from
       its own iterator, accumulating gradients with no communication in between. The
       next micro-batches are loaded meanwhile in a background thread (``prefetch``).
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
            accepted with one device); see :func:`mgpu_updater.shard_iterators`.
        optimizer: a set-up Chainer optimizer; its target is the model.
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
        prefetch: micro-batches loaded ahead per replica (0 turns it off).
        report_times: report ``main/time/{data,compute,comm,update}`` every update.
        nonfinite: ``'raise'`` (default) raises :class:`NonFiniteLossError` naming the
            update when its loss is NaN or infinite, before the parameters change;
            ``'skip'`` warns and skips that update. With dynamic loss scaling
            (``optimizer.loss_scaling()``) Chainer itself skips such steps and lowers the
            scale, so the policy does not apply.
        pipelined: opt-in (as ChainerMN's ``double_buffering``): the gradient of update
            t is reduced into a second set of buffers and applied one update late, so
            update t+1's gradient was computed on parameters one step stale (no
            overlap is realised yet: see README, "Pipelined update"). The first update applies nothing. Reports stay
            those of the window just computed.
        start_method: ``'spawn'`` (default) or ``'forkserver'``.
        start_timeout: seconds the workers get to start and report ready.
        communicator: a ChainerMN communicator: run across MPI ranks, one device per rank.
    """

    def __init__(self, iterators: Any, optimizer: chainer.Optimizer, *,
                 devices: Union[Sequence[Any], Dict[str, Any]],
                 accumulate_steps: int = 1,
                 converter: Callable = convert.concat_examples,
                 loss_func: Optional[Callable] = None,
                 prefetch: int = 2,
                 report_times: bool = True,
                 nonfinite: str = 'raise',
                 pipelined: bool = False,
                 start_method: str = 'spawn',
                 start_timeout: float = 120.0,
                 communicator: Any = None,
                 auto_new_epoch: bool = True,
                 loss_reduction: str = 'mean',
                 replica_reduction: str = 'mean',
                 micro_batch_size: Union[None, int, str] = None) -> None:
        self._finalized = False
        self._group: Group = ClosedGroup()
        self.accumulate_steps = _validate.positive_int('accumulate_steps', accumulate_steps)
        self.prefetch = _validate.positive_int('prefetch', prefetch, minimum=0)
        self.nonfinite = _validate.non_finite_policy(nonfinite)
        self.loss_reduction = _validate.loss_reduction(loss_reduction)
        self.replica_reduction = _validate.replica_reduction(replica_reduction)
        self.micro_batch_size = _validate.micro_batch_size(micro_batch_size)
        #: under micro_batch_size='auto': every replica's chunk size as of the last
        #: update (0: the whole batch), in replica order (MPI: rank order); saved in
        #: snapshots
        self.micro_batch_sizes: List[int] = []
        self.start_method = _validate.choice('start_method', start_method,
                                             ('spawn', 'forkserver'))
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)):
            raise TypeError(f'start_timeout must be a number of seconds > 0 '
                            f'({start_timeout!r} of type {type(start_timeout).__name__} '
                            'given); pass e.g. start_timeout=120')
        if not start_timeout > 0:   # also refuses NaN
            raise ValueError(f'start_timeout must be a number of seconds > 0 '
                             f'({start_timeout!r} given); pass e.g. start_timeout=120')
        self.start_timeout = float(start_timeout)
        self.report_times = bool(report_times)
        if not isinstance(pipelined, bool):
            raise TypeError(f'pipelined must be True or False ({pipelined!r} given)')
        self.pipelined = pipelined
        self._pending: Optional[_DeferredStep] = None
        self._devices, self.device_labels = _validate.devices(devices)
        its = _validate.iterators(iterators, len(self._devices))
        model = _validate.optimizer(optimizer)
        _validate.callable_or_none('converter', converter)
        _validate.callable_or_none('loss_func', loss_func)
        if converter is None:
            raise TypeError('converter must be callable (None given); the default is '
                            'chainer.dataset.concat_examples')
        self._communicator = communicator
        if communicator is not None and len(self._devices) != 1:
            raise ValueError(f'with a ChainerMN communicator each rank drives one device; '
                             f'devices has {len(self._devices)} ({self.device_labels!r}); '
                             'pass devices=[comm.intra_rank] (GPU) or ["@numpy"]')
        self._worker_iterators = its[1:]
        self._bound_loss: Optional[_loss_binding.LossBinding] = None
        if len(self._devices) > 1:
            self._bound_loss = _loss_binding.find(loss_func, model)
            _validate.worker_payload(model, None if self._bound_loss else loss_func,
                                     converter, self._worker_iterators)
        super().__init__(its[0], optimizer, converter=converter, device=self._devices[0],
                         loss_func=loss_func, auto_new_epoch=auto_new_epoch)
        self._replica: Optional[Replica] = None
        self._loader: Optional[Loader] = None
        self._epoch: Optional[EpochInfo] = None
        self._nominal_samples = float(self.accumulate_steps * sum(
            getattr(it, 'batch_size', 1) or 1 for it in its))
        self._skipped = 0
        #: seconds of the last update: 'data', 'compute', 'comm', 'update'
        self.last_times: Dict[str, float] = {}

    # ------------------------------------------------------------------ epoch bookkeeping
    # The master's loader runs ahead of training; the epoch is that of the last batch used.
    @property
    def epoch(self) -> int:
        return self._epoch.epoch if self._epoch else self._iterators['main'].epoch

    @property
    def epoch_detail(self) -> float:
        return self._epoch.epoch_detail if self._epoch else self._iterators['main'].epoch_detail

    @property
    def previous_epoch_detail(self) -> Optional[float]:
        if self._epoch:
            return self._epoch.previous_epoch_detail
        return self._iterators['main'].previous_epoch_detail

    @property
    def is_new_epoch(self) -> bool:
        return self._epoch.is_new_epoch if self._epoch else self._iterators['main'].is_new_epoch

    @property
    def n_devices(self) -> int:
        return len(self._devices) if self._communicator is None else self._communicator.size

    def worker_pids(self) -> List[int]:
        """Process ids of the running workers (empty before the first update)."""
        return self._group.pids()

    # ------------------------------------------------------------------ start-up
    def _start(self) -> None:
        model = self._optimizers['main'].target
        master_device = self._devices[0]
        # The loader first: it reads the first batch here, so a MultiprocessIterator forks
        # its pool before any BLAS call (see _loader.Prefetcher).
        self._loader = make_loader(self._iterators['main'], self.converter, master_device,
                                   self.prefetch)
        _initialize_lazy_params(model, self.loss_func, self._iterators['main'],
                                self.converter, master_device)
        self._replica = Replica(model, self.loss_func, self._loader, self.accumulate_steps,
                                self._scaling(self._iterators['main']),
                                name=f'replica 0 ({self.device_labels[0]})', keep_graphs=True,
                                chunking=self._chunking(self._own_index()))
        self._group = SoloGroup(model)
        if self._communicator is not None:
            from ._multihost import MpiGroup
            self._group = MpiGroup(self._communicator, model, self._nominal_samples)
            self._nominal_samples = self._group.nominal_samples
            self._replica.scaling = self._scaling(self._iterators['main'])
        elif len(self._devices) > 1:
            from . import comm
            layouts = ModelLayouts(model, double_buffered=self.pipelined)
            replica_model = copy.deepcopy(model)
            replica_model.to_device('@numpy')
            for param in replica_model.params():
                param.update_rule = None
            payloads = {}
            config = _inherit.master_config()
            seeds = _inherit.draw_seeds(len(self._worker_iterators))
            for rank, it in enumerate(self._worker_iterators, start=1):
                payloads[rank] = payload_factory(dict(
                    rank=rank, size=len(self._devices), device=self.device_labels[rank],
                    model=replica_model,
                    loss_func=None if self._bound_loss else
                    _loss_binding.swap_model(self.loss_func, model, replica_model),
                    bind_loss_to_model=self._bound_loss, converter=self.converter,
                    iterator=it, prefetch=self.prefetch,
                    accumulate_steps=self.accumulate_steps, scaling=self._scaling(it),
                    chunking=self._chunking(rank), config=config, seed=seeds[rank - 1],
                    comm_name=comm.backend_for(self._devices)), model)
            self._group = LocalGroup(model, layouts, comm.backend_for(self._devices),
                                     master_device, self.device_labels, payloads,
                                     self.start_method, self.start_timeout)

    def _scaling(self, iterator: Any) -> Scaling:
        """The gradient factors of the replica that reads ``iterator`` (see Scaling)."""
        window = self.accumulate_steps * (getattr(iterator, 'batch_size', 1) or 1)
        return Scaling(self.loss_reduction, self.replica_reduction,
                       update_norm=self._nominal_samples, window_norm=float(window))

    def _own_index(self) -> int:
        return 0 if self._communicator is None else self._communicator.rank

    def _chunking(self, index: int) -> Chunking:
        """How replica ``index`` splits its batches: the size given, or under 'auto' the
        size it found before (a resumed run starts there; the whole batch at first)."""
        if self.micro_batch_size != 'auto':
            return Chunking(self.micro_batch_size)
        found = (self.micro_batch_sizes[index]
                 if index < len(self.micro_batch_sizes) else 0)
        return Chunking(int(found) or None, auto=True)

    # ------------------------------------------------------------------ one update
    def update_core(self) -> None:
        if self._finalized:
            raise RuntimeError('this updater was finalized; build a new one to train again')
        try:
            self._update()
        except StopIteration:
            raise
        except BaseException:
            self._teardown(abort=True)
            raise

    def _update(self) -> None:
        if self._replica is None:
            self._start()
        optimizer = self._optimizers['main']
        loss_scale = optimizer._loss_scale
        parity = self.iteration % 2 if self.pipelined else None
        watch = Stopwatch()
        with watch('comm'):
            self._group.begin(loss_scale, parity)
        own = self._replica.run_window(loss_scale)
        with watch('comm'):
            if self.pipelined:
                results, pending = self._group.finish_async(own, parity)
            else:
                results = self._group.finish(own)
        count = sum(r.count for r in results)
        if count == 0:
            raise StopIteration
        if own.epochs:
            # One update spans the window: epoch triggers must see the boundary it crossed.
            first, last = own.epochs[0], own.epochs[-1]
            self._epoch = EpochInfo(last.epoch, last.epoch_detail, first.previous_epoch_detail,
                                    any(e.is_new_epoch for e in own.epochs))
        current = _DeferredStep(count, total_loss(results), loss_scale,
                                 pending if self.pipelined else None)
        if self.pipelined:
            current, self._pending = self._pending, current
            if current is not None:
                with watch('comm'):
                    current.pending.apply(optimizer.target)
        if current is not None:
            with watch('update'):
                self._apply(optimizer, current)
        if self.auto_new_epoch and own.epochs and self._epoch.is_new_epoch:
            optimizer.new_epoch(auto=True)
        self._report(results, own, watch)

    def _apply(self, optimizer: chainer.Optimizer, update: '_DeferredStep') -> None:
        """One optimizer step on the model's summed gradient of ``update``."""
        model = optimizer.target
        # The update's own factor, decided by Scaling with the others (see _replica).
        factor = self._replica.scaling.update(update.count)
        if factor != 1.0:
            for param in model.params():
                if param.grad is not None:
                    param.grad *= factor
        # With dynamic loss scaling a non-finite step is Chainer's to skip (and to lower
        # the scale), exactly as on one device; otherwise the nonfinite policy decides.
        if not math.isfinite(update.loss) and not optimizer._loss_scaling_is_dynamic:
            if self.nonfinite == 'raise':
                raise NonFiniteLossError(self.iteration + 1, update.loss)
            self._skipped += 1
            warnings.warn(f'skipping update {self.iteration + 1}: the loss is {update.loss}',
                          RuntimeWarning)
            return
        for param in model.params():
            param._loss_scale = update.loss_scale
        optimizer.update()

    def _report(self, results: List[WindowResult], own: WindowResult, watch: Stopwatch) -> None:
        observation = combine(results)
        if self.micro_batch_size == 'auto':
            sizes = [r.micro_batch_size or 0 for r in results]
            self.micro_batch_sizes = sizes
            if any(sizes):
                observation['main/micro_batch_size'] = min(s for s in sizes if s)
        for key, root in self._replica.graph_roots.items():
            if key in observation:
                observation[key] = with_graph(root, observation[key])
        times = dict(watch.times)
        times['data'] = own.times.get('data', 0.0)
        times['compute'] = own.times.get('compute', 0.0)
        times.setdefault('update', 0.0)
        self.last_times = times
        if self.report_times:
            observation.update({f'main/time/{k}': v for k, v in times.items()})
        chainer.report(observation)

    # ------------------------------------------------------------------ state
    def serialize(self, serializer: Any) -> None:
        """Everything needed for an exact resume: the model, the optimizer, every
        replica's iterator (as of the last batch used, prefetch notwithstanding), the
        iteration, and the layout (number of devices, accumulate_steps)."""
        optimizer = self._optimizers['main']
        optimizer.serialize(serializer['optimizer:main'])
        optimizer.target.serialize(serializer['model:main'])
        self.iteration = serializer('iteration', self.iteration)
        n_devices = serializer('n_devices', self.n_devices)
        steps = serializer('accumulate_steps', self.accumulate_steps)
        self._skipped = serializer('skipped_updates', self._skipped)
        if self.micro_batch_size == 'auto':
            self._serialize_micro_batch_sizes(serializer, saving=isinstance(
                serializer, chainer.serializer.Serializer))
        saving = isinstance(serializer, chainer.serializer.Serializer)
        self._serialize_pending(serializer['pending'], saving)
        if not saving and (int(n_devices) != self.n_devices
                           or int(steps) != self.accumulate_steps):
            raise ValueError(
                f'this snapshot was taken with {int(n_devices)} device(s) and '
                f'accumulate_steps={int(steps)}, but this updater has {self.n_devices} and '
                f'accumulate_steps={self.accumulate_steps}; resume with the same devices and '
                'accumulate_steps (the iterator shards and the batch composition depend on '
                'both), or load only the model with load_npz(path, model, path="updater/model:main/")')
        if saving:
            self._save_iterators(serializer)
        else:
            self._load_iterators(serializer)

    def _serialize_micro_batch_sizes(self, serializer: Any, saving: bool) -> None:
        """What 'auto' found, so that a resumed run starts at the sizes that fit."""
        sizes = numpy.asarray(self.micro_batch_sizes or [0] * self.n_devices, numpy.int64)
        try:
            sizes = serializer('micro_batch_sizes', sizes if saving else None)
        except KeyError:   # a snapshot taken without 'auto': start from whole batches
            return
        if not saving:
            self.micro_batch_sizes = [int(v) for v in numpy.asarray(sizes).ravel()]

    def _serialize_pending(self, serializer: Any, saving: bool) -> None:
        """The pipelined mode's gradient in flight is state too: save and restore it."""
        model = self._optimizers['main'].target
        present = serializer('present', self._pending is not None)
        if not bool(present):
            if not saving:
                self._pending = None
            return
        if saving:
            grads = self._pending.pending.wait()
            node = serializer['grads']
            for name, _ in model.namedparams():
                node(name, grads[name])
            serializer('count', self._pending.count)
            serializer('loss', self._pending.loss)
            serializer('loss_scale', -1.0 if self._pending.loss_scale is None
                       else self._pending.loss_scale)
            return
        node = serializer['grads']
        grads = {name: node(name, None) for name, _ in model.namedparams()}
        grads = {name: model.xp.asarray(g) for name, g in grads.items()}
        scale = float(serializer('loss_scale', -1.0))
        self._pending = _DeferredStep(int(serializer('count', 0)),
                                       float(serializer('loss', 0.0)),
                                       None if scale < 0 else scale,
                                       ReduceHandle(lambda: grads))

    def _save_iterators(self, serializer: Any) -> None:
        main = self._iterators['main']
        write_state(serializer['iterator:main'],
                    self._loader.state() if self._loader else capture_state(main))
        states = self._group.states()
        for rank, it in enumerate(self._worker_iterators, start=1):
            write_state(serializer[f'iterator:replica{rank}'],
                        states[rank] if rank in states else capture_state(it))

    def _load_iterators(self, serializer: Any) -> None:
        if self._replica is not None:
            # Loading into a running updater: restart so every replica reads the new state.
            self._teardown(abort=False)
            self._finalized = False
        load_state(self._iterators['main'], serializer['iterator:main'])
        self._epoch = None
        for rank, it in enumerate(self._worker_iterators, start=1):
            load_state(it, serializer[f'iterator:replica{rank}'])

    # ------------------------------------------------------------------ shutdown
    def _teardown(self, abort: bool) -> None:
        if self._pending is not None and self._pending.pending is not None:
            if abort:
                self._pending = None
            else:   # keep the gradient in flight, off the buffers that are about to go
                grads = {k: v.copy() for k, v in self._pending.pending.wait().items()}
                self._pending.pending = ReduceHandle(lambda: grads)
        group, self._group = self._group, ClosedGroup()
        try:
            group.close(abort=abort)
        finally:
            if self._loader is not None:
                self._loader.close()
            self._loader = None
            self._replica = None
            self._finalized = True

    def finalize(self) -> None:
        """Stop every worker (bounded), release shared memory, finalize the iterators.
        Safe to call twice, and after a failure."""
        try:
            self._teardown(abort=False)
        finally:
            for it in [self._iterators['main']] + self._worker_iterators:
                try:
                    it.finalize()
                except Exception:  # noqa: BLE001 - finalize must not fail half-way
                    pass


class _DeferredStep:
    """A reduced gradient not applied yet, with what applying it needs."""

    def __init__(self, count: int, loss: float, loss_scale: Optional[float],
                 pending: Optional[ReduceHandle]) -> None:
        self.count, self.loss, self.loss_scale, self.pending = count, loss, loss_scale, pending


def _initialize_lazy_params(model: chainer.Link, loss_func: Optional[Callable],
                            iterator: Any, converter: Callable, device: Any) -> None:
    """Initialise parameters Chainer creates on the first call (``L.Linear(None, n)``)
    with one forward pass on the master, in test mode, without backprop or reports,
    so the replicas start identical and the running statistics stay untouched."""
    if all(p.array is not None for p in model.params()):
        return
    dataset = getattr(iterator, 'dataset', None)
    if dataset is not None and len(dataset) > 0:
        batch = [dataset[0]]
    else:
        batch = copy.deepcopy(iterator).next()
    arrays = convert._call_converter(converter, batch, device)
    func = loss_func if loss_func is not None else model
    reporter = chainer.Reporter()   # what the model reports here is thrown away
    observers(reporter, model)
    with chainer.using_config('train', False), chainer.no_backprop_mode(), \
            reporter.scope({}):
        if isinstance(arrays, tuple):
            func(*arrays)
        elif isinstance(arrays, dict):
            func(**arrays)
        else:
            func(arrays)
    missing = [name for name, p in model.namedparams() if p.array is None]
    if missing:
        raise ValueError(f'parameters {missing} are still uninitialised after one forward '
                         'pass; initialise them explicitly (give in_size) before training')

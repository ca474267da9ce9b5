"""Start-up at the first update: the master's loader and replica, then its group.

The order matters and is kept here in one place:

1. the master's loader first: it reads the first batch in this thread, so that a
   ``MultiprocessIterator`` forks its pool before any BLAS call (see
   :class:`mgpu_updater._loader.Prefetcher`);
2. parameters Chainer creates on the first call (``L.Linear(None, n)``) are initialised by
   one forward pass on the master, so every replica starts from the same values;
3. the group: :class:`~mgpu_updater._groups.SoloGroup` (one device),
   :class:`~mgpu_updater._multihost.MpiGroup` (a ChainerMN communicator: every rank agrees
   on the global nominal samples, which the replica's scaling then uses), or
   :class:`~mgpu_updater._local.group.LocalGroup` (worker processes on this host, each
   given a pickled payload: its replica of the model, iterator, seed, configuration).
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import chainer

from . import _inherit, _loss_binding, _module_globals
from ._chainer_private import (call_converter, persistent_slots, persistent_value,
                               prepare_spectral_norms, set_persistent)
from ._checkpoint import capture_state, saves_nothing, set_back
from ._chunks import Chunking, splits
from ._flat_buffers import ModelLayouts
from ._groups import Group, SoloGroup
from ._loader import Loader, make_loader, plan, reads_in_caller_safely
from ._local.group import LocalGroup, payload_factory
from ._replica import (Replica, Scaling, copy_difference, copy_signature, kept_between_calls,
                       observers, put_back)
from ._warning import warn


class Settings(NamedTuple):
    """What start-up needs from the updater's (validated) arguments."""
    model: chainer.Link
    loss_func: Optional[Callable]
    bound_loss: Optional[_loss_binding.LossBinding]   # loss_func re-bound by link path
    converter: Callable
    iterator: Any                   # the master's
    worker_iterators: List[Any]     # one per worker, rank order
    devices: List[Any]              # Chainer devices, master first
    device_labels: List[str]
    communicator: Any               # ChainerMN communicator or None
    prefetch: Any                   # an int >= 0, or 'auto' (_loader.plan)
    accumulate_steps: int
    pipelined: bool
    start_method: str
    start_timeout: float
    nominal_samples: float          # W: nominal samples of one update, over all replicas
    loss_reduction: str
    replica_reduction: str
    micro_batch_size: Any           # None, an int or 'auto'
    micro_batch_sizes: List[int]    # under 'auto': the sizes found before (a resumed run)
    blas_threads: Optional[int] = None   # each worker's BLAS/OpenMP threads (_threads)
    reuse_host_memory: bool = False      # whether each worker keeps freed memory (_host_memory)
    read_values: bool = True        # the master reads its window's values on the host
    core_shares: Optional[List[Tuple[int, ...]]] = None   # each replica's cores (_threads)
    stall_warning: Optional[float] = None    # seconds before a stalled worker is named
    update_timeout: Optional[float] = None   # ... and before the update gives up
    nonfinite: Optional[str] = None          # the non-finite loss policy (MPI ranks agree)
    restarts: Any = None            # _restarts.RestartLog (max_worker_restarts > 0), or None
    optimizer: Any = None           # the master's optimizer (MPI ranks compare theirs)
    detached: Any = None            # what the last close gave the parameters, or None


class Started(NamedTuple):
    loader: Loader
    replica: Replica
    group: Group
    nominal_samples: float          # as the group agreed (MPI: summed over the ranks)


def loader_plan(s: Settings) -> Tuple[int, bool, bool]:
    """(depth, gated, trial) of every replica's loader (:func:`mgpu_updater._loader.plan`):
    under ``prefetch='auto'`` inline at first, and a trial of the two ways."""
    return plan(s.prefetch)


def start(s: Settings) -> Started:
    """Build the master's loader, replica and group (see the module docstring)."""
    master_device = s.devices[0]
    depth, gated, trial = loader_plan(s)
    own_index = 0 if s.communicator is None else s.communicator.rank
    # A start that fails or is interrupted (Ctrl-C while the workers start) leaves the
    # main iterator where it was: the next start (an update called again) reads from there.
    # (Only a loader with a thread reads at once, and captures states anyway.)
    before = capture_state(s.iterator) if depth > 0 else None
    if before is not None and saves_nothing(before):
        # its serialize saves nothing: what a loader reads ahead cannot be put back where
        # the updater stops, and the iterator, used again, skips those batches
        if s.prefetch == 'auto':
            depth, before = 0, None   # loaded inline (loading_modes: 'none')
        else:
            warn(f'{type(s.iterator).__name__}.serialize() saves nothing, so the batches '
                 f'that prefetch={s.prefetch} loads ahead cannot be put back where the '
                 'updater stops (finalize()): the iterator, used again (trainer.run() '
                 'again, another updater), skips them. Give serialize the position (as '
                 "SerialIterator's saves current_position, epoch, is_new_epoch and "
                 "order), or pass prefetch=0 (or 'auto', which then loads inline)",
                 RuntimeWarning, stacklevel=6)
    made: List[Loader] = []   # a loader with a thread, as soon as it runs
    loader: Optional[Loader] = None
    group: Optional[Group] = None
    lazy = False
    try:
        loader = make_loader(s.iterator, s.converter, master_device, depth, gated,
                             trial=trial, load_here=reads_in_caller_safely(s.iterator),
                             keep_examples=splits(chunking(s, own_index)), made=made,
                             observe=functools.partial(observers, model=s.model),
                             reports_under=_current_reporter())
        if len(s.devices) > 1 or s.communicator is not None or s.pipelined:
            # several replicas must start alike; one (stepping now) initialises them in
            # its first window, as StandardUpdater does
            lazy = initialize_lazy_params(s.model, s.loss_func, s.iterator, s.converter,
                                          master_device)
        if len(s.devices) > 1 or s.communicator is not None:
            # what a first call would draw on each replica, drawn once: the vector u of
            # a SpectralNormalization on a lazy link whose weight was set since (after
            # the pass, which draws it in the forward's order where it calls the link)
            prepare_spectral_norms(s.model)
        nominal = s.nominal_samples
        group = SoloGroup(s.model)
        if s.communicator is not None:
            from ._multihost import MpiGroup   # imports mpi4py
            group = MpiGroup(s.communicator, s.model, nominal, settings={
                'loss_reduction': s.loss_reduction, 'replica_reduction': s.replica_reduction,
                'pipelined': s.pipelined, 'nonfinite': s.nonfinite}, optimizer=s.optimizer)
            nominal = group.nominal_samples
        elif len(s.devices) > 1:
            group = _local_group(s, lazy)
        replica = Replica(s.model, s.loss_func, loader, s.accumulate_steps,
                          scaling(s, s.iterator, nominal),
                          name=(f'replica 0 ({s.device_labels[0]})' if s.communicator is None
                                else f'rank {own_index} ({s.device_labels[0]})'),
                          keep_graphs=True,
                          chunking=chunking(s, own_index),
                          # MPI ranks exchange their results pickled: read them first
                          read_values=s.read_values or s.communicator is not None,
                          one_of_many=len(s.devices) > 1 or s.communicator is not None,
                          before_read=group.settle,
                          initialised_before=s.pipelined)
        return Started(loader, replica, group, nominal)
    except BaseException:
        # each step whatever the one before raised (a second Ctrl-C in a loader's bounded
        # wait for its thread skipped the set-back and the workers' stop)
        try:
            try:
                for thread_loader in made:
                    before = thread_loader.state()   # as of the batches it handed out
                    thread_loader.close()
                if loader is not None and not made:
                    loader.close()
            finally:
                if before is not None:
                    set_back(s.iterator, before)
        finally:
            if group is not None:   # its workers started: stopped, their memory released
                group.close(abort=True)
        raise


def _current_reporter() -> Optional[chainer.Reporter]:
    try:
        return chainer.reporter.get_current_reporter()
    except IndexError:   # none is current
        return None


def scaling(s: Settings, iterator: Any, nominal_samples: float) -> Scaling:
    """The gradient factors of the replica that reads ``iterator`` (see Scaling)."""
    window = s.accumulate_steps * (getattr(iterator, 'batch_size', 1) or 1)
    return Scaling(s.loss_reduction, s.replica_reduction,
                   update_norm=nominal_samples, window_norm=float(window))


def chunking(s: Settings, index: int) -> Chunking:
    """How replica ``index`` splits its batches: the size given, or under 'auto' the size
    it found before (a resumed run starts there; the whole batch at first)."""
    if s.micro_batch_size != 'auto':
        return Chunking(s.micro_batch_size)
    found = s.micro_batch_sizes[index] if index < len(s.micro_batch_sizes) else 0
    return Chunking(int(found) or None, auto=True)


def _copy(model: chainer.Link) -> chainer.Link:
    """A copy of the model for the workers' payload: ``copy.deepcopy``, or where that fails
    on what the workers' pickling takes by reference (a module the model holds,
    ``self.cfg = config``), a round trip through that pickling (cloudpickle), which gives
    the workers what they would get anyway."""
    try:
        return copy.deepcopy(model)
    except TypeError:
        import cloudpickle
        return cloudpickle.loads(cloudpickle.dumps(model))


def _local_group(s: Settings, lazy: bool) -> LocalGroup:
    """Worker processes on this host, one per extra device, each with its payload.
    ``lazy``: a forward pass initialised lazy parameters before the model is copied."""
    from . import comm
    backend = comm.backend_for(s.devices)
    try:
        replica_model = _copy(s.model)
    except Exception as exc:  # noqa: BLE001 - deepcopy raises what pickling raises
        raise _uncopyable(s.model, exc, lazy) from exc
    _refuse_shared(s.model, replica_model)
    signature = copy_signature(s.model)
    differs = copy_difference(signature, copy_signature(replica_model))
    if differs is not None:
        raise RuntimeError(differs)
    replica_model.to_device('@numpy')
    # No gradient travels (the master's, NaN from Chainer's initialisation, doubled the
    # payload): a worker gives NaN ones to the parameters that had one, as Chainer
    # initialises them, for a forward that reads them before the first backward.
    nan_grads = tuple(name for name, param in replica_model.namedparams()
                      if param.array is not None and param.grad is not None)
    for param in replica_model.params():
        param.update_rule = None
        param.grad = None
    config = _inherit.master_config()
    process = _inherit.process_settings()
    module_globals = _module_globals.fingerprints(
        {'model': s.model, 'loss_func': s.loss_func, 'converter': s.converter})
    seeds = _inherit.draw_seeds(len(s.worker_iterators))
    depth, gated, trial = loader_plan(s)
    payloads = {}
    for rank, it in enumerate(s.worker_iterators, start=1):
        payloads[rank] = payload_factory(dict(
            rank=rank, size=len(s.devices), device=s.device_labels[rank],
            model=replica_model, signature=signature,
            loss_func=None if s.bound_loss else
            _loss_binding.swap_model(s.loss_func, s.model, replica_model),
            bind_loss_to_model=s.bound_loss, converter=s.converter,
            iterator=it, prefetch=depth, prefetch_gated=gated, prefetch_trial=trial,
            accumulate_steps=s.accumulate_steps, scaling=scaling(s, it, s.nominal_samples),
            chunking=chunking(s, rank), config=config, process=process,
            module_globals=module_globals,
            seed=seeds[rank - 1],
            blas_threads=s.blas_threads, reuse_host_memory=s.reuse_host_memory,
            cores=s.core_shares[rank] if s.core_shares else None,
            keep_resume=s.restarts is not None, comm_name=backend, nan_grads=nan_grads),
            s.model)
    layouts = ModelLayouts(s.model, double_buffered=s.pipelined)
    return LocalGroup(s.model, layouts, backend, s.devices[0], s.device_labels, payloads,
                      s.start_method, s.start_timeout, s.stall_warning, s.update_timeout,
                      restarts=s.restarts, detached=s.detached)


def _uncopyable(model: chainer.Link, exc: Exception, lazy: bool) -> TypeError:
    """The error for a model that :func:`_copy` fails on, naming the part that fails:
    the deepest link on the way down through the first child that fails alike, then the
    part of it that does not pickle (where pickling is what fails)."""
    from . import _pickle_path
    path, link = 'model', model
    for _ in range(_pickle_path.MAX_DEPTH):
        for child in link.children():
            try:
                _copy(child)
            except Exception:  # noqa: BLE001 - the one that fails alike
                path, link = f'{path}.{child.name}', child
                break
        else:
            break
    culprit = _pickle_path.find(link, path)
    after = (' after its first call (the forward pass that initialised its lazy '
             'parameters; if that call left what cannot be copied, giving the links their '
             'input sizes, L.Linear(784, n), skips it)' if lazy else '')
    return TypeError(
        f'the model ({type(model).__name__}) cannot be copied for the worker '
        f'processes{after}: {type(exc).__name__}: {exc}; the culprit is {culprit.path} '
        f'({_pickle_path.describe(culprit.obj)}). Every worker gets a copy '
        '(copy.deepcopy, then pickling): make that part copyable, or keep it off the model')


def _refuse_shared(model: chainer.Link, replica: chainer.Link) -> None:
    """Raise where the copy holds a link or parameter of the model itself (a
    ``__deepcopy__`` that returns ``self``): the workers' copy would not be one, and
    preparing it (no update rules) would strip the model's own parameters."""
    mine = {id(obj): name for name, obj in list(model.namedlinks()) + list(model.namedparams())}
    for name, obj in list(replica.namedlinks()) + list(replica.namedparams()):
        if id(obj) in mine:
            where = 'model' + (name.replace('/', '.') if name != '/' else '')
            raise TypeError(
                f'copy.deepcopy(model) returned {where} ({type(obj).__name__}) itself, '
                'not a copy: its __deepcopy__ (or that of a link above it) returns the '
                'object it was given. Each worker needs a copy of its own: let Chainer '
                'copy the link (drop the __deepcopy__), or return a deep copy from it')


class _Discarding(chainer.Reporter):
    """Current while the lazy-parameter pass runs: it is no update, so nothing it reports
    (the dataset's reads, the converter, the model, through any observer) is kept (the
    reads and the converter reported into the update that followed)."""

    def report(self, values: Any, observer: Any = None) -> None:
        pass


def initialize_lazy_params(model: chainer.Link, loss_func: Optional[Callable],
                           iterator: Any, converter: Callable, device: Any) -> bool:
    """Initialise parameters Chainer creates on the first call (``L.Linear(None, n)``)
    with one forward pass on the master, in test mode, without backprop or reports, on a
    batch of the iterator's size taken from the start of its dataset, so that the
    replicas start identical; the model's persistents are set back after it (running
    statistics, counters: the pass is no training step), and so is the state its links
    keep in plain attributes (:func:`~mgpu_updater._replica.put_back`). A parameter the pass leaves
    uninitialised (a link no forward calls) stays so in every replica, as under
    ``StandardUpdater``; each replica's window refuses one that a later call initialises
    (:meth:`mgpu_updater._replica.Replica.run_window`). The pass runs for
    ``L.BatchNormalization`` with no size and neither gamma nor beta too, whose only lazy
    part is its running statistics (zeros and ones, made at its first call); not for
    other persistents registered as None, which a first call may fill from its batch, and
    for which the pass would be one call more than ``StandardUpdater`` makes (a counter in
    a plain attribute, a forward that runs only with backprop). Returns whether it ran."""
    if (all(p.array is not None for p in model.params())
            and not any(isinstance(owner, chainer.links.BatchNormalization)
                        and persistent_value(owner, name) is None
                        for _, owner, name in persistent_slots(model))):
        return False
    dataset = getattr(iterator, 'dataset', None)
    size = getattr(iterator, 'batch_size', 1) or 1
    reporter = _Discarding()   # what the reads, the converter and the model report here
    with reporter.scope({}):
        if dataset is not None and len(dataset) > 0:
            what = f'the first {min(size, len(dataset))} samples of the dataset'
            batch = [dataset[i] for i in range(min(size, len(dataset)))]
        else:
            what = 'the first batch of a copy of the iterator'
            batch = copy.deepcopy(iterator).next()
    values = [(owner, name, persistent_value(owner, name))
              for _, owner, name in persistent_slots(model)]
    saved = [(owner, name, copy.deepcopy(value)) for owner, name, value in values
             if value is not None]
    func = loss_func if loss_func is not None else model
    state = kept_between_calls(model, loss_func, copies=True)
    try:
        with reporter.scope({}):
            arrays = call_converter(converter, batch, device)
        # without @static_graph's schedule, which holds what cannot be copied (modules,
        # weak references): each replica builds its own at its first training call
        with chainer.using_config('train', False), \
                chainer.using_config('use_static_graph', False), \
                chainer.no_backprop_mode(), reporter.scope({}):
            if isinstance(arrays, tuple):
                func(*arrays)
            elif isinstance(arrays, dict):
                func(**arrays)
            else:
                func(arrays)
    except Exception as exc:
        exc.add_note(f'(raised in the forward pass that initialises the lazy parameters '
                     f'before the replicas are copied: test mode, no backprop, on {what}. '
                     'An error of the batch, the converter or the model itself comes '
                     "from the first update's forward without this pass; where the "
                     'pass itself is at fault (a forward that needs train mode or '
                     'backprop), give the links their sizes, L.Linear(784, n), '
                     'L.BatchNormalization(n), to skip it)')
        raise
    put_back(state)   # first: a reset_state may touch a persistent too
    for owner, name, value in saved:
        set_persistent(owner, name, value)
    return True

"""The one place that touches Chainer's and ChainerMN's private names.

Chainer 7.8.1 is the final release, so what it keeps private will not move; still, each
function below names the Chainer 7.8.1 (ChainerMN 7.8.1) file and line it depends on, and
``tests/test_chainer_private.py`` pins the upstream behaviour relied on against the
installed Chainer, checks that every ``file:line`` cited here holds what it is cited for,
and that no other module of the package uses these names.

| reach | used by | upstream (7.8.1) | public alternative |
|---|---|---|---|
| `optimizer._loss_scale` | updater | chainer/optimizer.py:560, 750, 757, 879 | none (setter only) |
| `optimizer._loss_scaling_is_dynamic` | updater | chainer/optimizer.py:562, 746, 782 | none |
| `param._loss_scale = s` | updater | chainer/_backprop.py:262; chainer/optimizer.py:259, 291 | partly (a) |
| `convert._call_converter` | _startup, _loader | chainer/dataset/convert.py:125-144 | none (b) |
| `link._persistent`, `link._params`, `Chain._children`, `link.__dict__` | _flat_buffers, _replica, _startup, _unsent_state | chainer/link.py:148-149, 301, 361-363, 381, 663-664, 882, 914, 1051 | none (c) |
| `MultiprocessIterator._state`, `._previous_epoch_detail`, `._reset_state`, `__dict__` | _checkpoint, _payload | chainer/iterators/multiprocess_iterator.py:157-158, 216-238, 253-255, 266-298 | none (d) |
| `MultithreadIterator._state`, `._previous_epoch_detail` | _checkpoint | chainer/iterators/multithread_iterator.py:76-77, 124-137, 159-160 | none (d) |
| `update_rule._use_fp32_update`, `._state` | _checkpoint | chainer/optimizer.py:196, 252-270, 433-462, 473-484 | none |
| `order_sampler._random` | _checkpoint, _payload | chainer/iterators/order_samplers.py:56, 59 | none (e) |
| `communicator._init_comms()` | comm/mpi | chainermn/communicators/pure_nccl_communicator.py:54-57 | none |
| `chainer.config._local` | _inherit | chainer/configuration.py:66, 102 | none (f) |
| `chainer._get_link_hooks()` | _inherit | chainer/__init__.py:127-132; chainer/link_hook.py:137-141 | none |
| `SpectralNormalization._initialized`, `._prepare_parameters` | _startup | chainer/link_hooks/spectral_normalization.py:165, 198-199, 215, 224-226, 252 | none |
| `cuda._resolution_error` | _cuda | chainer/backends/cuda.py:77-78, 133-134 | none (g) |
| `@static_graph`'s wrapper, its schedules and how its backward sets gradients | _replica, _unsent_state | chainer/graph_optimizations/static_graph.py:667-669, 914-918, 1274-1275, 1308-1317 | none |
| reporter's "not registered" KeyError | _replica, updater | chainer/reporter.py:172-173 | none |
| `reporter._observer_names` | updater, _loader | chainer/reporter.py:82, 131, 144 | none |
| Link metaclass `type(DeviceResident)` | _payload | chainer/utils/meta.py:78 | none (h) |
| `SubDataset._dataset`, `._start`, `._order`; `TupleDataset._datasets`; `DictDataset._datasets`; `TransformDataset._dataset`, `._transform` | _iterators | chainer/datasets/sub_dataset.py:50-59, 64-76; chainer/datasets/tuple_dataset.py:38, 41-48; chainer/datasets/dict_dataset.py:27, 30-38; chainer/datasets/transform_dataset.py:44-45, 50-52 | none (i) |

(a) Folding the window's factor into the loss would make backward stamp the right scale on
the master, but pipelined and empty-window updates still need the write. (b)
``StandardUpdater`` itself calls it (chainer/training/updaters/standard_updater.py:246).
(c) ChainerMN makes the same reach (chainermn/extensions/allreduce_persistent.py:5-10).
(d) Their ``serialize`` drops what they loaded ahead; ``MultiprocessIterator``'s
``__getstate__`` resets its worker pool too. (e) Only the sampler's
``random_state`` argument. (f) ``chainer.config.show()`` prints the same names, as text.
(g) ``check_cuda_available`` raises with its text. (h) Made by ``enable_final``, importable
by no name. (i) Their constructors take these, nothing reads them back; indexing a
``TupleDataset`` with an array of indices would give the columns, but would also read every
example of a column that loads lazily (files), which is what must not happen.

``StandardUpdater``'s ``self._iterators`` / ``self._optimizers`` are not wrapped: the public
``get_iterator('main')`` / ``get_optimizer('main')`` replace them.

Not Chainer's, kept at their site: CPython's ``shared_memory._posixshmem.shm_unlink``
(``comm/shm.py``, explained there). No CuPy private is used. Also kept at their site, as
they read no private attribute: the names of the configuration entries Chainer sets itself
(``_inherit._NOT_SENT``, citing ``chainer/__init__.py:219, 235-236``), and the import-time
shims of ``_compat.py`` (a stub ``numpy.distutils``, ``numpy.sctypes``,
``CHAINER_CUDNN=0``, all set before ``import chainer``, citing the lines they answer).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import numpy

import chainer
from chainer.dataset import convert
from chainer.device_resident import DeviceResident
from chainer.functions.util.forget import Forget
from chainer.graph_optimizations import static_graph


# --------------------------------------------------------------------------------------
# Loss scaling


def loss_scale(optimizer: chainer.Optimizer) -> Optional[float]:
    """The optimizer's loss scale: None without loss scaling, else the (current) factor.

    Reads ``optimizer._loss_scale``: a class attribute ``None`` (chainer/optimizer.py:560),
    set by ``loss_scaling`` (chainer/optimizer.py:750 dynamic, starting at 1.0;
    chainer/optimizer.py:757 static) and passed by ``Optimizer.update`` to
    ``backward(loss_scale=...)`` (chainer/optimizer.py:879).
    """
    return optimizer._loss_scale


def loss_scaling_is_dynamic(optimizer: chainer.Optimizer) -> bool:
    """Whether the optimizer scales the loss dynamically (``loss_scaling()`` without
    ``scale``): then it skips a non-finite step and lowers the scale itself.

    Reads ``optimizer._loss_scaling_is_dynamic`` (chainer/optimizer.py:562 default False,
    chainer/optimizer.py:746 set by ``loss_scaling``; read by ``update_loss_scale``,
    chainer/optimizer.py:782).
    """
    return bool(optimizer._loss_scaling_is_dynamic)


def set_update_loss_scale(model: chainer.Link, scale: Optional[float]) -> None:
    """Tell every parameter of ``model`` by what its gradient is scaled before the step.

    ``UpdateRule.update`` reads ``param._loss_scale`` (chainer/optimizer.py:259) and
    divides the gradient by it before ``update_core`` (chainer/optimizer.py:291; None:
    no division). On one device the value comes from ``backward(loss_scale=s)``, which
    stamps ``s`` onto every leaf it reached (chainer/_backprop.py:262). Here each backward
    stamps None (:func:`backward_scaled`), and the summed gradient the optimizer steps on
    is scaled by the optimizer's loss scale: so this writes that ``scale`` onto every
    parameter (also those no backward reached this time, whose stamp would be stale) just
    before ``optimizer.update()``. It walks the model (about 70 us for ResNet-50's 162
    parameters on a 2-core AMD EPYC VM), so the updater calls it only where a stamp is
    not None or may not be.
    """
    for param in model.params():
        param._loss_scale = scale


def backward_scaled(loss: chainer.Variable, factor: float,
                    loss_scale: Optional[float] = None) -> None:
    """``loss.backward(loss_scale=loss_scale)``'s gradient times ``factor``, leaving every
    leaf's stamp None.

    ``Variable.backward`` seeds a one-element loss's gradient with ``ones_like`` and,
    given ``loss_scale``, multiplies it in place by it (chainer/variable.py:1568-1571),
    then stamps ``loss_scale`` onto every leaf it reaches (chainer/_backprop.py:262), which
    the update rule divides the gradient by before its step. A replica's factor (its part
    of the update) times the optimizer's loss scale is no scale for the step to undo, so
    the same seed is made here, by the same operations (the same bits in any dtype), and
    the backward runs without ``loss_scale``: its stamps are None, as a plain backward's,
    and the master writes none before its step unless the optimizer scales the loss
    (:func:`set_update_loss_scale`). A gradient the loss was given before (``loss.grad =
    w``, a weight) is the seed as it is there, not scaled by ``loss_scale``
    (chainer/variable.py:1558): here it is multiplied by ``factor`` alone.
    """
    preset = loss.grad
    if preset is not None:
        if factor != 1.0:
            seed = preset.copy()
            seed *= factor   # in place: its dtype and shape stay
            loss.grad = seed
    else:
        scale = factor
        if loss_scale is not None:
            scale *= loss_scale
        if scale != 1.0:
            with chainer.using_device(loss.device):
                seed = loss.device.xp.ones_like(loss.array)
            seed *= scale
            loss.grad = seed
    loss.backward()


# --------------------------------------------------------------------------------------
# Converters


def optimizer_fingerprint(optimizer: chainer.Optimizer) -> Tuple[Any, ...]:
    """What decides one optimizer's step beside the gradient, comparable between processes:
    its class, its own hyperparameters (``lr``, ``momentum``, Adam's ``alpha``...; not
    those set on one parameter's update rule) and its hooks, by timing, name and class,
    with the settings of Chainer's own (``WeightDecay``'s ``rate``; a user's hook may keep
    what it measured in its attributes, which no two ranks share). NaN compares equal to
    NaN. The hooks are kept in the private dicts of the optimizer's ``_hookable``
    (chainer/optimizer.py:591), its ``_pre_update_hooks`` and ``_post_update_hooks``
    (:29-30)."""
    hooks = []
    for timing, name, hook in optimizer_hooks(optimizer):
        kind = type(hook)
        settings = ()
        if kind.__module__.startswith('chainer.optimizer_hooks'):
            settings = tuple(sorted((k, _comparable(v)) for k, v in vars(hook).items()
                                    if isinstance(v, (bool, int, float, str))))
        hooks.append((timing, name, f'{kind.__module__}.{kind.__qualname__}', settings))
    kind = type(optimizer)
    return (f'{kind.__module__}.{kind.__qualname__}',
            tuple(sorted((k, _comparable(v))
                         for k, v in optimizer.hyperparam.get_dict().items())),
            tuple(hooks))


def optimizer_hooks(optimizer: chainer.Optimizer) -> List[Tuple[str, str, Any]]:
    """``(timing, name, hook)`` of each hook ``optimizer.add_hook`` added, ``'pre'`` ones
    first, each timing in the order added. They are kept in the private dicts of the
    optimizer's ``_hookable`` (chainer/optimizer.py:591), its ``_pre_update_hooks`` and
    ``_post_update_hooks`` (:29-30)."""
    hookable = getattr(optimizer, '_hookable', None)
    return [(timing, name, hook) for timing in ('pre', 'post')
            for name, hook in (getattr(hookable, f'_{timing}_update_hooks', None)
                               or {}).items()]


def _comparable(value: Any) -> Any:
    """A hyperparameter as ``==`` can compare it after pickling: NaN as a string, an
    array or numpy scalar as its values."""
    if isinstance(value, numpy.ndarray):
        return ('array', value.shape, str(value.dtype),
                tuple(_comparable(v) for v in value.ravel().tolist()))
    if isinstance(value, numpy.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return 'nan'
    return value


def call_converter(converter: Any, batch: Any, device: Any) -> Any:
    """``converter(batch, device)`` as ``StandardUpdater`` calls it.

    ``convert._call_converter`` (chainer/dataset/convert.py:125-144) passes a
    ``chainer.backend.Device`` to a converter made with ``@chainer.dataset.converter()``
    and the old-style integer device id (-1 on the CPU) to a plain function;
    ``StandardUpdater.update_core`` calls it the same way
    (chainer/training/updaters/standard_updater.py:246).
    """
    return convert._call_converter(converter, batch, device)


# --------------------------------------------------------------------------------------
# Persistents of a link


def named_persistents(link: chainer.Link) -> Iterator[Tuple[str, Any]]:
    """``(path, value)`` of every persistent value of ``link`` and its sublinks (BatchNorm's
    running mean and variance, its counter ``N``...): links in ``namedlinks`` order, names
    sorted within a link; the path is ``/name`` on ``link`` itself, ``/sub/name`` below.

    Reads ``link._persistent``, the set of names (chainer/link.py:149, filled by
    ``add_persistent`` chainer/link.py:361 and ``register_persistent``
    chainer/link.py:381), and the values from ``link.__dict__`` where ``add_persistent``
    puts them (chainer/link.py:363) and ``Link.serialize`` reads them
    (chainer/link.py:663-664). ChainerMN does the same
    (chainermn/extensions/allreduce_persistent.py:5-10).
    """
    for path, owner, name in persistent_slots(link):
        yield path, persistent_value(owner, name)


def persistent_slots(link: chainer.Link) -> List[Tuple[str, chainer.Link, str]]:
    """``(path, owner, name)`` of every persistent value of ``link`` and its sublinks, in
    :func:`named_persistents`' order; :func:`persistent_value` reads each one, so that a
    caller that keeps this list reads the current values without walking the links again."""
    return [((f'{path}/{name}' if path != '/' else f'/{name}'), sub, name)
            for path, sub in link.namedlinks() for name in sorted(sub._persistent)]


#: The private attributes of Chainer's links that hold the user's objects: a link's hooks
#: (chainer/link.py:184), a ``ChainList``'s links (:1051; a ``Chain``'s ``_children`` is a
#: set of their names, :882) and what a ``Sequential`` calls, links and functions
#: (chainer/sequential.py:123).
LINK_HOOKS, CHAIN_LIST_LINKS, SEQUENTIAL_LAYERS = '_local_link_hooks', '_children', '_layers'


def persistent_names(link: chainer.Link) -> FrozenSet[str]:
    """The names of the persistent values of ``link`` itself (``link._persistent``, see
    :func:`named_persistents`)."""
    return frozenset(link._persistent)


def registered_names(link: chainer.Link) -> FrozenSet[str]:
    """The names of ``link``'s own parameters, persistents and (a ``Chain``'s) child links:
    ``link._params`` and ``link._persistent`` (chainer/link.py:148-149, filled by
    ``Link.__setattr__`` in ``init_scope`` chainer/link.py:301), and ``Chain._children``
    (chainer/link.py:882, 914); a ``ChainList``'s children are no attributes
    (chainer/link.py:1051). What else ``link.__dict__`` holds is the link's own plain
    attributes (an RNN link's state, a value its first call made)."""
    children = getattr(link, '_children', ())
    return frozenset(link._params) | frozenset(link._persistent) | frozenset(
        name for name in children if isinstance(name, str))


def persistent_value(link: chainer.Link, name: str) -> Any:
    """The persistent value ``name`` of ``link`` itself, from ``link.__dict__`` (see
    :func:`named_persistents`)."""
    return link.__dict__[name]


def set_persistent(link: chainer.Link, name: str, value: Any) -> None:
    """Set the persistent value ``name`` of ``link`` itself (a name, not a path).

    Writes ``link.__dict__[name]`` as ``Link.serialize`` does on load
    (chainer/link.py:663-664), bypassing ``Link.__setattr__``.
    """
    link.__dict__[name] = value


# --------------------------------------------------------------------------------------
# Iterators


def multiprocess_iterator_state(it: chainer.iterators.MultiprocessIterator) -> Dict[str, Any]:
    """What ``it.serialize`` would write (the same keys and values), read without side
    effects: ``current_position``, ``epoch``, ``is_new_epoch``, ``order`` (a copy, or None
    when it does not shuffle) and ``previous_epoch_detail``.

    Its ``serialize`` (chainer/iterators/multiprocess_iterator.py:216-238) resets the
    iterator (``_reset_state``, chainer/iterators/multiprocess_iterator.py:253-255, resets
    the worker pool's communicator, discarding what it prefetched) and fails without an
    order. This reads the state it keeps instead: ``_state`` and
    ``_previous_epoch_detail``, set on every batch
    (chainer/iterators/multiprocess_iterator.py:157-158) and by ``_reset_state``
    (chainer/iterators/multiprocess_iterator.py:253).
    """
    state = it._state
    return {'current_position': state.current_position, 'epoch': state.epoch,
            'is_new_epoch': state.is_new_epoch,
            'order': None if state.order is None else state.order.copy(),
            'previous_epoch_detail': it._previous_epoch_detail}


def fresh_rule_state(rule: Any, param: chainer.Parameter) -> Dict[str, Any]:
    """The state ``rule``'s first update would create for ``param``, made on a copy of the
    rule (``rule`` keeps none): ``init_state`` on the parameter, or on its float32 copy
    under ``use_fp32_update`` (``UpdateRule.__update`` and ``_init_states``,
    chainer/optimizer.py), as ``UpdateRule.serialize`` makes one on a copy to learn the
    entries' names. Reads ``rule._use_fp32_update`` and sets the copy's ``_state``."""
    target: Any = param
    if rule._use_fp32_update and param.dtype == numpy.float16:
        target = chainer.Variable(param.array.astype(numpy.float32))
    twin = copy.copy(rule)
    twin._state = {}
    with chainer.using_device(chainer.backend.get_device_from_array(target.array)):
        twin.init_state(target)
    return dict(twin._state)


def load_unshuffled_multiprocess_iterator(it: chainer.iterators.MultiprocessIterator,
                                          deserializer: Any) -> bool:
    """Load ``it`` from ``deserializer`` as its ``serialize`` would, where that fails: an
    iterator that does not shuffle has no order, and its ``serialize``
    (chainer/iterators/multiprocess_iterator.py:216-238) copies it first
    (``self._state.order.copy()``), also to load. Sets the state as it would
    (``_reset_state``, :253-255) and ``_previous_epoch_detail``. False where the iterator
    has an order (then its own ``serialize`` loads it)."""
    if it._state.order is not None:
        return False
    current_position = int(deserializer('current_position', it.current_position))
    epoch = int(deserializer('epoch', it.epoch))
    is_new_epoch = bool(deserializer('is_new_epoch', it.is_new_epoch))
    it._reset_state(current_position, epoch, is_new_epoch, None)
    it._previous_epoch_detail = float(deserializer('previous_epoch_detail',
                                                   it._previous_epoch_detail))
    return True


def multithread_iterator_state(it: chainer.iterators.MultithreadIterator) -> Dict[str, Any]:
    """What ``it.serialize`` would write (the same keys and values), read without side
    effects: ``current_position``, ``epoch``, ``is_new_epoch``, ``_order`` (a copy, or
    None when it does not shuffle) and ``previous_epoch_detail`` (-1. before the first
    batch).

    Its ``serialize`` (chainer/iterators/multithread_iterator.py:124-137) drops the batch
    it loads ahead (``self._next = None``, :137), so that its next ``next()`` reads that
    batch again and, at the end of an epoch, draws the next epoch's order again
    (``_invoke_prefetch``, :144-156): called before every batch, it read each example
    twice and shuffled differently from the iterator left alone. This reads what it
    keeps instead: ``_state`` and ``_previous_epoch_detail``, set on every batch (:159-160)
    and by ``reset`` (:76-77).
    """
    state = it._state
    return {'current_position': state.current_position, 'epoch': state.epoch,
            'is_new_epoch': state.is_new_epoch,
            '_order': None if state.order is None else state.order.copy(),
            'previous_epoch_detail': it._previous_epoch_detail}


def multiprocess_iterator_pickle_state(
        it: chainer.iterators.MultiprocessIterator) -> Dict[str, Any]:
    """What ``it.__getstate__`` would return, read without side effects: the state of
    :func:`multiprocess_iterator_state` and ``init``, its attributes less the communicator,
    the state and the prefetch loop, which ``__setstate__`` rebuilds.

    ``__getstate__`` (chainer/iterators/multiprocess_iterator.py:266-288) calls
    ``serialize`` (resetting the original) and drops those three
    (chainer/iterators/multiprocess_iterator.py:279-281); ``__setstate__``
    (chainer/iterators/multiprocess_iterator.py:290-298) takes this dict.
    """
    state = multiprocess_iterator_state(it)
    state['init'] = {k: v for k, v in it.__dict__.items()
                     if k not in ('_comm', '_state', '_prefetch_loop')}
    return state


def order_sampler_rng(it: Any) -> Any:
    """The generator the iterator's order sampler draws the next epoch's order from
    (a ``numpy.random.RandomState`` for ``ShuffleOrderSampler``), or None when it has none.

    ``ShuffleOrderSampler`` keeps it as ``_random`` (chainer/iterators/order_samplers.py:56,
    numpy's global generator by default) and draws each order from it
    (chainer/iterators/order_samplers.py:59).
    """
    return getattr(getattr(it, 'order_sampler', None), '_random', None)


# --------------------------------------------------------------------------------------
# Datasets


def sub_dataset_indices(dataset: chainer.datasets.SubDataset,
                        positions: numpy.ndarray) -> Tuple[Any, numpy.ndarray]:
    """``(base, indices)``: the base dataset of a ``SubDataset`` and the indices into it of
    its examples at ``positions`` (each in ``[0, len(dataset))``), as ``get_example`` maps
    them: ``order[start + i]``, or ``start + i`` without an order.

    Reads ``_dataset``, ``_start`` and ``_order``, which the constructor keeps
    (chainer/datasets/sub_dataset.py:50-59) and ``get_example`` reads
    (chainer/datasets/sub_dataset.py:64-76).
    """
    indices = dataset._start + numpy.asarray(positions, dtype=numpy.int64)
    if dataset._order is not None:
        indices = numpy.asarray(dataset._order)[indices]
    return dataset._dataset, indices


def tuple_dataset_columns(dataset: chainer.datasets.TupleDataset) -> Tuple[Any, ...]:
    """The datasets a ``TupleDataset`` zips, in order: ``dataset[i]`` is the tuple of their
    ``i``-th examples.

    Reads ``_datasets``, kept by the constructor (chainer/datasets/tuple_dataset.py:38) and
    indexed by ``__getitem__`` (chainer/datasets/tuple_dataset.py:41-48).
    """
    return tuple(dataset._datasets)


def dict_dataset_columns(dataset: chainer.datasets.DictDataset) -> Dict[str, Any]:
    """The datasets of a ``DictDataset`` by key: ``dataset[i]`` is the dict of their
    ``i``-th examples.

    Reads ``_datasets``, kept by the constructor (chainer/datasets/dict_dataset.py:27) and
    indexed by ``__getitem__`` (chainer/datasets/dict_dataset.py:30-38).
    """
    return dict(dataset._datasets)


def transform_dataset_parts(
        dataset: chainer.datasets.TransformDataset) -> Tuple[Any, Callable[[Any], Any]]:
    """``(base, transform)`` of a ``TransformDataset``: ``dataset[i]`` is
    ``transform(base[i])``.

    Reads ``_dataset`` and ``_transform``, kept by the constructor
    (chainer/datasets/transform_dataset.py:44-45) and used by ``get_example``
    (chainer/datasets/transform_dataset.py:50-52).
    """
    return dataset._dataset, dataset._transform


# --------------------------------------------------------------------------------------
# ChainerMN


def chainermn_nccl_comm(communicator: Any) -> Any:
    """The NCCL communicator of a ChainerMN ``pure_nccl`` communicator, created on the
    current device if it is not yet.

    ChainerMN creates it lazily, on the current CUDA device, in ``_init_comms``
    (chainermn/communicators/pure_nccl_communicator.py:54-57), called only from its own
    collectives; call under ``chainer.using_device`` of the device it is for.
    """
    communicator._init_comms()
    return communicator.nccl_comm


# --------------------------------------------------------------------------------------
# Configuration, CUDA, reporter, Link


def config_entry_names() -> Set[str]:
    """The names of the configuration entries the calling thread sees: the global ones and
    the thread's own (``chainer.set_debug``, ``chainer.config.x = v``).

    Reads ``chainer.config._local``, the thread-local store of ``LocalConfig``
    (chainer/configuration.py:66), as ``LocalConfig.show`` does
    (chainer/configuration.py:102).
    """
    return set(vars(chainer.global_config)) | set(vars(chainer.config._local))


def thread_config_entries() -> Dict[str, Any]:
    """The configuration entries the calling thread has of its own (``chainer.set_debug``,
    ``chainer.config.x = v``, ``chainer.using_config``), which another thread does not see:
    ``chainer.config._local``, as in :func:`config_entry_names`."""
    return dict(vars(chainer.config._local))


def cuda_resolution_error() -> Optional[BaseException]:
    """The exception Chainer caught while importing CuPy (or cuDNN), or None.

    ``chainer.backends.cuda`` keeps it as ``_resolution_error``
    (chainer/backends/cuda.py:77-78 for CuPy and its CUDA libraries,
    chainer/backends/cuda.py:133-134 for cuDNN).
    """
    from chainer.backends import cuda
    return getattr(cuda, '_resolution_error', None)


def forgotten_function(node: Any) -> Optional[Callable]:
    """The function an ``F.forget`` node calls again in backward, back-propagating through
    what it builds then, where ``node`` is one (else None): its ``inputs`` list only the
    function's inputs, not the parameters it reaches (chainer/functions/util/forget.py:35,
    :55-57)."""
    return node.func if isinstance(node, Forget) else None


def observer_names(reporter: chainer.Reporter) -> Set[str]:
    """The names ``reporter`` gives its observers: ``reporter._observer_names``' values
    (chainer/reporter.py:82, 131, 144)."""
    return set(reporter._observer_names.values())


def observer_name(reporter: chainer.Reporter, observer: Any) -> Optional[str]:
    """The name ``reporter`` gives ``observer``, or None where it was not given it:
    ``reporter._observer_names`` (chainer/reporter.py:82, 131, 144), read only."""
    return reporter._observer_names.get(id(observer))


def is_unregistered_observer_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the ``KeyError`` ``Reporter.report`` raises for an observer (a
    link) it was not given (chainer/reporter.py:172-173)."""
    return isinstance(exc, KeyError) and 'not registered to the reporter' in str(exc)


def thread_link_hooks() -> Dict[str, Any]:
    """The link hooks registered globally in the calling thread (``with hook:``), which
    act on every link's call in that thread only: ``chainer._get_link_hooks()``, a
    thread-local dict (chainer/__init__.py:127-132), as ``LinkHook.__enter__`` registers
    them (chainer/link_hook.py:137-141). (The function hooks' counterpart is public:
    ``chainer.get_function_hooks()``.)"""
    return dict(chainer._get_link_hooks())


def prepare_spectral_norms(model: chainer.Link) -> List[str]:
    """Draw the vector ``u`` of each ``SpectralNormalization`` hook of ``model`` that has
    not drawn it though its link's weight has an array, as the hook's first call would,
    and return those links' paths. Added to a link whose weight had no array
    (``L.Linear(None, n)``) and given one since (pretrained weights, a snapshot loaded), such
    a hook draws ``u`` from the random state and registers it as a persistent (with
    ``use_gamma``, ``gamma`` too) at its first call, whatever the weight holds by then
    (``self._initialized``: chainer/link_hooks/spectral_normalization.py:165, 198-199,
    252; ``_prepare_parameters``, which uses its input only where the weight has no
    array: chainer/link_hooks/spectral_normalization.py:215, 224-226)."""
    from chainer.link_hooks import SpectralNormalization
    prepared = []
    for path, link in model.namedlinks():
        for hook in link.local_link_hooks.values():
            if isinstance(hook, SpectralNormalization) and not hook._initialized \
                    and getattr(link, hook.weight_name).array is not None:
                hook._prepare_parameters(link)
                prepared.append(path)
    return prepared


# --------------------------------------------------------------------------------------
# Static graphs (``@static_graph``)


#: the module of ``@static_graph``, its wrapper and its schedules' classes
_STATIC_GRAPH_MODULE = static_graph.__name__


def is_static_graph_machinery(kind: type) -> bool:
    """Whether ``kind`` is a class of ``@static_graph``'s, which keeps its schedules on the
    chain it decorates (``chain.schedule_manager``, ``chain.static_schedule``:
    chainer/graph_optimizations/static_graph.py:1308-1317). (Asked of every object a
    walk of the unsent state meets: a string comparison.)"""
    return getattr(kind, '__module__', None) == _STATIC_GRAPH_MODULE


def static_graph_links(model: chainer.Link) -> List[chainer.Link]:
    """The links of ``model`` whose ``forward`` or ``__call__`` is ``@static_graph``'s
    wrapper (chainer/graph_optimizations/static_graph.py:1274-1275). Each backward through
    such a link *sets* its parameters' gradients instead of adding to them: the first
    call's with ``chainer.grad(..., set_grad=True)`` (static_graph.py:914-918), the later
    calls' schedule by pointing each gradient at an array of its own
    (static_graph.py:667-669). Two backward passes without ``cleargrads`` leave the
    second's gradient alone."""
    module = _STATIC_GRAPH_MODULE
    found = []
    for link in model.links():
        for name in ('forward', '__call__'):
            method = getattr(type(link), name, None)
            if getattr(method, '__module__', None) == module and \
                    getattr(method, '__name__', '') == 'wrapped_func':
                found.append(link)
                break
    return found


# The metaclass of every Link (and of its base DeviceResident, chainer/device_resident.py:29):
# made by chainer.utils.enable_final (chainer/utils/meta.py:78), importable by no name.
LINK_METACLASS = type(DeviceResident)

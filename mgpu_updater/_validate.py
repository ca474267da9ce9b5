"""Checks of the updater's arguments: a clear error at construction, before any process.

Every message names the argument, echoes the value and says what to do.
"""
from __future__ import annotations

import multiprocessing
import numbers
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import numpy

import chainer
from chainer.iterators import (MultiprocessIterator, MultithreadIterator, SerialIterator,
                               ShuffleOrderSampler)
from chainer.dataset import iterator as iterator_module

from . import _payload, _pickle_path
from ._warning import warn


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f'{name} must be an int >= {minimum} ({value!r} of type '
                        f'{type(value).__name__} given); pass e.g. {name}={max(minimum, 1)}')
    if value < minimum:
        raise ValueError(f'{name} must be an int >= {minimum} ({value!r} given); pass e.g. '
                         f'{name}={max(minimum, 1)}')
    return int(value)


def other_updaters_arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Refuse what Chainer's updaters take and this one does not, saying what replaces it:
    ``StandardUpdater``'s ``iterator``, ``device``, ``input_device`` and ``loss_scale``,
    ``ParallelUpdater``'s ``models``, arguments after the optimizer given by position
    (Chainer's updaters take a converter there), and ``devices`` left out. Python's own
    error named the argument and nothing more."""
    if len(args) > 2:
        extra = ', '.join(type(a).__name__ for a in args[2:])
        raise TypeError(
            f'ParallelAccumulatingUpdater takes only the iterators and the optimizer by '
            f'position ({len(args)} positional arguments given; after the optimizer: '
            f'{extra}): pass the rest by keyword, e.g. converter=..., devices=[...]')
    fixes = {
        'iterator': lambda v: ('pass the iterators by position or as iterators=[...], one '
                               'per device (shard_iterators builds them)'),
        'device': lambda v: ('drop it: devices=[...] names every replica\'s device'
                             if 'devices' in kwargs else
                             f'pass devices=[{v!r}] for one replica, or one entry per '
                             'device (devices=[0, 1])'),
        'input_device': lambda v: ('drop it: each replica\'s converter sends its batch to '
                                   'that replica\'s device (devices=[...])'),
        'loss_scale': lambda v: (f'set it on the optimizer, optimizer.set_loss_scale({v!r}) '
                                 '(what StandardUpdater does with it), or use '
                                 'optimizer.loss_scaling() for dynamic scaling'),
        'models': lambda v: ("give the one model as the optimizer's target and "
                             'devices=[...]: each replica is a copy of it'),
    }
    for name, fix in fixes.items():
        if name in kwargs:
            owner = 'ParallelUpdater' if name == 'models' else 'StandardUpdater'
            raise TypeError(f'{name} is an argument of {owner}, not of '
                            f'ParallelAccumulatingUpdater ({name}={_show(kwargs[name])} '
                            f'given): {fix(kwargs[name])}')
    if 'devices' not in kwargs and (args or kwargs):   # (copy and pickle pass nothing)
        raise TypeError("ParallelAccumulatingUpdater needs devices=[...], one per replica: "
                        "e.g. devices=['@numpy'] (one CPU replica), devices=[0, 1] (two "
                        'GPUs), with one iterator per device')


def prefetch(value: Any) -> Any:
    """``'auto'`` or an int >= 0 (the micro-batches loaded ahead per replica)."""
    if value == 'auto' and isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise (ValueError if isinstance(value, numbers.Integral) and not isinstance(value, bool)
               else TypeError)(
            f"prefetch must be 'auto' or an int >= 0 ({value!r} given); pass e.g. "
            "prefetch='auto' (the default) or prefetch=2")
    return int(value)


def choice(name: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f'{name} must be one of {", ".join(map(repr, options))} '
                         f'({value!r} given)')
    return value


def _cuda_available() -> Tuple[bool, str]:
    from chainer.backends import cuda

    from . import _cuda
    why = _cuda.chainer_cuda_unavailable()
    if why is not None:
        return False, f'CuPy is not installed or cannot use CUDA: {why}'
    try:
        count = cuda.cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "not available"
        return False, f'CUDA reports no usable device ({exc})'
    if count == 0:
        return False, 'CUDA reports no device'
    return True, ''


def devices(value: Any) -> Tuple[List[Any], List[str]]:
    """Parse ``devices`` into Chainer device objects and their labels (master first).

    Everything that can be told from the specifiers alone (unknown, CPU and GPU mixed) is
    checked before CUDA is asked anything. A GPU may be listed more than once: several
    replicas on one GPU (through shared memory, see :func:`mgpu_updater.comm.backend_for`).
    """
    if isinstance(value, dict):
        if 'main' not in value:
            raise ValueError(f"devices given as a dict needs a 'main' key ({value!r} given); "
                             "e.g. {'main': 0, 'second': 1}")
        ordered = [value['main']] + [v for k, v in value.items() if k != 'main']
    elif isinstance(value, (list, tuple)):
        ordered = list(value)
    else:
        raise TypeError(f'devices must be a list of device specifiers ({value!r} given); '
                        "e.g. devices=[0, 1] or devices=['@numpy', '@numpy']")
    if not ordered:
        raise ValueError('devices must name at least one device ([] given); '
                         "e.g. devices=['@numpy'] for one CPU replica")
    labels = [_label(spec, i) for i, spec in enumerate(ordered)]
    gpus = [i for i, label in enumerate(labels) if label != '@numpy']
    if gpus and len(gpus) != len(labels):
        raise ValueError(f'devices mixes CPU and GPU devices ({ordered!r}); use only GPUs '
                         "or only '@numpy' replicas")
    # A GPU listed more than once holds that many replicas (processes); NCCL refuses two
    # ranks on one GPU, so comm.backend_for() then picks shared memory with host staging.
    if gpus:
        ok, why = _cuda_available()
        if not ok:
            i = gpus[0]
            raise ValueError(f'devices[{i}] is {ordered[i]!r}, a GPU, but {why}; use '
                             "'@numpy' for CPU replicas or install the cuda12/cuda13 extra")
    return [chainer.get_device(label) for label in labels], labels


def _label(spec: Any, i: int) -> str:
    if isinstance(spec, chainer.backend.Device):
        spec = str(spec)  # '@numpy', '@cupy:0'
    if isinstance(spec, bool):
        pass
    elif isinstance(spec, numbers.Integral):
        if spec == -1:
            return '@numpy'
        if spec >= 0:
            return f'@cupy:{int(spec)}'
    elif isinstance(spec, str):
        if spec == '@numpy':
            return spec
        if spec.startswith('@cupy:') and spec[6:].isdigit():
            return spec
    raise ValueError(f'devices[{i}] is {spec!r}, which is not a device specifier this updater '
                     "supports; use a GPU id (0, 1, ...), '@cupy:N', or '@numpy' / -1 "
                     'for a CPU replica')


def iterators(value: Any, n_devices: int) -> List[Any]:
    """One iterator per device, master first. A bare iterator with one device, or
    StandardUpdater's ``{'main': ...}`` holding either, is taken as well."""
    name = 'iterators'
    if isinstance(value, dict):
        value, name = _main_iterators(value, n_devices), "iterators['main']"
    if isinstance(value, iterator_module.Iterator):
        value = [value]
    elif not isinstance(value, (list, tuple)):
        raise TypeError(f'{name} must be a chainer iterator or a list of them, one per '
                        f'device ({_show(value)} given); wrap the dataset in e.g. '
                        'chainer.iterators.SerialIterator')
    value = list(value)
    for i, it in enumerate(value):   # before the count: a dataset is a list too
        if not isinstance(it, iterator_module.Iterator):
            raise TypeError(f'{name}[{i}] is {_show(it)}, not a '
                            'chainer.dataset.Iterator; wrap the dataset in e.g. '
                            'chainer.iterators.SerialIterator, one per device '
                            '(mgpu_updater.shard_iterators builds them from one dataset)')
    if len(value) != n_devices:
        example = (f", e.g. iterators={{'main': {_its(n_devices)}}}"
                   if name != 'iterators' else '')
        raise ValueError(f'{name} has {len(value)} iterator(s) but devices has '
                         f'{n_devices}; give exactly one iterator per device{example} '
                         '(mgpu_updater.shard_iterators builds them from one dataset)')
    if len({id(it) for it in value}) != len(value):
        raise ValueError(f'{name} holds the same iterator object more than once; each '
                         'device needs its own iterator over its own shard')
    batches: List[Any] = []   # per pass over its shard, where it can be told
    for i, it in enumerate(value):
        batch_size = getattr(it, 'batch_size', None)
        if isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool) \
                and batch_size <= 0:
            raise ValueError(f'{name}[{i}] has batch_size={batch_size!r}: each batch '
                             'must hold at least one sample; build the iterator with '
                             'batch_size >= 1')
        try:
            size = len(it.dataset)
        except Exception:  # noqa: BLE001 - no dataset or no length: nothing to say here
            batches.append(None)
            continue
        sampler = getattr(it, 'order_sampler', None)
        # Chainer's iterators make ceil(size / batch_size) batches a pass; another (a
        # bucketing, a token-budget iterator) makes as many as it fills, and an order
        # sampler of one's own may make an epoch of another length (oversampling)
        told = type(it) in _COUNTED and (
            sampler is None or type(sampler) is ShuffleOrderSampler)
        batches.append(-(-size // int(batch_size)) if told and isinstance(
            batch_size, numbers.Integral) and not isinstance(batch_size, bool)
            and batch_size > 0 else None)
        if size == 0:
            raise ValueError(f'{name}[{i}] iterates over an empty dataset (device {i} would '
                             'have no sample to train on, and Chainer\'s iterators divide '
                             'by its length); give every device a shard of at least one '
                             'batch (mgpu_updater.shard_iterators splits one dataset evenly)')
    longer = [(i, n) for i, n in enumerate(batches[1:], start=1)
              if batches[0] is not None and n is not None and n > batches[0]]
    if longer:
        i, n = max(longer, key=lambda pair: pair[1])
        warn(
            f"{name}[0], the master's, makes {batches[0]} batches of its shard per epoch, "
            f"fewer than {name}[{i}] ({n}): the updater's epoch (epoch, epoch_detail, a "
            "stop_trigger in epochs, the end of data under repeat=False) follows the "
            "master's iterator, so an epoch ends before the longer shards are used up, and "
            'under repeat=False their last batches are trained only by updates after the '
            "master's epoch ended, which a stop_trigger at that epoch never runs. Give the "
            'master the largest shard (mgpu_updater.shard_iterators does)', RuntimeWarning,
            stacklevel=3)
    return value


#: iterators whose batches per pass over their dataset the batch size tells (a subclass
#: may batch otherwise)
_COUNTED = (SerialIterator, MultiprocessIterator, MultithreadIterator)


def _its(n: int) -> str:
    return '[' + ', '.join(f'it{i}' for i in range(min(n, 3))) + (', ...]' if n > 3 else ']')


def _main_iterators(value: Dict[Any, Any], n_devices: int) -> Any:
    """What ``{'main': ...}`` holds. StandardUpdater takes a dict of named iterators and
    trains on 'main'; here 'main' holds one iterator per device (a bare one with one
    device). Other names would ride along unused and out of the snapshots: refused."""
    keys = sorted(map(str, value))
    one_each = f"iterators={{'main': {_its(max(n_devices, 2))}}}"
    if 'main' not in value:
        raise ValueError(f"iterators given as a dict needs a 'main' key (keys {keys} given); "
                         f'pass {one_each}, one iterator per device, or the list itself')
    if len(value) > 1:
        raise ValueError(f"iterators has keys {keys}; this updater reads only 'main' (one "
                         'iterator per device): give the others to what uses them (e.g. '
                         'extensions.Evaluator(it, model)), not to the updater; for one '
                         f'iterator per device pass {one_each}')
    return value['main']


def main_optimizer(value: Any) -> Any:
    """The optimizer itself, also when given as StandardUpdater's ``{'main': optimizer}``.
    Several optimizers are refused: this updater trains one model with one optimizer."""
    if not isinstance(value, dict):
        return value
    keys = sorted(map(str, value))
    if len(value) > 1:
        raise ValueError(f'optimizer has keys {keys}: this updater trains one model with one '
                         "optimizer; several optimizers (e.g. a GAN's generator and "
                         'discriminator) need their own update_core: subclass '
                         'chainer.training.updaters.StandardUpdater (one process), or pass '
                         "the one optimizer as optimizer or {'main': optimizer}")
    if 'main' not in value:
        raise ValueError(f"optimizer given as a dict needs a 'main' key (keys {keys} given); "
                         "pass the optimizer itself, or {'main': optimizer}")
    return value['main']


def optimizer(value: Any) -> chainer.Link:
    if not isinstance(value, chainer.Optimizer):
        if type(value).__module__.split('.')[0] == 'chainermn' \
                or type(value).__name__ == '_MultiNodeOptimizer':
            raise TypeError(
                f'optimizer must be a plain chainer.Optimizer, not ChainerMN\'s multi-node '
                f'one ({type(value).__name__} given): pass the optimizer it wraps and the '
                'communicator, optimizer=opt, communicator=comm; the updater reduces the '
                'gradients across the ranks itself')
        raise TypeError(f'optimizer must be a chainer.Optimizer set up on the model '
                        f'({_show(value)} given); e.g. optimizer = '
                        'chainer.optimizers.Adam(); optimizer.setup(model)')
    target = getattr(value, 'target', None)
    if target is None:
        raise ValueError(f'optimizer ({type(value).__name__}) was not set up; call '
                         'optimizer.setup(model) before building the updater')
    if not any(True for _ in target.params()):
        raise ValueError(f'the model ({type(target).__name__}) has no parameters: there '
                         'is nothing to train; check that its links are registered '
                         'inside init_scope()')
    return target


def gradient_reallocation(optimizer: chainer.Optimizer, summed: bool) -> None:
    """Warn, at construction, where the optimizer overrides ``reallocate_cleared_grads``
    (in its class or on itself; Chainer's docstring suggests a blank one for an optimizer that wants a parameter
    without a gradient left as it is) and the step is on a summed gradient (several
    replicas, ``pipelined``, MPI): there every parameter has one, zeros where no replica
    computed any, so weight decay and momentum move it as under Chainer's own
    ``reallocate_cleared_grads``, whatever the override does."""
    base = getattr(chainer.optimizer.GradientMethod, 'reallocate_cleared_grads', None)
    own = getattr(optimizer, 'reallocate_cleared_grads', None)
    own = getattr(own, '__func__', own)   # a method's function; set on the instance: itself
    if not summed or base is None or own is base:
        return
    warn(
        f'the optimizer ({type(optimizer).__name__}) overrides reallocate_cleared_grads, '
        'which decides what a parameter without a gradient steps on; with several '
        'replicas, pipelined=True or MPI ranks the step is on a summed gradient that every '
        'parameter has (zeros where no replica computed one), so such a parameter moves as '
        "under Chainer's own reallocate_cleared_grads (weight decay, momentum). A "
        'parameter that must not move: link.disable_update() or '
        'param.update_rule.enabled = False', RuntimeWarning, stacklevel=3)


_CALLABLE_HINTS = {
    'converter': 'e.g. chainer.dataset.concat_examples (the default)',
    'loss_func': 'or None to call the model itself',
}


def callable_or_none(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f'{name} must be callable ({_show(value)} given); pass a function, '
                        f'{_CALLABLE_HINTS.get(name, "or None")}')
    return value


def may_start_processes(n_devices: int) -> None:
    """Refuse, at construction, to run where the workers cannot start: in a daemonic
    process (a ``multiprocessing.Pool`` worker, a ``Process(daemon=True)``), which
    multiprocessing does not let start children (its bare AssertionError, at the first
    update)."""
    process = multiprocessing.current_process()
    if process.daemon:
        raise RuntimeError(
            f'this process ({process.name}) is daemonic, as a multiprocessing.Pool worker '
            'or a Process(daemon=True) is, and multiprocessing does not let it start '
            f'the {n_devices - 1} worker process(es) that devices={n_devices} need (one '
            'per device after the first). Run the training in a process that is not '
            'daemonic (concurrent.futures.ProcessPoolExecutor, or '
            'multiprocessing.Process(daemon=False)), or on one device')


def worker_payload(model: chainer.Link, loss_func: Any, converter: Any,
                   worker_iterators: Sequence[Any]) -> None:
    """Refuse, at construction, what cannot travel to the worker processes.

    Pickled as the payload will be (:mod:`mgpu_updater._payload`), so lambdas, closures,
    what ``__main__`` defines and modules importable by name (``six.moves``) pass; open
    files, locks, sockets, threads and generators do not. The message names the type that
    does not pickle and the path to it (:mod:`mgpu_updater._pickle_path`); its advice
    depends on what that is. ``loss_func`` is None when it is re-bound to each replica's
    model.
    """
    picklable('the model', model, 'Create such attributes lazily (e.g. open files in '
              'forward, not in __init__) or drop them before building the updater.')
    if loss_func is not None:
        picklable('loss_func', loss_func, 'Open files, locks or sockets inside the '
                  'function or a method of the model, not in the variables it captures.')
    picklable('converter', converter, 'Open files, locks or sockets inside the call, not '
              'in the variables or attributes the converter holds.')
    for i, it in enumerate(worker_iterators, start=1):
        picklable(f'iterators[{i}]', it, _iterator_hint)


def _iterator_hint(path: str) -> str:
    """The advice where an iterator holds what does not pickle, at ``path``: in its
    dataset, or in the iterator itself (one of the user's own, over a generator)."""
    if '.dataset' in path or '._dataset' in path:
        return ('Its dataset must be picklable (e.g. arrays or a TupleDataset), not a '
                'generator or an open file; open files lazily in get_example (or '
                '__getitem__), and leave the handle out of the pickle (a __getstate__ that '
                'drops it): the master reads its first batches before the workers start, '
                'and a dataset object its shard shares has opened it by then.')
    return ('An iterator that holds it cannot go to a worker process as it is: make it '
            'where it is used (at the first next()) and leave it out of the pickle (a '
            '__getstate__ that drops it), or read the data through a dataset (Chainer\'s '
            'iterators over a picklable dataset), or train on one device.')


def opened_since(worker_iterators: Dict[int, Any]) -> None:
    """A worker's payload that does not pickle at the start, where its iterator did when
    the updater was built: raise naming what its dataset opened since (the master reads
    its first batches first, through a dataset object the shards may share: a file that
    ``get_example`` opens lazily). Nothing where each pickles still."""
    for rank in sorted(worker_iterators):
        picklable(f'iterators[{rank}]', worker_iterators[rank],
                  'It pickled when the updater was built: its dataset opened this since, '
                  'when something read it (the master reads its first batches before the '
                  'workers start, through a dataset object its shard may share). Leave it '
                  'out of the pickle: a __getstate__ that drops it (to be opened again '
                  'where it is used); or give each replica a dataset object of its own.')


def picklable(name: str, value: Any, resource_hint: Union[str, Callable[[str], str]]) -> None:
    """Refuse what cannot travel to a worker process, naming the type that does not pickle
    and the path to it from ``value``. ``resource_hint`` is the advice where that is an
    open file, a lock, a socket, a thread or a generator (or gives it from the path)."""
    try:
        _payload.check(value)
    except Exception as exc:  # noqa: BLE001 - pickle raises many types
        root = name[4:] if name.startswith('the ') else name
        culprit = _pickle_path.find(value, root)
        hint = resource_hint(culprit.path) if callable(resource_hint) else resource_hint
        where = culprit.path if culprit.path != root else f'{root} itself'
        found = ('the culprit is' if culprit.complete else
                 'the search stopped, the culprit lies within')
        raise TypeError(f'{name} ({type(value).__name__}) cannot be sent to a worker '
                        f'process: {type(exc).__name__}: {exc}; {found} {where} '
                        f'({_pickle_path.describe(culprit.obj)}). '
                        f'{_unpicklable_hint(culprit, hint, exc)}') from exc


def _unpicklable_hint(culprit: Any, resource_hint: str, exc: BaseException) -> str:
    kind = _pickle_path.resource_kind(culprit.obj)
    type_name = _pickle_path.type_name(culprit.obj)
    if kind == 'a module':
        return (f'A module of type {type_name} travels by its name only: this one is not '
                'in sys.modules and no importer finds its __name__. Refer to an importable '
                'module, or register it in sys.modules where it is created.')
    if kind:
        return resource_hint
    text = str(exc).lower()
    if not ('pickle' in text and any(word in text for word in
                                     ('cannot', "can't", 'could not'))):
        # not pickle's own "cannot pickle" / "Can't pickle": the type's __reduce__ or
        # __getstate__ refused, saying why (chainer.Sequential holding a lambda)
        return (f'That error comes from the pickling of {type_name} itself: do what it '
                'says, or keep this one out of what is handed to the updater (create it '
                'where it is used).')
    return (f'Objects of type {type_name} do not pickle: keep this one out of what is '
            'handed to the updater (create it where it is used), or make the type '
            'picklable (__reduce__, or __getstate__ and __setstate__).')


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, with the type when it is not obvious."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + '...'
    if type(value).__name__ not in text:
        text += f' of type {type(value).__name__}'
    return text


def non_finite_policy(value: Any) -> str:
    return choice('nonfinite', value, ('raise', 'skip', 'ignore'))


_REDUCTION_HINTS = {
    'loss_reduction': ("'mean' when loss_func returns the mean over its batch (Chainer's "
                       "losses, e.g. F.softmax_cross_entropy), 'sum' when it returns the sum "
                       "(e.g. F.black_out, a hierarchical softmax, a loss summed over a tree)"),
    'replica_reduction': ("'mean' for StandardUpdater's (and ChainerMN's) dynamics on the "
                          "global batch, 'sum' for ParallelUpdater's and "
                          "MultiprocessParallelUpdater's sum over the devices"),
}


def _reduction(name: str, value: Any) -> str:
    if isinstance(value, str) and value in ('mean', 'sum'):
        return value
    kind = '' if isinstance(value, str) else f' of type {type(value).__name__}'
    raise ValueError(f"{name} must be 'mean' or 'sum' ({value!r}{kind} given); pass "
                     f'{_REDUCTION_HINTS[name]}')


def loss_reduction(value: Any) -> str:
    """What ``loss_func`` returns over its batch: its mean or its sum."""
    return _reduction('loss_reduction', value)


def replica_reduction(value: Any) -> str:
    """How the replicas' gradients combine: as one global batch, or summed."""
    return _reduction('replica_reduction', value)


def micro_batch_size(value: Any) -> Any:
    """None, ``'auto'``, or the most samples one forward/backward may hold (an int >= 1)."""
    if value is None or (isinstance(value, str) and value == 'auto'):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"micro_batch_size must be None, 'auto' or an int >= 1 ({value!r} "
                        f'of type {type(value).__name__} given); pass e.g. '
                        "micro_batch_size=16 to run each loaded batch in chunks of at most "
                        "16 samples, or 'auto' to find the size that fits")
    if value < 1:
        raise ValueError(f"micro_batch_size must be None, 'auto' or an int >= 1 ({value!r} "
                         "given); pass e.g. micro_batch_size=16, 'auto' to find the size "
                         'that fits, or None to run whole batches')
    return int(value)


#: The longest timeout the operating system's ``poll()`` takes, in whole seconds (2**31 - 1
#: milliseconds): ``multiprocessing.connection.wait`` raises OverflowError beyond it.
LONGEST_WAIT = 2147483


_WAITS = {
    'start_timeout': 'the start waits for the workers with a deadline, so that a worker '
                     'that hangs while starting is named',
}


def seconds(name: str, value: Any, none_means: str = '') -> float:
    """A time limit: a number of seconds > 0 (a Python or numpy number, not a bool), finite
    and at most :data:`LONGEST_WAIT`: every wait it bounds has a deadline. ``none_means``:
    what None would mean, where the caller takes it (:func:`seconds_or_none`)."""
    alternative = f', or None for {none_means}' if none_means else ''
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f'{name} must be a number of seconds > 0 '
                        f'({value!r} of type {type(value).__name__} '
                        f'given); pass e.g. {name}=120{alternative}')
    if not value > 0:   # also refuses NaN
        raise ValueError(f'{name} must be a number of seconds > 0 '
                         f'({value!r} given); pass e.g. {name}=120{alternative}')
    if not value <= LONGEST_WAIT:   # also infinity
        why = _WAITS.get(name, 'the wait it bounds cannot be longer')
        raise ValueError(f'{name} must be at most {LONGEST_WAIT} seconds, about 24 days '
                         f'({value!r} given): {why}; pass a finite number of seconds, '
                         f'e.g. {name}=600{alternative}')
    return float(value)


def seconds_or_none(name: str, value: Any) -> Any:
    """None (never), or a number of seconds > 0 as :func:`seconds` takes it."""
    return None if value is None else seconds(name, value, 'no limit')


def flag(name: str, value: Any, ints: bool = False) -> bool:
    """True or False (numpy's too; with ``ints``, 0 and 1 as well, where Chainer's own
    argument takes them); anything else, a string such as ``'no'`` above all, is refused
    rather than read by its truth."""
    if not (isinstance(value, (bool, numpy.bool_)) or (
            ints and isinstance(value, numbers.Integral) and value in (0, 1))):
        raise TypeError(f'{name} must be True or False ({value!r} of type '
                        f'{type(value).__name__} given); pass {name}=True or {name}=False')
    return bool(value)


def converter(value: Any) -> Any:
    if value is None:
        raise TypeError('converter must be callable (None given); the default is '
                        'chainer.dataset.concat_examples')
    return callable_or_none('converter', value)


_MPI4PY_VERBS = ('Allreduce', 'Bcast', 'Reduce', 'allgather')


def communicator(value: Any) -> Any:
    """None, or a ChainerMN communicator: checked for what this package uses of it
    (``rank``, ``size``, ``mpi_comm`` with mpi4py's verbs, ``bcast_obj``; see
    :mod:`mgpu_updater.comm.mpi`), by its attributes, never importing mpi4py."""
    if value is None:
        return None
    fix = ("pass communicator=chainermn.create_communicator('naive') (CPU) or "
           "('pure_nccl') (GPU) in every MPI rank, or None for the devices of this host")
    missing = [n for n in ('rank', 'size', 'mpi_comm', 'bcast_obj') if not hasattr(value, n)]
    if missing == ['mpi_comm', 'bcast_obj'] and all(hasattr(value, v) for v in _MPI4PY_VERBS):
        raise TypeError(f'communicator must be a ChainerMN communicator ({_show(value)} '
                        "given, an mpi4py communicator); wrap it: communicator="
                        "chainermn.create_communicator('naive', mpi_comm=<it>) (or "
                        "'pure_nccl')")
    if missing:
        raise TypeError(f'communicator must be a ChainerMN communicator ({_show(value)} '
                        f'given, which has no {", ".join(missing)}); {fix}')
    verbs = [v for v in _MPI4PY_VERBS if not callable(getattr(value.mpi_comm, v, None))]
    if verbs:
        raise TypeError(f'communicator must be a ChainerMN communicator ({_show(value)} '
                        f'given, whose mpi_comm {_show(value.mpi_comm)} has no '
                        f'{", ".join(verbs)}); {fix}')
    rank, size = value.rank, value.size
    if (any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (rank, size))
            or not 0 <= rank < size):
        raise ValueError(f'communicator must be a ChainerMN communicator ({_show(value)} '
                         f'given, whose rank {rank!r} and size {size!r} are not those of an '
                         f'MPI rank); {fix}')
    return value


def one_device_per_rank(communicator: Any, labels: List[str]) -> None:
    """With a ChainerMN communicator every rank drives exactly one device."""
    if communicator is not None and len(labels) != 1:
        raise ValueError(f'with a ChainerMN communicator each rank drives one device; '
                         f'devices has {len(labels)} ({labels!r}); '
                         'pass devices=[comm.intra_rank] (GPU) or ["@numpy"]')


def blas_threads(value: Any) -> Any:
    """``'auto'``, None, or the BLAS/OpenMP threads of each replica (an int >= 1)."""
    if value is None or (isinstance(value, str) and value == 'auto'):
        return value
    hint = ("pass 'auto' (the default: the cores divided among the replicas on this host, "
            'unless OMP_NUM_THREADS or a like variable is set), e.g. blas_threads=2 for 2 '
            'threads per replica, or None to leave the libraries as they are')
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"blas_threads must be 'auto', an int >= 1 or None ({value!r} of "
                        f'type {type(value).__name__} given); {hint}')
    if value < 1:
        raise ValueError(f"blas_threads must be 'auto', an int >= 1 or None ({value!r} "
                         f'given); {hint}')
    return int(value)


def _auto_or_flag(name: str, value: Any, fix: str) -> Any:
    """``'auto'``, True or False; else a TypeError naming ``name``, echoing the value and
    saying ``fix``."""
    if isinstance(value, bool) or (isinstance(value, str) and value == 'auto'):
        return value
    raise TypeError(f"{name} must be 'auto', True or False ({value!r} of type "
                    f"{type(value).__name__} given); {fix}")


def bind_cores(value: Any) -> Any:
    """``'auto'``, True or False (see :func:`mgpu_updater._threads.core_shares`)."""
    return _auto_or_flag('bind_cores', value,
                         "pass 'auto' (the default: each CPU replica process on cores of its "
                         "own, where there are enough), True to bind GPU replicas too, or "
                         "False to leave them to the scheduler")


def reuse_host_memory(value: Any) -> Any:
    """``'auto'``, True or False (see :mod:`mgpu_updater._host_memory`)."""
    return _auto_or_flag('reuse_host_memory', value,
                         "pass 'auto' (the default: every replica process keeps the host "
                         "memory it frees for its next micro-batch, unless the environment "
                         "configures malloc), True to do so anyway, or False to leave malloc "
                         "as it is")


__all__ = ['positive_int', 'choice', 'devices', 'iterators', 'main_optimizer', 'optimizer',
           'callable_or_none', 'worker_payload', 'picklable', 'non_finite_policy',
           'loss_reduction', 'replica_reduction', 'micro_batch_size', 'seconds', 'flag',
           'converter', 'communicator', 'one_device_per_rank', 'blas_threads',
           'reuse_host_memory', 'seconds_or_none', 'bind_cores']

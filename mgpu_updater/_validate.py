"""Checks of the updater's arguments: a clear error at construction, before any process.

Every message names the argument, echoes the value and says what to do.
"""
from __future__ import annotations

import io
import numbers
import pickle
from typing import Any, Dict, List, Sequence, Tuple

import chainer
from chainer.dataset import iterator as iterator_module

def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f'{name} must be an int >= {minimum} ({value!r} of type '
                        f'{type(value).__name__} given); pass e.g. {name}={max(minimum, 1)}')
    if value < minimum:
        raise ValueError(f'{name} must be >= {minimum} ({value!r} given)')
    return int(value)

def choice(name: str, value: Any, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f'{name} must be one of {", ".join(map(repr, options))} '
                         f'({value!r} given)')
    return value

def _cuda_available() -> Tuple[bool, str]:
    from chainer.backends import cuda
    if not cuda.available:
        return False, 'CuPy is not installed or cannot use CUDA'
    try:
        count = cuda.cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "not available"
        return False, f'CUDA reports no usable device ({exc})'
    if count == 0:
        return False, 'CUDA reports no device'
    return True, ''

def devices(value: Any) -> Tuple[List[Any], List[str]]:
    """Parse ``devices`` into Chainer device objects and their labels (master first)."""
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
    parsed, labels = [], []
    gpu_ids: Dict[int, int] = {}
    for i, spec in enumerate(ordered):
        label = _label(spec, i)
        if label == '@numpy':
            parsed.append(chainer.get_device('@numpy'))
        else:
            gpu = int(label.split(':')[1])
            ok, why = _cuda_available()
            if not ok:
                raise ValueError(f'devices[{i}] is {spec!r}, a GPU, but {why}; use '
                                 "'@numpy' for CPU replicas or install the cuda12/cuda13 extra")
            if gpu in gpu_ids:
                raise ValueError(f'devices lists GPU {gpu} twice (positions {gpu_ids[gpu]} and '
                                 f'{i} of {ordered!r}); give each GPU once, or use '
                                 'accumulate_steps for more micro-batches per GPU')
            gpu_ids[gpu] = i
            parsed.append(chainer.get_device(label))
        labels.append(label)
    kinds = {lab == '@numpy' for lab in labels}
    if len(kinds) > 1:
        raise ValueError(f'devices mixes CPU and GPU devices ({ordered!r}); use only GPUs '
                         "or only '@numpy' replicas")
    return parsed, labels

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
    if isinstance(value, iterator_module.Iterator):
        value = [value]
    elif not isinstance(value, (list, tuple)):
        raise TypeError(f'iterators must be a chainer iterator or a list of them, one per '
                        f'device ({type(value).__name__} given)')
    value = list(value)
    if len(value) != n_devices:
        raise ValueError(f'iterators has {len(value)} iterator(s) but devices has '
                         f'{n_devices}; give exactly one iterator per device '
                         '(mgpu_updater.shard_iterators builds them from one dataset)')
    for i, it in enumerate(value):
        if not isinstance(it, iterator_module.Iterator):
            raise TypeError(f'iterators[{i}] is {type(it).__name__}, not a '
                            'chainer.dataset.Iterator; wrap the dataset in e.g. '
                            'chainer.iterators.SerialIterator')
    if len({id(it) for it in value}) != len(value):
        raise ValueError('iterators holds the same iterator object more than once; each '
                         'device needs its own iterator over its own shard')
    return value

def optimizer(value: Any) -> chainer.Link:
    if not isinstance(value, chainer.Optimizer):
        raise TypeError(f'optimizer must be a chainer.Optimizer ({type(value).__name__} '
                        'given)')
    target = getattr(value, 'target', None)
    if target is None:
        raise ValueError(f'optimizer ({type(value).__name__}) was not set up; call '
                         'optimizer.setup(model) before building the updater')
    if not any(True for _ in target.params()):
        raise ValueError(f'the model ({type(target).__name__}) has no parameters: there '
                         'is nothing to train; check that its links are registered '
                         'inside init_scope()')
    return target

def callable_or_none(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f'{name} must be callable or None ({value!r} given)')
    return value

def picklable(name: str, value: Any, hint: str) -> None:
    """Refuse what cannot travel to a worker process, naming it."""
    try:
        pickle.dump(value, _Null(), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickle raises many types
        raise TypeError(f'{name} ({type(value).__name__}) cannot be sent to a worker '
                        f'process: {type(exc).__name__}: {exc}. {hint}') from exc

class _Null(io.RawIOBase):
    def write(self, b: Any) -> int:
        return memoryview(b).nbytes

    def writable(self) -> bool:
        return True

def non_finite_policy(value: Any) -> str:
    return choice('nonfinite', value, ('raise', 'skip'))

__all__ = ['positive_int', 'choice', 'devices', 'iterators', 'optimizer',
           'callable_or_none', 'picklable', 'non_finite_policy']

"""How a worker's start-up payload is pickled: whatever ``StandardUpdater`` accepts travels.

The payload (model, loss function, converter, iterator over the worker's shard) is pickled
with cloudpickle: by reference where the worker can import the object, by value where it
cannot. So lambdas and closures (``loss_func=model.get_loss_func()``), converters made with
``@chainer.dataset.converter()`` (the module attribute is the wrapper, not the function),
``TransformDataset`` with a nested transform, and classes or functions defined in
``__main__`` (also inside ``if __name__ == '__main__':`` or a ``main()``) all reach the
worker. What truly cannot travel (open files, locks, sockets, threads, generators) still
fails (cloudpickle would copy a text file opened for reading: refused here too), and :mod:`mgpu_updater._validate` names the attribute at fault.

Pickling never changes the user's objects. ``MultiprocessIterator.__getstate__`` does
(Chainer 7.8.1 ``chainer/iterators/multiprocess_iterator.py:266-288``: its ``serialize``
call resets ``current_position``, ``epoch`` and ``is_new_epoch`` to None on the original,
and it fails outright without an order, i.e. ``shuffle=False``); it is reduced here from
its attributes into the very state that method would return, read without side effects.
"""
from __future__ import annotations

import copyreg
import io
import pickle
import sys
from typing import Any, Dict, Tuple

import cloudpickle
from chainer.iterators import MultiprocessIterator


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, MultiprocessIterator):
            return _reduce_multiprocess_iterator(obj)
        if isinstance(obj, io.TextIOWrapper) and obj not in (sys.stdout, sys.stderr):
            # cloudpickle would read the whole file into the payload (a silent copy of
            # what may be gigabytes, and a file no longer shared): refuse it as pickle does.
            raise TypeError(f"cannot pickle '{type(obj).__module__}.{type(obj).__name__}' "
                            'object')
        return super().reducer_override(obj)


def _reduce_multiprocess_iterator(it: MultiprocessIterator) -> Tuple[Any, ...]:
    """``(copyreg.__newobj__, (cls,), state)``; unpickling calls Chainer's own
    ``__setstate__`` (``multiprocess_iterator.py:290-298``) with ``state``."""
    # The attributes __getstate__ drops (multiprocess_iterator.py:279-281): the
    # communicator, the state and the prefetch loop are rebuilt by __setstate__.
    init = {k: v for k, v in it.__dict__.items()
            if k not in ('_comm', '_state', '_prefetch_loop')}
    state = it._state
    order = None if state.order is None else state.order.copy()
    payload: Dict[str, Any] = {
        'current_position': state.current_position, 'epoch': state.epoch,
        'is_new_epoch': state.is_new_epoch, 'order': order,
        'previous_epoch_detail': it._previous_epoch_detail, 'init': init}
    return copyreg.__newobj__, (type(it),), payload


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for a worker process (which unpickles it with ``pickle.loads``)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def check(obj: Any) -> None:
    """Pickle ``obj`` as :func:`dumps` would, keeping nothing; raises what pickling raises."""
    _Pickler(_Null(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)


class _Null(io.RawIOBase):
    def write(self, b: Any) -> int:
        return memoryview(b).nbytes

    def writable(self) -> bool:
        return True

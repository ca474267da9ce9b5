"""The replicas of one update, seen from the master: how gradients meet.

A group hides where the other replicas are: nowhere (one device), in worker processes on
this host (:class:`LocalGroup`: shared memory or NCCL), or in other MPI ranks (see
:mod:`mgpu_updater._mpi`). The updater calls, every update::

    group.begin(loss_scale)           # parameters out, the others start their windows
    own = replica.run_window(...)     # the master's own share
    results = group.finish(own)       # model grads := sum over replicas,
                                      # float persistents := mean over replicas

The pipelined mode calls ``finish_async`` instead: it returns at once with a
:class:`Pending` gradient whose reduction overlaps the next update's compute.
Both sides of the local protocol live here: :func:`replica_step` is what a worker runs.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import chainer

from . import _payload
from . import comm as comm_module
from ._flat import (ModelLayouts, grad_arrays, persistent_arrays, persistent_scalars,
                    set_persistent_scalars, state_arrays)
from ._lifecycle import WorkerPool
from ._replica import Replica, WindowResult


class Pending:
    """A summed gradient on its way (pipelined mode): ``wait()`` then ``apply(model)``."""

    def __init__(self, source: Callable[[], Dict[str, Any]],
                 thread: Optional[threading.Thread] = None) -> None:
        self._source = source
        self._thread = thread
        self._error: Optional[BaseException] = None

    def wait(self) -> Dict[str, Any]:
        """The summed gradients by parameter name (after the reduction finished)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return self._source()

    def apply(self, model: chainer.Link) -> None:
        grads = self.wait()
        _ensure_grads(model)
        for name, param in model.namedparams():
            param.grad[...] = grads[name]


class Group:
    """One device, no one else: nothing to exchange."""

    size = 1

    def begin(self, loss_scale: Optional[float], parity: Optional[int] = None) -> None:
        pass

    def finish(self, own: WindowResult) -> List[WindowResult]:
        return [own]

    def finish_async(self, own: WindowResult, parity: int) -> Tuple[List[WindowResult], Pending]:
        """Default: reduce now, keep a copy of the summed gradient for later."""
        results = self.finish(own)
        _ensure_grads(self.model)
        saved = {name: p.grad.copy() for name, p in self.model.namedparams()}
        return results, Pending(lambda: saved)

    def states(self) -> Dict[int, Dict[str, Any]]:
        return {}

    def pids(self) -> List[int]:
        return []

    def close(self, abort: bool = False) -> None:
        pass


class SoloGroup(Group):
    def __init__(self, model: chainer.Link) -> None:
        self.model = model


class LocalGroup(Group):
    """Worker processes on this host, one per extra device."""

    def __init__(self, model: chainer.Link, layouts: ModelLayouts, backend: str,
                 master_device: Any, devices: List[Any], payloads: Dict[int, Any],
                 start_method: str, start_timeout: float) -> None:
        self.size = len(devices)
        self.model = model
        self.layouts = layouts
        self.comm, handle = comm_module.create(backend, self.size, layouts.spec(), master_device)
        self.pool = WorkerPool(devices, start_method)
        try:
            shm = getattr(self.comm, 'segment_names', [])
            if hasattr(self.comm, 'check_peer_alive'):   # NCCL: watch the workers in waits
                self.comm.check_peer_alive = self.pool.check_alive
            from ._worker import main as worker_main
            self.pool.start(worker_main, {r: p(handle) for r, p in payloads.items()}, shm,
                            start_timeout, before_ready=getattr(self.comm, 'init', None))
        except BaseException:
            self.close(abort=True)
            raise
        self._stat = list(layouts.stat.buffer_names().values())
        self._bcast = list(layouts.param.buffer_names().values())

    def begin(self, loss_scale: Optional[float], parity: Optional[int] = None) -> None:
        self.layouts.param.pack(state_arrays(self.model), self.comm.buffer)
        for name in self._bcast:
            self.comm.bcast(name)
        self.pool.send(('step', loss_scale, persistent_scalars(self.model), parity))

    def _gather(self, own: WindowResult, grads: Any) -> List[WindowResult]:
        model, layouts, comm = self.model, self.layouts, self.comm
        grads.pack(grad_arrays(model), comm.buffer)
        layouts.stat.pack(dict(persistent_arrays(model)), comm.buffer, scale=1.0 / self.size)
        others = self.pool.gather('done')
        for name in self._stat:
            comm.reduce(name)
        layouts.stat.unpack(comm.buffer, dict(persistent_arrays(model)))
        return [own] + [others[r] for r in sorted(others)]

    def finish(self, own: WindowResult) -> List[WindowResult]:
        grads = self.layouts.grad
        results = self._gather(own, grads)
        for name in grads.buffer_names().values():
            self.comm.reduce(name)
        _ensure_grads(self.model)
        grads.unpack(self.comm.buffer, grad_arrays(self.model))
        return results

    def finish_async(self, own: WindowResult, parity: int) -> Tuple[List[WindowResult], Pending]:
        grads = self.layouts.grad_set(parity)
        results = self._gather(own, grads)
        pending: Pending

        def reduce() -> None:
            try:
                for name in grads.buffer_names().values():
                    self.comm.reduce(name)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                pending._error = exc

        def source() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for dtype, entries in grads.groups.items():
                flat = self.comm.buffer(f'{grads.prefix}/{dtype}')
                for e in entries:
                    out[e.name] = flat[e.offset:e.offset + e.size].reshape(e.shape)
            return out

        thread = threading.Thread(target=reduce, name='mgpu-reduce', daemon=True)
        pending = Pending(source, thread)
        thread.start()
        return results, pending

    def states(self) -> Dict[int, Dict[str, Any]]:
        self.pool.send(('state',))
        return self.pool.gather('state', timeout=60.0, what='snapshot')

    def pids(self) -> List[int]:
        return self.pool.pids()

    def close(self, abort: bool = False) -> None:
        try:
            self.pool.close()
        finally:
            if abort:
                self.comm.abort()
            else:
                self.comm.finalize()


def replica_step(msg: tuple, replica: Replica, comm: Any, layouts: ModelLayouts,
                 size: int) -> WindowResult:
    """A worker's side of one update (see :meth:`LocalGroup.begin` and ``finish``)."""
    _, loss_scale, scalars, parity = msg
    model = replica.model
    for name in layouts.param.buffer_names().values():
        comm.bcast(name)
    layouts.param.unpack(comm.buffer, state_arrays(model))
    set_persistent_scalars(model, scalars)
    result = replica.run_window(loss_scale)
    grads = layouts.grad_set(parity)
    grads.pack(grad_arrays(model), comm.buffer)
    layouts.stat.pack(dict(persistent_arrays(model)), comm.buffer, scale=1.0 / size)
    for name in list(grads.buffer_names().values()) + list(layouts.stat.buffer_names().values()):
        comm.reduce(name)
    return result


def _ensure_grads(model: chainer.Link) -> None:
    """Give every parameter a gradient array to receive the reduced one."""
    for param in model.params():
        if param.grad is None:
            with chainer.using_device(param.device):
                param.grad = param.device.xp.zeros_like(param.array)


def payload_factory(init_kwargs: Dict[str, Any],
                    master_model: chainer.Link) -> Callable[[Any], bytes]:
    """Pickle a WorkerInit once the communicator handle is known (see ``_payload``).

    Whatever in it refers to ``master_model`` or its links (a closure as ``loss_func``)
    refers to the worker's replica, ``init_kwargs['model']``, once unpickled.
    """
    from ._worker import WorkerInit

    def make(handle: Any) -> bytes:
        replace = _payload.replica_links(master_model, init_kwargs['model'])
        return _payload.dumps(WorkerInit(comm_handle=handle, **init_kwargs), replace)
    return make

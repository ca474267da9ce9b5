"""The replicas of one update, seen from the master: how gradients meet.

A group hides where the other replicas are: nowhere (one device), in worker processes on
this host (:class:`LocalGroup`: shared memory or NCCL), or in other MPI ranks (see
:mod:`mgpu_updater._mpi`). The updater calls, every update::

    group.begin(loss_scale)           # parameters out, the others start their windows
    own = replica.run_window(...)     # the master's own share
    results = group.finish(own)       # model grads := sum over replicas,
                                      # float persistents := mean over replicas
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional

import chainer

from . import comm as comm_module
from ._flat import (ModelLayouts, grad_arrays, persistent_arrays, persistent_scalars,
                    state_arrays)
from ._lifecycle import WorkerPool
from ._replica import WindowResult


class Group:
    """One device, no one else: nothing to exchange."""

    size = 1

    def begin(self, loss_scale: Optional[float]) -> None:
        pass

    def finish(self, own: WindowResult) -> List[WindowResult]:
        return [own]

    def states(self) -> Dict[int, Dict[str, Any]]:
        return {}

    def pids(self) -> List[int]:
        return []

    def close(self, abort: bool = False) -> None:
        pass


class LocalGroup(Group):
    """Worker processes on this host, one per extra device."""

    def __init__(self, model: chainer.Link, layouts: ModelLayouts, backend: str,
                 master_device: Any, devices: List[Any], payloads: Dict[int, bytes],
                 start_method: str, start_timeout: float) -> None:
        self.size = len(devices)
        self.model = model
        self.layouts = layouts
        self.comm, handle = comm_module.create(backend, self.size, layouts.spec(), master_device)
        self.pool = WorkerPool(devices, start_method)
        try:
            shm = getattr(self.comm, 'segment_names', [])
            self.pool.start({r: p(handle) for r, p in payloads.items()}, shm, start_timeout)
            init = getattr(self.comm, 'init', None)
            if init is not None:
                init()
        except BaseException:
            self.close(abort=True)
            raise
        self._reduced = (list(layouts.grad.buffer_names().values())
                         + list(layouts.stat.buffer_names().values()))
        self._bcast = list(layouts.param.buffer_names().values())

    def begin(self, loss_scale: Optional[float]) -> None:
        self.layouts.param.pack(state_arrays(self.model), self.comm.buffer)
        for name in self._bcast:
            self.comm.bcast(name)
        self.pool.send(('step', loss_scale, persistent_scalars(self.model)))

    def finish(self, own: WindowResult) -> List[WindowResult]:
        model, layouts, comm = self.model, self.layouts, self.comm
        layouts.grad.pack(grad_arrays(model), comm.buffer)
        layouts.stat.pack(dict(persistent_arrays(model)), comm.buffer, scale=1.0 / self.size)
        others = self.pool.gather('done')
        for name in self._reduced:
            comm.reduce(name)
        _ensure_grads(model)
        layouts.grad.unpack(comm.buffer, grad_arrays(model))
        layouts.stat.unpack(comm.buffer, dict(persistent_arrays(model)))
        return [own] + [others[r] for r in sorted(others)]

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


def _ensure_grads(model: chainer.Link) -> None:
    """Give every parameter a gradient array to receive the reduced one."""
    for param in model.params():
        if param.grad is None:
            with chainer.using_device(param.device):
                param.grad = param.device.xp.zeros_like(param.array)


def payload_factory(init_kwargs: Dict[str, Any]):
    """Pickle a WorkerInit once the communicator handle is known."""
    from ._worker import WorkerInit

    def make(handle: Any) -> bytes:
        return pickle.dumps(WorkerInit(comm_handle=handle, **init_kwargs),
                            protocol=pickle.HIGHEST_PROTOCOL)
    return make

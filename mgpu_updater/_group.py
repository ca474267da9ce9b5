"""The replicas of one update, seen from the master: how gradients meet.

A group hides where the other replicas are: nowhere (one device), in worker processes on
this host (:class:`LocalGroup`: shared memory or NCCL), or in other MPI ranks (see
:mod:`mgpu_updater._mpi`). The updater calls, every update::

    group.begin(loss_scale)           # parameters out, the others start their windows
    own = replica.run_window(...)     # the master's own share
    results = group.finish(own)       # model grads := sum over replicas,
                                      # float persistents := mean over replicas

The pipelined mode calls ``finish_async`` instead: it returns with a :class:`Pending`
gradient that the updater applies one update later. The local protocol itself (messages,
the order of the collectives, the master's and the worker's halves) lives in
:mod:`mgpu_updater._protocol`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import chainer

from . import _payload
from . import comm as comm_module
from ._flat import ModelLayouts, grad_arrays
from ._lifecycle import WorkerPool
from ._protocol import State, StateRequest, broadcast_only, master_begin, master_finish
from ._replica import WindowResult


class Pending:
    """A summed gradient kept for later (pipelined mode): ``wait()`` then ``apply(model)``.

    Every collective was issued, in order, before this object exists (see
    :mod:`mgpu_updater._protocol`); ``source`` reads the result where it lies.
    """

    def __init__(self, source: Callable[[], Dict[str, Any]]) -> None:
        self._source = source

    def wait(self) -> Dict[str, Any]:
        """The summed gradients by parameter name."""
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
    """Worker processes on this host, one per extra device.

    Each update runs the master's half of :mod:`mgpu_updater._protocol`: :meth:`begin` is
    :func:`~mgpu_updater._protocol.master_begin`, :meth:`finish` and :meth:`finish_async`
    are :func:`~mgpu_updater._protocol.master_finish`, all on the calling thread.
    """

    def __init__(self, model: chainer.Link, layouts: ModelLayouts, backend: str,
                 master_device: Any, devices: List[Any], payloads: Dict[int, Any],
                 start_method: str, start_timeout: float) -> None:
        self.size = len(devices)
        self.model = model
        self.layouts = layouts
        self.comm, handle = comm_module.create(backend, self.size, layouts.spec(), master_device,
                                               broadcast=broadcast_only(layouts))
        self.pool = WorkerPool(devices, start_method)
        try:
            self.comm.watch_peers(self.pool.check_alive)   # NCCL checks it while it waits
            from ._worker import main as worker_main
            self.pool.start(worker_main, {r: p(handle) for r, p in payloads.items()},
                            self.comm.owned_segments, start_timeout, before_ready=self.comm.init)
        except BaseException:
            self.close(abort=True)
            raise

    def begin(self, loss_scale: Optional[float], parity: Optional[int] = None) -> None:
        master_begin(self.pool, self.comm, self.layouts, self.model, loss_scale, parity)

    def finish(self, own: WindowResult) -> List[WindowResult]:
        others = master_finish(self.pool, self.comm, self.layouts, self.model, None,
                               self.size)
        _ensure_grads(self.model)
        self.layouts.grad.unpack(self.comm.buffer, grad_arrays(self.model))
        return [own] + others

    def finish_async(self, own: WindowResult, parity: int) -> Tuple[List[WindowResult], Pending]:
        """As :meth:`finish`, but the summed gradient stays in the parity's buffers until
        the updater applies it, one update later (the next update uses the other set)."""
        others = master_finish(self.pool, self.comm, self.layouts, self.model, parity,
                               self.size)
        grads = self.layouts.grad_set(parity)

        def source() -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for dtype, entries in grads.groups.items():
                flat = self.comm.buffer(f'{grads.prefix}/{dtype}')
                for e in entries:
                    out[e.name] = flat[e.offset:e.offset + e.size].reshape(e.shape)
            return out

        return [own] + others, Pending(source)

    def states(self) -> Dict[int, Dict[str, Any]]:
        self.pool.send(StateRequest())
        return self.pool.gather(State.KIND, timeout=60.0, what='snapshot')

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

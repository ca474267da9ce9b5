"""The MPI backend: the communicator verbs on a ChainerMN communicator, across hosts.

One process (rank) per device, started by ``mpiexec``; the user creates the ChainerMN
communicator (``chainermn.create_communicator('naive')`` on CPUs, ``'pure_nccl'`` on GPUs)
and every byte goes through it:

- buffers on the host (``'@numpy'``) travel through its mpi4py communicator
  (``communicator.mpi_comm``: ``Reduce``, ``Bcast``, ``Allreduce``);
- buffers on a GPU travel through its NCCL communicator when it has one (``pure_nccl``),
  which ChainerMN creates lazily, on the current device, as for its own gradients; with
  any other ChainerMN communicator they are staged through host memory, so no CUDA-aware
  MPI is needed;
- float16 travels as float32 over MPI (MPI has no half type), as in ChainerMN;
- Python objects (the window results) travel pickled, through ``allgather_obj`` and
  ``bcast_obj``.

Sync points: every verb is a blocking collective. Every rank calls the same verbs on the
same buffer names in the same order (the updater does); the host returns when this rank's
part is done (for NCCL: when the collective was enqueued on the current stream, which the
next kernel on that stream waits for). Each verb is recorded: :meth:`MpiCommunicator.issued`
is this rank's sequence since :meth:`~MpiCommunicator.begin_update`, which the MPI group
compares across the ranks every update (riding on the allgather it does anyway).

The ChainerMN communicator belongs to the caller: :meth:`MpiCommunicator.finalize` releases
this object's buffers and leaves that communicator (and its NCCL communicator) open.

Failures: a collective cannot notice that a peer raised, so a rank that fails leaves the
others waiting. Run the ranks with ``python -m mpi4py script.py`` (or call
``chainermn.global_except_hook.add_hook()``): an uncaught exception then calls
``MPI_Abort`` and ``mpiexec`` ends every rank.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy

import chainer

from .._chainer_private import chainermn_nccl_comm
from .base import BufferSpec, Communicator, Issued, check_spec

__all__ = ['MpiCommunicator']


def _mpi() -> Any:
    from mpi4py import MPI
    return MPI


class MpiCommunicator(Communicator):
    """Named flat buffers reduced and broadcast over a ChainerMN communicator.

    Args:
        communicator: a ChainerMN communicator (anything with ``mpi_comm``, ``rank`` and
            ``size``, as ``chainermn.create_communicator`` returns).
        spec: buffer name -> (dtype, element count), identical on every rank.
        device: this rank's device (a Chainer device or specifier); the buffers live there.
    """

    name = 'mpi'

    def __init__(self, communicator: Any, spec: BufferSpec, device: Any = '@numpy') -> None:
        mpi_comm = getattr(communicator, 'mpi_comm', None)
        if mpi_comm is None:
            raise TypeError(
                f'communicator must be a ChainerMN communicator, as made by '
                f"chainermn.create_communicator('naive') or ('pure_nccl'); "
                f'{type(communicator).__name__} has no mpi_comm')
        super().__init__(int(communicator.rank), int(communicator.size))
        self.chainermn = communicator
        self.mpi_comm = mpi_comm
        self.device = chainer.get_device(device)
        self._spec = check_spec(spec)
        xp = self.device.xp
        self._on_gpu = xp is not numpy
        self._nccl: Any = None
        if self._on_gpu and hasattr(communicator, 'nccl_comm'):
            with chainer.using_device(self.device):   # ChainerMN's lazy NCCL set-up
                self._nccl = chainermn_nccl_comm(communicator)
        self._buffers: Dict[str, Any] = {}
        self._host: Dict[str, numpy.ndarray] = {}
        self._issued: List[Issued] = []
        self.updates = 0   # begin_update calls so far
        with chainer.using_device(self.device):
            for key, (dtype, count) in self._spec.items():
                self._buffers[key] = xp.zeros(count, dtype=dtype)

    @property
    def uses_nccl(self) -> bool:
        """Whether GPU buffers go through ChainerMN's NCCL communicator."""
        return self._nccl is not None

    # ------------------------------------------------------------------ buffers
    def buffer(self, name: str) -> Any:
        self._check_open()
        return self._buffers[name]

    def _staged(self, name: str) -> Optional[numpy.ndarray]:
        """The host array MPI works on, filled from the buffer; ``None`` when the buffer
        itself is one (a host buffer of a type MPI knows)."""
        buf = self._buffers[name]
        if not self._on_gpu and buf.dtype != numpy.float16:
            return None
        host = self._host.get(name)
        if host is None:
            dtype = numpy.float32 if buf.dtype == numpy.float16 else buf.dtype
            host = self._host[name] = numpy.empty(buf.size, dtype=dtype)
        host[...] = chainer.backend.CpuDevice().send(buf) if self._on_gpu else buf
        return host

    def _unstage(self, name: str, host: Optional[numpy.ndarray]) -> None:
        if host is None:
            return
        buf = self._buffers[name]
        if self._on_gpu:
            with chainer.using_device(self.device):
                buf[...] = self.device.send(host.astype(buf.dtype, copy=False))
        else:
            buf[...] = host

    # ------------------------------------------------------------------ NCCL
    def _nccl_args(self, name: str):
        from .nccl import nccl_type_name
        import cupy
        from cupy.cuda import nccl
        buf = self._buffers[name]
        return (buf.data.ptr, buf.size, getattr(nccl, nccl_type_name(buf.dtype)),
                cupy.cuda.get_current_stream().ptr)

    # ------------------------------------------------------------------ the issue order
    def begin_update(self) -> None:
        self._check_open()
        self._issued = []
        self.updates += 1

    def issued(self) -> List[Issued]:
        """The collectives this rank issued since :meth:`begin_update`, in order."""
        return list(self._issued)

    def _record(self, verb: str, name: str) -> None:
        self._check_open()
        if name not in self._buffers:
            raise KeyError(f'no buffer named {name!r}; the spec has {sorted(self._buffers)}')
        self._issued.append((verb, name))

    # ------------------------------------------------------------------ verbs
    def reduce(self, name: str, root: int = 0) -> None:
        self._record('reduce', name)
        if self._nccl is not None:
            from cupy.cuda import nccl
            ptr, n, dtype, stream = self._nccl_args(name)
            with chainer.using_device(self.device):
                self._nccl.reduce(ptr, ptr, n, dtype, nccl.NCCL_SUM, root, stream)
            return
        MPI = _mpi()
        host = self._staged(name)
        array = self._buffers[name] if host is None else host
        if self.rank == root:
            self.mpi_comm.Reduce(MPI.IN_PLACE, array, op=MPI.SUM, root=root)
            self._unstage(name, host)
        else:
            self.mpi_comm.Reduce(array, None, op=MPI.SUM, root=root)

    def bcast(self, name: str, root: int = 0) -> None:
        self._record('bcast', name)
        if self._nccl is not None:   # bytes: exact, any dtype (bool persistents too)
            import cupy
            from cupy.cuda import nccl
            buf = self._buffers[name]
            with chainer.using_device(self.device):
                self._nccl.bcast(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, root,
                                 cupy.cuda.get_current_stream().ptr)
            return
        host = self._staged(name)
        array = self._buffers[name] if host is None else host
        self.mpi_comm.Bcast(array.view(numpy.uint8), root=root)   # bytes: exact, any dtype
        if self.rank != root:
            self._unstage(name, host)

    def allreduce(self, name: str) -> None:
        self._record('allreduce', name)
        if self._nccl is not None:
            from cupy.cuda import nccl
            ptr, n, dtype, stream = self._nccl_args(name)
            with chainer.using_device(self.device):
                self._nccl.allReduce(ptr, ptr, n, dtype, nccl.NCCL_SUM, stream)
            return
        MPI = _mpi()
        host = self._staged(name)
        array = self._buffers[name] if host is None else host
        self.mpi_comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        self._unstage(name, host)

    # ------------------------------------------------------------------ objects
    def allgather_obj(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank (pickled)."""
        self._check_open()
        return self.mpi_comm.allgather(obj)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self._check_open()
        return self.chainermn.bcast_obj(obj, root=root)

    # ------------------------------------------------------------------ shutdown
    def abort(self) -> None:
        """Drop the buffers at once, with no collective (a peer may be gone). Ending the
        other ranks is MPI's job: ``python -m mpi4py`` calls ``MPI_Abort`` on the uncaught
        exception that follows."""
        self._finalized = True
        self._buffers, self._host, self._nccl = {}, {}, None

    def finalize(self) -> None:
        """Wait for this rank's enqueued GPU work, then drop the buffers; the ChainerMN
        communicator stays open (it is the caller's). Safe to call twice."""
        if self._finalized:
            return
        if self._on_gpu and self._buffers:
            with chainer.using_device(self.device):
                self.device.device.synchronize()
        self.abort()

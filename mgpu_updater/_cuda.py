"""Small CUDA helpers. CuPy is imported only when one of them is called.

- :func:`import_cupy`, :func:`import_nccl`: import on first use; when missing, fail with
  what to install.
- :func:`unavailable_reason`: why the GPU paths cannot run here (for test skips and
  reports), or ``None`` when they can; :func:`chainer_cuda_unavailable`: Chainer's own
  verdict on CUDA, part of it.
- :func:`wait_event`: a bounded host wait on a CUDA event. It polls instead of blocking in
  the driver, so the caller can notice a dead peer or give up after a timeout.
- :func:`using_device`: a CUDA device current for a block, so that the kernels launched
  there run on it, on its current stream (CuPy launches on the current device's stream,
  even for arrays of another device, through peer access).
- :class:`PinnedStager`: host batches -> reused pinned buffers -> the device, on a side
  stream, for the prefetcher of a GPU replica.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, ContextManager, List, Optional

import numpy

INSTALL_HINT = ("install CuPy for your CUDA version: pip install 'mgpu_updater[cuda12]' "
                "(CUDA 12) or pip install 'mgpu_updater[cuda13]' (CUDA 13)")
NCCL_HINT = "pip install nvidia-nccl-cu12 (CUDA 12) or nvidia-nccl-cu13 (CUDA 13)"
PINNED_SETS = 2   # sets of pinned buffers a PinnedStager stages from in turn


def import_cupy() -> Any:
    """Return the ``cupy`` module, or raise ImportError naming what to install."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails while loading
        raise ImportError(
            f'the GPU code of mgpu_updater needs CuPy, which could not be imported '
            f'({type(e).__name__}: {e}); {INSTALL_HINT}') from e
    return cupy


# CuPy 14 changed NCCL's unique id from a tuple of ints to bytes; comm/nccl.py uses bytes.
NCCL_MIN_CUPY = 14


def import_nccl() -> Any:
    """Return ``cupy.cuda.nccl`` once NCCL is loadable, or raise ImportError naming it.

    Needs CuPy >= 14 (its ``NcclCommunicator`` takes the unique id as bytes).
    """
    cupy = import_cupy()
    version = str(getattr(cupy, '__version__', '0'))
    if _major(version) < NCCL_MIN_CUPY:
        raise ImportError(
            f'the nccl communicator needs CuPy >= {NCCL_MIN_CUPY}, found CuPy {version} '
            f'(whose NCCL unique id is a tuple, not bytes); {INSTALL_HINT}')
    error: Optional[BaseException] = None
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # CuPy warns, then we raise the same news
        try:
            from cupy.cuda import nccl
        except Exception as e:
            nccl, error = None, e
    if nccl is None or not getattr(nccl, 'available', False):
        reason = f' ({type(error).__name__}: {error})' if error else ''
        raise ImportError(
            f'the nccl communicator needs the NCCL library, which CuPy could not load'
            f'{reason}; {NCCL_HINT}') from error
    return nccl


def _major(version: str) -> int:
    head = version.split('.')[0]
    return int(head) if head.isdigit() else 0


def chainer_cuda_unavailable() -> Optional[str]:
    """Chainer's own CUDA verdict: None when ``chainer.backends.cuda.available``, else why
    not, from the exception Chainer caught while importing CuPy and its CUDA libraries
    (``_resolution_error``, ``chainer/backends/cuda.py:56-78``: e.g. cuBLAS not found).

    Chainer also stores a failed cuDNN import there (``cuda.py:133-134``) while CUDA stays
    available; that is not a reason, and is not reported.
    """
    from chainer.backends import cuda
    from ._chainer_private import cuda_resolution_error
    if cuda.available:
        return None
    error = cuda_resolution_error()
    cause = f'{type(error).__name__}: {error}' if error is not None else 'no error recorded'
    return f'chainer.backends.cuda.available is False ({cause})'


def unavailable_reason(nccl: bool = False) -> Optional[str]:
    """Why CuPy (and NCCL when ``nccl``) cannot run here, in a few words; None if it can.

    In order: CuPy not importable; Chainer's own verdict (:func:`chainer_cuda_unavailable`,
    e.g. CuPy imports but its CUDA libraries do not load); no CUDA device; NCCL missing.
    This queries the driver, so call it from the test or the benchmark that needs the
    GPU, not at import or collection time.
    """
    try:
        cupy = import_cupy()
    except ImportError as e:
        return f'CuPy not installed ({e.__cause__})'
    chainer_verdict = chainer_cuda_unavailable()
    if chainer_verdict is not None:
        return f'Chainer cannot use CUDA: {chainer_verdict}'
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f'no CUDA device ({type(e).__name__}: {e})'
    if count < 1:
        return 'no CUDA device'
    if nccl:
        try:
            import_nccl()
        except ImportError:
            return f'NCCL not available ({NCCL_HINT})'
    return None


def using_device(device_id: Optional[int]) -> ContextManager[Any]:
    """CUDA device ``device_id`` current inside the ``with`` block (CuPy's ``Device``);
    nothing for ``None`` (buffers on the host)."""
    if device_id is None:
        return _ON_HOST
    return import_cupy().cuda.Device(device_id)


_ON_HOST = contextlib.nullcontext()   # reusable, and used twice in every update of CPU replicas


def wait_event(event: Any, *, timeout: Optional[float] = None,
               check: Optional[Callable[[], None]] = None,
               what: str = 'the GPU work') -> None:
    """Return once ``event`` has completed.

    Polls ``event.done`` (no blocking call into the driver). ``check``, when given, runs
    about every 50 ms and may raise (a dead peer, an NCCL error); its exception propagates.
    After ``timeout`` seconds, raises TimeoutError.
    """
    if event.done:
        return
    start = last_check = time.monotonic()
    delay = 2e-5
    while not event.done:
        now = time.monotonic()
        if check is not None and now - last_check >= 0.05:
            check()
            last_check = now
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f'{what} did not finish within {timeout:g} s')
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class Staged:
    """A batch on its way to the device: use ``arrays`` after :meth:`wait`."""

    __slots__ = ('arrays', '_event')

    def __init__(self, arrays: Any, event: Any) -> None:
        self.arrays = arrays
        self._event = event

    def wait(self, stream: Any = None) -> Any:
        """Make ``stream`` (default: the current one) wait for the copies; returns ``arrays``.

        This does not block the host.
        """
        if stream is None:
            stream = import_cupy().cuda.get_current_stream()
        stream.wait_event(self._event)
        return self.arrays

    def done(self) -> bool:
        """Whether the copies have finished (non-blocking)."""
        return bool(self._event.done)


class PinnedStager:
    """Copies host batches to one device through reused pinned buffers on a side stream.

    :meth:`stage` walks the converter's output (a numpy array, or a tuple, list or dict of
    them, nested), copies each numeric array into a pinned host buffer, starts an
    asynchronous copy from there into a new device array on the stager's own non-blocking
    stream, and returns a :class:`Staged` with the same structure. Other values pass
    through unchanged.

    Ordering: the device arrays come from the memory pool of ``compute_stream`` (default:
    the null stream, which Chainer computes on), and the copies start only after the work
    enqueued on that stream so far. So memory the pool hands out again, after the compute
    stream's last use of it, is never overwritten early. The consumer calls
    ``staged.wait()`` before using the arrays.

    The host blocks in one place only: before :meth:`stage` overwrites pinned buffers, it
    waits (bounded by ``timeout``) for the copies from them. There are two sets of them,
    taken in turn (:data:`PINNED_SETS`), so that is the copies of the batch before the
    last: each copy starts only after the compute queued when its batch was staged, so with
    one set the thread that stages the next batch waited for the device to finish the
    compute queued before the last one, and a host that ran ahead of the device (a model
    the GPU is busy with, several micro-batches an update) could be no more than about
    one micro-batch ahead. One stager serves one thread.
    """

    def __init__(self, device: int, compute_stream: Any = None,
                 timeout: Optional[float] = None) -> None:
        cupy = import_cupy()
        self._cupy = cupy
        self.device = int(device)
        self.timeout = timeout
        self._compute = compute_stream
        with cupy.cuda.Device(self.device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        # per set: slot i -> pinned memory of the i-th array; the event after the copies
        # of the batch last staged from that set
        self._sets: List[List[Any]] = [[] for _ in range(PINNED_SETS)]
        self._copied: List[Any] = [None] * PINNED_SETS
        self._turn = 0                 # the set the next batch is staged from

    def stage(self, batch: Any) -> Staged:
        cupy = self._cupy
        turn = self._turn
        self._wait_copied(turn)
        leaves: List[numpy.ndarray] = []
        template = _collect(batch, leaves)
        with cupy.cuda.Device(self.device):
            compute = self._compute if self._compute is not None else cupy.cuda.Stream.null
            with compute:
                targets = [cupy.empty(a.shape, a.dtype.newbyteorder('=')) for a in leaves]
                ready = cupy.cuda.Event(disable_timing=True)
                ready.record(compute)
            self.stream.wait_event(ready)
            for i, (src, dst) in enumerate(zip(leaves, targets)):
                if src.nbytes == 0:
                    continue
                host = self._pinned_view(self._sets[turn], i, dst.shape, dst.dtype)
                host[...] = src
                dst.data.copy_from_host_async(host.ctypes.data, dst.nbytes, self.stream)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(self.stream)
        self._copied[turn] = done
        self._turn = (turn + 1) % PINNED_SETS
        return Staged(_rebuild(template, iter(targets)), done)

    def close(self) -> None:
        """Wait (bounded) for the last copies, then release the pinned buffers."""
        for turn in range(PINNED_SETS):
            self._wait_copied(turn)
        self._sets = [[] for _ in range(PINNED_SETS)]

    def _wait_copied(self, turn: int) -> None:
        """Wait for the copies from set ``turn`` (the batch staged from it last)."""
        event = self._copied[turn]
        if event is not None:
            wait_event(event, timeout=self.timeout,
                       what=f'the host-to-device copy to device {self.device}')
            self._copied[turn] = None

    def _pinned_view(self, pinned: List[Any], slot: int, shape: Any,
                     dtype: numpy.dtype) -> numpy.ndarray:
        nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
        while len(pinned) <= slot:
            pinned.append(None)
        mem = pinned[slot]
        if mem is None or mem.size() < nbytes:
            # grow by a quarter so slowly growing batches do not reallocate every time
            mem = self._cupy.cuda.alloc_pinned_memory(nbytes + nbytes // 4)
            pinned[slot] = mem
        return numpy.ndarray(shape, dtype, buffer=mem)


_LEAF = object()


def _collect(batch: Any, leaves: List[numpy.ndarray]) -> Any:
    """The structure of ``batch`` with each numeric numpy array replaced by _LEAF."""
    if isinstance(batch, numpy.ndarray) and batch.dtype.kind in 'biufc':
        leaves.append(batch)
        return _LEAF
    if isinstance(batch, tuple):
        return tuple(_collect(x, leaves) for x in batch)
    if isinstance(batch, list):
        return [_collect(x, leaves) for x in batch]
    if isinstance(batch, dict):
        return {k: _collect(v, leaves) for k, v in batch.items()}
    return batch


def _rebuild(template: Any, targets: Any) -> Any:
    if template is _LEAF:
        return next(targets)
    if isinstance(template, tuple):
        return tuple(_rebuild(x, targets) for x in template)
    if isinstance(template, list):
        return [_rebuild(x, targets) for x in template]
    if isinstance(template, dict):
        return {k: _rebuild(v, targets) for k, v in template.items()}
    return template

"""The host's limits, named where the replicas' start runs into one.

Starting CPU replicas makes what ``StandardUpdater`` never needs: worker processes and
their threads, pipes, shared-memory segments in ``/dev/shm``, a copy of the model per
worker. Under a shell's or a container's limits that fails deep inside the standard
library, with a bare ``OSError: [Errno 24] Too many open files``, ``can't start new
thread``, ``[Errno 27] File too large`` from ``ftruncate``, an empty ``MemoryError`` or a
``FileNotFoundError`` without a path. :func:`explained` turns such an error into one of
the same type that names the limit, its value here and the fix; the caller raises it from
the original.
"""
from __future__ import annotations

import errno
import os
from typing import Optional

try:
    import resource
except ImportError:   # not POSIX: no limits to read
    resource = None   # type: ignore[assignment]


def _soft(name: str) -> Optional[int]:
    """The soft limit ``resource.<name>`` of this process, or None where there is none
    (unlimited, or not readable here)."""
    limit = getattr(resource, name, None)
    if limit is None:
        return None
    try:
        soft = resource.getrlimit(limit)[0]
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def _cwd_gone() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def explained(exc: BaseException, workers: int = 1) -> Optional[BaseException]:
    """An error of ``exc``'s type that says which limit of this host ``exc`` came from,
    or None where it came from none (then ``exc`` stands as it is). ``workers``: how many
    worker processes the start makes (none: the loader's thread is all it starts)."""
    start = 'the replicas could not start: '
    code = getattr(exc, 'errno', None)
    fewer = 'use fewer replicas' if workers else 'pass prefetch=0 (no loading thread)'
    if isinstance(exc, OSError) and code in (errno.EMFILE, errno.ENFILE):
        files = _soft('RLIMIT_NOFILE')
        return OSError(code, (
            f'{start}too many open files ({exc.strerror}). Each worker process takes about '
            'fifteen file descriptors of the master (the pipes of its messages and its '
            'output, shared memory, its process handles; a MultiprocessIterator more), and '
            f'this process may have {files if files is not None else "few"} (ulimit -n). '
            'Raise the limit (ulimit -n 4096 in the shell that starts the script), or '
            f'{fewer}'), exc.filename)
    if (isinstance(exc, BlockingIOError) and code == errno.EAGAIN) or (
            type(exc) is RuntimeError and "can't start new thread" in str(exc)):
        tasks = _soft('RLIMIT_NPROC')
        text = (f'{start}no process or thread could be made ({exc}). Each worker is a '
                'process with a few threads of its own, and a MultiprocessIterator makes '
                'more; the limit on the processes and threads of this user '
                f'({"ulimit -u " + str(tasks) if tasks is not None else "ulimit -u"}) or a '
                f"container's pids limit is reached. Raise it, or {fewer}")
        return (BlockingIOError(code, text) if isinstance(exc, BlockingIOError)
                else RuntimeError(text))
    memory = _soft('RLIMIT_AS')
    if memory is not None and (isinstance(exc, MemoryError) or (
            isinstance(exc, OSError) and code == errno.ENOMEM)):
        text = (f'{start}out of memory ({type(exc).__name__}: {exc}) under an address-space '
                f'limit of {memory / 2**20:.0f} MiB (ulimit -v). The master holds one copy '
                'of the model more while it pickles each worker its own, and every process '
                'maps the shared memory of the replicas (docs/memory.md): about twice '
                "StandardUpdater's address space. Raise the limit (ulimit -v unlimited), "
                f'or {fewer}')
        return (OSError(code, text, exc.filename) if isinstance(exc, OSError)
                else MemoryError(text))
    if isinstance(exc, OSError) and code == errno.EFBIG:
        size = _soft('RLIMIT_FSIZE')
        return OSError(code, (
            f'{start}a file-size limit ({exc.strerror}: ulimit -f, '
            f'{"%d bytes" % size if size is not None else "set"}) caps the shared-memory '
            'segments in /dev/shm that the replicas meet in too, which hold as many bytes '
            'as the parameters. Raise it (ulimit -f unlimited)'), exc.filename)
    if isinstance(exc, FileNotFoundError) and exc.filename is None and _cwd_gone():
        return FileNotFoundError(code or errno.ENOENT, (
            f'{start}the current directory was removed, and worker processes start in it '
            "(multiprocessing's spawn). Change to a directory that exists before the "
            'first update (os.chdir)'))
    return None

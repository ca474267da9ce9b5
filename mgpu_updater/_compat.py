"""The narrow shim that lets Chainer 7.8.1 import on Python >= 3.12 and numpy >= 2.

Chainer 7.8.1 (the last release) predates both. Two things stop it, and only two were
found by importing it and training a small CNN (BatchNorm, Adam, Evaluator, snapshot
and resume) on Python 3.12/3.13 with numpy 2.x:

1. ``chainer/_environment_check.py`` does ``import numpy.distutils.system_info`` at
   import time, only to call ``get_info('blas_opt')`` on macOS. ``numpy.distutils`` does
   not exist on Python >= 3.12 (nor in numpy builds that dropped it), so ``import
   chainer`` fails with ``ModuleNotFoundError``. :func:`apply` puts a stub
   ``numpy.distutils`` package with a ``system_info`` module whose ``get_info`` returns
   ``{}`` ('no BLAS information'; the check then does nothing) into ``sys.modules``,
   and only when the real one cannot be found.
2. ``chainer/functions/array/as_strided.py`` reads ``numpy.sctypes`` at import time
   (and again in its backward). numpy 2.0 removed it, so ``import chainer`` fails with
   ``AttributeError``. :func:`apply` sets ``numpy.sctypes`` back to the dict numpy 1.26
   had, built from the scalar types numpy 2 still has, and only when it is missing.

A third thing makes it fail where warnings are errors (pytest's ``filterwarnings =
error``, ``python -W error``):

3. CuPy 14 dropped cuDNN (``cupy.cuda.cudnn`` and ``cupy.cudnn`` are gone). Chainer then
   sets ``cudnn_enabled = False`` (``chainer/backends/cuda.py:123-138``) and its
   ``check_cuda_available()`` (``cuda.py:151-159``) warns ``cuDNN is not enabled`` unless
   ``CHAINER_CUDNN`` is ``0``, which Chainer reads once, at import
   (``_cudnn_disabled_by_user``, ``cuda.py:125``). The first such call comes during
   ``import chainer`` itself (``chainer/functions/activation/relu.py:13`` builds a kernel
   with ``cuda.elementwise``, which checks, ``cuda.py:596``), so under ``-W error`` the
   import fails. With CuPy >= 14 installed,
   :func:`apply` sets ``CHAINER_CUDNN=0`` in ``os.environ``, unless the user set it
   already (any value, kept as it is) or Chainer's CUDA module is imported already (too
   late to matter). The version is read from the package metadata of the installed
   distributions (``cupy``, ``cupy-cuda12x``, ``cupy-cuda13x``, ...) without importing
   CuPy. Nothing is lost: there is no cuDNN to disable, and Chainer runs its own
   cuDNN-free code (im2col + cuBLAS), as it does whenever ``cudnn_enabled`` is False.
   The variable is inherited by child processes (the workers), which is intended.

Nothing else is changed: no other numpy alias is restored and no warning is silenced
here. (``numpy.float``, used by ``F.resize_images``, was removed in numpy 1.24 and is
broken on every supported stack alike; it is not this shim's business.)

:func:`apply` must run before the first ``import chainer``. ``import mgpu_updater`` runs
it, and so does the import hook that installing mgpu_updater sets up
(``_mgpu_updater_hook.py``, loaded at start-up by ``mgpu_updater-chainer-hook.pth`` in
site-packages): the first ``import chainer`` applies it, so scripts that import Chainer
before ``mgpu_updater`` (every Chainer script) work unchanged. Where that hook is
switched off (``MGPU_UPDATER_NO_IMPORT_HOOK=1``) or mgpu_updater is not installed (only
on ``sys.path``), such code calls it itself::

    from mgpu_updater._compat import apply
    apply()
    import chainer

:func:`warning_filters` gives the ``filterwarnings`` entries (pytest ini format) that
importing Chainer and its dependencies needs under ``-W error``.
"""

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from typing import Optional

import numpy

__all__ = ['apply', 'needed', 'warning_filters']

# Set on the stub modules, so that tests and users can tell them from numpy's own.
STUB_MARK = '__mgpu_updater_stub__'


def _distutils_missing():
    if 'numpy.distutils.system_info' in sys.modules:
        return False
    try:
        return importlib.util.find_spec('numpy.distutils') is None
    except (ImportError, ValueError):
        return True


def _sctypes_missing():
    # numpy >= 2 raises AttributeError from its module __getattr__.
    return not hasattr(numpy, 'sctypes')


# CuPy's distributions on PyPI: cupy (source), cupy-cuda12x, cupy-cuda13x, cupy-rocm-6-0...
_CUPY_DIST = re.compile(r'^cupy(-(cuda|rocm)[a-z0-9-]*)?$')
# The first CuPy release without cuDNN.
CUPY_WITHOUT_CUDNN = 14


def _normalized(name):
    return re.sub(r'[-_.]+', '-', name).lower()


def installed_cupy_without_cudnn() -> Optional[str]:
    """The installed CuPy distribution >= 14, as ``'name version'``, or None.

    Read from package metadata: CuPy is not imported (that would load CUDA libraries).
    """
    for dist in importlib.metadata.distributions():
        name = dist.metadata['Name'] or ''
        if not _CUPY_DIST.match(_normalized(name)):
            continue
        major = re.match(r'\d+', dist.version or '')
        if major and int(major.group()) >= CUPY_WITHOUT_CUDNN:
            return f'{name} {dist.version}'
    return None


def _cudnn_switch_needed():
    return ('CHAINER_CUDNN' not in os.environ
            and 'chainer.backends.cuda' not in sys.modules
            and installed_cupy_without_cudnn() is not None)


def needed():
    """Return the names of the patches :func:`apply` would make now (maybe empty)."""
    names = []
    if _distutils_missing():
        names.append('numpy.distutils')
    if _sctypes_missing():
        names.append('numpy.sctypes')
    if _cudnn_switch_needed():
        names.append('CHAINER_CUDNN=0')
    return names


def _stub_module(name, is_package=False):
    module = types.ModuleType(name, 'Stub installed by mgpu_updater._compat.')
    module.__spec__ = importlib.machinery.ModuleSpec(
        name, None, origin='mgpu_updater._compat', is_package=is_package
    )
    if is_package:
        module.__path__ = []  # no submodules but the ones set below
    setattr(module, STUB_MARK, True)
    return module


def _install_distutils_stub():
    def get_info(name, notfound_action=0):
        """Stub of ``numpy.distutils.system_info.get_info``: no library information."""
        return {}

    package = _stub_module('numpy.distutils', is_package=True)
    system_info = _stub_module('numpy.distutils.system_info')
    system_info.get_info = get_info
    package.system_info = system_info
    sys.modules['numpy.distutils'] = package
    sys.modules['numpy.distutils.system_info'] = system_info
    # ``import numpy.distutils.system_info`` binds the submodule on its parent, as here.
    numpy.distutils = package


def sctypes_numpy126():
    """Return the ``numpy.sctypes`` dict numpy 1.26 had, built from today's types."""
    return {
        'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
        'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
        'float': [numpy.float16, numpy.float32, numpy.float64, numpy.longdouble],
        'complex': [numpy.complex64, numpy.complex128, numpy.clongdouble],
        'others': [bool, object, bytes, str, numpy.void],
    }


def _restore_sctypes():
    numpy.sctypes = sctypes_numpy126()


def _disable_cudnn():
    os.environ['CHAINER_CUDNN'] = '0'


_PATCHES = {
    'numpy.distutils': _install_distutils_stub,
    'numpy.sctypes': _restore_sctypes,
    'CHAINER_CUDNN=0': _disable_cudnn,
}


def apply():
    """Make ``import chainer`` work on this Python/numpy; call before importing Chainer.

    Idempotent, and a no-op where nothing is missing (Python 3.11 with numpy 1.x and no
    CuPy >= 14).
    Returns the names of the patches made by this call (empty when none were needed).
    """
    names = needed()
    for name in names:
        _PATCHES[name]()
    return names


# pytest ini format: action:message:category:module. The message is a regex matched
# at the start of the warning text; the module is a regex matched against the whole
# module name that the warning is attributed to.
_WARNING_FILTERS = [
    # chainer/_environment_check.py imports pkg_resources, which warns: a
    # DeprecationWarning in setuptools 73, a UserWarning in 81 (65.5 does not warn).
    'ignore:pkg_resources is deprecated as an API:DeprecationWarning',
    'ignore:pkg_resources is deprecated as an API:UserWarning',
    # ... and the real numpy.distutils where it exists (Python 3.11), which warns
    # itself and imports setuptools' distutils.msvccompiler, which warns too.
    'ignore:\\s*`numpy.distutils` is deprecated:DeprecationWarning',
    'ignore:msvccompiler is deprecated:DeprecationWarning',
]


def warning_filters():
    """Return the ``filterwarnings`` entries (pytest ini format) Chainer's import needs.

    Each one names a message; none silences a whole category. ``pyproject.toml``
    lists the same entries after ``'error'``.
    """
    return list(_WARNING_FILTERS)

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

Nothing else is changed: no other numpy alias is restored and no warning is silenced
here. (``numpy.float``, used by ``F.resize_images``, was removed in numpy 1.24 and is
broken on every supported stack alike; it is not this shim's business.)

:func:`apply` must run before the first ``import chainer``; ``import mgpu_updater`` runs
it. Code that imports Chainer before ``mgpu_updater`` calls it itself::

    from mgpu_updater._compat import apply
    apply()
    import chainer

:func:`warning_filters` gives the ``filterwarnings`` entries (pytest ini format) that
importing Chainer and its dependencies needs under ``-W error``.
"""

import importlib.machinery
import importlib.util
import sys
import types

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


def needed():
    """Return the names of the patches :func:`apply` would make now (maybe empty)."""
    names = []
    if _distutils_missing():
        names.append('numpy.distutils')
    if _sctypes_missing():
        names.append('numpy.sctypes')
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


_PATCHES = {
    'numpy.distutils': _install_distutils_stub,
    'numpy.sctypes': _restore_sctypes,
}


def apply():
    """Make ``import chainer`` work on this Python/numpy; call before importing Chainer.

    Idempotent, and a no-op where nothing is missing (Python 3.11 with numpy 1.x).
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

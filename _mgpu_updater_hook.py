"""Applies mgpu_updater's Chainer compat shim when Chainer is first imported.

Installing mgpu_updater puts ``mgpu_updater-chainer-hook.pth`` into site-packages. Python
runs its one line at start-up: it imports this module (nothing but ``sys``, which is
loaded already) and calls :func:`install`, which puts :class:`ChainerImportHook` first on
``sys.meta_path``. The hook finds nothing itself. The first time anything imports
``chainer`` (a script that does ``import chainer`` before ``import mgpu_updater``, as
every Chainer script does), it removes itself and applies the shim
(:func:`mgpu_updater._compat.apply`, which makes Chainer 7.8.1 import on Python >= 3.12,
numpy >= 2 and CuPy >= 14), then lets the normal finders load Chainer. Where Chainer is
never imported, nothing else happens.

The shim module is loaded from its file, as ``mgpu_updater._compat``, without importing
the ``mgpu_updater`` package (whose ``__init__`` imports Chainer). A later ``import
mgpu_updater`` reuses that module and its ``apply()`` finds nothing left to do.

Set ``MGPU_UPDATER_NO_IMPORT_HOOK=1`` to keep the hook from installing.
"""
import sys

__all__ = ['ChainerImportHook', 'install', 'uninstall', 'installed']

DISABLE_VARIABLE = 'MGPU_UPDATER_NO_IMPORT_HOOK'
SHIM = 'mgpu_updater._compat'


class ChainerImportHook:
    """A ``sys.meta_path`` finder that applies the shim on the first ``import chainer``."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != 'chainer':
            return None
        uninstall()
        try:
            apply_shim()
        except Exception as e:
            raise ImportError(
                f'mgpu_updater could not apply its Chainer compat shim before importing '
                f'Chainer ({type(e).__name__}: {e}); set {DISABLE_VARIABLE}=1 to import '
                'Chainer without it') from e
        return None   # the regular finders load Chainer


def apply_shim():
    """Load ``mgpu_updater._compat`` without importing the package, and apply it.

    Returns the names of the patches made (empty when none were needed), or None when
    mgpu_updater is not installed any more.
    """
    module = sys.modules.get(SHIM)
    if module is None:
        import importlib.machinery
        import importlib.util
        package = importlib.util.find_spec('mgpu_updater')   # finds, does not import
        if package is None or not package.submodule_search_locations:
            return None
        found = importlib.machinery.PathFinder.find_spec(
            '_compat', list(package.submodule_search_locations))
        if found is None or not found.origin:
            return None
        spec = importlib.util.spec_from_file_location(SHIM, found.origin)
        module = importlib.util.module_from_spec(spec)
        sys.modules[SHIM] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[SHIM]
            raise
    return module.apply()


def installed():
    return any(finder is ChainerImportHook for finder in sys.meta_path)


def install():
    """Put the hook first on ``sys.meta_path``, unless Chainer is imported already, the
    hook is there already, or ``MGPU_UPDATER_NO_IMPORT_HOOK`` is set (non-empty)."""
    import os
    if os.environ.get(DISABLE_VARIABLE) or 'chainer' in sys.modules or installed():
        return
    sys.meta_path.insert(0, ChainerImportHook)


def uninstall():
    while ChainerImportHook in sys.meta_path:
        sys.meta_path.remove(ChainerImportHook)

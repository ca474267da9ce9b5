"""The one build step pyproject.toml cannot express: ship ``mgpu_updater-chainer-hook.pth``.

Everything else (metadata, dependencies, packages) is in pyproject.toml. The ``.pth`` file
must land in site-packages itself, where Python's ``site`` module runs its line at
start-up: it installs the import hook of ``_mgpu_updater_hook.py``, which applies
mgpu_updater's Chainer compat shim when Chainer is first imported. ``build_py`` writes it:

- regular wheel: into ``build_lib``, whose top level becomes site-packages;
- editable install (PEP 660, setuptools >= 64): ``editable_wheel`` runs ``build_py`` in
  editable mode with a throw-away ``build_lib`` and packs the unpacked wheel directory,
  the ``install`` command's ``install_lib``, as it is; so the file goes there.

tests/test_import_hook.py checks both install modes in fresh virtual environments.

The build's ``mgpu_updater.egg-info`` goes into ``build/``, not beside ``pyproject.toml``:
there, ``python -c`` run in the source tree (README's check after ``pip install .``) has it
on ``sys.path``, and ``pkg_resources``, which Chainer imports, warns that
``_mgpu_updater_hook`` "was already imported" from site-packages (setuptools 80.8 on Python
3.13; tests/test_install.py checks the check is quiet).
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = 'mgpu_updater-chainer-hook.pth'
PTH_LINE = 'import _mgpu_updater_hook; _mgpu_updater_hook.install()\n'


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if getattr(self, 'editable_mode', False):
            target = self.get_finalized_command('install').install_lib
        else:
            target = self.build_lib
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, PTH_NAME), 'w', encoding='utf-8') as f:
            f.write(PTH_LINE)


EGG_BASE = 'build'
os.makedirs(EGG_BASE, exist_ok=True)   # egg_info wants it to exist
setup(cmdclass={'build_py': build_py_with_pth}, options={'egg_info': {'egg_base': EGG_BASE}})

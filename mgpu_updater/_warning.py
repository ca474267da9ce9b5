"""The package's warnings, each shown once per updater rather than once per process.

Python's default action shows a warning once per text and place: it keeps what it has shown
in the registry of the module the warning is attributed to. A script that builds updater
after updater in one process (a hyperparameter sweep, a notebook run again) saw a warning
about a silent difference (state the workers do not get, samples read again) in its first
trial only, though every later trial trained the same way. So every warning of the package
goes through :func:`warn`, which keeps registries of its own, one per module as Python
does, and forgets what the default action recorded as each updater is built
(:func:`new_updater`): within one updater's life a warning repeats no more than before, and
each updater's are shown. The filters (``-W``, ``warnings.simplefilter``, pytest's) apply as
to any warning; what the ``'once'`` and ``'module'`` actions record stays for the process.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Dict, Type

_registries: Dict[str, Dict[Any, Any]] = {}   # module name -> its registry


def new_updater() -> None:
    """Forget what the default action showed: the updater being built shows it again.
    (Its keys are ``(text, category, lineno)``; ``'once'`` writes ``(text, category)`` and
    ``'module'`` ``(text, category, 0)``, which stay.)"""
    for registry in list(_registries.values()):   # (another thread may warn meanwhile)
        for key in [k for k in list(registry) if type(k) is tuple and len(k) == 3 and k[2]]:
            registry.pop(key, None)


def warn(message: Any, category: Type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)``, with this module's registries."""
    try:
        frame = sys._getframe(stacklevel)
    except ValueError:   # fewer frames than asked for: as warnings.warn attributes it
        module, filename, lineno = 'sys', 'sys', 1
    else:
        module = frame.f_globals.get('__name__', '<string>')
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
    # no module_globals: warn_explicit would ask the module's loader for the source line,
    # and a __main__ run by `python -c` or from stdin has one that raises instead
    warnings.warn_explicit(message, category, filename, lineno, module,
                           _registries.setdefault(module, {}))

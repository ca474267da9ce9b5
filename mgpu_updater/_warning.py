"""The package's warnings, each shown once per updater rather than once per process.

Python's default action shows a warning once per text and place: it keeps what it has shown
in the registry of the module the warning is attributed to. A script that builds updater
after updater in one process (a hyperparameter sweep, a notebook run again) saw a warning
about a silent difference (state the workers do not get, samples read again) in its first
trial only, though every later trial trained the same way. So every warning of the package
goes through :func:`warn`, which keeps its own registry and starts it afresh as each updater
is built (:func:`new_updater`): within one updater's life a warning repeats no more than
before, and each updater's are shown. The filters (``-W``, ``warnings.simplefilter``,
pytest's) apply as to any warning, ``'once'`` included.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Dict, Type

_registry: Dict[Any, Any] = {}


def new_updater() -> None:
    """Forget what was shown: the updater being built shows its warnings again."""
    global _registry
    _registry = {}


def warn(message: Any, category: Type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)``, with this module's registry."""
    try:
        frame = sys._getframe(stacklevel)
    except ValueError:   # fewer frames than asked for: as warnings.warn attributes it
        globals_: Dict[str, Any] = sys.__dict__
        filename, lineno = 'sys', 1
    else:
        globals_ = frame.f_globals
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
    warnings.warn_explicit(message, category, filename, lineno,
                           globals_.get('__name__', '<string>'), _registry, globals_)

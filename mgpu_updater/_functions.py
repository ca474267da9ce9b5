"""What a Python function holds and reads: its closure's cells and the global names of its
code. (For the walks that look through a converter or a forgotten function for what they
reach: ``_loader``'s copies of generators, ``_replica``'s search for another model.)"""
from __future__ import annotations

import types
from typing import Any, List


def cell_is_set(cell: Any) -> bool:
    """Whether a closure's cell holds a value (a cell not assigned yet raises)."""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def global_names(code: types.CodeType) -> List[str]:
    """The global names a function's code, and the code nested in it, reads."""
    names: List[str] = []
    codes = [code]
    while codes:
        current = codes.pop()
        names += current.co_names
        codes += [c for c in current.co_consts if isinstance(c, types.CodeType)]
    return names

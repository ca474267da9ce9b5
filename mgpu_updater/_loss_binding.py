"""A ``loss_func`` that computes with the model, re-bound to each replica's own copy.

Chainer scripts pass the model itself as ``loss_func`` (the VAE example), one of its links,
a method of either (``model.predictor.loss``), or a closure over the model
(``model.get_loss_func()``). In a worker each must compute with that worker's replica of
the model: otherwise it runs on a copy nobody updates, its gradient never reaches the
reduction, and what it reports names an observer the worker's reporter does not know.

Two ways, both keyed on where the link sits in the model (its ``namedlinks`` path):

* :func:`find` describes a link or a bound method of a link as a :class:`LossBinding`; the
  worker rebuilds it on its replica with :func:`resolve` (nothing of the callable travels).
* :func:`swap_model` rewrites a closure or ``functools.partial`` so that every reference to
  the model or one of its links (in its closure cells, its arguments, or a bound method's
  ``self``) points at the replica's counterpart instead. The worker payload pickles the
  replica model and this ``loss_func`` together, so the pickle memo keeps them one object
  in the worker.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Dict, NamedTuple, Optional

import chainer

_DEPTH = 4   # how deep swap_model looks: closures of closures, partials of methods...


class LossBinding(NamedTuple):
    """``loss_func`` as a place in the model: the link at ``path`` ('/' is the model),
    called itself (``method`` None) or through its method ``method``."""
    path: str
    method: Optional[str]


def find(loss_func: Optional[Callable], model: chainer.Link) -> Optional[LossBinding]:
    """The binding of ``loss_func`` when it is the model, one of its links, or a method
    bound to one of them; None otherwise."""
    if loss_func is None:
        return None
    paths = {id(link): path for path, link in model.namedlinks()}
    if id(loss_func) in paths:
        return LossBinding(paths[id(loss_func)], None)
    owner = getattr(loss_func, '__self__', None)
    if isinstance(loss_func, types.MethodType) and id(owner) in paths:
        name = loss_func.__func__.__name__
        if getattr(owner, name, None) == loss_func:   # same function under that name
            return LossBinding(paths[id(owner)], name)
    return None


def resolve(binding: LossBinding, model: chainer.Link) -> Callable:
    """The callable ``binding`` describes, on ``model`` (a replica)."""
    link = dict(model.namedlinks())[binding.path]
    return link if binding.method is None else getattr(link, binding.method)


def swap_model(func: Any, model: chainer.Link, replica: chainer.Link) -> Any:
    """``func`` with every reference to ``model`` or one of its links replaced by
    ``replica``'s link at the same path; ``func`` itself when it holds none."""
    replicas = dict(replica.namedlinks())
    mapping = {id(link): replicas[path] for path, link in model.namedlinks()}
    return _swap(func, mapping, _DEPTH)


def _swap(obj: Any, mapping: Dict[int, Any], depth: int) -> Any:
    if id(obj) in mapping:
        return mapping[id(obj)]
    if depth == 0:
        return obj
    if isinstance(obj, types.MethodType):
        owner = _swap(obj.__self__, mapping, depth - 1)
        return obj if owner is obj.__self__ else types.MethodType(obj.__func__, owner)
    if isinstance(obj, functools.partial):
        inner = _swap(obj.func, mapping, depth - 1)
        args = tuple(_swap(a, mapping, depth - 1) for a in obj.args)
        keywords = {k: _swap(v, mapping, depth - 1) for k, v in obj.keywords.items()}
        if (inner is obj.func and all(a is b for a, b in zip(args, obj.args))
                and all(keywords[k] is obj.keywords[k] for k in keywords)):
            return obj
        return functools.partial(inner, *args, **keywords)
    if isinstance(obj, types.FunctionType) and obj.__closure__:
        contents = [_cell_contents(cell) for cell in obj.__closure__]
        swapped = [c if c is _EMPTY else _swap(c, mapping, depth - 1) for c in contents]
        if all(a is b for a, b in zip(swapped, contents)):
            return obj
        cells = tuple(types.CellType() if c is _EMPTY else types.CellType(c) for c in swapped)
        new = types.FunctionType(obj.__code__, obj.__globals__, obj.__name__,
                                 obj.__defaults__, cells)
        new.__kwdefaults__ = obj.__kwdefaults__
        new.__qualname__ = obj.__qualname__
        new.__module__ = obj.__module__
        new.__doc__ = obj.__doc__
        new.__dict__.update(obj.__dict__)
        return new
    return obj


_EMPTY = object()


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:   # a cell not filled yet
        return _EMPTY

"""What every replica does in one update: its window of micro-batches.

The master and each worker run the same :class:`Replica`. The loss scaling for
accumulation lives here, in :meth:`Replica.run_window`, and nowhere else.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy

import chainer

from .prefetch import Batch, EpochInfo, Loader, Stopwatch


class WindowResult(NamedTuple):
    """What a replica tells the master about its window (small and picklable)."""
    count: int                           # samples in the window
    loss_sum: float                      # sum over micro-batches of loss * samples
    sums: Dict[str, Any]                 # reported key -> sum of value * samples
    weights: Dict[str, float]            # reported key -> samples that reported it
    times: Dict[str, float]              # seconds: 'data', 'compute'
    epochs: List[EpochInfo]              # epoch bookkeeping after each micro-batch


def observers(reporter: chainer.Reporter, model: chainer.Link) -> None:
    """Name the model as the Trainer does for the 'main' optimizer."""
    reporter.add_observer('main', model)
    reporter.add_observers('main', model.namedlinks(skipself=True))


def _host(value: Any) -> Any:
    if isinstance(value, chainer.Variable):
        value = value.array
    if isinstance(value, chainer.get_array_types()):
        value = chainer.backend.CpuDevice().send(value)
        return float(value) if value.size == 1 else numpy.asarray(value, dtype=numpy.float64)
    return float(value)


class Replica:
    """One model replica with its loader, running ``accumulate_steps`` micro-batches."""

    def __init__(self, model: chainer.Link, loss_func: Optional[Callable],
                 loader: Loader, accumulate_steps: int, weight_norm: float) -> None:
        self.model = model
        self.loss_func = loss_func if loss_func is not None else model
        self.loader = loader
        self.accumulate_steps = accumulate_steps
        self.weight_norm = weight_norm
        self.reporter = chainer.Reporter()
        observers(self.reporter, model)

    def run_window(self, loss_scale: Optional[float]) -> WindowResult:
        """Run up to ``accumulate_steps`` micro-batches, accumulating gradients.

        Loss scaling for accumulation, the only place it happens: the micro-batch of
        ``b`` samples back-propagates ``loss * b / W`` (times the optimizer's own loss
        scale), where ``W`` is the nominal number of samples of one update over all
        replicas. Summed over every micro-batch of every replica this is the gradient of
        the sample-weighted mean loss whenever the update holds ``W`` samples; the master
        multiplies by ``W / B`` when it really held ``B`` (the short end of an epoch).
        """
        watch = Stopwatch()
        self.model.cleargrads()
        count = 0
        loss_sum: Any = 0.0
        sums: Dict[str, Any] = {}
        weights: Dict[str, float] = {}
        epochs: List[EpochInfo] = []
        for _ in range(self.accumulate_steps):
            with watch('data'):
                batch: Optional[Batch] = self.loader.get()
            if batch is None:        # iterator exhausted: the window holds what it got
                break
            with watch('compute'):
                observation: Dict[str, Any] = {}
                with self.reporter.scope(observation):
                    arrays = batch.arrays
                    if isinstance(arrays, tuple):
                        loss = self.loss_func(*arrays)
                    elif isinstance(arrays, dict):
                        loss = self.loss_func(**arrays)
                    else:
                        loss = self.loss_func(arrays)
                    scale = batch.size / self.weight_norm
                    if loss_scale is not None:
                        scale *= loss_scale
                    loss.backward(loss_scale=scale)
                loss_sum = loss_sum + loss.array * batch.size  # stays on the device
                del loss
                for key, value in observation.items():
                    if isinstance(value, chainer.Variable):
                        value = value.array
                    sums[key] = sums.get(key, 0.0) + value * batch.size
                    weights[key] = weights.get(key, 0.0) + batch.size
            count += batch.size
            epochs.append(batch.epoch)
        return WindowResult(
            count=count,
            loss_sum=_host(loss_sum) if count else 0.0,
            sums={k: _host(v) for k, v in sums.items()},
            weights=weights, times=dict(watch.times), epochs=epochs)


def combine(results: List[WindowResult]) -> Dict[str, Any]:
    """The sample-weighted mean of every reported value over all replicas' windows."""
    sums: Dict[str, Any] = {}
    weights: Dict[str, float] = {}
    for r in results:
        for key, value in r.sums.items():
            sums[key] = sums.get(key, 0.0) + value
            weights[key] = weights.get(key, 0.0) + r.weights[key]
    return {key: sums[key] / weights[key] for key in sums if weights[key] > 0}


def total_loss(results: List[WindowResult]) -> float:
    count = sum(r.count for r in results)
    if count == 0:
        return math.nan
    return sum(r.loss_sum for r in results) / count

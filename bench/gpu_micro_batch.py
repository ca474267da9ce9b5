"""GPU check of ``micro_batch_size='auto'`` (issue 12): with CuPy's memory pool capped so
that the whole batch does not fit, 'auto' finds a size that does and trains as without the cap.

    python bench/gpu_micro_batch.py [--dry-run] [--out FILE.json] [--model cnn|mlp|tiny]
                                    [--batch B] [--updates U] [--fraction F] [--require-gpu]

One replica on ``'@cupy:0'``, the same model from the same seed and the same samples in the
same order (the first ``U*B`` of a synthetic MNIST-shaped set) in every run:

1. Reference, no cap, ``micro_batch_size=None``: the losses of ``U`` updates, the final
   parameters, and the pool's footprint of update 2 (bytes it held before the update, and
   at its peak, with the cached blocks freed first).
2. Cap: ``pool.set_limit(size=before + F * (peak - before))``, so the whole batch's
   activations no longer fit (F=0.6: half of them do).
3. Under the cap, ``micro_batch_size=None`` must run out of memory: the cap bites.
4. Under the cap, ``micro_batch_size='auto'``, the same ``U`` updates: the size it settled
   at (``main/micro_batch_size``, ``updater.micro_batch_sizes``) must be smaller than the
   batch, and its losses and final parameters must match step 1's (``--rtol``, ``--atol``).

Prints what it found and writes it to ``--out`` (JSON). Exit status: 0 when every step
passed, 1 when one failed; without a usable CUDA device it prints ``SKIP: <reason>`` and
exits 0 (2 with ``--require-gpu``).

``--dry-run`` runs the same steps on ``'@numpy'``, with device memory simulated: the model
raises ``MemoryError`` when one forward holds more samples than the cap, and a footprint is
the largest forward in samples. It checks this script's logic where there is no GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _case, _common  # noqa: E402  (imports Chainer through the shim)

import chainer  # noqa: E402
import chainer.links as L  # noqa: E402
import numpy  # noqa: E402

from mgpu_updater import ParallelAccumulatingUpdater  # noqa: E402

MEASURED_UPDATE = 1  # the footprint is that of update 2: the optimizer's state exists then


class CudaPool:
    """Device 0 and CuPy's default memory pool: footprints in bytes, a cap by set_limit."""
    device = '@cupy:0'
    unit = 'bytes'

    def __init__(self) -> None:
        import cupy
        self.cupy = cupy
        self.pool = cupy.get_default_memory_pool()

    def model(self, name: str) -> chainer.Link:
        return _common.make_model(name, seed=0)

    def footprint(self, fn: Callable[[], Any]) -> Tuple[int, int]:
        with self.cupy.cuda.Device(0):
            return _case.pool_footprint(fn)

    @contextlib.contextmanager
    def capped(self, limit: int):
        with self.cupy.cuda.Device(0):   # set_limit applies to the current device
            gc.collect()                 # the previous run's arrays go back to the pool
            self.pool.free_all_blocks()
            self.pool.set_limit(size=int(limit))
            try:
                yield
            finally:
                self.pool.set_limit(size=0)   # 0: no limit
                self.pool.free_all_blocks()


class SimulatedMemory:
    """``'@numpy'`` with a simulated device memory of ``cap`` samples per forward (None: no
    cap); a footprint is (0, the largest forward in samples). Records every forward's size."""
    device = '@numpy'
    unit = 'samples'

    def __init__(self) -> None:
        self.cap: Optional[int] = None
        self.tried: List[int] = []

    def model(self, name: str) -> chainer.Link:
        return SampleCappedClassifier(_common.make_model(name, seed=0).predictor, self)

    def admit(self, samples: int) -> None:
        self.tried.append(samples)
        if self.cap is not None and samples > self.cap:
            raise MemoryError(f'simulated device memory: {samples} samples in one forward '
                              f'do not fit (cap {self.cap})')

    def footprint(self, fn: Callable[[], Any]) -> Tuple[int, int]:
        start = len(self.tried)
        fn()
        return 0, max(self.tried[start:], default=0)

    @contextlib.contextmanager
    def capped(self, limit: int):
        self.cap = int(limit)
        try:
            yield
        finally:
            self.cap = None


class SampleCappedClassifier(L.Classifier):
    """``L.Classifier`` whose forward first asks ``memory`` to admit its batch."""

    def __init__(self, predictor: chainer.Link, memory: SimulatedMemory) -> None:
        super().__init__(predictor)
        self.memory = memory

    def forward(self, x: Any, t: Any) -> chainer.Variable:
        self.memory.admit(len(x))
        return super().forward(x, t)


class Run(NamedTuple):
    losses: List[float]
    reported_sizes: List[Optional[int]]       # main/micro_batch_size of every update
    micro_batch_sizes: List[int]              # updater.micro_batch_sizes at the end
    params: Dict[str, numpy.ndarray]
    footprint: Tuple[int, int]                # of update MEASURED_UPDATE + 1


def train(memory: Any, dataset: Any, model_name: str, batch: int, updates: int,
          micro_batch_size: Any) -> Run:
    """``updates`` updates of one replica from seed 0 over ``dataset`` in order."""
    model = memory.model(model_name)
    model.to_device(memory.device)
    optimizer = _common.make_optimizer(model)
    iterator = chainer.iterators.SerialIterator(dataset, batch, shuffle=False)
    updater = ParallelAccumulatingUpdater([iterator], optimizer, devices=[memory.device],
                                          micro_batch_size=micro_batch_size,
                                          report_times=False)
    step = _case._observed_step(updater, model)
    observations: List[Dict[str, Any]] = []
    footprint = (0, 0)
    try:
        for u in range(updates):
            if u == MEASURED_UPDATE:
                footprint = memory.footprint(lambda: observations.append(step()))
            else:
                observations.append(step())
        params = {name: numpy.array(chainer.backend.CpuDevice().send(p.array))
                  for name, p in model.namedparams()}
    finally:
        updater.finalize()
    return Run(losses=[_case._float(o['main/loss']) for o in observations],
               reported_sizes=[o.get('main/micro_batch_size') for o in observations],
               micro_batch_sizes=list(updater.micro_batch_sizes), params=params,
               footprint=footprint)


def compare(reference: Run, run: Run, rtol: float, atol: float) -> List[str]:
    """What differs between two runs beyond the tolerances (empty: they match)."""
    problems = []
    ref_losses, losses = numpy.array(reference.losses), numpy.array(run.losses)
    if ref_losses.shape != losses.shape or not numpy.allclose(losses, ref_losses, rtol=rtol,
                                                              atol=atol):
        problems.append(f'losses differ: {run.losses} under the cap, {reference.losses} '
                        f'without (rtol={rtol}, atol={atol})')
    for name, value in reference.params.items():
        if not numpy.allclose(run.params[name], value, rtol=rtol, atol=atol):
            diff = float(numpy.max(numpy.abs(run.params[name] - value)))
            problems.append(f'parameter {name} differs by up to {diff:.3g} '
                            f'(rtol={rtol}, atol={atol})')
    return problems


def max_param_diff(reference: Run, run: Run) -> float:
    return max(float(numpy.max(numpy.abs(run.params[k] - v)))
               for k, v in reference.params.items())


def check(memory: Any, args: argparse.Namespace, report: Dict[str, Any]) -> List[str]:
    """Steps 1-4 of the module docstring; fills ``report``; returns the failures."""
    dataset = _common.make_dataset(args.batch * (args.updates + 2), seed=1)
    train_args = (dataset, args.model, args.batch, args.updates)

    reference = train(memory, *train_args, micro_batch_size=None)
    before, peak = reference.footprint
    limit = int(before + args.fraction * (peak - before))
    report['reference'] = {'losses': reference.losses, 'footprint_before': before,
                           'footprint_peak': peak, 'unit': memory.unit}
    report['limit'] = limit
    print(f'reference: losses {reference.losses}; one update needs {peak} {memory.unit} '
          f'at its peak, {before} before it; cap {limit} {memory.unit}')
    if peak <= before:
        return [f'the reference update took no {memory.unit} from the pool; nothing to cap']

    with memory.capped(limit):
        try:
            train(memory, dataset, args.model, args.batch, 1, micro_batch_size=None)
        except MemoryError as exc:   # CuPy's OutOfMemoryError is one
            report['whole_batch_under_cap'] = f'{type(exc).__name__}: {exc}'
            print(f'whole batch under the cap: {type(exc).__name__} (as it must)')
        else:
            report['whole_batch_under_cap'] = 'ran'
            return [f'the whole batch of {args.batch} ran under the cap of {limit} '
                    f'{memory.unit}: the cap does not bite, so the check shows nothing']
        auto = train(memory, *train_args, micro_batch_size='auto')

    found = auto.micro_batch_sizes[0] if auto.micro_batch_sizes else None
    report['auto'] = {
        'losses': auto.losses, 'micro_batch_size': found,
        'reported_micro_batch_size': auto.reported_sizes,
        'footprint_peak': auto.footprint[1], 'max_param_diff': max_param_diff(reference, auto),
    }
    print(f"micro_batch_size='auto' under the cap: settled at {found} of {args.batch} "
          f'samples (reported {auto.reported_sizes}); peak {auto.footprint[1]} '
          f'{memory.unit}; losses {auto.losses}; parameters within '
          f'{report["auto"]["max_param_diff"]:.3g} of the reference')
    problems = compare(reference, auto, args.rtol, args.atol)
    if not found or found >= args.batch:
        problems.append(f'auto settled at {found}, not at a size below the batch of '
                        f'{args.batch}')
    if any(size != found for size in auto.reported_sizes):
        problems.append(f'main/micro_batch_size was {auto.reported_sizes}, not {found} '
                        'from the first update on')
    if auto.footprint[1] > limit:
        problems.append(f'the capped update held {auto.footprint[1]} {memory.unit}, above '
                        f'the cap of {limit}')
    return problems


def cuda_unavailable_reason() -> Optional[str]:
    try:
        import cupy
    except ImportError as exc:
        return f'CuPy is not installed ({exc})'
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # no driver, no device: CuPy raises its own CUDA errors
        return f'CUDA is not usable: {type(exc).__name__}: {exc}'
    return None if count else 'no CUDA device is visible'


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--dry-run', action='store_true',
                   help="the same steps on '@numpy' with simulated device memory")
    p.add_argument('--out', help='write the findings to this JSON file')
    p.add_argument('--model', default='cnn', choices=_common.MODELS)
    p.add_argument('--batch', type=int, help='samples per update (default 1024; dry run 64)')
    p.add_argument('--updates', type=int, default=3, help='updates per run (>= 2)')
    p.add_argument('--fraction', type=float, default=0.6,
                   help="share of the reference update's growth the cap leaves (0 < F < 1)")
    p.add_argument('--rtol', type=float, default=1e-4)
    p.add_argument('--atol', type=float, default=1e-5)
    p.add_argument('--require-gpu', action='store_true',
                   help='exit 2 instead of 0 when CUDA is unavailable')
    args = p.parse_args(argv)
    args.batch = args.batch or (64 if args.dry_run else 1024)
    if args.batch < 2:
        p.error(f'--batch must be >= 2 ({args.batch} given): one sample cannot be split')
    if args.updates < MEASURED_UPDATE + 1:
        p.error(f'--updates must be >= {MEASURED_UPDATE + 1} ({args.updates} given)')
    if not 0 < args.fraction < 1:
        p.error(f'--fraction must be between 0 and 1, exclusive ({args.fraction} given)')
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    report: Dict[str, Any] = {'dry_run': args.dry_run, 'model': args.model,
                              'batch': args.batch, 'updates': args.updates,
                              'fraction': args.fraction}
    if args.dry_run:
        memory: Any = SimulatedMemory()
    else:
        reason = cuda_unavailable_reason()
        if reason:
            print(f'SKIP: {reason}')
            report.update(ok=None, skipped=reason)
            _write(args.out, report)
            return 2 if args.require_gpu else 0
        memory = CudaPool()
    report['device'] = memory.device
    try:
        with chainer.using_config('cudnn_deterministic', True):   # same sums in every run
            problems = check(memory, args, report)
    except Exception as exc:   # reported in the JSON as well, then the status says failed
        import traceback
        problems = [f'{type(exc).__name__}: {exc}\n{traceback.format_exc()}']
    report.update(ok=not problems, errors=problems)
    _write(args.out, report)
    for problem in problems:
        print(f'FAIL: {problem}')
    if not problems:
        print('OK')
    return 1 if problems else 0


def _write(path: Optional[str], report: Dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, default=str) + '\n')


if __name__ == '__main__':
    sys.exit(main())

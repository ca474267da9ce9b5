"""Does loading overlap compute? Step time with prefetch vs without, against max(L, C).

A dataset whose batches cost L seconds to load (I/O-like latency: sleeps) and a model
whose step costs C seconds (a real matrix product plus a sleep standing in for device
time), one replica. Prints a table and writes overlap.json to --out.

    python bench/overlap.py --load 0.05 --compute 0.05 --updates 30 --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))

import numpy as np  # noqa: E402

import mgpu_updater  # noqa: E402,F401  (applies the compat shim before chainer)
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

from mgpu_updater import ParallelAccumulatingUpdater  # noqa: E402


class SlowDataset(chainer.dataset.DatasetMixin):
    """Each example sleeps ``latency`` seconds: a batch of b costs b * latency."""

    def __init__(self, n, latency):
        self.n, self.latency = n, latency
        rng = np.random.RandomState(0)
        self.x = rng.randn(n, 64).astype(np.float32)
        self.t = rng.randint(0, 10, n).astype(np.int32)

    def __len__(self):
        return self.n

    def get_example(self, i):
        time.sleep(self.latency)
        return self.x[i], self.t[i]


class SlowModel(chainer.Chain):
    """A small MLP whose forward also waits ``delay`` seconds (device time)."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        with self.init_scope():
            self.l1 = L.Linear(64, 256)
            self.l2 = L.Linear(256, 10)

    def forward(self, x):
        time.sleep(self.delay)
        return self.l2(F.relu(self.l1(x)))


def step_time(load, compute, batch, updates, prefetch):
    dataset = SlowDataset(batch * (updates + 5), load / batch)
    model = L.Classifier(SlowModel(compute))
    opt = chainer.optimizers.SGD(0.01)
    opt.setup(model)
    it = chainer.iterators.SerialIterator(dataset, batch, shuffle=False)
    updater = ParallelAccumulatingUpdater(it, opt, devices=['@numpy'], prefetch=prefetch,
                                          report_times=False)
    times = []
    try:
        for u in range(updates):
            t0 = time.perf_counter()
            updater.update()
            if u >= 2:                   # warm-up: the first batches were not prefetched
                times.append(time.perf_counter() - t0)
    finally:
        updater.finalize()
    return statistics.median(times)


def measure_alone(load, compute, batch, repeats=5):
    """L and C as this machine really runs them."""
    ds = SlowDataset(batch, load / batch)
    t0 = time.perf_counter()
    for _ in range(repeats):
        chainer.dataset.concat_examples([ds[i] for i in range(batch)])
    real_l = (time.perf_counter() - t0) / repeats
    model = L.Classifier(SlowModel(compute))
    opt = chainer.optimizers.SGD(0.01)
    opt.setup(model)
    x, t = chainer.dataset.concat_examples([(ds.x[i], ds.t[i]) for i in range(batch)])
    t0 = time.perf_counter()
    for _ in range(repeats):
        opt.update(model, x, t)
    real_c = (time.perf_counter() - t0) / repeats
    return real_l, real_c


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--load', type=float, default=0.05, help='L: seconds to load one batch')
    p.add_argument('--compute', type=float, default=0.05, help='C: seconds of one step')
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--updates', type=int, default=30)
    p.add_argument('--out', default=None)
    args = p.parse_args(argv)

    real_l, real_c = measure_alone(args.load, args.compute, args.batch)
    without = step_time(args.load, args.compute, args.batch, args.updates, prefetch=0)
    with_ = step_time(args.load, args.compute, args.batch, args.updates, prefetch=2)
    bound, serial = max(real_l, real_c), real_l + real_c
    result = {
        'date': time.strftime('%Y-%m-%d'), 'machine': platform.processor() or platform.machine(),
        'cores': os.cpu_count(), 'python': platform.python_version(),
        'L_s': real_l, 'C_s': real_c, 'max_LC_s': bound, 'L_plus_C_s': serial,
        'step_without_prefetch_s': without, 'step_with_prefetch_s': with_,
        'ratio_with_to_max': with_ / bound, 'ratio_without_to_sum': without / serial,
        'speedup': without / with_,
    }
    print('| run | step (ms) | / max(L,C) | / (L+C) |')
    print('|---|---|---|---|')
    print(f'| L alone | {real_l * 1e3:.1f} | | |')
    print(f'| C alone | {real_c * 1e3:.1f} | | |')
    for name, t in (('no prefetch', without), ('prefetch=2', with_)):
        print(f'| {name} | {t * 1e3:.1f} | {t / bound:.3f} | {t / serial:.3f} |')
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'overlap.json'), 'w') as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == '__main__':
    main()

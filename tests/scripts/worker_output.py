"""Trains two CPU replicas whose forward prints and logs, its stdout a file or a pipe.

    python worker_output.py LOG_PATH [--slow-read SECONDS]

The main block configures logging (a file at LOG_PATH, INFO), as scripts do, which a
spawned worker does not run. Each forward prints ``forward <pid>`` and ``café <pid>``
(not ASCII), and logs ``record <pid>``; the worker also prints whether its stdout writes through (``python -u``). With
``--slow-read``, each example a worker reads after its first 12 takes that long to load,
so that the workers' loaders are inside a read when the updater stops them (they are
killed).
Prints ``MASTER <pid> WORKERS <pids>`` at the end.
"""
import argparse
import logging
import multiprocessing
import os
import sys
import time

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np

from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators

log = logging.getLogger('worker_output_script')


class Printing(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)

    def forward(self, x, t):
        print(f'forward {os.getpid()} write_through={sys.stdout.write_through}')
        print(f'caf\u00e9 {os.getpid()}')
        log.info('record %d', os.getpid())
        return F.softmax_cross_entropy(self.l(x), t)


class SlowAfter(chainer.dataset.DatasetMixin):
    def __init__(self, n, slow):
        rng = np.random.RandomState(0)
        self.x = rng.randn(n, 3).astype(np.float32)
        self.t = rng.randint(0, 2, n).astype(np.int32)
        self.slow = slow
        self.reads = {}   # per process (the worker's copy comes with the master's count)

    def __len__(self):
        return len(self.x)

    def get_example(self, i):
        pid = os.getpid()
        self.reads[pid] = self.reads.get(pid, 0) + 1
        if self.slow and self.reads[pid] > 12 and \
                multiprocessing.current_process().name.startswith('mgpu-worker'):
            time.sleep(self.slow)
        return self.x[i], self.t[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('log')
    parser.add_argument('--slow-read', type=float, default=0.0)
    args = parser.parse_args()
    logging.basicConfig(filename=args.log, level=logging.INFO,
                        format='%(processName)s %(process)d %(message)s')
    model = Printing()
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    its = shard_iterators(SlowAfter(64, args.slow_read), 2, 4)
    updater = ParallelAccumulatingUpdater(its, optimizer, devices=['@numpy'] * 2,
                                          prefetch=2)
    try:
        for _ in range(3):
            updater.update()
        workers = updater.worker_pids()
    finally:
        updater.finalize()
    print('MASTER', os.getpid(), 'WORKERS', *workers, flush=True)


if __name__ == '__main__':
    main()

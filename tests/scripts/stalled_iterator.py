"""A master whose worker's MultiprocessIterator processes stall in a read.

    python stalled_iterator.py FLAG_PATH finalize|master_sigkill

Prints ``READY {"workers": [...], "grandchildren": [...]}`` once the worker's iterator
processes stall (each read sleeps a minute once FLAG_PATH exists). ``finalize``: then
calls ``finalize()`` and prints ``RESULT {"finalize_s": ...}``; ``master_sigkill``:
waits to be killed.
"""
import json
import os
import sys
import time

import numpy

import mgpu_updater
import chainer
from chainer.iterators import MultiprocessIterator

from _models import classifier, dataset, setup_optimizer
from _processes import children


class StallingDataset:
    def __init__(self, base, flag):
        self.base, self.flag = base, flag

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if os.path.exists(self.flag):
            time.sleep(60)
        return self.base[i]



def main():
    flag, how = sys.argv[1], sys.argv[2]
    model = classifier(seed=2)
    its = [MultiprocessIterator(dataset(32, seed=0), 4, n_processes=2, shuffle=False),
           MultiprocessIterator(StallingDataset(dataset(32, seed=1), flag), 4,
                                n_processes=2, shuffle=False)]
    updater = mgpu_updater.ParallelAccumulatingUpdater(
        its, setup_optimizer('sgd', model), devices=['@numpy'] * 2)
    updater.update()
    workers = updater.worker_pids()
    deadline = time.monotonic() + 20
    while len(children(workers[0])) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    open(flag, 'w').close()
    time.sleep(0.5)
    grandchildren = children(workers[0])
    print('READY', json.dumps({'workers': workers, 'grandchildren': grandchildren}),
          flush=True)
    if how == 'finalize':
        t0 = time.monotonic()
        updater.finalize()
        print('RESULT', json.dumps({'finalize_s': round(time.monotonic() - t0, 3)}),
              flush=True)
    else:
        time.sleep(120)


if __name__ == '__main__':
    main()

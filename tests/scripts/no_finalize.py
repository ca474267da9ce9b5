"""A script that trains and exits without ``finalize()`` (no Trainer, no ``with``).

    python no_finalize.py

Prints ``WORKERS [...]`` and ``GRANDCHILDREN [...]`` (the worker's MultiprocessIterator
processes), then exits with the updater still referenced. The workers are not daemonic; the interpreter must
still exit at once, stopping them, instead of waiting for them forever.
"""
import json

import mgpu_updater
from chainer.iterators import MultiprocessIterator

from _models import classifier, dataset, setup_optimizer
from _processes import children



def main():
    its = [MultiprocessIterator(dataset(32, seed=r), 4, n_processes=2, shuffle=False)
           for r in range(2)]
    updater = mgpu_updater.ParallelAccumulatingUpdater(
        its, setup_optimizer('sgd', classifier()), devices=['@numpy'] * 2)
    updater.update()
    updater.update()
    workers = updater.worker_pids()
    print('WORKERS', json.dumps(workers), flush=True)
    print('GRANDCHILDREN', json.dumps(children(workers[0])), flush=True)
    return updater


if __name__ == '__main__':
    updater = main()   # still referenced when the interpreter exits

"""An updater dropped without ``finalize()``.

    python dropped_updater.py del|exit

Trains two updates on two CPU replicas, prints ``WORKERS [...]`` and ``SEGMENTS [...]``
(the shared-memory segments the master created), then either drops the updater (``del``
and ``gc.collect()``) and prints ``DROPPED`` once both are gone (``del``), or exits with
the updater still referenced (``exit``).
"""
import gc
import json
import os
import sys
import time

import mgpu_updater

from _models import classifier, dataset, setup_optimizer
from _processes import alive


def main(mode):
    import chainer
    its = [chainer.iterators.SerialIterator(dataset(32, seed=r), 4) for r in range(2)]
    updater = mgpu_updater.ParallelAccumulatingUpdater(
        its, setup_optimizer('sgd', classifier()), devices=['@numpy'] * 2)
    updater.update()
    updater.update()
    workers = updater.worker_pids()
    group = updater._group
    segments = list(group.comm.owned_segments) + (
        [group.board.name] if group.board is not None else [])
    del group
    print('WORKERS', json.dumps(workers), flush=True)
    print('SEGMENTS', json.dumps(segments), flush=True)
    if mode == 'exit':
        return updater
    del updater, its
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for p in workers if alive(p)] + [
            s for s in segments if os.path.exists('/dev/shm/' + s)]
        if not left:
            break
        time.sleep(0.05)
    print('DROPPED', json.dumps({'left': left}), flush=True)
    return None


if __name__ == '__main__':
    kept = main(sys.argv[1])

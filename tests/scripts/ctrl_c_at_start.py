"""A Ctrl-C while the workers start: SIGINT to the script's whole process group, as a
terminal sends it, shortly after the first worker process appears.

    python ctrl_c_at_start.py   (in a session of its own: the signal goes to its group)

The worker is then still in Python's start-up (importing the main module and Chainer
again), in the terminal's group, before it leads a group of its own. Prints
``WORKERS [...]`` (the processes seen) and ``CAUGHT <name>`` (what ``run`` raised).
"""
import json
import os
import signal
import threading
import time

import mgpu_updater
from chainer import training

from _models import classifier, dataset, setup_optimizer
from _processes import children

AFTER_EXEC = 0.15   # seconds from the worker's process seen to the Ctrl-C


def workers(pid):
    """The spawned workers among pid's children (not multiprocessing's resource tracker)."""
    out = []
    for child in children(pid):
        try:
            with open(f'/proc/{child}/cmdline', 'rb') as f:
                if b'spawn_main' in f.read():
                    out.append(child)
        except OSError:   # gone meanwhile
            continue
    return out


def interrupt_at_first_worker(seen):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = workers(os.getpid())
        if kids:
            seen.extend(kids)
            # past the new Python's own start-up (before it, SIGINT's default action ends
            # the process without a word), into its imports
            time.sleep(AFTER_EXEC)
            os.killpg(os.getpgrp(), signal.SIGINT)
            return
        time.sleep(0.002)


def main():
    # as in a terminal, whatever SIGINT disposition the launcher left us
    signal.signal(signal.SIGINT, signal.default_int_handler)
    its = mgpu_updater.shard_iterators(dataset(64, seed=0), 2, 8)
    updater = mgpu_updater.ParallelAccumulatingUpdater(
        its, setup_optimizer('sgd', classifier()), devices=['@numpy'] * 2)
    trainer = training.Trainer(updater, (3, 'iteration'), out=os.devnull)
    seen = []
    threading.Thread(target=interrupt_at_first_worker, args=(seen,), daemon=True).start()
    caught = None
    try:
        trainer.run()
    except BaseException as exc:  # noqa: BLE001 - the KeyboardInterrupt is the point
        caught = type(exc).__name__
    print('WORKERS', json.dumps(seen), flush=True)
    print('CAUGHT', caught, flush=True)


if __name__ == '__main__':
    main()

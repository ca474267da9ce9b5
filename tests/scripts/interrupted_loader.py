"""Interrupt the consumer of a Prefetcher many times, as Ctrl-C does; report JSON.

    python interrupted_loader.py TRIALS

Each trial starts a loader over a fast in-memory dataset, lets a SIGALRM handler raise
``KeyboardInterrupt`` in the main thread after a random 0-3 ms (the same signal check
where a SIGINT's default handler raises it) while the main thread calls ``get()`` in a
loop, then closes the loader. Prints ``{"trials", "other_errors", "slow_closes",
"longest_close"}``: an interrupt that surfaced as another exception, and a close that
took longer than 1 s (a lock left held), are what ``test_prefetch`` checks for.
"""
import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/

import chainer  # noqa: E402

from _models import dataset  # noqa: E402
from mgpu_updater._loader import Prefetcher  # noqa: E402




def interrupt(signum, frame):
    raise KeyboardInterrupt


def main():
    trials = int(sys.argv[1])
    rng = random.Random(0)
    signal.signal(signal.SIGALRM, interrupt)
    data = dataset(64, seed=1)
    other, slow, longest = [], 0, 0.0
    for _ in range(trials):
        loader = Prefetcher(chainer.iterators.SerialIterator(data, 2),
                            chainer.dataset.concat_examples, None, 2)
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0, 0.003))
            while True:
                loader.get()
        except KeyboardInterrupt:
            pass
        except BaseException as exc:  # noqa: BLE001 - what the test counts
            other.append(f'{type(exc).__name__}: {exc}')
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        t0 = time.monotonic()
        loader.close()
        took = time.monotonic() - t0
        longest = max(longest, took)
        slow += took > 1.0
    print(json.dumps({'trials': trials, 'other_errors': other[:5],
                      'n_other_errors': len(other), 'slow_closes': slow,
                      'longest_close': longest}))


if __name__ == '__main__':
    main()

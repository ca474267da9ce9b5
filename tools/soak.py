"""Soak: thousands of updates of a small model on CPU replicas, watching for leaks.

    python tools/soak.py [--updates 5000] [--from 500] [--replicas 2] [--json PATH]

Every ``--every`` updates it samples, for the master and each worker: the resident set
size (``VmRSS``), the open file descriptors, the sockets among them, and the shared-memory
segments mapped (``/dev/shm/mgpu_*``). At the end it checks, between update ``--from`` and
the last:

- RSS grew by less than 5 % in every process;
- the number of open fds and of mapped segments did not change;
- no process holds a TCP/UDP socket or a listening Unix socket (the control pipes of
  ``multiprocessing`` are connected Unix socket pairs, nothing else);
- segment names carry 128 random bits (``mgpu_`` + 32 hex digits).

The measurement is the tests' (``tests/scripts/soak_measure.py``). Prints the samples and
a verdict; exits 1 when a check fails.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests' / 'scripts'))
from soak_measure import format_figures, soak  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--updates', type=int, default=5000)
    parser.add_argument('--from', dest='start', type=int, default=500)
    parser.add_argument('--every', type=int, default=500)
    parser.add_argument('--replicas', type=int, default=2)
    parser.add_argument('--json', help='also write the figures and samples here')
    args = parser.parse_args()
    out = soak(args.updates, args.start, args.every, args.replicas)
    print(format_figures(out['figures']))
    print('problems:', out['problems'] or 'none')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(out, f, indent=1)
    return 1 if out['problems'] else 0


if __name__ == '__main__':
    sys.exit(main())

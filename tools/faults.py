"""Repeat every fault scenario and print time to error (or to recover) and successes.

    python tools/faults.py [--repeat 20] [--scenario NAME ...] [--restarts] [--json PATH]

The runner is the tests' (``tests/scripts/faults/fault_runner.py``): each run is one
``tests/scripts/faults/harness.py`` process (the master and its workers below it) under a
hard timeout. A run succeeds when the harness found no problem: the right error within the
bound, every process gone, no shared memory left. Time to error is from the fault (the
worker's raise or SIGKILL) to the master's ``WorkerError``, or from the signal to the master
until its last worker is gone.

``--restarts``: the ``max_worker_restarts`` scenarios (``restart_*``) instead: a worker is
SIGKILLed once (in its window, in its reduce, after its post, between updates; with three
replicas and dropout; with MultiprocessIterators) and each run succeeds when the training
goes on with its parameters and reports bitwise those of the same run uninterrupted, one
restart reported, every process and shared-memory segment gone at the end; the time is
from the SIGKILL to the end of the redone update, bounded by 10 s plus the new worker's
start-up (its median in the last column). ``restart_raise`` and ``restart_spent`` check
that a Python error, and a death past the budget, still end the run.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests' / 'scripts' / 'faults'))
from fault_runner import (RESTART_ERRORS, RESTART_SCENARIOS, SCENARIOS,  # noqa: E402
                          format_table, repeat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--repeat', type=int, default=20)
    parser.add_argument('--scenario', action='append',
                        choices=sorted(SCENARIOS) + sorted(RESTART_SCENARIOS),
                        help='run only these (repeatable); default: all')
    parser.add_argument('--restarts', action='store_true',
                        help='the max_worker_restarts scenarios (default: the others)')
    parser.add_argument('--json', help='also write the rows to this file')
    args = parser.parse_args()
    rows = []
    default = (list(RESTART_SCENARIOS) + list(RESTART_ERRORS) if args.restarts else
               [name for name in SCENARIOS if name not in RESTART_ERRORS])
    for name in args.scenario or default:
        row = repeat(name, args.repeat)
        rows.append(row)
        print(f'{name}: {row["ok"]}/{row["runs"]} in {row["wall_s"]:.0f} s', file=sys.stderr,
              flush=True)
        for failure in row['failures']:
            print('  ' + failure, file=sys.stderr)
    print(format_table(rows))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r['ok'] == r['runs'] for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())

"""Repeat every fault scenario and print time to error and successes.

    python tools/faults.py [--repeat 20] [--scenario NAME ...] [--json PATH]

The runner is the tests' (``tests/scripts/faults/fault_runner.py``): each run is one
``tests/scripts/faults/harness.py`` process (the master and its workers below it) under a
hard timeout. A run succeeds when the harness found no problem: the right error within the
bound, every process gone, no shared memory left. Time to error is from the fault (the
worker's raise or SIGKILL) to the master's ``WorkerError``, or from the signal to the master
until its last worker is gone.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests' / 'scripts' / 'faults'))
from fault_runner import SCENARIOS, format_table, repeat  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--repeat', type=int, default=20)
    parser.add_argument('--scenario', action='append', choices=sorted(SCENARIOS),
                        help='run only these (repeatable); default: all')
    parser.add_argument('--json', help='also write the rows to this file')
    args = parser.parse_args()
    rows = []
    for name in args.scenario or list(SCENARIOS):
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

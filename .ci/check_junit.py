"""Check a pytest JUnit XML report: `--all-skipped` (every test skipped, each with a reason;
none passed, failed or errored) or `--not-skipped PATH` (the tests of that file ran and
passed: none skipped). Exit 1 with the offending tests listed.

    python .ci/check_junit.py report.xml --all-skipped
    python .ci/check_junit.py report.xml --not-skipped tests/test_fakecupy.py
"""
import argparse
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    """(test id, outcome, message) of every test case in the report."""
    for case in ET.parse(path).getroot().iter('testcase'):
        test = f"{case.get('classname')}::{case.get('name')}"
        for tag in ('error', 'failure', 'skipped'):
            node = case.find(tag)
            if node is not None:
                yield test, tag, (node.get('message') or '').strip()
                break
        else:
            yield test, 'passed', ''


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('report')
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument('--all-skipped', action='store_true')
    group.add_argument('--not-skipped', metavar='PATH')
    args = ap.parse_args()
    cases = list(outcomes(args.report))
    if args.all_skipped:
        bad = [c for c in cases if c[1] != 'skipped' or not c[2]]
        what = 'skipped with a reason'
    else:
        module = args.not_skipped.replace('/', '.').removesuffix('.py')
        cases = [c for c in cases if c[0].startswith(module + '::')]
        bad = [c for c in cases if c[1] != 'passed']
        what = f'run and passed ({module})'
    for test, outcome, message in bad:
        print(f'NOT {what}: {test}: {outcome} {message}', file=sys.stderr)
    if not cases:
        print(f'no test cases in {args.report} to check', file=sys.stderr)
        return 1
    reasons = sorted({c[2] for c in cases if c[1] == 'skipped'})
    print(f'{len(cases) - len(bad)} of {len(cases)} tests {what}'
          + ''.join(f'\n  reason: {r}' for r in reasons))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())

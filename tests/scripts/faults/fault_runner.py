"""The fault runner: one scenario in fresh processes, repeated, and the table of results.

Each run is one ``harness.py`` process (the master and its workers below it) under a hard
timeout that kills the whole process group. A run succeeds when the harness found no
problem: the right error within the bound, every process gone, no shared memory left. Time
to error is from the fault (the worker's raise or SIGKILL) to the master's ``WorkerError``,
or from the signal to the master until its last worker is gone.

The ``restart_*`` scenarios run under ``max_worker_restarts``: a worker SIGKILLed once
must not end the run, whose parameters and reports must be bitwise those of the same run
uninterrupted; their time is the recovery's, from the SIGKILL to the end of the redone
update, bounded by 10 s plus the new worker's own start-up (``start_s``).

tests/test_faults.py imports it (one run per scenario; 20 runs each under ``slow``), and so
does ``tools/faults.py``, which prints the table: the tools depend on the tests' scripts,
never the reverse.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent   # the repository root
HARNESS = HERE / 'harness.py'

SCENARIOS = {
    # name: (harness scenario, extra driver arguments, bound in seconds)
    'raise_forward': ('raise_forward', [], 5.0),
    'raise_backward': ('raise_backward', [], 5.0),
    'raise_iterator': ('raise_iterator', [], 5.0),
    'raise_converter': ('raise_converter', [], 5.0),
    'raise_start': ('raise_start', [], 5.0),
    'kill_worker': ('kill_worker', [], 10.0),
    'master_sigint': ('master_sigint', [], 5.0),
    'master_sigterm': ('master_sigterm', [], 5.0),
    'master_sigkill': ('master_sigkill', [], 5.0),
    'master_sigkill_forkserver': ('master_sigkill', ['--start-method', 'forkserver'], 5.0),
}
# max_worker_restarts: (harness scenario, driver arguments, bound in seconds beyond the new
# worker's start-up)
RESTART_SCENARIOS = {
    'restart_window': ('restart_window', [], 10.0),          # SIGKILL in its forward
    'restart_reduce': ('restart_reduce', [], 10.0),          # ... in its reduce
    'restart_post': ('restart_post', [], 10.0),              # ... after its post
    'restart_between': ('restart_between', [], 10.0),        # ... between two updates
    # three replicas, dropout: the survivor rewinds, both draw the lost random numbers again
    'restart_dropout_replica2': ('restart_window', ['--replicas', '3', '--replica', '2',
                                                    '--dropout', '0.5'], 10.0),
    # every replica reads through a MultiprocessIterator: the dead one's processes go too
    'restart_mpit': ('restart_window', ['--iterator', 'multiprocess'], 10.0),
}
# max_worker_restarts, and still the run ends: (as SCENARIOS)
RESTART_ERRORS = {
    'restart_raise': ('restart_raise', ['--restarts', '2'], 5.0),   # a Python error
    'restart_spent': ('restart_spent', ['--restarts', '1'], 10.0),  # the second death
}
SCENARIOS.update(RESTART_ERRORS)


def run_once(scenario, extra=(), timeout=90.0):
    """One harness run; returns its report (``problems`` empty on success). The run has a
    temporary directory of its own (``TMPDIR``), which must be empty at its end, but for
    the folder of Python's fork server where a master SIGKILLed under ``forkserver`` had
    one (Python removes it at the master's exit, which a SIGKILL skips)."""
    tmp = tempfile.mkdtemp(prefix='mgpu-fault-')
    try:
        report = _run_in(tmp, scenario, extra, timeout)
        left = sorted(name for name in os.listdir(tmp) if not (
            name.startswith('pymp-') and scenario == 'master_sigkill' and 'forkserver' in extra))
        if left:
            report.setdefault('problems', []).append(
                f'left in the temporary directory: {left}')
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in(tmp, scenario, extra, timeout):
    env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    proc = subprocess.Popen([sys.executable, str(HARNESS), scenario, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=str(ROOT), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {'scenario': scenario, 'problems': [f'hang: killed after {timeout:.0f} s']}
    for line in out.decode().splitlines():
        if line.startswith('HARNESS '):
            return json.loads(line[len('HARNESS '):])
    return {'scenario': scenario,
            'problems': [f'no report (exit {proc.returncode}): {err.decode()[-1000:]}']}


def repeat(name, n):
    """Run scenario ``name`` (a key of SCENARIOS or RESTART_SCENARIOS) ``n`` times; one
    row of the table."""
    scenario, extra, bound = SCENARIOS.get(name) or RESTART_SCENARIOS[name]
    times, starts, failures = [], [], []
    t0 = time.monotonic()
    for i in range(n):
        report = run_once(scenario, extra)
        t = report.get('time_to_error')
        if t is not None:
            times.append(t)
        if report.get('start_s') is not None:
            starts.append(report['start_s'])
        if report['problems']:
            failures.append(f'run {i + 1}: {report["problems"]}')
    return {'scenario': name, 'runs': n, 'ok': n - len(failures), 'bound_s': bound,
            'median_s': statistics.median(times) if times else None,
            'max_s': max(times) if times else None, 'times_s': times,
            'restart': name in RESTART_SCENARIOS, 'start_s': starts,
            'start_median_s': statistics.median(starts) if starts else None,
            'wall_s': time.monotonic() - t0, 'failures': failures}


def format_table(rows):
    """The rows as a table; a restart scenario's times are its recovery's, and its bound
    is beyond the new worker's start-up (whose median is the last column)."""
    head = (f'{"scenario":<28}{"ok":>8}{"median s":>11}{"max s":>9}{"bound s":>11}'
            f'{"start s":>9}')
    lines = [head, '-' * len(head)]
    for r in rows:
        med = f'{r["median_s"]:.3f}' if r['median_s'] is not None else '-'
        mx = f'{r["max_s"]:.3f}' if r['max_s'] is not None else '-'
        bound = f'{r["bound_s"]:.0f}' + ('+start' if r.get('restart') else '')
        start = f'{r["start_median_s"]:.3f}' if r.get('start_median_s') is not None else '-'
        lines.append(f'{r["scenario"]:<28}{r["ok"]:>5}/{r["runs"]:<2}{med:>11}{mx:>9}'
                     f'{bound:>11}{start:>9}')
    return '\n'.join(lines)

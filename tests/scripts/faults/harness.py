"""Run one fault scenario under a hard timeout, watch every process, report JSON.

    python harness.py SCENARIO [--timeout S] [driver options...]

SCENARIO is one of ``run_fault.WORKER_FAULTS``, ``run_fault.RESTARTS`` or
``master_sigint``, ``master_sigterm``, ``master_sigkill``. The harness makes itself a child subreaper (Linux ``prctl``), so the
workers of a master that dies become its children: it sees when each one exits and reaps
it, and at the end it knows that no descendant is left. It imports neither Chainer nor the
package, so it starts in milliseconds. Prints one line: ``HARNESS <json>``, whose
``problems`` list is empty when the scenario behaved.
"""
import argparse
import ctypes
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from run_fault import proc_state  # noqa: E402  (same folder; a light import)

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, 'run_fault.py')
PR_SET_CHILD_SUBREAPER = 36

MASTER_SIGNALS = {'master_sigint': signal.SIGINT, 'master_sigterm': signal.SIGTERM,
                  'master_sigkill': signal.SIGKILL}
# the bound each scenario must meet: seconds from the fault to the error in the master
# (worker faults) or to the last worker gone (master signals)
LIMITS = {'kill_worker': 10.0, 'restart_spent': 10.0}
DEFAULT_LIMIT = 5.0
# restart_*: seconds from the SIGKILL to the end of the redone update, beyond the new
# worker's own start-up (detect, rewind, start, redo)
RESTART_LIMIT = 10.0


def become_subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), 'prctl(PR_SET_CHILD_SUBREAPER) failed')


def running(pid):
    return proc_state(pid) not in ('gone', 'Z', 'X')


class Lines:
    """The driver's stdout, line by line, each wait bounded."""

    def __init__(self, stream):
        self.stream = stream
        self.buf = b''
        self.eof = False
        self.seen = {}
        self.sel = selectors.DefaultSelector()
        self.sel.register(stream, selectors.EVENT_READ)

    def find(self, tag, deadline):
        """The JSON payload of the first line ``TAG <json>``; None at EOF or the deadline."""
        while tag not in self.seen:
            while b'\n' in self.buf:
                line, self.buf = self.buf.split(b'\n', 1)
                word, _, payload = line.partition(b' ')
                if word in (b'READY', b'RESULT'):
                    self.seen.setdefault(word.decode(), json.loads(payload))
            if tag in self.seen or self.eof or time.monotonic() >= deadline:
                break
            if self.sel.select(timeout=max(0.0, deadline - time.monotonic())):
                chunk = os.read(self.stream.fileno(), 65536)
                self.eof = not chunk
                self.buf += chunk
        return self.seen.get(tag)


def reap_all(deadline):
    """Reap every child (the driver is already reaped); returns pids still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []                       # no child left at all
        if pid == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
    left = []
    while True:                             # past the deadline: kill and report
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return left
        if pid:
            continue
        for entry in os.listdir('/proc'):
            if entry.isdigit():
                try:
                    with open(f'/proc/{entry}/stat') as f:
                        ppid = int(f.read().rsplit(')', 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == os.getpid():
                    left.append(int(entry))
                    os.kill(int(entry), signal.SIGKILL)
        os.waitpid(-1, 0)


def dump_stacks(proc, err):
    """Every thread's stack of a driver that hangs (its faulthandler answers SIGUSR1 on
    stderr), as text; read before the kill, so a hang says where it is."""
    start = err.seek(0, os.SEEK_END)
    os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    err.seek(start)
    return err.read().decode(errors='replace')[-8000:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('scenario')
    parser.add_argument('--timeout', type=float, default=45.0,
                        help='hard limit for the driver, seconds')
    args, driver_args = parser.parse_known_args()
    become_subreaper()
    signum = MASTER_SIGNALS.get(args.scenario)
    cmd = [sys.executable, DRIVER, 'serve' if signum else args.scenario] + driver_args
    problems = []
    report = {'scenario': args.scenario}
    t_start = time.monotonic()
    deadline = t_start + args.timeout
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        lines = Lines(proc.stdout)
        ready = lines.find('READY', deadline)
        report['ready'] = ready
        if signum is not None and ready is None:
            problems.append('the driver never reported READY')
        if signum is not None and ready is not None:
            t_signal = time.time()
            os.kill(proc.pid, signum)
            gone_at = {}
            watch_until = time.monotonic() + 15.0
            while time.monotonic() < watch_until and len(gone_at) < len(ready['workers']):
                for pid in ready['workers']:
                    if pid not in gone_at and not running(pid):
                        gone_at[pid] = time.time()
                time.sleep(0.005)
            report['worker_gone_after'] = {str(p): t - t_signal for p, t in gone_at.items()}
            if len(gone_at) < len(ready['workers']):
                problems.append(f'workers still running 15 s after {signum.name}: '
                                f'{sorted(set(ready["workers"]) - set(gone_at))}')
            else:
                report['time_to_error'] = max(gone_at.values()) - t_signal
        result = lines.find('RESULT', deadline)
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append(f'the driver hung: killed after {args.timeout:.0f} s')
            report['hung_stacks'] = dump_stacks(proc, err)
            proc.kill()
            proc.wait()
        report['driver_exit'] = proc.returncode
        report['driver_seconds'] = time.monotonic() - t_start
        left = reap_all(time.monotonic() + 10.0)
        if left:
            problems.append(f'descendants still running 10 s after the driver exited: {left}')
        err.seek(0)   # the workers and the resource tracker write here too
        stderr = err.read().decode(errors='replace')
        report['stderr_tail'] = stderr[-3000:]
    if 'resource_tracker' in stderr:
        problems.append('the resource tracker complained (a segment leaked, or was unlinked '
                        'twice): ' + stderr[stderr.index('resource_tracker'):][:500])
    report['result'] = result
    segments = set((ready or {}).get('segments', [])) | set((result or {}).get(
        'segments_created', []))
    report['segments_left'] = sorted(n for n in segments if os.path.exists('/dev/shm/' + n))
    if report['segments_left']:
        problems.append(f'shared memory left: {report["segments_left"]}')
        for name in report['segments_left']:
            os.unlink('/dev/shm/' + name)
    folders = set((ready or {}).get('folders', [])) | set((result or {}).get('folders', []))
    report['folders_left'] = sorted(f for f in folders if os.path.exists(f))
    if report['folders_left']:
        problems.append(f'folders left: {report["folders_left"]}')
        for folder in report['folders_left']:
            shutil.rmtree(folder, ignore_errors=True)
    check(args.scenario, signum, report, result, problems)
    report['problems'] = problems
    print('HARNESS', json.dumps(report), flush=True)


def check(scenario, signum, report, result, problems):
    limit = LIMITS.get(scenario, DEFAULT_LIMIT)
    report['limit'] = limit
    if scenario in RESTART_SCENARIOS:
        limit = _restart_as_expected(report, result, problems)
    elif signum is None:
        if result is None:
            problems.append('the driver printed no RESULT')
            return
        report['time_to_error'] = result.get('time_to_error')
        if result['replica_expected'] == 0:   # the master's own fault: its own error
            if result.get('error_type') != 'FaultInjected':
                problems.append(f'expected FaultInjected, got {result.get("error_type")}: '
                                f'{result.get("message", "")[:500]}')
        elif not _worker_error_as_expected(scenario, result, problems):
            return
        for key in ('active_children_after_error', 'active_children', 'not_reaped',
                    'finalize_errors', 'segments_left'):
            if result.get(key):
                problems.append(f'{key}: {result[key]}')
        if len(result.get('finalize_times', [])) != 2:
            problems.append('finalize() did not return twice')
    else:
        if signum == signal.SIGINT:
            if result is None:
                problems.append('the driver printed no RESULT after SIGINT')
            else:
                if result.get('error_type') != 'KeyboardInterrupt':
                    problems.append(f'the driver caught {result.get("error_type")}')
                for key in ('active_children', 'not_reaped', 'finalize_errors',
                            'segments_left'):
                    if result.get(key):
                        problems.append(f'{key}: {result[key]}')
        elif report['driver_exit'] != -signum:
            problems.append(f'the driver exited with {report["driver_exit"]}')
    t = report.get('time_to_error')
    if t is None:
        problems.append('no time to error measured')
    elif t > limit:
        problems.append(f'time to error {t:.2f} s > {limit} s')


RESTART_SCENARIOS = ('restart_window', 'restart_reduce', 'restart_post', 'restart_between')


def _restart_as_expected(report, result, problems):
    """The checks of a worker SIGKILLed once under ``max_worker_restarts``: the run goes
    on, bitwise the uninterrupted one; returns the bound on the recovery time."""
    if result is None:
        problems.append('the driver printed no RESULT')
        return RESTART_LIMIT
    if result.get('error'):
        problems.append(f'the run with the restart raised: {result["error"]}')
        return RESTART_LIMIT
    for key in ('bitwise_equal', 'reports_equal'):
        if not result.get(key):
            problems.append(f'{key} is {result.get(key)}')
    for key in ('iteration', 'epoch_detail'):
        if result.get(key) != result.get('reference_' + key):
            problems.append(f'{key} {result.get(key)} (uninterrupted: '
                            f'{result.get("reference_" + key)})')
    if result.get('restarts') != 1 or len(result.get('warnings', [])) != 1:
        problems.append(f'restarts {result.get("restarts")}, warnings '
                        f'{result.get("warnings")} (expected one of each)')
    reported = result.get('reported_restarts') or [0]
    if reported[-1] != 1:
        problems.append(f'main/worker_restarts reported {reported}')
    for key in ('not_reaped', 'segments_left'):
        if result.get(key):
            problems.append(f'{key}: {result[key]}')
    start = result.get('start_s') or 0.0
    report['start_s'] = start
    report['time_to_error'] = result.get('recovery_s')   # the time to recover, here
    report['limit'] = RESTART_LIMIT + start
    return RESTART_LIMIT + start


def _worker_error_as_expected(scenario, result, problems):
    """The checks of a fault in a worker; False when the error is no WorkerError."""
    if not result.get('is_worker_error'):
        problems.append(f'expected WorkerError, got {result.get("error_type")}: '
                        f'{result.get("message", "")[:500]}')
        return False
    if result['replica'] != result['replica_expected']:
        problems.append(f'the error names replica {result["replica"]}, '
                        f'not {result["replica_expected"]}')
    if scenario != 'raise_start' and (
            not result['segments_created']
            or result['segments_mapped_at_update_1'] != result['segments_created']):
        problems.append('the segments seen do not match: mapped '
                        f'{result["segments_mapped_at_update_1"]}, created '
                        f'{result["segments_created"]}')
    if result['device'] != '@numpy':
        problems.append(f'the error names device {result["device"]!r}')
    if scenario in ('kill_worker', 'restart_spent'):
        if result.get('exitcode') != -signal.SIGKILL:
            problems.append(f'exitcode {result.get("exitcode")} (expected -9)')
        if 'SIGKILL' not in result['message']:
            problems.append('the message does not say SIGKILL')
    elif not result.get('traceback_has_fault'):
        problems.append('the remote traceback lacks the fault: '
                        + (result.get('remote_traceback') or '')[-800:])
    return True


if __name__ == '__main__':
    main()

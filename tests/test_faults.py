"""Faults: a worker that raises or dies, a master that is interrupted or killed; and
under ``max_worker_restarts`` a worker that dies, replaced, the run bitwise the same.

Each scenario runs in fresh processes (``scripts/faults/harness.py`` -> ``run_fault.py``
-> the workers) under a hard timeout that kills the whole process group, so a hang fails
the test instead of stalling CI. The harness is a child subreaper: it sees every worker
exit, reaps the orphans, and checks that no descendant and no ``/dev/shm/mgpu_*`` segment
of the run is left. Faults fire only in the chosen worker (``scripts/faults/faulty.py``).

The runner is ``scripts/faults/fault_runner.py``; the 20x repetitions are marked ``slow``
(``tools/faults.py`` prints the table, with the same runner).
"""
import concurrent.futures
import re
import signal
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / 'scripts' / 'faults'))
sys.path.insert(0, str(HERE / 'scripts'))
import fault_runner  # noqa: E402
import soak_measure  # noqa: E402

HARD_TIMEOUT = 90.0   # seconds for one scenario, processes included


def run_scenario(scenario, *driver_args, timeout=HARD_TIMEOUT):
    """Run one scenario; returns the harness's report (a dict). The runner is the one
    ``tools/faults.py`` repeats."""
    return fault_runner.run_once(scenario, driver_args, timeout=timeout)


# Every fast scenario: key -> harness arguments. They run a few at a time in the
# background as soon as the first test of this module asks (each is mostly process
# start-up), so the module costs about a third of running them one by one.
FAST = {
    'raise_forward': ('raise_forward',),
    'raise_backward': ('raise_backward',),
    'raise_iterator': ('raise_iterator',),
    'raise_converter': ('raise_converter',),
    'raise_forward_replica2': ('raise_forward', '--replicas', '3', '--replica', '2'),
    'raise_start': ('raise_start',),
    'kill_worker': ('kill_worker',),
    'master_sigint': ('master_sigint',),
    'master_sigterm': ('master_sigterm',),
    'master_sigkill': ('master_sigkill',),
    'master_sigkill_forkserver': ('master_sigkill', '--start-method', 'forkserver'),
    # two workers see the master die: each segment is taken off the tracker once
    'master_sigkill_three_replicas': ('master_sigkill', '--replicas', '3'),
    # every replica reads through a MultiprocessIterator with 2 processes of its own
    'raise_forward_mpit': ('raise_forward', '--iterator', 'multiprocess'),
    'kill_worker_mpit': ('kill_worker', '--iterator', 'multiprocess'),
    'master_sigint_mpit': ('master_sigint', '--iterator', 'multiprocess'),
    'master_sigkill_mpit': ('master_sigkill', '--iterator', 'multiprocess'),
}
# max_worker_restarts: one of each kind (the runner's restart scenarios), each a run with
# the restart and the same run uninterrupted, compared bit for bit
FAST.update({key: (scenario, *extra) for key, (scenario, extra, _) in
             {**fault_runner.RESTART_SCENARIOS, **fault_runner.RESTART_ERRORS}.items()})


class Scenarios:
    def __init__(self, keys, width):
        self.pool = concurrent.futures.ThreadPoolExecutor(width)
        self.futures = {key: self.pool.submit(run_scenario, *FAST[key]) for key in keys}

    def report(self, key):
        if key not in self.futures:
            self.futures[key] = self.pool.submit(run_scenario, *FAST[key])
        return self.futures[key].result()


@pytest.fixture(scope='module')
def scenarios(request):
    this = request.module.__name__
    fast = [item for item in request.session.items if item.module.__name__ == this
            and item.get_closest_marker('slow') is None]
    width = 4   # mostly waiting on process start-up, not CPU-bound
    runner = Scenarios(list(FAST) if len(fast) > 1 else [], width)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


def assert_clean(report):
    assert report['problems'] == [], (
        f"{report['scenario']}: {report['problems']}\n--- driver stderr ---\n"
        f"{report.get('stderr_tail', '')}"
        + (f"\n--- the hung driver's threads ---\n{report['hung_stacks']}"
           if report.get('hung_stacks') else ''))


# ------------------------------------------------------------------ a worker raises
@pytest.mark.parametrize('scenario, site', [
    ('raise_forward', 'forward'),
    ('raise_backward', 'backward'),
    ('raise_iterator', '__getitem__'),
    ('raise_converter', '__call__'),
])
def test_worker_raises(scenarios, scenario, site):
    report = scenarios.report(scenario)
    assert_clean(report)
    result = report['result']
    assert result['error_type'] == 'WorkerError'
    assert result['replica'] == 1 and result['device'] == '@numpy'
    assert re.match(r"replica 1 on device '@numpy': failed during update", result['message'])
    # the worker's full traceback, down to the line that raised
    assert '--- traceback in the worker process ---' in result['message']
    tb = result['remote_traceback']
    assert tb.startswith('Traceback (most recent call last):')
    assert f'in {site}\n' in tb
    assert re.search(r'faulty\.FaultInjected: injected fault in \w+, call \d+, pid \d+\n?$', tb)
    assert result['time_to_error'] < 5.0
    assert len(result['finalize_times']) == 2


def test_worker_raises_names_the_right_replica(scenarios):
    """Three replicas, the fault in the last one: the error names replica 2."""
    report = scenarios.report('raise_forward_replica2')
    assert_clean(report)
    assert report['result']['replica'] == 2
    assert report['result']['message'].startswith("replica 2 on device '@numpy'")
    assert len(report['ready']['workers']) == 2


def test_worker_fails_at_start(scenarios):
    report = scenarios.report('raise_start')
    assert_clean(report)
    result = report['result']
    assert result['updates_done'] == 0
    assert result['message'].startswith("replica 1 on device '@numpy': failed during start")
    assert 'in __setstate__' in result['remote_traceback']


# ------------------------------------------------------------------ a worker is killed
def test_worker_killed_mid_update(scenarios):
    report = scenarios.report('kill_worker')
    assert_clean(report)
    result = report['result']
    assert re.match(r"replica 1 on device '@numpy': the worker process \(pid \d+\) was "
                    r'killed by SIGKILL', result['message'])
    assert result['exitcode'] == -signal.SIGKILL
    assert result['remote_traceback'] == ''
    assert result['time_to_error'] < 10.0


# ------------------------------------------------------------------ the master goes
@pytest.mark.parametrize('scenario', ['master_sigint', 'master_sigterm', 'master_sigkill',
                                      'master_sigkill_three_replicas'])
def test_master_signalled(scenarios, scenario):
    report = scenarios.report(scenario)
    assert_clean(report)
    assert report['ready']['workers']
    assert report['time_to_error'] < 5.0         # the last worker gone, after the signal
    if scenario == 'master_sigint':              # the master cleans up itself
        assert report['result']['error_type'] == 'KeyboardInterrupt'
        assert report['driver_exit'] == 0
    else:                                        # the workers notice by themselves
        signum = signal.SIGTERM if scenario == 'master_sigterm' else signal.SIGKILL
        assert report['driver_exit'] == -signum


def test_master_killed_forkserver(scenarios):
    """Under forkserver the workers' parent is the fork server, not the master: the
    parent watch must still see the master die (it waits on the parent's sentinel)."""
    report = scenarios.report('master_sigkill_forkserver')
    assert_clean(report)
    assert report['time_to_error'] < 5.0


# ------------------------------------------------------------------ MultiprocessIterator
@pytest.mark.parametrize('scenario', ['raise_forward_mpit', 'kill_worker_mpit',
                                      'master_sigint_mpit', 'master_sigkill_mpit'])
def test_faults_with_multiprocess_iterators(scenarios, scenario):
    """The workers' iterators run processes of their own (the workers' children): a
    worker that raises or is SIGKILLed, a master interrupted or SIGKILLed, and still the
    harness (a subreaper) finds no process and no segment left."""
    report = scenarios.report(scenario)
    assert_clean(report)
    if scenario.startswith('master_'):
        assert report['time_to_error'] < 5.0
    else:
        assert report['result']['is_worker_error']
        assert report['result']['updates_done'] == 2


# ------------------------------------------------------------------ max_worker_restarts
@pytest.mark.parametrize('key', sorted(fault_runner.RESTART_SCENARIOS))
def test_a_worker_killed_is_replaced_and_the_run_is_bitwise_the_same(scenarios, key):
    """SIGKILLed in its window, in its reduce, after its post (found at the next Step),
    between updates; with a survivor and dropout; with MultiprocessIterators: the run goes
    on, its parameters and every reported value bitwise those of the run uninterrupted
    (the harness compares, and finds nothing left: processes, segments), one restart
    warned and reported, recovered within 10 s plus the new worker's start-up."""
    report = scenarios.report(key)
    assert_clean(report)
    result = report['result']
    assert result['bitwise_equal'] and result['reports_equal']
    assert result['iteration'] == result['reference_iteration'] == 12
    assert result['epoch_detail'] == result['reference_epoch_detail']
    assert result['restarts'] == 1 and result['reported_restarts'][-1] == 1
    replica = result['replica_expected']
    warning, = result['warnings']
    assert re.match(rf"replica {replica} on device '@numpy': the worker process \(pid \d+\) "
                    r'was killed by SIGKILL, found in update (\d+); a new worker process '
                    r'\(pid \d+\) took its place within [\d.]+ s, and update \1 is redone '
                    r'from its start \(restart 1 of max_worker_restarts=1\)$', warning)
    update = int(re.search(r'found in update (\d+)', warning).group(1))
    # in the window, in the reduce and between updates 3 and 4: update 3 or 4 is redone;
    # after its post of update 8, the master finds it at update 9's Step
    assert update == (9 if key == 'restart_post' else 4 if key == 'restart_between' else 3)
    assert report['time_to_error'] <= 10.0 + report['start_s']


def test_a_python_error_is_not_restarted(scenarios):
    """A worker's own exception would come again from the same code: raised, saying so."""
    report = scenarios.report('restart_raise')
    assert_clean(report)
    result = report['result']
    assert re.match(r"replica 1 on device '@numpy': failed during update \(not restarted: "
                    r'max_worker_restarts replaces a worker process that died, from a signal '
                    r'or the out-of-memory killer; a Python exception in the worker is a bug '
                    r'that the same code would raise again\)', result['message'])
    assert 'FaultInjected' in result['remote_traceback']


def test_the_death_past_the_restarts_allowed_raises_naming_them(scenarios):
    """max_worker_restarts=1 and the fault fires again in the new worker: the second
    death ends the run as without restarts, naming the restart before it."""
    report = scenarios.report('restart_spent')
    assert_clean(report)
    result = report['result']
    assert re.match(r"replica 1 on device '@numpy': the worker process \(pid \d+\) was "
                    r'killed by SIGKILL; not restarted: max_worker_restarts=1 allows 1 restart '
                    r'over the run and 1 took place before \(replica 1 at update 3: the worker '
                    r'process \(pid \d+\) was killed by SIGKILL\)$', result['message'])
    assert result['exitcode'] == -signal.SIGKILL
    assert result['updates_done'] == 4   # the second death, in update 5


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize('key', sorted(fault_runner.RESTART_SCENARIOS))
def test_restart_3_times(key):
    """A few repetitions of each restart scenario (``tools/faults.py --restarts`` runs 20)."""
    row = fault_runner.repeat(key, 3)
    print(fault_runner.format_table([row]))
    assert row['ok'] == 3, row['failures']


# ------------------------------------------------------------------ 20 times each
SCENARIOS = ['raise_forward', 'raise_backward', 'raise_iterator', 'raise_converter',
             'raise_start', 'kill_worker', 'master_sigint', 'master_sigterm',
             'master_sigkill', 'master_sigkill_forkserver']   # the keys of fault_runner


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize('scenario', SCENARIOS)
def test_fault_20_times(scenario):
    row = fault_runner.repeat(scenario, 20)
    print(fault_runner.format_table([row]))
    assert row['ok'] == 20, row['failures']


# ------------------------------------------------------------------ soak and hygiene
@pytest.mark.slow
def test_soak_short():
    """A short soak (``tools/soak.py`` runs a long one): RSS flat, fds and segments constant, no inet or
    listening socket, segment names of 128 random bits, nothing left afterwards."""
    out = soak_measure.soak(updates=1000, start=200, every=200, log=lambda *a: None)
    print(soak_measure.format_figures(out['figures']))
    assert out['problems'] == []

"""Smoke test of ``bench/scaling.py``: a tiny grid end to end, then the results' schema.

The benchmark runs in a subprocess (it starts its own processes per thread setting, and
ChainerMN under ``mpiexec`` when mpi4py is installed); only its outputs are checked here.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from unittest import mock
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCALING = ROOT / 'bench' / 'scaling.py'

DEVICES = (1, 2)
KS = (1, 2)
ROW_KEYS = {'method', 'n', 'k', 'micro_batch', 'global_batch', 'samples_per_s',
            'samples_per_s_min', 'samples_per_s_max', 'rounds', 'speedup_vs_standard',
            'speedup_vs_best_standard', 'efficiency', 'vs_limit', 'processes', 'thread_env',
            'passes'}


def _expected_methods(result):
    methods = {'standard', 'hand', 'limit', 'parallel', 'ours'}
    if result['config']['device_kind'] == 'cpu' and result['machine']['cores_usable'] > 1:
        methods.add('standard_1t')
    mpiexec = Path(sys.executable).parent / 'mpiexec'
    if importlib.util.find_spec('mpi4py') and (mpiexec.exists() or _on_path('mpiexec')):
        methods.add('chainermn')
    return methods


def _on_path(name):
    import shutil
    return shutil.which(name) is not None


def _run_bench(script, *args, timeout):
    """Run ``bench/<script>`` with ``args`` in a subprocess (the checkout on its path);
    asserts it exited 0, showing the end of its stderr if not."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
    proc = subprocess.run([sys.executable, str(ROOT / 'bench' / script), *args],
                          cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope='module')
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
    cmd = [sys.executable, str(SCALING), '--smoke', '--out', str(out),
           '--devices', ','.join(map(str, DEVICES)), '--ks', ','.join(map(str, KS)),
           '--case-timeout', '120']
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=240)
    result_path = out / 'scaling.json'
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    failures = '\n'.join('{} N={} k={}:\n{}'.format(e.get('method'), e.get('n'), e.get('k'),
                                                    e.get('error'))
                         for e in result.get('errors', []))
    assert proc.returncode == 0, failures or proc.stderr[-5000:]
    return out, result, proc


@pytest.mark.slow  # ~30 s alone: about 35 fresh processes and two mpiexec runs
def test_outputs_written(smoke):
    out, result, proc = smoke
    assert (out / 'scaling.md').read_text().startswith('# Scaling benchmark')
    assert (out / 'scaling.png').stat().st_size > 1000
    assert '| method | devices | k |' in proc.stdout  # the table on stdout
    assert '[' in proc.stderr  # progress lines


@pytest.mark.slow  # ~30 s alone: about 35 fresh processes and two mpiexec runs
def test_every_row_present_and_sane(smoke):
    _, result, _ = smoke
    assert result['schema'] == 'mgpu_updater.bench.scaling/1'
    assert result['errors'] == []
    assert result['config']['devices'] == list(DEVICES)
    assert result['config']['accumulate_steps'] == list(KS)
    b = result['config']['micro_batch']
    seen = {(r['method'], r['n'], r['k']) for r in result['rows']}
    expected = {(m, n, k) for m in _expected_methods(result) for n in DEVICES for k in KS}
    assert seen == expected
    for row in result['rows']:
        assert ROW_KEYS <= set(row), row
        assert row['global_batch'] == row['n'] * row['k'] * b
        assert len(row['rounds']) == result['config']['rounds'] * result['config']['passes']
        assert all(math.isfinite(v) and v > 0 for v in row['rounds'])
        assert row['samples_per_s_min'] <= row['samples_per_s'] <= row['samples_per_s_max']
        assert row['speedup_vs_standard'] > 0 and row['efficiency'] > 0
    standard = [r for r in result['rows'] if r['method'] == 'standard']
    assert all(r['speedup_vs_standard'] == pytest.approx(1.0) for r in standard)


@pytest.mark.slow  # ~30 s alone: about 35 fresh processes and two mpiexec runs
def test_ours_reports_times_and_comm_share(smoke):
    _, result, _ = smoke
    ours = [r for r in result['rows'] if r['method'] == 'ours']
    for row in ours:
        for times in (row['times'], row['times_mean']):
            assert set(times) >= {'data', 'compute', 'comm', 'update'}
            assert all(v >= 0 for v in times.values())
        # Shares of the measured wall time per update (timer granularity allows a little > 1).
        assert 0 <= row['comm_share'] <= 1.5 and 0 <= row['comm_share_mean'] <= 1.5


@pytest.mark.slow  # ~30 s alone: about 35 fresh processes and two mpiexec runs
def test_memory_and_environment_recorded(smoke):
    _, result, _ = smoke
    assert [m['k'] for m in result['memory']] == list(KS)
    for m in result['memory']:
        assert m['accumulated_peak_bytes'] > 0 and m['one_batch_peak_bytes'] > 0
        assert m['ours_peak_bytes'] > 0
    assert result['machine']['cores_usable'] >= 1
    assert {'python', 'numpy', 'chainer', 'blas'} <= set(result['versions'])
    per_replica = result['threads']['per_replica']
    assert set(per_replica) == {str(n) for n in DEVICES}
    if result['config']['device_kind'] == 'cpu':
        replica_rows = [r for r in result['rows'] if r['method'] == 'ours']
        for row in replica_rows:
            assert row['thread_env']['OPENBLAS_NUM_THREADS'] == str(per_replica[str(row['n'])])
    skipped = {s['method'] for s in result['skipped']}
    assert 'MultiprocessParallelUpdater' in skipped or result['machine']['gpus'] >= 2


def test_passes_are_pooled_and_alternate():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import scaling
    groups = [{'label': 'a'}, {'label': 'b'}, {'label': 'memory'}]
    order = [(p, g['label']) for p, g in scaling.schedule(groups, 3)]
    assert order == [(0, 'a'), (0, 'b'), (0, 'memory'), (1, 'b'), (1, 'a'), (2, 'a'), (2, 'b')]
    records = [
        {'method': 'ours', 'n': 2, 'k': 4, 'pass': 1, 'samples_per_s': [3.0], 'wall_s': 1.0,
         'times_per_update': {'comm': [0.3]}},
        {'method': 'ours', 'n': 2, 'k': 4, 'pass': 0, 'samples_per_s': [1.0, 2.0],
         'wall_s': 2.0, 'times_per_update': {'comm': [0.1, 0.2]}},
    ]
    (merged,) = scaling.merge_passes(records)
    assert merged['samples_per_s'] == [1.0, 2.0, 3.0]
    assert merged['passes'] == 2 and merged['wall_s'] == 3.0
    assert merged['times_per_update'] == {'comm': [0.1, 0.2, 0.3]}
    row = scaling._row(dict(merged, processes=2, thread_env={}), micro_batch=8)
    assert row['samples_per_s'] == 2.0 and row['global_batch'] == 64
    assert row['step_time'] == pytest.approx(32.0)  # 64 samples at 2 samples/s
    assert row['comm_share'] == pytest.approx(0.2 / 32.0)


@pytest.mark.slow  # ~30 s alone: about 35 fresh processes and two mpiexec runs
def test_limit_rows_and_goals(smoke):
    _, result, _ = smoke
    per_replica = result['threads']['per_replica']
    limits = [r for r in result['rows'] if r['method'] == 'limit']
    assert sorted((r['n'], r['k']) for r in limits) == sorted(
        (n, k) for n in DEVICES for k in KS)
    for row in limits:
        assert row['processes'] == row['n']
        assert row['vs_limit'] == pytest.approx(1.0)
        if result['config']['device_kind'] == 'cpu':
            assert row['thread_env']['OPENBLAS_NUM_THREADS'] == str(per_replica[str(row['n'])])
    names = [g['goal'] for g in result['goals']]
    for k in KS:
        assert '2 replicas vs the limit (2 independent loops), k={}'.format(k) in names
    assert '1 replica vs StandardUpdater, k=1' in names
    assert '1 replica vs hand-written accumulation, k=2' in names
    for g in result['goals']:
        low, high = g['range']
        assert low <= g['value'] <= high
        assert isinstance(g['met'], bool) and isinstance(g['resolved'], bool)


def _rate_row(method, n, k, median, low, high):
    return {'method': method, 'n': n, 'k': k, 'samples_per_s': median,
            'samples_per_s_min': low, 'samples_per_s_max': high}


def test_goals_ratio_range_and_resolved():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import _report
    rows = [
        _rate_row('ours', 2, 1, 110.0, 105.0, 115.0),
        _rate_row('chainermn', 2, 1, 100.0, 98.0, 102.0),    # ahead, beyond the spread
        _rate_row('limit', 2, 1, 112.0, 100.0, 125.0),       # 0.98x, but the spread is wide
        _rate_row('ours', 1, 1, 90.0, 89.0, 91.0),
        _rate_row('standard', 1, 1, 100.0, 99.0, 101.0),     # 0.90x: clearly missed
        _rate_row('ours', 1, 4, 99.0, 98.0, 100.0),
        _rate_row('hand', 1, 4, 100.0, 99.0, 101.0),
    ]
    goals = {g['goal']: g for g in _report.goals(rows, [1, 4])}
    mn = goals['2 replicas vs ChainerMN (naive), k=1']
    assert mn['value'] == pytest.approx(1.1) and mn['met'] and mn['resolved']
    assert mn['range'] == [pytest.approx(105 / 102, abs=1e-3), pytest.approx(115 / 98, abs=1e-3)]
    limit = goals['2 replicas vs the limit (2 independent loops), k=1']
    assert limit['met'] and not limit['resolved']
    assert limit['detail'] == {'ChainerMN (naive) vs limit': pytest.approx(100 / 112, abs=1e-3)}
    standard = goals['1 replica vs StandardUpdater, k=1']
    assert not standard['met'] and standard['resolved']
    hand = goals['1 replica vs hand-written accumulation, k=4']
    assert hand['met'] and not hand['resolved']   # 0.99x; 98/101 = 0.970 < 0.98
    assert '2 replicas vs ChainerMN (naive), k=4' not in goals   # not measured: no goal
    table = _report.goals_table(list(goals.values()))
    assert table.count('no: the spread is larger than the difference') == 2


def test_same_malloc_gives_every_method_the_thresholds_ours_sets():
    """``--same-malloc``: every group's environment carries glibc's variables for the
    thresholds of ``reuse_host_memory`` (ours then leaves malloc alone); without it none."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import scaling
    from mgpu_updater import _host_memory
    wanted = {'MALLOC_MMAP_THRESHOLD_': str(_host_memory.MMAP_THRESHOLD),
              'MALLOC_TRIM_THRESHOLD_': str(_host_memory.TRIM_THRESHOLD)}
    for flag in ([], ['--same-malloc']):
        args = scaling.parse_args(['--devices', '1,2', '--ks', '1'] + flag)
        groups, _ = scaling.build_groups(args, 'cpu', [1, 2], 2)
        ran = [g for g in groups if g['label'] != 'memory']
        assert {g['cases'][0]['method'] for g in ran} >= {'standard', 'limit', 'ours'}
        for g in ran:
            env = g['env']
            if flag:
                assert {k: env.get(k) for k in wanted} == wanted, g['label']
                with mock.patch.dict(os.environ, env):   # ours then leaves malloc alone
                    assert _host_memory.decide('auto') is False
            else:
                assert not set(wanted) & set(env), g['label']
    assert scaling.parse_args([]).warmup == 3


def test_paired_bench_writes_one_row_per_k(tmp_path):
    """``bench/paired.py``: ours, the hand-written loop and (k=1) StandardUpdater alternating
    in one process over the same batches, each ratio's median with its bootstrap interval
    and the goal's verdict, and how far apart the weights ended."""
    _run_bench('paired.py', '--model', 'tiny', '--ks', '1,2', '--pairs', '3', '--warmup', '1',
               '--out', str(tmp_path), timeout=120)
    result = json.loads((tmp_path / 'paired.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.paired/5'
    assert [r['k'] for r in result['rows']] == [1, 2]
    assert 'standard' in result['rows'][0] and 'standard' not in result['rows'][1]
    for ratio in result['rows'] + [result['rows'][0]['standard']]:
        assert len(ratio['ratios']) == 3
        assert all(r > 0 and math.isfinite(r) for r in ratio['ratios'])
        assert ratio['ratio_q1'] <= ratio['ratio_median'] <= ratio['ratio_q3']
        low, high = ratio['ratio_ci95']
        assert min(ratio['ratios']) <= low <= high <= max(ratio['ratios'])
        assert ratio['goal'] in ('within 2%', 'above 2%', 'not resolved')
    for row in result['rows']:
        assert row['pairs'] == 3 and row['hand_ms'] > 0 and row['ours_ms'] > 0
        # every method's forward passes timed: a part of its update, their ratio per round
        for name, ms in row['forward_ms'].items():
            assert 0 < ms < row[name + '_ms']
        forward = [row['forward_ratio']] + (
            [row['standard']['forward_ratio']] if 'standard' in row else [])
        for ratio in forward:
            assert len(ratio['ratios']) == 3 and all(r > 0 for r in ratio['ratios'])
            assert min(ratio['ratios']) <= ratio['ci95'][0] <= ratio['ci95'][1] <= max(
                ratio['ratios'])
    assert set(result['rows'][0]['forward_ms']) == {'hand', 'ours', 'standard'}
    assert result['rows'][0]['standard_ms'] > 0
    # the same samples in the same order: ours ends where StandardUpdater does, bitwise,
    # and within rounding of the hand-written loop (which divides each loss by k)
    assert result['rows'][0]['standard']['weights_max_abs_diff'] == 0.0
    assert all(row['weights_max_abs_diff'] <= 1e-6 for row in result['rows'])
    text = (tmp_path / 'paired.md').read_text()
    assert '| 1 | StandardUpdater | 3 |' in text and '| 2 | hand-written loop | 3 |' in text
    assert str(ROOT) not in (tmp_path / 'paired.json').read_text()   # committed: no paths


def test_window_order_bench_times_each_order_against_standard_updater(tmp_path):
    """``bench/window_order.py``: StandardUpdater, ours, ours with the gradients cleared
    before the forward and ours without prefetch, alternating over the same samples; every
    update's and every forward's ratio to StandardUpdater's, and the same weights at the end."""
    _run_bench('window_order.py', '--model', 'tiny', '--rounds', '3', '--warmup', '1',
               '--out', str(tmp_path), timeout=120)
    result = json.loads((tmp_path / 'window_order.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.window_order/1'
    assert [r['method'] for r in result['rows']] == [
        'standard', 'ours', 'ours_cleared_before_forward', 'ours_prefetch_0']
    for row in result['rows']:
        assert 0 < row['forward_ms'] < row['ms']
        for ratio in (row['ratio'], row['forward_ratio']):
            assert len(ratio['ratios']) == 3 and all(r > 0 for r in ratio['ratios'])
            assert ratio['q1'] <= ratio['median'] <= ratio['q3']
        # the order of clearing and loading changes no number: bitwise the same weights
        assert row['weights_max_abs_diff'] == 0.0
    assert result['rows'][0]['ratio']['ratios'] == [1.0] * 3
    assert '| ours, prefetch=0 |' in (tmp_path / 'window_order.md').read_text()
    assert str(ROOT) not in (tmp_path / 'window_order.json').read_text()


def test_sample_order_bench_times_standard_updater_against_itself(tmp_path):
    """``bench/sample_order.py``: StandardUpdater over seed 0 (twice), seeds 1 and 2 and the
    one-shard order, alternating; every ratio to seed 0 with its interval."""
    _run_bench('sample_order.py', '--model', 'tiny', '--rounds', '3', '--warmup', '1',
               '--out', str(tmp_path), timeout=120)
    result = json.loads((tmp_path / 'sample_order.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.sample_order/1'
    assert [r['run'] for r in result['rows']] == [
        'seed 0 again', 'seed 1', 'seed 2', 'shard_iterators, n=1']
    assert result['seed0_ms'] > 0
    for row in result['rows']:
        assert row['ms'] > 0 and row['ratio_q1'] <= row['ratio_median'] <= row['ratio_q3']
        low, high = row['ratio_ci95']
        assert 0 < low <= row['ratio_median'] <= high
    assert '| seed 0 again |' in (tmp_path / 'sample_order.md').read_text()
    assert str(ROOT) not in (tmp_path / 'sample_order.json').read_text()


def test_paired_bench_verdict_needs_the_whole_interval_at_or_below_the_goal():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import _common, paired
    assert paired.verdict(0.99, 1.019) == 'within 2%'
    assert paired.verdict(1.00, 1.021) == 'not resolved'
    assert paired.verdict(1.021, 1.05) == 'above 2%'
    low, high = _common.median_interval([1.0] * 10 + [2.0] * 10)
    assert 1.0 <= low <= 1.5 <= high <= 2.0
    assert paired.parse_args([]).pairs is None   # ceil(600 / k) per k


def test_gpu_overhead_bench_dry_run_writes_every_config(tmp_path):
    """``bench/gpu_overhead.py --dry-run`` (on '@numpy'): every config timed, one profile."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
    cmd = [sys.executable, str(ROOT / 'bench' / 'gpu_overhead.py'), '--dry-run',
           '--batch', '8', '--ks', '1,2', '--seconds', '0.05', '--rounds', '1',
           '--profile', 'ours_2', '--profile-updates', '20', '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'gpu_overhead.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.gpu_overhead/2'
    assert result['device'] == '@numpy' and result['errors'] == []
    expected = ['standard_1'] + [f'{name}_{k}{suffix}' for k in (1, 2)
                                 for name, suffix in (('hand', ''), ('hand', '_read'),
                                                      ('ours', ''), ('ours', '_prefetch0'),
                                                      ('ours', '_ignore'))]
    expected.insert(expected.index('ours_1_ignore') + 1, 'ours_1_skip')
    assert list(result['summary']) == expected
    for row in result['runs']:
        assert row['updates'] >= 5 and row['samples_per_s'] > 0
    # ours is timed after prefetch='auto' decided, not during its trial
    for label, warm in result['warmup'].items():
        assert warm['updates'] >= 10, label
        if label.startswith('ours_') and '_prefetch0' not in label:
            assert warm['loading_modes'] and 'trial' not in warm['loading_modes'], (label, warm)
            assert warm['updates'] > 10, (label, warm)   # the trial outlasts 10 windows
    profile = (tmp_path / 'profile_ours_2.txt').read_text()
    assert '_attempt' in profile and str(ROOT) not in profile
    assert '| ours_2 |' in (tmp_path / 'gpu_overhead.md').read_text()


def test_gpu_overhead_bench_times_the_configs_asked_for(tmp_path):
    """``--configs`` times those configs only, in that order; ``--profile-in-json`` keeps
    the profile in the JSON (bench/gpu_check.sh: the machine returns 8 files at most); an
    unknown config is refused, naming the known ones."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
    script = str(ROOT / 'bench' / 'gpu_overhead.py')
    cmd = [sys.executable, script, '--dry-run', '--batch', '8', '--ks', '1,2',
           '--seconds', '0.05', '--rounds', '1', '--configs', 'hand_2,standard_1,ours_2',
           '--profile', 'ours_2', '--profile-updates', '5', '--profile-in-json',
           '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'gpu_overhead.json').read_text())
    assert list(result['summary']) == ['hand_2', 'standard_1', 'ours_2']
    assert '_attempt' in result['profiles']['ours_2']
    assert sorted(p.name for p in tmp_path.iterdir()) == ['gpu_overhead.json',
                                                          'gpu_overhead.md']
    table = (tmp_path / 'gpu_overhead.md').read_text()
    ours = next(line for line in table.splitlines() if line.startswith('| ours_2 |'))
    hand = result['summary']['hand_2']['median_samples_per_s']
    mine = result['summary']['ours_2']['median_samples_per_s']
    assert ours.rstrip(' |').endswith(f'{mine / hand:.3f}')   # ours against the hand loop
    refused = subprocess.run(cmd[:-2] + ['--configs', 'ours_3', '--out', str(tmp_path)],
                             cwd=str(ROOT), env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2
    assert 'unknown config(s) ours_3' in refused.stderr and 'ours_2_ignore' in refused.stderr


def test_timeline_bench_times_every_phase_of_both_processes(tmp_path):
    """``bench/timeline.py``: ours' master and worker stamp their phases (the worker wraps
    them when it imports the file as its main module); ChainerMN's where it can run."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
    cmd = [sys.executable, str(ROOT / 'bench' / 'timeline.py'), '--model', 'tiny',
           '--micro-batch', '4', '--updates', '4', '--warmup', '1', '--repeats', '2',
           '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'timeline.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.timeline/4'
    ours = result['ours']
    assert ours['updates'] == 8 and len(result['repeats']) == 2   # 2 repeats pooled
    assert ours['master pack'] is None   # the sums went onto the master's gradient arrays
    for key in ('update', 'window', 'outside', 'master begin', 'master targets',
                'master gather',
                'master reduce', 'master receive', 'master step', 'step latency',
                'worker start', 'worker window', 'worker idle'):
        assert ours[key] is not None and ours[key] >= 0, key
    assert ours['window'] < ours['update']
    # the window's thread: CPU time (one thread's can't pass its wall time), preemptions
    # and page faults, counted from the same stamps
    assert 0 < ours['window cpu'] <= ours['window'] * 1.01 + 0.05
    assert ours['window preempted'] >= 0 and ours['window faults'] >= 0
    assert ours['own'] is not None and ours['own'] <= ours['outside']   # less its waits
    # the master's wait at the board for the worker's pack
    assert ours['master meet'] is not None and ours['master meet'] >= 0
    assert ours['master step'] > 0
    # repeat by repeat: one ratio per repeat, its median inside its bootstrap interval
    pairs = result['paired']
    for key in ('update', 'window'):
        assert ('ours / ChainerMN: ' + key in pairs) == ('chainermn' in result)
        if 'chainermn' in result:
            r = pairs['ours / ChainerMN: ' + key]
            assert len(r['ratios']) == 2
            assert min(r['ratios']) <= r['ci95'][0] <= r['median'] <= r['ci95'][1] <= max(
                r['ratios'])
    if 'chainermn' in result:
        mn = result['chainermn']
        assert mn['updates'] == 8
        assert 0 <= mn['allreduce'] < mn['update'] and 0 <= mn['step'] < mn['update']
        assert 0 < mn['window cpu'] <= mn['window'] * 1.01 + 0.05
        assert mn['window preempted'] >= 0 and mn['window faults'] >= 0
        assert 'ours / ChainerMN' in (tmp_path / 'timeline.md').read_text()
    else:
        assert result['chainermn_skipped']
    assert str(ROOT) not in (tmp_path / 'timeline.json').read_text()


@pytest.mark.mpi
@pytest.mark.parametrize('compare, block', [('', 1), ('prefetch=2', 2)])
def test_paired_replicas_bench_times_every_method_in_turns(tmp_path, compare, block):
    """``bench/paired_replicas.py``: ours (the defaults twice, or ``--compare``'s
    settings and the defaults), ChainerMN under ``mpiexec`` and the limit's two loops,
    taking turns of ``--block`` updates, every ratio of issue 15 with its interval and
    verdict, and ours and ChainerMN on the same work (every method as many updates)."""
    _run_bench('paired_replicas.py', '--model', 'tiny', '--micro-batch', '4', '--ks', '1,2',
               '--rounds', '3', '--warmup', '1', '--block', str(block), '--out', str(tmp_path),
               *(['--compare', compare] if compare else []), timeout=180)
    result = json.loads((tmp_path / 'paired_replicas.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.paired_replicas/8'
    assert result['block'] == block
    assert result['first_kwargs'] == ({'prefetch': 2} if compare else {})
    assert [r['k'] for r in result['rows']] == [1, 2]
    from bench import paired_replicas
    for row in result['rows']:
        assert row['rounds'] == 3
        assert set(row['ms']) == {'ours', 'ours_default', 'chainermn', 'limit',
                                  'limit_lockstep', 'limit_same', 'limit_same_lockstep'}
        assert all(ms > 0 for ms in row['ms'].values())
        assert set(row['ratios']) == {key for key, *_ in paired_replicas.RATIOS}
        for key, _, _, _, kind in paired_replicas.RATIOS:
            ratio = row['ratios'][key]
            assert len(ratio['ratios']) == 3
            assert all(r > 0 and math.isfinite(r) for r in ratio['ratios'])
            assert ratio['q1'] <= ratio['median'] <= ratio['q3']
            low, high = ratio['ci95']
            assert min(ratio['ratios']) <= low <= high <= max(ratio['ratios'])
            assert ratio['verdict'] == paired_replicas.verdict(kind, low, high)
        # two loops waiting for the slower one never beat their summed samples/s
        assert all(r >= 1 for r in row['ratios']['limit_lockstep/limit']['ratios'])
        # each update split into the slower replica's forward/backward and the rest
        methods = {'ours', 'ours_default', 'limit', 'limit_same'}
        assert set(row['window_ms']) == set(row['outside_ms']) == methods
        for name in methods:
            whole = row['ms'][name + '_lockstep' if name.startswith('limit') else name]
            assert 0 < row['window_ms'][name] < whole
            assert 0 < row['outside_ms'][name] < whole
        # ours and ChainerMN stepped on the same samples from the same weights: the
        # same weights at the end, to rounding (both ChainerMN ranks alike)
        mn = row['weights_checksum']['chainermn_ranks']
        assert len(mn) == 2 and mn[0] == mn[1]
        assert all(d <= 1e-5 for d in row['weights_rel_diff_to_chainermn'].values())
        assert set(row['weights_rel_diff_after_first_turn']) == {'ours', 'ours_default'}
        assert all(d <= 1e-5 for d in row['weights_rel_diff_after_first_turn'].values())
    text = (tmp_path / 'paired_replicas.md').read_text()
    assert '| 2 | the limit / ours (defaults) |' in text
    assert 'taking turns {} update(s) at a time'.format(block) in text
    if compare:   # the first updater named by its settings
        assert '| 1 | ours (prefetch=2) / ours (defaults) |' in text
    else:
        assert '| 1 | ours (first, defaults) / ours (defaults) |' in text
    assert str(ROOT) not in (tmp_path / 'paired_replicas.json').read_text()


def test_paired_replicas_compare_takes_key_value_pairs_or_says_why_not(capsys):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import paired_replicas
    args = paired_replicas.parse_args(['--compare', 'prefetch=2,report_times=True'])
    assert args.first_kwargs == {'prefetch': 2, 'report_times': True}
    assert paired_replicas.parse_args(['--compare', 'prefetch=auto']).first_kwargs[
        'prefetch'] == 'auto'
    assert paired_replicas.parse_args([]).first_kwargs == {}
    with pytest.raises(SystemExit):
        paired_replicas.parse_args(['--compare', 'prefetch'])
    assert "'prefetch' is not KEY=VALUE" in capsys.readouterr().err


def test_paired_replicas_block_times_all_but_the_first_update_of_a_turn(capsys):
    """A turn of ``--block`` updates runs the method that many times, drops the first
    (it warms the method's processes) and averages the rest, key by key."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import paired_replicas as pr
    calls = []

    def seconds():
        calls.append(None)
        return [9.0, 1.0, 2.0, 3.0][len(calls) - 1]
    assert pr.blocked(seconds, 4)() == 2.0 and len(calls) == 4
    calls.clear()

    def split():
        calls.append(None)
        return {'a': 10.0 * len(calls), 'window:a': float(len(calls))}
    assert pr.blocked(split, 3)() == {'a': 25.0, 'window:a': 2.5}
    one = pr.blocked(seconds, 1)
    assert one is seconds
    assert pr.parse_args([]).block == 4
    with pytest.raises(SystemExit):
        pr.parse_args(['--block', '0'])
    assert '--block' in capsys.readouterr().err


def test_paired_replicas_verdicts_need_the_whole_interval():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import paired_replicas as pr
    assert pr.verdict('ahead', 0.97, 0.999) == 'ahead'
    assert pr.verdict('ahead', 0.98, 1.0) == 'not resolved'
    assert pr.verdict('ahead', 1.001, 1.02) == 'behind'
    assert pr.verdict('limit', 0.95, 0.97) == 'at >= 95%'
    assert pr.verdict('limit', 0.94, 0.96) == 'not resolved'
    assert pr.verdict('limit', 0.90, 0.949) == 'below 95%'
    assert pr.verdict(None, 0.5, 2.0) == '-'
    assert pr.parse_args([]).rounds is None   # ceil(400 / k) per k


def _environment_threads():
    """The BLAS pools (library, threads) of a fresh process with numpy, and the thread
    variables set, as this process's environment is now: what a launch-bound bench, which
    leaves the setting as it finds it, must record. Taken before a bench module is
    imported here (one that set a variable at import would leak it into the comparison)."""
    code = ('import json, numpy, threadpoolctl; print(json.dumps([[p["internal_api"], '
            'p["num_threads"]] for p in threadpoolctl.threadpool_info()]))')
    fresh = json.loads(subprocess.run([sys.executable, '-c', code], capture_output=True,
                                      text=True, check=True, timeout=60).stdout)
    from bench import _common
    return fresh, {k: os.environ[k] for k in _common.THREAD_VARS
                   if os.environ.get(k, '').strip()}


def _assert_threads_recorded(environment, result, markdown):
    """The BLAS pools the bench ran with are the environment's (``_environment_threads``),
    recorded without file paths and said in its Markdown."""
    from bench import _common
    fresh, variables = environment
    pools = result['threads']['threadpools']
    assert fresh and sorted([p['internal_api'], p['num_threads']] for p in pools
                            if p['internal_api'] in {api for api, _ in fresh}) == sorted(fresh)
    assert all('filepath' not in p for p in pools)
    assert result['threads']['variables'] == variables
    assert _common.describe_threads(result['threads']) in markdown


def test_overhead_bench_times_every_method_and_splits_the_phases(tmp_path):
    """``bench/overhead.py``: ours (one replica at k=1 and 4, two replicas) against
    StandardUpdater and the hand loop in turns, each ratio with its interval and verdict,
    and every method's update split into the same phases."""
    environment = _environment_threads()
    _run_bench('overhead.py', '--rounds', '3', '--phase-rounds', '2', '--block', '2',
               '--warmup', '0', '--trial-updates', '2', '--warm-rounds', '3', '--warm-block', '4',
               '--warm-untimed', '2', '--out', str(tmp_path), timeout=300)
    from bench import overhead
    result = json.loads((tmp_path / 'overhead.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.overhead/3'
    _assert_threads_recorded(environment, result, (tmp_path / 'overhead.md').read_text())
    assert set(result['ms']) == {'standard', 'standard_busy', 'hand_k4', 'ours_k1', 'ours_k4',
                                 'ours_n2'}
    assert set(result['ratios']) == {key for key, _, _ in overhead.PAIRS + overhead.SCALE}
    for key, _, _ in overhead.PAIRS:
        ratio = result['ratios'][key]
        assert len(ratio['ratios']) == 3 and all(r > 0 for r in ratio['ratios'])
        assert ratio['verdict'] == overhead.verdict(overhead.GOALS[key], *ratio['ci95'])
    warm = result['warm']   # ours_n2 and standard alone, in long turns
    assert (warm['block'], warm['untimed'], warm['rounds']) == (4, 2, 3)
    assert len(warm['ratio']['ratios']) == 3 and all(r > 0 for r in warm['ratio']['ratios'])
    assert warm['ratio']['verdict'] == overhead.verdict(overhead.GOALS['ours_n2/standard'],
                                                        *warm['ratio']['ci95'])
    assert set(warm['ms']) == {'standard', 'ours_n2'}
    for name, phases in result['phases'].items():
        assert set(phases) == set(overhead.PHASES) | {'window, own', 'own', 'total'}
        assert phases['total'] > 0 and phases['forward'] > 0 and phases['backward'] > 0
        if name.startswith('ours'):
            assert phases['report'] > 0 and phases['begin'] >= 0
    assert result['loading']['ours_n2'] == ['trial', 'trial'] or all(
        m in ('inline', 'ahead', 'trial') for m in result['loading']['ours_n2'])
    assert '| ours_k1/standard |' in (tmp_path / 'overhead.md').read_text()
    assert '| ours_n2/standard, warm (turns of 4, 2 untimed; 3 rounds) |' in \
        (tmp_path / 'overhead.md').read_text()
    assert str(ROOT) not in (tmp_path / 'overhead.json').read_text()


def test_two_replica_floor_runs_both_processes_in_lockstep(tmp_path):
    """``bench/two_replica_floor.py``: the worker's gradients reach the master every round
    (a dead or stuck worker is an error, not a hang), ours runs its turns beside it, and
    the report gives every ratio."""
    cmd = [sys.executable, str(ROOT / 'bench' / 'two_replica_floor.py'), '--rounds', '20',
           '--block', '4', '--untimed', '2', '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'two_replica_floor_block4.json').read_text())
    assert result['rounds'] == 20 and result['floor_ms'] > 0 and result['standard_ms'] > 0
    assert (result['block'], result['untimed']) == (4, 2)
    # past prefetch='auto''s trial: decided, each way as the machine's load made it
    assert result['ours_ms'] > 0 and len(result['ours_loading']) == 2
    assert all(mode in ('inline', 'ahead') for mode in result['ours_loading'])
    assert result['ratio_q05'] <= result['ratio_median'] <= result['ratio_q95']
    assert list(result['ratios']) == ['floor/standard', 'ours/standard', 'ours/floor']
    for r in result['ratios'].values():
        assert r['q05'] <= r['median'] <= r['q95']
        assert r['ci95'][0] <= r['median'] <= r['ci95'][1]
    table = (tmp_path / 'two_replica_floor_block4.md').read_text()
    assert '| ours/floor |' in table and '| floor/standard |' in table
    assert 'turns of 4 updates (2 untimed)' in table and '--block 4 --untimed 2' in table


def test_two_replica_floor_refuses_turns_with_nothing_timed():
    proc = subprocess.run([sys.executable, str(ROOT / 'bench' / 'two_replica_floor.py'),
                           '--block', '3', '--untimed', '3'],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert '--untimed' in proc.stderr and '--block 3 --untimed 3' in proc.stderr


def test_ab_overhead_compares_two_checkouts_on_the_same_batches(tmp_path):
    """``bench/ab_overhead.py``: this checkout against another (here, itself, imported a
    second time under another name): both updaters step on the same batches, so they end
    with the same weights, and every ratio is reported (its figures are not asserted)."""
    environment = _environment_threads()
    cmd = [sys.executable, str(ROOT / 'bench' / 'ab_overhead.py'), '--baseline', str(ROOT),
           '--ks', '1,2', '--rounds', '4', '--warmup', '2', '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'ab_overhead.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.ab_overhead/3'
    _assert_threads_recorded(environment, result, (tmp_path / 'ab_overhead.md').read_text())
    assert result['replicas'] == 1 and (result['block'], result['untimed']) == (3, 1)
    assert [row['k'] for row in result['results']] == [1, 2]
    for row in result['results']:
        assert row['same_weights'] is True
        assert set(row['ms']) == {'reference', 'baseline', 'this'}
        for r in row['ratios'].values():
            assert len(r['ratios']) == 4 and r['ci95'][0] <= r['median'] <= r['ci95'][1]
    assert [row['reference'] for row in result['results']] == ['StandardUpdater',
                                                              'hand-written loop']
    table = (tmp_path / 'ab_overhead.md').read_text()
    assert '| 1 | StandardUpdater |' in table and '| 2 | hand-written loop |' in table


def test_ab_overhead_compares_two_replicas_whose_workers_run_the_baseline(tmp_path):
    """``--replicas 2``: each updater's worker runs its own package (the baseline's
    imports it under the other name), bound to a core of its own: both step on the same
    batches, so they end with the same weights."""
    cmd = [sys.executable, str(ROOT / 'bench' / 'ab_overhead.py'), '--baseline', str(ROOT),
           '--replicas', '2', '--rounds', '3', '--block', '5', '--untimed', '1',
           '--warmup', '2', '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / 'ab_overhead.json').exists()   # a one-replica run's name
    result = json.loads((tmp_path / 'ab_overhead_2_replicas.json').read_text())
    assert (result['replicas'], result['ks'], result['block']) == (2, [1], 5)
    row, = result['results']
    assert row['same_weights'] is True
    assert all(len(modes) == 2 for modes in row['loading'].values())
    for r in row['ratios'].values():
        assert len(r['ratios']) == 3
    assert '--replicas 2' in (tmp_path / 'ab_overhead_2_replicas.md').read_text()


def test_ab_overhead_refuses_a_baseline_that_is_no_checkout(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / 'bench' / 'ab_overhead.py'),
                           '--baseline', str(tmp_path)], cwd=str(ROOT), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert '--baseline' in proc.stderr and 'no mgpu_updater/__init__.py' in proc.stderr


def test_gated_loader_bench_times_each_way_of_handing_places_back(tmp_path):
    """``bench/gated_loader.py``: the three loaders take turns and every ratio is
    reported (its figures are the committed run's, not asserted)."""
    cmd = [sys.executable, str(ROOT / 'bench' / 'gated_loader.py'), '--rounds', '30',
           '--out', str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'gated_loader.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.gated_loader/2' and result['bind'] is None
    assert set(result['ms']) == {'deferred', 'immediate', 'inline'}
    assert all(v > 0 for v in result['ms'].values())
    for key in ('immediate/deferred', 'inline/deferred'):
        r = result['ratios'][key]
        assert r['ci95'][0] <= r['median'] <= r['ci95'][1]
    assert '| immediate |' in (tmp_path / 'gated_loader.md').read_text()


def test_cold_window_bench_times_every_gap_against_none(tmp_path):
    """``bench/cold_window.py``: every gap's windows are timed, each against the window
    after none, in turns (its figures are the committed run's, not asserted)."""
    _run_bench('cold_window.py', '--rounds', '5', '--warmup', '1', '--out', str(tmp_path),
               timeout=120)
    from bench import cold_window
    result = json.loads((tmp_path / 'cold_window.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.cold_window/1' and result['rounds'] == 5
    assert result['core'] in os.sched_getaffinity(0)   # it ran on one of the cores it had
    assert result['cores'] == len(os.sched_getaffinity(0))   # ... and says how many
    names = [cold_window.label(kind, ms) for kind, ms in cold_window.GAPS]
    assert list(result['ms']) == names and all(v > 0 for v in result['ms'].values())
    assert list(result['ratios']) == names[1:]
    for r in result['ratios'].values():
        assert r['ci95'][0] <= r['median'] <= r['ci95'][1]
    assert '| sleep 2 ms |' in (tmp_path / 'cold_window.md').read_text()


def test_cold_window_bench_refuses_too_few_rounds():
    proc = subprocess.run([sys.executable, str(ROOT / 'bench' / 'cold_window.py'),
                           '--rounds', '1'], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and '--rounds must be >= 2, got 1' in proc.stderr

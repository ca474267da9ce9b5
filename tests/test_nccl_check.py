"""bench/gpu_check.py's section ``nccl_ranks_on_one_gpu``: what it reports and when it is
``ok``, from the outputs of its two children (pytest's JUnit file and the comparisons the
tests append; the anchor's RESULT lines), stubbed here: no GPU needed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location(
        'gpu_check_nccl_under_test', os.path.join(ROOT, 'bench', 'gpu_check.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(passed, failed=0, skipped=()):
    cases = [f'<testcase classname="t" name="ok{i}"/>' for i in range(passed)]
    cases += [f'<testcase classname="t" name="bad{i}"><failure message="boom"/></testcase>'
              for i in range(failed)]
    cases += [f'<testcase classname="t" name="s{i}"><skipped message="{reason}"/></testcase>'
              for i, reason in enumerate(skipped)]
    return f'<testsuites><testsuite>{"".join(cases)}</testsuite></testsuites>'


def _stub_children(monkeypatch, module, *, passed=20, failed=0, skipped=(),
                   comparisons=None, anchor=None):
    """subprocess.run answers as the pytest child and the anchor child would."""
    comparisons = comparisons if comparisons is not None else {
        'float32[2-k1]': 2e-7, 'float16[3-k1]': 1e-3, 'declared_order[3-sync]': 5e-6}
    anchor = anchor if anchor is not None else {
        'max_param_diff_vs_mpu': 0.0, 'max_param_diff_vs_mpu_first': 0.0, 'follows': True,
        'ours_over_mpu_time': 1.08, 'ours_ms_per_update': 54.0, 'mpu_ms_per_update': 50.0}
    seen = {}

    def run(cmd, cwd=None, stdout=None, stderr=None, timeout=None, env=None, text=None):
        if '-m' in cmd and 'pytest' in cmd:
            seen['pytest_env'] = env
            xml = next(a.split('=', 1)[1] for a in cmd if a.startswith('--junitxml='))
            with open(xml, 'w') as f:
                f.write(_junit(passed, failed, skipped))
            with open(env['MGPU_NCCL_REPORT'], 'a') as f:
                for name, diff in comparisons.items():
                    f.write(json.dumps({'test': name, 'max_diff': diff}) + '\n')
            return types.SimpleNamespace(returncode=1 if failed else 0)
        seen['anchor'] = cmd
        lines = [{'setup': {'ranks': 2}}, {'run': {'which': 'ours', 'ms_per_update': 54.0}},
                 {'run': {'which': 'mpu', 'ms_per_update': 50.0}}, {'comparison': anchor}]
        return types.SimpleNamespace(
            returncode=0, stdout=''.join('RESULT ' + json.dumps(x) + '\n' for x in lines))

    monkeypatch.setattr(module.subprocess, 'run', run)
    return seen


def _args(tmp_path, dry_run=False):
    return argparse.Namespace(outdir=str(tmp_path), dry_run=dry_run)


def test_a_passing_run_is_ok_with_every_number_the_section_promises(gpu_check, monkeypatch,
                                                                    tmp_path):
    seen = _stub_children(monkeypatch, gpu_check,
                          skipped=['needs two CUDA devices to put the master on device 1'])
    out = gpu_check.run_nccl(_args(tmp_path), 200)
    assert out['ok'] is True and 'error' not in out
    assert out['ranks'] == [2, 3]
    assert (out['tests_passed'], out['tests_skipped'], out['tests_failed']) == (20, 1, 0)
    # against StandardUpdater: the float32/float16 comparisons, not the CPU order check
    assert out['max_param_diff_vs_standard'] == 1e-3
    assert out['ours_over_mpu_time'] == 1.08 and out['max_param_diff_vs_mpu'] == 0.0
    assert seen['pytest_env']['MGPU_TEST_NCCL_RANKS_ON_ONE_GPU'] == '1'
    assert seen['anchor'][-2:] == ['--ranks', '2']
    assert (tmp_path / 'pytest_gpu.log').exists() and (tmp_path / 'bench.log').exists()
    assert sorted(os.listdir(tmp_path)) == ['bench.log', 'pytest_gpu.log']   # no new file


@pytest.mark.parametrize('case, match', [
    (dict(failed=1), r'1 failed'),
    (dict(skipped=["CuPy not installed (No module named 'cupy')"]), r'skipped: .*CuPy'),
    (dict(anchor={'max_param_diff_vs_mpu': 0.1, 'max_param_diff_vs_mpu_first': 0.0,
                  'follows': False, 'ours_over_mpu_time': 1.0}),
     r'the anchor: max_param_diff_vs_mpu 0.1'),
])
def test_anything_short_of_everything_is_not_ok_and_says_why(gpu_check, monkeypatch,
                                                             tmp_path, case, match):
    _stub_children(monkeypatch, gpu_check, **case)
    out = gpu_check.run_nccl(_args(tmp_path), 200)
    assert out['ok'] is False
    assert out['error'].startswith('NCCL ranks on one GPU: ')
    assert __import__('re').search(match, out['error']), out['error']


def test_a_dry_run_reports_skipped_without_an_error(gpu_check, monkeypatch, tmp_path):
    _stub_children(monkeypatch, gpu_check, passed=24,
                   skipped=["CuPy not installed (No module named 'cupy')"] * 21,
                   comparisons={})
    out = gpu_check.run_nccl(_args(tmp_path, dry_run=True), 200)
    assert out['ok'] is False and 'error' not in out
    assert out['skipped'].startswith('dry run: no GPU')
    assert (out['tests_passed'], out['tests_skipped']) == (24, 21)


def test_a_pytest_child_that_times_out_is_an_error(gpu_check, monkeypatch, tmp_path):
    def run(cmd, **kwargs):
        if 'pytest' in cmd:
            raise subprocess.TimeoutExpired(cmd, kwargs.get('timeout'))
        return types.SimpleNamespace(returncode=0, stdout='RESULT {"skipped": "x"}\n')
    monkeypatch.setattr(gpu_check.subprocess, 'run', run)
    out = gpu_check.run_nccl(_args(tmp_path), 200)
    limit = 200 - gpu_check.ANCHOR_SECONDS   # the rest is kept for the anchor
    assert out['ok'] is False and f'did not finish within {limit:.0f} s' in out['error']


def test_a_pytest_child_stopped_at_its_limit_leaves_what_it_printed(gpu_check, monkeypatch,
                                                                    tmp_path):
    """No JUnit file when pytest is killed: the counts come from its -v lines in the log,
    with the test it was running."""
    name = 'tests/test_nccl_one_gpu.py'

    def run(cmd, stdout=None, **kwargs):
        if 'pytest' in cmd:
            assert '-v' in cmd
            stdout.write(f'{name}::test_a[2] PASSED  [  4%]\n'
                         f'{name}::test_b[3] FAILED  [  8%]\n'
                         f'{name}::test_c SKIPPED (needs two CUDA devices)  [ 12%]\n'
                         f'{name}::test_d[2] ')
            stdout.flush()
            raise subprocess.TimeoutExpired(cmd, kwargs.get('timeout'))
        return types.SimpleNamespace(returncode=0, stdout='RESULT {"skipped": "x"}\n')
    monkeypatch.setattr(gpu_check.subprocess, 'run', run)
    out = gpu_check.run_nccl(_args(tmp_path), 200)
    assert out['ok'] is False and 'did not finish' in out['error']
    assert (out['tests_passed'], out['tests_failed'], out['tests_skipped']) == (1, 1, 1)
    assert out['failures'][0]['test'].endswith('::test_b[3]')
    assert out['running_when_stopped'].endswith('::test_d[2]')


@pytest.mark.parametrize('ours_ran', [True, False])
def test_chainers_updater_unable_to_compile_leaves_ours_alone(gpu_check, monkeypatch,
                                                              tmp_path, ours_ran):
    """Chainer's MultiprocessParallelUpdater cannot run (mpu_unavailable): the section is
    ok where ours ran and every test passed, not where ours failed too."""
    _stub_children(monkeypatch, gpu_check)
    stub = gpu_check.subprocess.run
    lines = [{'setup': {'ranks': 2}},
             {'mpu_unavailable': 'CompileException: incomplete type'}]
    lines.insert(1, {'run': {'which': 'ours', 'ms_per_update': 4.6}} if ours_ran
                 else {'error': 'ours: RuntimeError: boom'})

    def run(cmd, **kwargs):
        if 'pytest' in cmd:
            return stub(cmd, **kwargs)
        return types.SimpleNamespace(
            returncode=0 if ours_ran else 1,
            stdout=''.join('RESULT ' + json.dumps(x) + '\n' for x in lines))
    monkeypatch.setattr(gpu_check.subprocess, 'run', run)
    out = gpu_check.run_nccl(_args(tmp_path), 200)
    assert out['anchor']['mpu_unavailable'].startswith('CompileException')
    assert out['ok'] is ours_ran
    if not ours_ran:
        assert 'the anchor: ours: RuntimeError: boom' in out['error']

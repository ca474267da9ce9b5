"""One-GPU check: versions, ``pytest -m gpu``, MNIST-CNN throughput against StandardUpdater,
and several NCCL ranks on the one GPU.

Usage (``bench/gpu_check.sh`` installs what is missing from ``.whl/`` first, then runs this)::

    python bench/gpu_check.py OUTDIR [--dry-run] [--budget SECONDS] [--nccl-budget SECONDS]

Writes ``OUTDIR/gpu_check.json`` after every step, so a run that is killed or fails half-way
still leaves what it measured and the errors; ``pytest_gpu.log``, ``pytest_gpu.xml`` and
``bench.log`` go beside it (the NCCL step appends to the first and the last: the machine
returns a few files only). ``--dry-run`` runs the same steps on ``'@numpy'`` (shorter), to
check the script itself on a machine without a GPU; there the NCCL step runs its plumbing
on the CuPy stand-in and says "skipped" for the rest.

The NCCL step (section ``nccl_ranks_on_one_gpu``) runs ``tests/test_nccl_one_gpu.py``
under the test switch (``MGPU_TEST_NCCL_RANKS_ON_ONE_GPU=1``, docs/gpu.md: 2 and 3 NCCL
ranks on GPU 0, each acting as a host of its own), then ``bench/gpu_nccl_anchor.py`` (ours
with ``replica_reduction='sum'`` against Chainer's MultiprocessParallelUpdater, run the same
way). ``ok`` there is true only if every one of those tests passed (the one that needs two
GPUs may skip) and ours followed the anchor's trajectory.

The throughput step runs in a child process (a CUDA failure or a hang cannot stop the JSON
from being written): for each of StandardUpdater, ours with ``accumulate_steps=1``, the
hand-written accumulation loop with 4 micro-batches (``bench._case``'s) and ours with
``accumulate_steps=4`` (same global batch), a few warm-up updates (ours, with its defaults:
until ``prefetch='auto'`` has decided how to load, at most 300; its row says how), then as
many updates as fit in ``--seconds``, with the device synchronised before the clock starts
and stops. Two rounds, interleaved, so drift shows. Accumulating 4 micro-batches of a
model this small costs about 4 times the host's kernel launches of one batch, so the fair
comparison for ``ours_acc4`` is ``hand_acc4`` (``relative_to_hand_acc4``), not
StandardUpdater. Data are synthetic MNIST-shaped arrays: the machine has no network, and
samples/s does not depend on the pixel values.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = 'RESULT '
MAX_WARMUP = 300   # warm-up updates at most, waiting for prefetch='auto' to decide


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('outdir')
    parser.add_argument('--dry-run', action='store_true',
                        help="run every step on '@numpy' (no GPU needed), shorter")
    parser.add_argument('--budget', type=float, default=270.0,
                        help='seconds for the whole check (default 270)')
    parser.add_argument('--batch', type=int, default=256, help='global batch (default 256)')
    parser.add_argument('--seconds', type=float, default=None,
                        help='timed seconds per measurement (default 6, dry run 1.5)')
    parser.add_argument('--skip-pytest', action='store_true')
    parser.add_argument('--nccl-budget', type=float, default=260.0,
                        help='seconds for the NCCL step, on top of --budget (default 260), '
                             'within --total')
    parser.add_argument('--total', type=float, default=530.0,
                        help='seconds for everything, the NCCL step included (default 530)')
    parser.add_argument('--skip-nccl', action='store_true')
    parser.add_argument('--bench-child', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bench_child:
        return bench_child(args)

    start = time.monotonic()
    os.makedirs(args.outdir, exist_ok=True)
    out_json = os.path.join(args.outdir, 'gpu_check.json')
    report: Dict[str, Any] = {
        'schema': 1, 'dry_run': args.dry_run,
        'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
        'machine': platform.node(), 'errors': [],
    }

    def save() -> None:
        report['elapsed_s'] = round(time.monotonic() - start, 1)
        tmp = out_json + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(report, f, indent=2, sort_keys=True, default=str)
        os.replace(tmp, out_json)

    def left() -> float:
        return args.budget - (time.monotonic() - start)

    save()
    step(report, 'versions', collect_versions, save)
    if args.skip_pytest:
        report['pytest'] = {'skipped': '--skip-pytest'}
    else:
        step(report, 'pytest', lambda: run_pytest(args.outdir, max(30.0, min(170.0, left() - 90))),
             save)
    step(report, 'throughput', lambda: run_bench(args, max(20.0, left() - 10)), save)
    if args.skip_nccl:
        report[NCCL_SECTION] = {'skipped': '--skip-nccl'}
    else:
        step(report, NCCL_SECTION, lambda: run_nccl(
            args, min(args.nccl_budget, args.total - (time.monotonic() - start))), save)
    report['finished'] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec='seconds')
    report['ok'] = not report['errors']
    save()
    print(json.dumps({'ok': report['ok'], 'errors': report['errors'],
                      'summary': report.get('throughput', {}).get('summary')}, indent=2))
    print(f'wrote {out_json}')
    return 0 if report['ok'] else 1


def step(report: Dict[str, Any], name: str, fn: Any, save: Any) -> None:
    """Run one step; record its result or its error, and save either way."""
    try:
        report[name] = fn()
        failed = report[name].get('error') if isinstance(report[name], dict) else None
        if failed:
            report['errors'].append(f'{name}: {failed}')
    except BaseException as e:  # noqa: B902  a step must never stop the report
        report[name] = {'error': f'{type(e).__name__}: {e}', 'traceback': traceback.format_exc()}
        report['errors'].append(f'{name}: {type(e).__name__}: {e}')
        if isinstance(e, KeyboardInterrupt):
            save()
            raise
    save()


# -- versions -----------------------------------------------------------------------------

def collect_versions() -> Dict[str, Any]:
    v: Dict[str, Any] = {'python': sys.version.split()[0], 'platform': platform.platform(),
                         'executable': sys.executable, 'cpu_count': os.cpu_count()}

    def attempt(key: str, fn: Any) -> None:
        try:
            v[key] = fn()
        except Exception as e:
            v[key] = None
            v.setdefault('unavailable', {})[key] = f'{type(e).__name__}: {e}'

    attempt('git_commit', lambda: subprocess.run(
        ['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True, text=True,
        timeout=10).stdout.strip() or None)
    # the tree that ran can differ from HEAD (a copied working tree): name what differs
    attempt('git_changed_files', lambda: sorted(filter(None, subprocess.run(
        ['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT,
        capture_output=True, text=True, timeout=10).stdout.splitlines())))
    import numpy
    v['numpy'] = numpy.__version__
    attempt('compat_patches', _apply_compat)
    attempt('chainer', lambda: __import__('chainer').__version__)
    attempt('cupy', lambda: __import__('cupy').__version__)
    if v.get('cupy'):
        import cupy
        rt = cupy.cuda.runtime
        attempt('cuda_runtime', lambda: _cuda_version(rt.runtimeGetVersion()))
        attempt('cuda_driver_api', lambda: _cuda_version(rt.driverGetVersion()))
        attempt('device_count', rt.getDeviceCount)
        attempt('gpu', lambda: _gpu(rt))
        attempt('nccl', _nccl_version)
        attempt('cuda_libraries', lambda: cuda_libraries(cupy.__version__))
        attempt('cudnn', lambda: v['cuda_libraries']['cudnn'])
    attempt('chainer_cuda', chainer_cuda)
    attempt('nvidia_smi', lambda: subprocess.run(
        ['nvidia-smi', '--query-gpu=name,driver_version,memory.total,pci.bus_id',
         '--format=csv,noheader'], capture_output=True, text=True, timeout=20).stdout.strip())
    return v


CUDNN_GONE = 'not supported by CuPy >= 14'


def chainer_cuda() -> Dict[str, Any]:
    """Chainer's own CUDA verdict: ``chainer.backends.cuda.available``, ``cudnn_enabled``,
    and the error it caught while importing CuPy and its libraries (``_resolution_error``,
    ``chainer/backends/cuda.py:78``; on CuPy >= 14 also the missing cuDNN, ``:134``)."""
    sys.path.insert(0, ROOT)
    from mgpu_updater import _cuda
    from chainer.backends import cuda
    error = getattr(cuda, '_resolution_error', None)
    return {'available': bool(cuda.available), 'cudnn_enabled': bool(cuda.cudnn_enabled),
            'resolution_error': None if error is None else f'{type(error).__name__}: {error}',
            'unavailable_reason': _cuda.chainer_cuda_unavailable(),
            'CHAINER_CUDNN': os.environ.get('CHAINER_CUDNN')}


def cuda_libraries(cupy_version: str) -> Dict[str, Any]:
    """Whether the CUDA libraries Chainer needs load: cuBLAS, NVRTC (kernels compile at run
    time), cuRAND, each through CuPy's own module, with its version, the file this process
    mapped, or the error; and cuDNN, which CuPy >= 14 dropped.

    Needs no device: NVRTC's and cuRAND's versions come from the libraries themselves;
    cuBLAS's needs a handle, so without a device it is ``None`` (the library still loads).
    """
    import importlib
    out: Dict[str, Any] = {}

    def probe(name: str, version: Any) -> None:
        try:
            # `from cupy.cuda import cublas`, as Chainer does (CuPy 14 loads it on access)
            module = getattr(importlib.import_module('cupy.cuda'), name)
            out[name] = {'loads': True, 'version': version(module),
                         'path': _mapped_library(name)}
        except Exception as e:
            out[name] = {'loads': False, 'error': f'{type(e).__name__}: {e}'}

    probe('cublas', _cublas_version)
    probe('nvrtc', lambda m: '.'.join(map(str, m.getVersion())))
    probe('curand', lambda m: m.getVersion())
    if int(cupy_version.split('.')[0]) >= 14:
        out['cudnn'] = CUDNN_GONE
    else:
        try:
            out['cudnn'] = getattr(importlib.import_module('cupy.cuda'), 'cudnn').getVersion()
        except Exception as e:
            out['cudnn'] = f'{type(e).__name__}: {e}'
    return out


def _cublas_version(cublas: Any) -> Any:
    import cupy
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:   # no driver or no device: the version needs a handle on a device
        return None
    with cupy.cuda.Device(0):
        return cublas.getVersion(cupy.cuda.device.get_cublas_handle())


def _mapped_library(name: str) -> Optional[str]:
    """The ``lib<name>.so`` file this process has mapped (Linux), if any."""
    try:
        with open('/proc/self/maps') as f:
            paths = {line.split()[-1] for line in f if f'/lib{name}.so' in line}
    except OSError:
        return None
    return sorted(paths)[0] if paths else None


def _apply_compat() -> List[str]:
    sys.path.insert(0, ROOT)
    from mgpu_updater import _compat
    patches = _compat.needed()
    _compat.apply()
    return patches


def _cuda_version(n: int) -> str:
    return f'{n // 1000}.{n % 1000 // 10}'


def _gpu(rt: Any) -> Dict[str, Any]:
    p = rt.getDeviceProperties(0)
    name = p['name'].decode() if isinstance(p['name'], bytes) else p['name']
    return {'name': name, 'memory_gib': round(p['totalGlobalMem'] / 2 ** 30, 1),
            'compute_capability': f"{p['major']}.{p['minor']}",
            'multiprocessors': p.get('multiProcessorCount')}


def _nccl_version() -> Dict[str, Any]:
    sys.path.insert(0, ROOT)
    from mgpu_updater import _cuda
    nccl = _cuda.import_nccl()
    return {'runtime': nccl.get_version(), 'build': nccl.get_build_version()}


# -- pytest -m gpu -------------------------------------------------------------------------

def run_pytest(outdir: str, timeout: float) -> Dict[str, Any]:
    log = os.path.join(outdir, 'pytest_gpu.log')
    xml = os.path.join(outdir, 'pytest_gpu.xml')
    # the NCCL ranks on one GPU run in their own step (run_nccl), in their own process
    cmd = [sys.executable, '-m', 'pytest', '-m', 'gpu', '-q', '-rA', '-p', 'no:cacheprovider',
           f'--junitxml={xml}', f'--ignore={os.path.join(ROOT, NCCL_TESTS)}',
           os.path.join(ROOT, 'tests')]
    result: Dict[str, Any] = {'timeout_s': round(timeout)}
    if importlib.util.find_spec('pytest_timeout') is None:
        # pyproject.toml sets pytest-timeout's `timeout`, unknown without it; this run is
        # bounded by the subprocess timeout instead
        cmd[5:5] = ['-W', 'ignore::pytest.PytestConfigWarning']
        result['note'] = 'pytest-timeout not installed: per-test timeouts off'
    result['command'] = ' '.join(cmd[1:])
    t0 = time.monotonic()
    with open(log, 'w') as f:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=_child_env())
            result['returncode'] = proc.returncode
        except subprocess.TimeoutExpired:
            result['returncode'] = None
            result['error'] = f'pytest -m gpu did not finish within {timeout:.0f} s'
    result['seconds'] = round(time.monotonic() - t0, 1)
    with open(log) as f:
        text = f.read()
    result['tail'] = text[-3000:]
    summary = re.findall(r'^=* ?(\d+ (?:passed|failed|skipped|errors?|deselected)\b.*'
                         r' in [\d.]+s.*?) ?=*$', text, re.M)
    result['summary_line'] = summary[-1] if summary else None
    if os.path.exists(xml):
        result.update(_junit(xml))
    if result.get('returncode') not in (0, None) and 'error' not in result:
        # 5: no test collected (every gpu test deselected) is not a failure of the check
        if result['returncode'] != 5:
            result['error'] = (f"pytest -m gpu: {result.get('failed', '?')} failed, "
                               f"{result.get('errors', '?')} errors "
                               f"(returncode {result['returncode']})")
    return result


# -- several NCCL ranks on the one GPU --------------------------------------------------------

NCCL_SECTION = 'nccl_ranks_on_one_gpu'
NCCL_TESTS = 'tests/test_nccl_one_gpu.py'
NCCL_PLUMBING = 'tests/test_nccl_rules.py'   # the switch and the rules, on the CuPy stand-in
NCCL_SWITCH = 'MGPU_TEST_NCCL_RANKS_ON_ONE_GPU'
ALLOWED_SKIP = 'needs two CUDA devices'      # the one test that a one-GPU machine skips
STANDARD_TESTS = ('float32', 'float16', 'micro_batch_size', 'resume', 'master_on_device')
ANCHOR_SECONDS = 50.0                        # kept for the anchor out of the NCCL budget


def run_nccl(args: argparse.Namespace, budget: float) -> Dict[str, Any]:
    """The section ``nccl_ranks_on_one_gpu``: the tests through the test mode, then the
    anchor; on a dry run the plumbing on the stand-in, and "skipped" for the GPU. The
    tests' report and JUnit files live in a scratch folder, removed when it is read."""
    with tempfile.TemporaryDirectory(prefix='mgpu-nccl-check-') as scratch:
        return _run_nccl(args, budget, scratch)


def _run_nccl(args: argparse.Namespace, budget: float, scratch: str) -> Dict[str, Any]:
    t0 = time.monotonic()
    out: Dict[str, Any] = {'ranks': [2, 3], 'ok': False, 'tests_passed': 0,
                           'tests_skipped': 0, 'tests_failed': 0,
                           'max_param_diff_vs_standard': None, 'ours_over_mpu_time': None}
    report_file = os.path.join(scratch, 'comparisons.jsonl')
    xml = os.path.join(scratch, 'nccl.xml')
    env = _child_env()
    env[NCCL_SWITCH] = '1'
    env['MGPU_NCCL_REPORT'] = report_file
    if args.dry_run:
        targets = ['-m', 'not slow', os.path.join(ROOT, NCCL_PLUMBING),
                   os.path.join(ROOT, NCCL_TESTS)]
    else:
        targets = ['-m', 'gpu', os.path.join(ROOT, NCCL_TESTS)]
    # -v: each test's outcome is in the log as it finishes, read back if the step runs out
    cmd = [sys.executable, '-m', 'pytest', '-v', '-rA', '-p', 'no:cacheprovider',
           f'--junitxml={xml}'] + targets
    if importlib.util.find_spec('pytest_timeout') is not None:
        # A hang inside a CUDA call (a host read behind a stuck collective) holds the
        # main thread where no signal handler runs: the thread method ends the whole
        # pytest run then, whose outcomes so far are read back from its log, instead of
        # the hang taking the rest of the step (each test takes about 7 s)
        cmd[4:4] = ['--timeout', '45', '--timeout-method', 'thread']
    else:
        cmd[4:4] = ['-W', 'ignore::pytest.PytestConfigWarning']
    out['command'] = ' '.join(cmd[1:])
    timeout = max(30.0, budget - ANCHOR_SECONDS)
    with open(os.path.join(args.outdir, 'pytest_gpu.log'), 'a') as log:
        log.write(f'\n\n===== {NCCL_SECTION}: {out["command"]} ({NCCL_SWITCH}=1) =====\n')
        log.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=env)
            out['returncode'] = proc.returncode
        except subprocess.TimeoutExpired:
            out['returncode'] = None
            out['error'] = f'the NCCL tests did not finish within {timeout:.0f} s'
    out['pytest_seconds'] = round(time.monotonic() - t0, 1)
    counts = _junit(xml) if os.path.exists(xml) else _outcomes_in_log(
        os.path.join(args.outdir, 'pytest_gpu.log'), NCCL_TESTS)
    out['tests_passed'] = counts['passed']
    out['tests_skipped'] = counts['skipped']
    out['tests_failed'] = counts['failed'] + counts['errors']
    out['failures'] = counts['failures']
    out['skips'] = counts['skips']
    if 'running_when_stopped' in counts:
        out['running_when_stopped'] = counts['running_when_stopped']
    comparisons = _read_comparisons(report_file)
    out['comparisons'] = comparisons
    standard = [v for k, v in comparisons.items() if k.startswith(STANDARD_TESTS)]
    out['max_param_diff_vs_standard'] = max(standard) if standard else None
    out['anchor'] = run_anchor(args, max(20.0, budget - (time.monotonic() - t0)))
    comparison = out['anchor'].get('comparison') or {}
    out['ours_over_mpu_time'] = comparison.get('ours_over_mpu_time')
    out['max_param_diff_vs_mpu'] = comparison.get('max_param_diff_vs_mpu')
    unexpected = [r for r in out.get('skips', {}) if ALLOWED_SKIP not in r]
    if args.dry_run:
        out['skipped'] = ('dry run: no GPU; the test switch and the rules ran on the CuPy '
                          'stand-in, the NCCL tests and the anchor were skipped')
        if out['tests_failed'] or out.get('error') or out['returncode'] not in (0, None):
            out['error'] = out.get('error') or (
                f"the plumbing on the stand-in: {out['tests_failed']} failed "
                f"(returncode {out['returncode']}; see pytest_gpu.log)")
        return out
    # where Chainer's updater cannot run (mpu_unavailable), ours must still have run
    anchored = comparison.get('follows') is True or bool(
        out['anchor'].get('mpu_unavailable') and out['anchor'].get('runs')
        and not out['anchor'].get('error'))
    out['ok'] = bool(out['returncode'] == 0 and out['tests_passed'] and not out['tests_failed']
                     and not unexpected and anchored)
    if not out['ok'] and 'error' not in out:
        why = []
        if out['tests_failed'] or out['returncode'] != 0:
            why.append(f"{out['tests_failed']} failed (returncode {out['returncode']})")
        if unexpected:
            why.append(f'skipped: {unexpected}')
        if not anchored:
            why.append('the anchor: ' + str(out['anchor'].get('error') or
                                            out['anchor'].get('skipped') or
                                            f"max_param_diff_vs_mpu {out['max_param_diff_vs_mpu']}"))
        out['error'] = 'NCCL ranks on one GPU: ' + '; '.join(why)
    return out


def _read_comparisons(path: str) -> Dict[str, float]:
    """test name -> largest parameter difference, from the tests' report lines."""
    out: Dict[str, float] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    out[row['test']] = float(row['max_diff'])
                except (ValueError, KeyError):
                    continue
    return out


def run_anchor(args: argparse.Namespace, timeout: float) -> Dict[str, Any]:
    """bench/gpu_nccl_anchor.py in a child process (its output appended to bench.log)."""
    cmd = [sys.executable, os.path.join(ROOT, 'bench', 'gpu_nccl_anchor.py'), '--ranks', '2']
    if args.dry_run:
        cmd.append('--dry-run')
    result: Dict[str, Any] = {'command': ' '.join(cmd[1:]), 'timeout_s': round(timeout)}
    with open(os.path.join(args.outdir, 'bench.log'), 'a') as log:
        log.write(f'\n\n===== {NCCL_SECTION} anchor: {result["command"]} =====\n')
        log.flush()
        stdout = _run_to_log(cmd, log, timeout, result, 'the anchor')
        log.write('--- stdout ---\n' + stdout)
    for line in stdout.splitlines():
        if not line.startswith(RESULT):
            continue
        row = json.loads(line[len(RESULT):])
        if 'run' in row:
            result.setdefault('runs', []).append(row['run'])
        elif 'error' in row:
            result['error'] = row['error']
        else:
            result.update(row)
    return result


def _outcomes_in_log(path: str, test_file: str) -> Dict[str, Any]:
    """What ``pytest -v`` printed for ``test_file`` in the last section of ``path``, where
    it was stopped before its report: the counts of :func:`_junit` (without messages),
    and the test it was running."""
    with open(path) as f:
        text = f.read().rsplit('\n===== ', 1)[-1]
    name = os.path.basename(test_file)
    out: Dict[str, Any] = {'failed': 0, 'errors': 0, 'skipped': 0, 'passed': 0,
                           'failures': [], 'skips': {}}
    running = None
    for m in re.finditer(rf'(\S*{re.escape(name)}::\S+)(?: (PASSED|FAILED|SKIPPED|ERROR))?',
                         text):
        test, outcome = m.group(1), m.group(2)
        running = None if outcome else test
        if outcome == 'PASSED':
            out['passed'] += 1
        elif outcome == 'SKIPPED':
            out['skipped'] += 1
            out['skips']['(reason in pytest_gpu.log)'] = out['skips'].get(
                '(reason in pytest_gpu.log)', 0) + 1
        elif outcome in ('FAILED', 'ERROR'):
            out['failed' if outcome == 'FAILED' else 'errors'] += 1
            out['failures'].append({'test': test, 'message': '(see pytest_gpu.log)'})
    out['running_when_stopped'] = running
    return out


def _junit(path: str) -> Dict[str, Any]:
    root = ET.parse(path).getroot()
    cases = list(root.iter('testcase'))
    out: Dict[str, Any] = {'tests': len(cases), 'failed': 0, 'errors': 0, 'skipped': 0,
                           'passed': 0, 'failures': [], 'skips': {}}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find('failure') if case.find('failure') is not None else case.find('error')
        skip = case.find('skipped')
        if bad is not None:
            out['failed' if bad.tag == 'failure' else 'errors'] += 1
            out['failures'].append({'test': name, 'message': (bad.get('message') or '')[:500]})
        elif skip is not None:
            out['skipped'] += 1
            reason = (skip.get('message') or '')[:200]
            out['skips'][reason] = out['skips'].get(reason, 0) + 1
        else:
            out['passed'] += 1
    return out


def _run_to_log(cmd: List[str], log: Any, timeout: float, result: Dict[str, Any],
                what: str) -> str:
    """Run ``cmd`` with its stderr into ``log``; its stdout (what it printed by then, if it
    ran past ``timeout``). Sets ``result['returncode']`` (None past the timeout, with
    ``result['error']`` naming ``what``)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                              timeout=timeout, env=_child_env())
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or ''
        result['returncode'] = None
        result['error'] = f'{what} did not finish within {timeout:.0f} s'
        return raw.decode() if isinstance(raw, bytes) else raw
    result['returncode'] = proc.returncode
    return proc.stdout


def _child_env() -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    paths = [ROOT] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
    env['PYTHONPATH'] = os.pathsep.join(paths)
    return env


# -- throughput ----------------------------------------------------------------------------

def run_bench(args: argparse.Namespace, timeout: float) -> Dict[str, Any]:
    log = os.path.join(args.outdir, 'bench.log')
    cmd = [sys.executable, os.path.abspath(__file__), args.outdir, '--bench-child',
           '--batch', str(args.batch), '--budget', str(timeout)]
    if args.dry_run:
        cmd.append('--dry-run')
    if args.seconds is not None:
        cmd += ['--seconds', str(args.seconds)]
    result: Dict[str, Any] = {'timeout_s': round(timeout)}
    with open(log, 'w') as f:
        stdout = _run_to_log(cmd, f, timeout, result, 'the throughput run')
        f.write('\n--- stdout ---\n' + stdout)
    rows = [json.loads(line[len(RESULT):]) for line in stdout.splitlines()
            if line.startswith(RESULT)]
    result['setup'] = next((r['setup'] for r in rows if 'setup' in r), None)
    result['runs'] = [r for r in rows if 'config' in r]
    child_errors = [r['error'] for r in rows if 'error' in r and 'config' not in r]
    failed = [f"{r['config']}: {r['error']}" for r in result['runs'] if 'error' in r]
    if child_errors or failed:
        result.setdefault('error', '; '.join(child_errors + failed))
    elif result['returncode'] not in (0, None):
        result.setdefault('error', f"the throughput child exited with {result['returncode']} "
                                   '(see bench.log)')
    result['summary'] = _summarise(result['runs'])
    return result


def _summarise(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    best: Dict[str, float] = {}
    for r in runs:
        if 'samples_per_s' in r:
            best[r['config']] = max(best.get(r['config'], 0.0), r['samples_per_s'])
    summary: Dict[str, Any] = {'best_samples_per_s': {k: round(v, 1) for k, v in best.items()}}
    base = best.get('standard')
    if base:
        summary['relative_to_standard'] = {k: round(v / base, 3) for k, v in best.items()}
    hand = best.get('hand_acc4')
    if hand and 'ours_acc4' in best:
        summary['relative_to_hand_acc4'] = {'ours_acc4': round(best['ours_acc4'] / hand, 3)}
    return summary


def bench_child(args: argparse.Namespace) -> int:
    """Runs in its own process; prints one ``RESULT {json}`` line per finished item."""
    def emit(obj: Dict[str, Any]) -> None:
        print(RESULT + json.dumps(obj, default=str), flush=True)

    start = time.monotonic()
    seconds = args.seconds if args.seconds is not None else (1.5 if args.dry_run else 6.0)
    try:
        sys.path.insert(0, ROOT)
        import mgpu_updater  # noqa: F401  applies the compat shim before Chainer
        import numpy
        import chainer
        from chainer.datasets import TupleDataset
        from mgpu_updater import ParallelAccumulatingUpdater
        make_model, model_source = _model_factory()
        device = '@numpy' if args.dry_run else '@cupy:0'
        sync = _synchronizer(device)
        n = max(args.batch * 16, 4096)
        rng = numpy.random.RandomState(0)
        data = TupleDataset(rng.rand(n, 1, 28, 28).astype(numpy.float32),
                            rng.randint(0, 10, n).astype(numpy.int32))
        emit({'setup': {'device': device, 'global_batch': args.batch, 'dataset': n,
                        'timed_seconds': seconds, 'warmup_updates': 3 if args.dry_run else 10,
                        'ours_warmup_until_decided_at_most': 3 if args.dry_run else MAX_WARMUP,
                        'model': model_source, 'optimizer': 'MomentumSGD(lr=0.01)',
                        'iterator': 'SerialIterator(shuffle=True), every method',
                        'chainer': chainer.__version__}})
    except BaseException as e:
        emit({'error': f'set-up failed: {type(e).__name__}: {e}',
              'traceback': traceback.format_exc()})
        return 1

    def build(config: str) -> Any:
        model = make_model()
        model.to_device(device)
        optimizer = chainer.optimizers.MomentumSGD(lr=0.01).setup(model)
        if config == 'standard':
            it = chainer.iterators.SerialIterator(data, args.batch, shuffle=True)
            return chainer.training.updaters.StandardUpdater(it, optimizer, device=device)
        acc = int(config.split('acc')[-1])
        if args.batch % acc:
            raise ValueError(f'global batch {args.batch} is not divisible by {acc}')
        # the iterator StandardUpdater reads, for the hand loop and for ours
        it = chainer.iterators.SerialIterator(data, args.batch // acc, shuffle=True)
        if config.startswith('hand'):
            from bench._case import _hand_step
            return _HandUpdater(_hand_step(model, optimizer, it, acc, device))
        # the defaults, as a script that changes only its updater line runs it
        # (prefetch='auto': timed once its trial decided)
        return ParallelAccumulatingUpdater(it, optimizer, devices=[device],
                                           accumulate_steps=acc)

    configs = ['standard', 'ours_acc1', 'hand_acc4', 'ours_acc4']
    warmup = 3 if args.dry_run else 10
    most = warmup if args.dry_run else MAX_WARMUP   # the dry run checks the script only
    status = 0
    for round_ in (1, 2):
        for config in configs:
            # leave room for the rest: each measurement takes about seconds + set-up
            if time.monotonic() - start > args.budget - (seconds + 15):
                emit({'config': config, 'round': round_, 'error': 'skipped: out of time'})
                status = 1
                continue
            updater = None
            try:
                updater = build(config)
                # ours: past prefetch='auto''s trial (about 125 windows), as it trains
                modes = lambda: getattr(updater, 'loading_modes', [])  # noqa: E731
                warm = 0
                while warm < warmup or ('trial' in modes() and warm < most):
                    updater.update()
                    warm += 1
                sync()
                t0 = time.perf_counter()
                count = 0
                while True:
                    updater.update()
                    count += 1
                    if count % 5 == 0 and time.perf_counter() - t0 >= seconds:
                        break
                sync()
                elapsed = time.perf_counter() - t0
                row = {'config': config, 'round': round_, 'updates': count,
                       'seconds': round(elapsed, 3),
                       'samples_per_s': round(count * args.batch / elapsed, 1),
                       'ms_per_update': round(1000 * elapsed / count, 3)}
                if modes():
                    row['warmup_updates'] = warm
                    row['loading_modes'] = list(modes())
                times = getattr(updater, 'last_times', None)
                if times:
                    row['last_times_ms'] = {k: round(1000 * v, 3) for k, v in times.items()}
                emit(row)
            except BaseException as e:
                emit({'config': config, 'round': round_,
                      'error': f'{type(e).__name__}: {e}', 'traceback': traceback.format_exc()})
                status = 1
                if isinstance(e, KeyboardInterrupt):
                    raise
            finally:
                if updater is not None:
                    try:
                        updater.finalize()
                    except Exception:
                        traceback.print_exc()
    return status


class _HandUpdater:
    """The hand-written loop, with the two methods the timing loop calls."""

    def __init__(self, step: Any) -> None:
        self.update = step

    def finalize(self) -> None:
        pass


def _model_factory() -> Any:
    try:
        from examples.mnist.model import make_model
        return make_model, 'examples.mnist.model.make_model()'
    except Exception as e:  # the example is written elsewhere; keep the check running
        import chainer
        import chainer.functions as F
        import chainer.links as L

        class CNN(chainer.Chain):
            def __init__(self) -> None:
                super().__init__()
                with self.init_scope():
                    self.conv1 = L.Convolution2D(1, 16, ksize=3)
                    self.conv2 = L.Convolution2D(16, 32, ksize=3)
                    self.fc1 = L.Linear(32 * 12 * 12, 128)
                    self.fc2 = L.Linear(128, 10)

            def forward(self, x: Any) -> Any:
                h = F.relu(self.conv2(F.relu(self.conv1(x))))
                return self.fc2(F.relu(self.fc1(F.max_pooling_2d(h, 2))))

        return (lambda: L.Classifier(CNN()),
                f'built-in CNN (examples.mnist.model unavailable: {type(e).__name__}: {e})')


def _synchronizer(device: str) -> Any:
    if device == '@numpy':
        return lambda: None
    import cupy
    dev = cupy.cuda.Device(int(device.rsplit(':', 1)[-1]))
    return dev.synchronize


if __name__ == '__main__':
    sys.exit(main())

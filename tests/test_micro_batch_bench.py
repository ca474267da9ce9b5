"""The micro-batch benchmark (``bench/micro_batch.py``) and the GPU check of
``micro_batch_size='auto'`` (``bench/gpu_micro_batch.py``), issue 12.

The GPU check's logic runs here on ``'@numpy'`` with simulated device memory (``--dry-run``);
its CuPy side is the memory pool's cap, checked against a stand-in pool.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_micro_batch, micro_batch  # noqa: E402


def _args(*extra):
    return gpu_micro_batch.parse_args(['--dry-run', '--model', 'tiny', '--batch', '16',
                                       *extra])


# ------------------------------------------------------------------ bench/gpu_micro_batch.py
def test_dry_run_finds_the_size_under_the_cap_and_matches_the_uncapped_run():
    """Batch 16, cap 0.6 x 16 = 9 samples: the whole batch fails, 'auto' tries 16 then
    settles at 8 for every update, with the reference's losses."""
    memory, report = gpu_micro_batch.SimulatedMemory(), {}
    assert gpu_micro_batch.check(memory, _args(), report) == []
    assert report['limit'] == 9
    assert report['whole_batch_under_cap'].startswith('MemoryError: simulated device memory')
    assert report['auto']['micro_batch_size'] == 8
    assert report['auto']['reported_micro_batch_size'] == [8, 8, 8]
    assert report['auto']['footprint_peak'] == 8
    assert report['auto']['losses'] == pytest.approx(report['reference']['losses'], rel=1e-5)
    # reference: 3 whole batches; whole batch under the cap: 16 (fails); auto: 16 (fails),
    # then the first window again as 2 x 8, and 2 more windows of 2 x 8
    assert memory.tried == [16] * 3 + [16] + [16] + [8] * 6


def test_dry_run_main_writes_the_report_and_exits_0(tmp_path, capsys):
    out = tmp_path / 'gpu_micro_batch.json'
    assert gpu_micro_batch.main(['--dry-run', '--model', 'tiny', '--batch', '32',
                                 '--updates', '2', '--out', str(out)]) == 0
    report = json.loads(out.read_text())
    assert report['ok'] is True and report['errors'] == [] and report['device'] == '@numpy'
    assert report['auto']['micro_batch_size'] == 16
    text = capsys.readouterr().out
    assert "micro_batch_size='auto' under the cap: settled at 16 of 32 samples" in text
    assert text.rstrip().endswith('OK')


class _NoCap(gpu_micro_batch.SimulatedMemory):
    @contextlib.contextmanager
    def capped(self, limit):
        yield


def test_a_cap_that_does_not_bite_is_a_failure():
    problems = gpu_micro_batch.check(_NoCap(), _args(), {})
    assert len(problems) == 1
    assert 'the whole batch of 16 ran under the cap of 9 samples: the cap does not bite' \
        in problems[0]


def test_runs_that_differ_are_a_failure():
    memory = gpu_micro_batch.SimulatedMemory()
    args = _args()
    dataset = gpu_micro_batch._common.make_dataset(64, seed=1)
    ref = gpu_micro_batch.train(memory, dataset, 'tiny', 16, 2, micro_batch_size=None)
    assert gpu_micro_batch.compare(ref, ref, args.rtol, args.atol) == []
    off = ref._replace(losses=[ref.losses[0], ref.losses[1] * (1 + 1e-3)])
    assert gpu_micro_batch.compare(ref, off, args.rtol, args.atol)[0].startswith(
        'losses differ')
    name = sorted(ref.params)[0]
    moved = dict(ref.params, **{name: ref.params[name] + 1e-3})
    (problem,) = gpu_micro_batch.compare(ref, ref._replace(params=moved), args.rtol, args.atol)
    assert problem.startswith('parameter {} differs by up to 0.001'.format(name))


def test_without_cuda_it_skips_saying_why(tmp_path, capsys):
    reason = gpu_micro_batch.cuda_unavailable_reason()
    if reason is None:
        pytest.skip('CUDA is usable here: the check runs instead of skipping')
    out = tmp_path / 'skip.json'
    assert gpu_micro_batch.main(['--out', str(out)]) == 0
    assert capsys.readouterr().out == 'SKIP: {}\n'.format(reason)
    assert json.loads(out.read_text())['skipped'] == reason
    assert gpu_micro_batch.main(['--require-gpu']) == 2


def test_the_pool_cap_is_set_on_device_0_and_lifted_after_a_failure(monkeypatch):
    calls = []

    class Pool:
        def set_limit(self, size):
            calls.append(('set_limit', size))

        def free_all_blocks(self):
            calls.append(('free_all_blocks',))

    @contextlib.contextmanager
    def device(index):
        calls.append(('device', index))
        yield

    fake = types.SimpleNamespace(get_default_memory_pool=lambda: Pool(),
                                 cuda=types.SimpleNamespace(Device=device))
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    pool = gpu_micro_batch.CudaPool()
    with pytest.raises(MemoryError):
        with pool.capped(12345.7):
            calls.append(('inside',))
            raise MemoryError('out of memory')
    assert calls == [('device', 0), ('free_all_blocks',), ('set_limit', 12345), ('inside',),
                     ('set_limit', 0), ('free_all_blocks',)]


@pytest.mark.parametrize('argv,message', [
    (['--batch', '1'], '--batch must be >= 2 (1 given)'),
    (['--updates', '1'], '--updates must be >= 2 (1 given)'),
    (['--fraction', '1'], '--fraction must be between 0 and 1, exclusive (1.0 given)'),
])
def test_gpu_check_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_micro_batch.parse_args(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ bench/micro_batch.py
def _record(n, m, rates, peak, p):
    return {'model': 'cnn', 'n': n, 'micro_batch_size': m, 'pass': p, 'samples_per_s': rates,
            'peak_bytes': peak, 'gradient_bytes': 100}


def test_ratios_are_taken_within_each_pass_against_its_whole_batch():
    records = [
        _record(1, None, [100.0, 120.0, 80.0], 1100, 0),
        _record(1, 8, [50.0, 60.0, 56.0], 300, 0),
        _record(1, None, [200.0, 200.0, 200.0], 1100, 1),
        _record(1, 8, [80.0, 80.0, 90.0], 300, 1),
        _record(2, None, [10.0], 600, 0), _record(2, 128, [10.0], 600, 0),
    ]
    rows = micro_batch.summarize(records, global_batch=256)
    assert [(r['n'], r['micro_batch_size']) for r in rows] == [(1, None), (1, 8), (2, None),
                                                                (2, 128)]
    whole, eight, _, same = rows
    assert whole['speed_ratio'] == {'median': 1.0, 'min': 1.0, 'max': 1.0}
    # pass 0: 56 / 100; pass 1: 80 / 200 (medians of the rounds)
    assert eight['speed_ratio_per_pass'] == pytest.approx([0.56, 0.4])
    assert eight['speed_ratio']['min'] == pytest.approx(0.4)
    assert eight['speed_ratio']['max'] == pytest.approx(0.56)
    assert eight['peak_ratio']['median'] == pytest.approx(300 / 1100)
    assert eight['activation_ratio']['median'] == pytest.approx(200 / 1000)
    assert eight['samples_per_forward'] == 8 and eight['chunks_per_replica'] == 32
    assert eight['samples_per_s']['min'] == 50.0 and len(eight['rounds']) == 6
    assert same['samples_per_forward'] == 128 and same['chunks_per_replica'] == 1
    assert same['peak_ratio']['median'] == 1.0
    result = {'config': {'command': 'c', 'device_kind': 'cpu', 'global_batch': 256,
                         'devices': [1, 2],
                         'passes': 2, 'warmup': 1, 'rounds': 3, 'updates_per_round': 1,
                         'measured_with': 'tracemalloc', 'models': ['cnn']},
              'machine': {'cpu_model': 'x', 'cores_usable': 2, 'platform': 'y'},
              'versions': {'python': '3', 'numpy': '1', 'chainer': '7', 'blas': {}},
              'rows': rows, 'notes': [], 'errors': []}
    assert ('Noise floor: cnn N=2 micro_batch_size=128 runs the very same work as the whole '
            'batch (one chunk per loaded batch), so its speed ratio shows what this run cannot '
            'resolve: 1.00 (1.00-1.00).') in micro_batch.markdown(result, 'nowhere')
    table = micro_batch.table(rows)
    assert '| cnn | 1 | 8 | 8 | 70 (50-90) | 0.48 (0.40-0.56) | 0.0 | 0.27 (0.27-0.27) ' \
           '| 0.20 (0.20-0.20) |' in table


def test_the_grid_is_one_process_per_case_with_the_whole_batch_first():
    args = micro_batch.parse_args(['--sizes', '64,none,8', '--devices', '1,2',
                                   '--models', 'mlp'])
    assert args.sizes == [None, 64, 8]
    groups = micro_batch.build_groups(args, 'cpu', cores=2)
    assert [len(g['cases']) for g in groups] == [1] * 6
    assert [(g['n'], g['cases'][0]['micro_batch_size']) for g in groups] == [
        (1, None), (1, 64), (1, 8), (2, None), (2, 64), (2, 8)]
    assert {g['env']['OPENBLAS_NUM_THREADS'] for g in groups if g['n'] == 2} == {'1'}


def test_a_global_batch_that_does_not_split_is_refused(capsys):
    with pytest.raises(SystemExit):
        micro_batch.parse_args(['--global-batch', '255', '--devices', '1,2'])
    assert '--global-batch 255 must split evenly over every replica count' in \
        capsys.readouterr().err


@pytest.mark.slow  # ~30 s on 2 shared cores: 4 fresh processes that import Chainer
def test_smoke_run_writes_table_plot_and_json(tmp_path):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
    proc = subprocess.run([sys.executable, str(ROOT / 'bench' / 'micro_batch.py'), '--smoke',
                           '--out', str(tmp_path), '--case-timeout', '120'],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / 'micro_batch.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.micro_batch/1' and result['errors'] == []
    assert (tmp_path / 'micro_batch.png').stat().st_size > 1000
    assert (tmp_path / 'micro_batch.md').read_text().startswith('# Micro-batch benchmark')
    assert '| model | replicas | micro_batch_size |' in proc.stdout
    whole, four = result['rows']
    assert (whole['micro_batch_size'], four['micro_batch_size']) == (None, 4)
    for row in result['rows']:
        assert row['passes'] == 2 and len(row['rounds']) == 4
        assert all(v > 0 for v in row['rounds'])
        assert len(row['speed_ratio_per_pass']) == 2
    assert whole['peak_ratio'] == {'median': 1.0, 'min': 1.0, 'max': 1.0}
    # 4 samples per forward instead of 16: the CNN's activations shrink, so the peak does
    assert four['peak_ratio']['max'] < 0.7
    assert four['activation_ratio']['max'] < 0.5
    assert result['machine']['loadavg_start'] is not None

"""``bench/overlap.py`` runs every case and reports what it says (no timing asserts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_overlap_benchmark_reports_every_case(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / 'bench' / 'overlap.py'), '--load-ms', '4',
         '--compute-ms', '4', '--batch', '4', '--rounds', '2', '--block', '1',
         '--trial-updates', '3', '--replicas', '1,2', '--out', str(tmp_path)],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'overlap.json').read_text())
    assert result['schema'] == 'mgpu_updater.bench.overlap/5'
    cases = [(r['kind'], r['replicas']) for r in result['rows']]
    assert cases == [(k, n) for k in ('sleep', 'python', 'multiprocess',
                                            'python-multiprocess', 'host-bound')
                     for n in (1, 2)]
    for row in result['rows']:
        assert all(ms > 0 for ms in row['ms'].values())
        assert len(row['auto_over_max']['ratios']) == 2
        verdicts = ('-',) if row['kind'] == 'host-bound' else ('met', 'not met',
                                                               'not resolved')
        assert row['auto_over_max']['verdict'] in verdicts
        assert len(row['loading_modes']['auto']) == row['replicas']
        assert row['loading_modes']['off'] == ['none'] * row['replicas']
        if (row['kind'], row['replicas']) == ('python', 1):
            assert len(row['best_over_max']['ratios']) == 2
            assert row['ms']['best'] > 0
        else:
            assert row['best_over_max'] is None
    table = (tmp_path / 'overlap.md').read_text()
    assert '| sleep | 2 |' in table
    python_1 = next(line for line in table.splitlines() if line.startswith('| python | 1 |'))
    assert python_1.count('|') == 13 and python_1.rsplit('|', 3)[1].strip() != '-'
    assert str(ROOT) not in (tmp_path / 'overlap.json').read_text()

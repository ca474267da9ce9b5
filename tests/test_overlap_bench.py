"""The overlap benchmark runs and measures what it says (no timing asserts)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'bench'))

import overlap  # noqa: E402


def test_overlap_benchmark_reports_both_runs(tmp_path):
    result = overlap.main(['--load', '0.01', '--compute', '0.01', '--batch', '4',
                           '--updates', '5', '--out', str(tmp_path)])
    assert (tmp_path / 'overlap.json').exists()
    for key in ('step_without_prefetch_s', 'step_with_prefetch_s', 'L_s', 'C_s'):
        assert result[key] > 0
    assert result['max_LC_s'] == max(result['L_s'], result['C_s'])

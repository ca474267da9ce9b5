"""Host memory reuse (``reuse_host_memory``): every replica process keeps what it frees.

glibc's adaptive malloc gives freed memory back to the kernel and takes it again, one page
fault per page, every micro-batch. The probe below is a pattern that shows it: three
4 MiB arrays allocated and freed, again and again. Under glibc's defaults it faults about
a thousand pages every round, whatever it saw before; with the thresholds fixed
(:mod:`mgpu_updater._host_memory`) the second round on faults none. The decision is the
master's; the master applies it at the first update, each worker at its start. Each case
runs in a fresh process, because the change is for the life of the process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


from mgpu_updater import _host_memory
import _models

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

pytestmark = pytest.mark.skipif(not _host_memory.is_glibc(),
                                reason='reuse_host_memory acts on glibc malloc only')

PROBE = textwrap.dedent('''
    import resource
    import numpy

    def probe_faults(rounds=4):
        """Page faults of this thread in the last round of: three 4 MiB arrays, freed."""
        for _ in range(rounds):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            arrays = [numpy.ones(1 << 19) for _ in range(3)]
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
            del arrays
        return faults
''')

# A faulting round touches 3 x 4 MiB = 3072 pages (about 1000 of them trimmed and taken
# again under glibc's defaults); a reusing one none. The bounds leave room for noise.
REUSED = 50
RELEASED = 300


def _run(code: str, env_extra=None, timeout=120) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in _host_memory.USER_VARIABLES and k != 'GLIBC_TUNABLES'}
    env.update(env_extra or {})
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT), str(TESTS), env.get('PYTHONPATH', '')])
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_probe_faults_under_glibc_defaults_and_not_once_reused():
    code = PROBE + textwrap.dedent('''
        import json
        from mgpu_updater import _host_memory
        default = probe_faults()
        applied = _host_memory.reuse_freed_memory(True)
        print(json.dumps({'default': default, 'applied': applied, 'reused': probe_faults()}))
    ''')
    result = _run(code)
    assert result['applied'] is True
    assert result['default'] > RELEASED, result      # the probe means something here
    assert result['reused'] < REUSED, result


TRAIN = PROBE + textwrap.dedent('''
    import json, multiprocessing, sys
    import chainer
    import _models

    class ProbingLoss:
        """The model's loss; reports this process's probe under a key of its own."""
        def __init__(self, model):
            self.model = model

        def __call__(self, x, t):
            where = 'worker' if multiprocessing.parent_process() is not None else 'master'
            chainer.report({f'faults/{where}': float(probe_faults())})
            return self.model(x, t)

    if __name__ == '__main__':
        kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
        model = _models.classifier(seed=0)
        model, updater = _models.two_cpu_replicas(model=model, loss_func=ProbingLoss(model),
                                                  **kwargs)
        before = probe_faults()
        try:
            obs = _models.run_updates(updater, model, 2)[-1]
        finally:
            updater.finalize()
        print(json.dumps({'before': before, 'master': obs['faults/master'],
                          'worker': obs['faults/worker'], 'after': probe_faults()}))
''')


def _train(tmp_path, env_extra=None, **kwargs) -> dict:
    script = tmp_path / 'train_probe.py'
    script.write_text(TRAIN)
    code = (f'import runpy, sys; sys.argv = [{str(script)!r}, {json.dumps(kwargs)!r}]; '
            f'runpy.run_path({str(script)!r}, run_name="__main__")')
    return _run(code, env_extra)


def test_auto_reuses_in_every_replica_from_the_first_update(tmp_path):
    result = _train(tmp_path)
    assert result['before'] > RELEASED, result   # the master as the user left it
    assert result['master'] < REUSED, result
    assert result['worker'] < REUSED, result
    assert result['after'] < REUSED, result      # for the rest of the master's life


def test_false_leaves_malloc_alone(tmp_path):
    result = _train(tmp_path, reuse_host_memory=False)
    assert result['master'] > RELEASED, result
    assert result['worker'] > RELEASED, result


def test_auto_leaves_a_user_configured_malloc_alone_and_true_does_not(tmp_path):
    env = {'MALLOC_ARENA_MAX': '4'}   # configures malloc, but not its thresholds
    result = _train(tmp_path, env)
    assert result['master'] > RELEASED and result['worker'] > RELEASED, result
    result = _train(tmp_path, env, reuse_host_memory=True)
    assert result['master'] < REUSED and result['worker'] < REUSED, result


@pytest.mark.parametrize('name', _host_memory.USER_VARIABLES)
def test_auto_is_off_when_the_environment_configures_malloc(monkeypatch, name):
    for other in _host_memory.USER_VARIABLES + ('GLIBC_TUNABLES',):
        monkeypatch.delenv(other, raising=False)
    assert _host_memory.decide('auto') is True
    monkeypatch.setenv(name, '65536')
    assert _host_memory.user_configured() == (name,)
    assert _host_memory.decide('auto') is False
    assert _host_memory.decide(True) is True
    assert _host_memory.decide(False) is False


def test_glibc_tunables_count_only_for_malloc(monkeypatch):
    for other in _host_memory.USER_VARIABLES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv('GLIBC_TUNABLES', 'glibc.pthread.rseq=0')
    assert _host_memory.decide('auto') is True
    monkeypatch.setenv('GLIBC_TUNABLES', 'glibc.pthread.rseq=0:glibc.malloc.trim_threshold=0')
    assert _host_memory.decide('auto') is False


@pytest.mark.parametrize('value', ['yes', 'AUTO', 1, 0, None, 2.0])
def test_bad_values_are_refused_at_construction(value):
    with pytest.raises(TypeError, match=r"reuse_host_memory must be 'auto', True or False") \
            as e:
        _models.two_cpu_replicas(16, reuse_host_memory=value)
    message = str(e.value)
    assert f'{value!r} of type {type(value).__name__} given' in message
    assert 'False to leave malloc as it is' in message

"""One communicator contract, over every backend (design review R5).

The contract is what mgpu_updater/comm/base.py promises, run by every rank of each backend
through the same rank program (``scripts/comm_contract.py``):

- ``reduce`` onto rank 0 leaves there, bitwise, numpy's sum of every rank's buffer in rank
  order, in the buffer's dtype (float16, float32, float64, int32, int64; an empty buffer
  too); ``bcast`` from rank 0 leaves the root's bytes on every rank; ``allreduce`` (on the
  collective backends) leaves the sum on every rank;
- a backend that checks the issue order raises ``CollectiveOrderError`` naming both ranks
  when the ranks' collectives differ (shared memory, also behind the host-staged wrapper,
  at the verb or at ``end_update``; MPI when the group compares the issued sequences);
- ``finalize()`` twice is fine, and a verb after it raises a RuntimeError saying so.

Backends: ``shm`` (the real shared-memory backend, rank 0 here and N-1 spawned processes,
N = 2 and 3), ``nccl`` and ``staged`` (on the CuPy-14 stand-in, one thread per rank; the
stand-in's NCCL communicators are connected, ``_fakecupy.connect_ranks``, so that their
collectives move data between the ranks, summing in rank order; NCCL sums float16 in
float32), ``mpi`` (``mpiexec -n 2 python -m mpi4py``).
The NCCL backend does not check the issue order itself (the local protocol does, and the
shared-memory tests check that protocol on every update), so it has no order case here.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy
import pytest

import _fakecupy
from mgpu_updater import comm as comms
from mgpu_updater.comm.nccl import NcclCommunicator
from mgpu_updater.comm.shm import ShmCommunicator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / 'scripts'))
import comm_contract as contract  # noqa: E402  (spawned ranks import it the same way)

TIMEOUT = 60.0   # seconds any rank may take; a hang fails the test instead


# ------------------------------------------------------------------ running the ranks
def in_threads(size: int, make: Callable[[int], Any],
               job: Callable[[Any, Callable], Dict]) -> List[Dict]:
    """Run ``job(comm, channel)`` on ``size`` ranks, one thread each; then each rank's
    ``after_finalize``. Returns each rank's report (or traceback)."""
    barrier = threading.Barrier(size, timeout=TIMEOUT)
    comms_made: Dict[int, Any] = {}
    reports: List[Dict] = [{} for _ in range(size)]

    def rank_main(rank: int) -> None:
        def work() -> Dict:
            comm = comms_made[rank] = make(rank)
            try:
                out = job(comm, lambda step: barrier.wait())
            finally:
                barrier.wait()
            out['after_finalize'] = contract.after_finalize(comm)
            return out
        reports[rank] = contract.guarded(work)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f'rank{r}', daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), 'a rank hung'
    return reports


def shm_in_processes(size: int) -> List[Dict]:
    """Rank 0 (the owner of the segments) here, ranks 1..size-1 spawned, as the updater runs
    them; the barrier stands for the control channel."""
    ctx = multiprocessing.get_context('spawn')
    master = ShmCommunicator.create(size, contract.SPEC)
    barrier = ctx.Barrier(size, timeout=TIMEOUT)
    pipes, procs = [], []
    try:
        for rank in range(1, size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=contract.shm_rank,
                               args=(master.handle, rank, barrier, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)

        def job() -> Dict:
            channel = lambda step: barrier.wait()   # noqa: E731
            try:
                out = contract.run(master, channel, allreduce=False)
                out['order'] = contract.order_checks(master, channel)
            finally:
                barrier.wait()
            return out
        reports = [contract.guarded(job)]
        for parent in pipes:
            assert parent.poll(TIMEOUT), 'a spawned rank did not report'
            reports.append(parent.recv())
        for proc in procs:
            proc.join(TIMEOUT)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        after = contract.after_finalize(master)   # the owner: unlinks the segments
    reports[0]['after_finalize'] = after
    return reports


# ------------------------------------------------------------------ the backends
def gpu(device_id: int) -> types.SimpleNamespace:
    """What the communicator factory reads of a Chainer GpuDevice."""
    return types.SimpleNamespace(xp=object(), device=types.SimpleNamespace(id=device_id))


def run_shm(size, monkeypatch):
    return shm_in_processes(size)


def run_nccl(size, monkeypatch):
    fake = _fakecupy.install(monkeypatch)
    _fakecupy.connect_ranks(fake, timeout=TIMEOUT)
    unique_id = NcclCommunicator.new_unique_id()
    return in_threads(size, lambda r: NcclCommunicator(r, size, r, contract.SPEC, unique_id,
                                                       timeout=TIMEOUT),
                      lambda comm, channel: contract.run(comm, lambda step: None,
                                                         allreduce=True))


def run_staged(size, monkeypatch):
    _fakecupy.install(monkeypatch)
    master, handle = comms.create('shm', size, contract.SPEC, gpu(0))
    made = {0: master}

    def make(rank):
        if rank not in made:
            made[rank] = comms.attach('shm', handle, rank, gpu(0))
        return made[rank]

    def job(comm, channel):
        out = contract.run(comm, channel, allreduce=False)
        out['order'] = contract.order_checks(comm, channel)
        return out
    try:
        return in_threads(size, make, job)
    finally:
        master.finalize()


BACKENDS = {
    'shm-2': (run_shm, 2), 'shm-3': (run_shm, 3),
    'nccl-2': (run_nccl, 2), 'nccl-3': (run_nccl, 3),
    'staged-2': (run_staged, 2), 'staged-3': (run_staged, 3),
}
ORDER_CHECKED = ('shm', 'staged')   # the backends that check the issue order themselves
ALLREDUCE = ('nccl', 'mpi')          # allreduce under its ordering contract (see below)
WIDE = ('nccl',)                     # float16 summed in float32, cast back once


@pytest.fixture(scope='module')
def reports():
    """Each backend's reports, run once per module (lazily, per backend)."""
    cache: Dict[str, List[Dict]] = {}

    def get(key: str, monkeypatch) -> List[Dict]:
        if key not in cache:
            runner, size = BACKENDS[key]
            cache[key] = runner(size, monkeypatch)
        return cache[key]
    return get


def checked(reports: List[Dict]) -> List[Dict]:
    for r in reports:
        assert 'traceback' not in r, r['traceback']
    return reports


def assert_contract(reports: List[Dict], backend: str) -> None:
    size = len(reports)
    assert [r['rank'] for r in reports] == list(range(size))
    root = reports[0]
    for name in contract.NAMES:
        want = contract.rank_order_sum(name, size, wide=backend in WIDE)
        got = root['reduce'][name]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, got, want)
        sent = contract.rank_data(name, contract.BCAST_SEED)
        for r in reports:
            assert r['dtypes'][name] == str(numpy.dtype(contract.SPEC[name][0]))
            assert r['bcast'][name].tobytes() == sent.tobytes(), (r['rank'], name)
            if backend in ALLREDUCE:
                assert r['allreduce'][name].tobytes() == want.tobytes(), (r['rank'], name)
    # the sums are not trivially equal in every order: the check above sees the order
    if size == 3:
        name = 'buf/<f2'
        a, b, c = (contract.rank_data(name, r) for r in range(3))
        assert ((a + b) + c).tobytes() != (a + (b + c)).tobytes()


def assert_order_checked(reports: List[Dict]) -> None:
    size = len(reports)
    last = size - 1
    root, worker = reports[0]['order'], reports[last]['order']
    kind, message = root['1 root reduce']
    assert kind == 'CollectiveOrderError'
    assert message.startswith(f'rank 0 and rank {last} issued different collectives in update ')
    assert (f"collective #0 is ('reduce', 'buf/<f4') on rank 0 but ('reduce', 'other/<f4') "
            f'on rank {last}') in message
    assert root['2 root reduce'] is None
    kind, message = root['2 root end_update']
    assert kind == 'CollectiveOrderError'
    assert 'rank 0 issued 1 collective(s) where the other issued 2' in message
    kind, message = worker['3 worker bcast']
    assert kind == 'CollectiveOrderError'
    assert (f"collective #0 is ('bcast', 'buf/<f4') on rank 0 but ('bcast', 'other/<f4') "
            f'on rank {last}') in message
    for r in reports[1:last]:   # the ranks that issued what rank 0 did raise nothing
        assert r['order'] == {'1 worker reduce': None, '3 worker bcast': None}
    assert worker['1 worker reduce'] is None   # a non-root reduce compares nothing


def assert_finalize(reports: List[Dict], backend: str) -> None:
    for r in reports:
        after = r['after_finalize']
        assert after['finalize twice'] is None and after['finalized'] is True
        for verb in ('buffer', 'reduce', 'bcast', 'allreduce'):
            assert after[verb] is not None, f'rank {r["rank"]}: {verb} after finalize() passed'
            kind, message = after[verb]
            assert kind == 'RuntimeError', (verb, kind, message)
            assert f'the {backend if backend != "staged" else "shm"} communicator was finalized' \
                in message, (verb, message)


@pytest.mark.parametrize('key', list(BACKENDS))
def test_reduce_bcast_bitwise(reports, monkeypatch, key):
    assert_contract(checked(reports(key, monkeypatch)), key.split('-')[0])


@pytest.mark.parametrize('key', [k for k in BACKENDS if k.split('-')[0] in ORDER_CHECKED])
def test_collective_order_mismatch_raises(reports, monkeypatch, key):
    assert_order_checked(checked(reports(key, monkeypatch)))


@pytest.mark.parametrize('key', list(BACKENDS))
def test_finalize_twice_then_verbs_raise(reports, monkeypatch, key):
    assert_finalize(checked(reports(key, monkeypatch)), key.split('-')[0])


def test_nccl_refuses_what_it_cannot_sum(monkeypatch):
    """NCCL has no int16 or bool: refused at construction, naming the buffer's type and
    the ones NCCL has (shared memory and MPI sum them)."""
    _fakecupy.install(monkeypatch)
    for dtype in ('int16', 'bool'):
        with pytest.raises(TypeError, match=rf'the nccl communicator cannot sum '
                                            rf'.{numpy.dtype(dtype).str[1:]} \({dtype}\) '
                                            r'buffers; NCCL supports float16, float32'):
            NcclCommunicator(0, 1, 0, {'x': (dtype, 3)}, bytes(128))


def test_shm_refuses_to_reduce_a_broadcast_only_buffer():
    comm = ShmCommunicator.create(2, {'p': ('<f4', 3)}, broadcast=['p'])
    try:
        with pytest.raises(ValueError, match=r"buffer 'p' was created broadcast-only .*cannot "
                                             r'be reduced'):
            comm.reduce('p')
    finally:
        comm.finalize()


# ------------------------------------------------------------------ MPI
_mpi_cache: List[List[Dict]] = []


@pytest.fixture
def mpi_reports(mpiexec, tmp_path_factory):
    """Every rank's report of one ``mpiexec -n 2`` run, launched once per session (the
    ``mpi`` marker skips with the reason where mpi4py or mpiexec is missing)."""
    if not _mpi_cache:
        _mpi_cache.append(_launch_mpi(mpiexec, tmp_path_factory))
    return _mpi_cache[0]


def _launch_mpi(mpiexec: List[str], tmp_path_factory: Any) -> List[Dict]:
    out = tmp_path_factory.mktemp('mpi_contract')
    env = dict(os.environ)   # the mpiexec fixture set what Open MPI needs as root
    env['PYTHONPATH'] = os.pathsep.join([str(HERE.parent), env.get('PYTHONPATH', '')]).rstrip(
        os.pathsep)
    cmd = [*mpiexec, '-n', '2', sys.executable, '-m', 'mpi4py',
           str(HERE / 'scripts' / 'mpi' / 'contract.py'), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(HERE.parent), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f'mpiexec did not end within 90 s (a hang)\n{stdout[-2000:]}\n'
                    f'{stderr[-3000:]}')
    assert proc.returncode == 0, f'exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}'
    reports = []
    for rank in range(2):
        with open(out / f'rank{rank}.pkl', 'rb') as f:
            reports.append(pickle.load(f))
    return checked(reports)


@pytest.mark.mpi
def test_mpi_reduce_bcast_allreduce_bitwise(mpi_reports):
    assert_contract(mpi_reports, 'mpi')


@pytest.mark.mpi
def test_mpi_collective_order_mismatch_raises(mpi_reports):
    issued = [[('bcast', 'buf/<f4')], [('bcast', 'other/<f4')]]
    for r in mpi_reports:
        order = r['order']
        assert [list(map(tuple, s)) for s in order['issued']] == issued
        kind, message = order['compare']
        assert kind == 'CollectiveOrderError'
        assert ("collective #0 is ('bcast', 'buf/<f4') on rank 0 but ('bcast', 'other/<f4') "
                'on rank 1') in message


@pytest.mark.mpi
def test_mpi_finalize_twice_then_verbs_raise(mpi_reports):
    assert_finalize(mpi_reports, 'mpi')

"""The NCCL communicator.

Tests marked ``gpu`` run real NCCL (one rank; two ranks where two GPUs exist) and skip with
the reason when CuPy, a CUDA device or NCCL is missing. The others run anywhere: the lazy
import, the errors that say what to install, and the control flow against the stand-in in
``_fakecupy.py`` (which calls happen, on which stream, in which order; the lifecycle).
"""
from __future__ import annotations

import ast
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import types

import numpy
import pytest

import _fakecupy
from mgpu_updater import _cuda
from mgpu_updater.comm.nccl import NcclCommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UID = bytes(range(128))   # CuPy 14: the unique id is bytes
SPEC = {'grad/<f4': ('float32', 5), 'grad/<f2': ('float16', 3)}
DTYPES = ['float16', 'float32', 'float64', 'int8', 'uint8', 'int32', 'uint32', 'int64',
          'uint64']


# -- without a GPU --------------------------------------------------------------------------

@pytest.mark.parametrize('path', ['mgpu_updater/comm/nccl.py', 'mgpu_updater/_cuda.py'])
def test_no_module_level_cupy_import(path):
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    for node in tree.body:   # statements at module level only
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or '']
        assert not any(n.split('.')[0] in ('cupy', 'cupyx') for n in names), ast.dump(node)


def test_importing_the_module_does_not_import_cupy():
    code = textwrap.dedent('''
        import sys
        import mgpu_updater  # the package (and Chainer, which imports CuPy when installed)
        import chainer
        before = {m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')}
        import mgpu_updater.comm.nccl
        import mgpu_updater._cuda
        after = {m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')}
        assert after == before, sorted(after - before)
    ''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, '-c', code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_without_cupy_construction_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, 'cupy', None)   # makes `import cupy` fail
    with pytest.raises(ImportError, match=r"pip install 'mgpu_updater\[cuda12\]'.*"
                                          r"pip install 'mgpu_updater\[cuda13\]'"):
        NcclCommunicator(0, 1, 0, SPEC, UID)
    with pytest.raises(ImportError, match=r'needs CuPy'):
        NcclCommunicator.new_unique_id()
    assert _cuda.unavailable_reason().startswith('CuPy not installed')


def test_without_nccl_construction_names_the_nccl_package(monkeypatch):
    cupy = types.ModuleType('cupy')
    cuda = types.ModuleType('cupy.cuda')
    nccl = types.ModuleType('cupy.cuda.nccl')
    nccl.available = False   # what CuPy sets when libnccl cannot be loaded
    cupy.__version__ = '14.2.0'
    cupy.cuda, cuda.nccl = cuda, nccl
    for name, module in [('cupy', cupy), ('cupy.cuda', cuda), ('cupy.cuda.nccl', nccl)]:
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(ImportError, match=r'pip install nvidia-nccl-cu12 .* nvidia-nccl-cu13'):
        NcclCommunicator(0, 1, 0, SPEC, UID)


@pytest.mark.parametrize('dtype', ['bool', 'complex64', 'int16', '>f4'])
def test_unsupported_dtype_is_refused_before_cupy_is_needed(monkeypatch, dtype):
    monkeypatch.setitem(sys.modules, 'cupy', None)
    with pytest.raises(TypeError, match=r'cannot sum .* NCCL supports float16, float32'):
        NcclCommunicator(0, 1, 0, {'x': (dtype, 4)}, UID)


@pytest.mark.parametrize('kwargs, match', [
    (dict(rank=2, size=2), r'rank 2 is not in \[0, 2\)'),
    (dict(unique_id=UID[:3]), r"128 bytes that .*new_unique_id.*got 3 bytes \(b'"),
    (dict(spec={'x': ('float32', -1)}), r'negative size'),
])
def test_bad_arguments_are_refused(monkeypatch, kwargs, match):
    monkeypatch.setitem(sys.modules, 'cupy', None)
    args = dict(rank=0, size=1, device_id=0, spec=SPEC, unique_id=UID)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        NcclCommunicator(**args)


@pytest.mark.parametrize('unique_id', [tuple(UID), tuple(b - 128 for b in UID), bytearray(UID),
                                       memoryview(UID), list(UID), None])
def test_a_unique_id_that_is_not_bytes_is_refused(monkeypatch, unique_id):
    # CuPy < 14 made a tuple of ints, which CuPy 14's NcclCommunicator refuses
    monkeypatch.setitem(sys.modules, 'cupy', None)
    with pytest.raises(TypeError, match=rf'unique_id must be the 128 bytes that '
                                        rf'NcclCommunicator.new_unique_id\(\) returned on the '
                                        rf'master, not a {type(unique_id).__name__} '
                                        rf'.*CuPy >= 14 takes bytes only'):
        NcclCommunicator(0, 1, 0, SPEC, unique_id)


def test_cupy_older_than_14_is_refused_naming_the_version(monkeypatch):
    fake = _fakecupy.make()
    fake.__version__ = '13.6.0'
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    with pytest.raises(ImportError, match=r'needs CuPy >= 14, found CuPy 13.6.0 .*'
                                          r"pip install 'mgpu_updater\[cuda12\]'"):
        _cuda.import_nccl()


@pytest.fixture
def fake(monkeypatch):
    return _fakecupy.install(monkeypatch)


def test_nccl_is_created_lazily_on_the_right_device(fake):
    comm = NcclCommunicator(0, 1, 3, SPEC, UID)
    assert fake.comms == [] and not comm.initialized
    assert comm.buffer('grad/<f4').shape == (5,) and comm.buffer('grad/<f4').dtype == 'f4'
    comm.reduce('grad/<f4')
    comm.bcast('grad/<f2')
    [nc] = fake.comms
    assert nc.args == (1, UID, 0) and nc.device == 3
    # the warm-up of every verb comes first (see test_warm_up_connects_every_verb...), then
    # one call per verb, in place, on our stream; bcast moves bytes
    assert [c[0] for c in nc.calls[:3]] == ['allReduce', 'reduce', 'bcast']
    ptr = comm.buffer('grad/<f4').data.ptr
    assert nc.calls[3] == ('reduce', ptr, ptr, 5, 7, 0, 0, comm.stream.ptr)
    ptr = comm.buffer('grad/<f2').data.ptr
    assert nc.calls[4] == ('bcast', ptr, 6, 1, 0, comm.stream.ptr)
    comm.init()   # already done: no second communicator
    assert len(fake.comms) == 1
    comm.finalize()


def test_collectives_are_ordered_with_the_compute_stream_both_ways(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    comm.init()
    compute = fake.cuda.Stream()
    del fake.log[:]
    with compute:
        comm.allreduce('grad/<f4')
    (rec1, s1, ready), (wait1, s2, ev1), nccl, (rec2, s3, done), (wait2, s4, ev2) = fake.log
    assert (rec1, s1) == ('record', compute) and (wait1, s2, ev1) == ('wait', comm.stream, ready)
    assert nccl[0:2] == ('nccl', 'allReduce') and nccl[-1] == comm.stream.ptr
    assert (rec2, s3) == ('record', comm.stream) and (wait2, s4, ev2) == ('wait', compute, done)
    comm.finalize()


@pytest.mark.parametrize('dtype', DTYPES)
def test_every_supported_dtype_maps_to_its_nccl_type(fake, dtype):
    comm = NcclCommunicator(0, 1, 0, {'b': (dtype, 2)}, UID)
    comm.reduce('b')
    # float16 is summed in float32 (test_float16_is_summed_in_float32)
    name = 'float32' if dtype == 'float16' else numpy.dtype(dtype).name
    assert fake.comms[0].calls[-1][4] == getattr(fake.cuda.nccl, 'NCCL_' + name.upper())
    comm.finalize()


def test_empty_buffer_makes_no_call_and_bad_names_or_roots_are_refused(fake):
    comm = NcclCommunicator(0, 2, 0, {'e': ('float32', 0), 'x': ('float32', 1)}, UID)
    comm.reduce('e')
    assert [c[0] for c in fake.comms[0].calls] == ['allReduce', 'reduce', 'bcast']  # warm-up
    with pytest.raises(KeyError, match=r"no buffer named 'y'.*\['e', 'x'\]"):
        comm.reduce('y')
    with pytest.raises(ValueError, match=r'root 2 is not a rank'):
        comm.bcast('x', root=2)
    comm.finalize()


def test_finalize_destroys_once_and_use_after_finalize_raises(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    comm.reduce('grad/<f4')
    comm.finalize()
    comm.finalize()
    assert fake.comms[0].calls[-1] == ('destroy',)
    assert [c for c in fake.comms[0].calls if c[0] in ('destroy', 'abort')] == [('destroy',)]
    for use in (lambda: comm.buffer('grad/<f4'), lambda: comm.reduce('grad/<f4'),
                comm.poll, comm.init):
        with pytest.raises(RuntimeError, match=r'nccl communicator was finalized'):
            use()


def test_finalize_before_init_creates_nothing(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    comm.finalize()
    assert fake.comms == [] and comm.finalized


def test_abort_aborts_and_never_destroys(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    comm.init()
    fake.hang = True   # a collective stuck on a dead peer: abort must not wait for it
    comm.abort()
    comm.abort()
    comm.finalize()
    assert [c for c in fake.comms[0].calls if c[0] in ('destroy', 'abort')] == [('abort',)]
    assert comm.finalized


def test_poll_is_non_blocking_and_reports_async_errors(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    assert comm.poll() is True   # nothing in flight before init
    comm.reduce('grad/<f4')
    fake.hang = True
    assert comm.poll() is False
    fake.comms[0].async_error = 'NCCL_ERROR_REMOTE_ERROR: peer vanished'
    with pytest.raises(RuntimeError, match=r'asynchronous error on rank 0 .*peer vanished'):
        comm.poll()
    comm.abort()


def test_wait_aborts_when_a_peer_dies(fake):
    class PeerDied(Exception):
        pass

    def check_peer_alive():
        raise PeerDied('worker 1 exited with code -9')

    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    comm.reduce('grad/<f4')
    comm.check_peer_alive = check_peer_alive
    fake.hang = True
    with pytest.raises(PeerDied, match='worker 1'):
        comm.wait()
    assert fake.comms[0].calls[-1] == ('abort',)
    assert_abandoned(comm)


def test_a_collective_enqueued_after_a_peer_died_names_the_peer(fake):
    """NCCL returns an asynchronous error it holds (a dead peer's closed sockets) to the
    next collective: the peer's death, seen a moment later, is what is raised (the local
    group turns it into a WorkerError), not the bare NCCL error."""
    class PeerDied(Exception):
        pass

    seen = []

    def check_peer_alive():
        seen.append(1)
        if len(seen) >= 3:   # the death is seen a little after NCCL's error
            raise PeerDied('worker 1 exited with code -9')

    comm = NcclCommunicator(0, 1, 0, SPEC, UID)
    comm.reduce('grad/<f4')
    comm.wait()
    comm.check_peer_alive = check_peer_alive
    fake.comms[0].async_error = 'NCCL_ERROR_REMOTE_ERROR: peer vanished'
    with pytest.raises(PeerDied, match='worker 1'):
        comm.bcast('grad/<f4')
    comm.check_peer_alive = lambda: None   # no peer died: NCCL's own error
    with pytest.raises(RuntimeError, match=r'NCCL bcast .*failed on rank 0.*REMOTE_ERROR'):
        comm.bcast('grad/<f4')
    comm.abort()


def assert_abandoned(comm):
    """NCCL's communicator aborted, the buffers kept, and no collective (a lazy init would
    join the dead world again) until a rebuild or a rejoin."""
    assert not comm.initialized and not comm.finalized
    assert comm.buffer('grad/<f4').shape == (5,)
    with pytest.raises(RuntimeError, match=r'abandoned after a peer failed.*rebuild\(\)'):
        comm.reduce('grad/<f4')
    with pytest.raises(RuntimeError, match=r'abandoned after a peer failed'):
        comm.init()


def test_wait_times_out_and_aborts(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID, timeout=0.2)
    comm.reduce('grad/<f4')
    fake.hang = True
    with pytest.raises(TimeoutError, match=r'did not finish within 0.2 s'):
        comm.wait()
    assert fake.comms[0].calls[-1] == ('abort',)


def test_init_is_bounded_and_a_late_communicator_is_aborted(fake):
    block = fake.cuda.nccl.NcclCommunicator.block = threading.Event()
    comm = NcclCommunicator(0, 2, 0, SPEC, UID, timeout=0.2)
    with pytest.raises(TimeoutError, match=r'NCCL initialisation .* within 0.2 s on rank 0'):
        comm.init()
    assert comm.finalized
    block.set()   # the other rank shows up after all
    for _ in range(2000):   # up to 20 s: the thread may start late on a loaded machine
        if fake.comms and fake.comms[0].calls:
            break
        threading.Event().wait(0.01)
    assert fake.comms[0].calls == [('abort',)]


def test_init_watches_the_peers(fake):
    fake.cuda.nccl.NcclCommunicator.block = threading.Event()
    dead = RuntimeError('worker 1 is gone')

    def check_peer_alive():
        raise dead

    comm = NcclCommunicator(0, 2, 0, SPEC, UID, check_peer_alive=check_peer_alive)
    with pytest.raises(RuntimeError, match='worker 1 is gone'):
        comm.init()
    fake.cuda.nccl.NcclCommunicator.block.set()


def test_finalize_after_a_failure_warns_instead_of_hanging(fake):
    comm = NcclCommunicator(0, 1, 0, SPEC, UID, timeout=0.1)
    comm.reduce('grad/<f4')
    fake.hang = True
    with pytest.warns(RuntimeWarning, match=r'aborted instead of destroyed'):
        comm.finalize()
    assert fake.comms[0].calls[-1] == ('abort',) and comm.finalized


def test_the_unique_id_stays_bytes_from_the_master_to_every_rank(fake):
    from mgpu_updater import comm as comms
    uid = NcclCommunicator.new_unique_id()
    assert type(uid) is bytes and len(uid) == 128
    # the master's communicator and the handle the workers get, through a spawn pickle
    master, handle = comms.create('nccl', 2, SPEC, types.SimpleNamespace(
        device=types.SimpleNamespace(id=0)))
    handle = pickle.loads(pickle.dumps(handle))
    worker = comms.attach('nccl', handle, 1, types.SimpleNamespace(
        device=types.SimpleNamespace(id=1)))
    for comm in (master, worker):
        comm.init()   # the stand-in refuses what CuPy 14 refuses: anything but 128 bytes
        comm.finalize()
    ids = [c.args[1] for c in fake.comms]
    assert all(type(i) is bytes for i in ids) and ids[0] == ids[1] == handle[0]
    assert ids[0] != uid   # a fresh id per communicator group


def test_new_unique_id_refuses_what_the_cupy_14_api_never_returns(fake):
    fake.cuda.nccl.get_unique_id = lambda: tuple(range(128))   # CuPy < 14's type
    with pytest.raises(TypeError, match=r'get_unique_id\(\) returned must be the 128 bytes'):
        NcclCommunicator.new_unique_id()


# -- on a GPU ----------------------------------------------------------------------------

def _one_rank(spec, **kwargs):
    return NcclCommunicator(0, 1, 0, spec, NcclCommunicator.new_unique_id(), timeout=60,
                            **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', DTYPES)
def test_one_rank_reduce_bcast_allreduce_equal_the_cpu_result(nccl_gpu, dtype):
    cupy = nccl_gpu
    n = 1000
    host = (numpy.arange(n) % 97).astype(dtype)
    comm = _one_rank({'b': (dtype, n)})
    try:
        with cupy.cuda.Device(0):
            buf = comm.buffer('b')
            assert isinstance(buf, cupy.ndarray) and buf.device.id == 0
            buf[...] = cupy.asarray(host)   # on the compute stream, before the collective
            comm.reduce('b')                # one rank: the sum is the buffer itself
            numpy.testing.assert_array_equal(buf.get(), host)
            comm.bcast('b')
            comm.allreduce('b')
            buf *= 2                        # ordered after the collective
            comm.wait()
            assert comm.poll() is True
            numpy.testing.assert_array_equal(buf.get(), host * 2)
    finally:
        comm.finalize()


@pytest.mark.gpu
def test_one_rank_large_buffer_ordering(nccl_gpu):
    # 64 MiB: the fill, the collective and the read are long enough to expose missing
    # ordering between the compute stream and the communicator's stream
    cupy = nccl_gpu
    n = 16 * 2 ** 20
    comm = _one_rank({'g': ('float32', n)})
    try:
        with cupy.cuda.Device(0):
            buf = comm.buffer('g')
            for step in range(3):
                buf.fill(step + 1)
                comm.reduce('g')
                comm.bcast('g')
                assert float(buf.sum()) == float(n * (step + 1))
    finally:
        comm.finalize()


@pytest.mark.gpu
def test_gpu_finalize_twice_and_use_after_finalize(nccl_gpu):
    comm = _one_rank({'b': ('float32', 8)})
    comm.init()
    comm.finalize()
    comm.finalize()
    with pytest.raises(RuntimeError, match='finalized'):
        comm.reduce('b')


@pytest.mark.gpu
def test_gpu_abort(nccl_gpu):
    comm = _one_rank({'b': ('float32', 8)})
    comm.reduce('b')
    comm.abort()
    comm.finalize()
    assert comm.finalized
    with pytest.raises(RuntimeError, match='finalized'):
        comm.buffer('b')


def _two_rank_child(rank, uid, queue):
    try:
        comm = NcclCommunicator(rank, 2, rank, {'g': ('float32', 4), 'h': ('float16', 2)},
                                uid, timeout=60)
        import cupy
        with cupy.cuda.Device(rank):
            comm.init()
            comm.buffer('g')[...] = cupy.arange(4, dtype=cupy.float32) + 10 * rank
            comm.buffer('h')[...] = rank + 1
            comm.reduce('g')
            comm.reduce('h')
            g = comm.buffer('g').get()
            if rank == 0:
                comm.buffer('g')[...] = -1
            comm.bcast('g')
            comm.allreduce('h')
            comm.wait()
            queue.put((rank, g.tolist(), comm.buffer('g').get().tolist(),
                       comm.buffer('h').get().tolist()))
        comm.finalize()
    except BaseException as e:
        queue.put((rank, 'error', repr(e)))


@pytest.mark.gpu
def test_two_ranks_on_two_gpus(nccl_gpu):
    if nccl_gpu.cuda.runtime.getDeviceCount() < 2:
        pytest.skip('needs two CUDA devices (NCCL refuses two ranks on one device)')
    ctx = multiprocessing.get_context('spawn')
    queue = ctx.Queue()
    uid = NcclCommunicator.new_unique_id()
    procs = [ctx.Process(target=_two_rank_child, args=(r, uid, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict((r[0], r[1:]) for r in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    for rank in (0, 1):
        assert results[rank][0] != 'error', results[rank]
    assert results[0][0] == [10.0, 12.0, 14.0, 16.0]           # the reduce, on the root
    assert results[0][1] == results[1][1] == [-1.0] * 4         # the bcast from the root
    # 'h': reduce gives 3 on rank 0 only; the allreduce then sums 3 + 2 = 5 everywhere
    assert results[0][2] == results[1][2] == [5.0, 5.0]

"""The CuPy stand-in (``_fakecupy.py``) against the real CuPy 14, where that is installed.

The stand-in is only worth what it models: these tests compare each name it provides with
the real ``cupy`` / ``cupy.cuda.nccl``: that the name exists, the parameter names, order,
defaults and C types (from CuPy's own signatures: ``inspect`` for Python code, the first
line of the docstring Cython embeds for compiled code), the NCCL constants, and what the
real module does without a device: ``nccl.get_unique_id()``'s type and length, and which
unique ids ``NcclCommunicator`` refuses, with which error. Nothing here needs a GPU; each
test skips, saying why, where CuPy >= 14 with NCCL is not importable (the CI step
``make test-cupy14`` installs it). The parser itself is tested everywhere.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest

import _fakecupy

# C types in CuPy's Cython signatures -> the Python type the stand-in annotates
_C_TYPES = {'int': 'int', 'intptr_t': 'int', 'size_t': 'int', 'ptrdiff_t': 'int',
            'bytes': 'bytes', 'bint': 'bool'}

Param = Tuple[str, Optional[str], Optional[str]]   # name, type, default (as text)


def parse_embedded_signature(doc: str) -> Optional[Tuple[List[Param], Optional[str]]]:
    """``'Name(self, int a, bytes b=None) -> int'`` -> ([(a, int, None), (b, bytes, 'None')],
    'int'); None when the first line is not a signature."""
    first = (doc or '').strip().split('\n', 1)[0]
    m = re.match(r'^[\w.]+\((.*)\)\s*(?:->\s*(\w+))?\s*$', first)
    if m is None:
        return None
    params: List[Param] = []
    for part in filter(None, (p.strip() for p in m.group(1).split(','))):
        decl, _, default = part.partition('=')
        words = decl.split()
        name, ctype = words[-1], (words[-2] if len(words) > 1 else None)
        if name == 'self':
            continue
        params.append((name, ctype, default.strip() or None))
    return params, m.group(2)


def real_signature(obj: Any) -> Tuple[List[Param], Optional[str]]:
    """The real object's parameters (without self) and return type, as far as CuPy tells."""
    for doc in (getattr(obj, '__doc__', None),) if inspect.isclass(obj) else ():
        parsed = parse_embedded_signature(doc)   # Cython classes: the class docstring
        if parsed is not None:
            return parsed
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        parsed = parse_embedded_signature(obj.__doc__)
        assert parsed is not None, f'{obj!r} has neither a signature nor a signature line'
        return parsed
    params = [(p.name, None, None if p.default is p.empty else repr(p.default))
              for p in sig.parameters.values() if p.name != 'self']
    return params, None


def fake_signature(obj: Any) -> Tuple[List[Param], Optional[str]]:
    sig = inspect.signature(obj)
    params = [(p.name, p.annotation if p.annotation is not p.empty else None,
               None if p.default is p.empty else repr(p.default))
              for p in sig.parameters.values() if p.name != 'self']
    ret = sig.return_annotation
    return params, (None if ret is sig.empty else ret)


def test_the_signature_parser():
    doc = ('NcclCommunicator.reduce(self, intptr_t sendbuf, size_t count, '
           'NcclConfig config=None) -> int\n\nMore text.')
    assert parse_embedded_signature(doc) == (
        [('sendbuf', 'intptr_t', None), ('count', 'size_t', None),
         ('config', 'NcclConfig', 'None')], 'int')
    assert parse_embedded_signature('getDeviceCount() -> int') == ([], 'int')
    assert parse_embedded_signature('Device(device=None)') == ([('device', None, 'None')], None)
    assert parse_embedded_signature('Initialize self.  See help(type(self)).') is None


@pytest.fixture(scope='module')
def real():
    """``(cupy, cupy.cuda.nccl)`` of CuPy >= 14 with NCCL loadable; else skip saying why."""
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or a CUDA library that fails while loading
        pytest.skip(f'CuPy not importable ({type(e).__name__}: {e}); the stand-in models '
                    f'CuPy {_fakecupy.VERSION}')
    if int(cupy.__version__.split('.')[0]) < 14:
        pytest.skip(f'CuPy {cupy.__version__} installed; the stand-in models CuPy 14')
    if not getattr(nccl, 'available', False):
        pytest.skip('cupy.cuda.nccl cannot load the NCCL library (pip install nvidia-nccl-cu13)')
    return cupy, nccl


@pytest.fixture
def fake():
    return _fakecupy.make()


def _pairs(fake, real) -> Dict[str, Tuple[Any, Any]]:
    """Every callable the stand-in provides -> (stand-in, real)."""
    cupy, nccl = real
    fake_ptr = fake.zeros(1).data
    return {
        'cupy.zeros': (fake.zeros, cupy.zeros),
        'cupy.empty': (fake.empty, cupy.empty),
        'cupy.ndarray.get': (fake.FakeArray.get, cupy.ndarray.get),
        'cupy.ndarray.set': (fake.FakeArray.set, cupy.ndarray.set),
        'cupy.ndarray.copy': (fake.FakeArray.copy, cupy.ndarray.copy),
        'cupy.ndarray.fill': (fake.FakeArray.fill, cupy.ndarray.fill),
        'cupy.cuda.Event.synchronize': (fake.cuda.Event.synchronize,
                                        cupy.cuda.Event.synchronize),
        'cupy.cuda.nccl.NcclError': (fake.cuda.nccl.NcclError, nccl.NcclError),
        'cupy.cuda.Device': (fake.cuda.Device, cupy.cuda.Device),
        'cupy.cuda.Device.use': (fake.cuda.Device.use, cupy.cuda.Device.use),
        'cupy.cuda.Stream': (fake.cuda.Stream, cupy.cuda.Stream),
        'cupy.cuda.Stream.wait_event': (fake.cuda.Stream.wait_event,
                                        cupy.cuda.Stream.wait_event),
        'cupy.cuda.Event': (fake.cuda.Event, cupy.cuda.Event),
        'cupy.cuda.Event.record': (fake.cuda.Event.record, cupy.cuda.Event.record),
        'cupy.cuda.get_current_stream': (fake.cuda.get_current_stream,
                                         cupy.cuda.get_current_stream),
        'cupy.cuda.alloc_pinned_memory': (fake.cuda.alloc_pinned_memory,
                                          cupy.cuda.alloc_pinned_memory),
        'cupy.cuda.runtime.getDeviceCount': (fake.cuda.runtime.getDeviceCount,
                                             cupy.cuda.runtime.getDeviceCount),
        'cupy.cuda.MemoryPointer.copy_from_host_async': (
            fake_ptr.copy_from_host_async, cupy.cuda.MemoryPointer.copy_from_host_async),
        'cupy.cuda.nccl.get_unique_id': (fake.cuda.nccl.get_unique_id, nccl.get_unique_id),
        'cupy.cuda.nccl.NcclCommunicator': (fake.cuda.nccl.NcclCommunicator,
                                            nccl.NcclCommunicator),
        **{f'cupy.cuda.nccl.NcclCommunicator.{m}': (
            getattr(fake.cuda.nccl.NcclCommunicator, m), getattr(nccl.NcclCommunicator, m))
           for m in ('reduce', 'bcast', 'allReduce', 'check_async_error', 'abort', 'destroy')},
    }


def test_every_callable_has_the_real_parameters_and_types(fake, real):
    differences = []
    for name, (ours, theirs) in _pairs(fake, real).items():
        (fparams, fret), (rparams, rret) = fake_signature(ours), real_signature(theirs)
        if [p[0] for p in fparams] != [p[0] for p in rparams]:
            differences.append(f'{name}: parameters {[p[0] for p in fparams]}, '
                               f'CuPy has {[p[0] for p in rparams]}')
            continue
        for (pname, ftype, fdef), (_, ctype, rdef) in zip(fparams, rparams):
            if ctype in _C_TYPES and ftype != _C_TYPES[ctype]:
                differences.append(f'{name}({pname}): annotated {ftype}, CuPy takes {ctype}')
            if (fdef is None) != (rdef is None):
                differences.append(f'{name}({pname}): default {fdef}, CuPy has {rdef}')
        if rret in _C_TYPES and fret != _C_TYPES[rret]:
            differences.append(f'{name}: returns {fret}, CuPy returns {rret}')
    assert not differences, '\n'.join(differences)


def test_the_nccl_constants_have_the_real_values(fake, real):
    _, nccl = real
    ours = {k: v for k, v in vars(fake.cuda.nccl).items() if k.startswith('NCCL_')}
    assert ours and ours == {k: getattr(nccl, k) for k in ours}


def test_events_expose_done_as_a_property_like_cupy(fake, real):
    cupy, _ = real
    assert inspect.isdatadescriptor(cupy.cuda.Event.done)
    assert inspect.isdatadescriptor(fake.cuda.Event.done)


def test_arrays_expose_their_device_as_a_property_like_cupy(fake, real):
    cupy, _ = real
    assert inspect.isdatadescriptor(cupy.ndarray.device)
    assert inspect.isdatadescriptor(fake.FakeArray.device)
    with fake.cuda.Device(1):
        assert fake.zeros(2).device.id == 1   # made on the current device


@pytest.mark.parametrize('status', [5, 6])   # NCCL's duplicate GPU; a peer that died
def test_nccl_errors_read_as_cupys(fake, real, status):
    _, nccl = real
    assert str(fake.cuda.nccl.NcclError(status)) == str(nccl.NcclError(status))
    assert issubclass(nccl.NcclError, RuntimeError)
    assert issubclass(fake.cuda.nccl.NcclError, RuntimeError)


def test_get_unique_id_returns_what_cupy_returns(fake, real):
    _, nccl = real
    theirs, ours = nccl.get_unique_id(), fake.cuda.nccl.get_unique_id()
    assert type(ours) is type(theirs) is bytes
    assert len(ours) == len(theirs) == _fakecupy.UNIQUE_ID_BYTES


def _outcome(make, comm_id) -> str:
    try:
        comm = make(1, comm_id, 0)
    except (TypeError, ValueError) as e:   # argument checks, before any device is touched
        return f'{type(e).__name__}: {e}'
    except Exception:   # past the argument checks: NCCL itself, which needs a GPU
        return 'accepted'
    comm.destroy()
    return 'accepted'


@pytest.mark.parametrize('comm_id', [
    bytes(128), tuple(range(128)), bytearray(128), memoryview(bytes(128)), bytes(127),
    b'', None, list(range(128)), 'x' * 128], ids=lambda v: type(v).__name__ + str(len(v))
    if v is not None else 'None')
def test_nccl_communicator_accepts_and_refuses_the_ids_cupy_does(fake, real, comm_id):
    _, nccl = real
    real_id = comm_id
    if type(comm_id) is bytes and len(comm_id) == _fakecupy.UNIQUE_ID_BYTES:
        real_id = nccl.get_unique_id()   # a GPU's NCCL would try to reach bytes(128)
    # the real one fails past the argument checks without a GPU; with one, one rank of one
    # initialises
    theirs = _outcome(nccl.NcclCommunicator, real_id)
    ours = _outcome(fake.cuda.nccl.NcclCommunicator, comm_id)
    assert ours == theirs

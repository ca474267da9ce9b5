"""The master's messages as bytes (``protocol.Encoder``, ``protocol.Decoder``; issue 15).

The master keeps the bytes of the message it sent last and sends them again while the
message pickles the same; the worker unpickles only bytes it has not just seen. With the
caches cold after a window, pickling a Step cost the master 40-150 us of every update and
unpickling it the worker 35-65 us, both before the worker's window starts. The contract:
the worker always gets exactly the message the master sent (the types too), so a cached
message is reused only where a fresh pickle would unpickle as the same values.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from mgpu_updater._local.protocol import (Decoder, Encoder, Stop, StateRequest, Step,
                                          same_pickle)


def _roundtrip(messages):
    encoder, decoder = Encoder(), Decoder()
    out = []
    for msg in messages:
        data = encoder.encode(msg)
        out.append((data, decoder.decode(data)))
    return out


def test_an_unchanged_step_reuses_its_bytes_and_the_worker_its_message():
    a, b = Step(None, {'bn/N': 3}, None), Step(None, {'bn/N': 3}, None)
    (data_a, got_a), (data_b, got_b) = _roundtrip([a, b])
    assert data_b is data_a and got_b is got_a       # neither pickled nor unpickled again
    assert got_a == a and type(got_a) is Step


@pytest.mark.parametrize('first, second', [
    (Step(1.0, {}, None), Step(2.0, {}, None)),              # another loss scale
    (Step(None, {'N': 1}, None), Step(None, {'N': 1.0}, None)),   # int and float: equal ...
    (Step(None, {'N': True}, None), Step(None, {'N': 1}, None)),  # bool and int
    (Step(0.0, {}, None), Step(-0.0, {}, None)),             # zeros of either sign
    (Step(float('nan'), {}, None), Step(float('nan'), {}, None)),   # NaN is never equal
    (Step(None, {'a': 1, 'b': 2}, None), Step(None, {'b': 2, 'a': 1}, None)),  # key order
    (Step(None, {}, 0), Step(None, {}, 1)),                  # another parity
    (Step(None, {'N': np.float32(1)}, None), Step(None, {'N': np.float32(1)}, None)),
    (Stop(), StateRequest()),
])
def test_a_message_that_would_pickle_otherwise_is_pickled_afresh(first, second):
    """... and the worker gets it with its own types and values (``'N': 1.0`` stays a
    float, ``-0.0`` keeps its sign, a numpy scalar is never taken as cached)."""
    (_, _), (data, got) = _roundtrip([first, second])
    assert data == pickle.dumps(second, protocol=pickle.HIGHEST_PROTOCOL)
    assert type(got) is type(second)
    assert repr(got) == repr(second)
    for field, sent in zip(got, second):
        if isinstance(sent, dict):
            assert list(sent) == list(field)
            assert [type(v) for v in sent.values()] == [type(v) for v in field.values()]


def test_same_pickle_compares_types_all_the_way_down():
    assert same_pickle((1, {'a': (2.5, None, b'x')}), (1, {'a': (2.5, None, b'x')}))
    assert not same_pickle((1, {'a': (2.5,)}), (1, {'a': [2.5]}))
    assert not same_pickle(np.zeros(2), np.zeros(2))   # arrays: never cached
    assert not same_pickle({'a': 1}, {'a': 1, 'b': 2})


def test_the_worker_decodes_what_the_master_encodes_through_a_real_pipe():
    import multiprocessing
    a, b = multiprocessing.Pipe()
    encoder, decoder = Encoder(), Decoder()
    sent = [Step(None, {'N': 4}, None), Step(None, {'N': 4}, None), Step(None, {'N': 5}, 1),
            Stop()]
    try:
        for msg in sent:
            a.send_bytes(encoder.encode(msg))
        got = [decoder.decode(b.recv_bytes()) for _ in sent]
    finally:
        a.close()
        b.close()
    assert got == sent and [type(m) for m in got] == [type(m) for m in sent]

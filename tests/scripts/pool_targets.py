"""A trivial worker for tests/test_pool.py: it speaks the pool's start-up and message
protocol and nothing else (no Chainer, no model), so a pool starts in a fraction of a second.

The payload (bytes) names the behaviour; the messages are plain tuples whose first item is
the kind, as the pool reads them (``msg[0]``).
"""
import os
import pickle
import signal
import subprocess
import sys
import time


class _Messages(pickle.Unpickler):
    """Unpickles the pool's own messages (``Stop()``...) as plain tuples, so that this
    worker never imports mgpu_updater (and Chainer with it: seconds per worker)."""

    def find_class(self, module, name):
        if module == 'mgpu_updater._local.protocol':
            kind = name.lower()

            class Message(tuple):
                def __new__(cls, *fields):
                    return tuple.__new__(cls, (kind,) + fields)
            return Message
        return super().find_class(module, name)


def _recv(conn):
    import io
    return _Messages(io.BytesIO(conn.recv_bytes())).load()


def target(conn, master_pid, shm_names, default_start_method, stack_file=None,
           output=None):
    """The worker's entry point, as ``WorkerPool.start`` calls it."""
    assert 'mgpu_updater' not in sys.modules, 'the trivial worker imported the package'
    os.setpgid(0, 0)   # lead a process group, as mgpu_updater's worker does
    behaviour = os.environ.get('POOL_TARGET_BEFORE_HELLO')
    if behaviour == 'exit':
        os._exit(5)    # dies "while importing the main module"
    conn.send(('hello',))
    behaviour = conn.recv_bytes().decode()
    if behaviour == 'no_ready':
        time.sleep(60)
        return
    if behaviour == 'stubborn':   # ignores Stop and SIGTERM: only SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(('ready', os.getpid()))
    while True:
        msg = _recv(conn)
        if msg[0] == 'stop' and behaviour != 'stubborn':
            return
        if msg[0] == 'rewind' and behaviour == 'echo':   # max_worker_restarts' question
            conn.send(('rewound',))
            continue
        if behaviour == 'echo':
            conn.send(('done', msg[1]))
        elif behaviour == 'exit':
            os._exit(3)
        elif behaviour == 'fail':
            conn.send(('error', 'Traceback (most recent call last):\n  planted\n'))
        elif behaviour == 'done_then_fail':   # a worker that fails right after its Done
            conn.send(('done', msg[1]))
            time.sleep(0.2)
            conn.send(('error', 'Traceback (most recent call last):\n  planted\n'))
        elif behaviour == 'grandchild':
            child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
            conn.send(('done', child.pid))
        # 'silent' and 'stubborn': read, never answer

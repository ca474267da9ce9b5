"""A worker whose master died unlinks the master's segments once, however many paths ask.

Two threads of a worker notice the master's death (the watch thread and the main loop's
exit) and both clean up; the second cleanup must not unregister the names from the
resource tracker again, which then prints a KeyError traceback for each name.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import os, threading
    from multiprocessing import shared_memory
    from mgpu_updater.comm.shm import unlink_quietly
    seg = shared_memory.SharedMemory(create=True, size=64)   # registered with the tracker
    name = seg.name
    seg.close()
    threads = [threading.Thread(target=unlink_quietly, args=(name,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    unlink_quietly(name)
    print('GONE', not os.path.exists('/dev/shm/' + name.lstrip('/')))
''')


def test_unlinking_a_segment_twice_does_not_upset_the_resource_tracker():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert 'GONE True' in proc.stdout
    assert 'resource_tracker' not in proc.stderr and 'KeyError' not in proc.stderr, proc.stderr

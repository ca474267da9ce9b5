"""README's usage snippet runs as written (with random arrays standing in for _data())."""
import json
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / 'README.md'


def _data():
    rng = np.random.RandomState(0)
    x = rng.rand(1000, 20).astype(np.float32)
    return x, (x[:, 0] * 10).astype(np.int32)


def test_readme_snippet_runs(tmp_path, monkeypatch):
    text = README.read_text()
    code = re.search(r'## Use\n\n```python\n(.*?)```', text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace = {'_data': _data, '__name__': 'readme_snippet'}
    exec(compile(code, str(README), 'exec'), namespace)
    log = json.loads((tmp_path / 'result' / 'log').read_text())
    assert [e['epoch'] for e in log] == [1, 2]
    assert all(np.isfinite(e['validation/main/accuracy']) for e in log)
    assert namespace['updater'].worker_pids() == []   # finalized by trainer.run()

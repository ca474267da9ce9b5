"""README.md as a user reads it: the example runs as a script, and the argument list is the
updater's signature.

The example is README's first Python block. It is written to a file and run as
``__main__`` in a fresh interpreter, as a user runs it: workers are started with spawn
and import that file again, so this also checks that the block has its main guard and
needs no name it does not define.
"""
import ast
import inspect
import json
import pathlib
import re
import subprocess
import sys

import numpy as np

from mgpu_updater import ParallelAccumulatingUpdater

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'


def _section(text, heading):
    """The text of the README section ``## <heading>``, up to the next ``## ``."""
    match = re.search(rf'^## {re.escape(heading)}\n(.*?)(?=^## |\Z)', text, re.S | re.M)
    assert match, f'README.md has no "## {heading}" section'
    return match.group(1)


def _first_python_block(text):
    match = re.search(r'^```python\n(.*?)^```', text, re.S | re.M)
    assert match, 'README.md has no ```python block'
    return match.group(1)


def test_the_first_python_block_is_a_complete_script_with_a_main_guard():
    code = _first_python_block(README.read_text())
    tree = ast.parse(code)
    guards = [node for node in tree.body if isinstance(node, ast.If)
              and ast.unparse(node.test) in ("__name__ == '__main__'",
                                             '__name__ == "__main__"')]
    assert guards, "README's example has no `if __name__ == '__main__':` guard"


def test_the_first_python_block_runs_as_main(tmp_path):
    script = tmp_path / 'train.py'
    script.write_text(_first_python_block(README.read_text()))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = json.loads((tmp_path / 'result' / 'log').read_text())
    epochs = [entry['epoch'] for entry in log]
    assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) >= 2, epochs
    assert all(np.isfinite(entry['validation/main/accuracy']) for entry in log)
    assert 'validation/main/accuracy' in proc.stdout     # PrintReport's header
    # The toy task is learnt: the example shows training that works.
    assert log[-1]['validation/main/accuracy'] > 0.8, log[-1]
    assert log[-1]['main/loss'] < log[0]['main/loss'], log


# One line per argument: "- `name` (type, default `value`): what it does." or
# "- `name` (type, required): ...".
ARGUMENT_LINE = re.compile(r'^- `(?P<name>\w+)` \((?P<type>[^)]*?)'
                           r'(?:, default `(?P<default>[^`]*)`|, required)\): (?P<clause>.+)$')


def _readme_arguments():
    lines = [line for line in _section(README.read_text(), 'Arguments').splitlines()
             if line.startswith('- ')]
    parsed = [ARGUMENT_LINE.match(line) for line in lines]
    bad = [line for line, match in zip(lines, parsed) if match is None]
    assert not bad, ('README arguments not in the form "- `name` (type, default `value`): '
                     f'clause." or "- `name` (type, required): clause.": {bad}')
    return parsed


def _signature_parameters():
    params = inspect.signature(ParallelAccumulatingUpdater.__init__).parameters
    return {name: p for name, p in params.items() if name != 'self'}


def test_the_readme_lists_exactly_the_updaters_arguments_in_their_order():
    """Adding, removing or renaming an argument of ParallelAccumulatingUpdater fails here
    until README's "## Arguments" lists it, one line each, in the signature's order."""
    readme = [m.group('name') for m in _readme_arguments()]
    signature = list(_signature_parameters())
    missing = [name for name in signature if name not in readme]
    extra = [name for name in readme if name not in signature]
    assert not missing and not extra, (
        f'README "## Arguments" is out of date: add {missing}, remove {extra}')
    assert readme == signature, 'README lists the arguments in another order than the signature'


def _states_default(text, default):
    """Whether README's ``text`` is ``default``: the repr of a literal, or the name under
    which the default's module holds it (Chainer's ``concat_examples``, a converter object
    around a function of another name)."""
    if isinstance(default, (type(None), bool, int, float, str)):
        return text == repr(default)
    module = inspect.getmodule(getattr(default, 'base_callable', default))
    return getattr(module, text, None) is default


def test_the_readme_states_each_arguments_default_as_the_signature_has_it():
    params = _signature_parameters()
    for match in _readme_arguments():
        param = params[match.group('name')]
        if param.default is inspect.Parameter.empty:
            assert match.group('default') is None, (
                f'{param.name} has no default, but README says `{match.group("default")}`')
        else:
            assert _states_default(match.group('default'), param.default), (
                f'README gives {param.name} the default `{match.group("default")}`; '
                f'the signature has {param.default!r}')


def test_each_readme_argument_is_one_short_line():
    for match in _readme_arguments():
        assert len(match.group(0)) <= 130, f'one line, one clause: {match.group(0)}'
        assert match.group('clause').endswith('.'), match.group(0)


def test_the_readme_stays_a_short_page():
    assert len(README.read_bytes()) <= 16 * 1024, 'README.md is over 16 KB: move detail to docs/'

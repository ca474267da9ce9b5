"""Sphinx configuration: `make docs` builds the HTML into docs/_build/html.

The build is offline and strict (`-W -n`: every warning an error, every reference
resolved). The Markdown pages are MyST; the API reference is autodoc on the docstrings
(Google style, napoleon); Chainer's and CuPy's names resolve through the inventories in
docs/_inventories, generated from the installed packages (see generate.py there).
"""
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # the checkout, when the package is not installed

import mgpu_updater  # noqa: E402

project = 'mgpu_updater'
author = 'the mgpu_updater authors'
copyright = 'the mgpu_updater authors (MIT License)'
release = version = mgpu_updater.__version__

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.intersphinx',
]
source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
root_doc = 'index'
exclude_patterns = ['_build', '_inventories', 'Thumbs.db', '.DS_Store']

# MyST: headings get anchors for links like [text](semantics.md#one-update); `{role}`
# syntax for Sphinx roles in Markdown.
myst_heading_anchors = 3
myst_enable_extensions = ['colon_fence']

# autodoc: the docstrings say the types in words; the signatures show the defaults.
autodoc_typehints = 'none'
autodoc_member_order = 'bysource'
autodoc_class_signature = 'mixed'
autodoc_preserve_defaults = True   # `converter=convert.concat_examples`, as written
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# No network: the inventories are files in the repository.
intersphinx_mapping = {
    'chainer': ('https://docs.chainer.org/en/stable/',
                str(HERE / '_inventories' / 'chainer-objects.inv')),
    'cupy': ('https://docs.cupy.dev/en/stable/', str(HERE / '_inventories' / 'cupy-objects.inv')),
}
intersphinx_timeout = 1

# The updater's docstring names internal modules, which the reference leaves out (the
# design notes describe them).
nitpick_ignore = [
    ('py:mod', 'mgpu_updater._load_trial'),   # internal: described in design.md
    ('py:mod', 'mgpu_updater._gil_handoff'),   # internal: described in design.md
]

# A Markdown link from a page here to a file of the repository outside docs/ (results, a
# test) stays a link on GitHub; in the HTML it becomes a download of that file, since only
# docs/ is part of the site.
REPO_LINK = re.compile(r'\[([^\]\n]+)\]\((\.\./[^)\s#]+)\)')


def _repository_links_as_downloads(app, docname, source):
    def download(match):
        text, target = match.group(1).replace('`', ''), match.group(2)
        if not (HERE / pathlib.Path(docname).parent / target).resolve().is_file():
            return match.group(0)    # not a file: leave it for MyST to report
        return f'{{download}}`{text} <{target}>`'
    source[0] = REPO_LINK.sub(download, source[0])


def setup(app):
    app.connect('source-read', _repository_links_as_downloads)


html_theme = 'alabaster'
html_title = f'mgpu_updater {release}'
html_theme_options = {
    'description': 'Data-parallel updater with gradient accumulation for Chainer 7.8.1',
    'fixed_sidebar': True,
}

"""What the documentation promises, checked against the repository: the links and paths it
names exist, the results folder stays an index of current runs, the tutorial shows the
README's example, the package metadata and changelog agree with the code, and the words
describe the project's hardware and software only.

The Sphinx build itself (`make docs`, warnings as errors) is a CI step.
"""
import importlib.metadata
import pathlib
import re
import tomllib

import mgpu_updater

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
DOCS = ROOT / 'docs'
RESULTS = ROOT / 'bench' / 'results'


def doc_pages():
    return sorted(p for p in DOCS.glob('*.md'))


def first_python_block(text):
    return re.search(r'^```python\n(.*?)^```', text, re.S | re.M).group(1)


def test_the_tutorial_walks_through_the_readme_example():
    assert first_python_block((DOCS / 'tutorial.md').read_text()) == \
        first_python_block(README.read_text())


def test_every_doc_page_is_in_a_toctree():
    index = (DOCS / 'index.md').read_text()
    listed = set(re.findall(r'^([\w-]+)$', index, re.M))
    pages = {p.stem for p in doc_pages()} - {'index'}
    assert pages <= listed, f'pages not in docs/index.md: {sorted(pages - listed)}'


LINK = re.compile(r'\]\(([^)\s]+)\)')


def local_links(path):
    for target in LINK.findall(path.read_text()):
        if re.match(r'[a-z]+:', target) or target.startswith('#'):
            continue
        yield target.split('#')[0]


def test_readme_links_lead_to_files_in_the_repository():
    missing = [t for t in local_links(README) if not (ROOT / t).exists()]
    assert not missing, f'README.md links to missing files: {missing}'


def test_results_index_links_lead_to_files():
    index = RESULTS / 'README.md'
    missing = [t for t in local_links(index) if not (index.parent / t).resolve().exists()]
    assert not missing, f'bench/results/README.md links to missing files: {missing}'


# A path under bench/results in the prose: up to a space, a quote, a backtick, a bracket.
RESULTS_PATH = re.compile(r'bench/results/[\w./-]*[\w/]')


def test_paths_under_bench_results_named_by_the_docs_exist():
    """README, docs, the results index, the Makefile and the tests name no removed run
    (placeholders such as ``<date>-h200`` aside)."""
    sources = [README, RESULTS / 'README.md', ROOT / 'Makefile', *doc_pages(),
               *sorted((ROOT / 'tests').glob('*.py'))]
    missing = []
    for path in sources:
        for match in RESULTS_PATH.finditer(path.read_text()):
            name = match.group(0)
            follows = path.read_text()[match.end():match.end() + 1]
            if follows in '<$' and follows:
                continue   # a placeholder: bench/results/gpu/<date>-h200, $(...)
            if not (ROOT / name).exists():
                missing.append(f'{path.relative_to(ROOT)}: {name}')
    assert not missing, 'paths that do not exist:\n' + '\n'.join(missing)


def test_bench_results_is_an_index_of_at_most_20_entries():
    entries = sorted(p.name for p in RESULTS.iterdir())
    assert len(entries) <= 20, f'{len(entries)} entries at bench/results/: {entries}'
    index = (RESULTS / 'README.md').read_text()
    unlisted = [name for name in entries if name != 'README.md' and f'`{name}/' not in index]
    assert not unlisted, f'bench/results/README.md does not list {unlisted}'


# How the project was built is not the project's business: machines are described by their
# hardware and software.
FORBIDDEN = re.compile(r'\blent\b|workplace|device tool|\bsessions?\b|sandbox'
                       r'|(?<![.\w])run\(', re.I)


def test_docs_and_results_describe_machines_by_hardware_and_software_only():
    sources = [README, ROOT / 'CHANGELOG.md', *doc_pages(),
               *(p for p in RESULTS.rglob('*') if p.is_file()
                 and p.suffix in ('.md', '.json', '.log', '.txt', '.xml'))]
    found = []
    for path in sources:
        for number, line in enumerate(path.read_text(errors='replace').splitlines(), 1):
            if FORBIDDEN.search(line):
                found.append(f'{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}')
    assert not found, '\n'.join(found)


def test_the_version_is_defined_once_and_the_changelog_names_it():
    assert importlib.metadata.version('mgpu_updater') == mgpu_updater.__version__
    pyproject = tomllib.loads((ROOT / 'pyproject.toml').read_text())
    assert 'version' not in pyproject['project'], 'a second version in pyproject.toml'
    assert 'version' in pyproject['project']['dynamic']
    assert pyproject['tool']['setuptools']['dynamic']['version'] == {
        'attr': 'mgpu_updater.__version__'}
    first = re.search(r'^## (\S+)', (ROOT / 'CHANGELOG.md').read_text(), re.M).group(1)
    assert first == mgpu_updater.__version__, (first, mgpu_updater.__version__)


def test_the_package_metadata_names_its_license_and_readme():
    meta = importlib.metadata.metadata('mgpu_updater')
    assert meta['License-Expression'] == 'MIT'
    assert 'MIT License' in (ROOT / 'LICENSE').read_text().splitlines()[0]
    assert meta['Description-Content-Type'] == 'text/markdown'
    assert meta.get_all('Keywords') and meta.get_all('Classifier')

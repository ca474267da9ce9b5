"""Write Sphinx inventories (objects.inv) for Chainer and CuPy from the installed packages.

The docs build offline (``make docs`` on machines without internet), so intersphinx reads
the inventories committed here instead of fetching the published ones. These are generated:
every public class, function, exception and module of the modules listed below, with the
URIs of the published documentation's layout (``reference/generated/<name>.html#<name>``
on docs.chainer.org and docs.cupy.dev), the methods of each class as anchors on its page,
and each object's defining path (``obj.__module__ + '.' + obj.__qualname__``, what autodoc
writes for a base class) as an alias of the documented name. An object that the published
docs do not document still gets an entry; its link would then lead to a missing page.

Regenerate (Chainer 7.8.1; CuPy with NCCL installed, no GPU needed):

    python docs/_inventories/generate.py chainer docs/_inventories/chainer-objects.inv
    python docs/_inventories/generate.py cupy docs/_inventories/cupy-objects.inv
"""
import importlib
import inspect
import sys
import zlib

# Where each package documents its objects, in priority order: an object exported by
# several modules is documented under the first one listed that exports it.
MODULES = {
    'chainer': [
        'chainer.training.updaters', 'chainer.training.extensions',
        'chainer.training.triggers', 'chainer.training', 'chainer.links',
        'chainer.functions', 'chainer.optimizers', 'chainer.optimizer_hooks',
        'chainer.iterators', 'chainer.datasets', 'chainer.dataset', 'chainer.serializers',
        'chainer.initializers', 'chainer.backends.cuda', 'chainer.backend',
        'chainer.reporter', 'chainer.cuda', 'chainer',
    ],
    'cupy': ['cupy.cuda.nccl', 'cupy.cuda', 'cupy.cuda.memory', 'cupy.cuda.runtime',
             'cupy.random', 'cupy'],
}
PAGE = 'reference/generated/{}.html'


def _role(obj):
    if inspect.isclass(obj):
        return 'exception' if issubclass(obj, BaseException) else 'class'
    if inspect.isroutine(obj) or callable(obj):
        return 'function'
    return None


def entries(package):
    """(name, role, uri) for the public objects of ``package``'s documented modules."""
    documented = {}   # id(obj) -> documented name
    rows = {}
    for modname in MODULES[package]:
        try:
            module = importlib.import_module(modname)
        except ImportError as exc:   # e.g. chainer.cuda without CuPy: skip, say so
            print(f'skipping {modname}: {exc}', file=sys.stderr)
            continue
        rows.setdefault(modname, ('module', f'{PAGE.format(modname)}#module-{modname}'))
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith('_') or inspect.ismodule(obj):
                continue
            role = _role(obj)
            if role is None:
                continue
            owner = getattr(obj, '__module__', None) or ''
            if not owner.split('.')[0] in (package, f'{package}_backends'):
                continue   # re-exported from numpy, six, ...
            name = documented.setdefault(id(obj), f'{modname}.{attr}')
            uri = f'{PAGE.format(name)}#{name}'
            for alias in {f'{modname}.{attr}', f'{owner}.{getattr(obj, "__qualname__", attr)}'}:
                rows.setdefault(alias, (role, uri))
            if inspect.isclass(obj):
                for member, value in sorted(vars(obj).items()):
                    if member.startswith('_') and member != '__call__':
                        continue
                    if isinstance(value, property):
                        mrole = 'attribute'
                    elif inspect.isroutine(value) or isinstance(value, (staticmethod,
                                                                        classmethod)):
                        mrole = 'method'
                    else:
                        continue
                    for alias in {f'{modname}.{attr}', f'{owner}.{obj.__qualname__}'}:
                        rows.setdefault(f'{alias}.{member}',
                                        (mrole, f'{PAGE.format(name)}#{name}.{member}'))
    return rows


def write(package, path):
    version = importlib.import_module(package).__version__
    lines = []
    for name, (role, uri) in sorted(entries(package).items()):
        if uri.endswith('#' + name):
            uri = uri[:-len(name)] + '$'
        lines.append(f'{name} py:{role} 1 {uri} -\n')
    header = (f'# Sphinx inventory version 2\n# Project: {package.capitalize()}\n'
              f'# Version: {version}\n'
              '# The remainder of this file is compressed using zlib.\n')
    with open(path, 'wb') as f:
        f.write(header.encode())
        f.write(zlib.compress(''.join(lines).encode()))
    print(f'{path}: {len(lines)} entries ({package} {version})')


if __name__ == '__main__':
    write(sys.argv[1], sys.argv[2])

"""Shared pieces of the scaling benchmark: the workload, thread settings, timing, machine facts.

Imported by the orchestrator (``bench/scaling.py``), the case runner (``bench/_case.py``) and
the ChainerMN rank script (``bench/_mn_worker.py``), so that every method trains the very same
model on the very same synthetic data.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import mgpu_updater  # noqa: F401  (its shim lets Chainer 7.8.1 import on Python 3.12, numpy 2)
except ImportError:  # the baselines still run without the package
    pass
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import numpy  # noqa: E402

# The BLAS/OpenMP thread-count variables; they must be set before numpy is imported, so each
# benchmark case runs in a fresh process with its own environment.
THREAD_VARS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS',
               'VECLIB_MAXIMUM_THREADS', 'NUMEXPR_NUM_THREADS')

MODELS = ('cnn', 'mlp', 'tiny')
N_CLASSES = 10
IMAGE_SHAPE = (1, 28, 28)


def cpu_count():
    """The cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_process(processes, cores=None):
    """BLAS threads for each of ``processes`` busy processes sharing ``cores`` cores."""
    cores = cores or cpu_count()
    return max(1, cores // max(1, processes))


def thread_env(n_threads):
    """Environment variables that pin BLAS/OpenMP to ``n_threads`` threads."""
    return {name: str(n_threads) for name in THREAD_VARS}


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------

class MLP(chainer.Chain):
    """784 - width - width - 10 with ReLU (module level, so workers can unpickle it)."""

    def __init__(self, width):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(28 * 28, width)
            self.l2 = L.Linear(width, width)
            self.l3 = L.Linear(width, N_CLASSES)

    def forward(self, x):
        h = F.relu(self.l1(x))
        return self.l3(F.relu(self.l2(h)))


def model_source(name):
    """Where the model of ``name`` comes from (recorded in the results)."""
    if name == 'cnn':
        return 'examples.mnist.model.make_model'
    return 'bench._common MLP ' + {'mlp': '784-1000-1000-10', 'tiny': '784-32-32-10'}[name]


def make_model(name, seed=0):
    """A ``L.Classifier`` for ``name`` with parameters drawn from ``seed``.

    ``cnn`` is the example's MNIST CNN (conv3x3 16 - conv3x3 32 - maxpool2 - fc128 - fc10).
    """
    numpy.random.seed(seed)  # Chainer's default initialisers draw from numpy's global RNG
    if name == 'cnn':
        from examples.mnist.model import make_model as example_model
        return example_model()
    if name == 'mlp':
        return L.Classifier(MLP(1000))
    if name == 'tiny':
        return L.Classifier(MLP(32))
    raise ValueError('unknown model {!r}; expected one of {}'.format(name, MODELS))


def make_optimizer(model):
    optimizer = chainer.optimizers.MomentumSGD(lr=0.01)
    optimizer.setup(model)
    return optimizer


def make_dataset(n_samples, seed=0):
    """Synthetic MNIST-shaped data: float32 images in [0, 1), int32 labels."""
    rng = numpy.random.RandomState(seed)
    x = rng.random_sample((n_samples,) + IMAGE_SHAPE).astype(numpy.float32)
    t = rng.randint(0, N_CLASSES, size=n_samples).astype(numpy.int32)
    return chainer.datasets.TupleDataset(x, t)


def dataset_size(max_global_batch):
    """Two largest global batches' worth, at least 1024 samples."""
    return max(1024, 2 * max_global_batch)


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------

def gpu_count():
    """GPUs CuPy can see (0 when CuPy is missing or sees none)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: all mean "CPU only"
        return 0


def device_spec(kind, index):
    """Chainer device specifier for replica ``index``: '@cupy:i' on GPU, '@numpy' on CPU."""
    return '@cupy:{}'.format(index) if kind == 'gpu' else '@numpy'


def synchronize(kind):
    """Wait for queued device work, so that wall-clock timings are honest on GPU."""
    if kind == 'gpu':
        import cupy
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            with cupy.cuda.Device(i):
                cupy.cuda.Device(i).synchronize()


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def time_rounds(step, samples_per_step, warmup, rounds, updates, sync=lambda: None,
                on_timed=None):
    """Run ``warmup`` steps, then ``rounds`` timed rounds of ``updates`` steps each.

    Returns samples/s of every round. ``on_timed(result)`` receives what each timed ``step()``
    returned (used to collect reported timings of timed updates only).
    """
    for _ in range(warmup):
        step()
    sync()
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(updates):
            result = step()
            if on_timed is not None:
                on_timed(result)
        sync()
        per_round.append(updates * samples_per_step / (time.perf_counter() - start))
    return per_round


def summarize(values):
    """Median, min and max of a list of numbers."""
    return {'median': statistics.median(values), 'min': min(values), 'max': max(values)}


# ---------------------------------------------------------------------------------------------
# Machine, versions, BLAS
# ---------------------------------------------------------------------------------------------

def median_interval(values, resamples=2000, seed=0):
    """A 95% interval for the median of ``values``: percentiles of a seeded bootstrap."""
    import random
    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def ratio_summary(ratios):
    """A paired bench's ratios (one per round): their median, quartiles and the median's
    95% interval (:func:`median_interval`), with the ratios themselves."""
    q1, q3 = (statistics.quantiles(ratios, n=4)[0::2] if len(ratios) > 1
              else (ratios[0], ratios[0]))
    return {'median': statistics.median(ratios), 'q1': q1, 'q3': q3,
            'ci95': list(median_interval(ratios)), 'ratios': ratios}


def ratio_cell(summary):
    """A :func:`ratio_summary` as a Markdown cell: ``median (low-high)``, the 95% interval."""
    return '{:.3f} ({:.3f}-{:.3f})'.format(summary['median'], *summary['ci95'])


def cpu_model():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg():
    """1-minute load average (None where the OS has none): other work skews every figure."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_info():
    info = {
        'cpu_model': cpu_model(),
        'cores_usable': cpu_count(),
        'cores_total': os.cpu_count(),
        'platform': platform.platform(),
        'gpus': gpu_count(),
        'loadavg_start': loadavg(),
    }
    try:
        with open('/proc/meminfo') as f:
            info['memory_kib'] = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return info


def _version(module_name):
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return getattr(module, '__version__', 'unknown')


def _mpiexec_version(mpiexec):
    if not mpiexec:
        return None
    try:
        out = subprocess.run([mpiexec, '--version'], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else None


def blas_info():
    """BLAS that numpy was built with, and the live thread pools when threadpoolctl is there."""
    info = {}
    try:
        config = numpy.show_config(mode='dicts')  # numpy >= 1.25
        blas = config.get('Build Dependencies', {}).get('blas', {})
        info = {key: blas.get(key) for key in ('name', 'version', 'openblas configuration')
                if blas.get(key) is not None}
    except TypeError:  # older numpy: show_config() has no mode
        info = {'name': 'unknown (numpy < 1.25)'}
    try:
        info['threadpools'] = threadpools(POOL_KEYS + ('filepath',))
    except ImportError:
        info['threadpools'] = 'threadpoolctl not installed'
    return info


POOL_KEYS = ('internal_api', 'version', 'num_threads')


def threadpools(keys=POOL_KEYS):
    """The live BLAS/OpenMP thread pools, each as the ``keys`` of threadpoolctl's info."""
    import threadpoolctl
    return [{k: pool.get(k) for k in keys} for pool in threadpoolctl.threadpool_info()]


def thread_setting():
    """The BLAS/OpenMP thread pools this process has (library, version, threads; no file
    paths) and those of :data:`THREAD_VARS` that are set: what a result ran with."""
    return {'threadpools': threadpools(),
            'variables': {name: os.environ[name] for name in THREAD_VARS
                          if os.environ.get(name, '').strip()}}


def describe_threads(setting):
    """``thread_setting()`` in words, for a result's Markdown."""
    pools = ', '.join('{} {} with {} thread{}'.format(
        p['internal_api'], p['version'], p['num_threads'], '' if p['num_threads'] == 1 else 's')
        for p in setting['threadpools']) or 'no BLAS/OpenMP pool found'
    variables = ', '.join('{}={}'.format(k, v) for k, v in setting['variables'].items())
    return '{} ({})'.format(pools, variables or 'no thread variable set')


def versions(mpiexec=None):
    return {
        'python': platform.python_version(),
        'numpy': numpy.__version__,
        'chainer': chainer.__version__,
        'cupy': _version('cupy'),
        'mpi4py': _version('mpi4py'),
        'mpiexec': _mpiexec_version(mpiexec),
        'matplotlib': _version('matplotlib'),
        'mgpu_updater': _version('mgpu_updater'),
        'blas': blas_info(),
    }


def current_thread_env():
    return {name: os.environ.get(name) for name in THREAD_VARS}


def write_results(out_dir, stem, result, markdown, plot):
    """Write ``stem``.png (by ``plot(result, path)``, False without matplotlib), ``stem``.md
    (by ``markdown(result)``, also printed) and ``stem``.json to ``out_dir``."""
    out_dir = Path(out_dir)
    if not plot(result, out_dir / (stem + '.png')):
        result['notes'].append('matplotlib is not installed: no {}.png'.format(stem))
    save_results(out_dir, stem, result, markdown(result))


def save_results(out_dir, stem, result, text):
    """Print ``text`` (the Markdown) and, where ``out_dir`` is given, write ``stem``.md and
    ``stem``.json (``result``) there, without this checkout's path (they are committed)."""
    text = without_local_paths(text)
    print(text)
    if out_dir:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / (stem + '.md')).write_text(text)
        (out_dir / (stem + '.json')).write_text(
            without_local_paths(json.dumps(result, indent=1)) + '\n')


def without_local_paths(text):
    """``text`` with this checkout's path dropped (results are committed: no machine paths)."""
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    return text.replace(root, '')


def emit(record, stream=None):
    """Write one JSON record as one line (the case runners' protocol to the orchestrator)."""
    stream = stream or sys.stdout
    stream.write(json.dumps(record) + '\n')
    stream.flush()

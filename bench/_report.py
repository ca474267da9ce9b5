"""Turn the scaling benchmark's records into derived figures, goals, Markdown and a plot."""
import os

LABELS = {
    'standard': 'StandardUpdater',
    'standard_1t': 'StandardUpdater, 1 BLAS thread',
    'hand': 'hand-written accumulation',
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
    rows.sort(key=lambda r: (r['k'], r['n'], METHOD_ORDER.index(r['method'])))
    return rows


def _goal(name, target, value, met, detail=None):
    goal = {'goal': name, 'target': target, 'value': value, 'met': met}
    if detail is not None:
        goal['detail'] = detail
    return goal


def goals(rows, memory, ks):
    """The issue's targets, evaluated on what was measured (figures, not asserts)."""
    by_key = {(r['method'], r['n'], r['k']): r for r in rows}
    ns = sorted({r['n'] for r in rows})
    out = []
    if 2 in ns:
        for k in ks:
            ours = by_key.get(('ours', 2, k))
            if ours is None or ours['speedup_vs_best_standard'] is None:
                continue
            speedup = ours['speedup_vs_best_standard']
            out.append(_goal('2 replicas vs the faster StandardUpdater (all or 1 BLAS thread), '
                             'same global batch (k={})'.format(k), '>= 1.85x',
                             round(speedup, 3), speedup >= 1.85,
                             {'vs StandardUpdater with all threads':
                              round(ours['speedup_vs_standard'], 3)}))
            rivals = {m: by_key[(m, 2, k)]['samples_per_s'] for m in ('parallel', 'chainermn')
                      if (m, 2, k) in by_key}
            if rivals:
                out.append(_goal(
                    '2 replicas ahead of ParallelUpdater and ChainerMN (k={})'.format(k),
                    'ours > each', round(ours['samples_per_s'], 1),
                    all(ours['samples_per_s'] > v for v in rivals.values()),
                    {LABELS[m]: round(v, 1) for m, v in rivals.items()}))
    k_mid = 4 if 4 in ks else ks[len(ks) // 2]
    ours, hand = by_key.get(('ours', 1, k_mid)), by_key.get(('hand', 1, k_mid))
    if ours and hand:
        ratio = ours['samples_per_s'] / hand['samples_per_s']
        out.append(_goal('1 replica k={} vs hand-written loop'.format(k_mid), '>= 0.97x',
                         round(ratio, 3), ratio >= 0.97))
    k_max = max(ks)
    mem = next((m for m in memory if m['k'] == k_max), None)
    if mem and k_max > 1:
        suffix = '_ours' if 'ratio_activation_ours' in mem else ''
        who = 'ParallelAccumulatingUpdater' if suffix else 'hand-written loop'
        ratio = mem['ratio_activation' + suffix]
        out.append(_goal('activation memory, k={} micro-batches ({}) vs one batch'
                         .format(k_max, who), '<= 0.25x', round(ratio, 3), ratio <= 0.25,
                         {'peak ratio incl. gradients': round(mem['ratio_peak' + suffix], 3),
                          'hand-written loop': round(mem['ratio_activation'], 3)}))
    n_max = max(ns)
    k_min = min(ks)
    low, high = by_key.get(('ours', n_max, k_min)), by_key.get(('ours', n_max, k_max))
    if (n_max > 1 and k_max > k_min and low and high
            and low.get('comm_share') and high.get('comm_share') is not None):
        ratio = high['comm_share'] / low['comm_share']
        mean_ratio = high['comm_share_mean'] / low['comm_share_mean']
        out.append(_goal('communication share (median time/comm), k={} vs k={} (N={})'
                         .format(k_max, k_min, n_max),
                         '<= 1/6 (0.167)', round(ratio, 3), ratio <= 1 / 6,
                         {'k={}'.format(k_min): round(low['comm_share'], 4),
                          'k={}'.format(k_max): round(high['comm_share'], 4),
                          'ratio of means, waits included': round(mean_ratio, 3)}))
    return out


def _fmt(value, spec, none='-', suffix=''):
    return none if value is None else format(value, spec) + suffix


def _mib(n_bytes):
    return '{:.1f} MiB'.format(n_bytes / 2 ** 20)


def throughput_table(rows):
    lines = ['| method | devices | k | global batch | samples/s (median) | min-max '
             '| vs Standard | vs best Standard | efficiency | comm share |',
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        lines.append('| {} | {} | {} | {} | {:.1f} | {:.1f}-{:.1f} | {} | {} | {} | {} |'.format(
            LABELS[r['method']], r['n'], r['k'], r['global_batch'], r['samples_per_s'],
            r['samples_per_s_min'], r['samples_per_s_max'],
            _fmt(r['speedup_vs_standard'], '.2f', suffix='x'),
            _fmt(r['speedup_vs_best_standard'], '.2f', suffix='x'),
            _fmt(r['efficiency'], '.0%'), _fmt(r.get('comm_share'), '.1%')))
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
    lines = ['| goal | target | measured | met |', '|---|---|---|---|']
    for g in goal_list:
        detail = g.get('detail')
        value = str(g['value']) + (' ({})'.format(
            ', '.join('{}: {}'.format(k, v) for k, v in detail.items())) if detail else '')
        met = 'yes' if g['met'] else '**no**'
        lines.append('| {} | {} | {} | {} |'.format(g['goal'], g['target'], value, met))
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
        'efficiency = samples/s(N) / (N x samples/s(1)) of the same method and k.',
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
        parts += ['', '## Goals', '', goals_table(result['goals'])]
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

"""Cross-checks of `workbench.data_selection.epicoder`: temperature smoothing, subtree sampling limits, evolution
frequencies, the sandbox (timeouts, network, writes), metrics, runs that do not depend on string hashing, and the verdict
rule on made-up rows, all four verdicts (fast, CPU)."""
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
import numpy as np
import pytest
from workbench.core import Claim, Results, UNTESTABLE
from workbench.data_selection.epicoder import (FeatureTree, smooth_probs, extract_features, kcenter_greedy, feature_matrix, new_node_frequency,
    apply_expansion, evolve, StdlibExpander, synthesize, recipe, run_sandboxed, validate, cyclomatic, halstead, jaccard_distance,
    iter_stdlib_functions, EpiCoderConfig, run_experiment, claims, verdict, headline, tree_from_records, tree_records, extract_code, humaneval_programs,
    strongest, data_claims, downstream_claims, downstream_preconditions, ablation_claims, split_packages, stdlib_files, top_package,
    CLAIM_METRICS, EVAL_SETS)


@pytest.fixture(scope='module')
def corpus():
    units = list(iter_stdlib_functions(limit_modules=30, seed=3))
    return [extract_features(u.source) for u in units]


@pytest.fixture(scope='module')
def tree(corpus): return FeatureTree.from_feature_sets(corpus)


@pytest.mark.parametrize('seed', range(5))
def test_smoothing_sums_to_one_and_is_identity_at_t1(seed):
    p = np.random.default_rng(seed).gamma(0.5, size=7) + 1e-6
    for t in (0.1, 0.5, 1.0, 2.0, 10.0, 99.0, 100.0, 1e4):
        q = smooth_probs(p, t)
        assert np.isclose(q.sum(), 1.0) and (q >= 0).all()
        if t < 100: assert (np.argsort(-q, kind='stable') == np.argsort(-p, kind='stable')).all()   # order kept
    assert np.allclose(smooth_probs(p, 1.0), p / p.sum(), atol=1e-7)
    assert np.allclose(smooth_probs(p, 100.0), 1 / 7)
    assert smooth_probs(p, 0.01).max() > 0.99
    ent = [-(q * np.log(q)).sum() for q in (smooth_probs(p, t) for t in (0.5, 1, 3, 30))]
    assert all(a <= b + 1e-12 for a, b in zip(ent, ent[1:]))                      # higher t, flatter
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match='temperature'): smooth_probs(p, bad)
    with pytest.raises(ValueError): smooth_probs([0.0, 0.0], 1.0)


def _breadth(t, d=1, out=None):
    out = {} if out is None else out
    for c in t.children.values(): _breadth(c, d + 1, out)
    out.setdefault(d, []).append(len(t.children)); return out


@pytest.mark.parametrize('shape', [(1,), (3, 1), (5, 2, 1), (2, 3, 2), (8, 4, 3)])
def test_sampled_subtrees_respect_depth_and_breadth(tree, shape):
    rng = np.random.default_rng(0)
    for _ in range(20):
        s = tree.sample(shape, temperature=float(rng.choice([0.5, 1, 10, 200])), fixed=('workflow',), rng=rng)
        br = _breadth(s)
        for d, c in enumerate(shape, 1): assert max(br.get(d, [0])) <= c
        for d in range(len(shape) + 1, 4):                                          # deeper levels kept whole
            for p in s.paths():
                if len(p) >= d: assert set(s.node(p[:d - 1]).children) == set(tree.node(p[:d - 1]).children)
        assert set(s.paths()) <= set(tree.paths()) and 'workflow' in s.children
        for p in [()] + [q[:d] for q in s.paths() for d in range(1, min(len(shape), len(q)))]:   # a node at depth ≤ len(shape) keeps exactly min(c_d, |C|) children
            assert len(s.node(p).children) == min(shape[len(p)], len(tree.node(p).children)), (p, shape)
        if len(shape) >= tree.depth(): assert len(s.paths()) <= math.prod(shape)     # a full-depth shape bounds the leaves
    a, b = tree.sample(shape, 10, rng=7), tree.sample(shape, 10, rng=7)
    assert sorted(a.paths()) == sorted(b.paths())
    for bad in ((), (0,), (2, -1), (1.5,), 'ab'):
        with pytest.raises(ValueError, match='shape'): tree.sample(bad)


def test_tree_merge_and_frequencies(corpus):
    a, b = FeatureTree.from_feature_sets(corpus[:20]), FeatureTree.from_feature_sets(corpus[20:50])
    ab, ba = a.merge(b), b.merge(a)
    assert sorted(ab.paths()) == sorted(ba.paths()) and all(ab.frequency(p) == ba.frequency(p) for p in ab.paths())
    for c, node in ab.children.items(): assert math.isclose(node.frequency(), sum(ab.frequency((c, g)) for g in node.children))
    T = tree_from_records(tree_records(ab, top=10 ** 6, top_groups=10 ** 6))
    assert sorted(T.paths()) == sorted(ab.paths())


def test_evolution_frequency_rule_and_growth(tree):
    toy = FeatureTree.from_feature_sets([{('a', 'g', 'x'), ('a', 'g', 'y')}, {('a', 'g', 'x'), ('a', 'h', 'z')}])
    s = FeatureTree(); s.add_path(('a', 'g', 'x')); s.add_path(('a', 'g', 'y'))
    assert new_node_frequency(('a', 'g', 'n'), s, toy) == 1.5 and new_node_frequency(('a', 'h', 'n'), s, toy) == 1.0 and new_node_frequency(('q', 'r', 'n'), s, toy) == 1.0
    T = apply_expansion(FeatureTree().merge(toy), s, [('a', 'g', 'n'), ('a', 'g', 'x')])
    assert T.frequency(('a', 'g', 'x')) == 2 and T.node(('a', 'g', 'n')).evolved
    T1, growth = evolve(tree, StdlibExpander(), 15, rng=0)
    assert set(tree.paths()) <= set(T1.paths()) and len(T1.paths()) > len(tree.paths())
    assert all(T1.frequency(p) == tree.frequency(p) for p in tree.paths())


def test_kcenter_and_extraction(corpus):
    X, _ = feature_matrix(corpus)
    S = kcenter_greedy(X, 12, seed=1)
    assert len(set(S.tolist())) == 12
    S2, ties = kcenter_greedy(X, 12, seed=1, return_ties=True)
    assert S2.tolist() == S.tolist() and 0 <= ties <= 11
    f = extract_features("import collections\ndef f(x):\n    d = collections.deque(x)\n    for i in d: pass")
    assert {('dependency relations', 'collections', 'deque'), ('workflow', 'loop', 'for')} <= f


def test_sandbox_kills_loops_and_refuses_network_and_outside_writes():
    outside = Path(tempfile.gettempdir()) / f"epicoder-test-outside-{os.getpid()}.txt"
    progs = ["while True:\n    pass", "import socket\nsocket.socket()", "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')",
             f"open({str(outside)!r}, 'w').write('x')", f"import os\nos.remove({str(outside)!r})", "import os\nos.mkdir('/tmp/epicoder-test-dir-xyz')",
             "import subprocess\nsubprocess.run(['true'])", "with open('ok.txt', 'w') as f:\n    f.write('fine')\nassert open('ok.txt').read() == 'fine'",
             "import os\nassert os.listdir('.') == []"]
    import time; t0 = time.monotonic()
    rs = run_sandboxed(progs, timeout=1.0)
    assert time.monotonic() - t0 < 30
    assert rs[0]['status'] == 'timeout'
    assert all(r['status'] == 'error' and 'sandbox:' in r['error'] for r in rs[1:7]), rs     # urllib wraps the refusal in a URLError
    assert 'network' in rs[1]['error'] and 'outside' in rs[3]['error']
    assert rs[7]['status'] == 'pass' and rs[8]['status'] == 'pass'              # writes inside its own folder work; each program gets a fresh folder
    assert not outside.exists() and not Path('/tmp/epicoder-test-dir-xyz').exists()
    assert run_sandboxed(["x = bytearray(1 << 31)"], mem_mb=128)[0]['error'].startswith('MemoryError')
    assert run_sandboxed(["def f(:"])[0]['status'] == 'compile'


def test_validation_repairs_traced_failures():
    feats = [('workflow', 'loop', 'for'), ('error handling', 'raise', 'UnicodeDecodeError'), ('computation operation', 'arithmetic', 'matmul')]
    v = validate([synthesize(feats)], timeout=2.0, repair_turns=2)[0]
    assert v['first'] == 'error' and v['status'] == 'pass' and set(v['dropped']) == set(feats[1:])
    assert ('workflow', 'loop', 'for') in extract_features(v['task'].code)


def test_metrics_by_hand():
    assert cyclomatic("if x:\n    y = 1") == 2 and cyclomatic("x = 1") == 1
    assert cyclomatic("while a or b:\n    pass") == 3
    h = halstead("x = a + 1")
    assert (h['eta1'], h['eta2'], h['N1'], h['N2']) == (2, 3, 2, 3) and math.isclose(h['volume'], 5 * math.log2(5))
    assert math.isclose(jaccard_distance([{1, 2}, {2, 3}, {1, 2}]), np.mean([2 / 3, 0, 2 / 3]), rel_tol=1e-6)   # float32 counts
    assert extract_code("x\n```python\nprint(1)\n```") == 'print(1)'


def test_humaneval_reference_passes_in_the_sandbox():
    ps = humaneval_programs(10)
    assert len(ps) == 10 and all(r['status'] == 'pass' for r in run_sandboxed([p['code'] for p in ps], timeout=5.0))


def test_kcenter_breaks_ties_by_a_seeded_draw_not_by_position():
    "Four points all at the same distance: the second center is a draw among the three, reproducible per seed."
    import scipy.sparse as sp
    X = sp.csr_matrix(np.eye(4, dtype=np.float32))
    firsts = {}
    for s in range(60):
        S, ties = kcenter_greedy(X, 2, seed=s, return_ties=True)
        assert ties == 1 and kcenter_greedy(X, 2, seed=s).tolist() == S.tolist()
        firsts.setdefault(int(S[0]), set()).add(int(S[1]))
    assert all(len(v) > 1 for v in firsts.values())               # argmax would always take the lowest index


def test_held_out_packages_are_disjoint_and_seeded():
    files = stdlib_files()
    tr, ho = split_packages(files, 0.2, seed=0)
    assert {top_package(p) for p in tr}.isdisjoint({top_package(p) for p in ho}) and len(tr) + len(ho) == len(files)
    assert split_packages(files, 0.2, seed=0)[1] == ho and split_packages(files, 0.2, seed=1)[1] != ho
    with pytest.raises(ValueError, match='held_out_frac'): EpiCoderConfig(mode='quick', held_out_frac=0)


SMALL = dict(n_modules=8, n_seed_functions=10, evolve_steps=5, n_samples=6, n_seeds=2, n_humaneval=4, shapes=((2, 1, 1),),
             n_shape_samples=2)


def test_tiny_end_to_end_run():
    cfg = EpiCoderConfig(mode='quick', **SMALL)
    res = run_experiment(cfg)
    assert set(res.df.method) == set(cfg.methods) and (res.df.n == 6).all()
    assert len([c for c in res.claims if not c.is_precondition]) == 6 and res.verdict == verdict(res)
    rq = res.df.pivot(index='seed', columns='method', values='requested')
    assert np.allclose(rq['flat_random'], rq['epicoder']) and (rq['seed_synth'] <= rq['epicoder'] + 1e-9).all()   # equal request
    D = res.table('downstream')
    assert set(D.arm) == {'base', *cfg.ft_arms, 'epicoder_scratch'} and len(D[D.arm == 'epicoder']) == cfg.n_seeds
    ft = D[D.arm.isin(cfg.ft_arms)]
    assert ft.tokens.nunique() == 1 and ft.data_tokens.nunique() == 1 and ft.data_tokens.iloc[0] <= cfg.ft_tokens
    assert any(c.threshold_from == 'max_token_gap' and c.holds for c in res.claims)           # measured, not assumed
    assert 'warm-started' in headline(res) and set(res.table('mix').method) == set(cfg.methods)


_HASH_RUN = """
import json, sys
from workbench.data_selection.epicoder import EpiCoderConfig, run_experiment
r = run_experiment(EpiCoderConfig(mode='quick', **json.loads(sys.argv[1])))
D = r.table('downstream').drop(columns=['train_s'])
print(json.dumps(dict(rows=r.rows, downstream=D.to_dict('records'), mix=r.tables['mix'], verdict=r.verdict)))
"""


def test_quick_run_does_not_depend_on_string_hashing():
    "The same config in two processes with different PYTHONHASHSEED gives the same rows, downstream losses and mix."
    kw = json.dumps(dict(SMALL, n_seeds=1))
    env = lambda h: dict(os.environ, PYTHONHASHSEED=str(h), OMP_NUM_THREADS='1', WORKBENCH_PROGRESS='0')
    ps = [subprocess.Popen([sys.executable, '-c', _HASH_RUN, kw], env=env(h), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for h in (1, 2)]
    outs = [p.communicate(timeout=600) for p in ps]
    assert all(p.returncode == 0 for p in ps), [e[-2000:] for _, e in outs]
    a, b = (json.loads(o.strip().splitlines()[-1]) for o, _ in outs)
    assert a == b


def test_model_reaches_the_generator(monkeypatch):
    import workbench.data_selection.epicoder as E
    seen = {}
    def fake(prompts, max_new_tokens=160, model_name='smollm2-135m', batch_size=8):
        seen['model'] = model_name; return ["```python\ndef solve(data, text):\n    return [len(data)]\n```"] * len(prompts)
    monkeypatch.setattr(E, 'llm_generate', fake)
    cfg = EpiCoderConfig(mode='quick', n_modules=8, n_seed_functions=10, evolve_steps=2, llm_samples=2, model='my-org/bigger-coder')
    corpus = E.build_corpus(cfg)
    out = E.llm_unit(cfg, corpus, E.seed_tree(cfg, corpus, cfg.seed), cfg.seed)
    assert seen['model'] == 'my-org/bigger-coder' and len(out['samples']) == 4 and all(s['status'] == 'pass' for s in out['samples'])


# --- the verdict rule on made-up rows ---
METRICS = tuple(CLAIM_METRICS)      # n_features, coverage_loc, eta2, cyclomatic: the order of `data_claims`
CONFIG = dict(seed=0, min_learned=1.0, max_token_gap=0.0)


def _rows(epicoder, seeds, baselines):
    "One row per (method, seed): each method's lead over a common level, per metric (a number: every metric)."
    lead = {**dict.fromkeys(('flat_random', 'seed_synth', 'seed_full', 'seed_raw'), 0.0), **baselines, 'epicoder': epicoder}
    rows = []
    for s in seeds:
        for i, (m, x) in enumerate(lead.items()):
            x = x if isinstance(x, dict) else dict.fromkeys(METRICS, x)
            rows.append(dict(method=m, seed=s, **{k: 10.0 + x.get(k, 0.0) + 0.1 * s + 0.05 * ((s + i) % 2) for k in METRICS}))
    return rows


def _downstream(gain, seeds, learned=2.0, tokens=(1000, 1000)):
    "Downstream records: base (chance 6, its own loss 4) and arms; EpiCoder's loss is `gain` below seed snippets' (jittered)."
    out = []
    for s in seeds:
        j = 0.01 * ((s * 7) % 3)
        out.append(dict(arm='base', seed=s, heldout_init=6.0, humaneval_init=6.0, heldout_unigram=6.5, humaneval_unigram=6.5,
                        heldout_loss=4.0, humaneval_loss=4.2, tokens=5000))
        for arm, loss, tok in (('epicoder', 6.0 - learned - gain + j, tokens[0]), ('seed_synth', 6.0 - learned, tokens[1]),
                               ('flat_random', 6.0 - learned + j / 2, tokens[1])):
            out.append(dict(arm=arm, seed=s, heldout_loss=loss, humaneval_loss=loss + 0.05, tokens=tok, data_tokens=tok // 2))
    return out


def _made_up(epicoder=0.0, gain=0.0, seeds=range(5), downstream=True, **kw):
    base = {k: v for k, v in kw.items() if k not in ('learned', 'tokens')}
    tables = dict(downstream=_downstream(gain, seeds, **{k: v for k, v in kw.items() if k in ('learned', 'tokens')})) if downstream else {}
    R = Results('epicoder', CONFIG, _rows(epicoder, seeds, base), seeds=list(seeds), tables=tables)
    R.claims = claims(R)
    return R


@pytest.mark.parametrize('lead,gain,want,shows', [
    (1.0, 0.1, 'reproduced', [True] * 6),
    (dict(n_features=1.0, coverage_loc=1.0, eta2=0.0, cyclomatic=-1.0), 0.1, 'partly', [True, True, False, False, True, True]),
    (1.0, 0.0, 'partly', [True] * 4 + [False] * 2),               # the data shows, the model is no better
    (1.0, -0.1, 'not reproduced', [True] * 4 + [False] * 2),      # the model is worse beyond its CI: the central claim fails
    (0.0, 0.0, 'not reproduced', [False] * 6),                    # no effect beyond the CI
    (-1.0, 0.1, 'partly', [False] * 4 + [True] * 2),              # data properties the other way do not overrule the model
])
def test_verdict_on_made_up_rows(lead, gain, want, shows):
    R = _made_up(lead, gain)
    parts = [c for c in claims(R) if not c.is_precondition]
    assert [c.shows for c in parts] == shows
    assert all(c.holds for c in claims(R) if c.is_precondition)
    assert verdict(R) == want


@pytest.mark.parametrize('kw', [dict(learned=0.5), dict(tokens=(1000, 1100))])
def test_a_failed_precondition_makes_it_untestable(kw):
    "The model does not learn (0.5 nats below chance, threshold 1), or the arms saw different token counts."
    R = _made_up(1.0, 0.1, **kw)
    assert [c.holds for c in downstream_preconditions(R)].count(False) >= 1
    assert verdict(R) == UNTESTABLE
    assert verdict(_made_up(1.0, 0.1)) == 'reproduced'


def test_the_comparator_is_snippet_seeding_and_uniform_leaves_the_ablation():
    "Random leaves far ahead on every metric change nothing in the verdict; they show up in the ablation claims."
    R = _made_up(1.0, 0.1, flat_random=5.0)
    assert verdict(R) == 'reproduced'
    assert all(c.opposite for c in ablation_claims(R)[:4]) and all('random leaves' in c.name for c in ablation_claims(R)[:4])
    assert not any('random leaves' in c.name for c in claims(R))
    assert [c.name.split(':')[0] for c in data_claims(R)][::2] == ['EpiCoder − seed snippet, equal request'] * 2


def test_coverage_is_judged_against_the_strongest_snippet_baseline():
    "All of a seed's features (3x the request) count for coverage at equal lines, not per program."
    R = _made_up(1.0, 0.1, seed_full=5.0)
    assert strongest(R.df, 'coverage_loc', ('seed_synth', 'seed_full', 'seed_raw')) == ('seed_full',)
    assert [c.shows for c in data_claims(R)] == [True, False, True, True] and data_claims(R)[1].opposite
    assert verdict(R) == 'partly'


def test_a_tie_between_baselines_is_not_broken_by_list_order():
    "Two snippet baselines with the same mean coverage: both are compared, the less favourable counts, both are named."
    from workbench.data_selection.epicoder import versus, SNIPPET
    rows = _rows(1.0, range(5), dict(seed_full=0.5))
    full = {r['seed']: r['coverage_loc'] for r in rows if r['method'] == 'seed_full'}
    for r in rows:                                                  # seed_raw: seed_full's mean, another spread
        if r['method'] == 'seed_raw': r['coverage_loc'] = full[r['seed']] + [0.3, -0.3, 0.2, -0.2, 0.0][r['seed']]
    R = Results('epicoder', CONFIG, rows, seeds=list(range(5)))
    assert strongest(R.df, 'coverage_loc', SNIPPET) == ('seed_full', 'seed_raw')
    c = data_claims(R)[1]
    assert 'tied strongest' in c.name and 'seed snippet, all its features' in c.name and 'raw seed functions' in c.name
    each = [versus(R.df, 'coverage_loc', (b,), 'coverage') for b in ('seed_full', 'seed_raw')]
    assert c.lo == min(x.lo for x in each) and each[0].lo != each[1].lo
    assert strongest(R.df, 'coverage_loc', ('seed_raw', 'seed_full', 'seed_synth')) == ('seed_full', 'seed_raw')   # order-free


def test_a_record_without_the_downstream_test_is_judged_on_its_data_claims():
    "Records made before the downstream test keep loading: no downstream parts, no preconditions."
    R = _made_up(1.0, downstream=False)
    assert downstream_claims(R) == [] and downstream_preconditions(R) == [] and len(claims(R)) == 4
    assert verdict(R) == 'reproduced' and 'not measured' in headline(R)

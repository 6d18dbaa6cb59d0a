"Cross-checks of `workbench.data_selection.epicoder`: temperature smoothing, subtree sampling limits, evolution frequencies, the sandbox (timeouts, network, writes), metrics, and the verdict rule on made-up rows (fast, CPU)."
import math
import os
import tempfile
from pathlib import Path
import numpy as np
import pytest
from workbench.core import Claim, Results, UNTESTABLE
from workbench.data_selection.epicoder import (FeatureTree, smooth_probs, extract_features, kcenter_greedy, feature_matrix, new_node_frequency,
    apply_expansion, evolve, StdlibExpander, synthesize, recipe, run_sandboxed, validate, cyclomatic, halstead, jaccard_distance,
    iter_stdlib_functions, EpiCoderConfig, run_experiment, claims, verdict, headline, tree_from_records, tree_records, extract_code, humaneval_programs,
    strongest_baseline, CLAIM_METRICS)


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


def test_tiny_end_to_end_run():
    cfg = EpiCoderConfig(mode='quick', n_modules=12, n_seed_functions=15, evolve_steps=5, n_samples=6, n_seeds=2, n_humaneval=4, shapes=((2, 1, 1),), n_shape_samples=2)
    res = run_experiment(cfg)
    assert set(res.df.method) == set(cfg.methods) and (res.df.n == 6).all()
    assert len(res.claims) == 4 and 'equal request' in headline(res)
    rq = res.df.pivot(index='seed', columns='method', values='requested')
    assert np.allclose(rq['flat_random'], rq['epicoder']) and (rq['seed_synth'] <= rq['epicoder'] + 1e-9).all()   # equal request (seed snippets: capped by the seed's own features)
    assert 'not tested' in headline(res)


def test_model_reaches_the_generator(monkeypatch):
    import workbench.data_selection.epicoder as E
    seen = {}
    def fake(prompts, max_new_tokens=160, model_name='smollm2-135m', batch_size=8):
        seen['model'] = model_name; return ["```python\ndef solve(data, text):\n    return [len(data)]\n```"] * len(prompts)
    monkeypatch.setattr(E, 'llm_generate', fake)
    cfg = EpiCoderConfig(mode='quick', n_modules=8, n_seed_functions=10, evolve_steps=2, llm_samples=2, model='my-org/bigger-coder')
    out = E.llm_unit(cfg, E.build_corpus(cfg), cfg.seed)
    assert seen['model'] == 'my-org/bigger-coder' and len(out['samples']) == 4 and all(s['status'] == 'pass' for s in out['samples'])


# --- the verdict rule on made-up rows ---
FAILED = Claim('made-up precondition: the baselines leave headroom', 0.2, -0.1, 0.5, null=1.0, role='precondition', threshold_from='min_headroom')
HOLDS = Claim('made-up precondition: the sandbox passes HumanEval', 0.98, 0.95, 1.0, null=0.9, role='precondition', threshold_from='min_pass')
METRICS = tuple(CLAIM_METRICS)      # n_features, coverage_loc, eta2, cyclomatic: the order of `claims`


def _made_up(epicoder=0.0, seeds=range(5), **baselines):
    "Rows in the shape `claims` reads, one per (method, seed): each method's lead over a common level, per metric (a number: every metric)."
    lead = {**dict.fromkeys(('flat_random', 'seed_synth', 'seed_full', 'seed_raw'), 0.0), **baselines, 'epicoder': epicoder}
    rows = []
    for s in seeds:
        for i, (m, x) in enumerate(lead.items()):
            x = x if isinstance(x, dict) else dict.fromkeys(METRICS, x)
            rows.append(dict(method=m, seed=s, **{k: 10.0 + x.get(k, 0.0) + 0.1 * s + 0.05 * ((s + i) % 2) for k in METRICS}))  # seed jitter: finite CIs
    return Results('epicoder', dict(seed=0), rows, seeds=list(seeds))


@pytest.mark.parametrize('lead,want,shows', [
    (1.0, 'reproduced', [True] * 4),
    (dict(n_features=1.0, coverage_loc=1.0, eta2=0.0, cyclomatic=-1.0), 'partly', [True, True, False, False]),
    (0.0, 'not reproduced', [False] * 4),                        # no effect beyond the CI
    (-1.0, 'not reproduced', [False] * 4),                       # the other way on every metric
])
def test_verdict_on_made_up_rows(lead, want, shows):
    R = _made_up(lead)
    assert [c.shows for c in claims(R)] == shows
    assert verdict(R) == want


@pytest.mark.parametrize('stronger', ['flat_random', 'seed_synth'])
def test_claims_are_against_the_strongest_equal_request_baseline(stronger):
    "EpiCoder leads seed_synth and flat_random by 1; one of them leads by 2 on η2: that one is the baseline, and the η2 claim goes the other way."
    R = _made_up(1.0, **{stronger: dict(eta2=2.0)})
    assert strongest_baseline(R, 'eta2') == stronger and strongest_baseline(R, 'n_features') in ('flat_random', 'seed_synth')
    assert [c.shows for c in claims(R)] == [True, True, False, True] and claims(R)[2].opposite
    assert verdict(R) == 'partly'


def test_seed_full_counts_for_coverage_but_not_per_program():
    "All of a seed's features (3x the request) is excluded from per-program claims by the equal-request rule, but not from coverage at equal lines."
    R = _made_up(1.0, seed_full=5.0)
    assert strongest_baseline(R, 'n_features') != 'seed_full' and strongest_baseline(R, 'coverage_loc') == 'seed_full'
    assert [c.shows for c in claims(R)] == [True, False, True, True] and claims(R)[1].opposite
    assert verdict(R) == 'partly'


@pytest.mark.parametrize('lead,want', [(1.0, 'reproduced'), (0.0, 'not reproduced')])
def test_a_failed_precondition_makes_it_untestable(lead, want):
    R = _made_up(lead)
    R.claims = [FAILED, *claims(R)]
    assert verdict(R) == UNTESTABLE
    R.claims = [HOLDS, *claims(R)]
    assert verdict(R) == want

"Cross-checks of `workbench.data_selection.mass`: the skill graph's normalisations, the score forms and their reductions, merging, selection at a budget, equal-token training data, determinism, and the verdict rule on made-up rows, preconditions included (fast, CPU)."
import random
import numpy as np
import pytest
import torch
from workbench.core import Results, Claim, load_results
from workbench.data_selection.mass import (SKILLS, SKILL_OF, MathDoc, SkillGraph, make_target_pool, make_problems, worked_problem, skill_popularity,
    extract_skills, merge_skills, topk_sims, mass_scores, score_terms, centroid_scores, dsir_lite_scores, select_top, dedup, token_blocks,
    tokens_to_reach, MASSConfig, run_experiment, claims, verdict, headline, strongest_baseline)


def unit_rows(n, d, seed):
    x = np.random.default_rng(seed).normal(size=(n, d)); return x / np.linalg.norm(x, axis=1, keepdims=True)


def random_graph(m=6, seed=0):
    r = random.Random(seed); names = [f"s{i}" for i in range(m)]
    return SkillGraph.from_annotations([r.sample(names, r.randint(1, 4)) for _ in range(30)])


def test_graph_normalisations():
    g = random_graph()
    assert (g.node_weight >= 0).all() and np.isclose(g.node_weight.sum(), 1)
    assert np.allclose(g.adj, g.adj.T) and (g.adj >= 0).all() and np.allclose(np.diag(g.adj), 0)
    assert np.isclose(g.adj[np.triu_indices(len(g.names), 1)].sum(), 1)
    empty = SkillGraph.from_annotations([['a'], ['b'], ['a']])
    assert np.all(empty.adj == 0) and not np.isnan(empty.adj).any() and np.allclose(empty.node_weight, [2 / 3, 1 / 3])
    assert np.isclose(g.pagerank().sum(), 1)


@pytest.mark.parametrize('form', ['linear', 'quadratic'])
def test_scores_match_the_loop_and_reduce_to_node_only(form):
    g, D, S = random_graph(seed=1), unit_rows(9, 16, 0), unit_rows(6, 16, 1)
    St = topk_sims(D, S, 3); lam = 0.6
    loop = [sum(g.node_weight[k] * (s[k] if form == 'linear' else s[k] ** 2) + lam * sum(g.adj[k, l] * (s[k] if form == 'linear' else s[k] * s[l]) for l in range(6))
                for k in range(6)) for s in St]
    assert np.allclose(mass_scores(D, S, g, 3, lam, form), loop)
    node_only = St @ g.node_weight if form == 'linear' else (St ** 2) @ g.node_weight
    assert np.allclose(mass_scores(D, S, g, 3, 0.0, form), node_only)
    perm = np.random.default_rng(2).permutation(6)
    gp = SkillGraph([g.names[i] for i in perm], g.node_weight[perm], g.adj[np.ix_(perm, perm)])
    assert np.allclose(mass_scores(D, S[perm], gp, 3, lam, form), mass_scores(D, S, g, 3, lam, form))
    twins = np.vstack([D[:1], D[:1]])
    a, b = mass_scores(twins, S, g, 3, lam, form); assert a == b


def test_score_terms_and_top_k():
    g, D, S = random_graph(seed=3), unit_rows(5, 12, 4), unit_rows(6, 12, 5)
    assert np.allclose(sum(score_terms(D, S, g, 2, 0.8)), mass_scores(D, S, g, 2, 0.8))
    assert (np.count_nonzero(topk_sims(D, S, 2), axis=1) <= 2).all()
    assert all(topk_sims(S[k:k + 1], S, 1)[0, k] > 0 for k in range(6))          # a skill's own text has it in its top-1
    with pytest.raises(ValueError, match='form'): mass_scores(D, S, g, form='cubic')
    with pytest.raises(ValueError, match='skill embeddings'): mass_scores(D, S[:3], g)


class FirstWordEncoder:
    "Names with the same first word get the same unit vector."
    def encode(self, xs):
        words = sorted({x.split()[0] for x in xs})
        return torch.nn.functional.normalize(torch.tensor([[float(x.split()[0] == w) for w in words] for x in xs]), dim=-1)


def test_merge_skills():
    names = ['unit conversion', 'unit conversions', 'unit conversion', 'gcd', 'gcd of numbers', 'rounding']
    m = merge_skills(names, FirstWordEncoder(), 0.9)
    assert m['unit conversions'] == 'unit conversion' and m['gcd of numbers'] == 'gcd' and m['rounding'] == 'rounding'
    assert {k: m[v] for k, v in m.items()} == m                                  # idempotent
    assert merge_skills(names, FirstWordEncoder(), 1.01) == {n: n for n in set(names)}


def test_select_top_budget_order_and_errors():
    rng = np.random.default_rng(0); sc, ln = rng.normal(size=50), rng.integers(5, 50, size=50)
    for b in (0, 37, 300, 1000, int(ln.sum())):
        ix = select_top(sc, ln, token_budget=b)
        assert ln[ix].sum() <= b and (np.diff(sc[ix]) <= 0).all()
    assert sorted(select_top(sc, ln, ratio=1.0)) == list(range(50))
    for bad in (0, -0.5, 1.01, 2):
        with pytest.raises(ValueError, match='ratio'): select_top(sc, ln, ratio=bad)
    with pytest.raises(ValueError, match='ratio'): MASSConfig(mode='quick', ratio=1.2)


def test_equal_token_budgets_and_determinism():
    lists = [list(range(random.Random(i).randint(3, 30))) for i in range(40)]
    a = token_blocks(lists, range(40), 10, 32, eos_id=99, seed=1); b = token_blocks(lists, [0, 1, 2], 10, 32, eos_id=99, seed=1)
    assert a.shape == b.shape == (10, 32)                                           # same tokens for a big and a tiny subset
    assert torch.equal(a, token_blocks(lists, range(40), 10, 32, eos_id=99, seed=1))
    assert [d.text for d in make_target_pool(60, seed=4)] == [d.text for d in make_target_pool(60, seed=4)]
    assert [d.text for d in make_target_pool(60, seed=4)] != [d.text for d in make_target_pool(60, seed=5)]


def test_world_extraction_dedup_and_baselines():
    probs = make_problems(40, seed=3)
    for p in probs:
        assert p.text == p.prompt + p.steps + p.answer
        assert set(p.skills) <= {SKILL_OF[n] for n in extract_skills(p)}         # the rules never miss a skill of these problems
    pool = make_target_pool(120, seed=2); keep = dedup([d.text for d in pool])
    cats = [pool[i].category for i in keep]
    assert cats.count('dup') < sum(d.category == 'dup' for d in pool)
    ds = dsir_lite_scores([d.text for d in pool], [p.text for p in probs])
    mean = lambda c: np.mean([s for s, d in zip(ds, pool) if d.category == c])
    assert mean('multi') > mean('offtopic')
    assert np.isclose(skill_popularity(0.0).sum(), 1) and np.allclose(skill_popularity(0.0), 1 / len(SKILLS))
    assert tokens_to_reach([10, 20, 30], [3.0, 2.0, 1.0], 1.5) == 25.0 and tokens_to_reach([10, 20], [3.0, 2.0], 1.0) is None


def test_tiny_end_to_end_run():
    cfg = MASSConfig(mode='quick', pool_size=60, n_ref=12, n_eval=4, steps=4, n_evals=2, batch_size=2, seq_len=64, methods=('full', 'mass', 'centroid'))
    res = run_experiment(cfg)
    df = res.df
    assert set(df.method) == {'full', 'mass', 'centroid'} and (df.tokens == cfg.tokens).all()
    assert df[df.method == 'mass'].share_offtopic.iloc[0] <= df[df.method == 'full'].share_offtopic.iloc[0]
    assert len(res.claims) == 3                                                # full, half the tokens, and the one baseline that ran
    assert 'MASS' in headline(res)


def _fake(mass, half, full=2.2, baselines=None, n=5, noise=0.005, pre=()):
    """Held-out losses per (method, seed): MASS `mass` at T and `half` at T/2, the full pool `full`, each simple selector its value in
    `baselines` (default: 2.3 for random, centroid and DSIR-lite); `pre`: precondition claims."""
    rng, rows = np.random.default_rng(0), []
    baselines = dict(random=2.3, centroid=2.3, dsir_lite=2.3) if baselines is None else baselines
    for s in range(n):
        shared = 0.05 * rng.standard_normal()                                        # a seed effect common to every method
        for m, loss in (('full', full), ('mass', mass), *baselines.items()):
            rows.append(dict(method=m, seed=s, loss=loss + shared + noise * rng.standard_normal(),
                             loss_half=(half if m == 'mass' else loss) + shared + noise * rng.standard_normal()))
    return Results('mass', dict(mode='quick', seed=0, ratio=0.5), rows, seeds=list(range(n)), claims=list(pre))


def _precondition(holds: bool) -> Claim:
    "A made-up precondition (the problem exists: the pool holds at least the declared 20% off-topic or noisy documents)."
    est = 0.4 if holds else 0.05
    return Claim('share of off-topic or noisy documents in the pool (made up)', est, est, est, null=0.2, role='precondition', threshold_from='min_bad_share')


# (MASS at T, MASS at T/2, simple selectors or None for the default): what the rule must say
CASES = {'reproduced': (2.0, 2.1, None, 'reproduced'),                         # beats full at T and at T/2, and every selector
         'partly': (2.0, 2.3, None, 'partly'),                                 # at T/2 it is worse than the full pool at T
         'no effect': (2.2, 2.2, dict(random=2.2, centroid=2.2, dsir_lite=2.2), 'not reproduced'),
         'other way': (2.4, 2.5, dict(random=2.3, centroid=2.2, dsir_lite=2.3), 'not reproduced'),
         'strongest baseline': (2.2, 2.3, dict(random=2.4, centroid=2.0, dsir_lite=2.4), 'not reproduced')}   # beats random, not the centroid


@pytest.mark.parametrize('case', list(CASES))
def test_verdict_rule_on_made_up_rows(case):
    mass, half, base, want = CASES[case]
    assert verdict(_fake(mass, half, baselines=base)) == want


def test_claims_judge_against_the_strongest_selector():
    mass, half, base, _ = CASES['strongest baseline']
    r = _fake(mass, half, baselines=base)
    cs = claims(r)
    assert strongest_baseline(r) == 'centroid' and 'reference centroid' in cs[2].name and cs[2].opposite
    assert not any(c.shows for c in cs)
    r = _fake(2.2, 2.3, baselines=dict(random=2.4))                                 # against random alone, the third part would show
    assert strongest_baseline(r) == 'random' and claims(r)[2].shows and verdict(r) == 'partly'
    assert len(claims(_fake(2.0, 2.1, baselines={}))) == 2                           # no selector ran: two parts


@pytest.mark.parametrize('case', list(CASES))
def test_failed_precondition_makes_it_untestable(case):
    mass, half, base, want = CASES[case]
    assert verdict(_fake(mass, half, baselines=base, pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_fake(mass, half, baselines=base, pre=[_precondition(True)])) == want   # one that holds leaves the rule's verdict


def test_recorded_run_is_full_with_three_seeds():
    try: R = load_results('mass')
    except FileNotFoundError: pytest.skip('no full run recorded yet')
    assert R.mode == 'full' and len(R.seeds) >= 3 and len(R.claims) == 3


def test_the_lm_comes_from_the_model_field():
    "The default is the registry's scratch model: the same seeded tiny Llama as before; a pretrained model is a fresh, trainable copy."
    from workbench.data_selection.mass import lm_for
    from workbench.models import tiny_llama, load_model
    from workbench.testing import tiny_folder
    class Tok:
        def __len__(self): return 300
    cfg = MASSConfig(mode='quick')
    assert cfg.model == 'tiny-llama' and cfg.from_scratch
    a, b = lm_for(cfg, Tok(), 3), tiny_llama(300, cfg.n_layers, cfg.d_model, 4, max_len=cfg.seq_len, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())) and a.training
    folder = tiny_folder('qwen2'); c = MASSConfig(mode='quick', model=folder)
    assert not c.from_scratch
    m = lm_for(c, None, 0)
    assert m.training and all(p.requires_grad for p in m.parameters())
    assert all(torch.equal(x, y) for x, y in zip(m.state_dict().values(), load_model(folder).state_dict().values()))   # pretrained weights
    with pytest.raises(ValueError, match='exceeds'): lm_for(MASSConfig(mode='quick', model=folder, seq_len=4096), None, 0)
    with pytest.raises(ValueError, match='unknown model'): MASSConfig(mode='quick', model='no-such-model')

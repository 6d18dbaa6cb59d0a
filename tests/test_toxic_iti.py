"""Cross-checks of `workbench.interpretability.toxic_iti`: entanglement (with its invariances) and the Welch bound, the
synthetic corpus with its plain part held fixed, probes and chance, ITI through the platform hooks and decode loop, the
two frontiers, the precondition and the verdict rule, and the earlier design's record (fast, CPU)."""
import dataclasses, math, random
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from workbench.core import Results, Claim, judge
from workbench.testing import tiny_model, tiny_ids
from workbench.train import generate_ids
from workbench.hooks import run_with_cache
from workbench.interpretability.toxic_iti import (
    entanglement, welch_bound, train_toy_superposition, WordTokenizer, StyleProcess, sentence, document, style_prob,
    make_attribute_corpus, eliciting_prompts, bayes_next_rate, probe_texts, collect_head_activations, train_head_probes,
    mass_mean_directions, top_heads, ITIIntervention, random_directions, attribute_rate, first_sentence_marked,
    probe_directions, mass_mean_entanglement, attribute_entanglement, whiten, front_rate, frontier_table,
    ToxicITIConfig, claims, comparisons, preconditions, verdict, TOPICS, OTHER_ADJ, ADJ_TOPIC)


@pytest.mark.parametrize('n,m', [(4, 4), (8, 16), (30, 30)])
def test_orthonormal_directions_have_zero_entanglement(n, m):
    Q, _ = torch.linalg.qr(torch.randn(m, m, generator=torch.Generator().manual_seed(n)))
    assert entanglement(Q[:n] * torch.rand(n, 1).add(0.5)).abs().max() < 1e-5      # scale does not matter


@pytest.mark.parametrize('n,m', [(12, 4), (20, 5), (7, 3)])
def test_random_sets_respect_the_welch_bound(n, m):
    V = torch.randn(500, n, m, generator=torch.Generator().manual_seed(m))
    assert (entanglement(V).max(-1).values >= welch_bound(n, m) - 1e-6).all()
    assert entanglement(torch.ones(n, m))[0].item() == pytest.approx(1.0)


def test_superposition_toy_gives_a_rare_feature_less_norm():
    f = torch.full((2, 12), 0.05)
    f[0, 0] = 0.001
    W = train_toy_superposition(f, steps=400, seed=1)
    assert W[0, 0].norm() < W[1, 0].norm()


def _features(seed, extra_dims=2):
    "400 texts: 8 classes on 8 axes (attribute = class 0, topic = class // 2) and `extra_dims` axes with no feature."
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.eye(8)[torch.arange(400) % 8], torch.zeros(400, extra_dims)], 1)
    X = X + 0.3 * torch.randn(400, 8 + extra_dims, generator=g)
    lab = dict(attribute=(torch.arange(400) % 8 == 0).long(), topic=torch.arange(400) % 8 // 2)
    return X, lab, g


@pytest.mark.parametrize('seed', range(4))
def test_entanglement_is_invariant_to_a_shared_offset(seed):
    X, lab, g = _features(seed)
    e = attribute_entanglement(probe_directions(X, lab))[0]
    offset = 10 * torch.randn(X.shape[1], generator=g)                              # the same vector added to every text
    assert attribute_entanglement(probe_directions(X + offset, lab))[0] == pytest.approx(e, abs=1e-3)
    assert mass_mean_entanglement(X + offset, lab) == pytest.approx(mass_mean_entanglement(X, lab), abs=1e-4)


@pytest.mark.parametrize('seed', range(4))
def test_whitened_entanglement_ignores_a_dominant_label_free_direction(seed):
    "The anisotropy that saturated the earlier measure: a label-free direction with most of the variance."
    X, lab, g = _features(seed)
    u = torch.cat([torch.zeros(8), F.normalize(torch.randn(2, generator=g), dim=0)])
    Xs = X + 100 * torch.randn(len(X), 1, generator=g) * u
    e, e_s = (attribute_entanglement(probe_directions(x, lab))[0] for x in (X, Xs))
    assert e_s == pytest.approx(e, abs=0.02) and e < 0.9


def test_whiten_gives_unit_covariance_and_keeps_the_rank():
    X, _, g = _features(0)
    W = whiten(X @ torch.randn(10, 10, generator=g))
    assert torch.allclose(W.T @ W / (len(W) - 1), torch.eye(10), atol=1e-3)
    low = whiten(torch.cat([X, X[:, :1] * 2], 1))                                   # a duplicated direction: rank 10
    assert low.shape == (400, 10)


def test_entanglement_reaches_one_when_the_attribute_is_a_topic():
    X, lab, _ = _features(1)
    same = dict(attribute=(torch.arange(400) % 8 < 2).long(), topic=lab['topic'])  # attribute == topic 0
    e, _, near = attribute_entanglement(probe_directions(X, same))
    assert e > 0.95 and near == 'topic=0'


@pytest.mark.parametrize('share', [0.005, 0.02, 0.1, 0.2])
def test_corpus_share_is_realised_and_marked_words_stay_in_marked_sentences(share):
    c = make_attribute_corpus(2500, share, seed=3)
    assert abs(c.share - share) < 0.01 and c.n_plain == 2500
    r = random.Random(0)
    for _ in range(300):
        t = r.choice(list(TOPICS))
        plain, _ = sentence(r, t, r.random() < 0.5, False)
        marked, _ = sentence(r, t, r.random() < 0.5, True)
        assert not set(OTHER_ADJ[t]) & set(plain) and set(OTHER_ADJ[t]) & set(marked)


def test_plain_documents_are_held_fixed_and_marked_ones_added_on_top():
    lo, hi = make_attribute_corpus(300, 0.02, seed=5), make_attribute_corpus(300, 0.2, seed=5)
    assert torch.equal(lo.ids[:300], hi.ids[:300]) and hi.n_marked > lo.n_marked > 0
    assert torch.equal(lo.ids[300:], hi.ids[300:300 + lo.n_marked])                 # the higher share contains the lower


def test_the_marked_style_reuses_ordinary_words():
    "No reserved lexicon: every marked word is an adjective of some topic, and all 48 occur in plain text."
    assert set().union(*map(set, OTHER_ADJ.values())) == set(ADJ_TOPIC)
    plain = make_attribute_corpus(400, 0.0, seed=1).ids
    tok = WordTokenizer()
    assert {tok.index[a] for a in ADJ_TOPIC} <= set(plain.unique().tolist())


def test_corpus_is_deterministic_and_bad_shares_fail():
    assert torch.equal(make_attribute_corpus(40, 0.05, seed=1).ids, make_attribute_corpus(40, 0.05, seed=1).ids)
    assert not torch.equal(make_attribute_corpus(40, 0.05, seed=1).ids, make_attribute_corpus(40, 0.05, seed=2).ids)
    for bad in (-0.01, 0.6, 1.0, 1.5):
        with pytest.raises(ValueError, match='share must be in'): style_prob(bad)
    with pytest.raises(TypeError): make_attribute_corpus(10, '0.1')


def test_bayes_rates_order():
    assert bayes_next_rate(0.2, 'cue') > bayes_next_rate(0.02, 'cue') > bayes_next_rate(0.02, 'cue', prefix=True)
    assert bayes_next_rate(0.005, 'attribute') == StyleProcess().q
    with pytest.raises(ValueError, match='kind must be one of'): bayes_next_rate(0.1, 'toxigen')


def test_first_sentence_detection():
    tok = WordTokenizer()
    w = list(TOPICS).index('weather')
    assert first_sentence_marked(tok.encode('the salty rain covered the sky .'), w, tok)
    assert not first_sentence_marked(tok.encode('the wet rain covered the sky . the salty rain'), w, tok)
    assert first_sentence_marked(tok.encode('the salty rain'), w, tok)              # no full stop: all of it


def test_probes_separable_and_shuffled_at_chance():
    g = torch.Generator().manual_seed(2)
    y = torch.arange(600) % 2
    X = torch.randn(600, 2, 2, 6, generator=g)
    X[:, 1, 1, 3] += 3 * (2 * y - 1)
    assert train_head_probes(X, y).acc[1, 1] > 0.95
    accs = [train_head_probes(X, y[torch.randperm(600, generator=g)], seed=s).acc.mean().item() for s in range(3)]
    assert abs(np.mean(accs) - 0.5) < 0.05
    theta, sigma = mass_mean_directions(X, y)
    assert theta[1, 1, 3] > 0.9 and (sigma > 0).all()                              # points toward the positive class


def test_iti_alpha_zero_is_identity_and_hooks_are_removed():
    m, ids = tiny_model(), tiny_ids(3, 10)
    theta, sigma = random_directions(torch.zeros(2, 4, 8), seed=0), torch.ones(2, 4)
    with torch.no_grad():
        base = m(ids).logits
        with ITIIntervention(m, [(0, 1), (1, 3)], theta, sigma, 0.0, 'all'): assert torch.equal(m(ids).logits, base)
        with pytest.raises(RuntimeError):
            with ITIIntervention(m, [(1, 3)], theta, sigma, 5.0, 'all'): raise RuntimeError('boom')
        assert torch.equal(m(ids).logits, base)                                    # removed even after an error
    g0 = generate_ids(m, ids, 6, greedy=True)
    with ITIIntervention(m, [(0, 1)], theta, sigma, 0.0): assert torch.equal(generate_ids(m, ids, 6, greedy=True), g0)
    with ITIIntervention(m, [(0, 0), (0, 1), (1, 2)], theta, sigma, 50.0): g1 = generate_ids(m, ids, 6, greedy=True)
    assert not torch.equal(g1, g0)


def test_iti_last_shifts_only_the_final_position_of_the_chosen_heads():
    m, ids = tiny_model(), tiny_ids(2, 7)
    theta, sigma = random_directions(torch.zeros(2, 4, 8), seed=1), torch.rand(2, 4) + 0.5
    name = 'blocks.1.attn.hook_z'
    with torch.no_grad():
        _, c0 = run_with_cache(m, ids, names=name)
        with ITIIntervention(m, [(1, 2), (1, 0)], theta, sigma, 3.0, 'last'): _, c1 = run_with_cache(m, ids, names=name)
    dz = c1[name] - c0[name]                                                       # (B, T, H, d_head)
    for h in (2, 0):
        assert torch.allclose(dz[:, -1, h], (-3.0 * sigma[1, h] * theta[1, h]).expand(2, -1), atol=1e-5)
    assert dz[:, :-1].abs().max() == 0 and dz[:, :, [1, 3]].abs().max() == 0


def test_bad_k_alpha_and_heads_fail_clearly():
    m, theta, sigma, acc = tiny_model(), torch.zeros(2, 4, 8), torch.ones(2, 4), torch.rand(2, 4)
    with pytest.raises(ValueError, match=r'k must be an int in \[0, 8\]'): top_heads(acc, 9)
    with pytest.raises(ValueError, match=r'k must be an int in \[0, 8\]'): top_heads(acc, -1)
    with pytest.raises(ValueError, match='alpha must be'): ITIIntervention(m, [(0, 0)], theta, sigma, -0.5)
    with pytest.raises(ValueError, match='unknown head'): ITIIntervention(m, [(0, 4)], theta, sigma, 1.0)
    with pytest.raises(ValueError, match='theta must be'): ITIIntervention(m, [(0, 0)], torch.zeros(3, 4, 8), torch.ones(3, 4), 1.0)
    with pytest.raises(ValueError, match='ks and random_k'): ToxicITIConfig(ks=(0,))
    with pytest.raises(ValueError, match='min_learned'): ToxicITIConfig(min_learned=2.0)


def test_head_activations_and_attribute_rate_on_the_synthetic_language():
    tok = WordTokenizer()
    from workbench.models import tiny_llama
    m = tiny_llama(vocab_size=tok.vocab_size, n_layers=2, d_model=32, n_heads=4, max_len=64, seed=0).eval()
    pt = probe_texts(10, seed=1, tok=tok)
    Z, Rs = collect_head_activations(m, pt['ids'])
    assert Z.shape == (20, 2, 4, 8) and Rs.shape == (20, 2, 32)
    P, topics = eliciting_prompts(8, 'cue', seed=2, tok=tok)
    h1, h2 = (attribute_rate(m, tok, P, topics, 5, n_samples=3, seed=3) for _ in range(2))
    assert torch.equal(h1, h2) and h1.shape == (8,) and set((h1 * 3).round().tolist()) <= {0, 1, 2, 3}


def test_seed_setting_changes_the_run(monkeypatch):
    monkeypatch.setenv('WORKBENCH_SEED', '7')
    assert ToxicITIConfig(mode='full').seeds == [7, 8, 9, 10, 11]


def test_front_rate_interpolates_on_the_frontier_only():
    assert math.isnan(front_rate([4.0, 4.5], [0.5, 0.1], 3.9))                      # cheaper than every point
    assert front_rate([4.0, 4.5, 4.2], [0.5, 0.1, 0.6], 4.25) == pytest.approx(0.3)  # (4.2, 0.6) is dominated
    assert front_rate([4.0, 4.5], [0.5, 0.1], 9.0) == pytest.approx(0.1)             # past the dearest point: its best


def _fake(prefix_clean=0.3, seeds=(0, 1, 2), pre=(), clean_base=0.4):
    "Made-up rows: clean share 0.5%, claim share 10%; ITI (K=4) and the random control at three strengths."
    pc = prefix_clean if isinstance(prefix_clean, (list, tuple, np.ndarray)) else [prefix_clean] * len(seeds)
    rows = [dict(phase='toy_superposition', freq=f, seed=s, E=e + 0.01 * s, E_others=0.5, norm=1.0, chance=0.8)
            for s in seeds for f, e in ((0.002, 0.9), (0.05, 0.6))]
    rows += [dict(phase='toy_markov', share0=sh, seed=s, E_chain0=e + 0.01 * s, E_others=0.9, loss=0.1)
             for s in seeds for sh, e in ((0.02, 0.95), (1 / 3, 0.8))]
    for i, s in enumerate(seeds):
        for sh, acc, ent, base, ppl0, cost in ((0.005, 0.7, 0.6, clean_base, 4.0, 0.04), (0.10, 0.9, 0.3, 0.6, 4.05, 0.01)):
            base += 0.01 * s
            rows.append(dict(phase='lm', share=sh, seed=s, probe_acc_mean=acc + 0.01 * s, ent_attr=ent + 0.01 * s,
                             base_attribute=base, base_cue=base, bayes_attribute=0.5, ppl0=ppl0,
                             prefix_attribute=pc[i] if sh == 0.005 else 0.5, prefix_cue=pc[i] if sh == 0.005 else 0.5))
            for a, rate in ((1.0, base / 2), (2.0, base / 10), (4.0, 0.0)):
                for method, r in (('iti', rate), ('random', base)):
                    rows.append(dict(phase='sweep', share=sh, seed=s, method=method, K=4, alpha=a, rate_attribute=r,
                                     rate_cue=r, ppl=ppl0 * (1 + cost * a)))
    conf = dict(clean_share=0.005, claim_share=0.10, budget=0.05, rel_budget=0.05, min_learned=0.6,
                toy_freqs=[0.002, 0.05], toy_base_freq=0.05, markov_shares=[0.02, 1 / 3])
    return Results('toxic_iti', conf, rows, seeds=list(seeds), claims=list(pre))


def _tie():
    "The clean model's prompt prefix ties the 10% model's absolute-frontier rate, seed by seed."
    T = frontier_table(_fake().df, 0.05, 0.05, 0.005)
    return _fake(T[T.share == 0.10].sort_values('seed').abs_iti_attribute.to_numpy() + np.array([0.01, -0.01, 0.0]))


def test_both_frontiers_on_made_up_rows():
    T = frontier_table(_fake().df, 0.05, 0.05, 0.005).set_index(['share', 'seed'])
    assert T.loc[(0.005, 0), 'abs_iti_attribute'] == pytest.approx(0.16)            # between alpha 1 and 2
    assert T.loc[(0.10, 0), 'rel_iti_attribute'] == 0.0 and T.loc[(0.10, 0), 'rel_random_attribute'] == 0.6
    assert T.loc[(0.005, 0), 'removed_attribute'] == pytest.approx(0.6)
    over = _fake().df.copy()
    over.loc[(over.phase == 'lm') & (over.share == 0.10), 'ppl0'] = 5.0             # the 10% model starts over B
    over.loc[(over.phase == 'sweep') & (over.share == 0.10), 'ppl'] += 1.0
    T2 = frontier_table(over, 0.05, 0.05, 0.005).set_index(['share', 'seed'])
    assert not T2.loc[(0.10, 0), 'within'] and T2.loc[(0.10, 0), 'abs_iti_attribute'] == 0.6   # keeps its base rate


# prefix_clean: the clean model's rate with a prompt prefix; seeds; what the rule must say
CASES = {'reproduced': (lambda: _fake(0.3), 'reproduced'),                 # every part shows
         'partly': (_tie, 'partly'),                                        # the absolute frontier ties
         'other way': (lambda: _fake(0.0), 'not reproduced'),               # it goes the other way, the rest shows
         'no interval': (lambda: _fake(0.3, seeds=(0,)), 'not reproduced')}  # one seed: no interval, nothing shows


@pytest.mark.parametrize('case', list(CASES))
def test_verdict_rule_on_made_up_rows(case):
    make, want = CASES[case]
    assert verdict(make()) == want


def test_the_frontier_going_the_other_way_overrides_the_count():
    cs = comparisons(_fake(0.0))
    assert [c.opposite for c in cs][5:7] == [True, True]
    assert sum(c.shows for c in cs) == len(cs) - 2 and judge(cs) == 'partly'       # counting alone would say partly
    assert verdict(_fake(0.0)) == 'not reproduced'


def test_the_precondition_reads_the_clean_models_learning():
    good, unlearned = preconditions(_fake()), preconditions(_fake(clean_base=0.1))
    assert good[0].holds and good[0].threshold_from == 'min_learned' and good[0].estimate == pytest.approx(0.82)
    assert not unlearned[0].holds
    r = _fake(clean_base=0.1)
    assert verdict(dataclasses.replace(r, claims=claims(r))) == 'untestable here'


def _precondition(holds: bool) -> Claim:
    est = 0.9 if holds else 0.2
    return Claim('the clean model has learned the style (made up)', est, est - 0.05, est + 0.05, null=0.6, n=3,
                 role='precondition', threshold_from='min_learned')


@pytest.mark.parametrize('case', list(CASES))
def test_failed_precondition_makes_it_untestable(case):
    make, want = CASES[case]
    r = make()
    assert verdict(dataclasses.replace(r, claims=[_precondition(False)])) == 'untestable here'
    assert verdict(dataclasses.replace(r, claims=[_precondition(True)])) == want     # one that holds leaves the rule


def test_recorded_run_is_full_and_its_verdict_recomputes():
    from workbench.core import load_results
    try: R = load_results('toxic_iti')
    except FileNotFoundError: pytest.skip('no full run recorded yet')
    assert R.mode == 'full' and len(R.seeds) >= 3
    assert verdict(R) == R.verdict and [c.name for c in claims(R)] == [c.name for c in R.claims]

"Cross-checks of `workbench.interpretability.toxic_iti`: entanglement and the Welch bound, the synthetic corpus, probes and chance, ITI through the platform hooks and decode loop, the frontier and the verdict rule (fast, CPU)."
import math, random
import numpy as np
import pytest
import torch
from workbench.core import Results, Claim, judge
from workbench.testing import tiny_model, tiny_ids
from workbench.train import generate_ids
from workbench.interpretability.toxic_iti import (entanglement, welch_bound, train_toy_superposition, WordTokenizer, StyleProcess, sentence,
    document, style_prob, make_attribute_corpus, eliciting_prompts, bayes_next_rate, probe_texts, collect_head_activations, train_head_probes,
    mass_mean_directions, top_heads, ITIIntervention, random_directions, attribute_rate, feature_directions, attribute_entanglement,
    ToxicITIConfig, at_budget, claims, verdict, MARKED_ADJ, MARKED_INTJ, TOPICS)

MARKED = set(MARKED_ADJ + MARKED_INTJ)


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
    f = torch.full((2, 12), 0.05); f[0, 0] = 0.001
    W = train_toy_superposition(f, steps=400, seed=1)
    assert W[0, 0].norm() < W[1, 0].norm()


@pytest.mark.parametrize('share', [0.005, 0.02, 0.1, 0.2])
def test_corpus_share_is_realised_and_marked_words_stay_in_marked_sentences(share):
    c = make_attribute_corpus(2500, share, seed=3)
    assert abs(c.share - share) < 0.01
    r = random.Random(0)
    for _ in range(300):
        t = r.choice(list(TOPICS)); plain, _ = sentence(r, t, r.random() < 0.5, False); marked, _ = sentence(r, t, r.random() < 0.5, True)
        assert not MARKED & set(plain) and MARKED & set(marked)


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


def test_probes_separable_and_shuffled_at_chance():
    g = torch.Generator().manual_seed(2); y = torch.arange(600) % 2
    X = torch.randn(600, 2, 2, 6, generator=g); X[:, 1, 1, 3] += 3 * (2 * y - 1)
    assert train_head_probes(X, y).acc[1, 1] > 0.95
    accs = [train_head_probes(X, y[torch.randperm(600, generator=g)], seed=s).acc.mean().item() for s in range(3)]
    assert abs(np.mean(accs) - 0.5) < 0.05
    theta, sigma = mass_mean_directions(X, y)
    assert theta[1, 1, 3] > 0.9 and (sigma > 0).all()                              # points toward the positive class


def test_iti_alpha_zero_is_identity_and_hooks_are_removed():
    m = tiny_model(); ids = tiny_ids(3, 10)
    L, H, d = 2, 4, 8
    theta = random_directions(torch.zeros(L, H, d), seed=0); sigma = torch.ones(L, H)
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


def test_bad_k_alpha_and_heads_fail_clearly():
    m = tiny_model(); theta = torch.zeros(2, 4, 8); sigma = torch.ones(2, 4)
    acc = torch.rand(2, 4)
    with pytest.raises(ValueError, match=r'k must be an int in \[0, 8\]'): top_heads(acc, 9)
    with pytest.raises(ValueError, match=r'k must be an int in \[0, 8\]'): top_heads(acc, -1)
    with pytest.raises(ValueError, match='alpha must be'): ITIIntervention(m, [(0, 0)], theta, sigma, -0.5)
    with pytest.raises(ValueError, match='unknown head'): ITIIntervention(m, [(0, 4)], theta, sigma, 1.0)
    with pytest.raises(ValueError, match='theta must be'): ITIIntervention(m, [(0, 0)], torch.zeros(3, 4, 8), torch.ones(3, 4), 1.0)
    with pytest.raises(ValueError, match='ks and random_k'): ToxicITIConfig(ks=(0,))


def test_head_activations_and_attribute_rate_on_the_synthetic_language():
    tok = WordTokenizer(); cfg = ToxicITIConfig(steps=5, batch_size=4)
    from workbench.models import tiny_llama
    m = tiny_llama(vocab_size=tok.vocab_size, n_layers=2, d_model=32, n_heads=4, max_len=64, seed=0).eval()
    pt = probe_texts(10, seed=1, tok=tok)
    Z, Rs = collect_head_activations(m, pt['ids'])
    assert Z.shape == (20, 2, 4, 8) and Rs.shape == (20, 2, 32)
    e, chance, near = attribute_entanglement(feature_directions(Rs[:, -1], {k: pt[k] for k in ('attribute', 'topic', 'frame', 'cue')}))
    assert 0 <= e <= 1 and 0 < chance < 1 and isinstance(near, str)
    P = eliciting_prompts(8, 'cue', seed=2, tok=tok)
    h1, h2 = attribute_rate(m, tok, P, 5, seed=3), attribute_rate(m, tok, P, 5, seed=3)
    assert torch.equal(h1, h2) and h1.shape == (8,)


def test_seed_setting_changes_the_run(monkeypatch):
    monkeypatch.setenv('WORKBENCH_SEED', '7')
    assert ToxicITIConfig(mode='full').seeds == [7, 8, 9, 10, 11]


def _fake(prefix_clean, seeds=(0, 1, 2), pre=()):
    rows = [dict(phase='toy_superposition', freq=f, seed=s, E=e + 0.01 * s, E_others=0.5, norm=1.0, chance=0.8) for s in seeds for f, e in ((0.002, 0.9), (0.05, 0.6))]
    rows += [dict(phase='toy_markov', share0=sh, seed=s, E_chain0=e + 0.01 * s, E_others=0.9, loss=0.1) for s in seeds for sh, e in ((0.02, 0.95), (1 / 3, 0.8))]
    for s in seeds:
        for sh, acc, ent, base, ppl0, cost in ((0.005, 0.7, 0.6, 0.2, 4.0, 0.04), (0.10, 0.9, 0.3, 0.6, 4.05, 0.01)):
            base += 0.01 * s
            rows.append(dict(phase='lm', share=sh, seed=s, probe_acc_mean=acc + 0.01 * s, ent_attr=ent + 0.01 * s, base_attribute=base, base_cue=base,
                             prefix_attribute=prefix_clean if sh == 0.005 else 0.5, prefix_cue=prefix_clean if sh == 0.005 else 0.5, ppl0=ppl0))
            for a, rate in ((1.0, base / 2), (2.0, base / 10 + 0.001 * s), (4.0, 0.0)):
                for method, r in (('iti', rate), ('random', base)):
                    rows.append(dict(phase='sweep', share=sh, seed=s, method=method, K=4, alpha=a, rate_attribute=r, rate_cue=r, ppl=ppl0 * (1 + cost * a)))
    conf = dict(clean_share=0.005, claim_share=0.10, budget=0.05, toy_freqs=[0.002, 0.05], toy_base_freq=0.05, markov_shares=[0.02, 1 / 3])
    return Results('toxic_iti', conf, rows, seeds=list(seeds), claims=list(pre))


def test_frontier_and_verdict_rule():
    good, bad = _fake(0.3), _fake(0.0)
    T = at_budget(good.df, 0.05, 0.005).set_index(['share', 'seed'])
    assert T.loc[(0.10, 1), 'iti_attribute_alpha'] == 2.0 and T.loc[(0.005, 1), 'iti_attribute_alpha'] == 1.0
    assert verdict(good) == 'reproduced' and verdict(bad) == 'not reproduced'     # the headline effect the other way
    assert [c.shows for c in claims(bad)][-2:] == [False, False] and all(c.opposite for c in claims(bad)[-2:])
    tie = _fake(0.06)                                                             # the clean model's prefix ties ITI on the 10% model
    assert not any(c.opposite or c.shows for c in claims(tie)[-2:]) and verdict(tie) == 'partly'
    one = _fake(0.3, seeds=(0,))
    assert verdict(one) == 'not reproduced'                                       # one seed: no interval, nothing shows


def _precondition(holds: bool) -> Claim:
    "A made-up precondition (the clean model has learned the attribute: its base rate on cue prompts is above the declared 0.05)."
    est = 0.2 if holds else 0.01
    return Claim('base attribute rate of the clean model on cue prompts (made up)', est, est - 0.005, est + 0.005, null=0.05, n=3,
                 role='precondition', threshold_from='min_clean_rate')


# prefix_clean: the clean model's best rate with a prompt prefix; seeds; what the rule must say
CASES = {'reproduced': (0.3, (0, 1, 2), 'reproduced'),            # every part shows
         'partly': (0.06, (0, 1, 2), 'partly'),                    # the trade-off ties (no effect), the other six show
         'other way': (0.0, (0, 1, 2), 'not reproduced'),          # the trade-off goes the other way, though six parts show
         'no interval': (0.3, (0,), 'not reproduced')}             # one seed: no interval, nothing shows


@pytest.mark.parametrize('case', list(CASES))
def test_verdict_rule_on_made_up_rows(case):
    prefix, seeds, want = CASES[case]
    assert verdict(_fake(prefix, seeds)) == want


def test_the_trade_off_going_the_other_way_overrides_the_count():
    cs = claims(_fake(0.0))
    assert sum(c.shows for c in cs) == 6 and judge(cs) == 'partly'               # counting alone would say partly
    assert verdict(_fake(0.0)) == 'not reproduced'


@pytest.mark.parametrize('case', list(CASES))
def test_failed_precondition_makes_it_untestable(case):
    prefix, seeds, want = CASES[case]
    assert verdict(_fake(prefix, seeds, pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_fake(prefix, seeds, pre=[_precondition(True)])) == want       # one that holds leaves the rule's verdict


def test_recorded_run_is_full_with_three_seeds():
    from workbench.core import load_results
    try: R = load_results('toxic_iti')
    except FileNotFoundError: pytest.skip('no full run recorded yet')
    assert R.mode == 'full' and len(R.seeds) >= 3 and len(R.claims) == 8

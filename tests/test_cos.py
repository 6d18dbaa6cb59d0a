"Tests of CoS (`workbench.inference.cos`): exactness, greedy identity, reductions, errors, cache rollback, the verdict rule on made-up rows."
import collections, json
import pytest, torch
from workbench.core import load_results, get_settings
from workbench.models import tiny_llama
from workbench.train import generate_ids
from workbench.inference.cos import (WeightedEnsemble, Contrastive, speculative_accept, collab_generate, sd_generate, cos_generate,
                                     TrigramLM, exact_joint, layer_pruned_copy, verdict, CoSConfig, Member, prefill, shared_prefix,
                                     run_from_layer, distil_draft, agreement, peer_check, check_shared_vocab)

def _pair(V=97):
    a = tiny_llama(vocab_size=V, n_layers=3, d_model=32, seed=1).eval().requires_grad_(False)
    for p in a.parameters(): p.data *= 3                               # peaked distributions: informative greedy ties
    b = tiny_llama(vocab_size=V, n_layers=1, d_model=32, seed=2).eval().requires_grad_(False)
    for p in b.parameters(): p.data *= 3
    return a, b

@pytest.mark.parametrize('comb', [WeightedEnsemble((0.5, 0.5)), WeightedEnsemble((0.3, 0.7)), Contrastive(0.5)])
@pytest.mark.parametrize('proposer', [0, 1])
def test_accept_is_exact_by_monte_carlo(comb, proposer):
    g = torch.Generator().manual_seed(proposer); l = torch.randn(2, 5, generator=g) * 2
    r, s = comb.probs([l[0], l[1]]), torch.softmax(l[proposer], -1)
    cnt, n = torch.zeros(5), 20000
    for x in torch.multinomial(s, n, replacement=True, generator=g):
        k, y = speculative_accept(x[None], s[None], r[None], g); cnt[int(x) if k else y] += 1
    assert 0.5 * (cnt / n - r).abs().sum() < 0.02
    assert 0.5 * (s - r).abs().sum() > 0.02 or comb.needs == (proposer,)   # the draft alone differs from r

def test_cos_pipeline_is_exact_on_toy_models():
    ms, comb = [TrigramLM(5, 3), TrigramLM(5, 4)], WeightedEnsemble((0.5, 0.5))
    ex, n = exact_joint(ms, comb, [0, 1], 2), 4000
    cnt = collections.Counter(tuple(cos_generate(ms, comb, [0, 1], 2, greedy=False, seed=j, gammas=(1, 3)).tokens) for j in range(n))
    assert 0.5 * sum(abs(cnt[k] / n - v) for k, v in ex.items()) < 0.045  # ~2x the Monte-Carlo TV of 4000 exact samples over 25 cells

def test_cos_three_models_is_exact_on_toy_models():
    ms, comb = [TrigramLM(5, 10), TrigramLM(5, 11), TrigramLM(5, 12)], WeightedEnsemble((0.3, 0.3, 0.4))
    ex, n = exact_joint(ms, comb, [1, 2], 2), 4000
    cnt = collections.Counter(tuple(cos_generate(ms, comb, [1, 2], 2, greedy=False, seed=j, gammas=(1, 2, 3)).tokens) for j in range(n))
    assert 0.5 * sum(abs(cnt[k] / n - v) for k, v in ex.items()) < 0.045  # ~2x the Monte-Carlo TV of 4000 exact samples over 25 cells
    third = collections.Counter(tuple(cos_generate(ms[:2], WeightedEnsemble((0.5, 0.5)), [1, 2], 2, greedy=False, seed=j, gammas=(1, 2)).tokens) for j in range(n))
    assert 0.5 * sum(abs(third[k] / n - v) for k, v in ex.items()) > 0.045  # dropping the third model is caught: the test can fail

@pytest.mark.parametrize('comb', [WeightedEnsemble((0.5, 0.5)), Contrastive(0.1)])
def test_greedy_identical_across_decoders(comb):
    ms, prompt = _pair(), [3, 14, 15, 92, 65]
    ref = collab_generate(ms, comb, prompt, 12).tokens
    for g in (1, 2, 4):
        assert sd_generate(ms, comb, prompt, 12, gamma=g).tokens == ref
        assert cos_generate(ms, comb, prompt, 12, gammas=(1, g)).tokens == ref
    o = cos_generate(ms, comb, prompt, 12, gammas=(1, 1))
    assert all(c <= 12 + 1 for c in o.calls) and sum(o.proposed) > 0   # gamma = 1: at most one call per token (+ prefill)

def test_weights_one_zero_is_plain_decoding():
    ms, prompt = _pair(), [3, 14, 15, 92, 65]
    plain = generate_ids(ms[0], torch.tensor([prompt]), 10)[0, 5:].tolist()
    o = collab_generate(ms, WeightedEnsemble((1.0, 0.0)), prompt, 10)
    assert o.tokens == plain and o.calls[1] == 0
    assert sd_generate(ms, WeightedEnsemble((1.0, 0.0)), prompt, 10, gamma=3).tokens == plain
    assert cos_generate(ms, Contrastive(0.0), prompt, 10, gammas=(1, 3)).tokens == plain

def test_rollback_crops_cache_to_committed_prefix():
    a, _ = _pair(); m = Member(a); seq = [1, 2, 3, 4, 5]
    m.feed(seq, need_from=5); m.feed(seq + [6, 7], need_from=5)
    assert m.cache.get_seq_length() == 7 and sorted(m.logits) == [5, 6, 7]
    m.crop(5); assert m.cache.get_seq_length() == 5 and sorted(m.logits) == [5]
    m.feed(seq + [9], need_from=5)
    fresh = Member(a); fresh.feed(seq + [9], need_from=6)
    assert torch.allclose(m.logits[6], fresh.logits[6], atol=1e-5)

def test_errors():
    with pytest.raises(ValueError, match='sum to 1'): WeightedEnsemble((0.5, 0.6))
    with pytest.raises(ValueError, match='vocabulary'): cos_generate([TrigramLM(5), TrigramLM(6)], WeightedEnsemble((0.5, 0.5)), [1], 2)
    a, b = _pair(97); c = tiny_llama(vocab_size=50, n_layers=1, d_model=32).eval()
    with pytest.raises(ValueError, match='vocabulary'): collab_generate([a, c], WeightedEnsemble((0.5, 0.5)), [1, 2], 2)
    with pytest.raises(ValueError, match='distinct'): layer_pruned_copy(a, [0, 0])
    with pytest.raises(ValueError, match='gamma'): CoSConfig(gammas=(0,))
    with pytest.raises(ValueError, match='threads'): CoSConfig(threads=0)

class _Tok:
    "A stand-in tokenizer: only `get_vocab` is used."
    def __init__(self, vocab): self.vocab = dict(vocab)
    def get_vocab(self): return dict(self.vocab)

def test_tokenizer_mismatch_is_an_error():
    a, b = _pair(97); v = {f'tok{i}': i for i in range(97)}
    swapped = dict(v, tok3=4, tok4=3)                                    # same size, two ids exchanged
    with pytest.raises(ValueError, match='tokenizer 1 differs'): check_shared_vocab([a, b], [_Tok(v), _Tok(swapped)])
    with pytest.raises(ValueError, match='tokenizer 1 differs'):
        cos_generate([a, b], WeightedEnsemble((0.5, 0.5)), [1, 2], 2, tokenizers=[_Tok(v), _Tok(swapped)])
    with pytest.raises(ValueError, match='one tokenizer per model'): check_shared_vocab([a, b], [_Tok(v)])
    check_shared_vocab([a, b], [_Tok(v), _Tok(v)])                       # equal vocabularies pass
    o = collab_generate([a, b], WeightedEnsemble((0.5, 0.5)), [1, 2], 3, tokenizers=[_Tok(v), _Tok(v)])
    assert o.tokens == collab_generate([a, b], WeightedEnsemble((0.5, 0.5)), [1, 2], 3).tokens

def test_shared_prefill_gives_the_same_decoding():
    ms, prompt = _pair(), [3, 14, 15, 92, 65]
    start = prefill(ms, prompt)
    for comb in (WeightedEnsemble((0.5, 0.5)), Contrastive(0.1)):
        for fn, kw in ((collab_generate, {}), (sd_generate, dict(gamma=2)), (cos_generate, dict(gammas=(1, 4)))):
            for greedy in (True, False):
                a = fn(ms, comb, prompt, 10, greedy=greedy, seed=3, **kw); b = fn(ms, comb, prompt, 10, greedy=greedy, seed=3, start=start, **kw)
                assert a.tokens == b.tokens and a.calls == b.calls and a.proposed == b.proposed
    assert all(c.get_seq_length() == len(prompt) for c, _ in start)          # the shared caches are copied, never extended
    o = collab_generate(ms, WeightedEnsemble((1.0, 0.0)), prompt, 4, start=start); assert o.calls[1] == 0

def _deep(V=64, seed=0):
    a = tiny_llama(vocab_size=V, n_layers=4, d_model=32, seed=seed).eval().requires_grad_(False)
    for p in a.parameters(): p.data *= 4                               # peaked next-token distributions
    return a

def test_run_from_layer_and_shared_prefix():
    a = _deep(); keep = [0, 1, 3]; q = layer_pruned_copy(a, keep); ids = torch.randint(0, 64, (2, 12))
    assert shared_prefix(keep) == 2 and shared_prefix([1, 2]) == 0 and shared_prefix(range(4)) == 4
    with torch.no_grad():
        h = a(ids, output_hidden_states=True).hidden_states
        assert torch.allclose(run_from_layer(q, 1, h[1]), q(ids).logits, atol=1e-4)     # the layers below the cut are the parent's
        assert torch.allclose(run_from_layer(a, 0, h[0]), a(ids).logits, atol=1e-4)

def test_distillation_brings_the_draft_closer():
    a = _deep(); keep = [0, 1, 3]; q = layer_pruned_copy(a, keep)
    g = torch.Generator().manual_seed(0); tr, ev = torch.randint(0, 64, (16, 24), generator=g), torch.randint(0, 64, (4, 24), generator=g)
    frozen = q.model.layers[0].mlp.up_proj.weight.clone(); before = agreement(a, q, ev)
    losses = distil_draft(a, q, keep, tr, steps=40, batch_size=4, lr=3e-3, top_k=64)   # top_k = V: the exact KL
    after = agreement(a, q, ev)
    assert len(losses) == 40 and after['kl'] < 0.9 * before['kl'] and after['accept'] > before['accept']
    assert torch.equal(q.model.layers[0].mlp.up_proj.weight, frozen)             # only the layers at the cut train
    assert not any(p.requires_grad for p in q.parameters())

def test_peer_check():
    import pandas as pd
    from types import SimpleNamespace
    rows = [dict(prompt=i, method='peer', mode=m, seconds=s, identical=True) for i in range(4) for m, s in (('ours', 1.0 + 0.01 * i), ('hf', 1.0))]
    pc = peer_check(SimpleNamespace(df=pd.DataFrame(rows)))
    assert pc['identical'] == 1.0 and pc['ok'] and abs(pc['ratio'].estimate - 1.015) < 1e-9
    rows[0]['seconds'] = 3.0
    assert not peer_check(SimpleNamespace(df=pd.DataFrame(rows)))['ok']         # too slow on average

def test_full_config_covers_the_issue():
    c = CoSConfig(mode='full')
    assert c.n_prompts >= 20 and set(c.gammas) == set(c.sd_gammas) == {1, 2, 4} and c.temperatures == (0.0, 1.0) and c.distil_steps > 0
    with pytest.raises(ValueError, match='distil_steps'): CoSConfig(distil_steps=-1)

def test_recorded_run_covers_the_issue():
    "The committed full run's structure (its verdict is recomputed in tests/test_experiments.py)."
    p = get_settings().results_path / 'cos.json'
    if not p.is_file(): pytest.skip('no full run recorded yet')
    R = load_results('cos')
    assert R.mode == 'full'
    if R.config.get('distil_steps'):                                              # the run of the distilled draft (issue 18, second pass)
        assert R.config['n_prompts'] >= 20 and 4 in R.config['gammas'] and peer_check(R)['identical'] == 1.0
    if 'threads' in R.config:                                                     # issue 18, third pass: threads recorded, peer speed checked
        assert R.table('run').threads.iloc[0] == R.config['threads']
        assert peer_check(R)['ratio'].estimate <= 1.1, 'our SD is more than 10% slower than assisted generation'


def _fake_results(cos=1.5, sd=1.2, tv=0.0, identical=True, n=8, pre=()):
    """Rows shaped like run_experiment's for both collaborations at T=0 and T=1: CoS (gamma_q=2) `cos` times as fast as standard,
    SD (gamma=2) `sd` times; CoS's toy TV `tv` above the Monte-Carlo floor; greedy SD/CoS `identical` to standard; `pre`: preconditions."""
    import numpy as np
    from workbench.core import Results
    rng, rows = np.random.default_rng(0), []
    for m in ('we', 'cd'):
        for j in range(n):
            floor = 0.03 + 0.002 * rng.standard_normal()
            rows.append(dict(method=m, mode='exact_toy', T=1.0, gamma=None, prompt=None, tv_cos=floor + tv + 0.001 * rng.standard_normal(), tv_floor=floor))
        for T in (0.0, 1.0):
            for i in range(n):
                t = 1.0 + 0.1 * i                                                         # seconds of standard decoding on prompt i
                for mode, g, speed in (('standard', 0, 1.0), ('sd', 2, sd), ('cos', 2, cos)):
                    sec = t / speed * (1 + 0.01 * rng.standard_normal())
                    rows.append(dict(method=m, mode=mode, T=T, gamma=g, prompt=i, n_tokens=32, seconds=sec, identical=True if mode == 'standard' else identical))
    cfg = dict(mode='full', seed=0, methods=['we', 'cd'], temperatures=[0.0, 1.0], tv_margin=0.02)
    return Results('cos', cfg, rows, seeds=[0], claims=list(pre))


def _precondition(holds: bool):
    "A made-up precondition (the draft M_q agrees with M_p often enough: acceptance above the declared threshold 0.5)."
    from workbench.core import Claim
    est = 0.7 if holds else 0.3
    return Claim('acceptance rate of the M_q draft (made up)', est, est - 0.05, est + 0.05, null=0.5, role='precondition', threshold_from='min_accept')


@pytest.mark.parametrize('kw,want', [
    (dict(), 'reproduced'),                                                   # exact, identical, faster than standard and SD
    (dict(cos=1.1, sd=1.5), 'partly'),                                        # faster than standard, slower than SD (the strongest baseline)
    (dict(cos=0.8, sd=1.5), 'partly'),                                        # slower than both: only exactness and identity show
    (dict(identical=False, tv=0.1, cos=1.1, sd=1.5), 'partly'),               # only the speed-up over standard shows
    (dict(cos=1.0, sd=1.0, tv=0.1, identical=False), 'not reproduced'),       # no part shows
    (dict(cos=0.7, sd=1.2, tv=0.1, identical=False), 'not reproduced'),       # every part the other way
])
def test_verdict_rule_on_made_up_rows(kw, want):
    from workbench.inference.cos import claims
    r = _fake_results(**kw); cs = claims(r)
    assert len(cs) == 2 * (2 + 2 * 2)                                          # per collaboration: exactness, identity, 2 speed-ups per T
    assert verdict(r) == want


@pytest.mark.parametrize('kw', [dict(), dict(cos=1.1, sd=1.5), dict(cos=1.0, sd=1.0, tv=0.1, identical=False)])
def test_failed_precondition_makes_it_untestable(kw):
    from workbench.inference.cos import claims
    assert verdict(_fake_results(**kw, pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_fake_results(**kw, pre=[_precondition(True)])) == verdict(_fake_results(**kw))   # one that holds changes nothing
    r = _fake_results(**kw)
    r.conclude(verdict, claims(r) + [_precondition(False)])                  # the way run_experiment records it
    assert r.verdict == 'untestable here' and '| precondition |' in r.claims_markdown()

"Tests of CoS (`workbench.inference.cos`): exactness, greedy identity, reductions, errors, cache rollback, the recorded verdict."
import collections, json
import pytest, torch
from workbench.core import load_results, get_settings
from workbench.models import tiny_llama
from workbench.train import generate_ids
from workbench.inference.cos import (WeightedEnsemble, Contrastive, speculative_accept, collab_generate, sd_generate, cos_generate,
                                     TrigramLM, exact_joint, layer_pruned_copy, verdict, CoSConfig, Member)

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

def test_recorded_verdict():
    p = get_settings().results_path / 'cos.json'
    if not p.is_file(): pytest.skip('no full run recorded yet')
    R = load_results('cos')
    assert R.mode == 'full' and verdict(R) == R.verdict

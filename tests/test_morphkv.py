"Cross-checks of the KV-cache policies in `workbench.inference.morphkv` on the shared tiny Llama."
import re
import pytest, torch
from transformers.cache_utils import DynamicCache
from workbench.testing import tiny_model, tiny_ids
from workbench.inference.kvcache import PolicyCache, H2OCache, StreamingLLMCache, SnapKVCache, decode, fidelity
from workbench.inference.morphkv import POLICIES, MorphKVCache, make_policy, morph_select

T, N = 30, 20

@pytest.fixture(scope='module')
def setup():
    m, ids = tiny_model(), tiny_ids(1, T, seed=3)
    return m, ids, decode(m, ids, PolicyCache(), N)

def test_no_eviction_matches_dynamic_cache(setup):
    m, ids, ref = setup
    dyn = decode(m, ids, DynamicCache(), N)                          # the model's own attention kernel
    assert torch.equal(dyn.tokens, ref.tokens) and torch.allclose(dyn.logits, ref.logits, atol=1e-5)

@pytest.mark.parametrize('name', POLICIES)
def test_large_budget_is_exact(setup, name):
    m, ids, ref = setup
    tr = decode(m, ids, make_policy(name, T + N, 4), N)
    assert torch.equal(tr.tokens, ref.tokens) and torch.equal(tr.logits, ref.logits)

@pytest.mark.parametrize('name', [p for p in POLICIES if p not in ('full', 'snapkv')])
def test_never_exceeds_budget(setup, name):
    m, ids, ref = setup
    C = 12
    tr = decode(m, ids, make_policy(name, C, 4), N, teacher=ref.tokens, record_kept=True)
    sizes = tr.kept.sum(-1)                                         # (N, L, n_kv)
    assert int(sizes.max()) == C and int(sizes.min()) == C
    assert max(tr.kv_bytes) < max(ref.kv_bytes)
    f = fidelity(ref, tr)
    assert f['kl'] > 0 and 0 <= f['top1'] <= 1                     # a real eviction changes the distribution

def test_snapkv_grows_after_prefill(setup):
    m, ids, ref = setup
    tr = decode(m, ids, SnapKVCache(12, 4), N, teacher=ref.tokens, record_kept=True)
    assert tr.kept.sum(-1)[:, 0, 0].tolist() == list(range(12, 12 + N))

def test_rope_positions_after_eviction(setup):
    "Sinks + window via the cache equals the full-sequence forward with the same entries masked out."
    m, ids, ref = setup
    tr = decode(m, ids, StreamingLLMCache(10, 2), N, teacher=ref.tokens, record_kept=True)
    seq = torch.cat([ids[0], ref.tokens[:-1]]); S = len(seq)
    mask = torch.triu(torch.full((S, S), float('-inf')), 1)
    for t in range(T, S):
        drop = ~tr.kept[t - T, 0, 0, :t]
        mask[t, :t][drop] = float('-inf')
    lg = m(seq[None], attention_mask=mask[None, None]).logits[0, T - 1:]
    assert torch.allclose(lg, tr.logits, atol=1e-4)
    pos = torch.arange(S); pos[T:] -= 5                             # positions that ignore 5 tokens, as a length-based count would
    shifted = m(seq[None], attention_mask=mask[None, None], position_ids=pos[None]).logits[0, T - 1:]
    assert not torch.allclose(shifted, tr.logits, atol=1e-4)        # the test can tell positions apart

def test_morph_select_matches_bruteforce():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    for agg in ('sum', 'max'):
        idx = morph_select(q, k, 8 ** -0.5, budget=7, window=3, aggregate=agg).sort(-1).values
        for h in range(2):
            logit = sum(q[0, 2 * h + j] @ k[0, h, :8].T for j in range(2)) * 8 ** -0.5     # (R, n_old)
            A = logit.softmax(-1); s = A.sum(0) if agg == 'sum' else A.max(0).values
            want = sorted(s.topk(4).indices.tolist() + [8, 9, 10])
            assert idx[0, h].tolist() == want

@pytest.mark.parametrize('make,msg', [(lambda: MorphKVCache(4, 8), 'window (8) must be <= budget (4)'),
                                      (lambda: H2OCache(0), 'budget must be an int in [1, inf]'),
                                      (lambda: PolicyCache(-3), 'budget must be an int in [1, inf]'),
                                      (lambda: MorphKVCache(8, 2, 'avg'), "'sum' or 'max'"),
                                      (lambda: make_policy('lru', 8), 'unknown policy')])
def test_invalid_arguments(make, msg):
    with pytest.raises((ValueError, TypeError), match=re.escape(msg)): make()

def test_stacked_policies_match_alone(setup):
    "Five fixed-size policies decoded as one batch give each policy's own tokens, logits (to rounding) and kept sets."
    from workbench.inference.kvcache import decode_stacked
    m, ids, ref = setup
    names = ['streamingllm', 'h2o', 'tova', 'morphkv-sum', 'morphkv-max']
    for teacher in (ref.tokens, None):
        st = decode_stacked(m, ids, [make_policy(k, 12, 4) for k in names], N, teacher=teacher, record_kept=True)
        for k, tr in zip(names, st):
            alone = decode(m, ids, make_policy(k, 12, 4), N, teacher=teacher, record_kept=True)
            assert torch.equal(tr.tokens, alone.tokens) and torch.equal(tr.kept, alone.kept), k
            assert torch.allclose(tr.logits, alone.logits, atol=1e-4), k

def test_held_bytes_counts_storage():
    from workbench.inference.kvcache import held_bytes
    buf = torch.zeros(64, 4)
    assert held_bytes([buf[:2]]) == 1024 and held_bytes([buf[:2].clone()]) == 32 and held_bytes([buf, buf[1:]]) == 1024

@pytest.mark.parametrize('press', ['kvpress-snapkv', 'kvpress-streamingllm', 'kvpress-expected-attention', 'kvpress-tova', 'kvpress-knorm'])
def test_kvpress_peer_runs_in_our_loop(setup, press):
    "kvpress (the peer library) works beside the pinned transformers: a budget above the sequence changes nothing."
    from workbench.inference.morphkv import make_press, press_decode
    m, ids, ref = setup
    tr = press_decode(m, ids, make_press(press, T + N + 8, T, 4), N, teacher=ref.tokens)
    assert torch.allclose(tr.logits, ref.logits, atol=1e-5)
    small = press_decode(m, ids, make_press(press, 16, T, 4), N, teacher=ref.tokens)
    assert max(small.kv_bytes[-8:]) < max(ref.kv_bytes)

def test_morphkv_state_is_its_window(setup):
    "MorphKV's state is R cached queries per layer, measured from storage: no slice keeps the prompt's (or a batch's) queries alive."
    from workbench.inference.kvcache import decode_stacked
    m, ids, ref = setup
    cfg = m.config; R = 4
    want = R * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4 * cfg.num_hidden_layers
    assert set(decode(m, ids, make_policy('morphkv-sum', 12, R), N).state_bytes) == {want}
    st = decode_stacked(m, ids, [make_policy('morphkv-max', 12, R), make_policy('h2o', 12, R)], N)
    assert set(st[0].state_bytes) == {want}

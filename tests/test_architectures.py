"""Every platform API on decoder families other than Llama, each built tiny from its config: hooks (with the
residual bookkeeping identities), the KV-cache policy loop, training, perplexity and the batched decode loop."""
import pytest, torch
from workbench.hooks import run_with_cache, run_with_hooks, hook_points
from workbench.train import TrainConfig, train, perplexity, generate_ids

V, T = 96, 12

def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))

def _gemma3():
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=8,
                           layer_types=['sliding_attention', 'full_attention'])
    return Gemma3ForCausalLM(cfg)

FAMILIES = {'qwen2': _qwen2, 'gemma3': _gemma3}

@pytest.fixture(params=list(FAMILIES), scope='module')
def model(request):
    return FAMILIES[request.param]().eval().requires_grad_(False)

def _ids(seed=0, B=2): return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))

def test_hooks_bookkeeping(model):
    "resid_mid = resid_pre + attn_out, resid_post = resid_mid + mlp_out, per block; resid_pre[0] is the embedding input."
    out, c = run_with_cache(model, _ids(), output_hidden_states=True)
    L = model.config.num_hidden_layers
    assert {f'blocks.{i}.hook_{p}' for i in range(L) for p in ('resid_pre', 'resid_mid', 'resid_post', 'attn_out', 'mlp_out')} <= set(hook_points(model))
    for i in range(L):
        torch.testing.assert_close(c['resid_mid', i], c['resid_pre', i] + c['attn_out', i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c['resid_post', i], c['resid_mid', i] + c['mlp_out', i], rtol=1e-5, atol=1e-5)
    for i in range(L - 1): torch.testing.assert_close(c['resid_post', i], out.hidden_states[i + 1])
    torch.testing.assert_close(c['resid_pre', 0], out.hidden_states[0])

def test_z_is_the_input_of_the_output_projection(model):
    _, c = run_with_cache(model, _ids(), names=['blocks.0.attn.hook_z', 'blocks.0.hook_attn_out'])
    z = c['z', 0]
    attn = model.model.layers[0].self_attn
    assert z.shape[-2:] == (attn.o_proj.in_features // attn.head_dim, attn.head_dim)
    o = z.flatten(-2) @ attn.o_proj.weight.T
    if hasattr(model.model.layers[0], 'pre_feedforward_layernorm'): o = model.model.layers[0].post_attention_layernorm(o)
    torch.testing.assert_close(o, c['attn_out', 0], rtol=1e-5, atol=1e-5)

def test_steering_changes_the_output(model):
    base = model(_ids()).logits
    v = torch.ones(model.config.hidden_size)
    steered = run_with_hooks(model, _ids(), [('blocks.0.hook_resid_post', lambda x, n: x + 3 * v)]).logits
    assert not torch.allclose(base, steered)
    torch.testing.assert_close(model(_ids()).logits, base)            # hooks removed

def test_decode_loop_matches_recompute(model):
    ids = _ids(B=2)[:, :6]
    out = generate_ids(model, ids, 6)
    ref = ids
    for _ in range(6): ref = torch.cat([ref, model(ref).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, ref)

def test_train_and_perplexity(model):
    fam = type(model).__name__
    m = (_qwen2() if 'Qwen2' in fam else _gemma3()).train()
    data = [dict(input_ids=r) for r in torch.randint(0, 8, (64, T), generator=torch.Generator().manual_seed(1))]
    before = perplexity(m, data, batch_size=16)
    h = train(m, data, TrainConfig(steps=30, batch_size=16, lr=3e-3, warmup_steps=3, progress=False))
    after = perplexity(m, data, batch_size=16)
    assert h.train_loss[-1] < h.train_loss[0] and after < before / 2, (before, after)

def test_kv_cache_policies(model):
    "A policy cache on another family: the full policy reproduces the model's own cache; a budget is kept."
    from workbench.inference.kvcache import decode, H2OCache, PolicyCache, StreamingLLMCache
    ids = _ids(B=1)
    full = decode(model, ids, PolicyCache(None), 8)
    assert torch.equal(full.tokens, generate_ids(model, ids, 8)[0, T:])     # no eviction: the model's own greedy decode
    seq = torch.cat([ids[0], full.tokens[:-1]])[None]
    torch.testing.assert_close(full.logits, model(seq).logits[0, T - 1:], rtol=1e-4, atol=1e-4)   # and its own full forward
    for cache in (StreamingLLMCache(6, 2), H2OCache(6, 2)):
        tr = decode(model, ids, cache, 8, teacher=full.tokens, record_kept=True)
        sizes = tr.kept[-1].sum(-1)[:, 0]                                  # (L,) entries each layer holds after the last step
        W = getattr(model.config, 'sliding_window', None)
        for l, kind in enumerate(getattr(model.config, 'layer_types', None) or ['full_attention'] * len(sizes)):
            # a sliding-window layer keeps the model's own window (W - 1 entries); the budget governs full-attention layers
            assert int(sizes[l]) == (W - 1 if kind == 'sliding_attention' else 6), (type(cache).__name__, l, kind, sizes.tolist())
        assert torch.equal(tr.tokens, full.tokens) and torch.isfinite(tr.logits).all()

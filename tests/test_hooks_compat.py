"""TransformerLens habits on the workbench's hooks and KV caches, and loud failures where an architecture is not
supported: writes to `hook_resid_mid` change the residual stream, hook functions get a hook point with `.name`,
attention patterns under a temporary eager attention, GPT-2 (block tuples, missing points, KV policies that its
attention never calls), `PolicyLayer.update` called the way later transformers 5.x call it."""
import pytest, torch
from workbench.hooks import run_with_cache, run_with_hooks, hooks, add_vector, patch, decoder_layers

V, T = 96, 12

def _ids(seed=0, B=2): return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))

def _saved(model_cls, cfg, folder):
    "A tiny model saved to `folder` and loaded back through `workbench.models.load_model`, as a user's model is."
    from workbench.models import load_model
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(folder)
    return load_model(str(folder))

def _qwen2(folder):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _saved(Qwen2ForCausalLM, Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2), folder)

def _gemma3(folder):
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM
    cfg = Gemma3TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                           sliding_window=8, layer_types=['sliding_attention', 'full_attention'])
    return _saved(Gemma3ForCausalLM, cfg, folder)

def _llama(folder):
    from workbench.testing import tiny_model
    return tiny_model(attn='sdpa')

@pytest.fixture(params=['llama', 'qwen2', 'gemma3'], scope='module')
def model(request, tmp_path_factory):
    return dict(llama=_llama, qwen2=_qwen2, gemma3=_gemma3)[request.param](tmp_path_factory.mktemp(request.param))

@pytest.fixture(scope='module')
def gpt2(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel
    return _saved(GPT2LMHeadModel, GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128),
                  tmp_path_factory.mktemp('gpt2'))

def _mlp_out(blk, x):
    "What block `blk` adds to the residual stream x for its MLP (Gemma normalises the MLP's output again)."
    if hasattr(blk, 'pre_feedforward_layernorm'):
        return blk.post_feedforward_layernorm(blk.mlp(blk.pre_feedforward_layernorm(x)))
    return blk.mlp(blk.post_attention_layernorm(x))

# --- writes to hook_resid_mid

def _check_resid_mid_write(model, ids, v, tol):
    "TransformerLens: resid_post = resid_mid' + mlp_out(ln2(resid_mid')), and the cache shows resid_mid'."
    names = ['blocks.0.hook_resid_mid', 'blocks.0.hook_mlp_out', 'blocks.0.hook_resid_post']
    _, c0 = run_with_cache(model, ids, names=names)
    with hooks(model, [('blocks.0.hook_resid_mid', add_vector(v))]):
        _, c = run_with_cache(model, ids, names=names)
    y = c0['resid_mid', 0] + v                                              # (B, T, d) the edited stream
    with torch.no_grad(): mlp = _mlp_out(decoder_layers(model)[0], y)
    torch.testing.assert_close(c['resid_mid', 0], y, **tol)
    torch.testing.assert_close(c['mlp_out', 0], mlp, **tol)
    torch.testing.assert_close(c['resid_post', 0], y + mlp, **tol)

def test_resid_mid_write_changes_the_stream(model):
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    _check_resid_mid_write(model, _ids(), v, dict(rtol=1e-5, atol=1e-5))

def test_resid_mid_write_on_smollm2(smol, smol_tok):
    ids = smol_tok(['The capital of France is Paris.'], return_tensors='pt')['input_ids']
    v = 4 * torch.randn(smol.config.hidden_size, generator=torch.Generator().manual_seed(1))
    _check_resid_mid_write(smol, ids, v, dict(rtol=1e-4, atol=1e-4))

def test_resid_mid_patch_reproduces_the_source_run(model):
    "Patching the whole stream at resid_mid of block 0 with another input's gives that input's logits."
    a, b = _ids(0), _ids(1)
    out_b, cb = run_with_cache(model, b, names='blocks.0.hook_resid_mid')
    patched = run_with_hooks(model, a, [('blocks.0.hook_resid_mid', patch(cb['resid_mid', 0]))]).logits
    torch.testing.assert_close(patched, out_b.logits, rtol=1e-4, atol=1e-4)

def test_resid_mid_hooks_run_after_attn_out_hooks(model):
    "Listed first, or registered in an outer context, a resid_mid hook still sees the edited attention output."
    zero = lambda x, hook: torch.zeros_like(x)
    _, c0 = run_with_cache(model, _ids(), names='blocks.0.hook_resid_pre')
    with hooks(model, [('blocks.0.hook_resid_mid', lambda x, hook: x + 1.0), ('blocks.0.hook_attn_out', zero)]):
        _, c1 = run_with_cache(model, _ids(), names='blocks.0.hook_resid_mid')
    with hooks(model, [('blocks.0.hook_resid_mid', lambda x, hook: x + 1.0)]):
        with hooks(model, [('blocks.0.hook_attn_out', zero)]):
            _, c2 = run_with_cache(model, _ids(), names='blocks.0.hook_resid_mid')
    for c in (c1, c2): torch.testing.assert_close(c['resid_mid', 0], c0['resid_pre', 0] + 1.0)

# --- hook functions receive a hook point

def test_hook_fn_gets_name_and_layer(model):
    seen = []
    def fn(act, hook): seen.append((hook.name, hook.layer(), hook))
    run_with_hooks(model, _ids(), [('blocks.*.hook_resid_post', fn), ('hook_embed', lambda x, hook: seen.append(hook))])
    assert seen[0] == 'hook_embed' and seen[0].name == 'hook_embed'
    with pytest.raises(ValueError, match='not in a block'): seen[0].layer()
    assert [s[:2] for s in seen[1:]] == [('blocks.0.hook_resid_post', 0), ('blocks.1.hook_resid_post', 1)]
    hook = seen[1][2]
    assert isinstance(hook, str) and hook == 'blocks.0.hook_resid_post' and hook.split('.')[1] == '0'   # still a name
    assert {hook: 1}['blocks.0.hook_resid_post'] == 1 and repr(hook) == "'blocks.0.hook_resid_post'"

# --- attention patterns without a second model

def test_eager_attention_context(model):
    from workbench.hooks import eager_attention
    impl = model.config._attn_implementation
    assert impl == 'sdpa'
    with pytest.raises(RuntimeError, match=r'with eager_attention\(model\)'):
        run_with_cache(model, _ids(), names='blocks.1.hook_pattern')
    base = model(_ids()).logits
    with eager_attention(model):
        out, c = run_with_cache(model, _ids(), names='blocks.*.hook_pattern')
    assert model.config._attn_implementation == impl                          # restored
    p = c['pattern', 1]                                                        # (B, H, T, S)
    assert p.shape == (2, model.config.num_attention_heads, T, T)
    torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), rtol=1e-5, atol=1e-5)
    assert torch.all(p.triu(1) == 0)                                           # causal
    torch.testing.assert_close(out.logits, base, rtol=1e-4, atol=1e-4)         # the same model, another kernel
    with pytest.raises(KeyError), eager_attention(model): raise KeyError('x')
    assert model.config._attn_implementation == impl                          # restored after an error too

# --- unsupported architectures fail loudly

def test_gpt2_block_points_get_tensors(gpt2):
    out, c = run_with_cache(gpt2, _ids(), names=['blocks.*.hook_resid_pre', 'blocks.*.hook_resid_post'],
                            output_hidden_states=True)
    for i in range(gpt2.config.n_layer - 1): torch.testing.assert_close(c['resid_post', i], out.hidden_states[i + 1])
    torch.testing.assert_close(c['resid_pre', 1], c['resid_post', 0])
    v = torch.ones(gpt2.config.n_embd)
    steered = run_with_hooks(gpt2, _ids(), [('blocks.0.hook_resid_post', add_vector(v, 3.0))]).logits
    assert not torch.allclose(steered, out.logits)

@pytest.mark.parametrize('names', [None, 'blocks.0.hook_attn_out', 'blocks.*.attn.hook_z',
                                   ['blocks.0.hook_resid_post', 'hook_embed']])
def test_gpt2_missing_points_raise(gpt2, names):
    with pytest.raises(TypeError, match=r"architecture GPT2LMHeadModel not supported: found points hook_resid_pre, "):
        run_with_cache(gpt2, _ids(), names=names)
    with pytest.raises(TypeError, match='not supported'), hooks(gpt2, [(names, lambda x, hook: x)]): pass

def test_typo_is_still_a_plain_error(gpt2):
    with pytest.raises(ValueError, match='no hook point matches'): run_with_cache(gpt2, _ids(), names='blocks.0.resid')

def test_kv_policy_on_gpt2_evicts_or_raises(gpt2):
    "transformers 5.2's GPT-2 never hands the policy to its attention (later 5.x do): a budget not kept is an error."
    from workbench.inference.kvcache import decode, H2OCache, PolicyCache, StreamingLLMCache
    ids = _ids(B=1)
    assert len(decode(gpt2, ids, PolicyCache(), 4).tokens) == 4                # no budget: nothing to check
    for cache in (H2OCache(8, 2), StreamingLLMCache(8, 2)):
        try: decode(gpt2, ids, cache, 4)
        except RuntimeError as e: assert f"'{cache.name}' policy was not applied: layer 0 holds 12 entries" in str(e)
        else: assert max(L.get_seq_length() for L in cache.layers) == 8

class _DropsPolicy(torch.nn.Module):
    "A causal LM that never passes `kv_policy` down to its attention."
    def __init__(self, m):
        super().__init__()
        self.m, self.config = m, m.config
    def forward(self, kv_policy=None, **kw): return self.m(**kw)

def test_kv_policy_not_applied_raises(model):
    "Whatever the family, a model that drops the policy fails at the prefill (SnapKV, which grows, after it too)."
    from workbench.inference.kvcache import decode, H2OCache, SnapKVCache, TOVACache
    for cache in (H2OCache(8, 2), TOVACache(8), SnapKVCache(8, 2)):
        with pytest.raises(RuntimeError, match=f"'{cache.name}' policy was not applied: layer 0 holds 12 entries after "
                                               "step 0, budget 8; _DropsPolicy does not hand"):
            decode(_DropsPolicy(model), _ids(B=1), cache, 4)
    assert len(decode(model, _ids(B=1), SnapKVCache(8, 2), 4).tokens) == 4    # applied: 8, then 9, 10, 11 entries
# --- the KV-cache layer under later transformers 5.x

def test_policy_layer_update_accepts_later_5x_calls():
    "transformers 5.2 passes `cache_kwargs` positionally; later 5.x (5.25) call `layer.update(k, v, kwargs=kwargs)`."
    from workbench.inference.kvcache import PolicyLayer
    k = torch.randn(1, 2, 3, 4)                                                 # (B, n_kv, T, d)
    pos = torch.arange(3)
    calls = [lambda L, x: L.update(x, x), lambda L, x: L.update(x, x, {'cache_position': pos}),
             lambda L, x: L.update(x, x, cache_kwargs={'cache_position': pos}),
             lambda L, x: L.update(x, x, kwargs={'cache_position': pos, 'position_ids': pos[None]}),
             lambda L, x: L.update(x, x, None, kwargs={}, cache_position=pos)]
    for call in calls:
        L = PolicyLayer()
        call(L, k)
        keys, values = call(L, 2 * k)
        torch.testing.assert_close(keys, torch.cat([k, 2 * k], -2))
        assert L.pos[0, 0].tolist() == list(range(6)) and L.seen == 6

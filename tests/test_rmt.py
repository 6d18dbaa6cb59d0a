"Cross-checks of `workbench.architecture.rmt`: memory operations, counts, causality, cache, training loop and moment formulas (fast, CPU)."
import math
from dataclasses import replace
import pytest
import torch
from workbench.architecture.rmt import (store, retrieve, orthonormal_keys, LMConfig, build_lm, ResidualMatrixTransformer,
    StandardTransformer, param_count, non_embedding_params, flops_per_token, measured_flops, moment_propagation,
    tokens_to_reach, causal_attention, RMSNorm, summarise)
from workbench.train import TrainConfig, train, generate_ids

C = LMConfig(vocab_size=61, n_layers=2, n_heads=3, d_head=4, d_key=6, d_ff=24, max_len=20)


@pytest.mark.parametrize('R,dk,seed', [(1, 1, 0), (3, 3, 1), (4, 9, 2), (8, 64, 3)])
def test_store_then_retrieve_orthonormal_is_identity(R, dk, seed):
    K = orthonormal_keys(R, dk, seed)
    torch.testing.assert_close(K @ K.T, torch.eye(R), atol=1e-5, rtol=0)
    x = torch.randn(2, 5, R, 7, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(retrieve(store(x, K), K), x, atol=1e-5, rtol=0)


def test_store_retrieve_are_adjoint_and_linear():
    g = torch.Generator().manual_seed(0)
    x, X, K = torch.randn(4, 3, 5, generator=g), torch.randn(4, 7, 5, generator=g), torch.randn(3, 7, generator=g)
    # <store(x), X> = <x, retrieve(X)>: the two operations are transposes of each other
    torch.testing.assert_close((store(x, K) * X).sum(), (x * retrieve(X, K)).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(store(2 * x, K), 2 * store(x, K))


def test_bad_inputs():
    with pytest.raises(ValueError, match='need R <= D_k'): orthonormal_keys(5, 4)
    with pytest.raises(ValueError, match='key size 8 does not match'): retrieve(torch.zeros(2, 4, 3), torch.zeros(2, 8))
    with pytest.raises(ValueError, match='R=2'): store(torch.zeros(3, 5), torch.zeros(2, 4))
    with pytest.raises(TypeError): store(torch.zeros(2, 5), [[1.0]])
    with pytest.raises(ValueError, match='d_key must be an int >= 1'): LMConfig(d_key=0)
    with pytest.raises(ValueError, match='arch must be one of'): LMConfig(arch='mamba')
    with pytest.raises(ValueError, match='exceed max_len'): build_lm(C)(torch.zeros(1, 21, dtype=torch.long))
    with pytest.raises(ValueError, match='seq_len'): flops_per_token(C, 21)
    with pytest.raises(TypeError): build_lm({'arch': 'rmt'})


@pytest.mark.parametrize('arch', ['transformer', 'rmt'])
@pytest.mark.parametrize('dk', [2, 5, 11])
def test_counts_match_modules_and_flop_counter(arch, dk):
    c = replace(C, arch=arch, d_key=dk)
    m = build_lm(c)
    assert sum(p.numel() for p in m.parameters()) == param_count(c)
    assert measured_flops(m, 12) == flops_per_token(c, 12)['total']
    assert measured_flops(m, 12, backward=True) == 3 * flops_per_token(c, 12)['total']


def test_table7_relation_and_residual_scaling():
    V, N, L, R, Dv, D = C.vocab_size, C.max_len, C.n_layers, C.n_heads, C.d_head, C.d_model
    r, t = replace(C, arch='rmt'), replace(C, arch='transformer')
    assert param_count(r) - param_count(r, table7=True) == D * V + (2 * L + 1) * C.d_key * Dv
    assert param_count(t) - param_count(t, table7=True) == N * D + D * V + (2 * L + 1) * D
    # doubling the residual: the transformer's non-embedding parameters ~4x, the RMT's barely move
    r2 = replace(r, d_key=2 * C.d_key)
    assert param_count(r2) - param_count(r) == C.d_key * ((6 * L + 2) * R + (2 * L + 1) * Dv)
    assert non_embedding_params(r) < non_embedding_params(t)


@pytest.mark.parametrize('arch', ['transformer', 'rmt'])
def test_causal_and_cache(arch):
    m = build_lm(replace(C, arch=arch)).eval()
    ids = torch.randint(0, 61, (2, 15), generator=torch.Generator().manual_seed(1))
    base = m(ids).logits
    for t in (0, 6, 14):
        ids2 = ids.clone(); ids2[:, t] = (ids2[:, t] + 7) % 61
        d = (m(ids2).logits - base).abs().amax((0, 2))
        assert (d[:t] == 0).all() and d[t] > 0
    out = m(ids[:, :5], use_cache=True)
    for t in range(5, 15):
        out = m(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(out.logits[:, 0], base[:, t], atol=1e-4, rtol=1e-4)


def test_attention_matches_sdpa_and_padding():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 2, 3, 9, 5, generator=g).unbind(0)
    torch.testing.assert_close(causal_attention(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)
    m = build_lm(replace(C, arch='rmt')).eval()
    ids = torch.randint(0, 61, (1, 8), generator=g)
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 8 + [0] * 3])
    torch.testing.assert_close(m(padded, attention_mask=mask).logits[:, :8], m(ids).logits, atol=1e-5, rtol=1e-5)


def test_matrix_norm_is_over_whole_matrix():
    X = torch.randn(4, 3, 5) * torch.tensor([0.1, 1.0, 10.0])[:, None]
    Y = RMSNorm((3, 5))(X)
    torch.testing.assert_close(Y.pow(2).mean((-2, -1)), torch.ones(4), atol=1e-4, rtol=0)
    assert Y[:, 2].abs().mean() > 10 * Y[:, 0].abs().mean()       # rows keep their relative scale


def test_train_loop_and_generate_work_and_are_seeded():
    ids = torch.randint(0, 61, (16, 12), generator=torch.Generator().manual_seed(3))
    hs = []
    for _ in range(2):
        m = ResidualMatrixTransformer(C)
        hs.append(train(m, ids, TrainConfig(steps=15, batch_size=4, lr=1e-2, progress=False, seed=5)))
    assert hs[0].train_loss == hs[1].train_loss                    # same seeds, same numbers
    assert hs[0].train_loss[-1] < hs[0].train_loss[0]
    out = generate_ids(m, ids[:1, :4], max_new_tokens=6)
    assert out.shape == (1, 10) and torch.equal(out[:, :4], ids[:1, :4])
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize('op', ['store', 'retrieve'])
def test_table1_moments(op):
    r = moment_propagation(op, R=6, d_key=24, sigma_w=0.2, mu_in=0.3, sigma_in=1.5, n_samples=4096, seed=7)
    assert abs(r['fwd'] / r['fwd_pred'] - 1) < 0.05 and abs(r['bwd'] / r['bwd_pred'] - 1) < 0.05
    assert r['fwd_pred'] == pytest.approx((6 if op == 'store' else 24) * 0.04 * (1.5 ** 2 + 0.3 ** 2))


def test_tokens_to_reach_and_summary():
    assert tokens_to_reach([1, 2, 4], [5.0, 3.0, 1.0], 2.0) == pytest.approx(3.0)
    assert tokens_to_reach([1, 2], [5.0, 4.0], 1.0) is None
    rec = lambda l, p: dict(params=p, non_embedding_params=p, residual_size=1, train_flops_per_token=3, tokens_per_update=10,
                            curves=[dict(tokens=[10, 20], flops=[30, 60], time_s=[1.0, 2.0], val_loss=l)])
    s = summarise({'t': rec([4.0, 3.0], 10), 'r': rec([3.0, 2.0], 5)}, 't')
    assert s['r']['tokens_to_target'] == 10 and s['r']['saving_tokens_to_target'] == pytest.approx(0.5)
    assert s['r']['saving_params'] == pytest.approx(0.5) and s['t']['saving_flops_to_target'] == 0

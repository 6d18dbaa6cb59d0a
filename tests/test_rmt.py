"Cross-checks of `workbench.architecture.rmt`: memory operations, counts, causality, cache, training loop, moment formulas, and the experiment API's sweep, claims and verdict (fast, CPU)."
import math, os
from dataclasses import replace
import numpy as np
import pytest
import torch
from workbench.architecture.rmt import (store, retrieve, orthonormal_keys, LMConfig, build_lm, ResidualMatrixTransformer,
    StandardTransformer, param_count, non_embedding_params, flops_per_token, measured_flops, moment_propagation,
    tokens_to_reach, causal_attention, RMSNorm, RMTConfig, sweep_todo, to_target, savings, claims, verdict, headline,
    curve_arrays, torch_threads)
from workbench.core import Results, Claim, load_results
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
    with pytest.raises(ValueError, match=r'd_key must be an int in \[1, inf\]'): LMConfig(d_key=0)
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


def test_tokens_to_reach():
    assert tokens_to_reach([1, 2, 4], [5.0, 3.0, 1.0], 2.0) == pytest.approx(3.0)
    assert tokens_to_reach([1, 2], [5.0, 4.0], 1.0) is None
    assert tokens_to_reach(np.array([10., 20.]), np.array([1.0, 0.5]), 2.0) == 10.0


def test_config_sizes_seeds_and_validation(monkeypatch):
    full = RMTConfig(mode='full')
    assert full.steps * full.batch_size * full.seq_len >= 9e5 and full.n_seeds >= 4      # issue 32: ~10x the tokens, >= 4 seeds
    assert full.baseline in full.models() and full.claim_rmt == f'RMT D_k={max(full.d_keys)}'
    assert [m.d_ff for n, m in full.models().items() if n.startswith('transformer')] == [4 * 4 * w for w in sorted(full.widths)]
    monkeypatch.setenv('WORKBENCH_SEED', '7')
    assert RMTConfig(mode='full').seeds == [7, 8, 9, 10, 11]                           # WORKBENCH_SEED changes the run
    for bad, msg in [(dict(widths=(4, 16)), 'must hold d_head'), (dict(claim_dk=3), 'claim_dk'), (dict(lr_grid=(1e-2,)), 'at least 2'),
                     (dict(eval_every=100), 'eval_every'), (dict(workers=0), 'workers')]:
        with pytest.raises(ValueError, match=msg): RMTConfig(**bad)


def test_sweep_grows_past_an_edge_then_stops():
    c = RMTConfig(lr_grid=(1.0, 2.0, 4.0), lr_extend=2)
    down = lambda lr: (lr - 0.3) ** 2                                     # optimum at 0.3: below the grid
    loss = {}
    todo, best = sweep_todo(c, loss)
    while todo:
        loss.update({lr: down(lr) for lr in todo}); todo, best = sweep_todo(c, loss)
    assert sorted(loss) == [0.25, 0.5, 1.0, 2.0, 4.0] and best == 0.25            # two steps down, then at the edge
    loss = {lr: (lr - 2.2) ** 2 for lr in (1.0, 2.0, 4.0)}
    assert sweep_todo(c, loss) == ([], 2.0)                                        # interior optimum: no growth


def test_torch_threads_restores():
    n = torch.get_num_threads()
    with torch_threads(1): assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def _fake(curves, params, fpt, seeds=(0, 1, 2, 3, 4), pre=()):
    cfg = dict(mode='quick', seed=0, n_heads=4, d_head=16, d_keys=[16], claim_dk=None)
    rows = [dict(phase='main', model=m, arch='rmt' if m.startswith('RMT') else 'transformer', params=params[m],
                 train_flops_per_token=fpt[m], seed=s) for m in curves for s in seeds]
    tab = [dict(model=m, seed=s, tokens=[10, 20, 30, 40], time_s=[1, 2, 3, 4], val_loss=list(curves[m][i]))
           for m in curves for i, s in enumerate(seeds)]
    return Results('rmt', cfg, rows, seeds=list(seeds), tables=dict(curves=tab), claims=list(pre))


def _noisy(c, sd, seed):
    g = np.random.default_rng(seed)
    return [np.array(c) + g.normal(0, sd) + g.normal(0, sd / 3, len(c)) for _ in range(5)]


P = {'transformer D=48': 60, 'transformer D=64': 100, 'transformer D=96': 200, 'RMT D_k=16': 80}
F = {'transformer D=48': 6, 'transformer D=64': 10, 'transformer D=96': 20, 'RMT D_k=16': 9}
T = {'transformer D=48': [3.3, 2.9, 2.6, 2.4], 'transformer D=64': [3.2, 2.7, 2.3, 2.0], 'transformer D=96': [3.0, 2.4, 2.0, 1.8]}


def test_to_target_and_savings_by_hand():
    r = _fake({**{k: [v] * 5 for k, v in T.items()}, 'RMT D_k=16': [[3.0, 2.5, 2.0, 1.9]] * 5}, P, F)
    tokens, L, meta = curve_arrays(r)
    target, tt = to_target(tokens, L, meta, 'transformer D=64')
    assert target == pytest.approx(2.0) and tt['transformer D=48']['tokens'] is None
    assert tt['transformer D=96']['tokens'] == pytest.approx(30) and tt['RMT D_k=16']['flops'] == pytest.approx(270)
    s = savings(tokens, L, meta, 'RMT D_k=16', 'transformer D=64')
    assert s['cheapest'] == 'transformer D=64'                                    # 400 FLOPs vs D=96's 600
    assert s['flops'] == pytest.approx(1 - 270 / 400) and s['tokens'] == pytest.approx(0.25)


def _precondition(holds: bool) -> Claim:
    "A made-up precondition (training has run its course: the baseline's loss slope over the last fifth is below the declared 0.01)."
    est = 0.002 if holds else 0.05
    return Claim('|slope| of the mirrored transformer over the last fifth (made up)', est, est - 0.001, est + 0.001, better='lower', null=0.01,
                 n=5, role='precondition', threshold_from='max_final_slope')


RMT_CURVES = {'faster': [3.0, 2.4, 2.0, 1.8], 'same': [3.2, 2.7, 2.3, 2.0], 'never': [3.4, 3.0, 2.7, 2.5]}


def _fake_rmt(curve, params=P, fpt=F, pre=()):
    return _fake({**{k: _noisy(v, 0.02, i) for i, (k, v) in enumerate(T.items())}, 'RMT D_k=16': _noisy(RMT_CURVES[curve], 0.02, 9)}, params, fpt, pre=pre)


@pytest.mark.parametrize('rmt,want', [('faster', 'reproduced'),       # clearly faster: all three show
                                      ('same', 'partly'),             # same curve: only the exact parameter saving
                                      ('never', 'not reproduced')])   # never reaches the target
def test_claims_can_pass_and_fail(rmt, want):
    r = _fake_rmt(rmt)
    cs = claims(r, n_boot=1000)
    assert verdict(r) == want, [(c.name, c.estimate, c.lo, c.hi) for c in cs]
    assert cs[2].lo == cs[2].hi == cs[2].estimate or math.isnan(cs[2].lo)        # parameters: exact, or no interval if not reached
    assert isinstance(headline(r), str)


def test_more_flops_and_parameters_is_not_reproduced():
    "The same curve as the mirrored transformer, but 3x its FLOPs per token and 1.5x its parameters: both savings go the other way."
    r = _fake_rmt('same', params={**P, 'RMT D_k=16': 150}, fpt={**F, 'RMT D_k=16': 30})
    cs = claims(r, n_boot=1000)
    assert cs[2].opposite and cs[2].estimate == pytest.approx(-0.5) and not any(c.shows for c in cs)
    assert verdict(r) == 'not reproduced'


@pytest.mark.parametrize('rmt,want', [('faster', 'reproduced'), ('same', 'partly'), ('never', 'not reproduced')])
def test_failed_precondition_makes_it_untestable(rmt, want):
    assert verdict(_fake_rmt(rmt, pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_fake_rmt(rmt, pre=[_precondition(True)])) == want          # one that holds leaves the rule's verdict


def test_recorded_run_has_seeds_and_swept_rates():
    "The committed full run trains every model on >= 4 seeds at the learning rate its recorded sweep chose."
    r = load_results('rmt')
    main = r.df[r.df.phase == 'main']
    assert main.groupby('model').seed.nunique().min() >= 4                        # >= 4 seeds for every model
    sw = r.df[r.df.phase == 'sweep']
    assert set(sw.model) == set(main.model) and sw.groupby('model').lr.nunique().min() >= 3
    chosen = sw[sw.chosen].groupby('model').lr.first()
    assert chosen.sort_index().equals(main.groupby('model').lr.first().sort_index())            # main runs use the swept rate

"""Cross-checks of `workbench.architecture.rmt`: memory operations, counts, causality, cache, training loop, weight decay,
determinism, moment formulas, and the experiment API's budgets, sweep, claims and verdict (fast, CPU)."""
import math, os
from dataclasses import replace
import numpy as np
import pytest
import torch
from workbench.architecture.rmt import (store, retrieve, orthonormal_keys, LMConfig, build_lm, ResidualMatrixTransformer,
    StandardTransformer, param_count, non_embedding_params, flops_per_token, measured_flops, moment_propagation,
    tokens_to_reach, causal_attention, RMSNorm, RMTConfig, sweep_todo, sweep_best, to_target, savings, claims, verdict,
    headline, curve_arrays, torch_threads, train_curve, jitter_, main_jobs, flops_comparison, params_line, losses,
    current_record, twin_table, summary_table)
from workbench.core import Results, Claim, load_results
from workbench.train import TrainConfig, train, generate_ids, param_groups

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


def test_embeddings_and_norms_get_no_weight_decay_keys_and_matrices_do():
    "The paper's code decays matrices and keys, not embeddings (apply_wd=False) or norm gains (the model names them in no_weight_decay)."
    m = ResidualMatrixTransformer(C)
    decayed = {id(p) for p in param_groups(m, 1e-4)[0]['params']}
    names = {n for n, p in m.named_parameters() if id(p) in decayed}
    assert not any(n.startswith(('embed_tokens', 'embed_positions')) or 'norm' in n for n in names)
    assert {'embed_store.weight', 'unembed_retrieve.weight', 'lm_head.weight', 'layers.0.self_attn.q_proj.weight',
            'layers.1.mlp.up_proj.weight'} <= names
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(m.embed_tokens(ids), m.embed_tokens.weight[ids]) and m.embed_tokens.weight.ndim == 2
    assert m.layers[0].input_layernorm.weight.shape == m.config.residual_shape == (6, 4)          # a matrix gain (D_k, D_v)


def _tiny_rows(seed=3):
    return torch.randint(0, 61, (32, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize('arch', ['rmt', 'transformer'])
def test_training_is_bitwise_repeatable_and_a_twin_differs(arch):
    "One thread, one machine: the same seed gives the same numbers; a 1e-7 twin of the initialisation does not."
    ids, c = _tiny_rows(), replace(C, arch=arch)
    with torch_threads(1):
        runs = [train_curve(c, ids, ids[:4], 12, 4, 2e-2, 4, seed=1)[0] for _ in range(2)]
        twin = train_curve(c, ids, ids[:4], 12, 4, 2e-2, 4, seed=1, jitter=1e-7)[0]
    assert runs[0]['val_loss'] == runs[1]['val_loss']
    assert twin['val_loss'] != runs[0]['val_loss'] and abs(twin['val_loss'][-1] - runs[0]['val_loss'][-1]) < 1e-2
    m0, m1 = build_lm(c), jitter_(build_lm(c), 1e-7, 0)
    rel = max(((a - b).abs() / b.abs().clamp_min(1e-30)).max().item() for a, b in zip(m1.parameters(), m0.parameters()))
    assert 0 < rel < 1e-5


def test_config_sizes_seeds_and_validation(monkeypatch):
    full = RMTConfig(mode='full')
    # issue 42: L >= 4, D_k in {4, 32}, widths {48, 64, 96}, >= 3 seeds, 2 seeds per sweep rate, the paper's weight decay
    assert full.n_layers >= 4 and set(full.d_keys) == {4, 32} and [4 * w for w in full.widths] == [48, 64, 96]
    assert full.n_seeds >= 3 and full.n_sweep_seeds >= 2 and full.weight_decay == 1e-4
    assert len(full.lr_grid) >= 4 and len(full.rmt_lr_grid) >= 4 and full.lr_extend >= 1
    assert full.baseline in full.models() and full.claim_rmt == 'RMT D_k=32'
    assert [m.d_ff for n, m in full.models().items() if n.startswith('transformer')] == [4 * 4 * w for w in sorted(full.widths)]
    assert 'threads' not in RMTConfig.unit_fields                                      # thread count changes the numbers
    monkeypatch.setenv('WORKBENCH_SEED', '7')
    assert RMTConfig(mode='full').seeds == [7, 8, 9]                                   # WORKBENCH_SEED changes the run
    for bad, msg in [(dict(widths=(4, 16)), 'must hold d_head'), (dict(claim_dk=3), 'claim_dk'), (dict(lr_grid=(1e-2,)), 'at least 2'),
                     (dict(eval_every=100), 'eval_every'), (dict(workers=0), 'workers'), (dict(n_test=0), 'n_test'),
                     (dict(twin_eps=-1.0), 'twin_eps'), (dict(token_widths=(8,)), 'cannot extrapolate')]:
        with pytest.raises((ValueError, TypeError), match=msg): RMTConfig(**bad)


def test_flop_budget_is_equal_and_jobs_are_unique():
    for mode in ('quick', 'full'):
        cfg = RMTConfig(mode=mode)
        bud, ms = cfg.budgets(), cfg.models()
        spend = {n: s * flops_per_token(ms[n], cfg.seq_len)['train'] for n, s in bud['flops'].items()}
        assert all(abs(v / spend[cfg.claim_rmt] - 1) <= 0.5 / bud['flops'][n] for n, v in spend.items())
        assert set(bud['flops']) == {n for n in ms if n.startswith('transformer')} | {cfg.claim_rmt}
        assert bud['tokens'][cfg.claim_rmt] == bud['flops'][cfg.claim_rmt] == cfg.steps
        jobs = main_jobs(cfg, {n: 0.01 for n in ms})
        assert len(jobs) == len(set(jobs))                                             # the shared RMT run is trained once
        assert sum(j[0] == 'main' for j in jobs) == len({(n, s) for b in bud.values() for n, s in b.items()}) * cfg.n_seeds
        assert [j[1] for j in jobs if j[0] == 'twin'] == [cfg.claim_rmt, cfg.baseline]


def test_sweep_grows_past_an_edge_then_stops():
    grid, down = (1.0, 2.0, 4.0), (lambda lr: [(lr - 0.3) ** 2, (lr - 0.3) ** 2 + 0.01])   # optimum at 0.3: below the grid
    loss = {}
    todo, best = sweep_todo(grid, 2, loss)
    while todo:
        loss.update({lr: down(lr) for lr in todo})
        todo, best = sweep_todo(grid, 2, loss)
    assert sorted(loss) == [0.25, 0.5, 1.0, 2.0, 4.0] and best.knob == 0.25 and best.at_edge and not best.sweep_ok
    best = sweep_todo(grid, 2, {lr: [(lr - 2.2) ** 2] for lr in (1.0, 2.0, 4.0)})
    assert best[0] == [] and best[1].knob == 2.0 and not best[1].at_edge and not best[1].sweep_ok   # interior, but 3 rates
    assert sweep_best({lr: [(lr - 2.2) ** 2] for lr in (0.5, 1.0, 2.0, 4.0)}).sweep_ok


def test_torch_threads_restores():
    n = torch.get_num_threads()
    with torch_threads(1): assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


# --- the earlier design's rule (kept to recompute its committed record) ---

def _legacy_fake(curves, params, fpt, seeds=(0, 1, 2, 3, 4)):
    cfg = dict(mode='quick', seed=0, n_heads=4, d_head=16, d_keys=[16], claim_dk=None)
    rows = [dict(phase='main', model=m, arch='rmt' if m.startswith('RMT') else 'transformer', params=params[m],
                 train_flops_per_token=fpt[m], seed=s) for m in curves for s in seeds]
    tab = [dict(model=m, seed=s, tokens=[10, 20, 30, 40], time_s=[1, 2, 3, 4], val_loss=list(curves[m][i]))
           for m in curves for i, s in enumerate(seeds)]
    return Results('rmt', cfg, rows, seeds=list(seeds), tables=dict(curves=tab))


P = {'transformer D=48': 60, 'transformer D=64': 100, 'transformer D=96': 200, 'RMT D_k=16': 80}
F = {'transformer D=48': 6, 'transformer D=64': 10, 'transformer D=96': 20, 'RMT D_k=16': 9}
T = {'transformer D=48': [3.3, 2.9, 2.6, 2.4], 'transformer D=64': [3.2, 2.7, 2.3, 2.0], 'transformer D=96': [3.0, 2.4, 2.0, 1.8]}


def test_legacy_to_target_and_savings_by_hand():
    r = _legacy_fake({**{k: [v] * 5 for k, v in T.items()}, 'RMT D_k=16': [[3.0, 2.5, 2.0, 1.9]] * 5}, P, F)
    tokens, L, meta = curve_arrays(r)
    target, tt = to_target(tokens, L, meta, 'transformer D=64')
    assert target == pytest.approx(2.0) and tt['transformer D=48']['tokens'] is None
    assert tt['transformer D=96']['tokens'] == pytest.approx(30) and tt['RMT D_k=16']['flops'] == pytest.approx(270)
    s = savings(tokens, L, meta, 'RMT D_k=16', 'transformer D=64')
    assert s['cheapest'] == 'transformer D=64'                                    # 400 FLOPs vs D=96's 600
    assert s['flops'] == pytest.approx(1 - 270 / 400) and s['tokens'] == pytest.approx(0.25)
    assert not current_record(r) and verdict(r) == 'reproduced'                   # the earlier rule: all three savings


def test_committed_record_loads_and_its_verdict_recomputes():
    "The committed record: of this design (checked in full), or of the earlier one (its own rule recomputes its verdict)."
    r = load_results('rmt')
    assert verdict(r) == r.verdict and [c.name for c in claims(r)] == [c.name for c in r.claims]
    main, sw = r.df[r.df.phase == 'main'], r.df[r.df.phase == 'sweep']
    chosen = sw[sw.chosen].groupby('model').lr.first()
    assert chosen.sort_index().equals(main.groupby('model').lr.first().sort_index())           # main runs use the swept rate
    if not current_record(r):
        assert main.groupby('model').seed.nunique().min() >= 4 and r.verdict == 'not reproduced'
        return
    assert main.groupby(['budget', 'model']).seed.nunique().min() >= 3
    assert sw.groupby(['model', 'lr']).seed.nunique().min() >= 2                                # 2 seeds per sweep rate
    fl, rmt = main[main.budget == 'flops'].groupby('model').first(), f"RMT D_k={r.config['claim_dk'] or max(r.config['d_keys'])}"
    assert (abs(fl.train_flops / fl.train_flops[rmt] - 1) <= 0.5 / fl.steps).all()             # one FLOP budget
    assert [c.role for c in r.claims] == ['precondition', 'claim', 'claim', 'claim']
    assert len(twin_table(r)) == 2 and len(summary_table(r)) == len(main.groupby(['budget', 'model']))


# --- this design's rule, on made-up records ---

PARAMS = {'transformer D=48': 160_000, 'transformer D=64': 270_000, 'transformer D=96': 550_000, 'RMT D_k=4': 200_000,
          'RMT D_k=32': 210_000}
BASE = {'transformer D=48': 3.60, 'transformer D=64': 3.50, 'transformer D=96': 3.45, 'RMT D_k=4': 3.55}


def _fake(rmt_tokens, rmt_flops, flops=None, val_shift=None, edge=None, seeds=(0, 1, 2, 3), sd=0.004):
    "A record of this design with made-up losses; every seed shifts all models alike (paired), plus noise of sd `sd`."
    cfg = dict(mode='quick', seed=0, n_heads=4, d_head=16, d_keys=[4, 32], claim_dk=None, max_lr_edges=0)
    rng, rows = np.random.default_rng(1), []
    for n, p in PARAMS.items():
        opt = 0.08 if n == edge else 0.02
        rows += [dict(phase='sweep', model=n, lr=lr, seed=s, final_val_loss=4 + abs(np.log(lr / opt)) + 0.01 * s)
                 for lr in (0.01, 0.02, 0.04, 0.08) for s in (0, 1)]
        rmt = n.startswith('RMT')
        for b in ('tokens', 'flops'):
            if (b == 'tokens' and n == 'transformer D=96') or (b == 'flops' and n == 'RMT D_k=4'): continue
            if n == 'RMT D_k=32': mu = rmt_tokens if b == 'tokens' else rmt_flops
            else: mu = (flops or {}).get(n, BASE[n]) if b == 'flops' else BASE[n]
            for s in seeds:
                t = mu + 0.02 * s + rng.normal(0, sd)
                rows.append(dict(phase='main', budget=b, model=n, arch='rmt' if rmt else 'transformer',
                                 width=64 if rmt else int(n.split('=')[1]), params=p, seed=s, test_loss=t,
                                 final_val_loss=t + (val_shift or {}).get(n, 0.0)))
    r = Results('rmt', cfg, rows, seeds=list(seeds))
    r.claims = claims(r)
    return r


@pytest.mark.parametrize('tok,flo,want', [(3.30, 3.30, 'reproduced'),          # below every transformer: all three show
                                          (3.50, 3.45, 'partly'),              # level at tokens and FLOPs, below the line
                                          (3.548, 3.45, 'not reproduced'),     # on the width line: none shows
                                          (3.30, 3.60, 'not reproduced')])     # better at tokens, worse at equal FLOPs
def test_claims_can_pass_and_fail(tok, flo, want):
    r = _fake(tok, flo)
    cs = [c for c in r.claims if not c.is_precondition]
    assert verdict(r) == want, [(c.name, c.estimate, c.lo, c.hi) for c in cs]
    assert r.claims[0].is_precondition and r.claims[0].holds
    assert isinstance(headline(r), str) and 'D=96' in cs[0].name                 # the best width at equal FLOPs: D=96


def test_best_width_is_chosen_on_validation_not_test():
    r = _fake(3.30, 3.47, flops={'transformer D=96': 3.40}, val_shift={'transformer D=96': 0.5, 'transformer D=64': 0.5})
    bvb = flops_comparison(r)
    assert bvb.b.knob == 48 and bvb.b.chosen_on == 'held-out' and 'transformer D=48' in r.claims[1].name
    assert r.claims[1].shows                                                      # beats D=48, though not D=96 on test


def test_parameter_line_is_log_linear_per_seed():
    r = _fake(3.30, 3.30, sd=0.0)
    at, line = params_line(r)
    w = np.log(210_000 / 160_000) / np.log(270_000 / 160_000)
    assert at == 210_000
    np.testing.assert_allclose(line, [3.60 + w * (3.50 - 3.60) + 0.02 * s for s in range(4)], atol=1e-9)
    assert losses(r, 'tokens', 'RMT D_k=32').shape == (4,)
    with pytest.raises(ValueError, match='no flops run'): losses(r, 'flops', 'RMT D_k=4')


@pytest.mark.parametrize('tok,flo,want', [(3.30, 3.30, 'reproduced'), (3.548, 3.45, 'not reproduced')])
def test_a_sweep_at_its_edge_makes_it_untestable(tok, flo, want):
    r = _fake(tok, flo, edge='RMT D_k=4')
    assert not r.claims[0].holds and 'RMT D_k=4' in r.claims[0].name
    assert verdict(r) == 'untestable here' and verdict(_fake(tok, flo)) == want   # the same run with an interior optimum

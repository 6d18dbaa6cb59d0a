"Cross-checks of workbench.compression.lowrank_prune (TLR): masks against Wanda's reference code, the refinement's invariants, exact and randomised SVDs, the model-level wrapper, the experiment's claims and verdict."
import copy, math
import numpy as np
import pytest, torch
from workbench.compression.lowrank_prune import (magnitude_mask, wanda_mask, wanda_score, score_mask, keep_top, matched_mask, truncated_svd,
    rank_schedule, zero_shot_svd, tlr_refine, TLRResult, SparseLowRankLinear, input_norms, sequential_wanda, make_masks, matched_masks,
    prune_and_refine, pruned, count_parameters, sequence_nll, measure_procedure, gap_spectrum, fig_gap_spectra, parse_pattern,
    fig_tlr_errors, fig_ppl_params, fig_claims, TLRConfig, claims, verdict, headline, grid_points, TARGETS)
from workbench.core import Results
from workbench.hooks import decoder_layers
from workbench.measure import PeakRSS, PeakTensorMemory
from workbench.testing import tiny_model, tiny_ids

def _w(m=48, n=64, seed=0): return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))

# ---- masks ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('s', [0.0, 0.3, 0.5, 0.7])
def test_masks_exact_sparsity(s):
    W = _w()
    assert (magnitude_mask(W, s).sum(1) == 64 - int(s * 64)).all()                       # per row (the default)
    assert magnitude_mask(W, s, per_row=False).sum() == W.numel() - int(s * W.numel())   # per matrix
    assert (wanda_mask(W, torch.rand(64) + 0.1, s).sum(1) == 64 - int(s * 64)).all()

@pytest.mark.parametrize('nm', [(2, 4), (4, 8), (1, 4)])
def test_nm_masks(nm):
    W = _w(); N, M = nm
    for P in (magnitude_mask(W, None, nm), wanda_mask(W, torch.rand(64), None, nm)):
        assert (P.reshape(48, -1, M).sum(-1) == N).all()

def test_magnitude_keeps_the_largest_of_each_row_and_wanda_uses_norms():
    W = _w(); P = magnitude_mask(W, 0.5)
    for i in range(W.shape[0]): assert W[i].abs()[P[i]].min() >= W[i].abs()[~P[i]].max()
    Pm = magnitude_mask(W, 0.5, per_row=False)
    assert W.abs()[Pm].min() >= W.abs()[~Pm].max() and not torch.equal(P, Pm)
    norm = torch.ones(64); norm[:8] = 1e4                          # heavy inputs: their weights survive Wanda, not magnitude
    assert wanda_mask(W, norm, 0.5)[:, :8].all() and not magnitude_mask(W, 0.5)[:, :8].all()

def _wanda_reference(W, X, sparsity=0.5, prune_n=0, prune_m=0):
    "Mask as locuslab/wanda's prune_wanda builds it: scaler_row = ‖X_j‖²/nsamples, metric |W|·sqrt(scaler_row), stable sort per row."
    scaler_row = X.pow(2).sum(0) / X.shape[0]
    metric = W.abs() * torch.sqrt(scaler_row.reshape(1, -1))
    pruned_ = torch.zeros_like(metric, dtype=torch.bool)
    if prune_n:
        for ii in range(0, metric.shape[1], prune_m):
            tmp = metric[:, ii:ii + prune_m]
            pruned_.scatter_(1, ii + torch.topk(tmp, prune_n, dim=1, largest=False)[1], True)
    else:
        idx = torch.sort(metric, dim=-1, stable=True)[1][:, :int(metric.shape[1] * sparsity)]
        pruned_.scatter_(1, idx, True)
    return ~pruned_                                                # keep-mask

def _linear_inputs(model, ids):
    "(block, target) -> the input rows (tokens, n) of every target linear map, read with plain torch hooks (the reference)."
    xs, hs = {}, []
    def keep(key):
        def hook(mod, args): xs[key] = args[0].detach().flatten(0, -2)     # returns None: the input is not changed
        return hook
    for i, blk in enumerate(decoder_layers(model)):
        for t in TARGETS: hs.append(blk.get_submodule(t).register_forward_pre_hook(keep((i, t))))
    try: model(input_ids=ids)
    finally:
        for h in hs: h.remove()
    return xs

@pytest.mark.parametrize('sparsity,nm', [(0.5, None), (0.7, None), (None, (2, 4))])
def test_wanda_matches_the_reference_code(sparsity, nm):
    model, ids = tiny_model(), tiny_ids(4, 12)
    xs, norms = _linear_inputs(model, ids), input_norms(model, ids)
    for (i, t), X in xs.items():
        assert torch.allclose(norms[i, t], X.norm(dim=0), rtol=1e-4, atol=1e-6), (i, t)   # hook-point reconstruction = real inputs
        W = decoder_layers(model)[i].get_submodule(t).weight.detach()
        ref = _wanda_reference(W, X, sparsity or 0.5, *((nm[1] - nm[0], nm[1]) if nm else (0, 0)))
        assert torch.equal(wanda_mask(W, X.norm(dim=0), sparsity, nm), ref), (i, t)

def test_sequential_wanda_matches_a_blockwise_reference():
    "Block b's masks come from the model whose blocks < b are pruned: rebuilt here with plain hooks, one block at a time."
    model, ids = tiny_model(), tiny_ids(4, 12)
    masks, _ = sequential_wanda(model, ids, 0.5)
    ref_model = copy.deepcopy(model)
    for i in range(len(decoder_layers(model))):
        xs = _linear_inputs(ref_model, ids)
        for t in TARGETS:
            w = decoder_layers(ref_model)[i].get_submodule(t).weight
            ref = _wanda_reference(w.detach(), xs[i, t], 0.5)
            assert torch.equal(masks[i, t], ref), (i, t)
            w.data.mul_(ref)
    one_pass = make_masks(model, 'wanda', 0.5, norms=input_norms(model, ids))
    assert any(not torch.equal(one_pass[k], masks[k]) for k in masks if k[0] > 0)   # sequential differs from one pass

@pytest.mark.parametrize('bad', [1.0, -0.01, 1.5])
def test_invalid_sparsity(bad):
    with pytest.raises(ValueError, match=r'\[0, 1\)'): magnitude_mask(_w(), bad)

@pytest.mark.parametrize('bad', [True, '0.5'])
def test_sparsity_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match='sparsity must be a number'): magnitude_mask(_w(), bad)

def test_matched_mask_holds_exactly_the_patch_budget():
    W = _w(); P = magnitude_mask(W, 0.5)
    for k in (1, 4, 13):                                                           # 13·112 < 1536 pruned: no cap
        Pm = matched_mask(W.abs(), P, k * (48 + 64))
        assert Pm.sum() == P.sum() + k * (48 + 64) and (Pm & P).equal(P)         # the same count as S + rank-k, a superset
        rows = Pm.sum(1) - P.sum(1); assert rows.max() - rows.min() <= 1            # spread evenly over the rows
    assert matched_mask(W.abs(), P, 10**6).all()                                   # capped at the dense matrix
    assert torch.equal(keep_top(torch.tensor([[1., 3., 2., 3.]]), torch.tensor([2])), torch.tensor([[False, True, False, True]]))

# ---- shapes, SVDs, the refinement -------------------------------------------------------------------------------------

def test_mask_of_the_wrong_shape_is_refused():
    W = _w(); P = magnitude_mask(W, 0.5)
    for f in (lambda: tlr_refine(W, P[:, :60]), lambda: zero_shot_svd(W, P.T), lambda: gap_spectrum(W, P[:40]),
              lambda: matched_mask(W.abs(), P[:, :10], 3)):
        with pytest.raises(ValueError, match='same shape'): f()
    with pytest.raises(ValueError, match='binary'): tlr_refine(W, P.float() * 0.3, 4)

def test_invalid_rank_iters_and_schedule():
    W = _w(); P = magnitude_mask(W, 0.5)
    for r in (-1, 49):
        with pytest.raises(ValueError, match='rank must be an int in'): tlr_refine(W, P, r)
    with pytest.raises(TypeError, match='rank must be an int'): tlr_refine(W, P, 2.5)
    with pytest.raises(ValueError, match='n_iter'): tlr_refine(W, P, 4, -2)
    with pytest.raises(ValueError, match='schedule'): tlr_refine(W, P, 4, 3, schedule='cosine')

@pytest.mark.parametrize('shape', [(192, 576), (576, 192), (64, 64)])
def test_gram_svd_matches_a_float64_svd(shape):
    M = _w(*shape, seed=5); ref = torch.linalg.svdvals(M.double())
    for r in (1, 16, 64):
        U, s, V = truncated_svd(M, r, 'gram')
        assert U.shape == (shape[0], r) and V.shape == (shape[1], r)
        assert torch.allclose(s.double(), ref[:r], rtol=1e-5, atol=1e-4 * ref[0].item())   # squared: small σ are known to σ_1·1e-4
        err = (M - (U * s) @ V.T).norm().item(); opt = ref[r:].pow(2).sum().sqrt().item()
        assert abs(err - opt) <= 1e-5 * M.norm().item()                              # the best rank-r error (Eckart–Young)

@pytest.mark.parametrize('svd', ['gram', 'full'])
@pytest.mark.parametrize('schedule', ['fixed', 'linear'])
def test_objective_never_increases_and_support_kept(schedule, svd):
    W = _w(seed=3); P = magnitude_mask(W, 0.6)
    for T in (1, 5, 15):
        res = tlr_refine(W, P, 6, T, schedule=schedule, svd=svd)
        h = res.history
        assert len(h) == T + 1 and all(b <= a + 1e-6 for a, b in zip(h, h[1:]))
        assert (res.sparse[~P] == 0).all()

def test_special_cases():
    W = _w(); P = magnitude_mask(W, 0.5)
    z = zero_shot_svd(W, P, 5); gap = W * ~P
    U, s, V = torch.linalg.svd(gap, full_matrices=False)
    assert torch.allclose(z.B @ z.A, (U[:, :5] * s[:5]) @ V[:5], atol=1e-4)          # SVD of the gap
    assert torch.allclose(tlr_refine(W, P, 5, 0).dense(), z.dense(), atol=1e-5)       # T = 0: zero-shot
    assert torch.equal(tlr_refine(W, P, 0, 7).dense(), W * P)                         # k = 0: plain pruning
    assert torch.allclose(tlr_refine(W, P, 48, 2).dense(), W, atol=1e-4)              # full rank: exact
    assert tlr_refine(W, P, 5, 20).history[-1] < z.history[-1]                        # TLR beats zero-shot

def test_tlr_beats_zero_shot_across_seeds():
    wins = sum(tlr_refine(_w(32, 40, s), magnitude_mask(_w(32, 40, s), 0.5), 4, 10).history[-1]
               < zero_shot_svd(_w(32, 40, s), magnitude_mask(_w(32, 40, s), 0.5), 4).history[-1] for s in range(10))
    assert wins >= 9

def test_schedule_and_lowrank_svd_on_a_decaying_spectrum():
    r = rank_schedule(16, 20)
    assert r[0] == 1 and r[-1] == 16 and r == sorted(r) and rank_schedule(5, 1) == [5]
    Q1, _ = torch.linalg.qr(_w(200, 150, 1)); Q2, _ = torch.linalg.qr(_w(150, 150, 2))
    M = (Q1 * 0.8 ** torch.arange(150.)) @ Q2.T                                       # decaying spectrum
    _, s, _ = truncated_svd(M, 10); _, sl, _ = truncated_svd(M, 10, 'lowrank', seed=1)
    assert torch.allclose(s, sl, rtol=0.02)
    assert torch.equal(truncated_svd(M, 10, 'lowrank', seed=1)[1], sl)                # seeded: deterministic

def test_randomised_svd_tlr_on_a_flat_spectrum():
    "The regime the previous version ran: randomised SVD (q = r + 8, 2 power iterations) on pruning gaps of random weights."
    for seed in range(4):
        W = _w(192, 288, seed); P = magnitude_mask(W, 0.5); gap = W * ~P
        U, s, V = truncated_svd(gap, 16, 'lowrank', seed=seed); opt = zero_shot_svd(W, P, 16).history[-1] * W.norm().item()
        assert (gap - (U * s) @ V.T).norm().item() > 1.001 * opt                   # one randomised step misses the optimum
        exact, rnd = tlr_refine(W, P, 16, 10), tlr_refine(W, P, 16, 10, svd='lowrank', seed=seed)
        assert exact.history[-1] < rnd.history[-1] < zero_shot_svd(W, P, 16).history[-1]   # short of exact TLR, still below zero-shot
        assert (rnd.sparse[~P] == 0).all() and rnd.n_params == exact.n_params

# ---- layers, model, parameters ----------------------------------------------------------------------------------------

def test_sparse_lowrank_linear_matches_dense_and_counts_parameters():
    W = _w(); P = magnitude_mask(W, 0.5); res = tlr_refine(W, P, 4, 3)
    lin = torch.nn.Linear(64, 48); lin.weight.data = W
    sl = SparseLowRankLinear.from_linear(lin, res); x = torch.randn(3, 7, 64)
    assert torch.allclose(sl(x), x @ res.dense().T + lin.bias, atol=1e-4)
    assert (res.sparse[P] != 0).all()                                                 # every kept weight is non-zero here, so:
    assert res.n_params == int(P.sum()) + 4 * (48 + 64)
    assert sl.n_params() == dict(sparse=int(P.sum()), lowrank=4 * (48 + 64), dense=48 * 64)
    zeroed = TLRResult(res.sparse * (res.sparse.abs() > res.sparse.abs()[P].median()), res.B, res.A, [])
    assert zeroed.n_params == res.n_params - int(P.sum()) // 2                        # zeros in S are not counted

def test_model_wrapper_on_tiny_llama():
    model = copy.deepcopy(tiny_model()); ids = tiny_ids(4, 12)
    norms = input_norms(model, ids)
    assert set(norms) == {(i, t) for i in range(len(decoder_layers(model))) for t in TARGETS}
    masks = make_masks(model, 'wanda', 0.5, norms=norms)
    before = count_parameters(model)['total']
    hist = prune_and_refine(model, masks, 'tlr', rank=2, n_iter=3, workers=2)
    c = count_parameters(model)
    assert c['lowrank'] == sum(2 * sum(P.shape) for P in masks.values())
    assert c['sparse'] == sum(int(P.sum()) for P in masks.values())
    assert before - c['total'] == sum(int((~P).sum()) - 2 * sum(P.shape) for P in masks.values())
    assert all(h[-1] <= h[0] for h in hist.values())
    assert torch.isfinite(model(ids).logits).all()
    svd = {k: [v[0]] for k, v in hist.items()}
    assert len(fig_tlr_errors(hist, svd).data) == 2 * len(TARGETS) + 1

def test_matched_pruning_and_tlr_hold_the_same_parameters_and_pruned_is_undone():
    model, ids = copy.deepcopy(tiny_model()), tiny_ids(2, 10)
    base = model(ids).logits; masks = make_masks(model, 'magnitude', 0.5)
    mm = matched_masks(model, masks, 3)
    with pruned(model, mm, 'none'): c_matched = count_parameters(model)
    with pruned(model, masks, 'tlr', 3, 4, workers=2) as p:
        c_tlr = count_parameters(model); assert not torch.allclose(model(ids).logits, base)
    assert c_matched['total'] == c_tlr['total'] and len(p.history) == len(masks)
    assert torch.allclose(model(ids).logits, base) and count_parameters(model)['sparse'] == 0   # the dense maps are back

@pytest.mark.parametrize('arch', ['llama', 'qwen2'])
def test_tlr_child_plain_loading_is_refused_and_the_densified_copy_matches(arch, tmp_path):
    """Issue 39 §4: plain `from_pretrained` of a factored child used to drop B and A without an error (logits off by up to 0.33 on the
    tiny Qwen2); now it refuses, `load_child` still reads it, and `save_dense_child` writes W = S + BA that any from_pretrained loads."""
    import json
    from transformers import AutoModelForCausalLM
    from workbench.compression.lowrank_prune import save_child, load_child, save_dense_child, FACTORED_TYPE
    from workbench.models import load_model
    from workbench.testing import tiny_folder
    model = copy.deepcopy(tiny_model()) if arch == 'llama' else load_model(tiny_folder('qwen2'), 'float32', device='cpu')   # Qwen2: biases on q, k, v
    ids = tiny_ids(2, 12)
    prune_and_refine(model, make_masks(model, 'magnitude', 0.5), 'tlr', rank=4, n_iter=3)
    with torch.no_grad(): ref = model(input_ids=ids).logits
    save_child(model, tmp_path / 'tlr')
    with pytest.raises(ValueError, match=FACTORED_TYPE): AutoModelForCausalLM.from_pretrained(tmp_path / 'tlr')   # the marked model type
    with pytest.raises(OSError, match='no file named'): type(model).from_pretrained(tmp_path / 'tlr')           # the class itself finds no weights
    cfg = json.loads((tmp_path / 'tlr' / 'config.json').read_text())
    assert cfg['tlr_base']['architectures'] == [type(model).__name__]
    with torch.no_grad(): assert torch.allclose(load_child(tmp_path / 'tlr', device='cpu')(input_ids=ids).logits, ref, atol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(save_dense_child(model, tmp_path / 'hf')).eval()
    with torch.no_grad(): out = plain(input_ids=ids).logits
    assert type(plain) is type(model) and torch.allclose(out, ref, atol=1e-5)                      # float32 rounding only
    assert sum(isinstance(m, SparseLowRankLinear) for m in model.modules()) == 7 * len(decoder_layers(model))   # the model is left as it was
    with pytest.raises(ValueError, match='prune it first'): save_dense_child(copy.deepcopy(tiny_model()), tmp_path / 'dense')
    with pytest.raises(FileExistsError): save_dense_child(model, tmp_path / 'tlr')                  # never over a folder of something else

def test_sequence_nll_matches_the_platform_perplexity():
    from workbench.train import perplexity
    ids = tiny_ids(6, 16, seed=3)
    nll = sequence_nll(tiny_model(), ids, batch_size=4, workers=2)
    assert nll.shape == (6,) and abs(math.exp(nll.mean().item()) - perplexity(tiny_model(), ids, batch_size=4)) < 1e-3 * math.exp(nll.mean().item())
    lp = torch.log_softmax(tiny_model()(ids[1:2]).logits[0, :-1].float(), -1)
    assert abs(nll[1].item() + lp.gather(1, ids[1, 1:, None]).mean().item()) < 1e-5

def test_measure_procedure():
    W = _w(96, 256, 4); P = magnitude_mask(W, 0.5); Pm = matched_mask(W.abs(), P, 8 * 352)
    r = {x: measure_procedure(W, P, x, 8, 10, extra_mask=Pm) for x in ('none', 'svd', 'tlr', 'matched')}
    assert all(v['kept_mb'] >= 96 * 256 * 4 / 2**20 for v in r.values())
    assert r['tlr']['peak_mb'] > r['none']['peak_mb'] and r['tlr']['n_params'] == r['matched']['n_params'] == r['svd']['n_params']

def test_gap_spectrum_and_eckart_young():
    "The zero-shot SVD error equals the energy of the gap's singular values beyond rank k."
    W = _w(); P = magnitude_mask(W, 0.6); sv = gap_spectrum(W, P)
    assert torch.allclose((sv ** 2).sum(), (W * ~P).pow(2).sum(), rtol=1e-4)
    for k in (0, 4, 12):
        assert abs(zero_shot_svd(W, P, k, 'full').history[-1] - ((sv[k:] ** 2).sum().sqrt() / W.norm()).item()) < 1e-4
    assert len(fig_gap_spectra({'w': sv}, 4).data) == 2

@pytest.mark.parametrize('pat,want', [('50%', (0.5, None)), ('70%', (0.7, None)), ('2:4', (None, (2, 4)))])
def test_parse_pattern(pat, want): assert parse_pattern(pat) == want

@pytest.mark.parametrize('bad', ['100%', '-5%', '4:2', 'half', 0.5])
def test_parse_pattern_rejects(bad):
    with pytest.raises(ValueError): parse_pattern(bad)

def test_peak_rss_sees_an_allocation():
    import time
    # 128 MiB: above glibc's largest mmap threshold (32 MiB), so the pages are fresh from the OS even after earlier
    # tests freed memory the allocator could reuse (RSS counts what the process holds, not what it reuses)
    with PeakRSS() as pm:
        x = torch.ones(128 * 2**18); x += 1; time.sleep(0.05); del x
    assert pm.peak_mb is None or 120 < pm.peak_mb < 400

def test_peak_tensor_memory_counts_allocations_not_views():
    w = torch.zeros(256, 1024)                                     # 1 MiB made before the context: never counted
    with PeakTensorMemory() as pt:
        a = torch.empty(1024, 1024); b = a + 1; del a               # 4 + 4 MiB alive at once
        w.add_(1); w.view(-1); w[:10]; del b                        # in place, views: no allocation
        c = torch.empty(512, 1024)                                  # 2 MiB kept past the end
    assert pt.peak_mb == 8.0 and pt.kept_mb == 2.0

# ---- the experiment: config, claims, verdict ---------------------------------------------------------------------------

def test_config_sizes_validation_and_seed(monkeypatch):
    assert TLRConfig(mode='full').n_eval * TLRConfig(mode='full').eval_len >= 8192          # VERDICTS: ≥ 8k tokens
    assert TLRConfig(mode='quick').n_blocks < TLRConfig(mode='full').n_blocks == 30
    full = TLRConfig(mode='full').points
    assert {(k, T) for m, _, k, T in full if m == 'magnitude'} == {(k, T) for k in (8, 16, 32, 64) for T in (10, 25, 50)}
    with pytest.raises(ValueError, match='parameter-matched'): TLRConfig(points=(('magnitude', '2:4', 16, 5),))
    with pytest.raises(ValueError, match='svd'): TLRConfig(svd='qr')
    monkeypatch.setenv('WORKBENCH_SEED', '1')
    assert TLRConfig(mode='quick').seeds == [1]

def _fake_results(effects: dict, n=40, seed=0) -> Results:
    "Rows for grid points whose baselines' NLL exceed TLR's by `effects[point][baseline]` on average (noise sd 0.05)."
    rng = np.random.default_rng(seed); rows = []
    tlr_nll = 3 + rng.normal(0, 0.3, n)
    def add(mask, pattern, rank, n_iter, refine, nll):
        rows.extend(dict(mask=mask, pattern=pattern, rank=rank, n_iter=n_iter, refine=refine, seq=j, nll=float(v)) for j, v in enumerate(nll))
    for (mk, pat, k, T), eff in effects.items():
        add(mk, pat, k, T, 'tlr', tlr_nll)
        for ref in ('svd', 'matched'): add(mk, pat, k, 0, ref, tlr_nll + eff[ref] + rng.normal(0, 0.05, n))
    return Results('lowrank_prune', dict(mode='full', seed=seed, n_boot=2000), rows)

def test_verdict_counts_every_point_and_baseline():
    big, none_, worse = 0.1, 0.0, -0.1
    p1, p2 = ('magnitude', '50%', 16, 50), ('magnitude', '50%', 64, 50)
    assert verdict(_fake_results({p1: dict(svd=big, matched=big), p2: dict(svd=big, matched=big)})) == 'reproduced'
    r = _fake_results({p1: dict(svd=big, matched=worse), p2: dict(svd=big, matched=none_)})
    cs = claims(r)
    assert len(cs) == 4 and [c.shows for c in cs] == [True, False, True, False] and cs[1].opposite
    assert verdict(r) == 'partly'
    assert verdict(_fake_results({p1: dict(svd=worse, matched=worse), p2: dict(svd=none_, matched=worse)})) == 'not reproduced'
    assert grid_points(r) == [p1, p2]
    assert verdict(_fake_results({p1: dict(svd=big, matched=big), p2: dict(svd=worse, matched=big)})) == 'partly'   # one point failing is not pooled away

def test_ppl_params_and_claims_figures():
    models = [dict(mask='dense', pattern='-', refine='none', rank=0, n_iter=0, ppl=10., ppl_lo=9., ppl_hi=11., total=100),
              dict(mask='magnitude', pattern='50%', refine='none', rank=0, n_iter=0, ppl=30., ppl_lo=28., ppl_hi=33., total=60),
              dict(mask='magnitude', pattern='50%', refine='tlr', rank=16, n_iter=50, ppl=20., ppl_lo=19., ppl_hi=21., total=64)]
    assert len(fig_ppl_params(models, 'magnitude 50%').data) == 2
    with pytest.raises(ValueError, match='no models for'): fig_ppl_params(models, 'wanda 50%')
    cs = claims(_fake_results({('magnitude', '50%', 16, 50): dict(svd=0.1, matched=-0.1)}))
    assert len(fig_claims(cs).data) == 2

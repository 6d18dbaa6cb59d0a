"Cross-checks of workbench.compression.lowrank_prune (TLR): masks, the refinement's invariants, the model-level wrapper."
import copy
import pytest, torch
from workbench.compression.lowrank_prune import (magnitude_mask, wanda_mask, score_mask, truncated_svd, rank_schedule,
    zero_shot_svd, tlr_refine, SparseLowRankLinear, input_norms, make_masks, prune_and_refine, count_parameters, fig_tlr_errors, TARGETS)
from workbench.hooks import decoder_layers
from workbench.testing import tiny_model, tiny_ids

def _w(m=48, n=64, seed=0): return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))

@pytest.mark.parametrize('s', [0.0, 0.3, 0.5, 0.7])
def test_masks_exact_sparsity(s):
    W = _w()
    assert magnitude_mask(W, s).sum() == W.numel() - int(s * W.numel())
    assert (wanda_mask(W, torch.rand(64) + 0.1, s).sum(1) == 64 - int(s * 64)).all()

@pytest.mark.parametrize('nm', [(2, 4), (4, 8), (1, 4)])
def test_nm_masks(nm):
    W = _w(); N, M = nm
    for P in (magnitude_mask(W, None, nm), wanda_mask(W, torch.rand(64), None, nm)):
        assert (P.reshape(48, -1, M).sum(-1) == N).all()

def test_magnitude_keeps_largest_and_wanda_uses_norms():
    W = _w(); P = magnitude_mask(W, 0.5)
    assert W.abs()[P].min() >= W.abs()[~P].max()
    norm = torch.ones(64); norm[:8] = 1e4                          # heavy inputs: their weights survive Wanda, not magnitude
    assert wanda_mask(W, norm, 0.5)[:, :8].all() and not magnitude_mask(W, 0.5)[:, :8].all()

@pytest.mark.parametrize('bad', [1.0, -0.01, 1.5, True, '0.5'])
def test_invalid_sparsity(bad):
    with pytest.raises(ValueError, match=r'\[0, 1\)'): magnitude_mask(_w(), bad)

def test_invalid_rank_and_iters():
    W = _w(); P = magnitude_mask(W, 0.5)
    for r in (-1, 49, 2.5):
        with pytest.raises(ValueError, match='rank must be'): tlr_refine(W, P, r)
    with pytest.raises(ValueError, match='n_iter'): tlr_refine(W, P, 4, -2)
    with pytest.raises(ValueError, match='binary'): tlr_refine(W, P.float() * 0.3, 4)
    with pytest.raises(ValueError, match='schedule'): tlr_refine(W, P, 4, 3, schedule='cosine')

@pytest.mark.parametrize('schedule', ['fixed', 'linear'])
def test_objective_never_increases_and_support_kept(schedule):
    W = _w(seed=3); P = magnitude_mask(W, 0.6)
    for T in (1, 5, 15):
        res = tlr_refine(W, P, 6, T, schedule=schedule)
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

def test_schedule_and_lowrank_svd():
    r = rank_schedule(16, 20)
    assert r[0] == 1 and r[-1] == 16 and r == sorted(r) and rank_schedule(5, 1) == [5]
    Q1, _ = torch.linalg.qr(_w(200, 150, 1)); Q2, _ = torch.linalg.qr(_w(150, 150, 2))
    M = (Q1 * 0.8 ** torch.arange(150.)) @ Q2.T                                       # decaying spectrum, like real weights
    _, s, _ = truncated_svd(M, 10); _, sl, _ = truncated_svd(M, 10, 'lowrank', seed=1)
    assert torch.allclose(s, sl, rtol=0.02)
    assert torch.equal(truncated_svd(M, 10, 'lowrank', seed=1)[1], sl)                # seeded: deterministic

def test_sparse_lowrank_linear_matches_dense():
    W = _w(); P = magnitude_mask(W, 0.5); res = tlr_refine(W, P, 4, 3)
    lin = torch.nn.Linear(64, 48); lin.weight.data = W
    sl = SparseLowRankLinear.from_linear(lin, res); x = torch.randn(3, 7, 64)
    assert torch.allclose(sl(x), x @ res.dense().T + lin.bias, atol=1e-4)
    assert sl.n_params()['lowrank'] == 4 * (48 + 64) and res.n_params <= int(P.sum()) + 4 * 112

def test_model_wrapper_on_tiny_llama():
    model = copy.deepcopy(tiny_model()); ids = tiny_ids(4, 12)
    norms = input_norms(model, ids)
    assert set(norms) == {(i, t) for i in range(len(decoder_layers(model))) for t in TARGETS}
    masks = make_masks(model, 'wanda', 0.5, norms=norms)
    before = count_parameters(model)['total']
    hist = prune_and_refine(model, masks, 'tlr', rank=2, n_iter=3, svd='full')
    c = count_parameters(model)
    assert c['lowrank'] == sum(2 * sum(P.shape) for P in masks.values())
    assert c['sparse'] <= sum(int(P.sum()) for P in masks.values()) and c['total'] < before
    assert all(h[-1] <= h[0] for h in hist.values())
    assert torch.isfinite(model(ids).logits).all()
    tlr = {k: v for k, v in hist.items()}; svd = {k: [v[0]] for k, v in hist.items()}
    assert len(fig_tlr_errors(tlr, svd).data) == 2 * len(TARGETS) + 1

def test_gap_spectrum_and_eckart_young():
    "The zero-shot SVD error equals the energy of the gap's singular values beyond rank k."
    from workbench.compression.lowrank_prune import gap_spectrum, fig_gap_spectra
    W = _w(); P = magnitude_mask(W, 0.6); sv = gap_spectrum(W, P)
    assert torch.allclose((sv ** 2).sum(), (W * ~P).pow(2).sum(), rtol=1e-4)
    for k in (0, 4, 12):
        assert abs(zero_shot_svd(W, P, k, 'full').history[-1] - ((sv[k:] ** 2).sum().sqrt() / W.norm()).item()) < 1e-4
    assert len(fig_gap_spectra({'w': sv}, 4).data) == 2

@pytest.mark.parametrize('pat,want', [('50%', (0.5, None)), ('70%', (0.7, None)), ('2:4', (None, (2, 4)))])
def test_parse_pattern(pat, want):
    from workbench.compression.lowrank_prune import parse_pattern
    assert parse_pattern(pat) == want

@pytest.mark.parametrize('bad', ['100%', '-5%', '4:2', 'half', 0.5])
def test_parse_pattern_rejects(bad):
    from workbench.compression.lowrank_prune import parse_pattern
    with pytest.raises(ValueError): parse_pattern(bad)

def test_peak_rss_sees_an_allocation():
    import time
    from workbench.compression.lowrank_prune import PeakRSS
    # 128 MiB: above glibc's largest mmap threshold (32 MiB), so the pages are fresh from the OS even after earlier
    # tests freed memory the allocator could reuse (RSS counts what the process holds, not what it reuses)
    with PeakRSS() as pm:
        x = torch.ones(128 * 2**18); x += 1; time.sleep(0.05); del x
    assert pm.peak_mb is None or 120 < pm.peak_mb < 400

def test_peak_tensor_memory_counts_allocations_not_views():
    from workbench.compression.lowrank_prune import PeakTensorMemory
    w = torch.zeros(256, 1024)                                     # 1 MiB made before the context: never counted
    with PeakTensorMemory() as pt:
        a = torch.empty(1024, 1024); b = a + 1; del a               # 4 + 4 MiB alive at once
        w.add_(1); w.view(-1); w[:10]; del b                        # in place, views: no allocation
        c = torch.empty(512, 1024)                                  # 2 MiB kept past the end
    assert pt.peak_mb == 8.0 and pt.kept_mb == 2.0

def test_ppl_params_figure():
    from workbench.compression.lowrank_prune import fig_ppl_params
    rows = [dict(mask='dense', pattern='-', refine='none', ppl=10., total=100), dict(mask='magnitude', pattern='50%', refine='none', ppl=30., total=60),
            dict(mask='magnitude', pattern='50%', refine='tlr', ppl=20., total=64)]
    assert len(fig_ppl_params(rows, '50%').data) == 2
    with pytest.raises(ValueError, match='no rows for pattern'): fig_ppl_params(rows, '2:4')

"Cross-checks of workbench.compression.sparsity_law: CETT against its definition, thresholds, masking, bisection, laws, claims."
import copy, math
import numpy as np
import pytest, torch
from workbench.compression.sparsity_law import (cett, LayerCETT, neuron_output_norms, down_weights, mlp_post_name, ffn_mask_hooks,
    masked_nll, bisect_strength, check_target, find_cett_for_ppl, dense_run, CETTProbe, FFNWeights, ffn_dense, ffn_active_down,
    ffn_predicted, fit_sparsity_law, sparsity_law, SparsityLawConfig, claims, verdict, headline, tiny_lm, log_steps)
from workbench.core import Results
from workbench.hooks import decoder_layers, hooks, run_with_cache
from workbench.testing import tiny_model, tiny_ids


def _acts(m=7, F=12, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, F, generator=g), torch.randn(d, F, generator=g)


def _brute(a, w, eps):
    "CETT by loops: for each token, the norm of the summed outputs of the neurons under eps, over the output norm."
    out = []
    for t in range(a.shape[0]):
        n = [a[t, i] * w[:, i] for i in range(a.shape[1])]
        cut = sum((v for v in n if v.norm() < eps), torch.zeros(w.shape[0]))
        out.append((cut.norm() / sum(n).norm()).item())
    return float(np.mean(out))


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_cett_matches_brute_force_and_layer_search(seed):
    a, w = _acts(seed=seed); lc = LayerCETT(a, w, grid=None)
    for q in (0.1, 0.5, 0.9):
        eps = float(neuron_output_norms(a, w).quantile(q))
        assert cett(a, w, eps) == pytest.approx(_brute(a, w, eps), abs=1e-5)
        assert lc.cett(eps) == pytest.approx(cett(a, w, eps), abs=1e-6)
    assert cett(a, w, 0.0) == 0.0 and cett(a, w, math.inf) == pytest.approx(1.0, abs=1e-6)


def test_cett_is_not_monotone_in_general():
    a, w = torch.tensor([[1.0, -1.1]]), torch.tensor([[1.0, 1.0]])
    assert [round(cett(a, w, e), 3) for e in (0.5, 1.05, 2.0)] == [0.0, 10.0, 1.0]


def test_threshold_is_the_crossing_and_warm_start_changes_nothing():
    a, w = _acts(m=40, F=32, d=8, seed=3)
    cold = [LayerCETT(a, w, grid=None).threshold(c) for c in (0.05, 0.3, 0.6)]
    warm = LayerCETT(a, w, grid=None)
    assert [warm.threshold(c) for c in (0.6, 0.05, 0.3)] == [cold[2], cold[0], cold[1]]
    for c, e in zip((0.05, 0.3, 0.6), cold):
        j = int((warm.cand == e).nonzero()[0])
        assert warm.cett(e) <= c < warm.cett(float(warm.cand[j + 1]))


def test_masking_with_zero_thresholds_is_the_dense_model_and_hooks_go_away():
    m, ids = tiny_model(), tiny_ids(2, 10)
    L = len(decoder_layers(m))
    with torch.no_grad():
        dense = m(input_ids=ids).logits
        for rule, p in (('cett', [0.0] * L), ('topk', 0.0), ('fat', 0.0)):
            with hooks(m, ffn_mask_hooks(m, rule, p, {})): assert torch.equal(m(input_ids=ids).logits, dense)
    assert all(not blk.mlp.down_proj._forward_pre_hooks and not blk.mlp._forward_pre_hooks for blk in decoder_layers(m))


def test_relu_cett_sparsity_at_least_the_exact_zeros():
    m = tiny_lm('relu', 2, 32, 16, seed=0).eval().requires_grad_(False)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    d = dense_run(m, ids)
    for a, w in zip(d.acts, down_weights(m)):
        lc = LayerCETT(a, w)
        for c in (0.0, 0.05):
            kept = float((lc.n >= lc.threshold(c)).float().mean())
            assert kept <= float((a != 0).float().mean()) + 1e-9           # zeros have zero norm: always cut


def test_bisection_hits_the_target_and_rejects_bad_inputs():
    for target in (1.01, 1.05):
        lo, hi, path = bisect_strength(lambda x: (1 + 0.2 * x ** 3, 1 - x), target, 1e-4)
        x_star = ((target - 1) / 0.2) ** (1 / 3)
        assert hi - lo <= 1e-4 and lo < x_star <= hi and 1 + 0.2 * lo ** 3 < target
    for p, tol in ((0, 1e-3), (-1, 1e-3), (1, 0), (1, -0.1), (1, 1.0)):
        with pytest.raises(ValueError): check_target(p, tol)
    with pytest.raises(ValueError, match='p must be'): find_cett_for_ppl(tiny_model(), tiny_ids(), p=0)
    with pytest.raises(ValueError, match='one threshold per layer'): masked_nll(tiny_model(), tiny_ids(), 'cett', [0.1])


def test_active_neuron_ffn_variants_compute_the_masked_ffn():
    mlp = decoder_layers(tiny_model())[1].mlp; w = FFNWeights.of(mlp)
    x = torch.randn(w.wg.shape[1], generator=torch.Generator().manual_seed(4))
    a = w.inter(x); cut = torch.full_like(a, a.abs().quantile(0.7).item())
    ref = torch.where(a.abs() >= cut, a, 0.) @ w.wd_t
    assert torch.allclose(ffn_active_down(w, x, cut), ref, atol=1e-6)
    assert torch.allclose(ffn_predicted(w, x, (a.abs() >= cut).nonzero()[:, 0]), ref, atol=1e-6)
    assert torch.allclose(ffn_active_down(w, x, torch.full_like(a, math.inf)), torch.zeros_like(ref))   # nothing active


@pytest.mark.parametrize('act,true', [('silu', dict(A0=0.35, c=0.2, alpha=0.7)), ('relu', dict(alpha=0.5, b=-2.5, c=0.5, A0=0.06))])
def test_fit_recovers_the_law(act, true):
    D = np.geomspace(1e5, 3e6, 10)
    fit = fit_sparsity_law(D, sparsity_law(D / 1e5, true, act), act)
    assert fit['ok'] and fit['A0'] == pytest.approx(true['A0'], abs=2e-3) and fit['rmse'] < 1e-4


def test_config_sizes_and_validation():
    q, f = SparsityLawConfig(mode='quick'), SparsityLawConfig(mode='full')
    assert (q.n_chunks, f.n_chunks, f.steps, f.n_seeds) == (1, 8, 300, 3)
    assert log_steps(f.steps, f.n_ckpts, f.steps // 8)[0] == 37
    for bad in (dict(p=-1), dict(tol=0), dict(c_grid=(0.5, 1.5)), dict(archs=(('x', 2, 20),)), dict(n_stable=20)):
        with pytest.raises(ValueError): SparsityLawConfig(mode='quick', **bad)


def _synthetic(good: bool, speed=None, relu_slope=None, pre=()) -> Results:
    """Rows shaped like run_experiment's, with effects in the paper's direction (good) or against it; `speed`: the active-neuron
    FFN's time over dense (default 0.9 good, 1.1 bad); `relu_slope`: tiny ReLU's activation ratio per decade; `pre`: preconditions."""
    cfg = SparsityLawConfig(mode='quick', n_seeds=3)
    rng, sgn, rows = np.random.default_rng(0), 1 if good else -1, []
    for i in range(6):
        for m, s in (('cett', 0.30 + 0.1 * sgn), ('topk', 0.30), ('fat', 0.28)):
            rows.append(dict(part='smollm2', chunk=i, metric=m, sparsity=s + rng.normal(0, 0.005), x=0.1, ppl_ratio=1.009, held_ratio=1.01, held_sparsity=s, evals=10))
    for seed in cfg.seeds:
        for arch, act in (('base', 'relu'), ('base', 'silu'), ('deep', 'relu')):
            for k, tok in enumerate(np.geomspace(1e5, 1e6, 5)):
                slope = (-0.02 if act == 'relu' else 0.03) * sgn
                if relu_slope is not None and act == 'relu': slope = relu_slope
                A = (0.08 if act == 'relu' else 0.3) + slope * np.log10(tok / 1e5) + rng.normal(0, 1e-3)
                if not good and act == 'relu': A += 0.4
                rows.append(dict(part='tiny', arch=arch, width_depth=20.0, act=act, seed=seed, step=k + 1, tokens=float(tok), loss=2.0,
                                 zero_active=0.2, c_ckpt=0.1, A_ckpt=A, ratio_ckpt=1.009, c_stable=0.1, A_stable=A, ratio_stable=1.009, params=1, train_s=1.0))
    for v, r in (('active_down', speed if speed is not None else 0.9 if good else 1.1), ('predicted', 0.5), ('predicted_at_paper_sparsity', 0.2)):
        rows.append(dict(part='speed', variant=v, time_ratio=r, lo=r - 0.02, hi=r + 0.02, speedup=1 / r, active_share=0.7, dense_ms=1.0, step_ms=2.0, ffn_share=0.5))
    return Results('sparsity_law', cfg, rows, seeds=cfg.seeds, claims=list(pre))


def test_claims_follow_the_rows():
    good, bad = _synthetic(True), _synthetic(False)                            # the verdicts: test_verdict_rule_on_made_up_rows
    cg, cb = claims(good), claims(bad)
    assert len(cg) == 7 and all(c.shows for c in cg) and all(c.opposite for c in cb)
    assert 'CETT' in headline(good) and '4.1x' in headline(good)


def _precondition(holds: bool):
    "A made-up precondition (training has run its course: the tiny models' loss slope over the last fifth below the declared tolerance)."
    from workbench.core import Claim
    est = 0.001 if holds else 0.05
    return Claim('tiny loss slope over the last fifth (made up)', est, est - 0.0005, est + 0.0005, better='lower', null=0.01, role='precondition', threshold_from='slope_tol')


@pytest.mark.parametrize('kw,want', [
    (dict(good=True), 'reproduced'),                                           # all seven comparisons show
    (dict(good=True, speed=1.1), 'partly'),                                    # the active-neuron FFN slower than dense
    (dict(good=True, relu_slope=0.0, speed=1.0), 'partly'),                    # ReLU's ratio flat with data, no speed-up
    (dict(good=False), 'not reproduced'),                                      # every comparison the other way
])
def test_verdict_rule_on_made_up_rows(kw, want):
    r = _synthetic(**kw)
    assert len(claims(r)) == 7 and verdict(r) == want


@pytest.mark.parametrize('kw', [dict(good=True), dict(good=True, speed=1.1), dict(good=False)])
def test_failed_precondition_makes_it_untestable(kw):
    assert verdict(_synthetic(**kw, pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_synthetic(**kw, pre=[_precondition(True)])) == verdict(_synthetic(**kw))   # one that holds changes nothing
    r = _synthetic(**kw)
    r.conclude(verdict, claims(r) + [_precondition(False)])                  # the way run_experiment records it
    assert r.verdict == 'untestable here' and '| precondition |' in r.claims_markdown()


def test_recorded_run_is_full_and_within_budget():
    "The committed run's structure (its verdict and claims are recomputed in tests/test_experiments.py)."
    from workbench.core import load_results, get_settings
    if not (get_settings().results_path / 'sparsity_law.json').is_file(): pytest.skip('no full run recorded yet')
    r = load_results('sparsity_law')                                           # checked against the schema
    assert r.mode == 'full' and len(r.seeds) >= 3 and len(r.claims) == 7
    A = r.df[r.df.part == 'smollm2']
    assert (A.ppl_ratio < 1 + r.config['p'] / 100).all()                       # every operating point within its budget


def _distinct_floats(n: int) -> torch.Tensor:
    "n distinct positive float32 values (consecutive bit patterns from 1.0 up), in order."
    return (torch.arange(n, dtype=torch.int32) + 0x3F800000).view(torch.float32)


def test_quantile_indices_hold_past_2_to_the_24():
    "Issue 41: float32 linspace indices round past the end beyond 2^24 scores (≈ 365 SmolLM2 tokens of gate scores); both searches now index exactly."
    from workbench.compression.sparsity_law import DenseRun, _gate_quantiles
    n = 2 ** 24 + 4                                                             # the last index, 2^24 + 3, rounds up to 2^24 + 4 in float32
    v = _distinct_floats(n)
    q = _gate_quantiles(DenseRun(0., [], [v[:n // 2], v[n // 2:]]), n=8)        # pooled over two "layers"
    assert len(q) == 9 and q[0] == v[0].item() and q[-1] == v[-1].item()       # both ends: the smallest and the largest score
    assert np.all(np.diff(q) > 0)
    lc = LayerCETT(v.view(4, n // 4), torch.ones(1, n // 4), grid=16)          # norms |a_i| * 1: n distinct values
    assert lc.cand[-2].item() == v[-1].item() and lc.cand[-1].item() == math.inf and lc.cand[1].item() == v[1].item()

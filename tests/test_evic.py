"Cross-checks of `workbench.data_selection.evic`: per-sample gradients, Adam-preconditioned interactions against real optimizer steps, symmetry, projection, selection, the curriculum plans, and the verdict (fast, CPU)."
import math
import numpy as np
import pytest
import torch
from torch.func import functional_call
from workbench.core import Results, Claim, save_results, load_results
from workbench.train import TrainConfig
from workbench.data_selection.evic import (TOK, DOMAINS, make_domains, make_sample, held_out, encode_rows, stack_rows, make_model,
    per_sample_grads, summed_grad, adam_preconditioned, adam_state, real_interactions, RandomProjector, interaction_matrix,
    net_influence, select_positive, sample_losses, passes, train_curriculum, evic_plan, mixing_plan, sequential_plan, _estimate_free,
    round_stats, steps_to, EVICConfig, claims, verdict, headline, strongest_baseline, CENSORED, METHODS, run_unit, _rows)


def lin_loss(model, params, row):
    "½ (w·x - y)² of one row, as a function of the parameters."
    return 0.5 * (functional_call(model, params, (row['x'][None],))[0, 0] - row['y']) ** 2


def lin_toy(n=40, d=3, seed=0, flip=None):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64); w = torch.randn(d, generator=g, dtype=torch.float64)
    y = X @ w
    if flip is not None: y[flip] = -y[flip]
    model = torch.nn.Linear(d, 1, bias=False).double(); torch.nn.init.zeros_(model.weight)
    return model, dict(x=X, y=y)


def _adam_history(model, batch, loss, steps=3, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad(); torch.func.vmap(lambda r: loss(model, dict(model.named_parameters()), r))(batch).sum().backward(); opt.step()
    return opt


def test_per_sample_grads_sum_to_the_batch_gradient():
    m = make_model(1); b = stack_rows(encode_rows(make_domains(4, seed=2)))
    G = per_sample_grads(m, b, chunk=5)
    assert G.shape == (12, sum(p.numel() for p in m.parameters()))
    torch.testing.assert_close(G.sum(0), summed_grad(m, b), rtol=1e-4, atol=1e-5)
    m2, bl = lin_toy()
    Gl = per_sample_grads(m2, bl, loss=lin_loss)
    resid = (bl['x'] @ m2.weight[0].detach() - bl['y'])
    torch.testing.assert_close(Gl, resid[:, None] * bl['x'])                      # ∇½(w·x-y)² = (w·x-y) x


@pytest.mark.parametrize('momentum', [False, True])
def test_estimate_matches_a_real_adam_step(momentum):
    "Int[j, i] = lr · u_j·g_i is the first-order drop of ℓ_i after one real AdamW step on j: the relative error shrinks ∝ lr."
    model, b = lin_toy(n=12, d=4, seed=1)
    opt = _adam_history(model, b, lin_loss)
    G = per_sample_grads(model, b, loss=lin_loss); U = adam_preconditioned(G, opt, list(model.parameters()), momentum=momentum)
    errs = []
    for lr in (1e-2, 1e-3, 1e-4):
        real = real_interactions(model, opt, b, 5, lr, momentum=momentum, loss=lin_loss)
        errs.append(((lr * U[5] @ G.T - real).norm() / real.norm()).item())
    assert errs[2] < 1e-3 and errs[2] < errs[1] < errs[0]
    assert 5 < errs[1] / errs[2] < 20                                              # first order: the error is O(lr)


def test_the_lm_estimate_matches_a_real_step():
    torch.manual_seed(0); m = make_model(2).double(); b = stack_rows(encode_rows(make_domains(2, seed=3)))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(2): opt.zero_grad(); sample_losses(m, b).mean().backward(); opt.step()
    G = per_sample_grads(m, b); U = adam_preconditioned(G, opt, list(m.parameters()))
    errs = [((lr * U[1] @ G.T - real_interactions(m, opt, b, 1, lr)).norm() / real_interactions(m, opt, b, 1, lr).norm()).item() for lr in (1e-4, 1e-5, 1e-6)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-3


def test_momentum_free_update_is_the_difference_of_two_steps():
    model, b = lin_toy(n=6, seed=2); opt = _adam_history(model, b, lin_loss)
    G = per_sample_grads(model, b, loss=lin_loss); ps = list(model.parameters())
    zero = adam_preconditioned(torch.zeros_like(G[:1]), opt, ps, momentum=True)
    torch.testing.assert_close(adam_preconditioned(G, opt, ps), adam_preconditioned(G, opt, ps, momentum=True) - zero)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)                        # no history: m = 0, both forms agree
    torch.testing.assert_close(adam_preconditioned(G, fresh, ps), adam_preconditioned(G, fresh, ps, momentum=True))


def test_sgd_interactions_are_symmetric_adam_ones_are_not():
    model, b = lin_toy(n=10, d=5, seed=3); opt = _adam_history(model, b, lin_loss)
    G = per_sample_grads(model, b, loss=lin_loss)
    S = interaction_matrix(G, G); A = interaction_matrix(adam_preconditioned(G, opt, list(model.parameters())), G)
    torch.testing.assert_close(S, S.T)
    assert (A - A.T).norm() / A.norm() > 0.05


def test_duplicates_share_rows_and_columns_and_rows_are_sources():
    model, b = lin_toy(n=8, seed=4)
    b = {k: torch.cat([v, v[:1]]) for k, v in b.items()}                          # row 8 duplicates row 0
    opt = _adam_history(model, b, lin_loss)
    out = net_influence(model, opt, b, 'adam', show=list(range(9)), loss=lin_loss)
    A = out['Int']
    torch.testing.assert_close(A[8], A[0]); torch.testing.assert_close(A[:, 8], A[:, 0])
    torch.testing.assert_close(out['I'], A.sum(1))                                 # I_j sums over targets i: row sums
    assert not torch.allclose(out['I'], A.sum(0))


def test_a_corrupted_label_has_negative_net_influence():
    "At the start of training on clean data, the one sample with a flipped label hurts the rest: I < 0, for every update form."
    model, b = lin_toy(n=40, d=3, seed=5, flip=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = net_influence(model, opt, b, 'adam', loss=lin_loss)
    for u in ('adam', 'adam_momentum', 'sgd'):
        assert out[u][7] < 0 and (out[u] >= 0).float().mean() > 0.8, u
    assert 7 not in select_positive(out['I']).tolist()


def test_projection_preserves_inner_products():
    g = torch.Generator().manual_seed(0); X, Y = torch.randn(50, 4000, generator=g), torch.randn(50, 4000, generator=g)
    pr = RandomProjector(4000, 2048, seed=3, block=1500)
    err = ((pr(X) * pr(Y)).sum(1) - (X * Y).sum(1)).abs() / (X.norm(dim=1) * Y.norm(dim=1))
    assert err.max() < 0.1
    torch.testing.assert_close(pr(X), RandomProjector(4000, 2048, seed=3, block=1500)(X))
    assert not torch.allclose(pr(X), RandomProjector(4000, 2048, seed=4, block=1500)(X))
    with pytest.raises(ValueError, match='columns'): pr(X[:, :5])


def test_selection_keeps_zero_and_falls_back():
    I = torch.tensor([0.0, -1e-9, 3.0, -2.0])
    assert select_positive(I).tolist() == [0, 2]
    assert select_positive(torch.tensor([-3.0, -1.0, -2.0]), min_frac=0.3).tolist() == [1]
    assert select_positive(I, tau=-math.inf).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match='tau'): select_positive(I, tau=math.inf)


def test_errors_are_clear():
    rows = encode_rows(make_domains(8, seed=0))
    with pytest.raises(ValueError, match='warmup_frac'): evic_plan(rows, 8, None, [], warmup_frac=0)
    with pytest.raises(ValueError, match='warmup_frac'): evic_plan(rows, 8, None, [], warmup_frac=2.0)
    with pytest.raises(ValueError, match='iterations'): evic_plan(rows, 8, None, [], iterations=0)
    with pytest.raises(TypeError, match='iterations'): evic_plan(rows, 8, None, [], iterations=2.0)
    with pytest.raises(ValueError, match='warmup_frac'): EVICConfig(warmup_frac=-0.1)
    with pytest.raises(ValueError, match='iterations'): EVICConfig(iterations=0)
    m, other = make_model(0), make_model(1)
    G = per_sample_grads(m, stack_rows(rows[:2]))
    with pytest.raises(ValueError, match='not in the optimizer'): adam_preconditioned(G, torch.optim.AdamW(other.parameters()), list(m.parameters()))
    with pytest.raises(TypeError, match='Adam'): adam_preconditioned(G, torch.optim.SGD(m.parameters(), lr=0.1), list(m.parameters()))
    with pytest.raises(ValueError, match='fewer than one batch'): list(passes(range(3), 4, torch.Generator()))
    with pytest.raises(ValueError, match='only arithmetic'): make_sample('code', __import__('random').Random(0), 'clash')


def test_tau_minus_inf_is_the_estimate_free_plan_and_estimates_leave_training_alone():
    rows = encode_rows(make_domains(8, seed=1))
    tc = TrainConfig(steps=100, batch_size=8, lr=3e-3, min_lr=3e-3, warmup_steps=1, betas=(0.9, 0.999), weight_decay=0.0, progress=False)
    ma, mb, log = make_model(0), make_model(0), []
    train_curriculum(ma, rows, evic_plan(rows, 8, torch.Generator().manual_seed(0), log, iterations=2, tau=-math.inf, probe_next=True), tc)
    train_curriculum(mb, rows, _estimate_free(rows, 8, torch.Generator().manual_seed(0), 2, 1), tc)
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert [len(r['S']) for r in log] == [24, 24] and all('I_next' in r for r in log)


def test_plans_yield_their_budgets():
    g = torch.Generator().manual_seed(0)
    assert len(list(mixing_plan(30, 8, 17, g)(None, None))) == 17
    b = list(sequential_plan([list(range(10)), list(range(10, 30))], 4, [3, 5], g)(None, None))
    assert len(b) == 8 and all(i < 10 for x in b[:3] for i in x) and all(i >= 10 for x in b[3:] for i in x)
    one = list(passes(range(10), 3, g, n_passes=1)); assert len(one) == 3 and len({i for x in one for i in x}) == 9


def test_round_stats_and_steps_to():
    pool = [dict(domain=d, kind=k) for d in DOMAINS for k in ('clean', 'clean', 'corrupt')]
    show = [0, 3, 6]; Int = np.eye(3).tolist()
    log = [dict(round=1, step=4, S=[0, 1, 3], I=[1.0, 1, -1, 1, -1, -1, -1, -1, -1], Int=Int, adam_momentum=[1.0] * 9, sgd=[-1.0] * 9),
           dict(round=2, step=9, S=[0, 2], I=[1.0, -1, 1, -1, -1, -1, -1, -1, -1], Int=Int, adam_momentum=[1.0] * 9, sgd=[-1.0] * 9)]
    st = round_stats(log, pool, show, 'adam')
    assert st[0]['coverage'] == pytest.approx(3 / 9) and st[1]['coverage'] == pytest.approx(4 / 9)
    assert st[1]['corrupt_kept'] == pytest.approx(1 / 3) and st[0]['corrupt_kept'] == 0.0
    assert st[0]['flip_I'] is None and st[1]['flip_I'] == pytest.approx(3 / 9)
    assert st[0]['adam_momentum_frac'] == 1.0 and st[0]['sgd_frac'] == 0.0
    rnd = round_stats([dict(round=1, step=0, S=[2, 5, 8])], pool, show, 'adam')[0]
    assert rnd['corrupt_kept'] == 1.0 and 'flip_I' not in rnd
    curve = [dict(step=10, acc=0.2), dict(step=20, acc=0.5), dict(step=30, acc=0.4)]
    assert steps_to(curve, 0.45) == 20 and steps_to(curve, 0.6) is None


def _fake(evic_gain, frac, static_gain, n=5, seed=0, dmt_gain=0.01, pre=()):
    """Final accuracies per (method, seed): EVIC `evic_gain` above MTL, DMT `dmt_gain` above it, one-shot selection `static_gain` below EVIC;
    EVIC's steps to MTL's final accuracy are `frac` of MTL's; `pre`: precondition claims recorded beside the claims."""
    rng = np.random.default_rng(seed); rows = []
    for s in range(n):
        base = 0.6 + 0.02 * rng.standard_normal()
        for m, a, f in (('mtl', base, 1.0), ('sequential', base - 0.2, CENSORED), ('dmt', base + dmt_gain, 0.9),
                        ('static', base + evic_gain - static_gain + 0.003 * rng.standard_normal(), 1.0),
                        ('evic', base + evic_gain + 0.005 * rng.standard_normal(), frac + 0.02 * rng.standard_normal())):
            rows.append(dict(method=m, seed=s, acc=a, step_frac=f))
    r = Results('evic', EVICConfig(mode='quick'), rows, seeds=list(range(n)))
    return r.conclude(verdict, claims(r) + list(pre), headline(r))


def _precondition(holds: bool) -> Claim:
    "A made-up precondition (there is headroom: oracle minus MTL's final accuracy is above the declared 5 points)."
    est = 12.0 if holds else 2.0
    return Claim('oracle − MTL final accuracy, points (made up)', est, est - 1.0, est + 1.0, null=5.0, n=5, role='precondition', threshold_from='min_headroom')


CASES = [(0.05, 0.7, 0.05, 'reproduced'), (0.05, 1.3, 0.0, 'partly'), (0.0, 1.4, 0.0, 'not reproduced'), (-0.05, 1.5, -0.03, 'not reproduced')]


@pytest.mark.parametrize('gain,frac,static,want', CASES)
def test_verdict_rule(gain, frac, static, want, tmp_path):
    r = _fake(gain, frac, static)
    assert r.verdict == want and len(r.claims) == 3
    assert strongest_baseline(r) == 'dmt'                                          # the strongest baseline, not MTL by default
    assert r.claims[0].estimate == pytest.approx(100 * (gain - 0.01), abs=1.0)
    back = load_results('evic', save_results(r, tmp_path).parent)
    assert verdict(back) == want and back.headline == r.headline


def test_beating_mtl_but_not_the_strongest_baseline_is_not_reproduced():
    "EVIC 5 points above MTL but 5 below DMT, slower than MTL, level with one-shot selection: judged against DMT, nothing shows."
    r = _fake(0.05, 1.3, 0.0, dmt_gain=0.10)
    assert strongest_baseline(r) == 'dmt' and 'DMT' in r.claims[0].name.upper()
    assert r.claims[0].opposite and r.verdict == 'not reproduced'
    assert _fake(0.05, 1.3, 0.0, dmt_gain=-0.05).verdict == 'partly'              # with MTL the strongest, the same EVIC rows show one part


@pytest.mark.parametrize('gain,frac,static,want', CASES)
def test_failed_precondition_makes_it_untestable(gain, frac, static, want, tmp_path):
    r = _fake(gain, frac, static, pre=[_precondition(False)])
    assert r.verdict == 'untestable here' and verdict(r) == 'untestable here'
    assert verdict(load_results('evic', save_results(r, tmp_path).parent)) == 'untestable here'   # read back from the file
    assert _fake(gain, frac, static, pre=[_precondition(True)]).verdict == want                   # one that holds leaves the rule's verdict


def test_config_sizes_and_seeds(monkeypatch):
    assert EVICConfig(mode='full').seeds == [0, 1, 2, 3, 4] and EVICConfig(mode='full').budget == 720 and EVICConfig(mode='full').max_steps == 724
    monkeypatch.setenv('WORKBENCH_SEED', '7'); assert EVICConfig(mode='quick').seeds[0] == 7
    with pytest.raises(ValueError, match="'evic'"): EVICConfig(methods=('mtl', 'static'))
    with pytest.raises(ValueError, match='unique'): EVICConfig(methods=('mtl', 'static', 'evic', 'evic'))
    assert set(METHODS) >= {'mtl', 'sequential', 'dmt', 'static', 'evic', 'evic_sgd', 'random'}


def test_a_tiny_unit_runs_and_the_random_control_needs_sizes():
    cfg = EVICConfig(mode='quick', n_per_domain=8, batch_size=8, iterations=2, epochs_per_iteration=1, eval_every=2, pretrain_steps=5, n_test=4, n_show=2)
    u = run_unit(cfg, 'evic', cfg.seeds[0])
    assert u['steps'] <= cfg.max_steps and len(u['rounds']) == 2 and len(u['snapshots']) == 2 and u['rounds'][0]['flip_next'] is not None
    with pytest.raises(ValueError, match='sizes'): run_unit(cfg, 'random', 0)
    r = run_unit(cfg, 'random', cfg.seeds[0], sizes=[10, 12])
    assert [x['frac'] for x in r['rounds']] == [10 / 24, 12 / 24]


def test_recorded_run_passes_the_schema_and_covers_every_method():
    "The committed full run passes the schema and has every method on every seed."
    from workbench.core import check_results, get_settings
    import json
    path = get_settings().results_path / 'evic.json'
    if not path.exists(): pytest.skip('no full run recorded yet: `workbench run evic --full`')
    check_results(json.loads(path.read_text()), str(path))
    r = load_results('evic')
    assert isinstance(r, Results) and r.mode == 'full' and len(r.seeds) >= 3 and len(r.claims) == 3
    assert set(r.df.method) >= {'mtl', 'static', 'evic'} and r.df.groupby('method').seed.nunique().min() == len(r.seeds)

"Cross-checks of `workbench.data_selection.evic`: per-sample gradients, Adam-preconditioned interactions against real optimizer steps, the LESS form as a threshold shift, symmetry, projection, selection, the mechanism check, the plans at equal updates, and the verdict rule on made-up rows (fast, CPU)."
import math
import numpy as np
import pandas as pd
import pytest
import torch
from torch.func import functional_call
from workbench.core import Results, Claim, save_results, load_results, UNTESTABLE
from workbench.train import TrainConfig
from workbench.data_selection.evic import (TOK, DOMAINS, UPDATES, make_domains, make_sample, encode_rows, stack_rows, make_model,
    per_sample_grads, summed_grad, adam_preconditioned, real_interactions, RandomProjector, interaction_matrix,
    net_influence, select_positive, auc_below, sample_losses, passes, train_curriculum, evic_plan, mixing_plan, sequential_plan,
    round_lengths, _estimate_free, round_stats, acc_at, EVICConfig, claims, preconditions, comparisons, verdict, headline,
    strongest_baseline, mechanism, current_record, METHODS, RUN, run_unit, _rows)


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


@pytest.mark.parametrize('momentum', [True, False])
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
    G = per_sample_grads(m, b); U = adam_preconditioned(G, opt, list(m.parameters()), momentum=True)
    errs = []
    for lr in (1e-4, 1e-5, 1e-6):
        real = real_interactions(m, opt, b, 1, lr, momentum=True)
        errs.append(((lr * U[1] @ G.T - real).norm() / real.norm()).item())
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-3


def test_momentum_free_update_is_the_difference_of_two_steps():
    model, b = lin_toy(n=6, seed=2); opt = _adam_history(model, b, lin_loss)
    G = per_sample_grads(model, b, loss=lin_loss); ps = list(model.parameters())
    zero = adam_preconditioned(torch.zeros_like(G[:1]), opt, ps, momentum=True)
    torch.testing.assert_close(adam_preconditioned(G, opt, ps), adam_preconditioned(G, opt, ps, momentum=True) - zero)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)                        # no history: m = 0, both forms agree
    torch.testing.assert_close(adam_preconditioned(G, fresh, ps), adam_preconditioned(G, fresh, ps, momentum=True))


def test_the_less_form_is_the_momentum_free_form_shifted_by_one_constant():
    "On the LM: I^LESS_j − I^Δ_j = u(0)·G for every j, so both forms rank the pool identically and have the same AUC."
    torch.manual_seed(0); m = make_model(4).double(); pool = make_domains(6, seed=4); rows = encode_rows(pool)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0)
    b = stack_rows(rows)
    for _ in range(5): opt.zero_grad(); sample_losses(m, b).mean().backward(); opt.step()
    out = net_influence(m, opt, rows, chunk=5)
    assert torch.equal(out['I'], out['adam_momentum'])                            # the primary estimate is the LESS form
    ps = [p for p in m.parameters() if p.requires_grad]
    c = (adam_preconditioned(torch.zeros(1, sum(p.numel() for p in ps), dtype=torch.float64), opt, ps, momentum=True)[0]
         @ summed_grad(m, b)).item()
    torch.testing.assert_close(out['adam_momentum'] - out['adam'], torch.full_like(out['adam'], c), rtol=1e-7, atol=1e-9)
    assert torch.equal(torch.argsort(out['adam_momentum']), torch.argsort(out['adam']))
    bad = np.array([s['kind'] == 'corrupt' for s in pool])
    assert auc_below(out['adam_momentum'], bad) == auc_below(out['adam'], bad)
    # the threshold differs: LESS keeps I^Δ >= -c
    assert set(select_positive(out['adam_momentum']).tolist()) == set(torch.nonzero(out['adam'] >= -c).flatten().tolist())


def test_sgd_interactions_are_symmetric_adam_ones_are_not():
    model, b = lin_toy(n=10, d=5, seed=3); opt = _adam_history(model, b, lin_loss)
    G = per_sample_grads(model, b, loss=lin_loss)
    S = interaction_matrix(G, G)
    A = interaction_matrix(adam_preconditioned(G, opt, list(model.parameters()), momentum=True), G)
    torch.testing.assert_close(S, S.T)
    assert (A - A.T).norm() / A.norm() > 0.05


@pytest.mark.parametrize('update', ['adam_momentum', 'adam'])
def test_duplicates_share_rows_and_columns_and_rows_are_sources(update):
    model, b = lin_toy(n=8, seed=4)
    b = {k: torch.cat([v, v[:1]]) for k, v in b.items()}                          # row 8 duplicates row 0
    opt = _adam_history(model, b, lin_loss)
    out = net_influence(model, opt, b, update, show=list(range(9)), loss=lin_loss)
    A = out['Int']
    torch.testing.assert_close(A[8], A[0]); torch.testing.assert_close(A[:, 8], A[:, 0])
    torch.testing.assert_close(out['I'], A.sum(1))                                 # I_j sums over targets i: row sums
    assert not torch.allclose(out['I'], A.sum(0))


def test_a_corrupted_label_has_negative_net_influence():
    "At the start of training on clean data, the one sample with a flipped label hurts the rest: I < 0, for every update form."
    model, b = lin_toy(n=40, d=3, seed=5, flip=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = net_influence(model, opt, b, loss=lin_loss)
    for u in UPDATES:
        assert out[u][7] < 0 and (out[u] >= 0).float().mean() > 0.8, u
    assert 7 not in select_positive(out['I']).tolist()
    assert auc_below(out['I'], np.arange(40) == 7) == 1.0                        # the mechanism check sees it


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


def test_auc_is_the_pairwise_probability():
    rng = np.random.default_rng(1); x, bad = rng.normal(size=60), rng.random(60) < 0.25
    assert auc_below(x, bad) == pytest.approx(np.mean([(a < b) + 0.5 * (a == b) for a in x[bad] for b in x[~bad]]))
    assert auc_below(np.r_[np.zeros(3), np.ones(3)], np.r_[[True] * 3, [False] * 3]) == 1.0
    assert auc_below(np.ones(6), np.r_[[True] * 3, [False] * 3]) == 0.5
    with pytest.raises(ValueError, match='both classes'): auc_below([1.0, 2.0], [False, False])


def test_errors_are_clear():
    rows = encode_rows(make_domains(8, seed=0))
    with pytest.raises(ValueError, match='warmup_frac'): evic_plan(rows, 8, None, [], 20, warmup_frac=0)
    with pytest.raises(ValueError, match='warmup_frac'): evic_plan(rows, 8, None, [], 20, warmup_frac=2.0)
    with pytest.raises(ValueError, match='rounds'): evic_plan(rows, 8, None, [], 20, rounds=0)
    with pytest.raises(TypeError, match='rounds'): evic_plan(rows, 8, None, [], 20, rounds=2.0)
    with pytest.raises(ValueError, match='fewer than 3 rounds'): evic_plan(rows, 8, None, [], 5, rounds=3)
    with pytest.raises(ValueError, match='update'): evic_plan(rows, 8, None, [], 20, update='rmsprop')
    with pytest.raises(ValueError, match='warmup_frac'): EVICConfig(warmup_frac=-0.1)
    with pytest.raises(ValueError, match='rounds'): EVICConfig(rounds=0)
    m, other = make_model(0), make_model(1)
    G = per_sample_grads(m, stack_rows(rows[:2]))
    with pytest.raises(ValueError, match='not in the optimizer'): adam_preconditioned(G, torch.optim.AdamW(other.parameters()), list(m.parameters()))
    with pytest.raises(TypeError, match='Adam'): adam_preconditioned(G, torch.optim.SGD(m.parameters(), lr=0.1), list(m.parameters()))
    with pytest.raises(ValueError, match='fewer than one batch'): list(passes(range(3), 4, torch.Generator()))
    with pytest.raises(ValueError, match='only arithmetic'): make_sample('code', __import__('random').Random(0), 'clash')


def test_tau_minus_inf_is_the_estimate_free_plan_and_estimates_leave_training_alone():
    rows = encode_rows(make_domains(8, seed=1))
    tc = TrainConfig(steps=20, batch_size=8, lr=3e-3, min_lr=3e-3, warmup_steps=1, betas=(0.9, 0.999), weight_decay=0.0, progress=False)
    ma, mb, log = make_model(0), make_model(0), []
    ha = train_curriculum(ma, rows, evic_plan(rows, 8, torch.Generator().manual_seed(0), log, 20, rounds=2, tau=-math.inf, probe_next=True), tc)
    hb = train_curriculum(mb, rows, _estimate_free(rows, 8, torch.Generator().manual_seed(0), 20, 2), tc)
    assert ha['steps'] == hb['steps'] == 20
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert [len(r['S']) for r in log] == [24, 24] and all('I_next' in r for r in log) and [r['step'] for r in log] == [4, 12]


def test_plans_yield_their_budgets():
    g = torch.Generator().manual_seed(0)
    assert len(list(mixing_plan(range(30), 8, 17, g)(None, None))) == 17
    assert {i for b in mixing_plan([1, 3, 5, 7, 9, 11], 2, 9, g)(None, None) for i in b} <= {1, 3, 5, 7, 9, 11}
    b = list(sequential_plan([list(range(10)), list(range(10, 30))], 4, [3, 5], g)(None, None))
    assert len(b) == 8 and all(i < 10 for x in b[:3] for i in x) and all(i >= 10 for x in b[3:] for i in x)
    one = list(passes(range(10), 3, g, n_passes=1)); assert len(one) == 3 and len({i for x in one for i in x}) == 9
    assert round_lengths(100, 4, 3) == [32, 32, 32] and round_lengths(101, 4, 3) == [33, 32, 32] and sum(round_lengths(57, 6, 5)) == 51


def test_round_stats_and_reading_a_curve():
    pool = [dict(domain=d, kind=k) for d in DOMAINS for k in ('clean', 'clean', 'corrupt')]
    show = [0, 3, 6]; Int = np.eye(3).tolist()
    I1 = [1.0, 1, -1, 1, -1, -1, -1, -1, -1]
    log = [dict(round=1, step=4, S=[0, 1, 3], I=I1, Int=Int, adam_momentum=I1, adam=[v - 2 for v in I1], sgd=[-1.0] * 9),
           dict(round=2, step=9, S=[0, 2], I=[1.0, -1, 1, -1, -1, -1, -1, -1, -1], Int=Int, adam_momentum=[1.0] * 9, adam=[1.0] * 9,
                sgd=[-1.0] * 9)]
    st = round_stats(log, pool, show, 'adam_momentum')
    assert st[0]['coverage'] == pytest.approx(3 / 9) and st[1]['coverage'] == pytest.approx(4 / 9)
    assert st[1]['corrupt_kept'] == pytest.approx(1 / 3) and st[0]['corrupt_kept'] == 0.0
    assert st[0]['flip_I'] is None and st[1]['flip_I'] == pytest.approx(3 / 9)
    assert st[0]['adam_frac'] == pytest.approx(0.0) and st[0]['sgd_frac'] == 0.0 and st[0]['c_t'] == pytest.approx(2.0)
    # round 1: clean I = [1, 1, 1, -1, -1, -1], corrupted I = [-1, -1, -1]: P(corrupt < clean) = (3·3 + 0.5·3·3) / 18
    assert st[0]['auc'] == pytest.approx(0.75) and st[0]['adam_auc'] == st[0]['auc']
    rnd = round_stats([dict(round=1, step=0, S=[2, 5, 8])], pool, show, 'adam_momentum')[0]
    assert rnd['corrupt_kept'] == 1.0 and 'flip_I' not in rnd and 'auc' not in rnd
    curve = pd.DataFrame(dict(step=[0, 10, 20, 30], acc=[0.0, 0.2, 0.5, 0.4]))
    assert acc_at(curve, 30, 15) == pytest.approx(0.45) and acc_at(curve, 25, 15) == pytest.approx(0.5)
    assert acc_at(curve, 30, 1) == pytest.approx(0.4) and acc_at(curve, 15, 1) == pytest.approx(0.2)   # none inside: the last before
    with pytest.raises(ValueError, match='no evaluation'): acc_at(curve, -1, 5)


# ---- the verdict rule on made-up rows ---------------------------------------------------------------------------------

def _fake(gain=0.05, gain_frac=0.05, static_gain=0.05, n=5, seed=0, dmt=-0.1, oracle=0.2, slope=0.0, strongest_slope=0.0):
    """Made-up results: EVIC's accuracy `gain` above MTL at the end and `gain_frac` above MTL's end at step_frac, `static_gain`
    above one-shot; DMT `dmt` from MTL, the oracle `oracle` above MTL; EVIC's curve rising by `slope` per 1000 updates."""
    rng, steps = np.random.default_rng(seed), np.arange(0, 1001, 50)
    rows, curves = [], []
    for s in range(n):
        base = 0.6 + 0.02 * rng.standard_normal()
        arms = dict(mtl=(base, base), dmt=(base + dmt, base + dmt), random=(base - 0.05, base - 0.05), oracle=(base + oracle,) * 2,
                    static=(base + gain - static_gain, base), evic=(base + gain + 0.003 * rng.standard_normal(),
                                                                    base + gain_frac + 0.003 * rng.standard_normal()))
        for m, (a, af) in arms.items():
            sl = slope if m == 'evic' else strongest_slope if m == 'dmt' else 0.0
            rows.append(dict(method=m, seed=s, acc=a, acc_frac=af, auc=0.6 + 0.01 * rng.standard_normal()))
            y = a + sl * (steps - 1000) / 1000 + 0.0005 * rng.standard_normal(len(steps))
            curves.append(dict(method=m, seed=s, step=steps.tolist(), acc=y.tolist()))
    r = Results('evic', EVICConfig(mode='full'), rows, seeds=list(range(n)), tables=dict(curves=curves))   # full: declared thresholds
    return r.conclude(verdict, claims(r), headline(r))


CASES = [  # gain, gain at step_frac, gain over one-shot -> verdict
    ((0.05, 0.05, 0.05), 'reproduced'),
    ((0.05, 0.0, 0.0), 'partly'),                           # beats the strongest at equal updates only
    ((0.05, 0.05, -0.05), 'partly'),                        # loses to one-shot beyond its CI: not against the strongest baseline
    ((0.0, 0.0, 0.0), 'not reproduced'),                    # no part shows
    ((-0.05, 0.0, 0.05), 'not reproduced'),                 # beats one-shot, but below the strongest baseline beyond its CI
    ((0.05, -0.05, 0.05), 'not reproduced'),                # ahead at equal updates, behind with fewer steps beyond its CI
]


@pytest.mark.parametrize('args,want', CASES)
def test_verdict_rule(args, want, tmp_path):
    r = _fake(*args)
    assert r.verdict == want and verdict(r) == want
    assert [c.status for c in r.claims if c.is_precondition] == ['holds'] * 4
    assert len(comparisons(r)) == 3 and strongest_baseline(r) == 'mtl'
    assert r.claims[-3].estimate == pytest.approx(100 * args[0], abs=1.0)
    back = load_results('evic', save_results(r, tmp_path).parent)
    assert verdict(back) == want and back.headline == r.headline and current_record(back)


def test_the_strongest_baseline_is_the_one_compared():
    "EVIC 5 points above MTL but 5 below DMT: judged against DMT it goes the other way, so not reproduced."
    r = _fake(0.05, 0.05, 0.05, dmt=0.10)
    assert strongest_baseline(r) == 'dmt' and 'DMT' in r.claims[-3].name and r.claims[-3].opposite
    assert r.verdict == 'not reproduced'
    assert len([c for c in r.claims if c.is_precondition]) == 5                    # DMT's curve is tested for flatness too


@pytest.mark.parametrize('kw,which', [(dict(oracle=0.02), 'oracle − MTL'), (dict(oracle=-0.3), 'oracle (clean'),
                                      (dict(slope=0.3), 'EVIC'), (dict(dmt=0.10, strongest_slope=-0.3), 'DMT')])
def test_a_failed_precondition_makes_it_untestable(kw, which, tmp_path):
    "No headroom, an oracle that cannot do the task, EVIC's or the strongest baseline's curve still moving: untestable here."
    r = _fake(**kw)
    failed = [c for c in r.claims if c.is_precondition and not c.holds]
    assert r.verdict == UNTESTABLE and any(which in c.name for c in failed)
    assert verdict(load_results('evic', save_results(r, tmp_path).parent)) == UNTESTABLE


def test_the_threshold_comes_from_the_config():
    r = _fake()
    pre = preconditions(r)
    assert [c.threshold_from for c in pre] == ['min_upper', 'min_headroom', 'flat_tol', 'flat_tol']
    assert pre[2].null == r.config['flat_tol'] and pre[1].null == r.config['min_headroom']


def test_quick_thresholds_ask_nothing_full_ones_are_declared():
    q, f = EVICConfig(mode='quick'), EVICConfig(mode='full')
    assert 0 < f.flat_tol < 100 and f.min_headroom > 0 and f.min_upper > 0                       # declared, and asking something
    assert q.flat_tol >= 1e6 and q.min_headroom <= -1e6 and q.min_upper <= -1e6


def test_config_sizes_and_seeds(monkeypatch):
    full = EVICConfig(mode='full')
    assert full.seeds == [0, 1, 2, 3, 4] and full.methods == RUN and set(RUN) <= set(METHODS)
    assert full.step_frac == 0.777 and full.window >= full.eval_every and full.steps % full.eval_every == 0
    monkeypatch.setenv('WORKBENCH_SEED', '7'); assert EVICConfig(mode='quick').seeds[0] == 7
    with pytest.raises(ValueError, match="'oracle'"): EVICConfig(methods=('mtl', 'static', 'evic'))
    with pytest.raises(ValueError, match='unique'): EVICConfig(methods=('mtl', 'oracle', 'static', 'evic', 'evic'))
    with pytest.raises(ValueError, match='step_frac'): EVICConfig(step_frac=0)


def test_tiny_units_take_equal_updates_and_the_random_control_needs_sizes():
    cfg = EVICConfig(mode='quick', n_per_domain=8, batch_size=8, steps=16, rounds=2, eval_every=4, window=8, pretrain_steps=5,
                     n_test=4, n_show=2)
    u = run_unit(cfg, 'evic', cfg.seeds[0])
    assert u['steps'] == 16 and [c['step'] for c in u['curve']] == [0, 4, 8, 12, 16]
    assert len(u['rounds']) == 2 and len(u['snapshots']) == 2 and u['rounds'][0]['flip_next'] is not None
    assert all(0 <= r['auc'] <= 1 for r in u['rounds'])
    with pytest.raises(ValueError, match='sizes'): run_unit(cfg, 'random', 0)
    r = run_unit(cfg, 'random', cfg.seeds[0], sizes=[10, 12])
    assert r['steps'] == 16 and [x['frac'] for x in r['rounds']] == [10 / 24, 12 / 24]
    o = run_unit(cfg, 'oracle', cfg.seeds[0])
    rows = _rows(cfg, {('evic', 0): u, ('random', 0): r, ('oracle', 0): o})
    assert [x['steps'] for x in rows] == [16, 16, 16] and all(0 <= x['acc_frac'] <= 1 for x in rows)


def test_recorded_run_loads_and_its_verdict_recomputes():
    "The committed run passes the schema, has every method on every seed, and its verdict recomputes (either design)."
    from workbench.core import check_results, get_settings
    import json
    path = get_settings().results_path / 'evic.json'
    if not path.exists(): pytest.skip('no full run recorded yet: `workbench run evic --full`')
    check_results(json.loads(path.read_text()), str(path))
    r = load_results('evic')
    assert isinstance(r, Results) and r.mode == 'full' and len(r.seeds) >= 3 and verdict(r) == r.verdict
    assert set(r.df.method) >= {'mtl', 'static', 'evic'} and r.df.groupby('method').seed.nunique().min() == len(r.seeds)
    if current_record(r):
        assert any(c.is_precondition for c in r.claims) and len(comparisons(r)) == 3
        assert (r.df.steps == r.config['steps']).all() and not mechanism(r).empty
    else:
        assert len(r.claims) == 3 and not any(c.is_precondition for c in r.claims)   # the earlier design, kept loadable

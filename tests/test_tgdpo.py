"Cross-checks of `workbench.alignment.tgdpo`: the losses, the token rewards, the task, the preference trainer, the frontier and the verdict (fast, CPU)."
import math
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from workbench.core import Results, Claim, save_results, load_results
from workbench.alignment.tgdpo import (dpo_loss, simpo_loss, tgdpo_loss, tgdpo_weights, token_rewards, token_logps,
    DigitRuleTask, gold_reward, gold_token_reward, gold_guidance, make_policy, make_pairs, pair_rows, PreferenceLoss,
    train_preference, sample_from, reference_rewards, evaluate_policy, seq_and_labels, TGDPOConfig, fig_token_strip,
    frontier_win, matched_kl, claims, verdict, headline, gains_table, variant_label, BASELINE, RECIPE, SECOND_ARMS,
    front_win, matched_at, matched_beta, guide_rewards, preconditions, comparisons, second_arms, run_unit, _Setup,
    _weight_stats, GOLD, CENTRED)
from workbench.measure import torch_threads


def _tok(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    mc, mr = ((torch.rand(B, T, generator=g) > 0.3).double() for _ in range(2)); mc[:, 0] = mr[:, 0] = 1
    t = lambda m: -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 * m
    return dict(pol_c=t(mc), pol_r=t(mr), ref_c=t(mc), ref_r=t(mr), rhat_c=torch.randn(B, T, generator=g, dtype=torch.float64) * mc,
                rhat_r=torch.randn(B, T, generator=g, dtype=torch.float64) * mr, mask_c=mc, mask_r=mr)


def _grads(d, **kw):
    pc, pr = d['pol_c'].clone().requires_grad_(), d['pol_r'].clone().requires_grad_()
    tgdpo_loss(**dict(d, pol_c=pc, pol_r=pr), **kw).backward()
    return pc.grad, pr.grad


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_alpha_zero_and_reference_guide_give_dpo(seed):
    d = _tok(seed)
    S = {k: v.sum(-1) for k, v in d.items()}
    want = dpo_loss(S['pol_c'], S['pol_r'], S['ref_c'], S['ref_r'], beta=0.2, reduction='none')
    assert torch.allclose(tgdpo_loss(**d, beta=0.2, alpha=0.0, reduction='none'), want, atol=1e-12)
    zr = dict(d, rhat_c=token_rewards(d['ref_c'], d['ref_c'], d['mask_c']), rhat_r=token_rewards(d['ref_r'], d['ref_r'], d['mask_r']))
    assert torch.allclose(tgdpo_loss(**zr, beta=0.2, alpha=3.0, reduction='none'), want, atol=1e-12)
    # gradients too: d/dℓ_t of DPO is the same for every unmasked token of a sequence
    gc, gr = _grads(d, alpha=0.0)
    z = 0.1 * ((S['pol_c'] - S['ref_c']) - (S['pol_r'] - S['ref_r']))
    coef = (0.1 * torch.sigmoid(-z) / len(z))[:, None]
    assert torch.allclose(gc, -coef * d['mask_c'], atol=1e-12) and torch.allclose(gr, coef * d['mask_r'], atol=1e-12)


def test_constant_guidance_is_dpo_with_two_betas():
    d = _tok(3); c, a, b = -0.6, 0.7, 0.1
    cd = dict(d, rhat_c=torch.full_like(d['rhat_c'], c) * d['mask_c'], rhat_r=torch.full_like(d['rhat_r'], c) * d['mask_r'])
    lc, lr = (d['pol_c'] - d['ref_c']).sum(-1), (d['pol_r'] - d['ref_r']).sum(-1)
    want = -F.logsigmoid(b * (1 + a * c) * lc - b * (1 - a * c) * lr).mean()
    assert torch.allclose(tgdpo_loss(**cd, alpha=a, beta=b), want, atol=1e-12)


def test_padding_contributes_nothing():
    d = _tok(4)
    junk = {k: torch.cat([v, torch.full((v.shape[0], 4), -9.0 if k.startswith(('pol', 'ref')) else 5.0, dtype=v.dtype)], 1) for k, v in d.items()}
    for k in ('mask_c', 'mask_r'): junk[k][:, -4:] = 0
    assert torch.allclose(tgdpo_loss(**junk), tgdpo_loss(**d), atol=1e-12)
    gc, gr = _grads(junk)
    assert gc[:, -4:].abs().sum() == 0 and gr[:, -4:].abs().sum() == 0


def test_gradient_signs_follow_the_weights():
    d = _tok(5); d['rhat_c'] *= 3; d['rhat_r'] *= 3       # large r̂ so that some weights are negative with α = 0.5
    gc, gr = _grads(d, alpha=0.5)
    wc, wr = tgdpo_weights(d['rhat_c'], d['mask_c'], 0.5), tgdpo_weights(d['rhat_r'], d['mask_r'], 0.5, chosen=False)
    assert (wc < 0).any() and (wr < 0).any()
    assert (gc[wc > 0] < 0).all() and (gc[wc < 0] > 0).all()     # descent raises chosen tokens with f_w > 0, lowers those with f_w < 0
    assert (gr[wr > 0] > 0).all() and (gr[wr < 0] < 0).all()
    # gradient magnitude is proportional to the weight within a sequence
    i = 0; m = d['mask_c'][i] > 0
    ratio = gc[i][m] / wc[i][m]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), atol=1e-12)
    gc2, _ = _grads(d, alpha=0.5, clamp_min=0.0)
    assert (gc2 <= 0).all()                                       # clamping removes the sign flips


def test_swap_with_alpha_zero():
    d = _tok(6)
    sw = dict(d, pol_c=d['pol_r'], pol_r=d['pol_c'], ref_c=d['ref_r'], ref_r=d['ref_c'], rhat_c=d['rhat_r'], rhat_r=d['rhat_c'], mask_c=d['mask_r'], mask_r=d['mask_c'])
    z = 0.1 * ((d['pol_c'] - d['ref_c']).sum(-1) - (d['pol_r'] - d['ref_r']).sum(-1))
    assert torch.allclose(tgdpo_loss(**sw, alpha=0.0, reduction='none'), -F.logsigmoid(-z), atol=1e-12)


def test_shape_and_value_errors():
    d = _tok(7)
    with pytest.raises(ValueError, match='same shape'): tgdpo_loss(**dict(d, mask_c=d['mask_c'][:, :-1]))
    with pytest.raises(ValueError, match='same shape'): tgdpo_loss(**dict(d, ref_r=d['ref_r'][:, 1:]))
    with pytest.raises(ValueError, match='batch size'):
        tgdpo_loss(**dict(d, **{k: d[k][:2] for k in ('pol_r', 'ref_r', 'rhat_r', 'mask_r')}))
    with pytest.raises(ValueError, match=r'\(B, T\)'): tgdpo_loss(**{k: v.sum(-1) for k, v in d.items()})
    with pytest.raises(TypeError): tgdpo_loss(**dict(d, pol_c=d['pol_c'].tolist()))
    with pytest.raises(ValueError, match='beta'): tgdpo_loss(**d, beta=-1)
    with pytest.raises(ValueError, match='alpha'): tgdpo_loss(**d, alpha=float('inf'))
    with pytest.raises(ValueError, match='1-D'): dpo_loss(d['pol_c'], d['pol_r'], d['ref_c'], d['ref_r'])
    with pytest.raises(ValueError, match='same shape'): simpo_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match='shape'): token_rewards(d['pol_c'], d['ref_c'][:, :3], d['mask_c'])
    with pytest.raises(ValueError, match='one shape'): fig_token_strip([[1, 2]], [[0.1]], ['a'])


def test_simpo_matches_official_form():
    a, b = torch.tensor([-1.0, -2.5]), torch.tensor([-1.5, -1.0])
    beta, gamma = 2.0, 1.0   # the official code: logits = (a - b) - gamma / beta; loss = -logsigmoid(beta * logits)
    assert torch.allclose(simpo_loss(a, b, beta, gamma, reduction='none'), -F.logsigmoid(beta * ((a - b) - gamma / beta)))


def test_token_logps_is_shift_correct():
    task = DigitRuleTask(); m = make_policy(task, seed=1).eval()
    P = task.sample_prompts(3, seed=0); ids, lab = seq_and_labels(task, P, task.rule(P))
    lp, mk = token_logps(m, ids, lab)
    ls = m(input_ids=ids).logits.log_softmax(-1)
    want = ls[:, :-1].gather(2, ids[:, 1:, None]).squeeze(-1) * mk
    assert torch.allclose(lp, want, atol=1e-6)
    assert mk.sum() == 3 * task.length and not mk[:, :task.prompt_len - 1].any()


def test_task_gold_reward():
    task = DigitRuleTask(); P = task.sample_prompts(6, seed=2)
    assert torch.equal(gold_reward(task, P, task.rule(P)), torch.full((6,), sum(task.weights)))
    y = task.rule(P).clone(); y[:, 0] = (y[:, 0] + 1) % 10
    assert torch.allclose(gold_reward(task, P, y), torch.full((6,), sum(task.weights) - task.weights[0]))
    assert torch.equal(gold_guidance(task, P, y, task.rule(P), centre='half')[0][:, 0], torch.full((6,), -task.weights[0] / 2))
    assert torch.equal(task.sample_prompts(4, seed=9), task.sample_prompts(4, seed=9))


def test_gold_guide_is_scaled_and_centred():
    "Pooled centring: each position's r̂ sums to 0 over both sides, so mean f_w = mean f_l for every α; the scale is β."
    task = DigitRuleTask(); P = task.sample_prompts(64, seed=1)
    g = torch.Generator().manual_seed(0)
    yc, yr = (torch.where(torch.rand(64, 8, generator=g) < p, task.rule(P), torch.randint(0, 10, (64, 8), generator=g)) for p in (0.45, 0.3))   # both sides mostly wrong, as samples of the reference
    c1, r1 = gold_guidance(task, P, yc, yr, beta=0.1); c2, r2 = gold_guidance(task, P, yc, yr, beta=0.3)
    assert torch.allclose(c2, 3 * c1, atol=1e-6) and torch.allclose(r2, 3 * r1, atol=1e-6)
    assert torch.allclose(c1.sum(0) + r1.sum(0), torch.zeros(8), atol=1e-5)
    assert (c1.mean() > 0) and (r1.mean() < 0)                  # it still ranks: chosen tokens are better on average
    for a in (0.5, 5.0, 20.0):
        m = torch.ones_like(c1)
        assert tgdpo_weights(c1, m, a).mean() == pytest.approx(tgdpo_weights(r1, m, a, chosen=False).mean().item(), abs=1e-5)
    hc, hr = gold_guidance(task, P, yc, yr, centre='half')      # the previous version: rejected side weighs more
    assert tgdpo_weights(hr, torch.ones_like(hr), 0.5, chosen=False).mean() > tgdpo_weights(hc, torch.ones_like(hc), 0.5).mean() + 0.02


def test_trainer_alpha_zero_equals_dpo_and_guidance_flows():
    torch.manual_seed(0)
    task = DigitRuleTask(); ref = make_policy(task, seed=0).eval().requires_grad_(False)
    pairs = make_pairs(task, ref, 32, seed=1)
    rows = pair_rows(task, pairs, ref)
    ref_before = {k: v.clone() for k, v in ref.state_dict().items()}
    _, h1, _ = train_preference(ref, rows, PreferenceLoss('dpo'), steps=2, batch_size=16)
    guide = make_policy(task, seed=5).eval()
    grows = pair_rows(task, pairs, ref, guide=guide)
    assert any(r['chosen_rhat'].abs().sum() > 0 for r in grows)
    _, h2, _ = train_preference(ref, grows, PreferenceLoss('tgdpo', alpha=0.0), steps=2, batch_size=16)
    assert h1.train_loss == pytest.approx(h2.train_loss, abs=1e-6)
    _, h3, _ = train_preference(ref, grows, PreferenceLoss('tgdpo', alpha=2.0), steps=2, batch_size=16)
    assert h3.train_loss[-1] != pytest.approx(h1.train_loss[-1], abs=1e-6)   # step 1 is log 2 for every loss (policy = ref)
    _, h4, _ = train_preference(ref, rows, PreferenceLoss('simpo', beta=2.0), steps=2, batch_size=16)
    assert math.isfinite(h4.train_loss[-1])
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ref_before.items())     # the reference never moves
    P = task.sample_prompts(64, seed=3); rr = reference_rewards(task, ref, P, k=4, seed=1)
    assert rr.shape == (64, 4)
    ev = evaluate_policy(task, ref, ref, P, rr)
    assert ev['kl'] == pytest.approx(0.0, abs=1e-5)


def test_sampling_uses_the_shared_decode_loop():
    "sample_from is generate_ids: seeded, the prompt dropped, the same tokens as the platform loop."
    from workbench.train import generate_ids
    task = DigitRuleTask(); m = make_policy(task, seed=2).eval(); P = task.sample_prompts(16, seed=0)
    y = sample_from(m, task, P, seed=7)
    assert y.shape == (16, task.length) and torch.equal(y, sample_from(m, task, P, seed=7))
    assert torch.equal(y, generate_ids(m, P, task.length, greedy=False, seed=7)[:, P.shape[1]:])
    assert not torch.equal(y, sample_from(m, task, P, seed=8))


def test_torch_threads_restores_the_thread_count():
    n = torch.get_num_threads()
    with torch_threads(1): assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def test_trajectory_frontier_of_the_earlier_design():
    assert frontier_win([1.0, 2.0], [0.6, 0.8], 1.5) == pytest.approx(0.7)
    assert frontier_win([1.0, 2.0, 3.0], [0.8, 0.6, 0.7], 2.5) == pytest.approx(0.8)     # a later drop does not lower the frontier
    assert frontier_win([1.0], [0.9], 0.0) == pytest.approx(0.5)                          # KL 0: the reference itself
    with pytest.raises(ValueError, match='at'): frontier_win([1.0], [0.9], -1.0)
    df = pd.DataFrame([dict(variant=v, seed=0, n_pairs=4, kl=k, win=w) for v, k, w in
                       [('A', 1.0, 0.7), ('A', 2.0, 0.8), ('B', 1.0, 0.6), ('B', 4.0, 0.9)]])
    m = matched_kl(df, 'A', 'B')
    assert m.kl.item() == 2.0 and m.win.item() == pytest.approx(0.8) and m.win_base.item() == pytest.approx(0.6 + 0.3 / 3)


def test_beta_frontier_and_matched_kl():
    "The front of final points (dominated points dropped, the reference prepended); K* clipped into both ranges."
    assert front_win([1.0, 2.0, 3.0], [0.7, 0.6, 0.8], 2.0) == pytest.approx(0.75)
    assert front_win([2.0], [0.9], 1.0) == pytest.approx(0.7)                              # on the line from (0, ½)
    assert math.isnan(front_win([2.0], [0.9], 3.0))
    assert front_win([1.0, 2.0], [0.4, 0.45], 1.5) == pytest.approx(0.5)                  # below the reference: the reference
    assert matched_at([1.0, 3.0], [2.0, 5.0], 4.0) == (3.0, True) and matched_at([1.0, 3.0], [2.0, 5.0], 0.5) == (2.0, True)
    assert matched_at([4.0, 6.0], [1.0, 2.0], 1.5) == (2.0, False)
    rows = [dict(variant=v, seed=s, n_pairs=8, beta=b, final=f, kl=k, win=w) for s in (0, 1) for v, b, f, k, w in
            [('B', 0.1, True, 2.0, 0.70), ('B', 0.4, True, 1.0, 0.60), ('B', 0.1, False, 0.5, 0.58),
             ('A', 0.1, True, 3.0, 0.78), ('A', 0.4, True, 1.5, 0.70), ('A', 0.1, False, 0.6, 0.60)]]
    df = pd.DataFrame(rows)
    m = matched_beta(df, 'A', 'B', at_beta=0.1)                                             # K* = B's KL at β=0.1, inside both
    assert m.kl.tolist() == [2.0, 2.0] and m.inside.all()
    assert m.win.tolist() == pytest.approx([0.70 + 0.08 * 0.5 / 1.5] * 2) and m.win_base.tolist() == pytest.approx([0.70] * 2)
    ma = matched_beta(df, 'A', 'B', at_beta=0.1, checkpoints='all')                        # the early checkpoints join the fronts
    assert ma.kl.tolist() == [2.0, 2.0] and ma.win_base.tolist() == pytest.approx([0.70] * 2)
    with pytest.raises(ValueError, match='checkpoints'): matched_beta(df, 'A', 'B', checkpoints='last')
    with pytest.raises(ValueError, match='no final checkpoint'): matched_beta(df, 'A', 'B', at_beta=0.2)


def _fake_results(gain, n_seeds=5, sizes=(8, 16), noise=0.01, recipe_kl=(1.0, 2.0), recipe_win=None, spread=0.1,
                  min_spread=0.05):
    """Rows as run_experiment writes them: DPO's final checkpoints at β = 0.4, 0.1 with KL (1, 2) and win 0.7, 0.8; the
    recipe at `recipe_kl`, `gain` ahead (per size) or with win rates `recipe_win`; its weights' sd `spread`."""
    rng = np.random.default_rng(0); rows, wts = [], []
    cfg = TGDPOConfig(mode='quick', n_pairs=sizes, batch_size=4, n_seeds=n_seeds, betas=(0.1, 0.4), min_weight_spread=min_spread)
    for v in (BASELINE, RECIPE):
        for n in sizes:
            for s in range(n_seeds):
                for i, (b, k0) in enumerate(((0.4, 1.0), (0.1, 2.0))):
                    k = recipe_kl[i] if v == RECIPE else k0
                    w = (recipe_win[i] if v == RECIPE and recipe_win else 0.6 + 0.1 * k0 + (gain[n] if v == RECIPE else 0)) + noise * rng.standard_normal()
                    rows.append(dict(variant=variant_label(v), guide=v[1] or 'none', alpha=v[2], clamp_min=v[3], beta=b, n_pairs=n, seed=s,
                                     epoch=2.0, step=4, final=True, win=w, win_se=0.01, gold=1.0, kl=k, p_special=0.0))
                    sd = spread + 0.002 * rng.standard_normal() if v == RECIPE else 0.0
                    wts.append(dict(variant=variant_label(v), n_pairs=n, seed=s, beta=b, f_w=1.0, f_l=1.0, f_min=1.0, neg_frac=0.0, spread=sd,
                                    rhat_sd=None, rhat_mean_c=None, rhat_mean_r=None, rhat_corr=None))
    r = Results('tgdpo', cfg, rows, seeds=list(range(n_seeds)), tables=dict(weights=wts))
    return r.conclude(verdict, claims(r), headline(r))


@pytest.mark.parametrize('gain,want', [({8: 0.05, 16: 0.05}, 'reproduced'), ({8: 0.05, 16: 0.0}, 'partly'),
                                       ({8: 0.0, 16: 0.0}, 'not reproduced'), ({8: -0.05, 16: -0.05}, 'not reproduced')])
def test_verdict_counts_each_size(gain, want, tmp_path):
    r = _fake_results(gain)
    pre, cs = [c for c in r.claims if c.is_precondition], [c for c in r.claims if not c.is_precondition]
    assert len(pre) == 2 and all(c.holds and c.threshold_from == 'min_weight_spread' for c in pre)   # one precondition per size
    assert [c.n for c in cs] == [5, 5] and len(cs) == 2                                           # one claim per data size
    assert r.verdict == want
    assert cs[0].estimate == pytest.approx(100 * gain[8], abs=2.0)                                # in win-rate points
    back = load_results('tgdpo', save_results(r, tmp_path).parent)                                 # the verdict is recomputed from the file
    assert verdict(back) == want and back.headline == r.headline and claims(back) == r.claims
    gt = gains_table(back)
    assert set(gt.variant) == {'DPO', variant_label(RECIPE)}
    assert (gt[gt.variant == variant_label(RECIPE)].inside == 1.0).all()


def test_a_win_bought_with_more_kl_is_not_reproduced():
    "The recipe's final points beat DPO's (0.72, 0.85 vs 0.7, 0.8) only by moving to KL 1.5 and 4: at DPO's KL 2 it is behind."
    r = _fake_results({8: 0.0, 16: 0.0}, recipe_kl=(1.5, 4.0), recipe_win=(0.72, 0.85))
    fin = r.df[r.df.final].groupby('variant').win.max()
    assert fin[variant_label(RECIPE)] > fin['DPO'] + 0.04
    cs = comparisons(r)
    # at K* = 2: the recipe's front is 0.72 + (0.85 − 0.72)·0.5/2.5 = 0.746, DPO's 0.8
    assert all(c.opposite and c.estimate == pytest.approx(-5.4, abs=1.0) for c in cs) and r.verdict == 'not reproduced'


@pytest.mark.parametrize('gain', [{8: 0.05, 16: 0.05}, {8: 0.05, 16: 0.0}, {8: -0.05, 16: -0.05}])
def test_weights_that_barely_move_make_it_untestable(gain, tmp_path):
    "The recipe's weights at the paper's β spread less than the declared minimum: the verdict is untestable, whatever the gains."
    r = _fake_results(gain, spread=0.02)
    assert [c.holds for c in preconditions(r)] == [False, False]
    assert r.verdict == 'untestable here' and verdict(r) == 'untestable here'
    assert verdict(load_results('tgdpo', save_results(r, tmp_path).parent)) == 'untestable here'   # read back from the file
    assert _fake_results(gain, spread=0.02, min_spread=0.01).verdict == _fake_results(gain).verdict   # a lower threshold: the rule decides


def test_a_record_of_the_earlier_design_keeps_its_rule():
    "Rows without β: the trajectory claims (no precondition), its headline and table."
    rows = [dict(variant=variant_label(v), guide=v[1] or 'none', alpha=v[2], clamp_min=v[3], n_pairs=8, seed=s, epoch=e, step=int(2 * e),
                 final=e == 2.0, win=0.6 + 0.1 * e + (0.05 if v == RECIPE else 0.0) + 0.01 * s, win_se=0.01, gold=1.0, kl=e, p_special=0.0)
            for v in (BASELINE, RECIPE) for s in range(3) for e in (1.0, 2.0)]
    wts = [dict(variant=variant_label(v), n_pairs=8, seed=s, f_w=1.0, f_l=1.0, f_min=1.0, neg_frac=0.0, rhat_sd=0.03 if v == RECIPE else None, rhat_corr=None)
           for v in (BASELINE, RECIPE) for s in range(3)]
    r = Results('tgdpo', dict(mode='full', seed=0, beta=0.1), rows, seeds=[0, 1, 2], tables=dict(weights=wts))
    cs = claims(r)
    assert len(cs) == 1 and not cs[0].is_precondition and cs[0].estimate == pytest.approx(5.0)
    assert verdict(r.conclude(verdict, cs, headline(r))) == 'reproduced'          # 5 points at K* = 2 on every seed
    assert 'equal_steps' in gains_table(r) and headline(r).startswith('TGDPO (DPO guide, α=0.5) − DPO')


def test_weight_statistics():
    "sd of the weights: 0 at α = 0; α·sd(r̂) when both sides' means agree (a centred guide); negative share and side means."
    task = DigitRuleTask(); P = task.sample_prompts(40, seed=0)
    pairs = dict(prompts=P, chosen=task.rule(P), rejected=(task.rule(P) + 1) % 10)
    g = torch.Generator().manual_seed(1)
    rc = 0.05 * torch.tensor(task.weights) + 0.01 * torch.randn(40, 8, generator=g)     # follows r* = w_t on the chosen side
    rr = 0.01 * torch.randn(40, 8, generator=g)
    rr = rr - rr.mean() - rc.mean()                                  # side means opposite: mean f_w = mean f_l
    rows = [dict(chosen_rhat=torch.cat([torch.zeros(9), rc[i]]), rejected_rhat=torch.cat([torch.zeros(9), rr[i]])) for i in range(40)]
    w0, w2 = _weight_stats(task, pairs, rows, 0.0, None), _weight_stats(task, pairs, rows, 2.0, None)
    assert w0['spread'] == 0.0 and w0['f_w'] == w0['f_l'] == 1.0
    assert w2['f_w'] == pytest.approx(w2['f_l'], abs=1e-4)
    assert w2['spread'] == pytest.approx(2.0 * torch.cat([rc, -rr]).std().item(), abs=1e-4)
    assert w2['rhat_corr'] > 0.5                                     # r̂ ranks tokens as r* does (w_t on chosen, 0 on rejected)
    assert w2['rhat_mean_c'] == pytest.approx(rc.mean().item(), abs=1e-5)
    assert _weight_stats(task, pairs, rows, -30.0, None)['neg_frac'] > 0 and _weight_stats(task, pairs, rows, -30.0, 0.0)['f_min'] == 0.0


@torch_threads(1)
def test_the_recipe_is_guided_by_the_dpo_baselines_final_policy():
    "DPO's unit returns r̂ of its final policy (= a DPO run retrained the same way); the recipe's rows carry exactly that r̂."
    cfg = TGDPOConfig(mode='quick', n_pairs=(16,), batch_size=8, sft_steps=4, n_eval=8, ref_samples=2, epochs=1.0, eval_epochs=(1.0,),
                      n_seeds=1, n_show=4)
    setup = _Setup(cfg)
    base = run_unit(cfg, setup, BASELINE, 16, 0, 0.1)
    pairs = setup.pairs(16, 0)
    pol = train_preference(setup.ref, pair_rows(setup.task, pairs, setup.ref), PreferenceLoss('dpo', 0.1), cfg.steps[16], 8, cfg.lr, 0)[0]
    want = guide_rewards(setup.task, pairs, setup.ref, pol, 0.1)
    assert torch.allclose(torch.tensor(base['rhat']['rejected']), want['rejected'], atol=1e-5)
    rec = run_unit(cfg, setup, RECIPE, 16, 0, 0.1, base['rhat'])
    assert torch.allclose(torch.tensor(rec['rhat_head']['chosen']), want['chosen'][:4], atol=1e-5)
    cen = run_unit(cfg, setup, CENTRED, 16, 0, 0.1, base['rhat'])
    assert cen['weights']['f_w'] == pytest.approx(cen['weights']['f_l'], abs=1e-4)          # centred: both sides weigh alike
    assert base['weights']['spread'] == 0.0 and rec['weights']['spread'] > 0
    assert [e['step'] for e in base['evals']] == [cfg.steps[16]] and base['evals'][0]['epoch'] == 1.0


def test_config_validation_and_seeds():
    assert TGDPOConfig(mode='full').seeds == [0, 1, 2, 3, 4] and TGDPOConfig(mode='full', seed=3).seeds[0] == 3
    assert TGDPOConfig(mode='full').betas == (0.05, 0.1, 0.2, 0.4) and RECIPE in TGDPOConfig(mode='full').variants
    assert set(SECOND_ARMS) <= set(TGDPOConfig(mode='full').variants) and GOLD in SECOND_ARMS
    with pytest.raises(ValueError, match='RECIPE'): TGDPOConfig(variants=(BASELINE,))
    with pytest.raises(ValueError, match='BASELINE'): TGDPOConfig(variants=(RECIPE,))
    with pytest.raises(ValueError, match='guide'): TGDPOConfig(variants=(BASELINE, RECIPE, ('tgdpo', 'oracle', 0.5, None)))
    with pytest.raises(ValueError, match='unique'): TGDPOConfig(variants=(BASELINE, RECIPE, RECIPE))
    with pytest.raises(ValueError, match='eval_epochs'): TGDPOConfig(epochs=2.0, eval_epochs=(1.0, 3.0))
    with pytest.raises(ValueError, match='end at epochs'): TGDPOConfig(epochs=2.0, eval_epochs=(1.0,))
    with pytest.raises(ValueError, match='paper_beta'): TGDPOConfig(betas=(0.2, 0.4))
    with pytest.raises(ValueError, match='betas'): TGDPOConfig(betas=(0.4, 0.1))
    with pytest.raises(TypeError, match='n_seeds'): TGDPOConfig(n_seeds=2.0)

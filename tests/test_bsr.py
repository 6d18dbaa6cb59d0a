"Cross-checks of `workbench.alignment.bsr`: the losses, the synthetic task, the reward model, best-of-n, the experiment API and the verdict rule on made-up rows (fast, CPU)."
import math
import numpy as np
import pytest
import torch
from workbench.alignment.bsr import (bt_loss, bsr_loss, bsr_penalty, center_penalty, reward_loss, SyntheticPreferenceTask,
    sample_pairs, sample_listwise, sample_pool, gold_reward, make_reward_model, score, evaluate, PairLoss, bon_weights, bon_curve,
    BSRConfig, claims, verdict, SPLITS)
from workbench.core import Results, load_results, Claim
from workbench.measure import kendall_tau_b
from workbench.train import collate


def _r(seed=0, B=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)


def test_bt_matches_softplus_form():
    rw, rl = _r()
    assert torch.allclose(bt_loss(rw, rl), torch.nn.functional.softplus(rl - rw).mean())
    assert math.isclose(bt_loss(rw, rw).item(), math.log(2), rel_tol=1e-12)


def test_lambda_zero_is_bt_and_closed_form():
    rw, rl = _r(1, 16)
    assert torch.equal(bsr_loss(rw, rl, lam=0.0), bt_loss(rw, rl))
    lam = 1e-3   # official form: (λ·B)·mean(cat)², equal to λ/(4B)·(Σ r_w + r_l)²
    want = bt_loss(rw, rl) + lam / (4 * 16) * (rw + rl).sum() ** 2
    assert torch.allclose(bsr_loss(rw, rl, lam), want)
    assert torch.allclose(bsr_loss(rw, rl, lam), bt_loss(rw, rl) + lam * 16 * torch.cat([rw, rl]).mean() ** 2)


@pytest.mark.parametrize('c', [-3.0, 0.5, 7.0])
def test_constant_shift_changes_bsr_not_bt(c):
    rw, rl = _r(2)
    mu = torch.cat([rw, rl]).mean()
    rw, rl = rw - mu, rl - mu                                   # batch-centred: penalty 0
    assert bsr_penalty(rw, rl).item() == pytest.approx(0, abs=1e-12)
    assert bt_loss(rw + c, rl + c).item() == pytest.approx(bt_loss(rw, rl).item(), abs=1e-12)
    assert bsr_penalty(rw + c, rl + c).item() == pytest.approx(len(rw) * c ** 2, rel=1e-9)
    assert bsr_loss(rw + c, rl + c, 1e-2) > bsr_loss(rw, rl, 1e-2)


@pytest.mark.parametrize('kind,coef', [('bsr', 1e-3), ('bsr', 1.0), ('center', 1e-2)])
def test_regularisers_spare_margin_gradient(kind, coef):
    rw0, rl0 = _r(3)
    grads = {}
    for k, cf in (('bt', 0.0), (kind, coef)):
        rw, rl = (rw0 + 2).requires_grad_(), (rl0 + 2).requires_grad_()
        reward_loss(rw, rl, k, cf).backward()
        grads[k] = (rw.grad - rl.grad) / 2                      # d/d(margin)
    assert torch.allclose(grads['bt'], grads[kind], atol=1e-12)
    if kind == 'bsr':                                           # the penalty's gradient is the same λ·r̄ for every reward
        rw, rl = (rw0 + 2).requires_grad_(), (rl0 + 2).requires_grad_()
        (coef * bsr_penalty(rw, rl)).backward()
        assert torch.allclose(rw.grad, torch.full_like(rw, coef * (torch.cat([rw0, rl0]) + 2).mean().item()))


def test_errors():
    rw, rl = _r()
    with pytest.raises(ValueError, match='same shape'): bt_loss(rw, rl[:3])
    with pytest.raises(ValueError, match='1 dims'): bsr_loss(rw[None], rl[None])
    with pytest.raises(ValueError, match='at least 2'): bsr_loss(rw[:1], rl[:1])
    with pytest.raises(ValueError, match='lam'): bsr_loss(rw, rl, lam=-0.1)
    with pytest.raises(TypeError): center_penalty(rw.tolist(), rl)
    with pytest.raises(ValueError, match='kind'): reward_loss(rw, rl, 'dpo')
    with pytest.raises(ValueError, match='split'): sample_pairs(SyntheticPreferenceTask(), 'ood', 2)
    with pytest.raises(ValueError, match='head_input'): make_reward_model(60, head_input='pre_norm')


def test_task_deterministic_and_splits_differ():
    t = SyntheticPreferenceTask(seed=3)
    a, b = sample_pairs(t, 'mutual_ood', 20, seed=4), sample_pairs(t, 'mutual_ood', 20, seed=4)
    assert all(torch.equal(x['chosen_input_ids'], y['chosen_input_ids']) for x, y in zip(a, b))
    ids = sample_pairs(t, 'id', 50, seed=0); oods = sample_pairs(t, 'prompt_ood', 50, seed=0)
    id_tmpl = {tuple(r['chosen_input_ids'][1:4].tolist()) for r in ids}      # ID prompts: BOS, template, ...
    assert id_tmpl <= {tuple(x) for x in t.templates[:4].tolist()}
    assert all(r['chosen_input_ids'][1].item() >= t.topic0 for r in oods)   # OOD prompts: topic first
    lw = sample_listwise(t, 'id', 6, k=4, seed=0)
    assert torch.allclose(kendall_tau_b(lw['gold'], lw['gold']), torch.ones(6, dtype=torch.float64))
    x = lw['seqs'][0][:6]
    assert gold_reward(t, x, [t.filler0] * 3) < gold_reward(t, x, [t.topic0 + ((x[4] - t.topic0) // t.topic_size) * t.topic_size + i for i in range(3)])


def test_reward_model_padding_decomposition_and_loss_fn():
    t = SyntheticPreferenceTask()
    rows = sample_pairs(t, 'id', 32, seed=0)
    m = make_reward_model(t.vocab_size, seed=1)
    b = collate(rows[:5])
    r_batch = m(b['chosen_input_ids'], b['chosen_attention_mask'])
    r_single = torch.stack([m(r['chosen_input_ids'][None])[0] for r in rows[:5]])
    assert torch.allclose(r_batch, r_single, atol=1e-5)
    s = score(m, [r['chosen_input_ids'] for r in rows[:5]])
    assert torch.allclose(s['r'], r_single, atol=1e-5) and s['resid'].shape == (5, 2)
    assert torch.allclose(s['r'], m.score.weight.norm() * s['h'] * s['cos'], atol=1e-5)   # r = ‖W_p‖‖h‖cos θ
    assert s['h'].std() / s['h'].mean() > 0.01                                             # the residual head: ‖h‖ varies
    fn = score(make_reward_model(t.vocab_size, head_input='final_norm', seed=1), [r['chosen_input_ids'] for r in rows[:5]])
    assert fn['h'].std() / fn['h'].mean() < 1e-3                                           # after the final RMSNorm it does not
    b = collate(rows[:8]); m.train()                             # the training loss_fn == reward_loss on the two forwards
    want = bsr_loss(m(b['chosen_input_ids'], b['chosen_attention_mask']), m(b['rejected_input_ids'], b['rejected_attention_mask']), 1e-3)
    pl = PairLoss('bsr', 1e-3)
    assert torch.allclose(pl(m, b), want)
    assert len(pl.log) == 1 and abs(pl.log[0]['loss'] - want.item()) < 1e-6
    with pytest.raises(ValueError, match='kind'): PairLoss('hinge')


def test_evaluate_perfect_and_reversed_scorer():
    "A model whose reward is the gold reward has accuracy 1 and τ-b 1; its negative has 0 and −1."
    t = SyntheticPreferenceTask()
    pairs, lw = sample_pairs(t, 'id', 40, seed=1), sample_listwise(t, 'id', 10, seed=1)
    m = make_reward_model(t.vocab_size, seed=0)
    gold = {tuple(p[k].tolist()): p['gold_' + k.split('_')[0]] for p in pairs for k in ('chosen_input_ids', 'rejected_input_ids')}
    for s, g in zip(lw['seqs'], lw['gold'].flatten().tolist()): gold[tuple(s)] = g
    import workbench.alignment.bsr as B
    real = B.score
    for sign in (1, -1):
        def fake(model, seqs, batch_size=512, sign=sign):
            out = real(model, seqs); out['r'] = sign * torch.tensor([gold[tuple(torch.as_tensor(x).tolist())] for x in seqs]); return out
        B.score = fake
        try: ev = evaluate(m, pairs, lw)
        finally: B.score = real
        assert ev['acc'] == (1.0 if sign == 1 else 0.0) and ev['tau'] == pytest.approx(float(sign))


def test_bon_estimator_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    proxy, gold = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    from itertools import combinations
    for n in (1, 2, 4, 7):
        want = np.mean([np.mean([gold[p, list(c)][proxy[p, list(c)].argmax()].item() for c in combinations(range(7), n)]) for p in range(3)])
        assert bon_curve(proxy, gold, [n])['gold'][0] == pytest.approx(want, abs=1e-9)
    assert bon_weights(7, 3).sum().item() == pytest.approx(1.0)
    with pytest.raises(ValueError): bon_weights(4, 5)
    pool = sample_pool(SyntheticPreferenceTask(), 4, 16, seed=0)
    assert pool['gold'].shape == (4, 16) and len(pool['seqs']) == 64


def test_config_sizes_seeds_and_validation(monkeypatch):
    full, quick = BSRConfig(mode='full'), BSRConfig(mode='quick')
    assert full.n_seeds >= 5 and full.bon_n >= 256 and len(full.lams) >= 3 and quick.steps < full.steps
    monkeypatch.setenv('WORKBENCH_SEED', '1')
    assert BSRConfig(mode='quick').seeds[0] == 1                 # WORKBENCH_SEED changes the run
    with pytest.raises(ValueError, match='lams must hold'): BSRConfig(lam=0.3)
    with pytest.raises(ValueError, match='power of 2'): BSRConfig(bon_n=12)
    with pytest.raises(ValueError, match='bon_n'): BSRConfig(bon_n=1024, bon_pool=512)


def _fake_results(tau_gap, h_gap=0.1, drop_gap=0.1, center_tau=0.0, seeds=(0, 1, 2, 3, 4), noise=0.01, pre=()):
    """Rows shaped like run_experiment's: BSR's OOD τ-b ahead of BT by `tau_gap` (TRL centering ahead of BT by `center_tau`),
    its in-domain ‖h‖ CV below BT's by `h_gap`, its best-of-n drop below both baselines' by `drop_gap`; `pre`: precondition claims."""
    rng, rows = np.random.default_rng(0), []
    for kind, coef in (('bt', 0.0), ('bsr', 1e-3), ('center', 1e-2)):
        for s in seeds:
            base = dict(variant=kind, loss=kind, coef=coef, seed=s)
            for sp in SPLITS:
                gap = 0 if sp == 'id' else tau_gap if kind == 'bsr' else center_tau if kind == 'center' else 0
                rows.append(dict(base, record='eval', split=sp, tau=0.5 + gap + noise * rng.standard_normal(),
                                 h_cv=0.3 - (h_gap if kind == 'bsr' else 0) + noise * rng.standard_normal()))
            rows.append(dict(base, record='run', split=None, bon_drop=0.2 - (drop_gap if kind == 'bsr' else 0) + noise * rng.standard_normal()))
    return Results('bsr', dict(mode='full', seed=0, lam=1e-3, center_coef=1e-2, bon_n=256), rows, seeds=list(seeds), claims=list(pre))


def _precondition(holds: bool) -> Claim:
    "A made-up precondition (BT over-optimises: its best-of-n drop is above the declared threshold 0.05)."
    est = 0.12 if holds else 0.01
    return Claim("BT's best-of-n drop (made up)", est, est - 0.02, est + 0.02, null=0.05, role='precondition', threshold_from='min_bt_drop')


def test_claims_and_verdict_rule():
    cs = claims(_fake_results(0.1))
    assert len(cs) == 5 and all(isinstance(c, Claim) for c in cs)
    assert [c.better for c in cs] == ['lower', 'higher', 'higher', 'higher', 'lower']
    assert all(not c.shows for c in claims(_fake_results(0.0))[1:4])
    assert claims(_fake_results(-0.1))[1].opposite


@pytest.mark.parametrize('kw,want', [
    (dict(tau_gap=0.1), 'reproduced'),                                        # all five parts show
    (dict(tau_gap=0.0), 'partly'),                                            # dispersion and best-of-n show, τ-b does not
    (dict(tau_gap=0.1, h_gap=0.0, drop_gap=0.0), 'partly'),                   # only the three OOD τ-b parts show
    (dict(tau_gap=0.0, h_gap=0.0, drop_gap=0.0), 'not reproduced'),           # no effect anywhere
    (dict(tau_gap=-0.1, h_gap=-0.1, drop_gap=-0.1), 'not reproduced'),        # every part the other way
    (dict(tau_gap=0.1, center_tau=0.2, h_gap=0.0, drop_gap=0.0), 'not reproduced'),  # ahead of BT but behind the stronger baseline
])
def test_verdict_rule_on_made_up_rows(kw, want):
    assert verdict(_fake_results(**kw)) == want


def test_tau_is_judged_against_the_stronger_baseline():
    cs = claims(_fake_results(0.1, center_tau=0.2, h_gap=0.0, drop_gap=0.0))
    assert all('TRL centering' in c.name and c.opposite for c in cs[1:4])    # BSR beats BT by 0.1 but trails centering by 0.1


@pytest.mark.parametrize('kw', [dict(tau_gap=0.1), dict(tau_gap=0.0), dict(tau_gap=-0.1, h_gap=-0.1, drop_gap=-0.1)])
def test_failed_precondition_makes_it_untestable(kw):
    assert verdict(_fake_results(**kw, pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_fake_results(**kw, pre=[_precondition(True)])) == verdict(_fake_results(**kw))   # one that holds changes nothing
    r = _fake_results(**kw)
    r.conclude(verdict, claims(r) + [_precondition(False)])                  # the way run_experiment records it
    assert r.verdict == 'untestable here' and '| precondition |' in r.claims_markdown()


def test_recorded_run_is_full_with_five_seeds():
    r = load_results('bsr')
    assert r.mode == 'full' and len(r.seeds) >= 5 and len(r.claims) == 5

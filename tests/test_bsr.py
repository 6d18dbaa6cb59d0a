"Cross-checks of `workbench.alignment.bsr`: the losses, the synthetic task and the reward model (fast, CPU)."
import math
import pytest
import torch
from workbench.alignment.bsr import (bt_loss, bsr_loss, bsr_penalty, center_penalty, reward_loss, kendall_tau, mean_ci,
    SyntheticPreferenceTask, sample_pairs, sample_listwise, gold_reward, make_reward_model, score, pair_loss_fn, SPLITS)
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


def test_errors():
    rw, rl = _r()
    with pytest.raises(ValueError, match='same shape'): bt_loss(rw, rl[:3])
    with pytest.raises(ValueError, match='1-D'): bsr_loss(rw[None], rl[None])
    with pytest.raises(ValueError, match='at least 2'): bsr_loss(rw[:1], rl[:1])
    with pytest.raises(ValueError, match='lam'): bsr_loss(rw, rl, lam=-0.1)
    with pytest.raises(TypeError): center_penalty(rw.tolist(), rl)
    with pytest.raises(ValueError, match='kind'): reward_loss(rw, rl, 'dpo')
    with pytest.raises(ValueError, match='split'): sample_pairs(SyntheticPreferenceTask(), 'ood', 2)


def test_task_deterministic_and_splits_differ():
    t = SyntheticPreferenceTask(seed=3)
    a, b = sample_pairs(t, 'mutual_ood', 20, seed=4), sample_pairs(t, 'mutual_ood', 20, seed=4)
    assert all(torch.equal(x['chosen_input_ids'], y['chosen_input_ids']) for x, y in zip(a, b))
    ids = sample_pairs(t, 'id', 50, seed=0); oods = sample_pairs(t, 'prompt_ood', 50, seed=0)
    id_tmpl = {tuple(r['chosen_input_ids'][1:4].tolist()) for r in ids}      # ID prompts: BOS, template, ...
    assert id_tmpl <= {tuple(x) for x in t.templates[:4].tolist()}
    assert all(r['chosen_input_ids'][1].item() >= t.topic0 for r in oods)   # OOD prompts: topic first
    lw = sample_listwise(t, 'id', 6, k=4, seed=0)
    assert kendall_tau(lw['gold'], lw['gold']).eq(1).all()
    x = lw['seqs'][0][:6]
    assert gold_reward(t, x, [t.filler0] * 3) < gold_reward(t, x, [t.topic0 + ((x[4] - t.topic0) // t.topic_size) * t.topic_size + i for i in range(3)])


def test_reward_model_padding_and_loss_fn():
    t = SyntheticPreferenceTask()
    rows = sample_pairs(t, 'id', 32, seed=0)
    m = make_reward_model(t.vocab_size, seed=1)
    b = collate(rows[:5])
    r_batch = m(b['chosen_input_ids'], b['chosen_attention_mask'])
    r_single = torch.stack([m(r['chosen_input_ids'][None])[0] for r in rows[:5]])
    assert torch.allclose(r_batch, r_single, atol=1e-5)
    r_s, norms = score(m, [r['chosen_input_ids'] for r in rows[:5]])
    assert torch.allclose(r_s, r_single, atol=1e-5) and norms.shape == (5, 3)
    b = collate(rows[:8])                                        # the training loss_fn == reward_loss on the two forwards
    want = bsr_loss(m(b['chosen_input_ids'], b['chosen_attention_mask']), m(b['rejected_input_ids'], b['rejected_attention_mask']), 1e-3)
    assert torch.allclose(pair_loss_fn('bsr', 1e-3)(m, b), want)
    with pytest.raises(ValueError, match='kind'): pair_loss_fn('hinge')


def test_mean_ci():
    assert mean_ci([2.0]) == (2.0, 0.0)
    m, c = mean_ci([1.0, 3.0]); assert m == 2.0 and c == pytest.approx(12.71 * 1 / 1)
    assert len(SPLITS) == 4

"Cross-checks of `workbench.multimodal.mmmc`: scenes and conflicts, the judge, the model's input checks, REINFORCE++, the experiment API and the verdict rule on made-up rows (fast, CPU)."
import copy
import numpy as np
import pytest
import torch
from workbench.multimodal.mmmc import (SHAPES, COLOURS, RELATIONS, TYPES, CONFLICTS, EVAL_MIX, Obj, Scene, sample_scene, render_scene,
    relation_holds, images_to_tensor, check_pixels, make_example, make_dataset, premise_holds, scene_split, judge_answer, rouge_l,
    verify_questions, TinyVLM, WithImages, lm_row, prompt_ids, sample_responses, response_logprobs, reinforcepp_advantages,
    group_advantages, policy_loss, rl_train, MMMCConfig, claims, verdict, IMG, EOS, N_IMG, CELL, RGB,
    TEMPLATES, APPLIES, MMMC_MIX, base_mix, template_shares, template_table, template_rates, question_kind)
from workbench.core import Claim, Results, UNTESTABLE


def _true_relations(a: Obj, b: Obj) -> set:
    "Relations read off the grid coordinates directly (independent of `relation_holds`)."
    out = set()
    if a.col < b.col: out.add('left of')
    if a.col > b.col: out.add('right of')
    if a.row < b.row: out.add('above')
    if a.row > b.row: out.add('below')
    return out


@pytest.mark.parametrize('seed', range(5))
def test_each_conflict_contradicts_its_scene(seed):
    rng = np.random.default_rng(seed)
    for t in TYPES:
        for _ in range(200):
            e = make_example(rng, t)
            w = e.question.rstrip(' ?').split()
            present = {o.shape: o for o in e.scene.objects}
            if e.kind == 'colour':                           # what colour is the S ?
                holds = w[4] in present
            elif e.kind == 'where':                          # where is the C S ?
                holds = w[4] in present and present[w[4]].colour == w[3]
            else:                                            # what colour is the S1 R the S2 ?
                a, b, rel = w[4], w[-1], ' '.join(w[5:-2])
                holds = a in present and b in present and rel in _true_relations(present[a], present[b])
            assert holds == (t == 'none'), (t, e.question, e.scene)
            assert premise_holds(e.scene, e.question) == holds
            if t == 'object': assert e.answer == f"no , there is no {e.key_component} ."
            if t == 'attribute': assert present[w[4]].colour != w[3] and e.answer.endswith(f"is {present[w[4]].colour} .")
            if t == 'relation': assert ' not ' in e.answer and rel not in _true_relations(present[a], present[b])


@pytest.mark.parametrize('mix', [EVAL_MIX, MMMC_MIX, base_mix(0.1), dict(none=0.5, relation=0.5)])
def test_template_alone_does_not_predict_conflict(mix):
    ds = make_dataset(2000, mix, seed=3)
    assert all(e.kind == question_kind(e.question) for e in ds)
    wh = [e for e in ds if e.conflict_type != 'probe']
    overall = np.mean([e.conflict_type != 'none' for e in wh])
    tt = template_table(wh)
    for k, v in tt.items():                                    # every template used holds both normal and conflicting questions...
        assert v['normal'] > 0 and v['conflict'] > 0, (k, v)
        assert abs(v['conflict_share'] - overall) < 0.01, (k, v, overall)     # ...in the data set's overall proportion
    # the best predictor that sees only the template (majority label per template) does no better than the overall majority
    best = sum(max(v['normal'], v['conflict']) for v in tt.values()) / len(wh)
    assert best <= max(overall, 1 - overall) + 0.005
    sh = template_shares(mix)                                  # normal questions follow the conflict questions' template shares
    nrm = [e.kind for e in wh if e.conflict_type == 'none']
    for k in TEMPLATES: assert abs(nrm.count(k) / len(nrm) - sh[k]) < 0.01


def test_each_conflict_type_spread_over_its_templates():
    ds = make_dataset(3000, EVAL_MIX, seed=4)
    for t in CONFLICTS:
        kinds = [e.kind for e in ds if e.conflict_type == t]
        assert set(kinds) == set(APPLIES[t])
        for k in APPLIES[t]: assert abs(kinds.count(k) / len(kinds) - 1 / len(APPLIES[t])) < 0.01
    assert set(APPLIES['object']) == set(TEMPLATES)           # an absent object breaks the premise of every template
    rel_obj = [e for e in ds if e.conflict_type == 'object' and e.kind == 'relation']
    w = [e.question.rstrip(' ?').split() for e in rel_obj]     # the absent shape is sometimes the first, sometimes the second
    assert 0.4 < np.mean([e.scene.get(x[4]) is None for e, x in zip(rel_obj, w)]) < 0.6
    assert all(len(e.scene.objects) >= 2 for e in ds if e.kind == 'relation')   # normal or not: same scene sizes
    with pytest.raises(ValueError, match="cannot use the 'colour' template"): make_example(np.random.default_rng(0), 'attribute', kind='colour')
    with pytest.raises(ValueError, match="cannot use the 'where' template"): make_example(np.random.default_rng(0), 'relation', kind='where')


def test_template_rates_tell_detectors_from_template_rules():
    ds = make_dataset(300, EVAL_MIX, seed=5)
    perfect = template_rates([e.answer for e in ds], ds)
    assert all(v['flag_conflict'] == 1 and v['flag_normal'] == 0 and v['acc_normal'] == 1 and v['hallu'] == 0 for v in perfect.values())
    rule = template_rates(['no , there is no cross .' if e.kind == 'where' else 'the circle is red .' for e in ds], ds)
    assert all(v['flag_conflict'] == v['flag_normal'] for v in rule.values())            # detection 0 on every template
    assert set(rule) == set(TEMPLATES) and all(v['n_normal'] > 0 and v['n_conflict'] > 0 for v in rule.values())


def test_relation_matches_coordinates():
    rng = np.random.default_rng(0)
    for _ in range(200):
        s = sample_scene(rng, (2, 3)); a, b = s.objects[:2]
        assert {r for r in RELATIONS if relation_holds(a, r, b)} == _true_relations(a, b)


def test_render_and_split():
    s = Scene((Obj('circle', 'red', 0, 0), Obj('cross', 'blue', 2, 1)))
    img = render_scene(s)
    assert tuple(img[CELL // 2, CELL // 2]) == RGB['red'] and tuple(img[2 * CELL + CELL // 2, CELL + CELL // 2]) == RGB['blue']
    assert (img[CELL:2 * CELL, 2 * CELL:] == 240).all()                        # an empty cell stays background
    train_keys = {e.image_id for e in make_dataset(200, seed=0, split='train')}
    test_keys = {e.image_id for e in make_dataset(200, EVAL_MIX, seed=0, split='test')}
    assert not train_keys & test_keys                                           # split by scene


def test_bad_images_give_clear_errors():
    img = render_scene(sample_scene(np.random.default_rng(0)))
    with pytest.raises(ValueError, match='shape'): images_to_tensor(img[:20])
    with pytest.raises(ValueError, match='channels last'): images_to_tensor(img.transpose(2, 0, 1).copy())
    with pytest.raises(TypeError, match='uint8'): images_to_tensor(img.astype(float))
    with pytest.raises(TypeError, match='numpy'): images_to_tensor('image.png')
    px = images_to_tensor(img)
    with pytest.raises(ValueError, match=r'\[0, 1\]'): check_pixels(px * 255)
    with pytest.raises(ValueError, match='NaN'): check_pixels(px * float('nan'))
    with pytest.raises(TypeError, match='floating'): check_pixels((px * 255).long())
    m = TinyVLM(seed=0); ids = torch.tensor([[IMG] * N_IMG + [5, 6]])
    with pytest.raises(ValueError, match='no pixel_values'): m(ids)
    with pytest.raises(ValueError, match='images for'): m(ids, pixel_values=torch.cat([px, px]))
    with pytest.raises(ValueError, match='exactly 9'): m(ids[:, 2:], pixel_values=px)


def test_judge_and_rouge():
    e = make_example(np.random.default_rng(1), 'attribute'); s = e.question.split()[4]
    assert judge_answer(e.answer, e) == 'correct'
    assert judge_answer(f"the {e.question.split()[3]} {s} is at the top left .", e) == 'hallucinated'
    assert judge_answer('yes , the ' + s + ' is red .', e) == 'hallucinated'
    n = make_example(np.random.default_rng(1), 'none')
    assert judge_answer(n.answer, n) == 'correct' and judge_answer('no , there is no cross .', n) == 'false_conflict'
    assert rouge_l('a b c d', 'a c d') == pytest.approx(2 * (3 / 4) * 1 / (3 / 4 + 1))


def test_mix_errors():
    with pytest.raises(ValueError, match='unknown conflict_type'): make_dataset(4, dict(none=0.5, ocr=0.5))
    with pytest.raises(ValueError, match='sum to 1'): make_dataset(4, dict(none=0.5, object=0.2))
    with pytest.raises(ValueError, match='conflict_type'): make_example(np.random.default_rng(0), 'colour')


@pytest.mark.parametrize('beta', [0.0, 0.01, 0.5])
def test_reinforcepp_advantages_normalised_over_batch(beta):
    g = torch.Generator().manual_seed(0)
    R = torch.tensor([1., -1., 1., -1., -1., 1.])
    mask = (torch.arange(7)[None] < torch.tensor([3, 7, 1, 5, 2, 4])[:, None]).long()
    logratio = torch.randn(6, 7, generator=g) * 0.3
    A = reinforcepp_advantages(R, logratio, mask, beta)
    v = A[mask.bool()]
    assert v.mean().abs() < 1e-5 and (v.std(unbiased=False) - 1).abs() < 1e-4       # over the whole batch, not per prompt
    assert (A[~mask.bool()] == 0).all()
    # the returns before normalisation: G_t = R - beta * sum_{s>=t} logratio_s on response tokens
    m = mask.float(); G = R[:, None] - beta * (logratio * m).flip(1).cumsum(1).flip(1)
    Gv = G[mask.bool()]; assert torch.allclose(v, (Gv - Gv.mean()) / Gv.std(unbiased=False), atol=1e-4)
    # per-prompt means are NOT zero in general (that would be the group-relative estimator)
    assert (A.sum(1) / m.sum(1)).abs().max() > 0.1


def test_group_advantages_and_equal_rewards():
    a = group_advantages(torch.tensor([1., -1., 1., 1., -1., -1.]), 3)
    assert torch.allclose(a.view(2, 3).sum(1), torch.zeros(2), atol=1e-6)
    lp = torch.randn(4, 5, requires_grad=True); m = torch.ones(4, 5)
    policy_loss(lp, lp.detach(), group_advantages(torch.ones(4), 4)[:, None] * m, m).backward()
    assert torch.all(lp.grad == 0)


def test_kl_term_zero_at_start_of_rl():
    ref = TinyVLM(seed=3); pol = copy.deepcopy(ref)
    ex = make_dataset(8, seed=2)
    b = sample_responses(pol, ex, seed=0)
    with torch.no_grad():
        assert torch.equal(response_logprobs(pol, b), response_logprobs(ref, b))
    log = rl_train(pol, ref, ex, steps=1, batch_size=8, lr=1e-3, seed=0)
    assert log[0]['kl'] == 0.0
    # the zero is the policy's, not a dead KL term: once the policy moves, the same samples have non-zero log-ratios,
    # the logged KL is non-zero and β changes the advantages
    with torch.no_grad():
        for p in pol.parameters(): p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        logratio = response_logprobs(pol, b) - response_logprobs(ref, b)
    m = b['resp_mask'].float(); R = torch.tensor([1., -1.] * 4)
    assert (logratio * m).abs().max() > 1e-4
    assert not torch.allclose(reinforcepp_advantages(R, logratio, m, beta=0.5), reinforcepp_advantages(R, logratio, m, beta=0.0))
    assert rl_train(pol, ref, ex, steps=1, batch_size=8, lr=1e-3, seed=0)[0]['kl'] != 0.0


def test_labels_mask_image_and_question():
    e = make_dataset(1, seed=5)[0]
    r = lm_row(e, images_to_tensor(e.image)[0]); n = len(prompt_ids(e))
    assert (r['labels'][:n] == -100).all() and (r['labels'][n:] != -100).all() and r['labels'][-1] == EOS


def test_cell_labels_and_encoder_loss():
    "Per-cell labels follow the scene graph (row-major, 0 = empty); the encoder loss is finite, reaches the encoder, and is off at cell_weight=0."
    from workbench.multimodal.mmmc import cell_labels, cell_loss, vlm_loss, probe_kind
    from workbench.train import collate
    sc = Scene((Obj('cross', 'blue', 0, 2), Obj('circle', 'red', 2, 0)))
    y = cell_labels(sc)
    assert y.shape == (N_IMG, 2) and y[2].tolist() == [1 + SHAPES.index('cross'), 1 + COLOURS.index('blue')]
    assert y[6].tolist() == [1 + SHAPES.index('circle'), 1 + COLOURS.index('red')] and int((y[:, 0] > 0).sum()) == 2
    m = TinyVLM(seed=1); e = make_dataset(2, seed=3)
    b = collate([lm_row(x, images_to_tensor(x.image)[0]) for x in e])
    l = cell_loss(m, b['pixel_values'], b['cell_labels']); l.backward()
    assert torch.isfinite(l) and m.patch_embed[0].weight.grad.abs().sum() > 0
    m.zero_grad(); vlm_loss(m, b).backward()
    assert m.cell_head.weight.grad is None or m.cell_head.weight.grad.abs().sum() == 0
    assert [probe_kind(q) for q in ('is there a cross ?', 'is the cross red ?', 'is the cross above the circle ?')] == ['existence', 'colour', 'relation']


def test_config_errors_and_full_seeds():
    with pytest.raises(ValueError, match='group_size'): MMMCConfig(batch_size=30)
    assert MMMCConfig(mode='full').n_seeds >= 3


def test_stricter_rule_gives_no_credit_for_refusing():
    "A remedy that refuses everything (hallucination 0, detection 0, normal accuracy 0) shows a drop but gets no credit; one that detects does."
    from workbench.core import Results
    from workbench.multimodal.mmmc import REFUSE, gates, credited
    cfg, rows = MMMCConfig(mode='full'), []
    for i, s in enumerate(cfg.seeds):
        j = 0.01 * i                                                              # small seed-to-seed jitter: finite intervals
        arms = {'base': (0.7 + j, 0.9, 0.0), 'PE: instruction': (0.7 + j, 0.9, 0.0), 'PE: verify-then-answer': (0.3, 0.7, 0.4), 'SFT': (0.1 + j, 0.8 - j, 0.7 + j),
                'RL (REINFORCE++)': (0.0, 0.05 + j, j - 0.02), REFUSE: (0.0, 0.0, 0.0)}    # (hallucination, normal accuracy, detection)
        for m, (hl, acc, det) in arms.items():
            rows += [dict(record='eval', seed=s, method=m, conflict_type=t, hallu=0.0 if t == 'none' else hl, acc=acc if t == 'none' else 0.5) for t in TYPES]
            rows += [dict(record='template', seed=s, method=m, template=k, detection=det + (0.01 if k == 'where' else 0)) for k in TEMPLATES]
            rows.append(dict(record='run', seed=s, method=m, instability=0.1 + (0.05 + j if m.startswith('RL') else 0)))
    res = Results('mmmc', cfg, rows, seeds=cfg.seeds)
    g = gates(res)
    assert g['SFT']['credited'] and g['SFT']['detection'].shows and g['SFT']['normal_acc'].opposite   # detects: credited despite lost accuracy
    assert not g['RL (REINFORCE++)']['credited']                                   # refuses: neither detection nor accuracy
    assert g['PE: instruction']['credited'] and not g['PE: instruction']['normal_acc'].opposite
    cs, cr = claims(res), credited(res)
    rl_drop = next(i for i, c in enumerate(cs) if c.name == 'hallucination rate: RL (REINFORCE++) − base')
    assert cs[rl_drop].shows and not cr[rl_drop]                                   # the old rule would count it, the new one does not
    assert all(not ok for c, ok in zip(cs, cr) if c.name.startswith('hallucination rate on'))   # RL's lead over SFT: bought with refusal too
    assert sum(cr) < sum(c.shows for c in cs) and verdict(res) == 'partly'


# --- the verdict rule on made-up rows ---
from workbench.multimodal.mmmc import REFUSE, credited
FAILED = Claim('made-up precondition: the base perceives the premise', 0.55, 0.45, 0.65, null=0.8, role='precondition', threshold_from='min_perception')
HOLDS = Claim('made-up precondition: training has run its course', 0.001, -0.002, 0.004, better='lower', null=0.01, role='precondition', threshold_from='slope_tol')
REMEDIES = ('PE: instruction', 'SFT', 'RL (REINFORCE++)')


def _made_up(hallu, acc=None, det=None, instability=None, seeds=(0, 1, 2)):
    """Rows in the shape `claims` and `gates` read: per seed and method, 'eval' rows (hallucination rate per conflict type, accuracy on
    normal questions), 'template' rows (detection) and 'run' rows (instability). Defaults: normal accuracy 0.9, detection 0.5 for every
    remedy (refuse-everything: 0), instability 0.2 for RL and 0.1 for SFT."""
    acc = {m: 0.9 for m in hallu} | {REFUSE: 0.0} | (acc or {})
    det = {m: 0.5 for m in REMEDIES} | {'base': 0.0, REFUSE: 0.0} | (det or {})
    instability = {'SFT': 0.1, 'RL (REINFORCE++)': 0.2} | (instability or {})
    hallu = hallu | {REFUSE: 0.0}
    rows = []
    for s in seeds:
        for i, (m, h) in enumerate(hallu.items()):
            j = 0.01 * s + 0.005 * ((s + i) % 2)                                   # seed jitter: finite intervals
            h = h if isinstance(h, dict) else dict.fromkeys(CONFLICTS, h)
            rows += [dict(record='eval', seed=s, method=m, conflict_type=t, hallu=0.0 if t == 'none' else h[t] + j, acc=acc[m] - j if t == 'none' else 0.5)
                     for t in TYPES]
            rows += [dict(record='template', seed=s, method=m, template=k, detection=det.get(m, 0.0) + (j if det.get(m) else 0.0)) for k in TEMPLATES]
            rows.append(dict(record='run', seed=s, method=m, instability=instability.get(m, 0.0) + j))
    return Results('mmmc', dict(seed=0), rows, seeds=list(seeds))


WORKS = {'base': 0.7, 'PE: instruction': 0.5, 'SFT': 0.3, 'RL (REINFORCE++)': 0.1}


# claims: base above 40%; PE, SFT, RL − base; RL − best other remedy per conflict type (object, attribute, relation); instability RL − SFT
@pytest.mark.parametrize('hallu,kw,want,status', [
    (WORKS, {}, 'reproduced', ['shows'] * 8),
    (WORKS | {'RL (REINFORCE++)': 0.3}, {}, 'partly', ['shows'] * 4 + ['no effect'] * 3 + ['shows']),            # RL no better than SFT
    (WORKS | {'RL (REINFORCE++)': dict(object=0.1, attribute=0.3, relation=0.5)}, {}, 'partly',
     ['shows'] * 5 + ['no effect', 'opposite', 'shows']),                                                      # RL best on object conflicts only
    (dict.fromkeys(('base', *REMEDIES), 0.3), dict(instability={'RL (REINFORCE++)': 0.1}), 'not reproduced',
     ['opposite'] + ['no effect'] * 7),                                                                           # no problem, no remedy
])
def test_verdict_on_made_up_rows(hallu, kw, want, status):
    R = _made_up(hallu, **kw)
    cs = claims(R)
    assert [c.status for c in cs] == status
    assert credited(R) == [c.shows for c in cs]                              # every remedy detects: nothing is withheld
    assert verdict(R) == want


def test_remedies_that_only_refuse_get_no_credit():
    "Every remedy drops hallucination to 0 by refusing (detection 0, normal accuracy 0): three claims show, none is credited, so not reproduced."
    refuse = dict.fromkeys(REMEDIES, 0.0)
    R = _made_up({'base': 0.3, **refuse}, acc=refuse, det=refuse, instability={'RL (REINFORCE++)': 0.1})
    assert [c.shows for c in claims(R)] == [False, True, True, True, False, False, False, False]
    assert not any(credited(R)) and verdict(R) == 'not reproduced'
    R = _made_up({'base': 0.3, **refuse}, acc=refuse, instability={'RL (REINFORCE++)': 0.1})    # the same drops with detection: credited
    assert credited(R) == [False, True, True, True, False, False, False, False] and verdict(R) == 'partly'


@pytest.mark.parametrize('hallu,want', [(WORKS, 'reproduced'), (dict.fromkeys(('base', *REMEDIES), 0.3), 'not reproduced')])
def test_a_failed_precondition_makes_it_untestable(hallu, want):
    R = _made_up(hallu, instability={'RL (REINFORCE++)': 0.1} if want != 'reproduced' else None)
    R.claims = [FAILED, *claims(R)]
    assert verdict(R) == UNTESTABLE
    R.claims = [HOLDS, *claims(R)]
    assert verdict(R) == want

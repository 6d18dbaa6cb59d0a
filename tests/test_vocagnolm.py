"Cross-checks of `workbench.objectives.vocagnolm`: the lexical alignment against brute force, the teacher-guided loss's reductions, a teacher identical to the student, exact-match KD, the copy corpus and its token classes, training through `workbench.train.train`, error cases, and the verdict rule on made-up rows (all four verdicts; fast, CPU; no real model)."
import math
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from workbench.objectives.vocagnolm import (copy_corpus, copy_items, copy_lists, char_classes, token_classes, TOKEN_CLASSES,
    token_spans, align_spans, aggregate_teacher_loss, teacher_token_losses, teacher_guided_loss, build_stream, shuffle_mapped,
    train_student, StreamWindows, window_starts, score_heldout, stream_token_losses, shared_vocab_map, exact_match_kd_targets,
    exact_match_kd_loss, vocab_overlap, kept_share_by_class, teacher_copy_accuracy, heldout_overlap, claims, preconditions,
    verdict, headline, strongest_baseline, arm_best, VocAgnoLMConfig, TEACHERS, fig_seed_curves)
from workbench.core import Results, UNTESTABLE, VERDICTS
from workbench.data import train_bpe
from workbench.models import tiny_llama


@pytest.fixture(scope='module')
def tok():
    "A small byte-level BPE whose eos doubles as BOS."
    t = train_bpe(copy_corpus(60, seed=11), vocab_size=320, cache=False)
    t.bos_token = t.eos_token
    return t


def _brute(s, t):
    lo, hi = [], []
    for a, b in s:
        js = [j for j, (c, d) in enumerate(t) if d > c and max(a, c) < min(b, d)]
        lo.append(js[0] if js else 0)
        hi.append(js[-1] if js else -1)
    return np.array(lo), np.array(hi)


def _segmentation(rng, L, bos):
    b = np.r_[0, np.sort(rng.choice(np.arange(1, L), rng.integers(1, L - 1), replace=False)), L]
    sp = np.stack([b[:-1], b[1:]], 1)
    return np.r_[[[0, 0]], sp] if bos else sp


@pytest.mark.parametrize('seed', range(4))
def test_alignment_equals_brute_force_and_covers(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        L = int(rng.integers(4, 60))
        s, t = _segmentation(rng, L, rng.random() < .5), _segmentation(rng, L, rng.random() < .5)
        al = align_spans(s, t)
        lo, hi = _brute(s, t)
        assert (al.lo == lo).all() and (al.hi == hi).all()
        m = ~al.unmapped
        assert (t[al.lo[m], 0] <= s[m, 0]).all() and (t[al.hi[m], 1] >= s[m, 1]).all()
        assert (np.diff(al.lo[m]) >= 0).all() and (al.lo[m] <= al.hi[m]).all()


def test_identical_tokenizers_give_the_identity(tok):
    text = 'Copy 15 43 75 72: 15 43 75 72. ref 0a9f3.'
    _, sp = token_spans(tok, text)
    al = align_spans(sp, sp)
    assert (al.lo == np.arange(len(sp))).all() and (al.hi == np.arange(len(sp))).all()
    lt = np.random.default_rng(0).random(len(sp))
    for how in ('max', 'mean', 'sum'): np.testing.assert_allclose(aggregate_teacher_loss(al, lt, how), lt)


def test_keep_ratio_one_is_cross_entropy_and_counts():
    torch.manual_seed(1)
    lg, y = torch.randn(3, 9, 13), torch.randint(0, 13, (3, 9))
    y[2, 4:] = -100
    tl = torch.rand(3, 9)
    tl[0, :2] = float('nan')
    torch.testing.assert_close(teacher_guided_loss(lg, y, tl, 1.0), F.cross_entropy(lg.transpose(1, 2), y, ignore_index=-100))
    ls = F.cross_entropy(lg.transpose(1, 2), y.clamp(min=0), reduction='none')
    valid, mapped = y != -100, (y != -100) & ~tl.isnan()
    for k in (0.1, 0.4, 0.77):
        n = math.ceil(k * int(mapped.sum()))
        top = ls[mapped][(ls - tl)[mapped].topk(n).indices]
        expect = (top.sum() + ls[valid & ~mapped].sum()) / (n + int((valid & ~mapped).sum()))
        torch.testing.assert_close(teacher_guided_loss(lg, y, tl, k), expect)
    torch.testing.assert_close(teacher_guided_loss(lg, y, tl, 0.5, unmapped='exclude'),
                               ls[mapped][(ls - tl)[mapped].topk(math.ceil(0.5 * int(mapped.sum()))).indices].mean())


def test_teacher_identical_to_student_has_zero_excess(tok):
    "The label shift and the alignment together: a teacher that is the student has the student's losses, on every path."
    m = tiny_llama(len(tok), d_model=32, seed=3).eval()
    docs = copy_corpus(3, seed=5)
    st = build_stream(tok, docs, {'same': teacher_token_losses(m, tok, docs)})
    starts = np.flatnonzero(st['ids'] == tok.eos_token_id).tolist() + [len(st['ids'])]
    assert len(starts) == len(docs) + 1 and starts[0] == 0
    for a, b in zip(starts[:-1], starts[1:]):                    # each document after its eos, as the teacher scored it
        x = torch.from_numpy(st['ids'][a:b])[None]
        with torch.no_grad(): ls = F.cross_entropy(m(input_ids=x[:, :-1]).logits[0], x[0, 1:], reduction='none').numpy()
        tl = st['tl']['same'][a + 1:b]
        assert not np.isnan(tl).any() and np.isnan(st['tl']['same'][a])
        np.testing.assert_allclose(ls, tl, atol=1e-4)
    np.testing.assert_allclose(stream_token_losses(m, tok, docs), st['tl']['same'], atol=1e-4)   # Rho-1's reference path
    right, chance = teacher_copy_accuracy(teacher_token_losses(m, tok, docs), docs)
    h = score_heldout(m, tok, docs)
    assert (right == h['right']).all() and np.allclose(chance, h['chance'])


def test_copy_corpus_items_and_classes():
    docs = copy_corpus(40, seed=1, noise=0.0, wrong=1.0)
    for d in docs:
        for (a, b, n), lst in zip(copy_items(d)[::1], [l for l in copy_lists(d) for _ in l[1:]]):
            assert len(lst) == n and d[a:b].isdigit()
    text = "Copy 15 43 75: 15 44 75. code 123."
    c = char_classes(text)
    assert [TOKEN_CLASSES[c[text.index(s)]] for s in ('Copy', '15', '44', 'code')] == ['template', 'list', 'wrong', 'noise']
    assert TOKEN_CLASSES[c[text.rindex('75')]] == 'copy'
    assert token_classes(text, np.array([[0, 0], [4, 7]])).tolist() == [3, 0]
    assert heldout_overlap(["Copy 15 43 75: 15 43 75."], ["Copy 15 43 75: 15 43 75. Copy 11 12 13: 11 12 13."]) == (0.5, 2)
    assert copy_items("Copy 15 43 75: 15 43 75.").tolist() == [[18, 20, 3], [21, 23, 3]]


def test_kept_share_by_class():
    cls = np.array([0, 1, 1, 2, 4, 4, 3])
    share = kept_share_by_class(np.array([5., 3., 2., 1., 1., 1., np.nan]), np.array([5., 0., 0., 4., 2., 2., 0.]), cls, 0.4)
    assert share['copy'] == 1.0 and share['wrong'] == 0.0 and share['noise'] == 0.0 and math.isnan(share['template'])
    assert share['list'] == 1.0                                       # ceil(0.4 * 6) = 3 kept: excess 3, 2 and 0


def test_errors(tok):
    lg, y, tl = torch.randn(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4)
    for k in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match='top_k_ratio'): teacher_guided_loss(lg, y, tl, k)
    with pytest.raises(ValueError, match='shapes differ'): teacher_guided_loss(lg, y, tl[:, :3])
    with pytest.raises(ValueError, match='unmapped'): teacher_guided_loss(lg, y, tl, 0.5, unmapped='drop')
    with pytest.raises(ValueError, match='sorted'): align_spans(np.array([[4, 6], [0, 2]]), np.array([[0, 6]]))
    with pytest.raises(ValueError, match='end >= start'): align_spans(np.array([[3, 1]]), np.array([[0, 6]]))
    al = align_spans(np.array([[0, 3], [3, 6]]), np.array([[0, 2], [2, 6]]))
    with pytest.raises(ValueError, match='other texts'): aggregate_teacher_loss(al, [0.1])
    with pytest.raises(ValueError, match='scored 1 texts'): build_stream(tok, ['a', 'b'], {'t': [dict()]})
    with pytest.raises(ValueError, match='fewer than a window'): window_starts(20, 32, 4, 0)
    with pytest.raises(ValueError, match='noise'): copy_corpus(2, noise=2.0)
    with pytest.raises(ValueError, match='unknown model'): VocAgnoLMConfig(model='gpt2')
    with pytest.raises(ValueError, match='teacher2'): VocAgnoLMConfig(teacher2='no-such-model')
    with pytest.raises(ValueError, match='differ'): VocAgnoLMConfig(teacher2=TEACHERS[0])
    with pytest.raises(ValueError, match='increase'): VocAgnoLMConfig(top_k_ratios=(0.4, 0.2))
    with pytest.raises(ValueError, match='control_k'): VocAgnoLMConfig(top_k_ratios=(0.2, 0.6), control_k=0.4)
    with pytest.raises(TypeError): VocAgnoLMConfig(teachers=TEACHERS)           # derived from model and teacher2


def test_exact_match_kd(tok):
    vm = shared_vocab_map(tok, tok)
    assert len(vm) == len(tok) and vocab_overlap(tok, tok) == 1.0
    lg, y = torch.randn(2, 5, len(tok)), torch.randint(0, len(tok), (2, 5))
    p, ix = lg.softmax(-1).topk(8, -1)
    pf, ixf = lg.softmax(-1).topk(len(tok), -1)
    torch.testing.assert_close(exact_match_kd_loss(lg, y, ixf, pf), F.cross_entropy(lg.transpose(1, 2), y), atol=1e-5, rtol=0)
    kl8 = exact_match_kd_loss(lg, y, ix, p / p.sum(-1, keepdim=True)) - F.cross_entropy(lg.transpose(1, 2), y)
    torch.testing.assert_close(kl8, -torch.log(p.sum(-1)).mean(), atol=1e-5, rtol=0)
    sc = dict(spans=np.array([[0, 3]]), top_ids=np.array([[1, 2]]), top_p=np.array([[.5, .5]]))
    ids, pr = exact_match_kd_targets(np.array([[0, 3]]), sc, {}, K=2)
    assert (ids == -1).all() and (pr == 0).all()                     # disjoint vocabularies: no target, the loss is plain CE


def test_training_through_train_reproduces_cpt_at_k1(tok):
    docs = copy_corpus(6, seed=2)
    st = build_stream(tok, docs, {'t': [dict(spans=token_spans(tok, d)[1], losses=np.ones(len(token_spans(tok, d)[1]), np.float32))
                                        for d in docs]})
    a, b = tiny_llama(len(tok), d_model=32, seed=0), tiny_llama(len(tok), d_model=32, seed=0)
    ha = train_student(a, st['ids'], 6, 2, 32, 1e-2, seed=4)
    hb = train_student(b, st['ids'], 6, 2, 32, 1e-2, seed=4, extras=dict(tl=st['tl']['t']), top_k_ratio=1.0)
    np.testing.assert_allclose(ha.train_loss, hb.train_loss, atol=1e-4)
    assert ha.step[-1] == hb.step[-1] == 6
    w = StreamWindows(st['ids'], window_starts(len(st['ids']), 32, 4, 7), 32, dict(tl=st['tl']['t']))
    assert w[0]['input_ids'].shape == (33,) and w[0]['tl'].shape == (32,)
    assert window_starts(len(st['ids']), 32, 4, 7) == window_starts(len(st['ids']), 32, 4, 7)   # the same windows per seed
    shuf = shuffle_mapped(st['tl']['t'], 0)
    assert np.array_equal(np.isnan(shuf), np.isnan(st['tl']['t']))


def test_config_sizes_and_seeds():
    q, f = VocAgnoLMConfig(mode='quick'), VocAgnoLMConfig(mode='full')
    assert f.teachers == TEACHERS[:1] and f.n_seeds >= 5 and q.n_train_docs < f.n_train_docs and len(f.top_k_ratios) >= 4
    assert VocAgnoLMConfig(seed=5, n_seeds=2).seeds == [5, 6]
    assert VocAgnoLMConfig(mode='quick', teacher2=TEACHERS[1]).teachers == TEACHERS


# --- the verdict rule on made-up rows ---
T0, KS = TEACHERS[0], (0.2, 0.4, 0.6, 0.8)


def _made_up(voc=0.10, rho1=0.05, kd=0.0, shuffled=0.05, cpt=0.40, clean=0.10, chance=0.30, overlap=0.0, teacher=0.6,
             updates_gap=0, best_k=0.4, eval_k=None, seeds=(0, 1, 2, 3, 4)):
    """Rows in the shape `claims` reads: each arm's held-out (`acc`) and validation (`val_acc`) accuracy with seed jitter.
    VocAgnoLM and Rho-1 peak at kept share `best_k` on validation; `eval_k` moves VocAgnoLM's held-out peak elsewhere."""
    eval_k = best_k if eval_k is None else eval_k
    arms = [('cpt', 'none', 1.0, cpt, cpt), ('clean', 'none', 1.0, cpt + clean, cpt + clean), ('kd', T0, 1.0, cpt + kd, cpt + kd),
            ('shuffled', T0, 0.4, cpt + shuffled, cpt + shuffled)]
    arms += [('rho1', 'none', k, cpt + rho1 * (k == best_k), cpt + rho1 * (k == best_k)) for k in KS]
    arms += [('vocagnolm', T0, k, cpt + voc * (k == eval_k), cpt + voc * (k == best_k)) for k in KS]
    rows = [dict(method=m, teacher=t, k=k, seed=s, acc=a + 0.01 * (s % 2), val_acc=v + 0.01 * (s % 3), bpc=1.0,
                 updates=600 + updates_gap * (m == 'kd'))
            for s in seeds for m, t, k, a, v in arms]
    cfg = dict(teachers=(T0,), top_k_ratios=KS, control_k=0.4, min_acc_over_chance=0.05, min_noise_harm=0.02,
               max_update_gap=0, max_heldout_overlap=0.01, min_teacher_over_chance=0.2)
    tables = dict(setup=[dict(chance=chance, overlap=overlap, n_lists=400)],
                  teachers=[dict(teacher=T0, over_chance=[teacher - 0.1, teacher, teacher + 0.1] * 20)])
    r = Results('vocagnolm', cfg, rows, seeds=list(seeds), tables=tables)
    return r.conclude(verdict, claims(r), headline(r))


@pytest.mark.parametrize('kw,want', [
    (dict(), 'reproduced'),                                   # beats Rho-1 (the strongest baseline) and the control
    (dict(shuffled=0.10), 'partly'),                          # beats the baselines; the control is as good
    (dict(voc=0.04, rho1=0.04, shuffled=0.0), 'partly'),      # beats the control; ties the strongest baseline
    (dict(voc=0.0, rho1=0.0, shuffled=0.0), 'not reproduced'),   # no effect anywhere
    (dict(rho1=0.2), 'not reproduced'),                       # beats CPT and the control, but Rho-1 beats it: the other way
    (dict(chance=0.45), UNTESTABLE),                          # CPT below chance + threshold: the student cannot learn the task
    (dict(clean=0.0), UNTESTABLE),                            # the noise does not hurt CPT
    (dict(overlap=0.2), UNTESTABLE),                          # held-out lists can be memorised from training text
    (dict(teacher=0.05), UNTESTABLE),                         # the teacher cannot do the task
    (dict(updates_gap=5), UNTESTABLE),                        # the arms were not compared at equal updates
])
def test_verdict_on_made_up_rows(kw, want):
    R = _made_up(**kw)
    assert R.verdict == want == verdict(R)
    assert T0.split('-')[0] in R.headline


def test_all_four_verdicts_are_reachable():
    got = {_made_up(**kw).verdict for kw in (dict(), dict(shuffled=0.1), dict(rho1=0.2), dict(chance=0.45))}
    assert got == set(VERDICTS)


def test_kept_share_is_chosen_on_validation_not_on_the_held_out_set():
    R = _made_up(best_k=0.4, eval_k=0.6)                      # held-out accuracy peaks at 0.6, validation at 0.4
    b = arm_best(R.df, 'vocagnolm', T0, KS, R.seeds)
    assert b.knob == 0.4 and not b.at_edge and not b.tied
    assert 'best k=0.4' in [c for c in R.claims if not c.is_precondition][0].name
    assert R.verdict == 'not reproduced'                      # at k=0.4 VocAgnoLM's held-out accuracy is CPT's: below Rho-1
    assert arm_best(_made_up(best_k=0.2).df, 'vocagnolm', T0, KS, R.seeds).at_edge


def test_strongest_baseline_is_chosen_on_validation():
    assert strongest_baseline(_made_up(), T0) == ('rho1', 'none', 0.4)
    assert strongest_baseline(_made_up(rho1=0.0, kd=0.03), T0) == ('kd', T0, 1.0)
    assert strongest_baseline(_made_up(rho1=-0.05, kd=-0.02), T0) == ('cpt', 'none', 1.0)


def test_the_rule_reads_the_recorded_claims():
    "A failed precondition added to a reproducing run makes it untestable; the rule does not recompute the claims."
    R = _made_up()
    assert [c.holds for c in preconditions(R)] == [True] * 5
    bad = [c for c in preconditions(_made_up(chance=0.45)) if not c.holds]
    R.claims = [*bad, *R.claims]
    assert verdict(R) == UNTESTABLE
    R.claims = [c for c in R.claims if not c.is_precondition]
    assert verdict(R) == 'reproduced'


def test_fig_seed_curves_draws_one_line_per_run():
    import pandas as pd
    curves = pd.DataFrame([dict(setting=n, seed=s, step=[1, 2, 3], loss=[3.4, 3.4 - s, 1.0])
                           for n in ('CPT', 'CPT noise-free', 'Rho-1 k=0.4') for s in (0, 1, 2)])
    fig = fig_seed_curves(curves)
    assert len(fig.data) == 6 and {d.legendgroup for d in fig.data} == {'CPT', 'CPT noise-free'}
    assert list(fig.data[1].y) == [3.4, 2.4, 1.0]                  # seed 1 of CPT, in table order
    with pytest.raises(ValueError, match='no curves'): fig_seed_curves(curves, ('CPT', 'clean'))

"Cross-checks of `workbench.objectives.vocagnolm`: the lexical alignment against brute force, the teacher-guided loss's reductions, a teacher identical to the student, exact-match KD, error cases, and the verdict rule on made-up rows (fast, CPU; no real model)."
import math
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from workbench.objectives.vocagnolm import (math_corpus, token_spans, align_spans, aggregate_teacher_loss, teacher_token_losses,
    teacher_guided_loss, build_stream, shuffle_mapped, train_student, score_heldout, answer_spans, shared_vocab_map,
    exact_match_kd_targets, exact_match_kd_loss, vocab_overlap, claims, verdict, headline, strongest_baseline, VocAgnoLMConfig, TEACHERS)
from workbench.core import Claim, Results, UNTESTABLE
from workbench.data import train_bpe
from workbench.models import tiny_llama


@pytest.fixture(scope='module')
def tok():
    "A small byte-level BPE whose eos doubles as BOS."
    t = train_bpe(math_corpus(60, seed=11), vocab_size=320, cache=False)
    t.bos_token = t.eos_token
    return t


def _brute(s, t):
    lo, hi = [], []
    for a, b in s:
        js = [j for j, (c, d) in enumerate(t) if d > c and max(a, c) < min(b, d)]
        lo.append(js[0] if js else 0); hi.append(js[-1] if js else -1)
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
        al = align_spans(s, t); lo, hi = _brute(s, t)
        assert (al.lo == lo).all() and (al.hi == hi).all()
        m = ~al.unmapped
        assert (t[al.lo[m], 0] <= s[m, 0]).all() and (t[al.hi[m], 1] >= s[m, 1]).all()
        assert (np.diff(al.lo[m]) >= 0).all() and (al.lo[m] <= al.hi[m]).all()


def test_identical_tokenizers_give_the_identity(tok):
    text = 'Compute 11 * 12. We get 11 * 12 = 132, so the answer is 132.'
    _, sp = token_spans(tok, text)
    al = align_spans(sp, sp)
    assert (al.lo == np.arange(len(sp))).all() and (al.hi == np.arange(len(sp))).all()
    lt = np.random.default_rng(0).random(len(sp))
    for how in ('max', 'mean', 'sum'): np.testing.assert_allclose(aggregate_teacher_loss(al, lt, how), lt)


def test_keep_ratio_one_is_cross_entropy_and_counts():
    torch.manual_seed(1)
    lg, y = torch.randn(3, 9, 13), torch.randint(0, 13, (3, 9)); y[2, 4:] = -100
    tl = torch.rand(3, 9); tl[0, :2] = float('nan')
    torch.testing.assert_close(teacher_guided_loss(lg, y, tl, 1.0), F.cross_entropy(lg.transpose(1, 2), y, ignore_index=-100))
    # the kept count is ceil(k * mapped) + unmapped: recover it from a loss whose per-token values are all 1 except a marker
    ls = F.cross_entropy(lg.transpose(1, 2), y.clamp(min=0), reduction='none')
    valid, mapped = y != -100, (y != -100) & ~tl.isnan()
    for k in (0.1, 0.4, 0.77):
        kept = math.ceil(k * int(mapped.sum())) + int((valid & ~mapped).sum())
        top = (ls - tl)[mapped].topk(math.ceil(k * int(mapped.sum()))).values + tl[mapped][(ls - tl)[mapped].topk(math.ceil(k * int(mapped.sum()))).indices]
        expect = (top.sum() + ls[valid & ~mapped].sum()) / kept
        torch.testing.assert_close(teacher_guided_loss(lg, y, tl, k), expect)
    torch.testing.assert_close(teacher_guided_loss(lg, y, tl, 0.5, unmapped='exclude'),
                               ls[mapped][(ls - tl)[mapped].topk(math.ceil(0.5 * int(mapped.sum()))).indices].mean())


def test_teacher_identical_to_student_has_zero_excess(tok):
    m = tiny_llama(len(tok), d_model=32, seed=3).eval()
    docs = math_corpus(3, seed=5)
    st = build_stream(tok, docs, {'same': teacher_token_losses(m, tok, docs)})
    starts = np.flatnonzero(st['ids'] == tok.eos_token_id).tolist() + [len(st['ids'])]
    assert len(starts) == len(docs) + 1 and starts[0] == 0
    for a, b in zip(starts[:-1], starts[1:]):                    # each document after its eos, as the teacher scored it
        x = torch.from_numpy(st['ids'][a:b])[None]
        with torch.no_grad(): ls = F.cross_entropy(m(input_ids=x[:, :-1]).logits[0], x[0, 1:], reduction='none').numpy()
        tl = st['tl']['same'][a + 1:b]
        assert not np.isnan(tl).any() and np.isnan(st['tl']['same'][a])
        np.testing.assert_allclose(ls, tl, atol=1e-4)


def test_errors(tok):
    lg, y, tl = torch.randn(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4)
    for k in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match='top_k_ratio'): teacher_guided_loss(lg, y, tl, k)
    with pytest.raises(ValueError, match='shapes differ'): teacher_guided_loss(lg, y, tl[:, :3])
    with pytest.raises(ValueError, match='unmapped'): teacher_guided_loss(lg, y, tl, 0.5, unmapped='drop')
    with pytest.raises(ValueError, match='sorted'): align_spans(np.array([[4, 6], [0, 2]]), np.array([[0, 6]]))
    with pytest.raises(ValueError, match='end >= start'): align_spans(np.array([[3, 1]]), np.array([[0, 6]]))
    al = align_spans(np.array([[0, 3], [3, 6]]), np.array([[0, 2], [2, 6]]))
    with pytest.raises(ValueError, match='different texts'): aggregate_teacher_loss(al, [0.1])
    with pytest.raises(ValueError, match='scored 1 texts'): build_stream(tok, ['a', 'b'], {'t': [dict()]})
    with pytest.raises(ValueError, match='unknown model'): VocAgnoLMConfig(model='gpt2')
    with pytest.raises(ValueError, match='teacher2'): VocAgnoLMConfig(teacher2='no-such-model')
    with pytest.raises(ValueError, match='differ'): VocAgnoLMConfig(teacher2=TEACHERS[0])
    with pytest.raises(TypeError): VocAgnoLMConfig(teachers=TEACHERS)           # derived from model and teacher2


def test_exact_match_kd(tok):
    vm = shared_vocab_map(tok, tok)
    assert len(vm) == len(tok) and vocab_overlap(tok, tok) == 1.0
    lg, y = torch.randn(2, 5, len(tok)), torch.randint(0, len(tok), (2, 5))
    p, ix = lg.softmax(-1).topk(8, -1)
    # the student's own top-8, renormalised, as target: KL equals -log(top-8 mass) averaged, not zero; the full distribution gives zero
    pf, ixf = lg.softmax(-1).topk(len(tok), -1)
    torch.testing.assert_close(exact_match_kd_loss(lg, y, ixf, pf), F.cross_entropy(lg.transpose(1, 2), y), atol=1e-5, rtol=0)
    kl8 = exact_match_kd_loss(lg, y, ix, p / p.sum(-1, keepdim=True)) - F.cross_entropy(lg.transpose(1, 2), y)
    torch.testing.assert_close(kl8, -torch.log(p.sum(-1)).mean(), atol=1e-5, rtol=0)
    ids, pr = exact_match_kd_targets(np.array([[0, 3]]), dict(spans=np.array([[0, 3]]), top_ids=np.array([[1, 2]]), top_p=np.array([[.5, .5]])), {}, K=2)
    assert (ids == -1).all() and (pr == 0).all()                     # disjoint vocabularies: no target, the loss is plain CE


def test_training_reproduces_cpt_at_k1_and_answers(tok):
    docs = math_corpus(6, seed=2); ids, _ = build_stream(tok, docs, {})['ids'], None
    st = build_stream(tok, docs, {'t': [dict(spans=token_spans(tok, d)[1], losses=np.ones(len(token_spans(tok, d)[1]), np.float32)) for d in docs]})
    a, b = tiny_llama(len(tok), d_model=32, seed=0), tiny_llama(len(tok), d_model=32, seed=0)
    ca = train_student(a, st['ids'], None, 6, 2, 32, 1e-2, seed=4)
    cb = train_student(b, st['ids'], st['tl']['t'], 6, 2, 32, 1e-2, seed=4, top_k_ratio=1.0)
    np.testing.assert_allclose([l for _, l in ca], [l for _, l in cb], atol=1e-4)
    shuf = shuffle_mapped(st['tl']['t'], 0)
    assert np.array_equal(np.isnan(shuf), np.isnan(st['tl']['t']))
    h = score_heldout(a, tok, math_corpus(3, seed=9, noise=0.0))
    assert (h['total'] == [len(answer_spans(t)) for t in math_corpus(3, seed=9, noise=0.0)]).all() and (h['bpc'] > 0).all()


def test_config_sizes_and_seeds(monkeypatch):
    q, f = VocAgnoLMConfig(mode='quick'), VocAgnoLMConfig(mode='full')
    assert f.teachers == TEACHERS and f.n_seeds >= 3 and q.n_train_docs < f.n_train_docs
    assert VocAgnoLMConfig(seed=5, n_seeds=2).seeds == [5, 6]


# --- the verdict rule on made-up rows ---
FAILED = Claim('made-up precondition: the teacher is stronger than the student', -0.1, -0.3, 0.1, null=0.0, role='precondition', threshold_from='min_teacher_gap')
HOLDS = Claim('made-up precondition: training has run its course', 0.001, -0.002, 0.004, better='lower', null=0.01, role='precondition', threshold_from='slope_tol')
T0 = TEACHERS[0]


def _made_up(bpc, acc, kd=0.0, shuffled=0.0, seeds=(0, 1, 2, 3), ks=(0.4, 0.7)):
    "Rows in the shape `claims` reads: each setting's gain over plain CPT (bits per char: lower by it; answer accuracy: higher by it) plus seed jitter."
    gain = {('cpt', 'none', 1.0): (0.0, 0.0), ('kd', T0, 1.0): (kd, kd), ('shuffled', T0, ks[0]): (shuffled, shuffled),
            **{('vocagnolm', T0, k): (bpc, acc) for k in ks}}
    rows = [dict(method=m, teacher=t, k=k, seed=s, bpc=2.0 - gb + 0.01 * s + 0.005 * ((s + i) % 2), answer_acc=0.5 + ga + 0.01 * s - 0.005 * ((s + i) % 2))
            for s in seeds for i, ((m, t, k), (gb, ga)) in enumerate(gain.items())]
    return Results('vocagnolm', dict(teachers=(T0,), top_k_ratios=ks), rows, seeds=list(seeds))


@pytest.mark.parametrize('bpc,acc,want,shows', [
    (0.1, 0.1, 'reproduced', [True] * 6),
    (-0.1, 0.1, 'partly', [False] * 3 + [True] * 3),          # the committed run's pattern: accuracy up, bits per char worse
    (0.0, 0.0, 'not reproduced', [False] * 6),                # no effect beyond the CI
    (-0.1, -0.1, 'not reproduced', [False] * 6),              # the other way on both metrics
])
def test_verdict_on_made_up_rows(bpc, acc, want, shows):
    R = _made_up(bpc, acc)                                    # claims per metric: k=0.4 and k=0.7 vs the strongest baseline, then vs the shuffled control
    assert [c.shows for c in claims(R)] == shows
    assert verdict(R) == want


def test_claims_are_against_the_strongest_baseline_and_the_control():
    "Exact-match KD above VocAgnoLM is the baseline (those claims go the other way); with KD below CPT, CPT is, and a shuffled control as good as VocAgnoLM fails the control claims."
    R = _made_up(0.1, 0.1, kd=0.2)
    assert strongest_baseline(R.df, 'bpc', T0, R.seeds) == ('kd', T0) == strongest_baseline(R.df, 'answer_acc', T0, R.seeds)
    assert [c.shows for c in claims(R)] == [False, False, True] * 2 and all(c.opposite for c in claims(R) if 'strongest' in c.name)
    assert verdict(R) == 'partly'
    R = _made_up(0.1, 0.1, kd=-0.05, shuffled=0.1)                     # KD below CPT: CPT is the baseline
    assert strongest_baseline(R.df, 'bpc', T0, R.seeds) == ('cpt', 'none')
    assert [c.shows for c in claims(R)] == [True, True, False] * 2 and verdict(R) == 'partly'


@pytest.mark.parametrize('bpc,want', [(0.1, 'reproduced'), (0.0, 'not reproduced')])
def test_a_failed_precondition_makes_it_untestable(bpc, want):
    R = _made_up(bpc, bpc)
    R.claims = [FAILED, *claims(R)]
    assert verdict(R) == UNTESTABLE
    R.claims = [HOLDS, *claims(R)]
    assert verdict(R) == want

"Cross-checks of `workbench.collaboration.fed_icl`: partition, message schema, transport privacy and bytes, protocol reductions, the linear-attention theory, and the verdict (fast, CPU, no LM: a fake scorer copies facts)."
import json, re
from types import SimpleNamespace
import numpy as np
import pytest
from workbench.core import Results, save_results, load_results
from workbench.collaboration.fed_icl import (TOPICS, LETTERS, QAExample, make_fictional_qa, dirichlet_partition, Embeddings, Retriever, format_prompt,
    check_message, InProcessTransport, FedICLClient, FedICLServer, run_fed_icl, lsa_gamma, lsa_predict, linear_fed_icl, linear_theory, linear_case,
    lora_round_bytes, FedICLConfig, claims, verdict, headline, best_single, _acc)


class FakeScorer:
    "Answers like a perfect copier: the label of the last demonstration about the same entity, else option 0."
    def __init__(self): self.calls = 0
    def __call__(self, demos, query):
        self.calls += 1
        names = set(re.findall(r'[A-Z][a-z]{3,}', query.question)) - {'The'}
        a = 0
        for q, ans in demos:
            if names & set(re.findall(r'[A-Z][a-z]{3,}', q)) and ans in query.options: a = query.options.index(ans)
        pr = [0.1] * len(query.options); pr[a] = 0.7
        return a, pr


def _setup(L=3, alpha=0.05, n_topics=3, n_ent=4, M=6, seed=0):
    cl, sv = make_fictional_qa(n_topics, n_ent, seed)
    emb = Embeddings('tfidf', corpus=[e.question for e in cl + sv])
    return cl, sv[:M], emb, [p for p in dirichlet_partition(cl, L, alpha, seed) if p]


def test_data_and_partition():
    cl, sv = make_fictional_qa(8, 30, seed=3)
    assert [c.answer for c in cl] == [s.answer for s in sv] and all(c.entity == s.entity for c, s in zip(cl, sv))
    assert not any(c.question == s.question for c, s in zip(cl, sv))                    # different wordings: no leakage by identical strings
    for a in (0.01, 1.0, 1e4):
        P = dirichlet_partition(cl, 3, a, seed=1)
        assert sorted(e.entity for p in P for e in p) == sorted(e.entity for e in cl)
    top = lambda P: np.mean([max(sum(e.topic == t for e in p) for p in P) / 30 for t in TOPICS])
    assert top(dirichlet_partition(cl, 3, 0.01, 2)) > 0.9 and top(dirichlet_partition(cl, 3, 1e4, 2)) < 0.45
    with pytest.raises(ValueError, match='alpha'): dirichlet_partition(cl, 3, 0)
    with pytest.raises(ValueError, match='n_clients'): dirichlet_partition(cl, 0, 1.0)


def test_tfidf_retrieval_finds_the_same_fact():
    cl, sv = make_fictional_qa(8, 10, seed=0)
    emb = Embeddings('tfidf', corpus=[e.question for e in cl + sv]); r = Retriever([e.question for e in cl], emb)
    assert np.mean([cl[r.topk(s.question, 1)[0]].entity == s.entity for s in sv]) > 0.9
    assert format_prompt([('a', 'b')], 'c') == 'a b\nc'


def test_messages_are_checked():
    good = dict(type='query', round=1, items=[dict(qid=0, question='q', options=['a', 'b', 'c', 'd'], answer='B')])
    assert check_message(good) is good
    bad = [(dict(good, type='grad'), 'message type'), (dict(good, round=True), 'round'), ([], 'dict'), (dict(good, extra=1), 'unknown fields'),
           (dict(good, items=[dict(qid=0, question='q', options=[], answer='Z')]), 'one of'), (dict(good, items='x'), 'list'),
           (dict(type='answer', round=1, client=0, items=[dict(qid=0, answer='A', prob=0.5)]), 'prob'),
           ({k: v for k, v in good.items() if k != 'round'}, "lacks the field 'round'")]
    for m, msg in bad:
        with pytest.raises(ValueError, match=msg): check_message(m)


def test_no_example_text_leaves_a_client_and_bytes_are_constant():
    cl, Q, emb, parts = _setup()
    clients = [FedICLClient(i, p, FakeScorer(), emb, C=1) for i, p in enumerate(parts)]
    tr = InProcessTransport(); h = run_fed_icl(clients, FedICLServer(Q, 0), 3, tr)
    assert len({r['bytes_down'] for r in h}) == 1 and len({r['bytes_up'] for r in h}) == 1
    assert h[0]['bytes_down'] == sum(len(s.encode()) for s in tr.log[0::2][:len(clients)])
    for s in tr.log:
        for e in cl:
            assert e.question not in s                                                   # no client example text on the wire
        assert 'answer' in json.loads(s)['type'] or 'query' == json.loads(s)['type']
    truth = [q.answer for q in Q]
    assert all(a is None for a in [q.answer for q in FedICLServer(Q, 0).q])             # the server never holds labels
    assert np.mean(np.array(h[-1]['vote']) == truth) >= np.mean(np.array(h[0]['vote']) == truth)


def test_identical_clients_equal_single_client_icl():
    cl, Q, emb, _ = _setup()
    one = run_fed_icl([FedICLClient(0, cl, FakeScorer(), emb, C=2)], FedICLServer(Q, 1), 1)[0]
    three = run_fed_icl([FedICLClient(i, cl, FakeScorer(), emb, C=2) for i in range(3)], FedICLServer(Q, 1), 1)[0]
    assert three['vote'] == one['vote'] == one['clients'][0] and all(c == one['clients'][0] for c in three['clients'])


def test_one_client_with_all_data_is_the_upper_bound():
    cl, Q, emb, _ = _setup()
    gt = run_fed_icl([FedICLClient(0, cl, FakeScorer(), emb, C=1, mode='gt')], FedICLServer(Q, 0), 1, filter_first=False)[0]['vote']
    assert gt == [q.answer for q in Q]                                                  # a perfect copier with its own fact retrieved


def test_protocol_is_deterministic_and_errors_are_clear():
    cl, Q, emb, parts = _setup(alpha=1.0)
    run = lambda: run_fed_icl([FedICLClient(i, p, FakeScorer(), emb, C=1) for i, p in enumerate(parts)], FedICLServer(Q, 4), 2)
    assert run() == run()
    with pytest.raises(ValueError, match='no examples'): FedICLClient(0, [], FakeScorer(), emb)
    with pytest.raises(ValueError, match='M >= 1'): FedICLServer([])
    with pytest.raises(ValueError, match='C'): FedICLClient(0, cl, FakeScorer(), emb, C=0)
    with pytest.raises(ValueError, match='mode'): FedICLClient(0, cl, FakeScorer(), emb, mode='debate')
    with pytest.raises(ValueError, match='rounds'): run_fed_icl([], FedICLServer(Q, 0), 0)
    srv = FedICLServer(Q, 0)
    with pytest.raises(ValueError, match='unknown question id'): srv.aggregate([dict(client=0, items=[dict(qid=99, answer='A', prob='0.5000')])])


def test_linear_iteration_matches_the_closed_form():
    c = linear_case(False, N=300, M=300, T=20.0, seed=3); th = linear_theory(**c)
    ys = linear_fed_icl(c['Xc'], c['yc'], c['Xs'], c['Gi'], 6)
    w = np.zeros(len(th['H']))
    for y in ys:
        w = 0.5 * th['H'] @ w + 0.5 * th['w_limit']                                     # w_{k+1} = ½ H w_k + ½ w_limit
        np.testing.assert_allclose(y, c['Xs'] @ w, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(lsa_gamma(np.eye(2), 4.0), np.eye(2) * (1.25 + 0.5))


@pytest.mark.parametrize('matched', [True, False])
def test_linear_fixed_point(matched):
    c = linear_case(matched, seed=1); th = linear_theory(**c)
    assert th['norm_H'] < 2
    y0 = np.random.default_rng(0).standard_normal(len(c['Xs'])) * 10
    ys = linear_fed_icl(c['Xc'], c['yc'], c['Xs'], c['Gi'], 40, y0=y0)
    ws = [np.linalg.lstsq(c['Xs'], y, rcond=None)[0] for y in ys]
    np.testing.assert_allclose(ws[-1], th['w_star'], atol=1e-8)                          # converges from a random start
    d = [np.linalg.norm(w - th['w_star']) for w in ws]
    assert all(b <= 0.5 * th['norm_H'] * a + 1e-9 for a, b in zip(d[:10], d[1:11]))      # contraction rate ½||H||
    gap = np.linalg.norm(th['w_star'] - th['w_limit']) / np.linalg.norm(th['w_limit'])
    assert gap < 0.06 if matched else gap > 0.12                                        # pooled ICL only with matched covariances


def test_matched_gap_vanishes_with_more_data():
    "With matched covariances, w* -> w_limit as N, M grow (H -> I); with mismatched ones it does not."
    rel = lambda m, n: np.mean([(lambda th: np.linalg.norm(th['w_star'] - th['w_limit']) / np.linalg.norm(th['w_limit']))(linear_theory(**linear_case(m, N=n, M=n, seed=s))) for s in range(3)])
    assert rel(True, 16000) < 0.5 * rel(True, 500)
    assert rel(False, 16000) > 0.1


def test_lora_bytes_by_hand():
    smol = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, head_dim=64)
    per_layer = 8 * (576 + 576) + 8 * (576 + 192)                                       # A and B of q (576->576) and v (576->192)
    assert lora_round_bytes(smol, 8, 3) == per_layer * 30 * 4 * 2 * 3


def test_config(monkeypatch):
    full = FedICLConfig(mode='full')
    assert full.seeds == [0, 1, 2] and len(full.alphas) >= 2 and full.n_clients == 3
    monkeypatch.setenv('WORKBENCH_SEED', '5'); assert FedICLConfig(mode='quick').seeds == [5]
    for kw, msg in ((dict(alphas=(0.0,)), 'alphas'), (dict(C=0), 'C'), (dict(backend='bm25'), 'backend'), (dict(variants=('free',)), 'variants'),
                    (dict(n_queries=999), 'n_queries')):
        with pytest.raises(ValueError, match=msg): FedICLConfig(mode='quick', **kw)


def _fake(fed_gain, n_seeds=3, M=10, seed=0, kb=2.0):
    rng, rows, comm, units = np.random.default_rng(seed), [], [], []
    for a in (0.05, 100.0):
        for s in range(n_seeds):
            truth_single = rng.random((3, M)) < np.array([[0.5], [0.3], [0.3]])
            gt = truth_single[0] & (rng.random(M) < 0.8)
            fed = np.clip(gt + (rng.random(M) < fed_gain), 0, 1) if fed_gain >= 0 else gt & (rng.random(M) < 1 + fed_gain)
            add = lambda m, r, v, c=-1: rows.extend(dict(alpha=a, seed=s, method=m, round=r, client=c, qid=q, correct=int(x)) for q, x in enumerate(v))
            add('zero_shot', 0, rng.random(M) < 0.25); add('gt', 1, gt); add('ub', 1, np.ones(M))
            for c in range(3): add('single', 1, truth_single[c], c)
            for k in (1, 2): add('fed', k, gt if k == 1 else fed)
            comm += [dict(alpha=a, seed=s, method='fed', round=k, bytes_down=int(kb * 600), bytes_up=int(kb * 400)) for k in (1, 2)]
            units.append(dict(alpha=a, seed=s, lora_bytes=11059200, n_forward=1, retrieval_hit=1.0))
    r = Results('fed_icl', FedICLConfig(mode='quick'), rows, seeds=list(range(n_seeds)), tables=dict(comm=comm, units=units))
    return r.conclude(verdict, claims(r), headline(r))


@pytest.mark.parametrize('gain,kb,want', [(0.9, 2.0, 'reproduced'), (0.3, 2.0, 'partly'), (0.0, 2.0, 'not reproduced'), (-0.5, 2e3, 'not reproduced')])   # 0.0: only the bytes show
def test_verdict_rule(gain, kb, want, tmp_path):
    r = _fake(gain, kb=kb)
    assert r.verdict == want and len(r.claims) == 5
    back = load_results('fed_icl', save_results(r, tmp_path).parent)
    assert verdict(back) == want and back.headline == r.headline


def test_best_single_picks_the_best_client_per_seed():
    r = _fake(0.0)
    d = r.df[(r.df.method == 'single') & (r.df.alpha == 0.05)]
    want = np.mean([d[d.seed == s].groupby('client').correct.mean().max() for s in r.seeds])
    assert best_single(r.df, 0.05).mean() == pytest.approx(want)


def test_recorded_results_recompute():
    "The committed full run passes the schema and its verdict recomputes from its rows."
    from workbench.core import check_results, get_settings
    path = get_settings().results_path / 'fed_icl.json'
    if not path.exists(): pytest.skip('no full run recorded yet: `workbench run fed_icl --full`')
    check_results(json.loads(path.read_text()), str(path))
    r = load_results('fed_icl')
    assert r.mode == 'full' and len(r.seeds) >= 3
    assert verdict(r) == r.verdict and [c.name for c in claims(r)] == [c.name for c in r.claims]
    for c, c2 in zip(r.claims, claims(r)): assert c.estimate == pytest.approx(c2.estimate, nan_ok=True)
    assert set(r.df.method) >= {'zero_shot', 'single', 'gt', 'ub', 'fed'} and r.df.groupby('alpha').seed.nunique().min() == len(r.seeds)

"Cross-checks of `workbench.collaboration.fed_icl`: partition, message schema, transport privacy and bytes, protocol reductions, the linear-attention theory, and the verdict (fast, CPU, no LM: a fake scorer copies facts)."
import json, os, re
import torch
import numpy as np
import pytest
from workbench.core import Results, save_results, load_results
from workbench.collaboration.fed_icl import (TOPICS, LETTERS, QAExample, make_fictional_qa, dirichlet_partition, Embeddings, Retriever, format_prompt,
    check_message, InProcessTransport, FedICLClient, FedICLServer, run_fed_icl, lsa_gamma, lsa_predict, linear_fed_icl, linear_theory, linear_case,
    lora_round_bytes, FedICLConfig, claims, verdict, headline, best_single, _acc, ProcessTransport, make_transport, encode_message, decode_message,
    LMFuser, fusion_comparison, MCScorer, load_scorer, CopyScorer, FlowerTransport, FLOWER_MISSING, answer_strings, fanout_score, fanout_norm,
    fanoutqa_dev, run_fanoutqa_unit, FANOUT_SKIP)


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
    "Counted on the model's own q_proj and v_proj: SmolLM2's shapes (on the meta device, no weights) and a Gemma-3 whose heads are wider than d/heads."
    from transformers import LlamaConfig, LlamaForCausalLM, Gemma3TextConfig, Gemma3ForCausalLM
    with torch.device('meta'):
        smol = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=64))
        gem = Gemma3ForCausalLM(Gemma3TextConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=48, vocab_size=64, layer_types=['full_attention'] * 2))
    per_layer = 8 * (576 + 576) + 8 * (576 + 192)                                       # A and B of q (576->576) and v (576->192)
    assert lora_round_bytes(smol, 8, 3) == per_layer * 30 * 4 * 2 * 3 == 11059200       # the committed run's lora_bytes
    assert lora_round_bytes(gem, 8, 1) == (8 * (32 + 96) + 8 * (32 + 48)) * 2 * 4 * 2    # q: 32->2·48, v: 32->1·48 (not d -> d)


def test_config(monkeypatch):
    full = FedICLConfig(mode='full')
    assert full.seeds == [0, 1, 2] and len(full.alphas) >= 2 and full.n_clients == 3
    monkeypatch.setenv('WORKBENCH_SEED', '5'); assert FedICLConfig(mode='quick').seeds == [5]
    for kw, msg in ((dict(alphas=(0.0,)), 'alphas'), (dict(C=0), 'C'), (dict(backend='bm25'), 'backend'), (dict(variants=('free',)), 'variants'),
                    (dict(n_queries=999), 'n_queries'), (dict(fanout_n=-1), 'fanout_n')):
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


def test_process_transport_gives_the_same_answers_and_bytes_from_other_processes():
    cl, Q, emb, parts = _setup(alpha=1.0)
    mk = lambda: [FedICLClient(i, p, FakeScorer(), emb, C=1) for i, p in enumerate(parts)]
    local = run_fed_icl(mk(), FedICLServer(Q, 2), 3, InProcessTransport())
    remote_clients = mk()
    with ProcessTransport() as tr:
        remote = run_fed_icl(remote_clients, FedICLServer(Q, 2), 3, tr)
        pids, procs = tr.pids, [w[0] for w in tr.workers.values()]
        assert len(set(pids)) == len(parts) and os.getpid() not in pids            # one OS process per client
        for s in tr.log:
            assert not any(e.question in s for e in cl)                              # only schema messages crossed the pipe
    assert remote == local                                                           # same answers, votes and bytes each round
    assert all(c.last == {} for c in remote_clients)                                 # the work happened in the client processes
    assert tr.workers == {} and not any(p.is_alive() for p in procs)                # closed on exit
    assert isinstance(make_transport('inprocess'), InProcessTransport) and isinstance(make_transport('process'), ProcessTransport)
    with pytest.raises(ValueError, match='transport'): make_transport('grpc')


def test_process_transport_reports_client_errors():
    msg = dict(type='query', round=1, items=[dict(qid=0, question='q', options=['a', 'b', 'c', 'd'], answer='A')])
    def boom(m): raise KeyError('lost my examples')
    with ProcessTransport() as tr:
        with pytest.raises(RuntimeError, match='lost my examples'): tr.send(msg, boom)
        with pytest.raises(ValueError, match='prob'): tr.send(msg, lambda m: dict(type='answer', round=1, client=0, items=[dict(qid=0, answer='A', prob=1.0)]))
    assert decode_message(encode_message(msg)) == msg
    for bad, what in ((b'\xff', 'UTF-8 JSON'), (b'{"type": "query"', 'UTF-8 JSON'), (b'{"type": "weights"}', 'message type')):
        with pytest.raises(ValueError, match=what): decode_message(bad)


def test_fusion_aggregation():
    cl, Q, emb, parts = _setup()
    q = Q[0]
    assert LMFuser(FakeScorer())(q, [(1, 0.9), (2, 0.3)]) == 1                      # the copier follows the most confident client (shown last)
    same = lambda rule: run_fed_icl([FedICLClient(i, cl, FakeScorer(), emb, C=2) for i in range(3)],
                                    FedICLServer(Q, 1, rule, LMFuser(FakeScorer()) if rule == 'fuse' else None), 2)
    v, f = same('vote'), same('fuse')
    assert [h['table'] for h in f] == [h['vote'] for h in v] and [h['bytes_up'] for h in f] == [h['bytes_up'] for h in v]   # identical clients: fusion = vote
    rng = np.random.default_rng(0)
    srv = FedICLServer(Q, 3, 'fuse', fuser=lambda q, g: int(rng.integers(4)))       # a random fuser is kept only when clients back it more
    for _ in range(5):
        reps = [dict(client=i, items=[dict(qid=m, answer=LETTERS[int(rng.integers(4))], prob=f"{rng.random():.4f}") for m in range(len(Q))]) for i in range(3)]
        mass = np.zeros((len(Q), 4))
        for r in reps:
            for it in r['items']: mass[it['qid'], LETTERS.index(it['answer'])] += float(it['prob'])
        before = list(srv.answers); after = srv.aggregate(reps)[0]
        for m, (a, b, fz) in enumerate(zip(before, after, srv.fused)):
            assert b == (fz if mass[m, fz] > mass[m, a] else a)
    with pytest.raises(ValueError, match='fuser'): FedICLServer(Q, 0, 'fuse')
    with pytest.raises(ValueError, match='rule'): FedICLServer(Q, 0, 'median')


def test_config_aggregations_transport_and_alphas():
    full = FedICLConfig(mode='full')
    assert 1.0 in full.alphas and min(full.alphas) < 1 < max(full.alphas)            # high, medium and low heterogeneity
    assert full.transport == 'inprocess' and 'fuse' in full.aggregations
    for kw, msg in ((dict(aggregations=('fuse',)), 'aggregations'), (dict(aggregations=('vote', 'mean')), 'aggregations'), (dict(transport='grpc'), 'transport')):
        with pytest.raises(ValueError, match=msg): FedICLConfig(mode='quick', **kw)
    from workbench.core import _unit_config
    assert _unit_config(FedICLConfig(mode='full', transport='process', aggregations=('vote',))) == _unit_config(full)   # cached units are shared


def test_fusion_is_reported_beside_the_claims_not_in_them():
    r = _fake(0.0)
    assert fusion_comparison(r) == []
    extra = [dict(row, method='fuse') for row in r.rows if row['method'] == 'fed']
    r2 = Results('fed_icl', FedICLConfig(mode='quick'), r.rows + extra, seeds=r.seeds, tables=dict(comm=r.table('comm').to_dict('records'), units=r.table('units').to_dict('records')))
    fc = fusion_comparison(r2)
    assert len(fc) == 4 and fc[0].estimate == pytest.approx(0.0)                    # fusion == vote here
    assert [c.name for c in claims(r2)] == [c.name for c in claims(r)] and verdict(r2) == verdict(r)


def test_fanoutqa_string_accuracy():
    ref = {'Pat Burrell': 'Right', 'JD Drew': 'Left'}
    assert answer_strings(ref) == ['Pat Burrell', 'JD Drew', 'Right', 'Left'] and answer_strings([True, [1, {'a': 'b'}]]) == ['yes', '1', 'a', 'b']
    assert fanout_score(ref, 'Pat Burrell: right. JD Drew: left!') == (1.0, True)
    assert fanout_score(ref, 'Pat Burrell bats right') == (0.5, False)
    assert fanout_score('tin', 'tinsel and zinc') == (0.0, False)                   # whole words only
    assert fanout_norm('About 1,234,567 people; U.S.') == 'about 1234567 people us' and fanout_score(1234567, 'some 1,234,567') == (1.0, True)


def test_fanoutqa_dev_questions_when_installed():
    dev = fanoutqa_dev()
    if dev is None:
        with pytest.raises(ImportError, match='fq_site'): run_fanoutqa_unit('smollm2-135m', 1, 4, 0)   # the unit says how to get the package
        pytest.skip(FANOUT_SKIP)
    assert len(dev) > 100 and all(q['question'] and q['answer'] is not None for q in dev)
    full = [fanout_score(q['answer'], ' ; '.join(answer_strings(q['answer'])))[1] for q in dev]
    assert np.mean(full) > 0.9                                                         # the reference's own strings score as complete, except:
    for q, ok in zip(dev, full):                                                     # strings like '$87 billion' or 'Italy (2021)', which FanOutQA's whole-word pattern misses too
        assert ok or any(not re.fullmatch(r'\w(.*\w)?', fanout_norm(a), re.S) for a in answer_strings(q['answer']))


def test_headline_reports_fanoutqa_when_present():
    r = _fake(0.3)
    assert 'FanOutQA' not in r.headline
    fq = [dict(loose=0.2, echo_loose=0.0, strict=0), dict(loose=0.0, echo_loose=0.1, strict=0)]
    r2 = Results('fed_icl', FedICLConfig(mode='quick'), r.rows, seeds=r.seeds, tables=dict(comm=r.table('comm').to_dict('records'), units=r.table('units').to_dict('records'), fanoutqa=fq))
    assert 'string accuracy 0.10 (question-echo control 0.05) on 2 questions' in headline(r2)


def test_scorer_pickles_as_its_model_name():
    sc = MCScorer(None, None, name='smollm2-135m')
    fn, args = sc.__reduce_ex__(4)
    assert fn is load_scorer and args == ('smollm2-135m',)                              # another process reloads the model, no weights in the pickle
    a, pr = CopyScorer()([('x', 'zinc'), ('y', 'tin'), ('z', 'zinc')], QAExample('q', ('tin', 'copper', 'zinc', 'iron'), None, 'bridge'))
    assert a == 2 and abs(sum(pr) - 1) < 1e-9


def test_flower_transport_says_how_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, 'flwr', None)                                     # as if flwr were not installed
    with pytest.raises(ImportError, match=re.escape("pip install 'workbench[flower]'")): make_transport('flower')
    assert 'workbench[flower]' in FLOWER_MISSING


def _cmd(q) -> str:
    "A process's command line, or '' once it has exited (a zombie has none)."
    import psutil
    try: return ' '.join(q.cmdline())
    except psutil.Error: return ''


def _listening(q) -> list:
    "The listening sockets of a process (none once it has exited)."
    import psutil
    try: return [c for c in q.net_connections('inet') if c.status == psutil.CONN_LISTEN]
    except psutil.Error: return []


@pytest.mark.optional
def test_flower_round_equals_in_process():
    """Two rounds over Flower's deployment engine (a local SuperLink, one SuperNode per client) give the in-process messages
    byte for byte; every process involved listens on the loopback host only, and closing stops the grandchildren too
    (the `flower-superexec` Flower starts in a session of its own, and the apps it runs). `tools/setup.sh` installs the
    `flower` extra, so this runs in `make test`."""
    if os.environ.get('WORKBENCH_REQUIRE_EXTRAS') != '1':                           # `make test` sets it: there a missing extra fails
        pytest.importorskip('flwr', reason="flwr is an optional extra: pip install 'workbench[flower]' (tools/setup.sh installs it)")
    import psutil
    cl, Q, emb, parts = _setup(L=2, alpha=1.0, M=4)
    mk = lambda: [FedICLClient(i, p, CopyScorer(), emb, C=2) for i, p in enumerate(parts)]
    ref = InProcessTransport(); local = run_fed_icl(mk(), FedICLServer(Q, 1), 2, ref)
    remote_clients = mk()
    with FlowerTransport(timeout=300) as ft:
        remote = run_fed_icl(remote_clients, FedICLServer(Q, 1), 2, ft)
        folder, procs = ft.dir, list(ft.procs)
        assert len(ft.slots) == len(parts) and len(procs) == len(parts) + 1         # a SuperLink and one SuperNode per client
        grand = [q for p in procs for q in psutil.Process(p.pid).children(recursive=True)]
        cmds = [_cmd(q) for q in grand]
        assert sum('flower-superexec' in c for c in cmds) == len(procs), cmds       # one SuperExec under the SuperLink and each SuperNode
        listening = {c.laddr.ip for q in [psutil.Process(p.pid) for p in procs] + grand for c in _listening(q)}
        assert listening and listening <= {'127.0.0.1'}, listening                   # nothing reachable from outside the machine
    assert ft.log == ref.log and (ft.bytes_down, ft.bytes_up) == (ref.bytes_down, ref.bytes_up)
    assert remote == local                                                           # same answers, votes and bytes each round
    assert all(c.last == {} for c in remote_clients)                                 # answered in the SuperNodes' processes
    assert all(p.poll() is not None for p in procs) and not folder.exists()          # stopped and cleaned up on exit
    gone = lambda q: not q.is_running() or q.status() == psutil.STATUS_ZOMBIE
    assert all(gone(q) for q in grand), [_cmd(q) for q in grand if not gone(q)]     # and so are the grandchildren

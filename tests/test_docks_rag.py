"Tests of DocKS-RAG (`workbench.retrieval.docks_rag`): generator, scorer (official Ign-F1), retrieval without leakage, head, errors, recorded verdict."
import json
import pytest, torch
from workbench.core import load_results, get_settings
from workbench.retrieval.docks_rag import (make_world, make_docre_dataset, DocKG, SentenceKB, build_hybrid_prompt, HybridRelationHead,
                                           atlop_threshold_loss, docre_scores, rel_id, DocKSConfig, verdict, BASE, RULES, RELATIONS, _encoder)

@pytest.fixture(scope='module')
def ds(): return make_docre_dataset(20, 6, seed=3)

@pytest.fixture(scope='module')
def kb(ds): return SentenceKB(_encoder(), ds.train)

def test_generator_is_deterministic_and_follows_schema(ds):
    assert json.dumps(make_docre_dataset(20, 6, seed=3).train) == json.dumps(ds.train)
    w = ds.world
    assert all((w['types'][h], w['types'][t]) == BASE[r] for h, r, t in w['facts'] if r in BASE)
    for h, r, t in w['facts']:
        if r in RULES: assert any((h, RULES[r][0], m) in w['facts'] and (m, RULES[r][1], t) in w['facts'] for m in w['types'])
    for d in ds.train + ds.test:
        for l in d['labels']: assert (d['entities'][l['h']], l['r'], d['entities'][l['t']]) in w['facts']

def test_inter_sentence_facts_exist(ds):
    S = lambda d: {e: {m['sent_id'] for m in vs} for e, vs in zip(d['entities'], d['vertexSet'])}
    n = sum(any(not S(d)[d['entities'][l['h']]] & S(d)[d['entities'][l['t']]] for l in d['labels']) for d in ds.train + ds.test)
    assert n >= len(ds.train + ds.test) // 2

G = {('d', 'a', 'b', 'works_for'), ('d', 'a', 'c', 'spouse'), ('d', 'b', 'x', 'located_in')}

def test_scorer_official_ign_f1():
    assert docre_scores(G, G, set())['f1'] == 1.0
    assert docre_scores({('d', 'q', 'z', 'born_in')}, G, set())['f1'] == 0.0
    P = {('d', 'a', 'b', 'works_for'), ('d', 'a', 'c', 'spouse'), ('d', 'q', 'z', 'born_in')}
    s0, s1 = docre_scores(P, G, set()), docre_scores(P, G, {('a', 'b', 'works_for')})
    assert s0['ign_f1'] == s0['f1']                                  # no training fact: Ign-F1 = F1
    assert s1['r'] == s0['r'] and abs(s1['ign_f1'] - 4 / 7) < 1e-12   # recall unchanged; hand-computed official formula
    assert docre_scores(list(P) + list(P), G, set())['n_pred'] == 3   # duplicates counted once
    assert docre_scores({('d', 'c', 'a', 'spouse')}, G, set())['n_correct'] == 1

def test_retrieval_never_leaks_test_labels(ds, kb):
    test_ids = {d['title'] for d in ds.test}
    for d in ds.test:
        hits = kb.search(d['sents'][0], k=50)
        assert not {x.doc_id for x in hits} & test_ids
        assert len(hits) <= 50 and [x.score for x in hits] == sorted((x.score for x in hits), reverse=True)
    assert kb.search('x', k=0) == []
    assert 'train0' not in {x.doc_id for x in kb.search(ds.train[0]['sents'][0], 100, exclude_doc='train0')}
    kg = DocKG.from_documents(ds.train, ds.world['types'], epochs=10)
    test_facts = {(d['entities'][l['h']], l['r'], d['entities'][l['t']]) for d in ds.test for l in d['labels']}
    train_facts = {(d['entities'][l['h']], l['r'], d['entities'][l['t']]) for d in ds.train for l in d['labels']}
    assert {(h, d_['rel'], t) for h, t, d_ in kg.g.edges(data=True) if not d_['inferred']} == train_facts
    assert set(kg.adj) <= set(ds.world['types']) and test_facts - train_facts   # some test facts are unseen, and the KG holds only train triples

def test_entity_match_shrinks_with_threshold(ds, kb):
    kg = DocKG.from_documents(ds.train, ds.world['types'], epochs=0)
    n = [len(kg.match(['Vergantor Belru'], _encoder(), tau)) for tau in (-1.0, 0.3, 0.6, 0.9, 1.0)]
    assert n == sorted(n, reverse=True) and n[0] == len(kg.g)

def test_head_shape_and_loss(ds, kb):
    kg = DocKG.from_documents(ds.train, ds.world['types'], epochs=0)
    d = ds.test[0]; hp = build_hybrid_prompt(d, d['entities'][0], d['entities'][1], kg, kb, k=3)
    m = HybridRelationHead(len(hp.vector()))
    logits = m(torch.tensor(hp.vector())[None].repeat(4, 1))
    assert logits.shape == (4, len(RELATIONS) + 1)
    y = torch.zeros(4, len(RELATIONS) + 1); y[:, 0] = 1
    assert atlop_threshold_loss(logits, y).item() > 0

def test_bad_inputs(ds, kb):
    with pytest.raises(KeyError): rel_id('married_to')
    with pytest.raises(ValueError): kb.search('x', k=-1)
    kg = DocKG.from_documents(ds.train, ds.world['types'], epochs=0)
    with pytest.raises(ValueError): kg.retrieve(['x'], tau_eq=1.5)
    with pytest.raises(ValueError): DocKG.from_documents(ds.train, ds.world['types'], tau_er=-0.1)
    with pytest.raises(ValueError): DocKSConfig(mode='quick', tau_eq=-2.0)
    with pytest.raises(ValueError): DocKSConfig(mode='quick', k=-1)

def test_recorded_verdict():
    p = get_settings().results_path / 'docks_rag.json'
    if not p.is_file(): pytest.skip('no full run recorded yet')
    R = load_results('docks_rag')
    assert R.mode == 'full' and len(R.seeds) >= 3 and verdict(R) == R.verdict

# --- sweeps and the untuned-LLM probe (issue 23: B4, k and tau_eq sweeps) ---
from workbench.retrieval.docks_rag import (with_k, with_link, exact_link, AliasLinker, alias, split_features, llm_relation_scores,
                                           probe_prompt, _load_llm, VERBAL, _unit_cfg)

@pytest.fixture(scope='module')
def prompts(ds, kb):
    kg = DocKG.from_documents(ds.train, ds.world['types'], epochs=0)
    d = ds.test[0]
    P10 = [build_hybrid_prompt(d, h, t, kg, kb, k=10) for h in d['entities'] for t in d['entities'] if h != t]
    P5 = [build_hybrid_prompt(d, h, t, kg, kb, k=5) for h in d['entities'] for t in d['entities'] if h != t]
    return kg, P10, P5

def test_k_recut_matches_direct_retrieval_and_k0_is_b1(kb, prompts):
    kg, P10, P5 = prompts
    X5, Xr = split_features(P5, kb), split_features(P10, kb, 5)
    assert all(torch.equal(X5[v], Xr[v]) for v in X5)                    # top-5 is a prefix of top-10
    assert torch.equal(split_features(P10, kb, 0)['B3'], X5['B1'])        # k=0: the hybrid head sees exactly B1's inputs
    with pytest.raises(ValueError): with_k(P5[0], kb, 6)                 # re-cutting can only shrink

def test_exact_link_reproduces_features_and_alias_links_shrink(ds, kb, prompts):
    kg, _, P5 = prompts
    X = split_features(P5, kb)
    assert all(torch.equal(X[v], split_features(P5, kb, None, kg, exact_link(kg))[v]) for v in X)
    lk = AliasLinker(kg, _encoder(), ds.world['types'])
    e = next(iter(kg.adj))
    n = [len(lk.link(tau)(e)) for tau in (-1.0, 0.0, 0.5, 0.7, 0.9, 1.0)]
    assert n == sorted(n, reverse=True) and n[0] == len(kg.adj)
    assert alias('Kalo Verti', 'PER') == 'Verti' and alias('Dorhol Group', 'ORG') == 'Dorhol'
    with pytest.raises(ValueError): lk.link(1.5)

def test_llm_relation_scores_prefers_the_stated_relation(ds, kb, prompts):
    model, tok = _load_llm('smollm2-135m')
    s = llm_relation_scores(model, tok, 'Ann Bo works for Kilo Group. Question: how is Ann Bo related to Kilo Group?\nAnswer:',
                            [VERBAL[r].format(h='Ann Bo', t='Kilo Group') for r in ('works_for', 'founded_by', 'NA')])
    assert s.shape == (3,) and torch.isfinite(s).all() and (s <= 0).all()
    one = llm_relation_scores(model, tok, 'Ann Bo works for Kilo Group.', ['Ann Bo works for Kilo Group.'])
    assert torch.isclose(one, llm_relation_scores(model, tok, 'Ann Bo works for Kilo Group.', ['Ann Bo works for Kilo Group.', 'x'])[:1], atol=1e-4).all()
    kg, _, P5 = prompts
    assert 'Known facts' not in probe_prompt(P5[0], ('ctx',)) and probe_prompt(P5[0]).endswith('Answer:')

def test_sweep_config_errors_and_unit_key():
    with pytest.raises(ValueError): DocKSConfig(mode='quick', tau_grid=(0.5, 1.2))
    with pytest.raises(ValueError): DocKSConfig(mode='quick', k_grid=(-1,))
    with pytest.raises(ValueError): DocKSConfig(mode='quick', n_sweep_seeds=2)        # more sweep seeds than seeds
    a, b = DocKSConfig(mode='full'), DocKSConfig(mode='full', k_grid=(), tau_grid=(), n_probe=0)
    from workbench.core import _unit_config
    assert _unit_config(_unit_cfg(a)) == _unit_config(_unit_cfg(b))   # the sweeps never invalidate the seed units

"Tests of DocKS-RAG (`workbench.retrieval.docks_rag`): generator, scorer (official Ign-F1), retrieval without leakage, head, errors, the verdict rule on made-up rows."
import json
import pytest, torch
from workbench.core import Claim, Results, UNTESTABLE
from workbench.retrieval.docks_rag import (make_world, make_docre_dataset, DocKG, SentenceKB, build_hybrid_prompt, HybridRelationHead,
                                           atlop_threshold_loss, docre_scores, rel_id, DocKSConfig, verdict, claims, BASE, RULES, RELATIONS)
from workbench.models import load_embedder

@pytest.fixture(scope='module')
def ds(): return make_docre_dataset(20, 6, seed=3)

@pytest.fixture(scope='module')
def kb(ds): return SentenceKB(load_embedder(), ds.train)

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
    disjoint = {('a', 'c', 'works_for'), ('b', 'x', 'spouse'), ('q', 'z', 'born_in')}   # training facts, none a gold (test) fact; one equals a wrong prediction
    assert not {f[1:] for f in G} & disjoint
    s2 = docre_scores(P, G, disjoint)
    assert s2['n_correct_train'] == 0 and s2['ign_f1'] == s2['f1'] == s0['f1'] and s2['f1'] < 1
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
    n = [len(kg.match(['Vergantor Belru'], load_embedder(), tau)) for tau in (-1.0, 0.3, 0.6, 0.9, 1.0)]
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
    with pytest.raises(KeyError, match='unknown relation'): rel_id('married_to')
    with pytest.raises(ValueError, match=r'^k must be an int in \[0'): kb.search('x', k=-1)
    kg = DocKG.from_documents(ds.train, ds.world['types'], epochs=0)
    with pytest.raises(ValueError, match=r'^tau_eq must be a finite number in \[-1, 1\], got 1.5'): kg.retrieve(['x'], tau_eq=1.5)
    with pytest.raises(ValueError, match=r'^tau_er must be a finite number in \[0, 1\], got -0.1'): DocKG.from_documents(ds.train, ds.world['types'], tau_er=-0.1)
    with pytest.raises(ValueError, match=r'^tau_eq must be a finite number in \[-1, 1\], got -2.0'): DocKSConfig(mode='quick', tau_eq=-2.0)
    with pytest.raises(ValueError, match=r'^k must be an int in \[0'): DocKSConfig(mode='quick', k=-1)
    with pytest.raises(ValueError, match=r'^tau_eq must be a finite number'): build_hybrid_prompt(ds.test[0], *ds.test[0]['entities'][:2], kg, kb, tau_eq=float('nan'))

# --- sweeps and the untuned-LLM probe (issue 23: B4, k and tau_eq sweeps) ---
from workbench.retrieval.docks_rag import (with_k, with_link, exact_link, AliasLinker, alias, split_features, llm_relation_scores,
                                           probe_prompt, _load_llm, VERBAL, _unit_cfg, calibrated_scores, PROBE_CANDS, build_pipeline)

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
    lk = AliasLinker(kg, load_embedder(), ds.world['types'])
    e = next(iter(kg.adj))
    n = [len(lk.link(tau)(e)) for tau in (-1.0, 0.0, 0.5, 0.7, 0.9, 1.0)]
    assert n == sorted(n, reverse=True) and n[0] == len(kg.adj)
    assert alias('Kalo Verti', 'PER') == 'Verti' and alias('Dorhol Group', 'ORG') == 'Dorhol'
    with pytest.raises(ValueError): lk.link(1.5)

def test_llm_relation_scores_prefers_the_stated_relation(ds, kb, prompts):
    model, tok = _load_llm('smollm2-135m')
    cands = ('works_for', 'founded_by', 'located_in', 'NA')
    s = llm_relation_scores(model, tok, 'Ann Bo works for Kilo Group. Question: how is Ann Bo related to Kilo Group?\nAnswer:',
                            [VERBAL[r].format(h='Ann Bo', t='Kilo Group') for r in cands])
    assert s.shape == (4,) and torch.isfinite(s).all() and (s <= 0).all()
    assert cands[int(s.argmax())] == 'works_for', s                    # the stated relation scores highest
    hp = build_hybrid_prompt({'sents': ['Ann Bo works for Kilo Group.'], 'entities': ['Ann Bo', 'Kilo Group'],
                              'vertexSet': [[dict(name='Ann Bo', sent_id=0, type='PER')], [dict(name='Kilo Group', sent_id=0, type='ORG')]], 'labels': []},
                             'Ann Bo', 'Kilo Group', prompts[0], kb, k=0)
    cal, raw, null = calibrated_scores(model, tok, hp, ('ctx',))
    assert cal.shape == (len(PROBE_CANDS),) and torch.allclose(cal, raw - null)
    assert PROBE_CANDS[int(cal.argmax())] == 'works_for', cal          # calibrated: still the stated relation, over all relations and NA
    one = llm_relation_scores(model, tok, 'Ann Bo works for Kilo Group.', ['Ann Bo works for Kilo Group.'])
    assert torch.isclose(one, llm_relation_scores(model, tok, 'Ann Bo works for Kilo Group.', ['Ann Bo works for Kilo Group.', 'x'])[:1], atol=1e-4).all()
    kg, _, P5 = prompts
    assert 'Known facts' not in probe_prompt(P5[0], ('ctx',)) and probe_prompt(P5[0]).endswith('Answer:')

def test_sweep_config_errors_and_unit_key():
    with pytest.raises(ValueError, match=r'^tau_grid item must be a finite number in \[-1, 1\], got 1.2'): DocKSConfig(mode='quick', tau_grid=(0.5, 1.2))
    with pytest.raises(ValueError, match='k_grid item'): DocKSConfig(mode='quick', k_grid=(-1,))
    with pytest.raises(ValueError, match='n_sweep_seeds'): DocKSConfig(mode='quick', n_sweep_seeds=2)        # more sweep seeds than seeds
    a, b = DocKSConfig(mode='full'), DocKSConfig(mode='full', k_grid=(), tau_grid=(), n_probe=0)
    from workbench.core import _unit_config
    assert _unit_config(_unit_cfg(a)) == _unit_config(_unit_cfg(b))   # the sweeps never invalidate the seed units

def test_pipeline_prompts_retrieve_only_training_documents():
    "Every hit in the prompts build_pipeline / build_split make is a training sentence, never from the prompt's own document; the KGs hold only training triples."
    cfg = DocKSConfig(mode='quick', n_train=10, n_test=4, kg_epochs=0, n_folds=2, k=3, k_grid=(0, 5), tau_grid=())
    pipe = build_pipeline(cfg, 5)
    train_ids, test_ids = {d['title'] for d in pipe.ds.train}, {d['title'] for d in pipe.ds.test}
    train_trip = {(d['entities'][l['h']], l['r'], d['entities'][l['t']]) for d in pipe.ds.train for l in d['labels']}
    n = 0
    for P, meta in ((pipe.train[0], pipe.train[3]), (pipe.test[0], pipe.test[3])):
        assert len(P) == len(meta) > 0
        for hp, (doc, h, t) in zip(P, meta):
            assert len(hp.hits) == 5 and all(x.doc_id in train_ids and x.doc_id != doc for x in hp.hits), (doc, [x.doc_id for x in hp.hits])
            assert all(tr in train_trip for x in hp.hits for tr in x.triples)
            n += len(hp.hits)
    assert n and not test_ids & train_ids
    assert {(h, r, t) for h, t, r in pipe.kg.g.edges(keys=True)} <= train_trip


# --- the verdict rule on made-up rows ---
FAILED = Claim('made-up precondition: DocKG adds inferred edges', 0.0, 0.0, 0.0, null=1.0, role='precondition', threshold_from='min_inferred_edges')
HOLDS = Claim('made-up precondition: the document-only head is above the type prior', 0.2, 0.15, 0.25, null=0.05, role='precondition', threshold_from='min_gap')
K_UP = {0: -0.1, 2: -0.05, 10: -0.02, 20: -0.05}                  # F1 at each swept k relative to the default k=5 (k=0 is B1's row)
TAU_UP = {0.6: -0.05, 0.7: -0.03, 0.8: 0.0, 0.9: -0.03, 1.0: -0.05}  # relative to the default tau_eq=0.8
GOOD_PROBE = [dict(seed=0, gold=['works_for'], B3=['works_for'], B4_hybrid=['works_for'] if i < 3 else [], B4_plain=[]) for i in range(6)]


def _made_up(lead, k=None, tau=None, probe=None, seeds=range(5)):
    """Rows (and the probe table) in the shape `claims` reads: F1 and Ign-F1 per (seed, variant) with B3's lead over B0-B2
    (`lead`: a number, or variant -> lead); optionally the k and tau_eq sweeps (offsets from the default) and probe pairs."""
    lead = lead if isinstance(lead, dict) else dict(B0=0.0, B1=0.0, B2=0.0, B3=lead)
    jit = lambda s, i: 0.01 * s + 0.005 * ((s + i) % 2)                # seed jitter: finite intervals
    rows = []
    for s in seeds:
        b3 = 0.4 + lead['B3'] + jit(s, 3)
        rows += [dict(seed=s, variant=v, part='main', k=5, tau_eq=None, sweep=False, f1=0.4 + a + jit(s, i), ign_f1=0.3 + a + jit(s, i))
                 for i, (v, a) in enumerate({**lead, 'prior': -0.2}.items())]
        rows += [dict(seed=s, variant='B3', part='k', k=kk, tau_eq=None, sweep=True, f1=b3 + d + jit(s, j), ign_f1=b3 + d) for j, (kk, d) in enumerate((k or {}).items())]
        rows += [dict(seed=s, variant='B3', part='tau_eq', k=5, tau_eq=t, sweep=True, f1=b3 + d + jit(s, j), ign_f1=b3 + d) for j, (t, d) in enumerate((tau or {}).items())]
    return Results('docks_rag', dict(seed=0, k=5, tau_eq=0.8), rows, seeds=list(seeds), tables=dict(probe=probe) if probe else {})


@pytest.mark.parametrize('lead,want,status', [
    (0.1, 'reproduced', ['shows'] * 6),
    (dict(B0=0.0, B1=0.1, B2=0.1, B3=0.1), 'partly', ['shows', 'no effect', 'no effect'] * 2),   # B3 beats the document alone only
    (0.0, 'not reproduced', ['no effect'] * 6),
    (-0.1, 'not reproduced', ['opposite'] * 6),
])
def test_verdict_on_made_up_rows(lead, want, status):
    "B3 − B0, B1, B2 in F1 then in Ign-F1, paired over seeds (no sweeps, no probe: those claims are absent)."
    R = _made_up(lead)
    assert [c.status for c in claims(R)] == status
    assert verdict(R) == want


def test_sweeps_and_probe_are_claims_too():
    "The inverted U in k (smallest k > 0 and the largest) and in tau_eq (both ends and both neighbours), and the probe's two comparisons."
    R = _made_up(0.1, K_UP, TAU_UP, GOOD_PROBE)
    cs = claims(R)
    assert [c.name.split(' − ')[-1] for c in cs[6:12]] == ['B3 at k=2', 'B3 at k=20', 'at tau_eq=0.6', 'at tau_eq=0.7', 'at tau_eq=0.9', 'at tau_eq=1.0']
    assert len(cs) == 14 and all(c.shows for c in cs) and verdict(R) == 'reproduced'
    cs = claims(_made_up(0.1, {**K_UP, 0: 0.3}, TAU_UP))               # k=0 (B1's inputs) is not a sweep claim, however it scores
    assert len(cs) == 12 and verdict(_made_up(0.1, {**K_UP, 0: 0.3}, TAU_UP)) == 'reproduced'


def test_a_sweep_going_the_other_way_is_partly():
    "F1 rising with k (no inverted U): the k=20 claim goes the other way; the rule has no reversal clause, so the verdict is partly."
    R = _made_up(0.1, {2: -0.05, 10: 0.02, 20: 0.05}, TAU_UP)
    cs = claims(R)
    assert cs[7].name.endswith('k=20') and cs[7].opposite and sum(c.shows for c in cs) == len(cs) - 1
    assert verdict(R) == 'partly'


@pytest.mark.parametrize('lead,want', [(0.1, 'reproduced'), (-0.1, 'not reproduced')])
def test_a_failed_precondition_makes_it_untestable(lead, want):
    R = _made_up(lead)
    R.claims = [FAILED, *claims(R)]
    assert verdict(R) == UNTESTABLE
    R.claims = [HOLDS, *claims(R)]
    assert verdict(R) == want

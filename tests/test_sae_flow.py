"Cross-checks of `workbench.interpretability.sae_flow`: matcher and chance levels, TopK SAE and its training, planted flow and the planted deactivation test, hooks on SmolLM2, steering with the platform decoder, the verdict rule (fast, CPU)."
import json, math
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from workbench.core import Results, Claim, load_results
from workbench.hooks import run_with_cache, decoder_layers
from workbench.testing import tiny_model, tiny_ids, smol, smol_tokenizer
from workbench.train import generate_ids
from workbench.interpretability.sae_flow import (Site, site, check_sites, TopKSAE, train_sae, sae_stats, sae_loss, match_features,
    predecessors, chance_scores, chance_tau, planted_flow, link_recovery, PLANTED_SITES, origin_groups, build_flow_graph, collect_activations,
    run_block, Intervention, steer, prompt_batch, continuation_nll, keyword_share, steer_settings, deactivation_test, save_sae, load_sae,
    FlowGraph, SAEFlowConfig, verdict, claims, throughput, TRAIN_TOKENS_FULL, check_blocks, norm_gain, saelens_cfg,
    paper_settings, schedule, frontier_claim, steer_preconditions, apply_interventions)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_matching_recovers_permutation(seed):
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(300, 64, generator=g)
    p = torch.randperm(300, generator=g)
    v, i = match_features(D, D[p] * torch.rand(300, 1, generator=g).add(0.5))   # permuted, rescaled rows
    assert torch.equal(p[i[:, 0]], torch.arange(300))
    assert torch.allclose(v[:, 0], torch.ones(300), atol=1e-5)
    v2, _ = match_features(D, D[torch.randperm(300, generator=g)[:150]])         # half of them missing: lower scores
    assert (v2[:, 0] < 0.999).sum() >= 140


def test_chance_levels_sit_at_the_extreme_value_estimate_and_the_shuffle_breaks_shared_directions():
    D = F.normalize(torch.randn(1024, 576, generator=torch.Generator().manual_seed(5)), dim=-1)
    ch = chance_scores(D, D, seed=2)
    n, d = 1024, 576
    ev = math.sqrt(2 * math.log(n) / d) - (math.log(math.log(n)) + math.log(4 * math.pi)) / (2 * math.sqrt(2 * math.log(n))) / math.sqrt(d)
    assert abs(ch['random'].median().item() - ev) < 0.02, (ch['random'].median(), ev)
    assert ch['shuffled'].max() < 0.4                                              # D against itself scores 1; its shuffle does not
    tau = chance_tau([ch])
    assert ch['random'].quantile(0.99) <= tau and ch['shuffled'].quantile(0.99) <= tau < 0.3
    assert chance_scores(D, D, seed=2)['random'].equal(ch['random'])              # seeded
    with pytest.raises(ValueError, match='q must be'): chance_tau([ch], q=2.0)


def test_topk_exactly_k_and_unit_decoder():
    sae = TopKSAE(48, 200, 7, seed=3)
    with torch.no_grad(): sae.b_enc.fill_(10.0)                                  # every pre-activation positive
    x = torch.randn(500, 48)
    x_hat, z = sae(x)
    assert ((z != 0).sum(-1) == 7).all()
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(200), atol=1e-6)
    assert torch.allclose(x_hat, z @ sae.W_dec + sae.b_dec)
    assert torch.allclose(sae.decode_sparse(*sae.topk(x)), x_hat, atol=1e-5)   # the training decoder gives the same x̂


def test_trained_sae_reconstructs_and_keeps_k():
    acts, _ = planted_flow(d=32, n_res=16, n_tokens=2000, seed=4)
    x = acts[PLANTED_SITES[0]]
    sae = train_sae(x, 32, 3, steps=200, batch_size=256, lr=1e-2, seed=0)
    st = sae_stats(sae, x)
    assert st['explained_variance'] > 0.9 and st['l0'] <= 3
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(32), atol=1e-5)
    assert (sae.act_scale > 0).sum() > 0 and torch.allclose(sae.freq.sum(), torch.tensor(st['l0']), atol=1e-4)


def test_auxk_switches_on_with_dead_latents():
    sae = TopKSAE(16, 64, 2, seed=0); x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0)).repeat(128, 1)
    loss, mse = sae_loss(sae, x, dead_after=10**9)
    assert torch.equal(loss, mse)                                                 # nobody dead yet: no auxiliary term
    sae.stale.fill_(10**6)                                                        # everyone silent for a long time; two inputs wake at most 4
    loss2, mse2 = sae_loss(sae, x, dead_after=1000)
    assert loss2 > mse2 and torch.allclose(mse2, mse)


def test_planted_links_and_groups():
    acts, truth = planted_flow(d=64, n_tokens=4000, seed=1)
    ks, ns = dict(zip(PLANTED_SITES, (3, 1, 1, 5))), dict(zip(PLANTED_SITES, (48, 16, 16, 80)))
    saes = {s: train_sae(acts[s], ns[s], ks[s], steps=120, batch_size=256, lr=1e-2, seed=n) for n, s in enumerate(PLANTED_SITES)}
    rec = link_recovery(saes, truth)
    assert rec['recovered'] >= 0.8, rec
    codes = {s: saes[s].encode(acts[s]) for s in PLANTED_SITES}
    og = origin_groups(codes, predecessors(saes, 1), 1)
    assert abs(sum(og.values()) - 1) < 1e-6 and og['From nowhere'] < 0.2
    chance = origin_groups(codes, predecessors(saes, 1, shuffle_seed=3), 1)
    assert chance['From nowhere'] > og['From nowhere'] + 0.3                       # shuffled decoders: the co-activation is chance
    tau = chance_tau([chance_scores(saes[PLANTED_SITES[3]].dirs, saes[s].dirs, seed=n) for n, s in enumerate(PLANTED_SITES[:3])])
    assert tau < 0.7
    R1 = PLANTED_SITES[3]
    for g, s, j, f in truth[::5]:                                                 # graphs of planted features: never empty
        i = match_features(f[None], saes[R1].dirs)[1][0, 0].item()
        G = build_flow_graph(saes, R1, i, tau=tau)
        src = (s, match_features(f[None], saes[s].dirs)[1][0, 0].item())
        assert G.edges and src in G.nodes, (g, G.nodes)                            # the planted source is linked
        assert all(G.nodes[b][0] == R1 and w >= tau for a, b, w in G.edges)       # edges into R1, above chance


def test_deactivation_test_on_planted_identity_block():
    "Block 1 writes nothing, R0 and R1 share an orthonormal dictionary: removing the top-1 predecessor (the same latent) always switches the target off, a control never does."
    m = tiny_model(fresh=True).eval().requires_grad_(False)
    with torch.no_grad(): decoder_layers(m)[1].self_attn.o_proj.weight.zero_(); decoder_layers(m)[1].mlp.down_proj.weight.zero_()
    Q = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))[0]
    def sae():
        s = TopKSAE(32, 32, 4).requires_grad_(False); s.W_dec.copy_(Q); s.W_enc.copy_(Q.T); return s
    saes = {site('R0'): sae(), site('R1'): sae()}
    acts = collect_activations(m, tiny_ids(16, 12, seed=7), ['R0', 'R1'])
    codes = {s: saes[s].encode(a) for s, a in acts.items()}
    for s in saes: sae_stats(saes[s], acts[s][:, 1:].reshape(-1, 32))
    out = deactivation_test(m, saes, acts, codes, 1, n_targets=12, max_seqs=3, min_fires=3, seed=1)
    assert len(out['rows']) == 12 and sum(out['skipped'].values()) == 0
    for r in out['rows']:
        assert r['top1'] == r['target'] and r['control'] != r['target'] and r['group'] == 'RES'
        assert r['off_top1'] == 1.0 and r['off_control'] == 0.0 and r['n_top1'] > 0 and r['n_control'] > 0
    # a broken predecessor (a different dictionary at R0): the test no longer finds a clean switch-off
    Q2 = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(9)))[0]
    saes[site('R0')].W_dec.copy_(Q2); saes[site('R0')].W_enc.copy_(Q2.T)
    codes[site('R0')] = saes[site('R0')].encode(acts[site('R0')]); sae_stats(saes[site('R0')], acts[site('R0')][:, 1:].reshape(-1, 32))
    out2 = deactivation_test(m, saes, acts, codes, 1, n_targets=12, max_seqs=3, min_fires=3, seed=1)
    assert np.mean([r['off_top1'] for r in out2['rows']]) < 0.9


def test_residual_identity_and_run_block_on_smollm2():
    model, tok = smol(), smol_tokenizer()
    ids = tok('Two plus two equals four, and the cat sat on the mat.', return_tensors='pt')['input_ids']
    _, c = run_with_cache(model, ids, names=['blocks.*.hook_resid_pre', 'blocks.*.hook_attn_out', 'blocks.*.hook_mlp_out', 'blocks.*.hook_resid_post'])
    for l in range(30):
        post = c[f'blocks.{l}.hook_resid_post']
        pre = c[f'blocks.{l}.hook_resid_pre'] + c[f'blocks.{l}.hook_attn_out'] + c[f'blocks.{l}.hook_mlp_out']
        assert (post - pre).abs().max() <= 1e-5 * post.abs().max(), l
        if l > 0: assert torch.equal(c[f'blocks.{l}.hook_resid_pre'], c[f'blocks.{l - 1}.hook_resid_post'])
    acts = collect_activations(model, ids, ['R3', 'A4', 'M4', 'R4'])
    assert torch.allclose(acts[site('R4')], acts[site('R3')] + acts[site('A4')] + acts[site('M4')], atol=1e-4 * acts[site('R4')].abs().max().item())
    out = run_block(model, 4, acts[site('R3')])                                  # block 4 alone on the cached R3
    assert torch.allclose(out, acts[site('R4')], atol=1e-4 * acts[site('R4')].abs().max().item())
    sae = TopKSAE(576, 64, 8, seed=2)
    with steer(model, {site('A4'): sae}, [Intervention('A4', 3, 0.0, 'scale')]): full = collect_activations(model, ids, ['R4'])[site('R4')]
    alone = run_block(model, 4, acts[site('R3')], [(site('A4').hook, lambda x, n: x - sae.encode(x)[..., 3:4] * sae.W_dec[3].detach())])
    assert torch.allclose(alone, full, atol=1e-4 * full.abs().max().item())      # hooks inside the block act as in the full pass


def test_strength_zero_leaves_logits_unchanged_on_smollm2():
    model, tok = smol(), smol_tokenizer()
    ids = tok('The weather in the valley was', return_tensors='pt')['input_ids']
    saes = {site(s): TopKSAE(576, 64, 8, seed=n) for n, s in enumerate(('R5', 'A6', 'M7'))}
    for s in saes.values(): s.act_scale.fill_(3.0)
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with steer(model, saes, [Intervention('R5', 1, 0.0), Intervention('A6', 2, 0.0, 'push'), Intervention('M7', 3, 1.0, 'scale')]):
            same = model(input_ids=ids).logits
        with steer(model, saes, [Intervention('R5', 1, 8.0)]):
            moved = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(same, base) and torch.equal(after, base)
    assert not torch.allclose(moved, base)


def test_bad_sites_give_clear_errors():
    m = tiny_model()
    saes = {site('R1'): TopKSAE(32, 16, 2)}
    with pytest.raises(ValueError, match='bad site name'): site('L3')
    with pytest.raises(ValueError, match='bad site name'): site('blocks.1.hook_resid_post')
    with pytest.raises(ValueError, match='site kind must be one of'): Site(1, 'resid_pre')
    with pytest.raises(ValueError, match='out of range'): check_sites(m, ['R2'])
    with pytest.raises(ValueError, match='out of range'):
        with steer(m, saes, [Intervention('R7', 0, 1.0)]): pass
    with pytest.raises(ValueError, match='no SAE at site A1'):
        with steer(m, saes, [Intervention('A1', 0, 1.0)]): pass
    with pytest.raises(ValueError, match='out of range'): collect_activations(m, tiny_ids(), ['M9'])
    with pytest.raises(ValueError, match="needs R0's SAE"): deactivation_test(m, {site('R1'): saes[site('R1')], site('A1'): TopKSAE(32, 16, 2)}, {}, {}, 1)


class _Tok:
    pad_token_id = 0
    def __call__(self, p, add_special_tokens=False): return dict(input_ids=list(p))


def test_batched_left_padded_generation_steered_matches_single():
    m, ids = tiny_model(), tiny_ids(3, 8, seed=5)
    saes = {site('R0'): TopKSAE(32, 16, 2, seed=1)}; saes[site('R0')].act_scale.fill_(4.0)
    rows = [ids[0, :8].tolist(), ids[1, :3].tolist(), ids[2, :5].tolist()]
    pid, pm = prompt_batch(_Tok(), rows)
    with steer(m, saes, [Intervention('R0', 5, 2.0)]):
        both = generate_ids(m, pid, 5, attention_mask=pm)
        one = [generate_ids(m, torch.tensor([r]), 5)[0, -5:] for r in rows]
        plain = generate_ids(m, torch.tensor([rows[0]]), 5)[0, -5:]
    assert all(torch.equal(both[b, -5:], o) for b, o in enumerate(one))
    nll = continuation_nll(m, both, pm, 8)
    for b, r in enumerate(rows):
        full = torch.tensor([r + both[b, -5:].tolist()]); lp = m(input_ids=full).logits[0, :-1].log_softmax(-1)
        assert torch.allclose(nll[b], -lp[len(r) - 1:].gather(-1, full[0, len(r):, None]).mean(), atol=1e-4)
    assert keyword_share('a sword! no swords', ['sword']) == 0.25


def test_flow_and_single_layer_steering_push_equally():
    saes = {site(s): TopKSAE(32, 16, 2, seed=n) for n, s in enumerate(('R0', 'R1', 'A1'))}
    saes[site('R1')].act_scale.fill_(3.0)
    G = FlowGraph(); G.add(site('R0'), 4); G.add(site('A1'), 2); G.add(site('R1'), 7)
    for sign in (1.0, -1.0):
        st = steer_settings(saes, site('R1'), 7, G, (2.0, 8.0), sign)
        for (m1, a1, single), (m2, a2, flow) in zip(st[::2], st[1::2]):
            assert (m1, m2) == ('single', 'flow') and a1 == a2
            push = lambda ivs: sum(abs(iv.strength) * saes[site(iv.site)].W_dec[iv.latent].norm().item() for iv in ivs)
            assert math.isclose(push(single), push(flow), rel_tol=1e-5) and math.isclose(push(single), a1 * 3.0, rel_tol=1e-5)
            assert [str(iv.site) for iv in flow] == ['R0', 'R1'] and all(np.sign(iv.strength) == sign for iv in single + flow)


def test_saelens_layout_round_trip(tmp_path):
    acts, _ = planted_flow(d=24, n_res=16, n_tokens=1500, seed=2)
    x = acts[PLANTED_SITES[0]]
    sae = train_sae(x, 40, 3, steps=40, batch_size=256, lr=1e-2, seed=4)     # trained: biases and decoder away from their init
    assert sae.b_dec.abs().sum() > 0 and sae.b_enc.abs().sum() > 0
    sae.hook_name = 'blocks.7.hook_mlp_out'
    save_sae(sae, tmp_path/'M7')
    assert sorted(p.name for p in (tmp_path/'M7').iterdir()) == ['cfg.json', 'sae_weights.safetensors']
    cfg = json.loads((tmp_path/'M7'/'cfg.json').read_text())
    assert (cfg['architecture'], cfg['d_in'], cfg['d_sae'], cfg['k'], cfg['metadata']['hook_name']) == ('topk', 24, 40, 3, 'blocks.7.hook_mlp_out')
    from safetensors.torch import load_file
    w = load_file(str(tmp_path/'M7'/'sae_weights.safetensors'))
    assert {n: tuple(t.shape) for n, t in w.items()} == dict(W_enc=(24, 40), b_enc=(40,), W_dec=(40, 24), b_dec=(24,))   # SAELens' names and shapes
    back = load_sae(tmp_path/'M7')
    assert back.hook_name == 'blocks.7.hook_mlp_out' and back.model_name is None and (back.d_in, back.d_sae, back.k) == (24, 40, 3)
    for n in ('W_enc', 'b_enc', 'W_dec', 'b_dec'): assert torch.equal(getattr(back, n), getattr(sae, n))
    z = sae.encode(x[:200])
    assert torch.equal(back.encode(x[:200]), z) and torch.equal(back.decode(z), sae.decode(z)) and torch.equal(back(x[:200]).x_hat, sae(x[:200]).x_hat)
    save_sae(back, tmp_path/'again'); assert torch.equal(load_sae(tmp_path/'again').encode(x[:50]), z[:50])   # a reloaded SAE saves again
    with pytest.raises(ValueError, match='hook name'): save_sae(TopKSAE(4, 8, 2), tmp_path/'nohook')
    with pytest.raises(FileNotFoundError, match='not an SAE folder'): load_sae(tmp_path/'nohook')
    cfg['architecture'] = 'jumprelu'; (tmp_path/'M7'/'cfg.json').write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expected 'topk'"): load_sae(tmp_path/'M7')


def _fake(off_top1, off_control, flow, single, pre=()):
    "Made-up causal and steering tables (layers 7 and 8; one theme and direction at alpha 4 and 8); `pre`: precondition claims."
    C = [dict(layer=l, off_top1=a, off_control=b) for l in (7, 8) for a, b in zip(off_top1, off_control)]
    P = [dict(theme='war', direction='on', method=m, alpha=a, prompt=p, gain=g * (a / 4))
         for a in (4.0, 8.0) for m, gs in (('flow', flow), ('single', single)) for p, g in enumerate(gs)]
    return Results('sae_flow', dict(mode='quick'), [dict(kind='x')], tables=dict(causal=C, prompts=P), claims=list(pre))


UP, FLAT = [0.9, 0.8, 0.7, 0.95, 0.85, 0.9, 0.8], [0.1, 0.2, 0.1, 0.15, 0.1, 0.2, 0.1]
CASES = {'reproduced': (UP, FLAT, UP, FLAT),          # deactivation and flow steering both show
         'partly': (UP, FLAT, FLAT, UP),              # deactivation shows, flow steering goes the other way
         'not reproduced': (FLAT, UP, FLAT, FLAT),    # the control switches targets off more; steering no different
         'other way': (FLAT, UP, FLAT, UP)}           # every part the other way


def _precondition(holds: bool) -> Claim:
    "A made-up precondition (the residual SAEs explain at least the declared 0.6 of the variance)."
    est = 0.8 if holds else 0.4
    return Claim('explained variance of the residual SAEs (made up)', est, est - 0.05, est + 0.05, null=0.6, role='precondition', threshold_from='min_explained_variance')


@pytest.mark.parametrize('case,want', [('reproduced', 'reproduced'), ('partly', 'partly'), ('not reproduced', 'not reproduced'),
                                       ('other way', 'not reproduced')])
def test_verdict_rule_on_made_up_rows(case, want):
    assert verdict(_fake(*CASES[case])) == want


def test_claims_per_layer_and_alpha_star():
    cl = claims(_fake(*CASES['partly']))
    assert [c.name.split(':')[0] for c in cl] == ['R7', 'R8', 'war on'] and 'alpha*=8' in cl[-1].name   # alpha* = single's best
    assert cl[-1].opposite and all(c.shows for c in cl[:2])
    assert all(c.opposite for c in claims(_fake(*CASES['other way'])))


@pytest.mark.parametrize('case', list(CASES))
def test_failed_precondition_makes_it_untestable(case):
    assert verdict(_fake(*CASES[case], pre=[_precondition(False)])) == 'untestable here'
    assert verdict(_fake(*CASES[case], pre=[_precondition(True)])) == verdict(_fake(*CASES[case]))   # one that holds changes nothing


def test_config_sizes_and_checks():
    full = SAEFlowConfig(mode='full')
    assert full.layers == [6, 7, 8, 9, 10, 11] and len(full.sites) == 18 and full.n_targets >= 100 and full.n_prompts >= 30
    assert SAEFlowConfig(mode='full', seed=1).seed == 1
    assert full.n_train_tokens == TRAIN_TOKENS_FULL and full.n_train_tokens % (full.batch_windows * (full.seq_len - 1)) == 0   # whole updates
    assert SAEFlowConfig(mode='full', n_train_tokens=2_000_000).n_train_tokens == 2_000_000                                  # the one field that sets the training tokens
    with pytest.raises(ValueError, match='themes must be one of'): SAEFlowConfig(themes=('jazz',))
    with pytest.raises(ValueError, match='n_layers must be an int'): SAEFlowConfig(n_layers=1)


def test_recorded_run_reports_every_layer_and_prompt():
    "The committed full run has an SAE at every site, a deactivation row per target layer and every prompt in every steering setting."
    r = load_results('sae_flow')
    assert r.mode == 'full'
    df = r.df
    assert set(df[df.kind == 'sae'].site) == {str(s) for s in SAEFlowConfig(**{k: r.config[k] for k in ('mode', 'first_layer', 'n_layers')}).sites}
    ca = df[df.kind == 'causal']
    assert len(ca) == r.config['n_layers'] - 1                                    # every target layer reported on its own
    assert (ca.n_targets + ca.skipped_never_co_active + ca.skipped_no_control <= ca.candidates).all()
    assert len([c for c in r.claims if c.name.startswith('R')]) == len(ca[ca.n_targets > 0])
    if 'theme_prompts' in r.tables:                                                  # the paper's protocol (this design)
        st = r.table('theme_prompts')
        assert st.groupby(['theme', 'direction', 'arm', 'method', 'knob']).prompt.nunique().min() == r.config['n_prompts']
        assert {c.threshold_from for c in r.claims if c.is_precondition} == {'min_room', 'min_move'}
    else:                                                                            # a record of the earlier design
        st = r.table('prompts')
        assert st.groupby(['theme', 'direction', 'method', 'alpha']).prompt.nunique().min() == r.config['n_prompts']


def test_flow_explorer_slider_keeps_tau_with_one_edge():
    from workbench.viz import FeatureGraph, FeatureFlowExplorer as FlowExplorer
    g = FeatureGraph([(8, 1, 'R8 #1'), (9, 2, 'R9 #2')], [(0, 1, 0.2419)])        # one edge: the platform slider had min = max = 0.2419
    fe = FlowExplorer(g, threshold=0.18)
    assert abs(fe.threshold.value - 0.18) < 1e-9 and fe.threshold.min <= 0.0 and fe.threshold.max >= 1.0
    assert sum(t.mode == 'lines' for t in fe.fig.data) == 1                            # the edge clears tau, so it is drawn
    fe.threshold.value = 0.25
    assert sum(t.mode == 'lines' for t in fe.fig.data) == 0                            # and hides above its weight
    assert abs(FlowExplorer(g, threshold=1.3).threshold.value - 1.3) < 1e-9        # a threshold above every cosine is kept, not clamped


def test_throughput_from_a_training_record():
    t = throughput(dict(tokens=200_000, wall_s=500.0, train_s=490.0, forward_s=150.0, forward_tokens=201_000, n_saes=18, threads=1))
    assert t['s_per_100k'] == 250.0 and t['sae_s_per_100k'] == 175.0 and t['projected_s'] == 5000 and abs(t['forward_tok_s'] - 1340.0) < 0.1
    assert 'forward_tok_s' not in throughput(dict(tokens=1000, train_s=10.0))       # an older record without the forward timing


# SAELens 6 (sae_lens/saes/sae.py, sae_lens/loading/pretrained_sae_loaders.py): `SAE.load_from_disk` reads cfg.json, treats it as a
# pre-6.0 file unless `metadata.sae_lens_version` (or a top-level `sae_lens_version`) is >= 6.0.0-rc.0, builds `TopKSAEConfig` from the
# top-level keys that are its fields and `SAEMetadata(**cfg['metadata'])`; a pre-6.0 file's hook and model names are read from the top level.
SAELENS_TOPK_FIELDS = {'d_in', 'd_sae', 'dtype', 'device', 'apply_b_dec_to_input', 'normalize_activations', 'reshape_activations', 'k',
                       'rescale_acts_by_decoder_norm'}


def _saelens_names(cfg: dict) -> dict:
    "What SAELens 6's loader would take as the SAE's metadata from a cfg.json (its version test and key handling, without the package)."
    from packaging.version import Version
    version = cfg.get('sae_lens_version') or (cfg.get('metadata') or {}).get('sae_lens_version')
    if not version or Version(version) < Version('6.0.0-rc.0'): return {k: cfg.get(k) for k in ('model_name', 'hook_name')}   # pre-6.0 path
    return dict(cfg['metadata'])


def test_saelens_metadata_carries_hook_and_model_names(tmp_path):
    sae = TopKSAE(16, 32, 4, seed=1)
    save_sae(sae, tmp_path/'R5', 'blocks.5.hook_resid_post', 'HuggingFaceTB/SmolLM2-135M-Instruct', 64, extra=dict(key='x'))
    cfg = json.loads((tmp_path/'R5'/'cfg.json').read_text())
    assert SAELENS_TOPK_FIELDS <= set(cfg) and cfg['architecture'] == 'topk' and 'meta' not in cfg
    md = _saelens_names(cfg)                                                          # the 6.x path: names survive a SAELens load
    assert md['hook_name'] == 'blocks.5.hook_resid_post' and md['model_name'] == 'HuggingFaceTB/SmolLM2-135M-Instruct'
    assert md['context_size'] == 64 and md['hook_head_index'] is None and md['prepend_bos'] is False
    assert cfg['workbench'] == dict(key='x')                                          # ours, beside SAELens' keys (which it ignores)
    old = dict(cfg); old.pop('metadata'); old['meta'] = cfg['metadata']; old['meta'].pop('sae_lens_version')
    assert _saelens_names(old)['hook_name'] is None                                   # the earlier layout: SAELens lost the hook name
    assert saelens_cfg(sae, 'blocks.5.hook_resid_post')['metadata']['model_name'] is None


def test_load_sae_reads_the_new_and_the_old_layout(tmp_path):
    sae = TopKSAE(16, 32, 4, seed=2); x = torch.randn(50, 16)
    save_sae(sae, tmp_path/'new', 'blocks.2.hook_attn_out', 'some/model')
    cfg = json.loads((tmp_path/'new'/'cfg.json').read_text())
    (tmp_path/'old').mkdir(); (tmp_path/'old'/'sae_weights.safetensors').write_bytes((tmp_path/'new'/'sae_weights.safetensors').read_bytes())
    old = {k: v for k, v in cfg.items() if k not in ('metadata', 'rescale_acts_by_decoder_norm')}      # as save_sae wrote it before
    old['meta'] = dict(model_name='some/model', hook_name='blocks.2.hook_attn_out', hook_layer=2, hook_head_index=None, context_size=None,
                       prepend_bos=False, dataset_path=None)
    (tmp_path/'old'/'cfg.json').write_text(json.dumps(old))
    for d in ('new', 'old'):
        back = load_sae(tmp_path/d)
        assert (back.hook_name, back.model_name) == ('blocks.2.hook_attn_out', 'some/model'), d
        assert torch.equal(back.encode(x), sae.encode(x))


@pytest.mark.parametrize('arch', ['qwen2', 'gemma3'])
def test_run_block_matches_the_full_pass_on_other_architectures(arch):
    "Block by block on a tiny Qwen2 and a tiny Gemma-3 (70 tokens: Gemma-3's sliding layers see 32), hooks inside the block as in the full pass."
    from workbench.models import load_model
    from workbench.testing import tiny_folder
    m = load_model(tiny_folder(arch)); ids = torch.randint(0, 1000, (2, 70), generator=torch.Generator().manual_seed(0))
    acts = collect_activations(m, ids, ['R0', 'R1', 'A2', 'R2', 'R3'])
    for l in (1, 2, 3):
        out, ref = run_block(m, l, acts[site(f'R{l - 1}')]), acts[site(f'R{l}')]
        assert torch.allclose(out, ref, atol=1e-5 * ref.abs().max().item()), (arch, l)
    seen = {}
    run_block(m, 2, acts[site('R1')], [(site('A2').hook, lambda x, n: seen.setdefault(n, x))])
    assert torch.allclose(seen[site('A2').hook], acts[site('A2')], atol=1e-5 * acts[site('A2')].abs().max().item())
    if arch == 'gemma3':                                                              # the sliding window matters: a plain causal mask differs
        blk = decoder_layers(m)[1]; kind, blk.attention_type = blk.attention_type, 'full_attention'
        try: assert not torch.allclose(run_block(m, 1, acts[site('R0')]), acts[site('R1')], atol=1e-3)
        finally: blk.attention_type = kind


def test_run_block_names_the_architectures_it_supports():
    import transformers
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).eval()
    with pytest.raises(ValueError, match='rotary embeddings .*Llama, Qwen2, Mistral, Gemma 3.*GPT2LMHeadModel'): run_block(gpt2, 0, torch.randn(1, 5, 32))


def test_norm_gain_reads_each_parametrisation():
    "Llama's RMSNorm scales by its weight, Gemma's by 1 + weight: the logit lens takes the gain the model applies."
    from workbench.models import load_model
    from workbench.testing import tiny_folder
    m = tiny_model(fresh=True)
    with torch.no_grad(): m.model.norm.weight.uniform_(0.5, 2.0)
    assert torch.equal(norm_gain(m), m.model.norm.weight.float())
    g = load_model(tiny_folder('gemma3'))
    with torch.no_grad(): g.model.norm.weight.uniform_(-0.5, 0.5)
    assert torch.allclose(norm_gain(g), 1 + g.model.norm.weight.float(), rtol=1e-4)


def test_blocks_and_model_come_from_the_config():
    assert SAEFlowConfig().model == 'smollm2-135m' and SAEFlowConfig(first_layer=25, n_layers=5).layers == [25, 26, 27, 28, 29]
    assert check_blocks(SAEFlowConfig(first_layer=25, n_layers=5), smol()) == 30
    with pytest.raises(ValueError, match='has 30 blocks'): check_blocks(SAEFlowConfig(first_layer=26, n_layers=5), smol())
    with pytest.raises(ValueError, match='unknown model'): SAEFlowConfig(model='nowhere/at/all')
    with pytest.raises(ValueError, match='needs a pretrained one'): SAEFlowConfig(model='tiny-llama')


def test_paper_protocol_rescales_every_node_with_one_r_and_schedules_the_push():
    "Switching off rescales the start feature (single) or every graph node at blocks <= l (cumulative) with the same r; on adds s x mean activation."
    saes = {site(s): TopKSAE(32, 16, 2, seed=n) for n, s in enumerate(('R0', 'A1', 'M1', 'R1', 'R2'))}
    for m in saes.values(): m.act_scale.fill_(3.0)
    G = FlowGraph(); G.add(site('R1'), 7); G.add(site('R0'), 4); G.add(site('M1'), 2); G.add(site('R2'), 5)
    cfg = SAEFlowConfig(r_grid=(0.0, -4.0), s_grid=(2.0, 8.0))
    off = paper_settings(site('R1'), 7, G, 'off', cfg)
    assert [(m, r) for m, r, _ in off] == [('single', 0.0), ('cumulative', 0.0), ('single', -4.0), ('cumulative', -4.0)]
    cum = off[3][2]
    assert sorted(str(iv.site) for iv in cum) == ['M1', 'R0', 'R1'] and all(iv.mode == 'scale' and iv.strength == -4.0 for iv in cum)
    x = torch.randn(3, 4, 32)
    z = saes[site('R1')].encode(x)[..., 7:8]
    out = apply_interventions(saes, [iv for iv in cum if str(iv.site) == 'R1'], x)
    assert torch.allclose(out, x + (-4.0 - 1) * z * saes[site('R1')].W_dec[7], atol=1e-5)     # h + (r - 1) z d
    on = {(m, s): ivs for m, s, ivs in paper_settings(site('R1'), 7, G, 'on', cfg)}
    assert set(on) == {(m, s) for m in ('single', 'constant', 'exponential') for s in (2.0, 8.0)}
    assert [iv.strength for iv in on['constant', 8.0]] == [8.0] * 3 and all(iv.mode == 'add' for iv in on['constant', 8.0])
    assert [round(iv.strength, 6) for iv in on['exponential', 8.0]] == [round(8 * math.exp(-0.05 * l), 6) for l in (0, 1, 1)]
    assert schedule(8.0, 0, 'exponential') == 8.0 and schedule(8.0, 20, 'exponential') < schedule(8.0, 10, 'exponential')
    with pytest.raises(ValueError, match='direction must be one of'): paper_settings(site('R1'), 7, G, 'up', cfg)
    with pytest.raises(ValueError, match='r_grid'): SAEFlowConfig(r_grid=(1.5,))


def test_module_threshold_keeps_module_links_below_the_residual_one():
    acts, truth = planted_flow(d=64, n_tokens=4000, seed=1)
    ks, ns = dict(zip(PLANTED_SITES, (3, 1, 1, 5))), dict(zip(PLANTED_SITES, (48, 16, 16, 80)))
    saes = {s: train_sae(acts[s], ns[s], ks[s], steps=120, batch_size=256, lr=1e-2, seed=n) for n, s in enumerate(PLANTED_SITES)}
    R1 = PLANTED_SITES[3]
    for g, s, j, f in truth[::5]:
        i = match_features(f[None], saes[R1].dirs)[1][0, 0].item()
        strict, loose = build_flow_graph(saes, R1, i, tau=0.99), build_flow_graph(saes, R1, i, tau=0.99, tau_module=0.0)
        assert len(loose.nodes) >= len(strict.nodes)
        assert all(sa.kind != 'resid_post' or w >= 0.99 for (a, b, w) in loose.edges for sa in [loose.nodes[a][0]])
        assert sum(loose.nodes[a][0].kind != 'resid_post' for a, b, w in loose.edges) == 2   # both modules, at any cosine


def _frontier_table(gain_cum, gain_single, cost=(0.1, 0.3, 0.6), n=12, seed=0):
    "Made-up per-prompt records: both methods at the same costs, gains scaled per knob."
    rng = np.random.default_rng(seed)
    rows = []
    for m, g in (('cumulative', gain_cum), ('single', gain_single)):
        for k, c in zip((0.0, -2.0, -8.0), cost):
            for p in range(n):
                rows.append(dict(theme='love', direction='off', arm='paper', method=m, knob=k, prompt=p,
                                 cost=c + 0.02 * rng.standard_normal(), gain=g * c + 0.01 * rng.standard_normal(), cos=0.3))
    return __import__('pandas').DataFrame(rows)


def test_frontier_claim_at_matched_coherence():
    cfg = dict(match_nll=0.25)
    c = frontier_claim(_frontier_table(0.5, 0.1), cfg, 'love', 'off', 'paper', 'cumulative', 'single')
    assert c.shows and abs(c.estimate - 0.4 * 0.25) < 0.02 and 'ΔNLL 0.250' in c.name     # (0.5 - 0.1) x cost at the match
    same = frontier_claim(_frontier_table(0.3, 0.3), cfg, 'love', 'off', 'paper', 'cumulative', 'single')
    assert not same.shows and same.lo < 0 < same.hi
    low = frontier_claim(_frontier_table(0.5, 0.1, cost=(0.02, 0.05, 0.1)), cfg, 'love', 'off', 'paper', 'cumulative', 'single')
    import re
    at = float(re.search(r'ΔNLL ([0-9.]+)', low.name)[1])
    assert 0.04 < at < 0.06                                                           # half the smallest arm's largest cost
    assert frontier_claim(_frontier_table(0.1, 0.5), cfg, 'love', 'off', 'paper', 'cumulative', 'single').opposite


def test_steering_preconditions_fail_at_the_floor():
    base = [dict(theme='love', direction=d, arm='base', method='base', knob=0.0, prompt=p, cos=c, gain=0.0, cost=0.0)
            for d, c in (('on', 0.10), ('off', 0.11)) for p in range(10)]
    single = [dict(theme='love', direction=d, arm='paper', method='single', knob=k, prompt=p, cos=0.2, gain=g, cost=0.1)
              for d in ('on', 'off') for p in range(10) for k, g in ((1.0, 0.0), (4.0, 0.05 + 0.001 * p))]
    import pandas as pd
    pre = steer_preconditions(pd.DataFrame(base + single), {'love': 0.40}, dict(min_room=0.02, min_move=0.01))
    held = {c.name.split(':')[0] + ' ' + c.threshold_from: c.holds for c in pre}
    assert held == {'love on min_room': True, 'love on min_move': True, 'love off min_room': False, 'love off min_move': True}

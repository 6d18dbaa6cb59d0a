"Cross-checks of `workbench.interpretability.sae_flow`: matcher, TopK SAE, planted flow, hooks on SmolLM2, steering (fast, CPU)."
import pytest
import torch
import torch.nn.functional as F
from workbench.hooks import run_with_cache
from workbench.testing import tiny_model, tiny_ids, smol, smol_tokenizer
from workbench.interpretability.sae_flow import (Site, site, check_sites, TopKSAE, train_sae, sae_stats, match_features,
    predecessors, planted_flow, link_recovery, PLANTED_SITES, origin_groups, build_flow_graph, collect_activations,
    Intervention, steer, generate_batch, keyword_rate)


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


def test_topk_exactly_k_and_unit_decoder():
    sae = TopKSAE(48, 200, 7, seed=3)
    with torch.no_grad(): sae.b_enc.fill_(10.0)                                  # every pre-activation positive
    x = torch.randn(500, 48)
    x_hat, z = sae(x)
    assert ((z != 0).sum(-1) == 7).all()
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(200), atol=1e-6)
    assert torch.allclose(x_hat, z @ sae.W_dec + sae.b_dec)


def test_trained_sae_reconstructs_and_keeps_k():
    acts, _ = planted_flow(d=32, n_res=16, n_tokens=2000, seed=4)
    x = acts[PLANTED_SITES[0]]
    sae = train_sae(x, 32, 3, steps=100, batch_size=256, lr=1e-2, seed=0)
    st = sae_stats(sae, x)
    assert st['explained_variance'] > 0.9 and st['l0'] <= 3
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(32), atol=1e-5)
    assert (sae.act_scale > 0).sum() > 0


def test_planted_links_and_groups():
    acts, truth = planted_flow(d=64, n_tokens=4000, seed=1)
    ks, ns = dict(zip(PLANTED_SITES, (3, 1, 1, 5))), dict(zip(PLANTED_SITES, (48, 16, 16, 80)))
    saes = {s: train_sae(acts[s], ns[s], ks[s], steps=120, batch_size=256, lr=1e-2, seed=n) for n, s in enumerate(PLANTED_SITES)}
    rec = link_recovery(saes, truth)
    assert rec['recovered'] >= 0.8, rec
    codes = {s: saes[s].encode(acts[s]) for s in PLANTED_SITES}
    og = origin_groups(codes, predecessors(saes, 1), 1)
    assert abs(sum(og.values()) - 1) < 1e-6 and og['From nowhere'] < 0.2
    G = build_flow_graph(saes, 'R1', 0, tau=0.5)
    assert all(G.nodes[b][0] == Site(1, 'resid_post') for a, b, w in G.edges)   # DAG into R1


def test_residual_identity_on_smollm2():
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


def test_strength_zero_leaves_logits_unchanged_on_smollm2():
    model, tok = smol(), smol_tokenizer()
    ids = tok('The weather in the valley was', return_tensors='pt')['input_ids']
    saes = {site(s): TopKSAE(576, 64, 8, seed=n) for n, s in enumerate(('R5', 'A6', 'M7'))}
    for s in saes.values(): s.act_scale.fill_(3.0)
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with steer(model, saes, [Intervention('R5', 1, 0.0), Intervention('A6', 2, 0.0), Intervention('M7', 3, 1.0, 'scale')]):
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


def test_batched_generation_steered_matches_single():
    m, ids = tiny_model(), tiny_ids(3, 6, seed=5)
    saes = {site('R0'): TopKSAE(32, 16, 2, seed=1)}; saes[site('R0')].act_scale.fill_(4.0)
    with steer(m, saes, [Intervention('R0', 5, 2.0)]):
        both = generate_batch(m, ids, 5)
        one = torch.cat([generate_batch(m, ids[b:b + 1], 5) for b in range(3)])
    assert torch.equal(both, one)
    assert keyword_rate(['a sword!', 'no'], ['sword']) == 0.5

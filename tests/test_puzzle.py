"Cross-checks of workbench.compression.puzzle on a tiny Llama: assembly, cache handling, the MIP against brute force, budgets."
import itertools
import numpy as np
import pytest
import torch
from workbench.models import tiny_llama
from workbench.compression.puzzle import (AttnVariant, FFNVariant, BlockLibrary, build_library, cache_block_io, measure_costs,
                                          assemble_child, arch_of, arch_cost, arch_kl, solve_mip, puzzle_choice, uniform_choice,
                                          greedy_choice, drop_layers_choice, block_influence, kl_div, run_from)

A = [AttnVariant(), AttnVariant('gqa', 1), AttnVariant('linear'), AttnVariant('noop')]
F = [FFNVariant(), FFNVariant('pruned', 24), FFNVariant('linear'), FFNVariant('noop')]


@pytest.fixture(scope='module')
def setup():
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=97, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, max_len=64, attn='sdpa').eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    calib_ids, eval_ids = torch.randint(0, 97, (6, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
    calib, ev = cache_block_io(m, calib_ids), cache_block_io(m, eval_ids)
    with torch.no_grad(): logits = m(input_ids=eval_ids).logits
    lib = build_library(m, A, F, calib, {i: ev[i]['resid_pre'] for i in ev}, logits, bld_steps=2, batch_size=3)
    lib.cost_attn, lib.cost_ffn, lib.overhead = np.array([1.0, 0.7, 0.3, 0.]), np.array([2.0, 1.2, 0.4, 0.]), 0.5
    return m, lib, calib, eval_ids, logits


def test_parent_everywhere_reproduces_parent_logits(setup):
    m, lib, _, ids, logits = setup
    zero = np.zeros(lib.n_layers, int)
    child = assemble_child(m, lib, arch_of(lib, zero, zero))
    with torch.no_grad(): assert torch.equal(child(input_ids=ids).logits, m(input_ids=ids).logits)
    assert (lib.kl_attn[:, 0] == 0).all() and (lib.kl_ffn[:, 0] == 0).all()
    assert (lib.kl_attn[:, 1:] > 0).all() and (lib.kl_ffn[:, 1:] > 0).all()      # every real change moves the output
    # the replay from the cached residual with a swapped-in parent sub-block is the parent too
    assert torch.allclose(run_from(m, 0, m.model.embed_tokens(ids)), logits, atol=1e-5)


def test_child_with_attention_free_layers_decodes_with_cache(setup):
    "Layer 0 without attention: cached decoding must give the same logits as recomputing the whole prefix."
    m, lib, _, ids, _ = setup
    arch = [(AttnVariant('noop'), FFNVariant('pruned', 24)), (AttnVariant('gqa', 1), FFNVariant()), (AttnVariant('linear'), FFNVariant('noop'))]
    child = assemble_child(m, lib, arch)
    x = ids[:1, :10]
    with torch.no_grad():
        out = child(input_ids=x[:, :8], use_cache=True)
        for t in range(8, 10): out = child(input_ids=x[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        full = child(input_ids=x).logits[:, -1]
    assert torch.allclose(out.logits[:, -1], full, atol=1e-5)
    assert child is not m and m.model.layers[0].self_attn.__class__.__name__ == 'LlamaAttention'   # the parent is untouched


def _brute(qa, qf, ca, cf, budget, overhead=0.):
    L, best = len(qa), (np.inf, None)
    for ia in itertools.product(range(qa.shape[1]), repeat=L):
        for if_ in itertools.product(range(qf.shape[1]), repeat=L):
            c = overhead + ca[list(ia)].sum() + cf[list(if_)].sum()
            q = qa[range(L), ia].sum() + qf[range(L), if_].sum()
            if c <= budget and q < best[0]: best = (q, (ia, if_))
    return best


@pytest.mark.parametrize('seed', range(4))
def test_mip_matches_brute_force_on_3_layer_toy(seed):
    r = np.random.default_rng(seed)
    qa, qf, ca, cf = r.random((3, 4)), r.random((3, 3)), r.random(4), r.random(3)
    qa[:, 0] = qf[:, 0] = 0                                                          # the parent: zero KL, (usually) the most cost
    lo, hi = 0.3 + 3 * (ca.min() + cf.min()), 0.3 + 3 * (ca.max() + cf.max())
    for budget in np.linspace(lo, hi, 5):
        ia, if_ = solve_mip(qa, qf, ca, cf, budget, overhead=0.3)
        q = qa[range(3), ia].sum() + qf[range(3), if_].sum()
        assert 0.3 + ca[ia].sum() + cf[if_].sum() <= budget + 1e-9
        assert abs(q - _brute(qa, qf, ca, cf, budget, 0.3)[0]) < 1e-9


def test_every_child_respects_its_budget_and_mip_is_best(setup):
    m, lib, calib, _, _ = setup
    L, zero = lib.n_layers, np.zeros(lib.n_layers, int)
    parent_ms, prev = arch_cost(lib, zero, zero), -1.
    for frac in (1.0, 0.8, 0.6, 0.45, 0.3):
        b = frac * parent_ms
        got = {'puzzle': puzzle_choice(lib, b), 'uniform': uniform_choice(lib, b), 'greedy': greedy_choice(lib, b),
               'drop': drop_layers_choice(lib, b, block_influence(calib))}
        for name, (ia, if_) in got.items():
            assert arch_cost(lib, ia, if_) <= b + 1e-9, name
            assert arch_kl(lib, *got['puzzle']) <= arch_kl(lib, ia, if_) + 1e-9, name
        kl = arch_kl(lib, *got['puzzle'])
        assert kl >= prev - 1e-12; prev = kl                                    # optimum never improves as the budget tightens
    ia, if_ = puzzle_choice(lib, 1e9)
    assert (ia == 0).all() and (if_ == 0).all()                               # unlimited budget: the parent


def test_infeasible_budget_raises(setup):
    _, lib, _, _, _ = setup
    with pytest.raises(ValueError, match='infeasible'): puzzle_choice(lib, lib.overhead - 0.1)
    with pytest.raises(ValueError, match='infeasible'): solve_mip(np.zeros((3, 2)), np.zeros((3, 2)), [1., 1.], [1., 1.], 5.9)
    with pytest.raises(ValueError, match='memory|no architecture'):
        solve_mip(np.zeros((2, 2)), np.zeros((2, 2)), [1., 0.], [1., 0.], 10., mem_attn=[1., 1.], mem_ffn=[1., 1.], memory_budget=1.)


def test_measure_costs_fills_library(setup):
    m, lib, _, _, _ = setup
    lib2 = BlockLibrary(lib.attn, lib.ffn, lib.modules, lib.kl_attn, lib.kl_ffn)
    t = measure_costs(m, lib2, prompt_len=8, new_tokens=2, repeats=1)
    assert lib2.overhead > 0 and lib2.cost_attn[-1] == 0 and lib2.cost_ffn[-1] == 0 and (lib2.cost_attn >= 0).all()
    assert set(t) == {('noop', 'noop'), *((a.name, 'noop') for a in A[:-1]), *(('noop', f.name) for f in F[:-1])}
    with pytest.raises(ValueError, match='no-op'):
        measure_costs(m, BlockLibrary(A[:2], F[:2], lib.modules, lib.kl_attn[:, :2], lib.kl_ffn[:, :2]))

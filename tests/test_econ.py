"Cross-checks of `workbench.collaboration.econ`: votes, rewards, mixer monotonicity, encoder invariance, best response on known games, regret, debate tokens, reproducibility and the recorded verdict (fast, CPU)."
import numpy as np
import pytest
import torch
from workbench.collaboration.econ import (weighted_vote, majority_vote, econ_rewards, BeliefNetwork, BeliefEncoder, QMixer,
    best_response_profile, equilibrium_gap, value_table, regret, ECONTeam, decide, train_team, train_executor, debate, build_bank,
    independent_tokens, make_arith_tasks, PROFILES, ECONConfig, verdict, claims)
from workbench.core import load_results


def test_mixer_monotone_in_every_agent():
    torch.manual_seed(1)
    for n in (1, 3, 6):
        mix, qs = QMixer(n, 16), torch.randn(128, n, requires_grad=True)
        g, = torch.autograd.grad(mix(qs, torch.randn(128, 16)).sum(), qs)
        assert (g >= 0).all()


def test_encoder_permutation_invariant():
    torch.manual_seed(0)
    enc, b = BeliefEncoder(32), torch.randn(5, 4, 32)
    for p in ([1, 0, 2, 3], [3, 2, 1, 0]):
        torch.testing.assert_close(enc(b), enc(b[:, p]), atol=1e-5, rtol=1e-5)


def _game(P1, P2):
    P1, P2 = torch.tensor(P1, dtype=torch.float), torch.tensor(P2, dtype=torch.float)
    return [lambda a: P1[:, a[:, 1]].T, lambda a: P2[a[:, 0], :]]


def test_best_response_reaches_known_equilibrium_and_no_unilateral_gain():
    # prisoner's dilemma (0 = cooperate, 1 = defect): the unique equilibrium is (1, 1)
    pd_ = _game([[3, 0], [5, 1]], [[3, 5], [0, 1]])
    a, ok = best_response_profile(pd_, torch.tensor([[0, 0], [0, 1], [1, 0]]))
    assert ok.all() and a.tolist() == [[1, 1]] * 3
    assert equilibrium_gap(pd_, a).abs().max() == 0
    for i in range(2):
        dev = a.clone(); dev[:, i] = 0
        assert (pd_[i](dev).gather(1, dev[:, i:i + 1]) <= pd_[i](a).gather(1, a[:, i:i + 1])).all()
    one, ok1 = best_response_profile([lambda a: torch.tensor([[0.2, 0.1, 0.9]])], torch.tensor([[0]]))
    assert one.tolist() == [[2]] and ok1.all()


def test_cycling_game_reports_no_convergence():
    pen = _game([[1, -1], [-1, 1]], [[-1, 1], [1, -1]])
    a, ok = best_response_profile(pen, torch.tensor([[0, 0]]), max_iter=5)
    assert not ok.any() and equilibrium_gap(pen, a).item() > 0


def test_votes():
    U = torch.tensor([[1, 2, 2], [5, 6, 7], [4, 4, 9]])
    assert majority_vote(U).tolist() == [2, 5, 4]
    assert weighted_vote(U, torch.full((3, 3), 1 / 3)).tolist() == majority_vote(U).tolist()
    assert majority_vote(U[:, 1:2]).tolist() == [2, 6, 4]


def test_rewards_in_unit_interval_and_ts():
    g = torch.Generator().manual_seed(0)
    U, y = torch.randint(0, 3, (200, 3), generator=g), torch.randint(0, 3, (200,), generator=g)
    C = majority_vote(U); r = econ_rewards(U, C, y)
    assert ((r >= 0) & (r <= 1)).all()
    ts = econ_rewards(U, C, y, (1, 0, 0))                          # the TS part alone
    assert (ts == (C == y).float()[:, None]).all()
    with pytest.raises(ValueError, match='summing to 1'): econ_rewards(U, C, y, (0.5, 0.5, 0.5))


def test_bad_agent_counts():
    with pytest.raises(ValueError, match='n_agents'): BeliefNetwork(8, 0, 5)
    with pytest.raises(ValueError, match='n_agents'): QMixer(0)
    with pytest.raises(ValueError, match='qs must be'): QMixer(3, 16)(torch.zeros(2, 4), torch.zeros(2, 16))
    with pytest.raises(ValueError, match='one q_fn per agent'): best_response_profile([lambda a: a], torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match='one observation per agent'): ECONTeam([8, 8, 8]).beliefs([torch.zeros(2, 8)])
    with pytest.raises(ValueError, match='number of agents'): ECONTeam([])
    with pytest.raises(ValueError, match='at least one agent'): weighted_vote(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0))


def _toy_bank(seed=0, Q=40, N=3, K=5, m=3):
    r = np.random.default_rng(seed)
    y = r.integers(0, 5, Q)
    bank = np.where(r.random((Q, N, K, m)) < np.linspace(0.8, 0.2, K)[None, None, :, None], y[:, None, None, None], r.integers(5, 9, (Q, N, K, m)))
    return bank.astype(np.int64), y


def test_regret_nonnegative_cumulative_nondecreasing_and_reproducible():
    bank, y = _toy_bank()
    V = value_table(bank, y)
    obs = [torch.randn(len(y), 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    t1, log1 = train_team(obs, bank, y, 160, seed=3, V=V)
    t2, log2 = train_team(obs, bank, y, 160, seed=3, V=V)
    reg = np.array(log1['regret'])
    assert (reg >= -1e-12).all() and (np.diff(np.cumsum(reg)) >= -1e-12).all()
    assert log1['regret'] == log2['regret']
    a, ok, gap = decide(t1, obs)
    assert a.shape == (len(y), 3) and (gap >= 0).all()
    assert (gap[ok] == 0).all()                                   # a fixed point has no unilateral gain on the Q_i


def test_debate_token_accounting():
    torch.manual_seed(0)
    ex = train_executor(PROFILES[2], steps=5)
    tasks = make_arith_tasks(4, 'test')
    U0 = build_bank([ex] * 3, tasks, m=2)[:, :, 0]
    hist, toks = debate([ex] * 3, tasks, U0, 2, 0.5)
    plen = np.array([len(t['expr']) + 1 for t in tasks], float)
    np.testing.assert_allclose(toks[0], independent_tokens(U0, plen))   # R=0 = independent answering
    assert (toks[0] < toks[1]).all() and (toks[1] < toks[2]).all()


def test_config_validation():
    with pytest.raises(ValueError, match='rounds'): ECONConfig(mode='quick', rounds=(0,))
    with pytest.raises(ValueError, match='episodes'): ECONConfig(mode='quick', episodes=0)
    assert ECONConfig(mode='full').n_seeds >= 3


def test_recorded_verdict():
    try: R = load_results('econ')
    except FileNotFoundError: pytest.skip('no recorded econ results yet')
    assert verdict(R) == R.verdict
    n_big = len(set(R.df.n_agents) - {len(PROFILES)}) if 'n_agents' in R.df else 0
    assert len(claims(R)) == 4 + 2 * n_big                        # two claims per larger team (adding agents)
    if n_big: assert all(r['same_executors'] for r in R.tables['scale'])


# --- adding agents (issue 26) ---
from workbench.collaboration.econ import run_scale, run_seed, scale_name, CHANCE, old_verdict, ABLATION
from workbench.core import _unit_config


def test_scale_config_errors_and_unit_key():
    for bad in (2, 3, 11):
        with pytest.raises(ValueError, match='scale_agents'): ECONConfig(mode='quick', scale_agents=bad)
    with pytest.raises(ValueError, match='n_scale_seeds'): ECONConfig(mode='quick', n_scale_seeds=2)
    ECONConfig(mode='quick', scale_agents=0)                       # 0: not run
    assert _unit_config(ECONConfig(mode='full')) == _unit_config(ECONConfig(mode='full', scale_agents=0, n_scale_seeds=0))


def test_larger_team_starts_with_the_same_executors():
    cfg = ECONConfig(mode='quick', exec_steps=5, n_rl=24, n_test=16, m=2, episodes=32, scale_agents=4)
    u, x = run_seed(cfg, 0), run_scale(cfg, 0)
    assert x['n_agents'] == 4 and set(x['acc']) == {'single', 'self-consistency', 'majority vote', 'ECON', *CHANCE}
    for c in (u['cost'], x['cost']):                               # compute per question: calls, FLOPs, seconds
        assert c['single']['calls'] == 1 and c['self-consistency']['calls'] == 3 and c[CHANCE[1]]['flops'] == 0
        assert c['ECON']['flops'] > c['majority vote']['flops'] > 0 and c['ECON']['sec'] > 0
    assert u['cost']['MAD R=1']['calls'] == 6 and u['cost']['MAD R=1']['flops'] > u['cost']['majority vote']['flops']
    rec = u['inspect'][0]                                          # the inspector holds each agent's beliefs about the others
    assert np.array(rec['beliefs']).shape == (3, 2, 5) and np.allclose(np.array(rec['beliefs']).sum(-1), 1, atol=1e-2)
    assert 0 <= u['chance_regret'] <= 1
    assert np.allclose(x['check_mv3'], u['acc']['majority vote'])  # the first three are the 3-agent unit's executors, same draws
    assert all(0 <= a <= 1 for v in x['acc'].values() for a in v) and x['tok']['ECON'] > u['tok']['ECON']
    assert scale_name('ECON', 4) == 'ECON (4 agents)'


def test_verdict_rule_reversal_is_not_reproduced():
    from workbench.core import Claim
    from workbench.collaboration import econ
    up = Claim(name='a', estimate=0.1, lo=0.05, hi=0.15, better='higher', null=0.0, n=10, ci='t')
    down = Claim(name='b', estimate=-0.1, lo=-0.15, hi=-0.05, better='higher', null=0.0, n=10, ci='t')
    flat = Claim(name='c', estimate=0.0, lo=-0.1, hi=0.1, better='higher', null=0.0, n=10, ci='t')
    class _R: pass
    orig = econ.claims
    try:
        for cs, want in (([up, flat], 'partly'), ([up, down], 'not reproduced'), ([up, up], 'reproduced'), ([flat], 'not reproduced')):
            econ.claims = lambda r, cs=cs: cs
            assert econ.verdict(_R()) == want
    finally: econ.claims = orig

"Cross-checks of `workbench.collaboration.econ`: votes, rewards, mixer monotonicity, encoder invariance, best response on known games, regret, debate tokens, reproducibility and the verdict rule on made-up rows (fast, CPU)."
import numpy as np
import pytest
import torch
from workbench.collaboration.econ import (weighted_vote, majority_vote, econ_rewards, BeliefNetwork, BeliefEncoder, QMixer,
    best_response_profile, equilibrium_gap, value_table, regret, ECONTeam, decide, train_team, train_executor, debate, build_bank,
    independent_tokens, make_arith_tasks, PROFILES, ECONConfig, verdict, claims)
from workbench.core import Claim, Results, UNTESTABLE


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


# --- adding agents (issue 26) ---
from workbench.collaboration.econ import run_scale, run_seed, scale_name, CHANCE, ABLATION
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


# --- the verdict rule on made-up rows ---
FAILED = Claim('made-up precondition: oracle temperatures beat the best fixed one', 0.005, -0.01, 0.02, null=0.03, role='precondition', threshold_from='min_headroom')
HOLDS = Claim('made-up precondition: the executors answer above chance', 0.4, 0.35, 0.45, null=0.1, role='precondition', threshold_from='min_exec_acc')
EVEN = dict.fromkeys(('single', 'self-consistency', 'majority vote', 'MAD R=1', 'MAD R=2', 'ECON fixed-T', 'independent'), 0.0)


def _made_up(lead, regret=0.0, scale=None, seeds=(0, 1, 2), n_items=20):
    """Rows and the items table in the shape `claims` reads: each method's accuracy lead per test item over a common level
    (`lead`: ECON's, or a dict of method -> lead over EVEN), independent learners' extra cumulative regret over ECON's, and
    optionally a larger team (`scale`: method -> lead, 6 executors)."""
    acc = {**EVEN, **(lead if isinstance(lead, dict) else dict(ECON=lead))}
    level = np.random.default_rng(0).uniform(0.3, 0.6, (len(seeds), n_items)); rows, items = [], []
    wiggle = 0.02 * (-1) ** np.arange(n_items)                       # per-item noise with mean exactly 0 (n_items even): ties stay ties
    for i, s in enumerate(seeds):
        teams = [(m, a, len(PROFILES)) for m, a in acc.items()] + [(scale_name(m, 6), a, 6) for m, a in (scale or {}).items()]
        for j, (m, a, n) in enumerate(teams):
            x = level[i] + a + (-1) ** j * wiggle
            reg = {'ECON': 1.0 + 0.02 * (s % 2), 'independent': 1.0 + regret}.get(m)
            rows.append(dict(seed=s, method=m, n_agents=n, acc=float(x.mean()), cum_regret=None if reg is None else reg + 0.05 * s))
            items.append(dict(seed=s, method=m, acc=x.tolist()))
    return Results('econ', dict(seed=0), rows, seeds=list(seeds), tables=dict(items=items))


def _claims_once(R, monkeypatch):
    "`claims(R)`, and `verdict` made to reuse them (each claim bootstraps 10,000 times: computing them twice would double the test's time)."
    from workbench.collaboration import econ
    cs, real = claims(R), econ.claims
    monkeypatch.setattr(econ, 'claims', lambda r: cs if r is R else real(r))
    return cs


# claims: ECON − strongest answer-alone baseline, − best debate, regret (independent − ECON), − its learned vote alone
@pytest.mark.parametrize('lead,regret,want,status', [
    (0.2, 1.0, 'reproduced', ['shows'] * 4),
    (dict(ECON=0.2, **{'MAD R=2': 0.2, 'ECON fixed-T': 0.2}), 0.0, 'partly', ['shows', 'no effect', 'no effect', 'no effect']),
    (0.0, 0.0, 'not reproduced', ['no effect'] * 4),
    (dict(ECON=0.2, **{'ECON fixed-T': 0.3}), 1.0, 'not reproduced', ['shows', 'shows', 'shows', 'opposite']),   # three show, the ablation reverses
    (dict(ECON=0.2, **{'majority vote': 0.3}), 1.0, 'not reproduced', ['opposite', 'shows', 'shows', 'shows']),  # below the strongest baseline
])
def test_verdict_on_made_up_rows(lead, regret, want, status, monkeypatch):
    R = _made_up(lead, regret)
    assert [c.status for c in _claims_once(R, monkeypatch)] == status
    assert verdict(R) == want


def test_claims_name_the_strongest_baseline_and_debate():
    cs = claims(_made_up(dict(ECON=0.2, **{'self-consistency': 0.1, 'MAD R=1': 0.1}), 1.0))
    assert 'ECON − self-consistency (strongest' in cs[0].name and 'ECON − MAD R=1 (best debate' in cs[1].name and cs[3].name == ABLATION
    assert cs[0].estimate == pytest.approx(0.1, abs=0.02) and cs[2].estimate == pytest.approx(1.0, abs=0.05)


def test_larger_team_below_its_strongest_baseline_is_not_reproduced(monkeypatch):
    "Every 3-agent claim shows and adding agents helps, but with 6 executors self-consistency beats ECON: the committed run's pattern."
    R = _made_up(0.2, 1.0, scale={'ECON': 0.3, 'single': 0.0, 'self-consistency': 0.4, 'majority vote': 0.1})
    cs = _claims_once(R, monkeypatch)
    assert [c.status for c in cs] == ['shows'] * 5 + ['opposite']
    assert 'self-consistency (6 agents)' in cs[5].name and verdict(R) == 'not reproduced'


@pytest.mark.parametrize('lead,want', [(0.2, 'reproduced'), (0.0, 'not reproduced')])
def test_a_failed_precondition_makes_it_untestable(lead, want, monkeypatch):
    R = _made_up(lead, 1.0 if lead else 0.0)
    cs = _claims_once(R, monkeypatch)
    R.claims = [FAILED, *cs]
    assert verdict(R) == UNTESTABLE
    R.claims = [HOLDS, *cs]
    assert verdict(R) == want

"Cross-checks of the sweep, frontier and precondition helpers in `workbench.measure` on made-up data with known answers."
from dataclasses import dataclass
import math
import numpy as np
import pytest
from workbench.core import judge, machine_info, machine_line, UNTESTABLE
from workbench.measure import (best_setting, best_vs_best, pareto_front, interp_on_front, matched_cost, curve_slope,
                               flattened, oracle_headroom, precondition, claim, paired_bootstrap, SpeedRatio, compare_speed)

COST = np.array([1.0, 2.0, 4.0, 8.0, 16.0])        # a geometric grid of budgets
LEVEL = np.array([0.30, 0.45, 0.55, 0.62, 0.66])   # mean quality per budget: diminishing returns


def arms(shift: float, n: int=80, noise: float=0.05, seed: int=0):
    "Two arms scored on the same n items (shared item difficulty); arm a's front is b's raised by `shift`."
    rng = np.random.default_rng(seed)
    item = rng.normal(0, 0.3, n)                                          # (n,) difficulty both arms see
    qb = LEVEL[:, None] + item + rng.normal(0, noise, (len(LEVEL), n))    # (K, n)
    qa = LEVEL[:, None] + shift + item + rng.normal(0, noise, (len(LEVEL), n))
    return qa, qb


def test_matched_cost_dominating_arm_excludes_zero():
    qa, qb = arms(shift=0.05)
    m = matched_cost(COST, qa, COST, qb, at=3.0, log_cost=True, n_boot=1000)
    assert m.lo > 0, m                                                    # a is better at every budget
    assert claim('a − b at matched cost', m).shows


def test_matched_cost_identical_arms_contains_zero():
    qa, qb = arms(shift=0.0, seed=1)                                      # same distribution, independent noise
    m = matched_cost(COST, qa, COST, qb, at=3.0, log_cost=True, n_boot=1000)
    assert m.lo < 0 < m.hi, m
    assert m.hi - m.lo > 0                                                # a real interval, not a degenerate one


def test_matched_cost_pairing_narrows_the_interval():
    "Shuffling arm b's items breaks the pairing: the same data then give a wider interval (Cov(a, b) > 0 removed)."
    qa, qb = arms(shift=0.05, noise=0.03, seed=2)
    paired = matched_cost(COST, qa, COST, qb, at=6.0, n_boot=1000)
    shuffled = matched_cost(COST, qa, COST, qb[:, np.random.default_rng(0).permutation(qb.shape[1])], at=6.0, n_boot=1000)
    assert math.isclose(paired.estimate, shuffled.estimate, abs_tol=1e-12)   # the means do not depend on the order
    assert paired.half_width < shuffled.half_width / 3


def test_matched_cost_interval_covers_the_true_difference():
    "Over 30 made-up datasets the 95% interval covers the true shift at least 24 times."
    hits = 0
    for s in range(30):
        qa, qb = arms(shift=0.04, n=60, noise=0.1, seed=100 + s)
        m = matched_cost(COST, qa, COST, qb, at=5.0, n_boot=400, seed=s)
        hits += m.lo <= 0.04 <= m.hi
    assert hits >= 24, hits


def test_matched_cost_log_interpolation_at_the_geometric_midpoint():
    qa, qb = arms(shift=0.05, seed=3)
    m = matched_cost(COST, qa, COST, qb, at=math.sqrt(2 * 4), log_cost=True, n_boot=200)   # halfway between 2 and 4 in log
    qam, qbm = qa.mean(1), qb.mean(1)
    assert math.isclose(m.estimate, (qam[1] + qam[2]) / 2 - (qbm[1] + qbm[2]) / 2, abs_tol=1e-12)


def test_matched_cost_refuses_extrapolation():
    qa, qb = arms(shift=0.05)
    with pytest.raises(ValueError, match='does not extrapolate'):
        matched_cost(COST, qa, COST * 4, qb, at=2.0)                      # b's cheapest point costs 4


def test_front_ignores_dominated_points():
    cost, q = [1, 2, 3, 4], [0.5, 0.3, 0.8, 0.6]                           # 1 and 3 are dominated
    assert pareto_front(cost, q) == [0, 2]
    assert math.isclose(interp_on_front(cost, q, 2.0), 0.65)               # chord (1, .5)–(3, .8), not via (2, .3)
    assert math.isclose(interp_on_front(cost, q, 4.0), 0.8)                # past the front: flat
    assert math.isnan(interp_on_front(cost, q, 4.5))


def test_best_setting_refuses_a_tie_and_flags_on_request():
    with pytest.raises(ValueError, match=r"refuses a tie: knob 4 .* of \[8\]"):
        best_setting([2, 4, 8, 16], [[0.1, 0.3], [0.5, 0.7], [0.6, 0.6], [0.2, 0.2]])   # means .2, .6, .6, .2
    b = best_setting([2, 4, 8, 16], [0.2, 0.6, 0.6, 0.2], ties='flag')
    assert (b.knob, b.tied, b.tied_with, b.sweep_ok) == (4, True, (8,), False)


def test_best_vs_best_judges_each_arm_at_its_own_optimum():
    "Arm a wins at its own best knob though it loses at b's best knob: best against best finds it."
    rng = np.random.default_rng(4)
    item = rng.normal(0, 1, 50)
    a = np.array([0.2, 0.4, 0.9, 0.5])[:, None] + item + rng.normal(0, 0.05, (4, 50))
    b = np.array([0.3, 0.7, 0.5, 0.2])[:, None] + item + rng.normal(0, 0.05, (4, 50))
    r = best_vs_best([1, 2, 4, 8], a, [1, 2, 4, 8], b, n_boot=1000)
    assert (r.a.knob, r.b.knob, r.edge) == (4, 2, False)
    assert r.claim('a − b, each at its best').shows
    assert paired_bootstrap(a[1], b[1], n_boot=1000).hi < 0               # at b's best knob a would have lost
    edge = best_vs_best([1, 2, 4], a[:3], [1, 2, 4], b[:3], n_boot=200)
    assert edge.edge and edge.a.at_edge                                   # a's best is now the grid's last value


def test_flattened_on_falling_and_flat_curves():
    rng = np.random.default_rng(5)
    steps = np.arange(0, 2000, 20.0)                                      # (T,) = 100 evaluations
    falling = 3.0 - 5e-4 * steps + rng.normal(0, 0.02, (5, 100))          # (S, T) still falling on 5 seeds
    flat = 2.0 + rng.normal(0, 0.02, (5, 100))
    tol = 2e-4                                                            # loss per step
    assert not flattened(falling, tol, x=steps).holds
    assert flattened(flat, tol, x=steps).holds
    assert math.isclose(curve_slope(falling, x=steps).estimate, -5e-4, rel_tol=0.1)


def test_oracle_headroom_zero_when_one_action_wins_every_item():
    rng = np.random.default_rng(6)
    s = rng.random((30, 5))
    s[:, 3] = s.max(1)                                                    # action 3 ties or wins every item
    h = oracle_headroom(s, n_boot=500)
    assert (h.estimate, h.lo, h.hi) == (0.0, 0.0, 0.0)
    split = np.where(np.arange(30)[:, None] % 2 == np.arange(2), 1.0, 0.0)   # each of 2 actions wins half the items
    assert math.isclose(oracle_headroom(split, n_boot=500).estimate, 0.5)


@dataclass
class _Cfg:
    min_headroom: float = 0.1      # the oracle headroom the claim needs
    loss_flat_tol: float = 1e-4    # |loss slope| per step over the last fifth


def test_failed_precondition_makes_the_verdict_untestable():
    "No headroom and a still-falling loss fail their declared preconditions, and judge() says 'untestable here'."
    rng = np.random.default_rng(7)
    s = rng.random((30, 3))
    s[:, 0] = s.max(1) + 0.01
    cfg = _Cfg()
    pre = [precondition('oracle headroom', oracle_headroom(s, n_boot=500), cfg, 'min_headroom'),
           precondition('loss flat', flattened(3.0 - 1e-3 * np.arange(100.0), cfg.loss_flat_tol), cfg, 'loss_flat_tol',
                        better='lower')]
    assert [p.status for p in pre] == ['fails', 'fails'] and pre[1].threshold_from == 'loss_flat_tol'
    qa, qb = arms(shift=0.05)
    effect = matched_cost(COST, qa, COST, qb, at=3.0, n_boot=500)
    assert judge(pre + [claim('a − b at matched cost', effect)]) == UNTESTABLE
    with pytest.raises(ValueError, match="no field 'headroom'"):
        precondition('oracle headroom', oracle_headroom(s, n_boot=500), cfg, 'headroom')


def test_speed_ratio_prints_its_machine():
    s = compare_speed(lambda: None, lambda: None, repeats=2, n_boot=200)
    assert s.machine == machine_line(machine_info()) and str(s).endswith(s.machine)
    assert 'not recorded' in str(SpeedRatio(1.0, 0.9, 1.1, [1.0], [1.0]))

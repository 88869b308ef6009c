"""The exploration planner with fake measurements: feasibility, UCB1, budget changes, resume."""

from __future__ import annotations

import json

import pytest

from spotlight.errors import ConfigError
from spotlight.policy.caching import StepCache
from spotlight.policy.planner import Arm, Planner, PlannerConfig

STEPS, GROUP, PROMPTS = 10, 8, 8
# worker-seconds per candidate sample x model call on the fake machine
CALL_S = 0.01


def make(arms=("8", "16", "8@taylor:3", "32@fbc:0.2"), **kw) -> Planner:
    return Planner(PlannerConfig(arms=arms, **kw), steps=STEPS, group_size=GROUP)


def measure(p: Planner, arm: Arm, calls_per_sample: float | None = None) -> None:
    """The fake machine: a candidate sample costs CALL_S per computed model call."""
    calls = arm.nominal_calls(STEPS) if calls_per_sample is None else calls_per_sample
    samples = PROMPTS * arm.candidates
    p.observe_cost(arm, worker_seconds=samples * calls * CALL_S, samples=samples,
                   sample_calls=round(samples * calls))


def cost(arm: Arm, calls_per_sample: float | None = None) -> float:
    calls = arm.nominal_calls(STEPS) if calls_per_sample is None else calls_per_sample
    return PROMPTS * arm.candidates * calls * CALL_S


def test_arms_parse_from_recipe_strings():
    cfg = PlannerConfig(arms=("16", "32@taylor:4", "16@fbc:0.25", Arm(8)))
    assert cfg.arms == (Arm(16), Arm(32, StepCache("taylor", 4)), Arm(16, StepCache("fbc", 0.25)), Arm(8))
    assert [a.label for a in cfg.arms] == ["16", "32@taylor:4", "16@fbc:0.25", "8"]


def test_first_choice_without_measurements_is_the_cheapest_and_says_so():
    p = make()
    d = p.choose(workers=2, prompts=PROMPTS, window_s=1.0)
    # the fewest nominal candidate-calls: TaylorSeer every 3rd of 10 steps computes 5 (0, 1, 3, 6, 9)
    assert d.arm == Arm(8, StepCache("taylor", 3)) and d.reason == "no cost estimate yet: cheapest"
    p.observe_cost(d.arm, worker_seconds=1.0, samples=10, sample_calls=50)
    d = p.choose(workers=2, prompts=PROMPTS)  # priced now, but no training window seen yet
    assert d.reason == "no training window yet: cheapest" and d.budget_s is None


def test_never_chooses_an_infeasible_arm():
    p = make(call_seconds=CALL_S, budget_fraction=1.0)
    arms = p.cfg.arms
    # budget fits 8 (6.4 s) and 8@taylor:3 (3.2 s) but not 16 (12.8 s) nor 32@fbc:0.2 (25.6 s: a
    # first-block cache is priced at full steps, its reuse depends on the data)
    p.observe_window(3.5)
    for it in range(30):
        d = p.choose(workers=2, prompts=PROMPTS)
        assert d.predicted_s[d.arm.label] <= d.budget_s == pytest.approx(7.0)
        assert d.arm in (arms[0], arms[2]), (it, d)
        measure(p, d.arm)
        # a payoff that would lure UCB to the big arms if they were allowed
        p.observe_payoff(d.arm, 0.1)
        p.observe_payoff(arms[3], 0.5) if it == 0 else None
    assert p.pulls[1] == 0


def test_no_arm_fits_chooses_the_cheapest_and_says_so():
    p = make(call_seconds=CALL_S)
    d = p.choose(workers=1, prompts=PROMPTS, window_s=0.1)
    assert d.arm == Arm(8, StepCache("taylor", 3)) and d.reason == "no arm fits the budget: cheapest"
    assert d.budget_s == pytest.approx(0.09)
    assert json.loads(json.dumps(d.as_dict()))["arm"] == "8@taylor:3"  # loggable as is


def test_tries_each_feasible_arm_once_then_exploits_the_best():
    p = make(call_seconds=CALL_S)
    payoff = {"8": 0.05, "16": 0.12, "8@taylor:3": 0.08, "32@fbc:0.2": 0.20}
    p.observe_window(100.0)
    seen = []
    for _ in range(100):
        d = p.choose(workers=4, prompts=PROMPTS)
        seen.append(d.arm.label)
        measure(p, d.arm)
        p.observe_payoff(d.arm, payoff[d.arm.label])
    assert seen[:4] == ["8", "16", "8@taylor:3", "32@fbc:0.2"]  # each once, in list order
    # then mostly the best: pulls follow the payoffs, the best arm gets most of them
    assert sorted(payoff, key=seen.count) == sorted(payoff, key=payoff.get)
    assert seen.count("32@fbc:0.2") > 60 and seen[-20:].count("32@fbc:0.2") >= 15
    # with exploration 0 it exploits right after the first round
    p = make(call_seconds=CALL_S, exploration=0.0)
    p.observe_window(100.0)
    for i in range(8):
        d = p.choose(workers=4, prompts=PROMPTS)
        assert d.reason == ("untried" if i < 4 else "ucb")
        assert i < 4 or d.arm.label == "32@fbc:0.2"
        p.observe_payoff(d.arm, payoff[d.arm.label])


def test_adapts_when_spot_workers_leave_and_come_back():
    p = make(call_seconds=CALL_S)
    payoff = {"8": 0.05, "16": 0.12, "8@taylor:3": 0.08, "32@fbc:0.2": 0.20}
    p.observe_window(4.0)
    for _ in range(12):  # 8 workers: 28.8 worker-s, every arm fits
        d = p.choose(workers=8, prompts=PROMPTS)
        measure(p, d.arm, calls_per_sample=6 if d.arm.cache else None)  # a cache computes 6 of 10
        p.observe_payoff(d.arm, payoff[d.arm.label])
    assert d.arm.label == "32@fbc:0.2"
    assert d.predicted_s["32@fbc:0.2"] == pytest.approx(cost(p.cfg.arms[3], 6))  # as measured
    # preemptions: 2 workers left -> 7.2 worker-s; 32@fbc:0.2 (15.4 s) and 16 (12.8 s) no longer fit
    small = []
    for _ in range(10):
        d = p.choose(workers=2, prompts=PROMPTS)
        assert d.budget_s == pytest.approx(7.2) and d.reason == "ucb"
        assert d.scores["32@fbc:0.2"] is None and d.scores["16"] is None
        small.append(d.arm.label)
        measure(p, d.arm)
        p.observe_payoff(d.arm, payoff[d.arm.label])
    # the better one that fits
    assert set(small) == {"8", "8@taylor:3"} and small.count("8@taylor:3") > small.count("8")
    # a longer training window (measured) brings the big arm back
    for _ in range(3):
        p.observe_window(20.0)
    big = []
    for _ in range(5):
        d = p.choose(workers=2, prompts=PROMPTS)
        big.append(d.arm.label)
        p.observe_payoff(d.arm, payoff[d.arm.label])
    assert big.count("32@fbc:0.2") >= 3


def test_window_and_costs_are_ewmas():
    p = make(smoothing=0.5)
    p.observe_window(10.0)
    p.observe_window(20.0)
    assert p.window_s == 15.0
    a = Arm(16)
    p.observe_cost(a, worker_seconds=16.0, samples=16, sample_calls=160)
    p.observe_cost(a, worker_seconds=32.0, samples=16, sample_calls=160)
    assert p.predicted_seconds(a, prompts=1) == pytest.approx(16 * 1.5)
    # an arm never measured is priced from the per-call rate times its nominal calls: all steps for
    # a first-block cache, TaylorSeer's schedule (5 of 10 at interval 3)
    assert p.predicted_seconds(Arm(32, StepCache("fbc", 0.2)), prompts=1) == pytest.approx(32 * STEPS * 0.15)
    assert p.predicted_seconds(Arm(8, StepCache("taylor", 3)), prompts=1) == pytest.approx(8 * 5 * 0.15)


def test_state_round_trip_gives_the_same_next_choices():
    payoff = {"8": 0.05, "16": 0.12, "8@taylor:3": 0.08, "32@fbc:0.2": 0.11}

    def drive(p: Planner, iterations: int, start: int) -> list[str]:
        out = []
        for it in range(start, start + iterations):
            d = p.choose(workers=1 + it % 4, prompts=PROMPTS)
            out.append(d.arm.label + ":" + d.reason)
            measure(p, d.arm, calls_per_sample=5 + it % 3 if d.arm.cache else None)
            p.observe_payoff(d.arm, payoff[d.arm.label] * (1 + 0.1 * (it % 5)))
            p.observe_window(3.0 + it % 7)
        return out

    a = make(call_seconds=CALL_S)
    drive(a, 15, 0)
    saved = json.loads(json.dumps(a.state_dict()))  # through the checkpoint's JSON metadata
    b = make(call_seconds=CALL_S)
    b.load_state_dict(saved)
    assert b.state_dict() == a.state_dict()
    assert drive(b, 25, 15) == drive(a, 25, 15)
    with pytest.raises(ConfigError, match=r"explore\.arms .* differ from the checkpoint"):
        make(arms=("8", "16")).load_state_dict(saved)


@pytest.mark.parametrize("kw, field", [
    (dict(arms=()), r"explore\.arms must name at least one arm"),
    (dict(arms=("16", "sixteen")), r"explore\.arms\[1\]: 'sixteen' is not"),
    (dict(arms=("1",)), r"explore\.arms\[0\] \(1\): candidates must be >= 2"),
    (dict(arms=("16x4",)), r"explore\.arms\[0\]: '16x4' is not 'M' or 'M@CACHE'"),
    (dict(arms=("16@fbc:0",)), r"explore\.arms\[0\]: 'fbc:0': fbc threshold must be > 0"),
    (dict(arms=("16@taylor:1.5",)), r"explore\.arms\[0\]: 'taylor:1.5': taylor interval must be an integer"),
    (dict(arms=("16@mag:0.1",)), r"explore\.arms\[0\]: 'mag:0.1': step cache 'mag' is not one of"),
    (dict(arms=("16", "16")), r"explore\.arms has duplicates"),
    (dict(exploration=-1.0), r"explore\.exploration must be >= 0"),
    (dict(smoothing=0.0), r"explore\.smoothing must be in \(0, 1\]"),
    (dict(budget_fraction=1.5), r"explore\.budget_fraction must be in \(0, 1\]"),
    (dict(call_seconds=0.0), r"explore\.call_seconds must be > 0"),
])
def test_bad_config_is_one_clear_line(kw, field):
    with pytest.raises(ConfigError, match=field) as e:
        PlannerConfig(**kw)
    assert "\n" not in str(e.value)


def test_arm_list_that_can_never_fit_is_refused_at_construction():
    with pytest.raises(ConfigError, match=r"explore\.arms\[1\] \(4\): 4 candidates cannot fill a group of "
                                          r"run\.group_size=8, so it fits no budget"):
        make(arms=("16", "4"))


def test_bad_measurements_are_refused():
    p = make()
    with pytest.raises(ValueError, match="seconds must be > 0"):
        p.observe_window(0.0)
    with pytest.raises(ValueError, match="spread must be >= 0"):
        p.observe_payoff(Arm(16), float("nan"))
    with pytest.raises(ValueError):
        p.observe_payoff(Arm(64), 0.1)  # not one of the arms
    with pytest.raises(ValueError, match="samples must be >= 1"):
        p.observe_cost(Arm(16), worker_seconds=1.0, samples=0, sample_calls=0)

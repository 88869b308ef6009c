"""The run's evaluation: ODE on held-out prompts as the headline, beside ODE on training prompts,
the SDE policy and the flow-matching drift (issue 11)."""

from __future__ import annotations

import torch

from spotlight.data.prompts import HELDOUT, all_captions, heldout_prompts, prompt_set
from spotlight.evaluation import Evaluator
from spotlight.recipe import load_recipe
from spotlight.rewards.base import make_reward


def test_heldout_prompts_are_of_the_grammar_and_never_trained_on():
    grammar = set(all_captions())
    for name in ("demo", "counting", "broad"):
        held, train = heldout_prompts(name), prompt_set(name)
        assert len(held) == 8 and set(held) <= grammar and not set(held) & set(train)
    assert heldout_prompts("counting") == heldout_prompts("counting")  # a fixed split
    assert set(HELDOUT["demo"]) == set(heldout_prompts("demo"))
    assert heldout_prompts("all") == []


def test_evaluation_reports_three_suites_and_drift(tiny_model, tiny_cfg, tmp_path):
    from dataclasses import asdict

    recipe = load_recipe({"model": asdict(tiny_cfg), "run": {"eval_seeds": 2, "eval_samples": 2},
                          "sampler": {"steps": 2, "eval_steps": 2, "sde_steps": 1, "noise_patch": 4}})
    ev = Evaluator(tiny_model, recipe, make_reward("compositional"), tmp_path)
    base = ev(0)
    assert base["eval_headline"] == "ode_heldout" and base["eval_reward"] == base["eval_ode_heldout"]
    for suite in ("ode_heldout", "ode_train", "sde_train"):
        assert len(base[f"eval_{suite}_per_set"]) == 2
        assert set(base[f"eval_{suite}_parts"]) >= {"present", "count", "shape"}
        lost = base[f"eval_{suite}_shortfall"]  # what the reward missed, by cause
        assert {"count", "shape: object missing"} <= set(lost)
        assert abs(sum(lost.values()) - (1 - base[f"eval_{suite}"])) < 1e-3
        assert (
            tmp_path
            / "samples"
            / f"eval_0000{ {'ode_heldout': '', 'ode_train': '_train', 'sde_train': '_sde'}[suite] }.png"
        ).exists()
    assert (
        base["fm_drift"] == 0.0 and ev(0, save_samples=False)["eval_reward"] == base["eval_reward"]
    )  # seeded
    with torch.no_grad():
        for p in tiny_model.dit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert ev(5, save_samples=False)["fm_drift"] > 0.0  # perturbed weights draw worse

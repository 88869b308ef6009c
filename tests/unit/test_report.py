"""The run's reward plot: the evaluation curves, the drift, and — for a reward that says what it
missed — the held-out reward not earned, stacked by cause."""

from __future__ import annotations

from PIL import Image

from spotlight.report import plot_rewards


def _records(shortfall: bool) -> list[dict]:
    out = []
    for it in (0, 10, 20):
        out.append({"event": "iteration", "iteration": it, "wall_s": it * 2.0, "reward_mean": 0.8 + it / 100})
        ev = {"event": "eval", "iteration": it, "wall_s": it * 2.0 + 1, "eval_ode_heldout": 0.85 + it / 200,
              "eval_ode_heldout_std": 0.01, "fm_drift": it / 1000}
        if shortfall:
            ev["eval_ode_heldout_shortfall"] = {
                "count": 0.05 - it / 1000, "shape: elongated box": 0.1 - it / 400, "relation": 0.0
            }
        out.append(ev)
    return out


def test_the_plot_adds_a_panel_for_the_reward_not_earned(tmp_path):
    plot_rewards(_records(False), tmp_path / "plain.png")
    plot_rewards(_records(True), tmp_path / "short.png")
    with Image.open(tmp_path / "plain.png") as plain, Image.open(tmp_path / "short.png") as short:
        assert plain.height == short.height
        assert short.width == round(plain.width * 4 / 3)  # one 5-inch panel more, at the same dpi

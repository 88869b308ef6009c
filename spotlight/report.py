"""What a run leaves behind: metrics JSONL, TensorBoard events, sample-grid PNGs and the reward plot.

Only writes files; knows nothing of how the numbers were produced.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image


class MetricsLog:
    """Append-only JSONL of one dict per event (iteration, evaluation)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_to_checkpoint(self, iteration: int) -> None:
        """Keep what a run had written when it saved its checkpoint after ``iteration`` iterations:
        the records of iterations before it and the evaluations up to it (the evaluation at
        ``iteration`` is of the checkpoint's weights); a run resumed from it writes the rest."""
        keep = [r for r in self.read() if r.get("iteration", -1) < iteration
                or (r.get("event") == "eval" and r.get("iteration") == iteration)]
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))


def save_grid(images: np.ndarray, path: Path, columns: int, scale: int = 4) -> None:
    """uint8 images [N, H, W, 3] tiled `columns` wide with a 1-px grey gutter, upscaled."""
    n, h, w, _ = images.shape
    rows = -(-n // columns)
    grid = np.full((rows * (h + 1) + 1, columns * (w + 1) + 1, 3), 64, dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, columns)
        grid[1 + r * (h + 1): 1 + r * (h + 1) + h, 1 + c * (w + 1): 1 + c * (w + 1) + w] = img
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST).save(path)


EVAL_CURVES = (  # metrics key, label: the headline first
    ("eval_ode_heldout", "ODE, held-out prompts (headline)"),
    ("eval_ode_train", "ODE, training prompts"),
    ("eval_sde_train", "SDE policy, training prompts"),
)


def plot_rewards(records: list[dict], path: Path) -> None:
    """Evaluation rewards (mean ± spread over eval seed sets: ODE on held-out prompts, ODE on
    training prompts, the SDE policy) and the rollout reward against iteration and wall time, the
    flow-matching drift against iteration, exploration (runs that explore) and the held-out reward
    not earned by cause (rewards with a `shortfall`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("event") == "iteration"]
    evals = [r for r in records if r.get("event") == "eval"]
    curves = [(k, label) for k, label in EVAL_CURVES if any(k in r for r in evals)] or [
        ("eval_reward", "held-out reward")
    ]
    explored = [r for r in train if "explore_requests" in r or "rank_consistency" in r]
    short = [r for r in evals if "eval_ode_heldout_shortfall" in r]
    panels = 3 + bool(explored) + bool(short)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8), constrained_layout=True)
    for ax, key, label in ((axes[0], "iteration", "iteration"), (axes[1], "wall_s", "wall time (s)")):
        if train:
            ax.plot(
                [r[key] for r in train],
                [r["reward_mean"] for r in train],
                lw=1,
                alpha=0.4,
                label="rollout reward (SDE, selected seeds)",
            )
        for metric, name in curves:
            ev = [r for r in evals if metric in r]
            if not ev:
                continue
            x = np.array([r[key] for r in ev])
            m = np.array([r[metric] for r in ev])
            s = np.array([r.get(f"{metric}_std", 0.0) for r in ev])
            ax.plot(x, m, "o-", lw=2.5 if metric in ("eval_ode_heldout", "eval_reward") else 1.5, label=name)
            ax.fill_between(x, m - s, m + s, alpha=0.2)
        ax.set_xlabel(label)
        ax.set_ylabel("compositional reward")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    drift = [r for r in evals if "fm_drift" in r]
    if drift:
        axes[2].plot([r["iteration"] for r in drift], [100 * r["fm_drift"] for r in drift], "o-", color="C3")
        axes[2].axhline(10, ls="--", color="grey", lw=1)
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("flow-matching loss vs base (%)")
    axes[2].set_title("drift on rendered scenes of the eval prompts", fontsize=9)
    axes[2].grid(alpha=0.3)
    if explored:
        plot_exploration(axes[3], train)
    if short:
        plot_shortfall(axes[-1], short)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_shortfall(ax, evals: list[dict]) -> None:
    """The held-out ODE reward not earned at each evaluation, stacked by cause (count, relation, and
    the shape loss by what filled each named slot): which failures RL is fixing, not only how many."""
    its = [r["iteration"] for r in evals]
    causes = sorted({k for r in evals for k in r["eval_ode_heldout_shortfall"]},
                    key=lambda k: -evals[0]["eval_ode_heldout_shortfall"].get(k, 0.0))
    causes = [k for k in causes if any(r["eval_ode_heldout_shortfall"].get(k, 0.0) for r in evals)]
    ax.stackplot(its, [[r["eval_ode_heldout_shortfall"].get(k, 0.0) for r in evals] for k in causes],
                 labels=causes, alpha=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward not earned (per sample)")
    ax.set_title("held-out ODE: what the reward still misses", fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    ax.grid(alpha=0.3)


def plot_exploration(ax, train: list[dict]) -> None:
    """Per iteration: the share of iteration time the trainer waited on exploration, and the rank
    consistency (Spearman) of stale/cached vs fresh/full candidate scores where it was checked."""
    its = [r["iteration"] for r in train]
    ax.plot(its, [100 * r["explore_s"] / max(r.get("iteration_s", 0.0), 1e-9) for r in train],
            lw=1, color="C1", label="trainer waiting on exploration (% of iteration)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("% of iteration time", color="C1")
    ax.set_ylim(bottom=0)
    checked = [r for r in train if not math.isnan(r.get("rank_consistency", math.nan))]
    if checked:
        twin = ax.twinx()
        twin.plot([r["iteration"] for r in checked], [r["rank_consistency"] for r in checked], "o",
                  color="C2", label="rank consistency (Spearman)")
        twin.set_ylim(-1, 1)
        twin.set_ylabel("Spearman, stale/cached vs fresh/full", color="C2")
    ax.set_title(f"exploration ({train[0].get('schedule', '?')})", fontsize=9)
    ax.grid(alpha=0.3)


TB_SCALARS = (  # metrics key -> TensorBoard tag, for the records that carry it
    ("reward_mean", "reward/mean"),
    ("group_spread", "reward/group_spread"),
    ("eval_ode_heldout", "eval/ode_heldout"),
    ("eval_ode_heldout_std", "eval/ode_heldout_spread"),
    ("eval_ode_train", "eval/ode_train"),
    ("eval_sde_train", "eval/sde_train"),
    ("fm_drift", "eval/fm_drift"),
    ("lr", "train/lr"),
    ("loss", "train/loss"),
    ("kl", "train/kl"),
    ("grad_norm", "train/grad_norm"),
    ("spot_nodes", "spot/nodes"),
    ("preemptions", "spot/preemptions"),
    ("steps_lost", "spot/steps_lost"),
    ("requests_resumed", "spot/requests_resumed"),
    ("gpu_s_reserved", "cost/gpu_s_reserved"),
    ("gpu_s_spot", "cost/gpu_s_spot"),
    ("cost_usd", "cost/usd"),
    ("rollout_s", "time/rollout_s"),
    ("train_s", "time/train_s"),
    ("explore_s", "time/explore_wait_s"),
    ("iteration_s", "time/iteration_s"),
)


class TensorBoardLog:
    """TensorBoard event files in a run folder, beside ``metrics.jsonl``: every record's scalars
    (``TB_SCALARS``, plus the exploration share, GPU-seconds and the planner's arm as its index in
    ``arms``) at step = the record's iteration, and each evaluation's sample grids as images.

    ``open`` returns None when asked not to write or when the ``tensorboard`` package is absent
    (torch's ``SummaryWriter`` needs it). ``purge_step``: a resumed run's first iteration; events
    logged at or past it by the interrupted run are dropped by TensorBoard's reader."""

    def __init__(self, out: Path, purge_step: int | None = None, arms: tuple[str, ...] = ()) -> None:
        self.out, self.arms, self.purge_step = out, arms, purge_step
        self._writer = None  # opened by the first record: a Loop built only to evaluate writes nothing

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if self.purge_step is None:  # a fresh run owns its folder's events, as it owns metrics.jsonl
                for old in (self.out / "tensorboard").glob("events.out.tfevents.*"):
                    old.unlink()
            self._writer = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=self.purge_step)
            if self.arms:
                self._writer.add_text("explore/arms", "planner_arm index: " + ", ".join(
                    f"{i} = {a}" for i, a in enumerate(self.arms)), 0)
        return self._writer

    @classmethod
    def open(cls, out: Path, enabled: bool, purge_step: int | None = None,
             arms: tuple[str, ...] = ()) -> TensorBoardLog | None:
        if not enabled:
            return None
        try:
            import tensorboard  # noqa: F401  (only whether it is there)
        except ImportError:
            return None
        return cls(out, purge_step, arms)

    def write(self, record: dict) -> None:
        step, add = int(record.get("iteration", 0)), self.writer.add_scalar
        for key, tag in TB_SCALARS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                add(tag, value, step)
        if record.get("event") == "iteration":
            if record.get("iteration_s"):
                add("explore/trainer_wait_share", record["explore_s"] / record["iteration_s"], step)
            if "gpu_s_reserved" in record:
                add("cost/gpu_s", record["gpu_s_reserved"] + record.get("gpu_s_spot", 0.0), step)
            arm = record.get("plan_arm")
            if arm is not None and arm in self.arms:
                add("explore/planner_arm", self.arms.index(arm), step)
        if record.get("event") == "eval":
            for suffix, tag in (("", "samples/ode_heldout"), ("_train", "samples/ode_train"),
                                ("_sde", "samples/sde_train")):
                grid = self.out / "samples" / f"eval_{step:04d}{suffix}.png"
                if grid.exists():
                    self.writer.add_image(tag, np.asarray(Image.open(grid).convert("RGB")), step,
                                          dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

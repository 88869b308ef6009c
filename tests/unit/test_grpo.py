"""GRPO update: advantages, ratio exactly 1 at the first inner step, full and LoRA both learn."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from spotlight import work
from spotlight.comm.messages import RolloutWork
from spotlight.errors import ConfigError
from spotlight.policy import sampler as S
from spotlight.policy.grpo import GRPOConfig, GRPOTrainer, advantages, batch_std, share
from spotlight.policy.seeds import ExploreConfig, candidate_seeds, select_contrast

SHAPE = (3, 16, 16)
PROMPTS = ["two red circles", "a green square above a yellow circle"]


def rollout_groups(model, cfg, seeds_per_prompt=4):
    """Groups with a reward the model can learn: brightness of the final image."""
    groups = []
    for i, p in enumerate(PROMPTS):
        seeds = candidate_seeds(0, 0, i, seeds_per_prompt)
        job = RolloutWork(prompt=p, seeds=seeds, version=0)
        st = S.sde_rollout(model, [p] * len(seeds), seeds, cfg, SHAPE)
        rewards = st.latents[-1].mean((1, 2, 3)).numpy()
        groups.append(work.group(job, *work.trajectory(st), rewards))
    return groups


def surrogate(trainer, groups):
    """The clipped surrogate on fixed data, without stepping (what the update minimises)."""
    steps = list(range(trainer.sampler.steps))
    total = 0.0
    with torch.no_grad():
        for g in groups:
            adv = advantages(g.rewards)
            text = trainer.model.encode([g.prompt] * len(g.seeds))
            for k in steps:
                lp, _, _ = S.step_log_prob(
                    trainer.model, g.latents[:, k], g.latents[:, k + 1], k, text, trainer.sampler
                )
                ratio = torch.exp(lp - g.log_probs[:, k])
                total += torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean().item()
    return total / (len(groups) * len(steps))


def test_advantages_are_group_normalised():
    a = advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert abs(float(a.mean())) < 1e-6 and abs(float(a.std(unbiased=False)) - 1) < 1e-3
    assert torch.equal(advantages(torch.tensor([0.5, 0.5, 0.5])), torch.zeros(3))


def test_batch_normalised_advantages_keep_the_groups_relative_sizes():
    """adv_norm = 'batch': a group whose samples differ by a sliver gets sliver-sized advantages,
    where the per-group std would blow it up to ±1 like a group with a missing object."""
    sliver, missing = torch.tensor([0.95, 0.96, 0.95, 0.96]), torch.tensor([1.0, 1.0, 0.5, 1.0])
    assert float(advantages(sliver).abs().max()) > 0.95  # per group: ±1 (less the 1e-4 epsilon)
    std = batch_std([sliver, missing])
    small, large = advantages(sliver, std=std), advantages(missing, std=std)
    assert float(small.abs().max()) < 0.1 < 1.0 < float(large.abs().max())
    both = torch.cat([small, large])
    assert float(both.pow(2).mean().sqrt()) == pytest.approx(1.0, abs=1e-3)  # unit scale over the batch
    assert abs(float(small.sum())) < 1e-6 and abs(float(large.sum())) < 1e-6  # zero-sum per group
    assert torch.equal(advantages(torch.tensor([0.5, 0.5]), std=std), torch.zeros(2))
    with pytest.raises(ConfigError, match="grpo.adv_norm"):
        GRPOConfig(adv_norm="global")


def test_the_trainer_uses_the_configured_advantage_scale(tiny_model):
    """Spreading one group's rewards 10x about its mean: (almost) no change to the update under
    the per-group std (it divides the spread back out), a different update under the batch's std."""
    cfg = S.SamplerConfig(steps=2)
    groups = rollout_groups(tiny_model, cfg)
    r = groups[0].rewards
    spread = [dataclasses.replace(groups[0], rewards=r.mean() + 10 * (r - r.mean())), *groups[1:]]

    def updated(norm, gs):
        model = copy.deepcopy(tiny_model)
        GRPOTrainer(model, GRPOConfig(lr=1e-3, adv_norm=norm, timestep_fraction=1.0), cfg).update(gs)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    moved_group = (updated("group", groups) - updated("group", spread)).norm()  # only the 1e-4 epsilon
    moved_batch = (updated("batch", groups) - updated("batch", spread)).norm()
    assert moved_batch > 1e-3 and moved_group < 0.05 * moved_batch, (moved_group, moved_batch)


@pytest.mark.parametrize(
    "cfg",
    [
        S.SamplerConfig(steps=3),
        S.SamplerConfig(steps=3, sde_steps=2, noise_level=0.6, noise_patch=4, sde_type="cps"),
    ],
    ids=["flow", "cps-blocks"],
)
def test_ratio_is_exactly_one_at_first_inner_step(tiny_model, cfg):
    trainer = GRPOTrainer(tiny_model, GRPOConfig(timestep_fraction=1.0), cfg)
    groups = rollout_groups(tiny_model, cfg)
    stats = trainer.update(groups)
    assert stats["ratio_dev"] == 0.0  # max |ρ − 1| over every sample and step of the first inner step
    assert stats["groups_trained"] == 2


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_updates_reduce_the_loss(tiny_model, finetune):
    cfg = S.SamplerConfig(steps=3)
    trainer = GRPOTrainer(
        tiny_model,
        GRPOConfig(
            finetune=finetune,
            lr=2e-2 if finetune == "lora" else 3e-3,
            timestep_fraction=1.0,
            clip_range=0.2,
            beta=0.01,
        ),
        cfg,
    )
    groups = rollout_groups(tiny_model, cfg)
    before = surrogate(trainer, groups)
    for _ in range(8):
        trainer.update(groups)
    after = surrogate(trainer, groups)
    assert before == pytest.approx(0.0, abs=1e-6)  # ratio 1 and zero-mean advantages
    assert after < before - 0.01, (before, after)
    if finetune == "lora":
        trained = [n for n, p in tiny_model.named_parameters() if p.requires_grad]
        assert trained and all("lora" in n for n in trained)


def test_kl_is_zero_at_reference_and_positive_after_training(tiny_model):
    cfg = S.SamplerConfig(steps=2)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(beta=0.1, lr=1e-3, timestep_fraction=1.0), cfg)
    groups = rollout_groups(tiny_model, cfg)
    assert trainer.update(groups)["kl"] == 0.0
    assert trainer.update(groups)["kl"] > 0.0


def test_seed_selection_keeps_extremes():
    seeds = [10, 11, 12, 13, 14, 15]
    rewards = np.array([0.5, 0.9, 0.1, 0.7, 0.2, 0.95])
    assert select_contrast(seeds, rewards, 4) == [15, 11, 14, 12]  # two highest, then two lowest
    with pytest.raises(ConfigError, match="even"):
        select_contrast(seeds, rewards, 3)
    assert len(set(candidate_seeds(0, 1, 2, 64))) == 64
    assert candidate_seeds(0, 1, 2, 4) == candidate_seeds(0, 1, 2, 4) != candidate_seeds(0, 2, 2, 4)


def test_configs_reject_impossible_values():
    with pytest.raises(ConfigError, match="grpo.finetune"):
        GRPOConfig(finetune="qlora")
    with pytest.raises(ConfigError, match="grpo.lr"):
        GRPOConfig(lr=0)
    with pytest.raises(ConfigError, match="explore.candidates"):
        ExploreConfig(candidates=1)


def awm_surrogate(model, groups, seed=7):
    """Σ A_i·‖v(x_t) − (ε − x_0,i)‖² on fixed (ε, t): what objective 'awm' lowers."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for g in groups:
            x0 = g.latents[:, -1].clamp(-1, 1)
            eps = torch.randn(x0.shape, generator=gen)
            t = torch.sigmoid(torch.randn(x0.shape[0], generator=gen))
            xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
            v = model.velocity(xt, t, model.encode([g.prompt] * len(g.seeds)))
            err = (v - (eps - x0)).pow(2).flatten(1).mean(1)
            total += float((advantages(g.rewards) * err).mean())
    return total / len(groups)


def test_awm_pulls_in_positive_samples_and_pushes_away_negative(tiny_model):
    cfg = S.SamplerConfig(steps=3)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(objective="awm", lr=3e-3, beta=0.01, awm_times=4), cfg)
    groups = rollout_groups(tiny_model, cfg)
    before = awm_surrogate(tiny_model, groups)
    first = trainer.update(groups)
    assert first["kl"] == 0.0 and first["groups_trained"] == 2  # the reference is the base
    for _ in range(7):
        stats = trainer.update(groups)
    assert stats["kl"] > 0.0
    assert awm_surrogate(tiny_model, groups) < before - 1e-3


def test_awm_column_credit_weights_pixels_by_their_column(tiny_model):
    """awm_credit = 'columns': without maps (or with each sample's reward at every column) the
    update is the per-sample one; a map that moves credit between columns changes it, and the
    column-weighted loss falls as the per-sample one does."""
    cfg = S.SamplerConfig(steps=2)
    groups = rollout_groups(tiny_model, cfg)
    width = SHAPE[-1]

    def trained(mode, groups, updates=1):
        model = copy.deepcopy(tiny_model)
        trainer = GRPOTrainer(model, GRPOConfig(objective="awm", awm_times=2, beta=0.1, lr=3e-3,
                                                awm_credit=mode), cfg)
        for _ in range(updates):
            trainer.update(groups)
        return model, torch.cat([p.detach().flatten() for p in model.parameters()])

    _, per_sample = trained("sample", groups)
    flat = [dataclasses.replace(g, credit=g.rewards[:, None].repeat(1, width)) for g in groups]
    for same in (groups, flat):
        # the same update up to float rounding: the column loss sums the same terms in another
        # order, and Adam's first step ~lr·sign(g) can turn a near-zero gradient's rounding into a
        # visible step (2e-6 on 2 of 67k weights seen); another credit moves most weights by ~lr
        d = (trained("columns", same)[1] - per_sample).abs()
        assert d.max() < 1e-4 and int((d > 1e-6).sum()) <= 1e-3 * d.numel()
    # credit on the left half only: the right half of every image carries no advantage
    left = [dataclasses.replace(g, credit=torch.cat([g.rewards[:, None].repeat(1, width // 2),
                                                      torch.zeros(len(g.seeds), width - width // 2)], 1))
            for g in groups]
    model, moved = trained("columns", left, updates=8)
    assert not torch.allclose(moved, per_sample, atol=1e-6)
    assert _column_surrogate(model, left) < _column_surrogate(tiny_model, left) - 1e-4

    # every sample scores the same, each with a different letter right: a signal under 'columns' only
    even = [dataclasses.replace(g, rewards=torch.full_like(g.rewards, 0.5),
                                credit=torch.eye(len(g.seeds), width))
            for g in groups]
    cols = GRPOTrainer(copy.deepcopy(tiny_model), GRPOConfig(objective="awm", awm_credit="columns"), cfg)
    assert cols.plan([g.rewards for g in even], [g.credit for g in even])[1] == list(range(len(even)))
    assert cols.plan([g.rewards for g in even])[1] == []  # without the maps: nothing to learn
    assert cols.update(even)["groups_trained"] == len(even)
    per = GRPOTrainer(copy.deepcopy(tiny_model), GRPOConfig(objective="awm", awm_credit="sample"), cfg)
    assert per.update(even)["groups_trained"] == 0.0


def _column_surrogate(model, groups):
    """Σ per-column advantage × flow-matching error on fixed (ε, t) draws (what 'columns' lowers)."""
    from spotlight.policy.grpo import column_advantages

    total = 0.0
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for g in groups:
            x0 = g.latents[:, -1].clamp(-1, 1)
            eps = torch.randn(x0.shape, generator=gen)
            t = torch.rand(x0.shape[0], generator=gen)
            xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
            v = model.velocity(xt, t, model.encode([g.prompt] * len(g.seeds)))
            amap = column_advantages(g.credit, x0.shape[-1])[:, None, None, :]
            total += float((amap * (v - (eps - x0)).pow(2)).mean())
    return total / len(groups)


def test_awm_config_is_validated():
    with pytest.raises(ConfigError, match="grpo.objective"):
        GRPOConfig(objective="dpo")
    with pytest.raises(ConfigError, match="grpo.awm_times"):
        GRPOConfig(objective="awm", awm_times=0)
    with pytest.raises(ConfigError, match="grpo.awm_time_dist"):
        GRPOConfig(objective="awm", awm_time_dist="beta")
    with pytest.raises(ConfigError, match="grpo.awm_negative"):
        GRPOConfig(objective="awm", awm_negative=-1.0)
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="grpo.awm_time_min"):
            GRPOConfig(objective="awm", awm_time_min=bad)
    with pytest.raises(ConfigError, match="grpo.awm_rollout_noise"):
        GRPOConfig(objective="awm", awm_rollout_noise=1.5)
    with pytest.raises(ConfigError, match="grpo.warmup_iterations"):
        GRPOConfig(warmup_iterations=-1)


@pytest.mark.parametrize("dist", ["uniform", "logit_normal"])
def test_awm_time_min_trains_only_the_high_noise_levels(tiny_model, dist, monkeypatch):
    """grpo.awm_time_min: every (x_t, t) the AWM loss and its KL see has t in [awm_time_min, 1];
    without it the same seeded draws reach below it."""
    cfg = S.SamplerConfig(steps=2)
    groups = rollout_groups(tiny_model, cfg)
    seen: dict[float, list[float]] = {}
    velocity = type(tiny_model).velocity
    for t_min in (0.0, 0.6):
        model = copy.deepcopy(tiny_model)
        trainer = GRPOTrainer(model, GRPOConfig(objective="awm", awm_times=4, awm_time_dist=dist,
                                                awm_time_min=t_min, beta=0.5), cfg)
        times = seen.setdefault(t_min, [])

        def spy(self, x, t, text, times=times):
            times.extend(t.flatten().tolist())
            return velocity(self, x, t, text)

        monkeypatch.setattr(type(tiny_model), "velocity", spy)
        trainer.update(groups)
        trainer.update(groups)
        monkeypatch.setattr(type(tiny_model), "velocity", velocity)
    assert len(seen[0.6]) == len(seen[0.0]) > 0
    assert min(seen[0.6]) >= 0.6 and max(seen[0.6]) <= 1.0
    assert min(seen[0.0]) < 0.6


@pytest.mark.parametrize("shared", [True, False])
def test_awm_rollout_noise_renoises_each_image_with_its_own_x1(tiny_model, shared, monkeypatch):
    """grpo.awm_rollout_noise = 0.5 of 4 draws: two copies of each image are re-noised with the
    noise its rollout started from (x_t on the line x_1 -> x_0), the other two with fresh noise."""
    cfg = S.SamplerConfig(steps=2)
    groups = rollout_groups(tiny_model, cfg)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(objective="awm", awm_times=4, awm_rollout_noise=0.5,
                                                 awm_shared_noise=shared), cfg)
    inputs = []
    velocity = type(tiny_model).velocity

    def spy(self, x, t, text):
        if self is tiny_model:
            inputs.append((x.detach().clone(), t.detach().clone()))
        return velocity(self, x, t, text)

    monkeypatch.setattr(type(tiny_model), "velocity", spy)
    trainer.update(groups)
    assert len(inputs) == len(groups)
    for g, (xt, t) in zip(groups, inputs, strict=True):
        G = len(g.seeds)
        x0, x1 = g.latents[:, -1].clamp(-1, 1), g.latents[:, 0]
        tt = t[:, None, None, None]
        line = (1 - tt) * x0.repeat(4, 1, 1, 1) + tt * x1.repeat(4, 1, 1, 1)
        on_line = (xt - line).flatten(1).abs().amax(1) < 1e-5
        assert on_line[: 2 * G].all() and not on_line[2 * G :].any()


def test_warmup_ramps_the_learning_rate(tiny_model):
    cfg = S.SamplerConfig(steps=2)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-3, warmup_iterations=4, timestep_fraction=1.0), cfg)
    groups = rollout_groups(tiny_model, cfg)
    lrs = []
    for _ in range(5):
        trainer.update(groups)
        lrs.append(trainer.opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_cosine_decay_after_the_warmup(tiny_model):
    """grpo.decay_iterations: lr·(decay_to + (1 − decay_to)·½(1 + cos(π·i/N))), times the warm-up's
    ramp, held at lr·decay_to from iteration N on; each update's lr is in its stats."""
    cfg = S.SamplerConfig(steps=2)
    grpo = GRPOConfig(objective="awm", awm_times=1, lr=1e-3, warmup_iterations=2, decay_iterations=4,
                      decay_to=0.2)
    trainer = GRPOTrainer(tiny_model, grpo, cfg)
    groups = rollout_groups(tiny_model, cfg)
    lrs = [trainer.update(groups)["lr"] for _ in range(6)]
    cosine = [0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(5)]
    expected = [1e-3 * min(1, (i + 1) / 2) * (0.2 + 0.8 * cosine[min(i, 4)]) for i in range(6)]
    assert lrs == pytest.approx(expected) and lrs[-2:] == pytest.approx([2e-4, 2e-4])
    with pytest.raises(ConfigError, match="grpo.decay_to"):
        GRPOConfig(decay_to=1.5)
    with pytest.raises(ConfigError, match="grpo.decay_iterations"):
        GRPOConfig(decay_iterations=-1)


def test_moving_average_follows_the_trained_weights(tiny_model):
    """grpo.ema_decay: after each optimizer step ema ← d·ema + (1 − d)·θ; it starts at the base and
    the online weights are trained as without it."""
    import copy

    cfg = S.SamplerConfig(steps=2)
    base = copy.deepcopy(tiny_model)
    plain = GRPOTrainer(copy.deepcopy(tiny_model), GRPOConfig(objective="awm", lr=1e-3, awm_times=1), cfg)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(objective="awm", lr=1e-3, awm_times=1, ema_decay=0.75), cfg)
    assert plain.ema is None
    groups = rollout_groups(tiny_model, cfg)
    expected = [p.detach().clone() for p in base.parameters()]
    for _ in range(3):
        plain.update(groups)
        trainer.update(groups)
        expected = [0.75 * e + 0.25 * p.detach() for e, p in zip(expected, tiny_model.parameters())]
    for p, q in zip(tiny_model.parameters(), plain.model.parameters()):
        assert torch.equal(p, q)  # the average does not change what is trained
    ema = list(trainer.ema.parameters())
    assert any(not torch.equal(e, b) for e, b in zip(ema, base.parameters()))  # it moved...
    assert not all(torch.equal(e, p) for e, p in zip(ema, tiny_model.parameters()))  # ...behind θ
    for e, x in zip(trainer.ema.parameters(), expected):
        torch.testing.assert_close(e, x, rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="grpo.ema_decay"):
        GRPOConfig(ema_decay=1.0)


def test_adaptive_beta_rises_past_the_target_and_falls_back_to_its_floor(tiny_model):
    """grpo.kl_target: after each update β ← β·(1 + clip(kl/target − 1, ±0.2)·n/horizon), never below
    grpo.beta; the update uses the β it had before."""
    cfg = S.SamplerConfig(steps=2)
    groups = rollout_groups(tiny_model, cfg)
    n = sum(len(g.seeds) for g in groups)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(objective="awm", lr=1e-3, awm_times=1, beta=0.5,
                                                 kl_target=1e-12, kl_horizon=4 * n), cfg)
    first = trainer.update(groups)  # the model is still the reference: kl = 0, under the target
    assert first["kl"] == 0.0 and first["beta"] == 0.5 and trainer.beta == 0.5  # floor
    betas = []
    for _ in range(3):
        stats = trainer.update(groups)
        assert stats["kl"] > 1e-10  # far past the target: the error is clipped at +0.2
        betas.append(stats["beta"])
    assert betas == pytest.approx([0.5, 0.5 * 1.05, 0.5 * 1.05**2])
    assert trainer.beta == pytest.approx(0.5 * 1.05**3)
    trainer.cfg.kl_target = 1e6  # far under it: falls 5% an update, down to the floor and no lower
    for _ in range(2):
        trainer.update(groups)
    assert trainer.beta == pytest.approx(0.5 * 1.05**3 * 0.95**2)
    for _ in range(2):
        trainer.update(groups)
    assert trainer.beta == 0.5
    fixed = GRPOTrainer(tiny_model, GRPOConfig(objective="awm", lr=1e-3, awm_times=1, beta=0.5), cfg)
    fixed.update(groups)
    assert fixed.beta == 0.5  # kl_target = 0: β stays
    with pytest.raises(ConfigError, match="grpo.kl_target needs grpo.beta"):
        GRPOConfig(kl_target=0.01)
    with pytest.raises(ConfigError, match="grpo.kl_horizon"):
        GRPOConfig(beta=1, kl_target=0.01, kl_horizon=0)


def test_push_limit_stops_pushing_a_sample_away_past_the_reference(tiny_model):
    """grpo.awm_push_limit: a below-average sample's flow-matching error stops growing once it is
    past the reference's by the limit; without it the push goes on."""
    import copy

    cfg = S.SamplerConfig(steps=3)
    groups = rollout_groups(tiny_model, cfg)
    gen = torch.Generator().manual_seed(11)
    worst = [g.latents[int(g.rewards.argmin()), -1] for g in groups]  # each group's lowest reward
    x0 = torch.stack(worst).clamp(-1, 1)
    eps, t = torch.randn(x0.shape, generator=gen), torch.full((len(x0),), 0.5)
    xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
    text_of = lambda m: m.encode([g.prompt for g in groups])  # noqa: E731

    def error(model) -> float:
        with torch.no_grad():
            return float((model.velocity(xt, t, text_of(model)) - (eps - x0)).pow(2).mean())

    base = error(tiny_model)
    grown, stopped = {}, []
    for limit in (0.0, 0.05):
        model = copy.deepcopy(tiny_model)
        grpo = GRPOConfig(objective="awm", lr=3e-3, awm_times=4, awm_push_limit=limit)
        trainer = GRPOTrainer(model, grpo, cfg)
        for _ in range(8):
            stats = trainer.update(groups)
            stopped.append(stats["push_stopped"])
        grown[limit] = error(model) / base - 1
    assert grown[0.0] > 0.2, grown  # pushed away without a limit...
    assert grown[0.05] < 0.5 * grown[0.0], grown  # ...and held near the limit with one
    assert max(stopped) > 0
    with pytest.raises(ConfigError, match="grpo.awm_push_limit"):
        GRPOConfig(awm_push_limit=-0.1)


@pytest.mark.parametrize("chunk,world", [([4, 7, 9], 1), ([4, 7, 9], 2), ([5], 4), (list(range(10)), 3)])
def test_share_trains_each_group_once_and_gives_every_rank_the_same_passes(chunk, world):
    """The sharded trainer's split of one optimizer step's groups: each group on one rank with
    weight 1; ranks with fewer pad with weight-0 repeats, so all run the same number of passes."""
    shares = [share(chunk, r, world) for r in range(world)]
    assert sorted(gi for s in shares for gi, w in s if w == 1.0) == sorted(chunk)
    assert {len(s) for s in shares} == {-(-len(chunk) // world)}
    assert all(gi in chunk and w in (0.0, 1.0) for s in shares for gi, w in s)
    assert share(chunk, 0, 1) == [(gi, 1.0) for gi in chunk]  # one process: the chunk itself


def test_trainer_section_is_validated():
    from spotlight.recipe import load_recipe

    with pytest.raises(ConfigError, match="trainer.ranks must be >= 1"):
        load_recipe("tiny", ["trainer.ranks=0"])
    with pytest.raises(ConfigError, match="trainer.timeout_s must be > 0"):
        load_recipe("tiny", ["trainer.timeout_s=0"])
    with pytest.raises(ConfigError, match="grpo.ema_decay > 0 is not supported with trainer.ranks > 1"):
        load_recipe("tiny", ["trainer.ranks=2"])  # tiny keeps a moving average
    with pytest.raises(ConfigError, match="run.mode 'sim' trains no model"):
        load_recipe("tiny", ["trainer.ranks=2", "grpo.ema_decay=0", "run.mode=sim"])
    assert load_recipe("tiny", ["trainer.ranks=2", "grpo.ema_decay=0"]).trainer.ranks == 2

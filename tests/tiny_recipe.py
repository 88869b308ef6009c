"""The tiny model and sampler the runtime tests share: overrides of the demo recipe that make a
request take milliseconds and pin every sampler field, so a test does not depend on the demo's
sampler or objective (`from tiny_recipe import TINY_MODEL`; tests/ is on sys.path through its
conftest). The runtime tests were written against the policy-gradient objective with a shared x_1
per group (lr 1e-4, KL β=30, no warm-up); the demo recipe now trains with advantage-weighted
matching on near-ODE rollouts, so those are pinned here too."""

TINY_MODEL = [
    "model.checkpoint=none",
    "model.layers=1",
    "model.heads=2",
    "model.head_dim=16",
    "model.image_size=16",
    "model.patch=4",
    "sampler.steps=3",
    "sampler.sde_steps=none",
    'sampler.sde_type="flow"',
    "sampler.noise_level=0.7",
    "sampler.shared_init=true",
    'grpo.objective="grpo"',
    "grpo.lr=1e-4",
    "grpo.beta=30.0",
    "grpo.warmup_iterations=0",
]

"""The tiny model and sampler the runtime tests share: overrides of the demo recipe that make a
request take milliseconds and pin every sampler field, so a test does not depend on the demo's
sampler (`from tiny_recipe import TINY_MODEL`; tests/ is on sys.path through its conftest)."""

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
]

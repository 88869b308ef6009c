#!/usr/bin/env bash
# bash scripts/demo_prefix_vs_69e7a3c.sh — the demo's first 5 iterations with this code but the recipe values,
# reward and base of 69e7a3c (before issue 7), compared with a run of 69e7a3c itself saved in /tmp/before7
# (made with: git worktree add /tmp/wt_before 69e7a3c; in it: spotlight run tiny run.iterations=5
# run.out_dir=/tmp/before7 run.eval_every=100). Prints whether every rollout reward is identical.
set -e
ROOT="$(git rev-parse --show-toplevel)"
rm -rf /tmp/wt_after /tmp/after7
git -C "$ROOT" worktree add -f /tmp/wt_after HEAD >/dev/null
cd /tmp/wt_after
git checkout 69e7a3c -- spotlight/rewards/compositional.py spotlight/assets/base.safetensors
"$ROOT"/.venv/bin/python -c "
import sys; sys.path.insert(0, '/tmp/wt_after')
from spotlight.cli import main
sys.exit(main(['run', 'tiny', '--no-progress', 'run.iterations=5', 'run.out_dir=\"/tmp/after7\"', 'run.eval_every=100',
  'run.prompts=\"demo\"', 'run.eval_samples=2', 'run.eval_seeds=1',
  'sampler.steps=10', 'sampler.noise_level=1.0', 'sampler.sde_steps=2', 'sampler.noise_patch=8', 'sampler.shared_init=true',
  'sampler.sde_type=\"flow\"', 'sampler.eval_steps=20',
  'grpo.lr=3e-4', 'grpo.adam_eps=1e-4', 'grpo.clip_range=0.2', 'grpo.beta=0.0', 'grpo.timestep_fraction=1.0', 'grpo.finetune=\"full\"',
  'explore.schedule=\"critical\"', 'explore.candidates=16', 'reward.name=\"compositional\"']))
"
"$ROOT"/.venv/bin/python - <<'PY'
import json
def its(path):
    return [json.loads(l) for l in open(path) if json.loads(l)["event"] == "iteration"]
a, b = its("/tmp/before7/tiny/metrics.jsonl"), its("/tmp/after7/tiny/metrics.jsonl")
for x, y in zip(a, b):
    print(x["iteration"], f"{x['reward_mean']:.6f}", f"{y['reward_mean']:.6f}", "identical" if x["rewards"] == y["rewards"] else "DIFFERENT")
print("all 5 identical:", len(a) == len(b) == 5 and all(x["rewards"] == y["rewards"] for x, y in zip(a, b)))
PY

#!/usr/bin/env bash
# One GPU session (< 8 minutes on one H200): every GPU path once, and the base model pretrained on
# the GPU alongside. Run from the repository root on a CUDA machine whose python3 has torch; writes
# its logs and the pretrained bases under $OUT (default runs/gpu_session).
#
#   OUT=/tmp/out bash scripts/gpu_session.sh
#
# 1. two pretrainings start in the background (the renderer, on 12 CPU processes, is their
#    bottleneck): the shipped base continued with 4x the CPU batch, and the same size from scratch;
# 2. meanwhile, in the foreground: bench/gpu_check.py (its table), the `gpu`-marked tests, a tiny
#    in-process run with run.device=cuda, and the demo recipe through the runtime on the GPU;
# 3. the pretrainings are waited for; each saves <name>.safetensors under $OUT.
set -u
OUT=${OUT:-runs/gpu_session}
MIN=${PRETRAIN_MINUTES:-5}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"

stamp "pretraining in the background: $MIN minutes each"
$py -m spotlight.cli pretrain --device cuda --workers 6 --batch-size 256 --lr 5e-4 --minutes "$MIN" \
    --out "$OUT/base_cont.safetensors" 'model.checkpoint="builtin:base"' >"$OUT/pretrain_cont.log" 2>&1 &
p1=$!
$py -m spotlight.cli pretrain --device cuda --workers 6 --batch-size 256 --lr 1e-3 --minutes "$MIN" --seed 1 \
    --out "$OUT/base_scratch.safetensors" >"$OUT/pretrain_scratch.log" 2>&1 &
p2=$!

stamp "gpu_check"
timeout 240 $py bench/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
stamp "gpu-marked tests"
timeout 120 $py -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_device.py 2>&1 | tail -15
stamp "tiny, in-process, run.device=cuda"
timeout 150 $py -m spotlight.cli run tiny --no-progress run.device='"cuda"' run.iterations=4 run.eval_every=4 \
    run.eval_seeds=1 run.out_dir='"/tmp/gpu_runs"' 2>&1 | tail -25
stamp "demo recipe through the runtime, run.device=cuda"
timeout 150 $py -m spotlight.cli run demo --no-progress run.device='"cuda"' run.iterations=3 run.eval_every=3 \
    run.eval_seeds=1 run.out_dir='"/tmp/gpu_runs_rt"' 2>&1 | tail -25
grep -h '"event": "iteration"' /tmp/gpu_runs*/tiny/metrics.jsonl 2>/dev/null | cut -c1-400 > "$OUT/iterations.jsonl"

stamp "waiting for the pretrainings"
wait $p1 $p2
tail -4 "$OUT/pretrain_cont.log" "$OUT/pretrain_scratch.log"
rm -f "$OUT"/*m.safetensors  # the 5-minute snapshots: the finals are enough
stamp "done"

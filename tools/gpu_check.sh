#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one short script (minutes), printing what ran and its figures:
#   1. the FSDP2 learner in bf16 on the Qwen2.5-0.5B shape (random weights): step time, tokens/s,
#      peak GPU memory, and a weight push gathered from the GPU;
#   2. the NCCL weight broadcast (weights.backend=nccl) between learner rank 0 and a generator:
#      needs two GPUs (NCCL puts one rank per GPU); skipped with a message on one;
#   3. `asyncgrpo train` end to end on the GPU (vLLM and the learner sharing it) on the small
#      full-vocabulary shape, with the vLLM-vs-learner probe as a check;
#   4. the same run as LoRA (rank 16), the generator merging adapter pushes against serving them
#      through vLLM's LoRA path (rollout.lora_apply=merge|vllm): samples/s and the probe of each.
# Run from the repository root on a machine with the project installed (`make install`).
#     bash tools/gpu_check.sh [OUT_DIR]
# The models are built once under OUT_DIR (default runs/gpu_check) and kept; each call's runs go to a
# new OUT_DIR/<date-time> folder, so that a second call never meets the first one's run directories.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
PY=${PY:-.venv/bin/python}
RUNS="$OUT/$(date +%Y%m%d-%H%M%S)"
if [ -e "$RUNS" ]; then echo "gpu_check: $RUNS exists already (two calls in one second?)" >&2; exit 2; fi
mkdir -p "$RUNS"
echo "runs in $RUNS"
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)

echo "== 1. FSDP2 learner, bf16, Qwen2.5-0.5B shape"
[ -f "$OUT/qwen2.5-0.5b/config.json" ] || $PY -m asyncgrpo.cli make-model qwen2.5-0.5b "$OUT/qwen2.5-0.5b"
$PY - "$OUT" "$RUNS" <<'EOF'
import json, sys, time
import torch
sys.path.insert(0, "tests/integration")
from learner_fixtures import step_groups
from asyncgrpo.config import load
from asyncgrpo.learner.learner import Learner

out, runs = sys.argv[1], sys.argv[2]
cfg = load(["device=cuda", "learner.mixed_precision=bf16", "learner.warmup_steps=0", f"model.path={out}/qwen2.5-0.5b",
            f"run_dir={runs}/learner", "learner.micro_batch_tokens=4096"])
learner = Learner.from_config(cfg, f"{out}/qwen2.5-0.5b")
times = []
for groups in step_groups(6, num_groups=16):
    torch.cuda.synchronize(); start = time.perf_counter()
    metrics = learner.train_on(groups)
    torch.cuda.synchronize(); times.append(time.perf_counter() - start)
start = time.perf_counter()
named = list(learner.policy.full_state_dict())
gather_s = time.perf_counter() - start
print(json.dumps({"check": "learner_bf16_0.5b", "step_s": times[1:], "tokens_per_step": metrics["perf/tokens"],
                  "loss_finite": all(v == v for v in metrics.values() if isinstance(v, float)),
                  "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "gather_s": gather_s, "tensors": len(named)}))
learner.close()
EOF

echo "== 2. NCCL weight broadcast"
if [ "$GPUS" -ge 2 ]; then
  $PY -m pytest -q -p no:cacheprovider tests/integration/test_weights_nccl.py
  $PY -m asyncgrpo.cli train run_dir="$RUNS/nccl" progress=false device=cuda weights.backend=nccl train.max_steps=6 \
      eval.at_start=false eval.at_end=false train.export_at_end=false
else
  echo "skipped: $GPUS GPU(s); NCCL needs one GPU per rank (learner rank 0 and a generator)"
fi

echo "== 3. asyncgrpo train on the GPU, full-vocabulary shape"
[ -f "$OUT/tiny-fullvocab/config.json" ] || $PY -m asyncgrpo.cli make-model tiny-fullvocab "$OUT/tiny-fullvocab"
$PY -m asyncgrpo.cli train run_dir="$RUNS/train" progress=false device=cuda model.path="$OUT/tiny-fullvocab" \
    task.name=gsm8k data.train_files=[tests/data/gsm8k_sample.jsonl] data.chat_template=true task.eval_size=3 \
    model.max_positions=512 rollout.max_new_tokens=256 rollout.kv_cache_gib=2 train.max_steps=10 \
    "reward.terms=[{name:letters,kind:format,pattern:'[a-z]'}]"
$PY - "$RUNS" <<'EOF'
import json, sys
summary = json.load(open(f"{sys.argv[1]}/train/summary.json"))
print(json.dumps({"check": "train_gpu", "status": summary["status"], "samples_per_s": summary["samples_per_s"],
                  "probe": summary["probe"], "learner_peak_gpu_mib": summary["learner"].get("peak_gpu_allocated_mib")}))
EOF

echo "== 4. LoRA on the GPU: adapters merged in place vs vLLM's LoRA path"
for APPLY in merge vllm; do
  $PY -m asyncgrpo.cli train run_dir="$RUNS/lora_$APPLY" progress=false device=cuda model.path="$OUT/tiny-fullvocab" \
      task.name=gsm8k data.train_files=[tests/data/gsm8k_sample.jsonl] data.chat_template=true task.eval_size=3 \
      model.max_positions=512 rollout.max_new_tokens=256 rollout.kv_cache_gib=2 train.max_steps=10 \
      "reward.terms=[{name:letters,kind:format,pattern:'[a-z]'}]" learner.lora.rank=16 learner.lora.alpha=32 \
      rollout.lora_apply=$APPLY
  $PY - "$RUNS" "$APPLY" <<'EOF'
import json, sys
summary = json.load(open(f"{sys.argv[1]}/lora_{sys.argv[2]}/summary.json"))
print(json.dumps({"check": f"lora_{sys.argv[2]}_gpu", "status": summary["status"],
                  "samples_per_s": summary["samples_per_s"], "probe": summary["probe"]}))
EOF
done

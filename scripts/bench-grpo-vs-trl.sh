#!/usr/bin/env bash
# GRPO with LoRA: tunestudio vs TRL's GRPOTrainer + PEFT, side by side on this machine, in one run.
# The SmolLM2-135M shape (random init, the same weights on both sides), LoRA r LORA_R (default 16,
# alpha 2r) on all linear layers, fp32, one prompt per step with its G (default 8) completions
# sampled in-process (tunestudio's own KV-cache generation; TRL through transformers' `generate`,
# no vLLM), temperature 1, top-p 1, no top-k, beta 0, loss `dapo`, one iteration per sampled
# block, activation checkpointing on both sides when CHECKPOINTING is 1 (the default: TRL's
# GRPOConfig default), THREADS threads (default 2). The prompts are
# arithmetic questions the script writes ("What is 17 + 25? Answer with the number.") in TRL's
# conversational format with an `answer` column, so both sides apply the chat template; the
# reward is the same rule on both sides (tunestudio's `accuracy` on `answer`, TRL a Python
# function: the last `\boxed{}` or number of the completion against the answer). Random weights
# almost never sample EOS, so every completion runs to MAX_COMPLETION (default 64) tokens on both
# sides (the script prints each side's mean completion length to show it). Runs are interleaved
# (tunestudio, TRL, ...) so drift in the machine's speed hits both; each run is STEPS (default 4)
# steps and its first step is the warm-up: prompts/s is (STEPS - 1) prompts over the seconds of
# steps 2..STEPS, generation included (tunestudio's `elapsed_secs` in metrics.jsonl, TRL's
# `on_step_end` times). Peak RSS is the process's (`/usr/bin/time` for tunestudio, `ru_maxrss`
# for TRL); each process's CPU seconds (user + system, load included) are printed too, as a check
# on a machine shared with other work. TRL's seconds in `generate` are timed too, so its split between generation and the
# training step shows.
#
#   scripts/bench-grpo-vs-trl.sh [ROUNDS=2]
#
# Also: MODEL_DIR (a real model folder instead of random weights), STEPS, G, MAX_PROMPT (default 128), MAX_COMPLETION, LORA_R, THREADS, CHECKPOINTING, NICE (a niceness for
# both sides' runs, default 0). PyTorch, transformers, PEFT and TRL come from PyPI into
# TUNESTUDIO_TORCH_VENV (default target/torch-venv).
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${1:-2}"
STEPS="${STEPS:-4}"
G="${G:-8}"
MAX_PROMPT="${MAX_PROMPT:-128}"
MAX_COMPLETION="${MAX_COMPLETION:-64}"
LORA_R="${LORA_R:-16}"
THREADS="${THREADS:-2}"
NICE="${NICE:-0}"
CHECKPOINTING="${CHECKPOINTING:-1}"
SHARED="${TUNESTUDIO_SHARED:-$(cd .. && pwd)/shared}"
VENV="${TUNESTUDIO_TORCH_VENV:-target/torch-venv}"
WORK=target/bench-grpo
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
[ "$STEPS" -ge 2 ] || { echo "STEPS must be at least 2 (the first step is the warm-up)"; exit 1; }

# TUNESTUDIO_BIN: a release binary built elsewhere (else this checkout's, built now).
BIN="${TUNESTUDIO_BIN:-}"
if [ -z "$BIN" ]; then
  cargo build --release --bin tunestudio || exit 1
  BIN=target/release/tunestudio
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || { echo "cannot create a venv at $VENV"; exit 1; }
if ! "$VENV/bin/python" -c "import torch, transformers, peft, trl, datasets" 2>/dev/null; then
  echo "installing torch, transformers, peft, trl and datasets from PyPI into $VENV ..."
  "$VENV/bin/pip" install -q torch transformers peft trl datasets || { echo "pip could not install them"; exit 1; }
fi
"$VENV/bin/python" -c 'import torch, transformers, peft, trl; print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, trl {trl.__version__}")'

# One model folder for both: the SmolLM2-135M config, SmolLM2's tokenizer and chat template
# (the tiny Llama fixture's), and random weights written once by PyTorch (seed 0). MODEL_DIR, a
# real model folder (config.json, tokenizer, *.safetensors: e.g. SmolLM2-135M-Instruct from the
# hub), replaces all of it, so the accuracy reward can rise (each side prints its rewards by step).
rm -rf "$WORK/model"
mkdir -p "$WORK/model"
if [ -n "${MODEL_DIR:-}" ]; then
  cp -rL "$MODEL_DIR"/. "$WORK/model/"
else
  cp "$SHARED/model-configs/smollm2-135m.json" "$WORK/model/config.json"
  for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp -f "$SHARED/fixtures/tiny-llama/$f" "$WORK/model/$f"
  done
fi
# More prompts than steps, so neither side's sampler runs out (each side shuffles with its seed;
# every prompt has the same token count, so which prompts a side draws does not change its work).
picked=$("$VENV/bin/python" scripts/trl_grpo_step.py prepare "$WORK/model" "$((STEPS > 16 ? STEPS : 16))" \
  "$WORK/prompts.json" 2>/dev/null | tail -n 1)
echo "prompts: $picked"

tunestudio_run() { # → prints "prompts_per_sec peak_rss_bytes mean_completion_length cpu_secs"
  local dir="$WORK/ts"
  rm -rf "$dir"; mkdir -p "$dir"
  cat > "$dir/run.toml" <<EOF
output_dir = "out"
[model]
source = "$(pwd)/$WORK/model"
[data]
path = "$(pwd)/$WORK/prompts.json"
validation_ratio = 0.0
allow = ["learning-rate"]
[training]
method = "grpo"
micro_batch = 1
gradient_accumulation = 1
max_steps = $STEPS
learning_rate = 5e-6
schedule = "constant"
activation_checkpointing = $([ "$CHECKPOINTING" = 1 ] && echo true || echo false)
seed = 0
[grpo]
num_generations = $G
max_prompt_length = $MAX_PROMPT
max_completion_length = $MAX_COMPLETION
temperature = 1.0
top_p = 1.0
top_k = 0
beta = 0.0
loss_type = "dapo"
num_iterations = 1
[[grpo.reward]]
kind = "accuracy"
column = "answer"
[lora]
enabled = true
r = $LORA_R
alpha = $((2 * LORA_R))
dropout = 0.0
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[checkpoint]
save_every = 0
save_final = false
[devices]
devices = ["cpu"]
EOF
  /usr/bin/time -f '%M %U %S' -o "$dir/time" nice -n "$NICE" "$BIN" train --config "$dir/run.toml" \
    --max-steps "$STEPS" >"$dir/log" 2>&1 ||
    { echo "tunestudio train failed:" >&2; tail -n 20 "$dir/log" >&2; echo "nan nan nan nan"; return; }
  "$VENV/bin/python" - "$dir/out/metrics.jsonl" $(tail -n 1 "$dir/time") <<'EOF'
import json, sys
steps = [e for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "step"]
secs = steps[-1]["elapsed_secs"] - steps[0]["elapsed_secs"]
length = sum(s["metrics"]["completions/mean_length"] for s in steps) / len(steps)
print("tunestudio reward by step:", [round(s["metrics"].get("reward", float("nan")), 3) for s in steps], file=sys.stderr)
print((len(steps) - 1) / secs, int(sys.argv[2]) * 1024, length, float(sys.argv[3]) + float(sys.argv[4]))
EOF
}

trl_run() { # → prints "prompts_per_sec peak_rss_bytes mean_completion_length generate_share cpu_secs"
  /usr/bin/time -f '%U %S' -o "$WORK/trl.time" nice -n "$NICE" "$VENV/bin/python" scripts/trl_grpo_step.py train "$WORK/model" "$WORK/prompts.json" \
    "$STEPS" "$G" "$MAX_PROMPT" "$MAX_COMPLETION" "$LORA_R" "$THREADS" "$CHECKPOINTING" >"$WORK/trl.log" 2>&1 ||
    { echo "TRL failed:" >&2; tail -n 20 "$WORK/trl.log" >&2; echo "nan nan nan nan nan"; return; }
  tail -n 1 "$WORK/trl.log" | "$VENV/bin/python" -c 'import json,sys; j=json.load(sys.stdin); u,s=map(float,open(sys.argv[1]).read().split()[-2:])
l=j["completion_mean_length"]; g=j["generate_secs"]
print("TRL reward by step:", j.get("reward_by_step"), file=sys.stderr)
print(j["prompts_per_sec"], j["peak_rss_bytes"], sum(l)/max(len(l),1), "nan" if g is None else g/j["secs"], u+s)' "$WORK/trl.time"
}

gb() { awk -v b="$1" 'BEGIN {print b/1e9}'; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
echo
echo "== GRPO, LoRA r $LORA_R, fp32, checkpointing $CHECKPOINTING, G $G, completions of $MAX_COMPLETION tokens, $STEPS steps (step 1 warm-up), $THREADS threads =="
ts_p=(); ts_r=(); pt_p=(); pt_r=()
for round in $(seq 1 "$ROUNDS"); do
  read -r p r l c < <(tunestudio_run); ts_p+=("$p"); ts_r+=("$r")
  printf 'round %s tunestudio: %.4f prompts/s, peak RSS %.2f GB, mean completion %.1f tokens, process CPU %.0f s\n' \
    "$round" "$p" "$(gb "$r")" "$l" "$c"
  read -r p r l s c < <(trl_run); pt_p+=("$p"); pt_r+=("$r")
  printf 'round %s TRL:        %.4f prompts/s, peak RSS %.2f GB, mean completion %.1f tokens, process CPU %.0f s, %.0f%% of steps 2.. in generate   (round ratio %.2f×)\n' \
    "$round" "$p" "$(gb "$r")" "$l" "$c" "$(awk -v x="$s" 'BEGIN {print 100*x}')" "$(awk -v a="${ts_p[-1]}" -v b="$p" 'BEGIN {print a/b}')"
done
a=$(median "${ts_p[@]}"); b=$(median "${pt_p[@]}"); ra=$(median "${ts_r[@]}"); rb=$(median "${pt_r[@]}")
printf 'median over %s rounds: tunestudio %.4f prompts/s %.2f GB, TRL %.4f prompts/s %.2f GB\n' "$ROUNDS" "$a" \
  "$(gb "$ra")" "$b" "$(gb "$rb")"
printf 'ratio %.2f× prompts/s (goal ≥ 1.5), %.2f× peak RSS (goal ≤ 0.80)\n' \
  "$(awk -v x="$a" -v y="$b" 'BEGIN {print x/y}')" "$(awk -v x="$ra" -v y="$rb" 'BEGIN {print x/y}')"

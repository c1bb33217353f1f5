#!/usr/bin/env bash
# DPO with LoRA: tunestudio vs TRL's DPOTrainer + PEFT, side by side on this machine, in one run.
# The SmolLM2-135M shape (random init, the same weights on both sides), LoRA r LORA_R (default 16)
# on all linear layers, fp32, one pair per step, DPO sigmoid with beta 0.1, activation
# checkpointing on both sides (TRL's default), THREADS threads (default 2). The rows are the first
# ROWS (default 8) pairs of ../shared/datasets/dpo_en_demo.json whose sequences fit MAX_SEQ
# (default 256) tokens, so neither side truncates (TRL 1.x cuts the whole sequence, tunestudio
# the prompt and the completion apart). Runs are interleaved (tunestudio, TRL, ...) so drift in
# the machine's speed hits both; each run is one epoch and its first step is the warm-up.
#
#   scripts/bench-dpo-vs-trl.sh [ROUNDS=2]
#
# REFERENCES (default "adapter-disabled precomputed") names the reference of each comparison:
# `adapter-disabled` is TRL's default with PEFT (the base, adapter off, one forward per step);
# `precomputed` is TRL's `precompute_ref_log_probs=True` (one pass before training).
# Tokens/s counts every input token of both sequences of a pair (prompt included), from the
# chat template's tokens; peak RSS is the process's (`/usr/bin/time`, `ru_maxrss`).
# PyTorch, transformers, PEFT and TRL come from PyPI into TUNESTUDIO_TORCH_VENV (default
# target/torch-venv).
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${1:-2}"
ROWS="${ROWS:-8}"
MAX_SEQ="${MAX_SEQ:-256}"
LORA_R="${LORA_R:-16}"
THREADS="${THREADS:-2}"
REFERENCES="${REFERENCES:-adapter-disabled precomputed}"
SHARED="${TUNESTUDIO_SHARED:-$(cd .. && pwd)/shared}"
VENV="${TUNESTUDIO_TORCH_VENV:-target/torch-venv}"
WORK=target/bench-dpo
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS"

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

# One model folder for both: the SmolLM2-135M config, SmolLM2's tokenizer and chat template
# (the tiny Llama fixture's), and random weights written once by PyTorch (seed 0).
mkdir -p "$WORK/model"
cp "$SHARED/model-configs/smollm2-135m.json" "$WORK/model/config.json"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp -f "$SHARED/fixtures/tiny-llama/$f" "$WORK/model/$f"
done
picked=$("$VENV/bin/python" scripts/trl_dpo_step.py prepare "$WORK/model" "$SHARED/datasets/dpo_en_demo.json" \
  "$ROWS" "$MAX_SEQ" "$WORK/pairs.json" 2>/dev/null | tail -n 1)
rows=$(echo "$picked" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["rows"])')
all_tokens=$(echo "$picked" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
echo "rows: $rows pairs, $all_tokens tokens (both sequences of each pair, prompt included)"

tunestudio_run() { # $1 reference → prints "tokens_per_sec peak_rss_bytes"
  local dir="$WORK/ts-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  cat > "$dir/run.toml" <<EOF
output_dir = "out"
[model]
source = "$(pwd)/$WORK/model"
[data]
path = "$(pwd)/$WORK/pairs.json"
validation_ratio = 0.0
allow = ["learning-rate"]
[training]
method = "dpo"
micro_batch = 1
max_steps = $rows
learning_rate = 5e-5
schedule = "constant"
activation_checkpointing = true
seed = 0
[preference]
beta = 0.1
reference = "$1"
max_prompt_length = $MAX_SEQ
max_completion_length = $MAX_SEQ
[lora]
enabled = true
r = $LORA_R
alpha = $((2 * LORA_R))
[checkpoint]
save_every = 0
save_final = false
[devices]
devices = ["cpu"]
EOF
  /usr/bin/time -f '%M' -o "$dir/maxrss_kib" "$BIN" train --config "$dir/run.toml" >"$dir/log" 2>&1 ||
    { echo "tunestudio train failed:" >&2; tail -n 20 "$dir/log" >&2; echo "nan nan"; return; }
  "$VENV/bin/python" - "$dir/out/metrics.jsonl" "$all_tokens" "$rows" "$(cat "$dir/maxrss_kib")" <<'EOF'
import json, sys
steps = [e for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "step"]
secs = steps[-1]["elapsed_secs"] - steps[0]["elapsed_secs"]
tokens = float(sys.argv[2]) / int(sys.argv[3]) * (len(steps) - 1)
print(tokens / secs, int(sys.argv[4]) * 1024)
EOF
}

trl_run() { # $1 reference → prints "tokens_per_sec peak_rss_bytes"
  "$VENV/bin/python" scripts/trl_dpo_step.py train "$WORK/model" "$WORK/pairs.json" "$LORA_R" "$THREADS" "$1" 2>/dev/null |
    tail -n 1 | "$VENV/bin/python" -c 'import json,sys; j=json.load(sys.stdin); print(j["tokens_per_sec"], j["peak_rss_bytes"])'
}

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
for REF in $REFERENCES; do
  echo; echo "== DPO, LoRA r $LORA_R, fp32, reference $REF =="
  ts_t=(); ts_r=(); pt_t=(); pt_r=()
  for round in $(seq 1 "$ROUNDS"); do
    read -r t r < <(tunestudio_run "$REF"); ts_t+=("$t"); ts_r+=("$r")
    printf 'round %s tunestudio: %.1f tokens/s, peak RSS %.2f GB\n' "$round" "$t" "$(awk -v b="$r" 'BEGIN {print b/1e9}')"
    read -r t r < <(trl_run "$REF"); pt_t+=("$t"); pt_r+=("$r")
    printf 'round %s TRL:        %.1f tokens/s, peak RSS %.2f GB   (round ratio %.2f×)\n' "$round" "$t" \
      "$(awk -v b="$r" 'BEGIN {print b/1e9}')" "$(awk -v a="${ts_t[-1]}" -v b="$t" 'BEGIN {print a/b}')"
  done
  a=$(median "${ts_t[@]}"); b=$(median "${pt_t[@]}"); ra=$(median "${ts_r[@]}"); rb=$(median "${pt_r[@]}")
  printf 'median over %s rounds: tunestudio %.1f tokens/s %.2f GB, TRL %.1f tokens/s %.2f GB\n' "$ROUNDS" "$a" \
    "$(awk -v x="$ra" 'BEGIN {print x/1e9}')" "$b" "$(awk -v x="$rb" 'BEGIN {print x/1e9}')"
  printf 'ratio %.2f× tokens/s (goal ≥ 1.25), %.2f× peak RSS (goal ≤ 0.80)\n' \
    "$(awk -v x="$a" -v y="$b" 'BEGIN {print x/y}')" "$(awk -v x="$ra" -v y="$rb" 'BEGIN {print x/y}')"
done

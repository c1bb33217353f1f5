#!/usr/bin/env bash
# The plan's process peak against what `top` shows over whole runs (issue #17): each run trains
# to its end under `/usr/bin/time -v` (peak RSS = VmHWM), next to `tunestudio plan --config` for
# the same config. Also prints the allocator retention each run implies, as a share of the
# step's transient heap besides one logits chunk (`plan::process::RETENTION_PER_TRANSIENT_BYTE`
# is what the SmolLM2-135M full run retains; the small runs retain more per byte).
#
#   scripts/rss-vs-plan.sh [ROUNDS=1]     (about 3 minutes a round on 2 cores)
#
# Runs (fp32, Alpaca or C4 rows of varying length, random init where the fixture has no weights):
#   demo          assets/demo.toml, 60 steps (the Run chart's demo)
#   tiny-mistral  Alpaca, seq 256, micro-batch 4, 40 steps
#   tiny-llama    C4 text, seq 256, micro-batch 2, validation 5 %, 40 steps
#   smollm2       SmolLM2-135M shape, Alpaca, seq 128, micro-batch 4, 15 steps
#   smollm2-lora  the same with LoRA r 16 on all linears
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${1:-1}"
SHARED="${TUNESTUDIO_SHARED:-$(cd .. && pwd)/shared}"
ROOT="$(pwd)"
BIN="$ROOT/target/release/tunestudio"
command -v /usr/bin/time > /dev/null || { echo "needs /usr/bin/time (apt-get install time)"; exit 1; }
cargo build --release --quiet
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

mkdir -p "$WORK/smollm2"
cp assets/demo-model/tokenizer.json assets/demo-model/tokenizer_config.json "$WORK/smollm2/"
cp "$SHARED/model-configs/smollm2-135m.json" "$WORK/smollm2/config.json"

# name source init data format max_length micro_batch validation steps lora
config() {
  cat > "$WORK/$1.toml" <<EOF
output_dir = "$WORK/out-$1"
[model]
source = "$2"
init = "$3"
[data]
path = "$4"
format = "$5"
# The tiny fixtures' weights are random-like: a from-scratch rate, allowed by name.
allow = ["learning-rate"]
max_length = $6
validation_ratio = $8
[training]
precision = "fp32"
micro_batch = $7
max_steps = $9
learning_rate = 0.001
warmup_steps = 2
[lora]
enabled = ${10}
r = 16
target_modules = ["all-linear"]
[eval]
eval_every = 1000
[checkpoint]
save_every = 1000
[devices]
devices = ["cpu"]
EOF
}
sed -e "s#source = \"demo-model\"#source = \"$ROOT/assets/demo-model\"#" \
    -e "s#path = \"demo-data.json\"#path = \"$ROOT/assets/demo-data.json\"#" \
    -e "s#output_dir = \"../runs/demo\"#output_dir = \"$WORK/out-demo\"#" \
    assets/demo.toml > "$WORK/demo.toml"
ALPACA="$SHARED/datasets/alpaca_en_demo.json"
config tiny-mistral "$SHARED/fixtures/tiny-mistral" pretrained "$ALPACA" alpaca 256 4 0.0 40 false
config tiny-llama "$SHARED/fixtures/tiny-llama" pretrained "$SHARED/datasets/c4_demo.jsonl" text 256 2 0.05 40 false
config smollm2 "$WORK/smollm2" random "$ALPACA" alpaca 128 4 0.0 15 false
config smollm2-lora "$WORK/smollm2" random "$ALPACA" alpaca 128 4 0.0 15 true

printf '%-13s %12s %12s %8s %22s\n' run "peak RSS" planned error "retention / fragmenting"
for round in $(seq "$ROUNDS"); do
  for name in demo tiny-mistral tiny-llama smollm2 smollm2-lora; do
    rm -rf "$WORK/out-$name"
    measured_kib=$(/usr/bin/time -v "$BIN" train --config "$WORK/$name.toml" 2>&1 > /dev/null \
      | awk '/Maximum resident/ {print $6}')
    "$BIN" plan --json --config "$WORK/$name.toml" 2> /dev/null | python3 -c '
import json, sys
name, measured = sys.argv[1], int(sys.argv[2]) * 1024
j = json.load(sys.stdin)
d = (j.get("plan") or j)["per_device"][0]
p = d["process"]
resident = d["weights_bytes"] + d["master_weights_bytes"] + d["optimizer_states_bytes"]
retention = sum(t["bytes"] for t in p["terms"] if "retention" in t["name"])
# The planned term is RETENTION (the constant) x the transient heap besides one logits chunk.
RETENTION = 0.26
fragmenting = retention / RETENTION
implied = (measured - (d["peak_bytes"] - retention)) / fragmenting
M = 2 ** 20
print("%-13s %8.1f MiB %8.1f MiB %+7.1f%% %22.2f" % (name, measured / M, d["peak_bytes"] / M,
      100 * (d["peak_bytes"] - measured) / measured, implied))
' "$name" "$measured_kib"
  done
done

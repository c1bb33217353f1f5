#!/usr/bin/env bash
# tunestudio vs PyTorch + transformers (+ PEFT), side by side on this machine, in one run:
# the SmolLM2-135M shape (random init), seq 256, batch 1, AdamW, 2 threads.
# Runs are interleaved (tunestudio, PyTorch, tunestudio, PyTorch, ...) so that drift
# in the machine's speed hits both; prints tokens/s and peak RSS of each and the ratios.
# Modes (MODES, default "full lora bf16-mixed lora-bf16-mixed"):
#   full        fp32 full fine-tuning, for each gradient accumulation in ACCUMULATIONS
#               (default "1 4"; same effective batch on both sides: PyTorch accumulates in
#               `.grad`, tunestudio in one buffer per parameter)
#   lora        fp32 LoRA r LORA_R (default 16) on all seven linear layers (PEFT on the
#               PyTorch side); also the ratio to tunestudio's own full fine-tuning
#   bf16-mixed  tunestudio --precision bf16-mixed vs PyTorch CPU autocast bf16
#   lora-bf16-mixed
#               LoRA r LORA_R under bf16-mixed vs PEFT under CPU autocast bf16; also the
#               ratio to tunestudio's own fp32 LoRA when the lora mode ran before it
#
#   scripts/bench-vs-torch.sh [ROUNDS=2] [STEPS=3]
#
# PyTorch, transformers and PEFT come from PyPI into a venv (TUNESTUDIO_TORCH_VENV, default
# target/torch-venv). If they cannot be installed the script says so and still runs
# tunestudio.
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${1:-2}"
STEPS="${2:-3}"
ACCUMULATIONS="${ACCUMULATIONS:-1 4}"
MODES="${MODES:-full lora bf16-mixed lora-bf16-mixed}"
LORA_R="${LORA_R:-16}"
THREADS="${THREADS:-2}"
SHARED="${TUNESTUDIO_SHARED:-$(cd .. && pwd)/shared}"
CONFIG="$SHARED/model-configs/smollm2-135m.json"
VENV="${TUNESTUDIO_TORCH_VENV:-target/torch-venv}"
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS"

cargo build --release --bin tunestudio || exit 1
BIN=target/release/tunestudio

have_torch=0
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" || echo "note: cannot create a venv at $VENV"
fi
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c "import torch, transformers, peft" 2>/dev/null; then
  echo "installing torch, transformers and peft from PyPI into $VENV (several GB the first time) ..."
  "$VENV/bin/pip" install -q torch transformers peft || echo "note: pip could not install torch/transformers/peft"
fi
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, transformers, peft" 2>/dev/null; then
  have_torch=1
else
  echo "PyTorch is not available here: running tunestudio alone (no ratios)."
fi

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
compare() {
  ts_tps=(); ts_rss=(); pt_tps=(); pt_rss=(); ratios=()
  for round in $(seq 1 "$ROUNDS"); do
    # shellcheck disable=SC2086
    out=$("$BIN" bench --model-config "$CONFIG" --seq-len 256 --batch 1 --accumulation "$ACC" --steps "$STEPS" --threads "$THREADS" $TS_ARGS 2>/dev/null)
    # The kernels gemm picked on this CPU decide most of tunestudio's figure: say which.
    [ "$round" = 1 ] && echo "tunestudio matmul SIMD: $(echo "$out" | awk -F'  +' '/^matmul SIMD/ {print $2}')"
    tps=$(echo "$out" | awk '/^tokens\/s / {print $2}')
    rss=$(echo "$out" | awk '/^peak RSS/ {print $3 * 1e9}')
    ts_tps+=("$tps"); ts_rss+=("$rss")
    echo "round $round tunestudio: $tps tokens/s, peak RSS $(awk -v b="$rss" 'BEGIN {printf "%.2f GB", b/1e9}')"
    if [ "$have_torch" = 1 ]; then
      # shellcheck disable=SC2086
      json=$("$VENV/bin/python" scripts/torch_step.py "$CONFIG" 256 1 "$STEPS" "$THREADS" "$ACC" $PT_ARGS 2>/dev/null | tail -n 1)
      tps=$(echo "$json" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_sec"])')
      rss=$(echo "$json" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["peak_rss_bytes"])')
      pt_tps+=("$tps"); pt_rss+=("$rss")
      ratios+=("$(awk -v a="${ts_tps[-1]}" -v b="$tps" 'BEGIN {print a/b}')")
      echo "round $round PyTorch:    $(printf '%.1f' "$tps") tokens/s, peak RSS $(awk -v b="$rss" 'BEGIN {printf "%.2f GB", b/1e9}')   (round ratio $(printf '%.2f' "${ratios[-1]}")×)"
    fi
  done

  ts_t=$(median "${ts_tps[@]}"); ts_r=$(median "${ts_rss[@]}")
  echo
  echo "$LABEL, accumulation $ACC: median over $ROUNDS rounds ($STEPS steps each after a warm-up), seq 256, micro-batch 1, $THREADS threads:"
  printf '  tunestudio  %7.1f tokens/s  peak RSS %.2f GB\n' "$ts_t" "$(awk -v b="$ts_r" 'BEGIN {print b/1e9}')"
  if [ "$have_torch" = 1 ]; then
    pt_t=$(median "${pt_tps[@]}"); pt_r=$(median "${pt_rss[@]}")
    printf '  PyTorch     %7.1f tokens/s  peak RSS %.2f GB\n' "$pt_t" "$(awk -v b="$pt_r" 'BEGIN {print b/1e9}')"
    printf '  ratio       %7.2f× tokens/s (target ≥ 1.25)   %.2f× peak RSS (target ≤ 0.80)\n' \
      "$(awk -v a="$ts_t" -v b="$pt_t" 'BEGIN {print a/b}')" "$(awk -v a="$ts_r" -v b="$pt_r" 'BEGIN {print a/b}')"
    # Each round's pair ran back to back, so its ratio is the least exposed to drift.
    printf '  round ratios: median %.2f×, range %.2f–%.2f× tokens/s\n' "$(median "${ratios[@]}")" \
      "$(printf '%s\n' "${ratios[@]}" | sort -g | head -n 1)" "$(printf '%s\n' "${ratios[@]}" | sort -g | tail -n 1)"
  fi
}

full_tps=""
lora_tps=""
for MODE in $MODES; do
  case "$MODE" in
    full)
      for ACC in $ACCUMULATIONS; do
        echo; echo "== full fine-tuning, fp32, gradient accumulation $ACC =="
        LABEL="full fine-tuning fp32" TS_ARGS="" PT_ARGS="" compare
        [ "$ACC" = 1 ] && full_tps="$ts_t"
      done ;;
    lora)
      ACC=1
      echo; echo "== LoRA r $LORA_R on all linear layers, fp32 =="
      LABEL="LoRA r $LORA_R fp32" TS_ARGS="--lora-r $LORA_R" PT_ARGS="--lora-r $LORA_R" compare
      lora_tps="$ts_t"
      [ -n "$full_tps" ] && printf '  LoRA vs tunestudio full fine-tuning: %.2f× tokens/s (target ≥ 1.30)\n' \
        "$(awk -v a="$ts_t" -v b="$full_tps" 'BEGIN {print a/b}')" ;;
    bf16-mixed)
      ACC=1
      echo; echo "== bf16-mixed (tunestudio) vs CPU autocast bf16 (PyTorch) =="
      LABEL="bf16-mixed full fine-tuning" TS_ARGS="--precision bf16-mixed" PT_ARGS="--bf16" compare
      [ -n "$full_tps" ] && printf '  bf16-mixed vs tunestudio fp32 full fine-tuning: %.2f× tokens/s\n' \
        "$(awk -v a="$ts_t" -v b="$full_tps" 'BEGIN {print a/b}')" ;;
    lora-bf16-mixed)
      ACC=1
      echo; echo "== LoRA r $LORA_R under bf16-mixed (tunestudio) vs PEFT under CPU autocast bf16 =="
      LABEL="LoRA r $LORA_R bf16-mixed" TS_ARGS="--lora-r $LORA_R --precision bf16-mixed" \
        PT_ARGS="--lora-r $LORA_R --bf16" compare
      [ -n "$lora_tps" ] && printf '  bf16-mixed LoRA vs tunestudio fp32 LoRA: %.2f× tokens/s\n' \
        "$(awk -v a="$ts_t" -v b="$lora_tps" 'BEGIN {print a/b}')" ;;
    *) echo "unknown mode $MODE (full, lora, bf16-mixed, lora-bf16-mixed)"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# The GPU check of a CUDA build, in one call of at most 8 minutes on one H200, on a machine with
# no Rust and no network: everything runs from one stripped `tunestudio` binary built elsewhere
# (scripts/build-cuda.sh build bundle → target/gpu-bundle/, which travels with the checkout),
# whose CUDA runtime (cuBLAS, cuRAND, cudart, NVRTC, NCCL) comes from the NVIDIA wheels in the
# machine's Python. One JSON report: $OUT/check.json (steps with status, reason, seconds, figures).
#
# Steps (each a named entry of check.json; docs/gpu-check.md says what each proves):
#   parity-fp32            fixture parity (transformers' loss and gradients), fp32, generic ops + checkpointing
#   parity-bf16            the same in bf16
#   memory-plan            `tunestudio plan` vs the NVML process peak of `tunestudio train`, 6 single-GPU shapes (±5 %)
#   layer-split            the founding case scaled down: layers split over 2 streams of the GPU, micro-batch 1 ×
#                          accumulation 4, against one device (losses within 1e-5)
#   data-parallel          2 ranks on 2 streams of the GPU (the host reducer) against one device on the whole batch
#   sharded                ZeRO-2 and ZeRO-3 over 2 streams of the GPU (host reduce-scatter and all-gathers)
#                          against one device
#   nccl-one-rank          NCCL communicator of one rank + all-reduce (GPU only)
#   launcher               `train` as rank 0 of a world of one under torchrun's environment (the rendezvous
#                          with itself, the launched trainer's NCCL path over one rank), data parallel
#                          and ZeRO-2 (ncclReduceScatter / ncclAllGather), against the one-device reference
#   resume                 4 steps, checkpoint at 2, resumed: the losses of the uninterrupted run (1e-6)
#   optimizer-offload      `optimizer_offload = "host"` trains as the state on the device does (1e-5)
#   out-of-memory          a real out-of-memory (a random-init run the plan puts above the card) ends in a
#                          checkpoint of the last good step and a refit plan
#   qlora                  LoRA on a q8_0 / q4_k base on the device against the CPU's native op
#   throughput-vs-pytorch  bf16 tokens/s of the SmolLM2-135M shape, tunestudio vs PyTorch eager and SDPA
#
# `--cpu` runs every step that can run without a GPU (tiny shapes, `cpu:0,cpu:1` logical devices,
# an injected out-of-memory; NCCL skipped): CI runs it (tests/it/devices_gpu_check.rs).
set -uo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
MODE=gpu
BIN="${TUNESTUDIO_BIN:-}"
SHARED="${TUNESTUDIO_SHARED:-}"
OUT_DIR="${OUT:-$REPO_DIR/target/gpu-check-out}"
RUN_TORCH=1
ONLY=""
BUDGET=""
KEEP_WORK=0
ALL_STEPS=(parity-fp32 parity-bf16 memory-plan layer-split data-parallel sharded nccl-one-rank launcher resume
           optimizer-offload out-of-memory qlora throughput-vs-pytorch)

usage() {
  cat <<EOF
Usage: scripts/gpu-check.sh [--cpu] [--bin PATH] [--shared DIR] [--out DIR] [--no-torch]
                            [--only STEP,...] [--budget SECS]

Runs tunestudio's GPU check on GPU 0 (or what of it runs on the CPU, with --cpu) and writes one
JSON report, OUT/check.json. Exit status 1 if a step fails, 2 if nothing could run.

  --cpu           every step that can run without a GPU, tiny shapes (CI)
  --bin PATH      the tunestudio binary (default: \$TUNESTUDIO_BIN, target/gpu-bundle/tunestudio[.xz],
                  target/cuda/release/tunestudio; with --cpu also target/release|debug/tunestudio)
  --shared DIR    fixtures folder (default: \$TUNESTUDIO_SHARED, target/gpu-bundle/shared, ../shared)
  --out DIR       where results go (default: \$OUT or ./target/gpu-check-out)
  --no-torch      skip the PyTorch side of throughput-vs-pytorch
  --only STEPS    run only these steps (comma-separated): ${ALL_STEPS[*]}
  --keep-work     keep the scratch folder of the runs (checkpoints, models); default: only their logs,
                  metrics.jsonl, run.toml and plan.json are kept, under OUT/runs/
  --budget SECS   the whole check's time budget (default 470 on a GPU, 900 with --cpu); each
                  step has its own share and a timeout; a step that cannot start in time is skipped
  -h, --help      this help
EOF
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --cpu) MODE=cpu ;;
    --bin) shift; BIN="${1:?--bin needs a path}" ;;
    --shared) shift; SHARED="${1:?--shared needs a folder}" ;;
    --out) shift; OUT_DIR="${1:?--out needs a folder}" ;;
    --no-torch) RUN_TORCH=0 ;;
    --only) shift; ONLY=",${1:?--only needs step names},";;
    --budget) shift; BUDGET="${1:?--budget needs seconds}" ;;
    --keep-work) KEEP_WORK=1 ;;
    *) usage >&2; echo "gpu-check: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[gpu-check %4ds] %s\n' "$SECONDS" "$*"; }
SECONDS=0
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
gc_py() { python3 "$SCRIPT_DIR/gpu_check.py" "$@"; }
STEPS_JSONL="$OUT_DIR/steps.jsonl"
ENV_JSON="$OUT_DIR/environment.json"
export GPU_CHECK_VERDICT="$OUT_DIR/verdict.json"
rm -rf "$STEPS_JSONL" "$GPU_CHECK_VERDICT" "$OUT_DIR/check.json" "$OUT_DIR/runs"
# The runs (checkpoints, random-init models, data) live in a scratch folder, so that $OUT holds
# only the report and the logs (it comes back from the GPU machine); a fresh one per call.
UNPACKED=""
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-work.XXXXXX")" || { log "cannot create a scratch folder"; exit 2; }
cleanup() {
  [[ -n "$UNPACKED" ]] && rm -f "$UNPACKED"
  if [[ $KEEP_WORK -eq 1 ]]; then log "runs kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
# Set-up failures still leave the one report, with the reason and no steps; exit status 2.
setup_failed() {
  log "$1"
  printf '{"mode": "%s", "passed": false, "setup_error": "%s", "total_secs": %d, "steps": []}\n' \
    "$MODE" "$(printf '%s' "$1" | tr -d '\042\134')" "$SECONDS" >"$OUT_DIR/check.json"
  exit 2
}
command -v python3 >/dev/null || setup_failed "python3 is needed (the report is JSON written by scripts/gpu_check.py)"

# Time: on a GPU the whole check is planned for 8 minutes: the step shares below add up to 470 s
# with the set-up; --cpu (a debug binary on 2 cores in CI) gets twice each share.
if [[ -z "$BUDGET" ]]; then
  if [[ $MODE == gpu ]]; then BUDGET=470; else BUDGET=900; fi
fi
SCALE=1
[[ $MODE == cpu ]] && SCALE=2

# --- the binary -------------------------------------------------------------
if [[ -z "$BIN" ]]; then
  for candidate in "$REPO_DIR/target/gpu-bundle/tunestudio" "$REPO_DIR/target/gpu-bundle/tunestudio.xz" \
                   "$REPO_DIR/target/cuda/release/tunestudio"; do
    if [[ -f "$candidate" ]]; then BIN="$candidate"; break; fi
  done
  if [[ -z "$BIN" && $MODE == cpu ]]; then
    for candidate in "$REPO_DIR/target/release/tunestudio" "$REPO_DIR/target/debug/tunestudio"; do
      if [[ -f "$candidate" ]]; then BIN="$candidate"; break; fi
    done
  fi
fi
[[ -n "$BIN" && -f "$BIN" ]] || setup_failed "no tunestudio binary found (build one: scripts/build-cuda.sh build bundle, or pass --bin)"
if [[ "$BIN" == *.xz ]]; then
  UNPACKED="$WORK/tunestudio"
  if ! xz -dc "$BIN" >"$UNPACKED"; then setup_failed "cannot decompress $BIN"; fi
  chmod +x "$UNPACKED"
  BIN="$UNPACKED"
fi
log "binary: $BIN ($MODE mode, budget ${BUDGET}s)"

# --- fixtures ---------------------------------------------------------------
if [[ -z "$SHARED" ]]; then
  for candidate in "$REPO_DIR/target/gpu-bundle/shared" "$REPO_DIR/../shared" "$REPO_DIR/shared"; do
    if [[ -d "$candidate/fixtures" ]]; then SHARED="$candidate"; break; fi
  done
fi
[[ -d "$SHARED/fixtures/tiny-llama" ]] || setup_failed "fixtures not found (pass --shared DIR holding fixtures/tiny-llama)"
SHARED="$(cd "$SHARED" && pwd)"
export TUNESTUDIO_SHARED="$SHARED"
TINY="$SHARED/fixtures/tiny-llama"
SMOL_CONFIG="$SHARED/model-configs/smollm2-135m.json"
DEMO_DATA="$REPO_DIR/assets/demo-data.json"
log "fixtures: $SHARED"

# --- CUDA runtime libraries (GPU mode) ---------------------------------------
# The binary's RUNPATH is a path of the build machine; here the CUDA 13 runtime comes from the
# NVIDIA wheels PyTorch installed (site-packages/nvidia/*/lib). The driver (libcuda.so.1) is the
# system's — never a link stub.
LIBDIRS=""
if [[ $MODE == gpu ]]; then
  nvroots="$(python3 - <<'EOF' 2>/dev/null
import site, sys
roots = []
try:
    import nvidia
    roots += list(nvidia.__path__)
except Exception:
    pass
for d in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    roots.append(d.rstrip("/") + "/nvidia")
print("\n".join(dict.fromkeys(roots)))
EOF
)"
  wanted="libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13 libnccl.so.2 libnvrtc.so.13"
  wanted="$wanted $(ldd "$BIN" 2>/dev/null | awk '/not found/ { print $1 }' | tr '\n' ' ')"
  for lib in $wanted; do
    while IFS= read -r root; do
      [[ -d "$root" ]] || continue
      found="$(find "$root" -name "$lib" -not -path '*/stubs/*' 2>/dev/null | head -n 1)"
      if [[ -n "$found" ]]; then
        d="$(dirname "$found")"
        case ":$LIBDIRS:" in *":$d:"*) ;; *) LIBDIRS="${LIBDIRS:+$LIBDIRS:}$d" ;; esac
        break
      fi
    done <<<"$nvroots"
  done
  export LD_LIBRARY_PATH="${LIBDIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if ldd "$BIN" | grep -q "not found"; then
    log "missing shared libraries (is PyTorch with NVIDIA's CUDA 13 wheels installed in python3?):"
    ldd "$BIN" | grep "not found"
    setup_failed "missing shared libraries: $(ldd "$BIN" | awk '/not found/ { print $1 }' | tr '\n' ' ')"
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>/dev/null \
    | tee "$OUT_DIR/nvidia-smi.csv"
fi
"$BIN" devices --json >"$OUT_DIR/devices.json" 2>"$OUT_DIR/devices.err" || { cat "$OUT_DIR/devices.err"; setup_failed "tunestudio devices failed: $(tail -n 1 "$OUT_DIR/devices.err")"; }
"$BIN" devices | tee "$OUT_DIR/devices.txt"
gpus=$(python3 -c 'import json,sys; print(sum(d["kind"]=="cuda" for d in json.load(open(sys.argv[1]))["devices"]))' \
  "$OUT_DIR/devices.json" 2>/dev/null || echo 0)
if [[ $MODE == gpu && $gpus -lt 1 ]]; then
  setup_failed "no CUDA GPU found by tunestudio devices (see devices.txt; is this a CUDA build?); --cpu runs the CPU half"
fi
TORCH_REASON=""
if [[ $RUN_TORCH -eq 0 ]]; then
  TORCH_REASON="PyTorch comparison off (--no-torch)"
elif ! python3 -c 'import torch' 2>/dev/null; then
  TORCH_REASON="PyTorch is not importable by python3 here"
fi
python3 - "$ENV_JSON" "$MODE" "$BIN" "${LD_LIBRARY_PATH:-}" "$OUT_DIR/devices.json" "$SHARED" "$TORCH_REASON" <<'EOF'
import json, subprocess, sys
out, mode, binary, ld, devices, shared, torch_reason = sys.argv[1:]
env = {"mode": mode, "binary": binary, "ld_library_path": ld, "shared": shared}
try:
    env["devices"] = json.load(open(devices)).get("devices")
except Exception as e:
    env["devices"] = str(e)
try:
    env["version"] = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
except Exception:
    pass
if not torch_reason:
    try:
        env["torch"] = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                                      capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception:
        pass
json.dump(env, open(out, "w"), indent=1)
EOF

# --- mode parameters -----------------------------------------------------------
if [[ $MODE == gpu ]]; then
  ONE='"cuda:0"'; TWO='"cuda:0", "cuda:0"'   # two logical devices (streams) of GPU 0
  DP_TOL=1e-4     # a rank's half batch is another GEMM shape: cuBLAS sums in another order
  QLORA_TOL=2e-3  # the GPU's dequantize + cuBLAS against the CPU's fused q8_0/q4_k kernels
  OOM_WORDS=4300  # rows longer than the OOM step's 4096 tokens
  MEM_TOL=5       # percent: the plan against NVML's figure for the process
else
  ONE='"cpu"'; TWO='"cpu:0", "cpu:1"'
  # Logical CPU devices as distinct memories: a transfer between them copies, as between two
  # GPUs, so a copy kept across steps goes stale here too (the tied head of a layer split did,
  # on the first H200 run).
  export TUNESTUDIO_DISTINCT_CPU_DEVICES=1
  DP_TOL=1e-5
  QLORA_TOL=1e-5
  OOM_WORDS=300
  # Percent. The CPU's figure is the process's peak RSS (a debug binary in CI, beside other
  # jobs), which moves by a few MiB from run to run on these ~100 MiB runs: a bound that catches
  # a broken plan, not the GPU's ±5 % (tests/plan_accuracy.rs compares the CPU exactly, with
  # a counting allocator).
  MEM_TOL=10
fi

# Rows of one repeated sentence (~1 token a word with SmolLM2's tokenizer): every micro-batch is
# as long as max_length, as the planner plans it.
long_data() { # file, words per row, rows
  python3 - "$@" <<'EOF'
import json, sys
path, words, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
text = " ".join(["the quick brown fox jumps over the lazy dog"] * (words // 9 + 1))
json.dump([{"instruction": f"Repeat the sentence ({i}).", "input": "", "output": text} for i in range(rows)],
          open(path, "w"))
EOF
}

# A random-init model folder of a model-configs shape with the fixture's SmolLM2 tokenizer.
random_model() { # folder, config.json
  mkdir -p "$1"
  cp "$2" "$1/config.json"
  cp "$TINY"/tokenizer.json "$TINY"/tokenizer_config.json "$1/"
  [[ -f "$TINY/chat_template.jinja" ]] && cp "$TINY/chat_template.jinja" "$1/"
  return 0
}

# --- run configs ---------------------------------------------------------------
# `cfg_reset`, then set C_* and `cfg_write DIR` writes DIR/run.toml (output in DIR/out).
cfg_reset() {
  C_MODEL="$TINY"; C_INIT=pretrained; C_DATA="$DEMO_DATA"; C_MAXLEN=64; C_PREC=fp32
  C_MB=4; C_ACC=2; C_STEPS=4; C_LR=0.001; C_DEVICES="$ONE"; C_STRATEGY=single
  C_SAVE_EVERY=0; C_SAVE_FINAL=false; C_OFFLOAD=none; C_ACKPT=false; C_LORA_R=0; C_QUANT=none
  C_SHARD=gradients-and-optimizer
}
cfg_write() {
  local dir="$1"
  mkdir -p "$dir"
  cat >"$dir/run.toml" <<TOML
output_dir = "$dir/out"
[model]
source = "$C_MODEL"
init = "$C_INIT"
quantize = "$C_QUANT"
[data]
path = "$C_DATA"
format = "alpaca"
# A fixture or random-init model at a from-scratch rate: allowed by name.
allow = ["learning-rate"]
max_length = $C_MAXLEN
validation_ratio = 0.0
[training]
precision = "$C_PREC"
micro_batch = $C_MB
gradient_accumulation = $C_ACC
max_steps = $C_STEPS
learning_rate = $C_LR
activation_checkpointing = $C_ACKPT
optimizer_offload = "$C_OFFLOAD"
[lora]
enabled = $([[ $C_LORA_R -gt 0 ]] && echo true || echo false)
r = $([[ $C_LORA_R -gt 0 ]] && echo "$C_LORA_R" || echo 8)
target_modules = ["all-linear"]
[checkpoint]
save_every = $C_SAVE_EVERY
keep_last = 0
save_final = $C_SAVE_FINAL
[devices]
strategy = "$C_STRATEGY"
shard = "$C_SHARD"
devices = [$C_DEVICES]
TOML
}

# The time left to the current step (its share, within the whole budget).
left() {
  local a=$((STEP_DEADLINE - SECONDS)) b=$((BUDGET - SECONDS))
  ((b < a)) && a=$b
  ((a < 1)) && a=1
  echo "$a"
}
# Runs a command under the step's timeout.
tmo() { timeout -k 5 "$(left)" "$@"; }

# `tunestudio train` of DIR/run.toml (extra arguments after the folder); log in DIR/train.log.
train() {
  local dir="$1"; shift
  tmo "$BIN" train --config "$dir/run.toml" "$@" >>"$dir/train.log" 2>&1
  local rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "timed out after the step's share" >>"$dir/train.log"
  return $rc
}
fail_train() { # dir, what
  gc_py verdict failed "$2 failed: $(tail -n 3 "$1/train.log" | tr '\n' ' ' | cut -c1-400)"
}

# `tunestudio devices --check --only STEP` into $OUT_DIR/devcheck-STEP.json.
devcheck() {
  local args=(devices --check --fixtures "$TINY" --only "$1" --json)
  [[ $MODE == cpu ]] && args+=(--cpu)
  tmo "$BIN" "${args[@]}" >"$OUT_DIR/devcheck-$1.json" 2>"$OUT_DIR/devcheck-$1.err"
}

# The one-device references: the founding case's micro-batch 1 × accumulation 4, and micro-batch
# 4 × accumulation 2 (checkpoints at steps 2 and 4: the resume and out-of-memory steps start there).
ensure_ref_founding() {
  [[ -f "$WORK/ref-founding/out/metrics.jsonl" ]] && return 0
  rm -rf "$WORK/ref-founding"; cfg_reset; C_MB=1; C_ACC=4; cfg_write "$WORK/ref-founding"
  train "$WORK/ref-founding" || { fail_train "$WORK/ref-founding" "the one-device reference run"; return 1; }
}
ensure_ref() {
  [[ -d "$WORK/ref/out/checkpoint-2" && -f "$WORK/ref/out/metrics.jsonl" ]] && return 0
  rm -rf "$WORK/ref"; cfg_reset; C_SAVE_EVERY=2; cfg_write "$WORK/ref"
  train "$WORK/ref" || { fail_train "$WORK/ref" "the one-device reference run"; return 1; }
}

# --- the steps -----------------------------------------------------------------------------

step_parity_fp32() { devcheck parity-generic; gc_py devcheck "$OUT_DIR/devcheck-parity-generic.json" parity-generic; }
step_parity_bf16() { devcheck parity-generic-bf16; gc_py devcheck "$OUT_DIR/devcheck-parity-generic-bf16.json" parity-generic-bf16; }

# Plan vs measured peak, per shape: on a GPU the memory NVML attributes to the training process
# (nvidia-smi every 100 ms, and the trainer's own NVML samples in metrics.jsonl: CUDA context,
# cuBLAS workspace, the allocator's pools and the tensors together); on the CPU the process's
# peak RSS (VmHWM, and the trainer's samples). Every row is longer than max_length.
mem_case() { # name, model folder, precision, micro_batch, max_length, extra (ckpt|lora|acc4)
  local name=$1 dir="$WORK/memory-plan/$1"
  rm -rf "$dir"; cfg_reset
  C_MODEL="$2"; C_INIT=random; C_DATA="$WORK/memory-plan/long.json"; C_PREC=$3; C_MB=$4; C_MAXLEN=$5
  C_ACC=1; C_STEPS=2; C_LR=0.0001
  case "${6:-}" in ckpt) C_ACKPT=true ;; lora) C_LORA_R=16 ;; acc4) C_ACC=4 ;; esac
  cfg_write "$dir"
  local device=cpu
  [[ $MODE == gpu ]] && device=cuda:0
  tmo "$BIN" plan --json --config "$dir/run.toml" >"$dir/plan.json" 2>"$dir/plan.err"
  timeout -k 5 "$(left)" "$BIN" train --config "$dir/run.toml" >"$dir/train.log" 2>&1 &
  local pid=$! peak=0 used child=""
  while kill -0 "$pid" 2>/dev/null; do
    [[ -n "$child" ]] || child=$(pgrep -P "$pid" 2>/dev/null | head -n 1)   # timeout's child: tunestudio
    [[ -n "$child" ]] || { sleep 0.05; continue; }
    if [[ $MODE == gpu ]]; then
      used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
        | awk -F', *' -v p="$child" '$1 == p { s += $2 } END { print s + 0 }')
      used=$((used * 1048576))
    else
      used=$(awk '/^VmHWM:/ { print $2 * 1024 }' "/proc/$child/status" 2>/dev/null)
    fi
    [[ -n "$used" && "$used" -gt "$peak" ]] && peak=$used
    sleep 0.1
  done
  wait "$pid" || log "  train $name failed (see $dir/train.log)"
  gc_py mem-case "$WORK/memory-plan/cases.jsonl" "$name" "$dir/plan.json" "$peak" "$dir/out/metrics.jsonl" "$device"
}
step_memory_plan() {
  rm -rf "$WORK/memory-plan"; mkdir -p "$WORK/memory-plan"
  if [[ $MODE == gpu ]]; then
    local smol="$WORK/memory-plan/smollm2-135m"
    random_model "$smol" "$SMOL_CONFIG"
    long_data "$WORK/memory-plan/long.json" 2100 32
    mem_case fp32-b4-s512 "$smol" fp32 4 512
    mem_case bf16mixed-b4-s1024 "$smol" bf16-mixed 4 1024
    mem_case bf16-b8-s1024 "$smol" bf16 8 1024
    mem_case bf16-b8-s2048-ckpt "$smol" bf16 8 2048 ckpt
    mem_case bf16-lora16-b8-s1024 "$smol" bf16 8 1024 lora
    mem_case bf16mixed-b4-s512-acc4 "$smol" bf16-mixed 4 512 acc4
  else
    long_data "$WORK/memory-plan/long.json" 120 16
    mem_case fp32-b4-s64 "$TINY" fp32 4 64
    mem_case fp32-b4-s96 "$TINY" fp32 4 96
    mem_case bf16mixed-b4-s64 "$TINY" bf16-mixed 4 64
    mem_case bf16-b4-s96 "$TINY" bf16 4 96
    mem_case fp32-b4-s96-ckpt "$TINY" fp32 4 96 ckpt
    mem_case fp32-lora16-b4-s96 "$TINY" fp32 4 96 lora
  fi
  gc_py mem-verdict "$WORK/memory-plan/cases.jsonl" "$MEM_TOL" "$MODE"
}

# The founding case scaled down: micro-batch 1 × accumulation 4, layers split over two logical
# devices of the one GPU (two streams; every stage's gradient taps meet the loss from the second
# micro-batch on), against one device.
step_layer_split() {
  ensure_ref_founding || return
  local dir="$WORK/layer-split"
  rm -rf "$dir"; cfg_reset; C_MB=1; C_ACC=4; C_DEVICES="$TWO"; C_STRATEGY=layer-split; cfg_write "$dir"
  train "$dir" || { fail_train "$dir" "the layer-split run"; return; }
  gc_py compare --tol 1e-5 --steps 4 --stages 2 \
    "layer-split=$dir/out/metrics.jsonl:$WORK/ref-founding/out/metrics.jsonl"
}

# Two ranks on two logical devices of the one GPU (micro-batch 2 each, accumulation 2): NCCL
# refuses two ranks on one GPU, so the host reducer sums them; against one device on micro-batch 4.
step_data_parallel() {
  ensure_ref || return
  local dir="$WORK/data-parallel"
  rm -rf "$dir"; cfg_reset; C_MB=2; C_DEVICES="$TWO"; C_STRATEGY=data-parallel; cfg_write "$dir"
  train "$dir" || { fail_train "$dir" "the data-parallel run"; return; }
  gc_py compare --tol "$DP_TOL" --steps 4 --ranks 2 \
    "data-parallel=$dir/out/metrics.jsonl:$WORK/ref/out/metrics.jsonl"
}

# Sharded data parallel (ZeRO-2) over the same two logical devices: each rank steps its ranges
# of the trainable tensors, the gradients reduce-scattered and the ranges all-gathered on the
# device (host collectives); against one device on the whole batch.
step_sharded() {
  ensure_ref || return
  local dir="$WORK/sharded"
  rm -rf "$dir"; cfg_reset; C_MB=2; C_DEVICES="$TWO"; C_STRATEGY=sharded; cfg_write "$dir"
  train "$dir" || { fail_train "$dir" "the sharded run"; return; }
  # ZeRO-3: every layer gathered from the two streams' ranges for its forward and recompute.
  local z3="$WORK/sharded-zero3"
  rm -rf "$z3"; cfg_reset; C_MB=2; C_DEVICES="$TWO"; C_STRATEGY=sharded; C_SHARD=everything
  cfg_write "$z3"
  train "$z3" || { fail_train "$z3" "the ZeRO-3 run"; return; }
  gc_py compare --tol "$DP_TOL" --steps 4 --ranks 2 \
    "sharded=$dir/out/metrics.jsonl:$WORK/ref/out/metrics.jsonl" \
    "zero3=$z3/out/metrics.jsonl:$WORK/ref/out/metrics.jsonl"
}

step_nccl_one_rank() {
  if [[ $MODE == cpu ]]; then
    gc_py verdict skipped "NCCL needs a GPU (CPU logical devices use the host reducer)"; return
  fi
  devcheck nccl; gc_py devcheck "$OUT_DIR/devcheck-nccl.json" nccl
}

# Resume on the device: the reference's checkpoint of step 2 (a copy of its folder), resumed to
# step 4, against the uninterrupted steps 3 and 4.
# `tunestudio train` started as torchrun starts a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
# MASTER_PORT): a world of one joins the rendezvous with itself and trains as rank 0, writing
# every output, through the launched trainer's path (ncclCommInitRank with the rendezvous's id on
# cuda:LOCAL_RANK, the step's sums over one rank); its losses are the one-device reference's. A
# world of two stays out: NCCL refuses two ranks on one GPU (docs/multi-node.md).
step_launcher() {
  ensure_ref || return
  local dir="$WORK/launcher"
  rm -rf "$dir"; cfg_reset; C_SAVE_EVERY=2; cfg_write "$dir"
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 train "$dir" ||
    { fail_train "$dir" "the run as rank 0 of a world of one"; return; }
  # ZeRO-2 across processes, a world of one: on a GPU its reduce-scatter and all-gather are
  # ncclReduceScatter and ncclAllGather over the one rank (slots of one), and its checkpoint
  # gathers the optimizer state through the same all-gather.
  local z2="$WORK/launcher-sharded"
  rm -rf "$z2"; cfg_reset; C_SAVE_EVERY=2; C_STRATEGY=sharded; cfg_write "$z2"
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29534 train "$z2" ||
    { fail_train "$z2" "the sharded run as rank 0 of a world of one"; return; }
  gc_py compare --tol 1e-6 --steps 4 \
    "launcher=$dir/out/metrics.jsonl:$WORK/ref/out/metrics.jsonl" \
    "launcher-sharded=$z2/out/metrics.jsonl:$WORK/ref/out/metrics.jsonl"
}

step_resume() {
  ensure_ref || return
  local dir="$WORK/resume"
  rm -rf "$dir"; mkdir -p "$dir"
  cp -r "$WORK/ref/out" "$dir/out"; rm -rf "$dir/out/checkpoint-4"
  cp "$WORK/ref/out/metrics.jsonl" "$dir/uninterrupted.jsonl"
  cfg_reset; C_SAVE_EVERY=2; cfg_write "$dir"
  train "$dir" --resume "$dir/out/checkpoint-2" || { fail_train "$dir" "the resumed run"; return; }
  gc_py compare --tol 1e-6 --after 2 --steps 2 --resumed-from 2 \
    "resume=$dir/out/metrics.jsonl:$dir/uninterrupted.jsonl"
}

# AdamW's state in host memory (stepped there) against the state on the device. On the CPU the
# generic ops stand in for the GPU's (the state as device tensors unless offloaded).
step_optimizer_offload() {
  local dir="$WORK/optimizer-offload" ops=auto
  [[ $MODE == cpu ]] && ops=generic
  rm -rf "$dir"; cfg_reset; cfg_write "$dir/device"
  C_OFFLOAD=host; cfg_write "$dir/host"
  TUNESTUDIO_OPS=$ops train "$dir/device" || { fail_train "$dir/device" "the run with the state on the device"; return; }
  TUNESTUDIO_OPS=$ops train "$dir/host" || { fail_train "$dir/host" "the offloaded run"; return; }
  gc_py compare --tol 1e-5 --steps 4 \
    "optimizer-offload=$dir/host/out/metrics.jsonl:$dir/device/out/metrics.jsonl"
}

# A real out-of-memory: a random-init SmolLM2-135M in bf16 trains 2 steps at max_length 64
# (checkpoint at 2), then resumes at micro-batch 8 × max_length 4096, which the plan puts far
# above the card (~780 GiB): step 3 runs out in its forward. The run must end with a checkpoint of
# step 2 and settings that fit (the refit). On the CPU a real allocation failure ends the process,
# so the trainer's test switch injects it (TUNESTUDIO_INJECT_OOM) in the same flow, tiny-llama.
step_out_of_memory() {
  local dir="$WORK/out-of-memory" model="$TINY" prec=fp32 big=128 inject=()
  rm -rf "$dir"; mkdir -p "$dir"
  long_data "$dir/long.json" "$OOM_WORDS" 16
  if [[ $MODE == gpu ]]; then
    model="$dir/smollm2-135m"; random_model "$model" "$SMOL_CONFIG"; prec=bf16; big=4096
  else
    inject=(env TUNESTUDIO_INJECT_OOM=3:forward)
  fi
  cfg_reset; C_MODEL="$model"; C_INIT=random; C_DATA="$dir/long.json"; C_PREC=$prec; C_MB=8; C_ACC=1
  C_SAVE_EVERY=2; C_STEPS=2; C_LR=0.0001; cfg_write "$dir"
  train "$dir" || { fail_train "$dir" "the 2 steps before the out-of-memory"; return; }
  C_MAXLEN=$big; C_STEPS=4; cfg_write "$dir"
  tmo "$BIN" plan --json --config "$dir/run.toml" >"$dir/plan.json" 2>"$dir/plan.err"
  echo "--- resumed with max_length $big" >>"$dir/train.log"
  "${inject[@]}" timeout -k 5 "$(left)" "$BIN" train --config "$dir/run.toml" --resume "$dir/out/checkpoint-2" \
    --allow-config-change >>"$dir/train.log" 2>&1
  gc_py oom "$dir/out/metrics.jsonl" "$dir/plan.json" "$MODE"
}

# QLoRA: LoRA on a q8_0 / q4_k base through `tunestudio train` on the device (the generic path: a
# weight dequantized per product) against the CPU's native quantized op. On the CPU the generic
# ops on the CPU stand in for the device.
run_qlora() { # name, quantize, devices, ops
  local dir="$WORK/qlora/$1"
  cfg_reset; C_QUANT=$2; C_DEVICES=$3; C_LORA_R=8; C_MB=2; C_ACC=1; cfg_write "$dir"
  TUNESTUDIO_OPS="$4" TUNESTUDIO_QUANT_CACHE="$dir/cache" train "$dir"
}
step_qlora() {
  rm -rf "$WORK/qlora"
  local q pairs=()
  for q in q8_0 q4_k; do
    run_qlora "$q-cpu" "$q" '"cpu"' auto || { fail_train "$WORK/qlora/$q-cpu" "QLoRA $q on the CPU"; return; }
    if [[ $MODE == cpu ]]; then
      run_qlora "$q-dev" "$q" '"cpu"' generic
    else
      run_qlora "$q-dev" "$q" "$ONE" auto
    fi || { fail_train "$WORK/qlora/$q-dev" "QLoRA $q on the device"; return; }
    pairs+=("$q=$WORK/qlora/$q-dev/out/metrics.jsonl:$WORK/qlora/$q-cpu/out/metrics.jsonl")
  done
  gc_py compare --tol "$QLORA_TOL" --steps 4 "${pairs[@]}"
}

# tokens/s of a bf16 training step of the SmolLM2-135M shape (batch 8 × 512, AdamW) in tunestudio
# (`devices --check` throughput) and in PyTorch on the same GPU, eager attention and SDPA.
step_throughput() {
  devcheck throughput
  if [[ -z "$TORCH_REASON" ]]; then
    local attn args
    if [[ $MODE == gpu ]]; then
      args=(--config "$SMOL_CONFIG" --device cuda --dtype bf16 --batch 8 --seq 512 --steps 10)
    else
      args=(--config "$TINY/config.json" --device cpu --dtype f32 --batch 2 --seq 64 --steps 3)
    fi
    for attn in eager sdpa; do
      tmo python3 "$SCRIPT_DIR/gpu_check_torch.py" "${args[@]}" --attn "$attn" \
        >"$OUT_DIR/torch-$attn.json" 2>"$OUT_DIR/torch-$attn.log" || rm -f "$OUT_DIR/torch-$attn.json"
    done
  fi
  gc_py throughput "$OUT_DIR/devcheck-throughput.json" "$OUT_DIR" "$TORCH_REASON"
}

# --- the run ---------------------------------------------------------------------------------
# name, share of the budget in seconds (GPU; doubled with --cpu), function.
run_step() {
  local name=$1 share=$(($2 * SCALE)) fn=$3
  if [[ -n "$ONLY" && "$ONLY" != *",$name,"* ]]; then return; fi
  local started_ns now_ns
  started_ns=$(date +%s%N)
  rm -f "$GPU_CHECK_VERDICT"
  STEP_DEADLINE=$((SECONDS + share))
  log "$name (share ${share}s)"
  if ((BUDGET - SECONDS < 5)); then
    gc_py verdict skipped "not started: the check's ${BUDGET}s budget is spent"
  else
    "$fn"
  fi
  now_ns=$(date +%s%N)
  gc_py record "$name" "$(((now_ns - started_ns) / 1000000)).0e-3" "$share" "$STEPS_JSONL"
}

run_step parity-fp32 25 step_parity_fp32
run_step parity-bf16 25 step_parity_bf16
run_step memory-plan 90 step_memory_plan
run_step layer-split 35 step_layer_split
run_step data-parallel 30 step_data_parallel
run_step sharded 30 step_sharded
run_step nccl-one-rank 15 step_nccl_one_rank
run_step launcher 25 step_launcher
run_step resume 20 step_resume
run_step optimizer-offload 25 step_optimizer_offload
run_step out-of-memory 60 step_out_of_memory
run_step qlora 45 step_qlora
run_step throughput-vs-pytorch 90 step_throughput

# Logs, metrics, run configs and plans of every run into OUT/runs (no checkpoints, models or data).
(cd "$WORK" && find . -type f \( -name '*.log' -o -name 'metrics.jsonl' -o -name 'run.toml' -o -name 'plan.json' \
  -o -name '*.err' -o -name 'cases.jsonl' -o -name 'uninterrupted.jsonl' \) -size -4M -print0 \
  | while IFS= read -r -d '' f; do mkdir -p "$OUT_DIR/runs/$(dirname "$f")"; cp "$f" "$OUT_DIR/runs/$f"; done)
gc_py report "$OUT_DIR/check.json" "$MODE" "$BUDGET" "$SECONDS" "$STEPS_JSONL" "$ENV_JSON"
python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["passed"] else 1)' "$OUT_DIR/check.json"

#!/usr/bin/env bash
# The GPU checks of a CUDA build, in one go (≤ 10 minutes on one H200), on a
# machine with no Rust and no network: everything runs from one `tunestudio`
# binary built elsewhere with scripts/build-cuda.sh (+ its `bundle` step).
#
#   1. discovery            `tunestudio devices` (table + JSON)
#   2. device checks        `tunestudio devices --check`: parity with transformers'
#                           reference loss/gradients in fp32 and bf16, and in fp32 through
#                           the device-generic ops with activation checkpointing (the GPU's
#                           checkpointing, generic loss and frozen linear), a layer split over
#                           2 logical devices on the one GPU, data parallel over 2 logical
#                           devices, NCCL all-reduce, the memory sampler, predicted vs
#                           measured memory over the planner's grid, tokens/s of the
#                           SmolLM2-135M shape in bf16
#   3. generic-path bench   `tunestudio bench --ops generic` beside `--ops native` on the
#                           CPU (the bench runs on the CPU): what the generic ops cost
#   3c. memory truth        predicted vs measured (NVML / VmHWM) peak per device, small grid
#   3d. QLoRA               LoRA on a q8_0 / q4_k base trained on the device vs the CPU
#   4. PyTorch reference    the same training step in PyTorch (if installed) → speed ratio
#
# `--cpu` runs the same steps on the CPU (tiny shapes), so this script is tested
# on machines without a GPU. Results go to $OUT (or ./gpu-check-out).
set -uo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
MODE=gpu
BIN="${TUNESTUDIO_BIN:-}"
SHARED="${TUNESTUDIO_SHARED:-}"
OUT_DIR="${OUT:-$REPO_DIR/target/gpu-check-out}"
RUN_TORCH=1

usage() {
  cat <<EOF
Usage: scripts/gpu-check.sh [--cpu] [--bin PATH] [--shared DIR] [--out DIR] [--no-torch]

Runs tunestudio's device checks on GPU 0 (or on the CPU with --cpu) and a PyTorch
run of the same training step for a tokens/s ratio. Exit status 1 if a check fails.

  --cpu          run every step on the CPU with tiny shapes (no GPU needed)
  --bin PATH     the tunestudio binary (default: \$TUNESTUDIO_BIN, target/gpu-bundle/tunestudio[.xz],
                 target/cuda/release/tunestudio; with --cpu also target/release|debug/tunestudio)
  --shared DIR   fixtures folder (default: \$TUNESTUDIO_SHARED, target/gpu-bundle/shared, ../shared)
  --out DIR      where results go (default: \$OUT or ./target/gpu-check-out)
  --no-torch     skip the PyTorch comparison
  -h, --help     this help
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
    *) usage >&2; echo "gpu-check: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[gpu-check] %s\n' "$*"; }
mkdir -p "$OUT_DIR"
SECONDS=0

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
[[ -n "$BIN" && -f "$BIN" ]] || { log "no tunestudio binary found (build one: scripts/build-cuda.sh build bundle, or pass --bin)"; exit 2; }
if [[ "$BIN" == *.xz ]]; then
  unpacked="${TMPDIR:-/tmp}/tunestudio-gpu-check"
  xz -dc "$BIN" >"$unpacked" && chmod +x "$unpacked" || { log "cannot decompress $BIN"; exit 2; }
  BIN="$unpacked"
fi
log "binary: $BIN"

# --- fixtures ---------------------------------------------------------------
if [[ -z "$SHARED" ]]; then
  for candidate in "$REPO_DIR/target/gpu-bundle/shared" "$REPO_DIR/../shared" "$REPO_DIR/shared"; do
    if [[ -d "$candidate/fixtures" ]]; then SHARED="$candidate"; break; fi
  done
fi
[[ -d "$SHARED/fixtures/tiny-llama" ]] || { log "fixtures not found (pass --shared DIR holding fixtures/tiny-llama)"; exit 2; }
export TUNESTUDIO_SHARED="$SHARED"
log "fixtures: $SHARED"

# --- CUDA runtime libraries (GPU mode) ---------------------------------------
# The RUNPATH baked in at build time is a local path of the build machine; on a
# GPU machine the CUDA 13 runtime comes from PyTorch's NVIDIA wheels. The driver
# (libcuda.so.1) is the system's — never the build's link stub.
if [[ $MODE == gpu ]]; then
  libdirs=""
  if command -v python3 >/dev/null; then
    sitedirs="$(python3 -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null || true)"
    for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13 libnccl.so.2 libnvrtc.so.13; do
      for sd in $sitedirs; do
        [[ -d "$sd/nvidia" ]] || continue
        found="$(find "$sd/nvidia" -name "$lib" -not -path '*/stubs/*' 2>/dev/null | head -n 1)"
        if [[ -n "$found" ]]; then
          d="$(dirname "$found")"
          case ":$libdirs:" in *":$d:"*) ;; *) libdirs="${libdirs:+$libdirs:}$d" ;; esac
          break
        fi
      done
    done
  fi
  export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if ldd "$BIN" | grep -q "not found"; then
    log "missing shared libraries:"; ldd "$BIN" | grep "not found"
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null | tee "$OUT_DIR/nvidia-smi.csv"
fi

# --- 1. discovery -------------------------------------------------------------
log "step 1: discovery"
"$BIN" devices | tee "$OUT_DIR/devices.txt"
"$BIN" devices --json >"$OUT_DIR/devices.json" || { log "devices --json failed"; exit 1; }

# --- 2. device checks ---------------------------------------------------------
log "step 2: device checks ($MODE)"
check_args=(devices --check --fixtures "$SHARED/fixtures/tiny-llama")
[[ $MODE == cpu ]] && check_args+=(--cpu)
"$BIN" "${check_args[@]}" --json >"$OUT_DIR/check.json"
check_rc=$?
python3 - "$OUT_DIR/check.json" <<'EOF' 2>/dev/null || cat "$OUT_DIR/check.json"
import json, sys
r = json.load(open(sys.argv[1]))
for s in r["steps"]:
    print(f"[{s['status'].upper():7}] {s['name']:<15} {s['secs']:7.2f}s  {s['detail']}")
EOF
log "device checks: $([[ $check_rc -eq 0 ]] && echo passed || echo FAILED) (exit $check_rc)"

# --- 3. generic-path speed beside native (CPU bench: the ratio the generic ops cost) ----
log "step 3: tunestudio bench --ops native | generic (CPU)"
for ops in native generic; do
  "$BIN" bench --ops "$ops" --model-config "$SHARED/fixtures/tiny-llama/config.json" \
    --seq-len 64 --steps 3 >"$OUT_DIR/bench-$ops.txt" 2>&1 || log "bench --ops $ops failed"
  grep -E '^(ops|step \(median\)|tokens/s|last loss)' "$OUT_DIR/bench-$ops.txt"
done

# Compares the step losses of runs under $OUT_DIR: each argument is RUN=REFERENCE (folder
# names); a run passes when every step's loss is within $tol (relative, floor 1) of the
# reference's. Exit status 1 when one does not.
compare_losses() {
  python3 - "$OUT_DIR" "$tol" "$@" <<'EOF'
import json, sys, os
out, tol, pairs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
def losses(name):
    steps, path = {}, os.path.join(out, name, "out", "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            e = json.loads(line)
            if e.get("event") == "step": steps[e["step"]] = e["loss"]
    return steps
bad = 0
for pair in pairs:
    name, ref_name = pair.split("=")
    ref, got = losses(ref_name), losses(name)
    worst = max(abs(got[s] - ref[s]) for s in ref) if ref and got.keys() == ref.keys() else float("inf")
    ok = worst <= tol * max(1.0, max(abs(v) for v in ref.values())) if ref else False
    bad += not ok
    print(f"[{'PASSED' if ok else 'FAILED':7}] {name:<18} {len(got)} steps, worst |loss - {ref_name}| = {worst:.2e}")
sys.exit(1 if bad else 0)
EOF
}

# --- 3b. several devices through `tunestudio train` -------------------------------
# Data parallel and a layer split on two logical devices of one GPU (two streams), and on
# two GPUs where there are two, must train like one device (same losses step by step).
log "step 3b: data parallel and layer split through tunestudio train"
multi_rc=0
run_multi() { # name, micro_batch, strategy, devices (TOML array body), accumulation
  local dir="$OUT_DIR/multi-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  cat >"$dir/run.toml" <<TOML
output_dir = "$dir/out"
[model]
source = "$SHARED/fixtures/tiny-llama"
init = "pretrained"
[data]
path = "$SHARED/datasets/alpaca_en_demo.json"
format = "alpaca"
# The tiny fixture's weights are random-like: a from-scratch rate, allowed by name.
allow = ["learning-rate"]
max_length = 64
[training]
micro_batch = $2
gradient_accumulation = ${5:-2}
max_steps = 6
learning_rate = 0.001
[devices]
strategy = "$3"
devices = [$4]
TOML
  "$BIN" train --config "$dir/run.toml" >"$dir/train.log" 2>&1 || { log "train $1 failed:"; tail -n 5 "$dir/train.log"; multi_rc=1; }
}
if [[ $MODE == cpu ]]; then
  dev0='"cpu:0"'; dev1='"cpu:1"'; one='"cpu"'; tol=1e-5
else
  dev0='"cuda:0"'; dev1='"cuda:0"'; one='"cuda:0"'; tol=2e-3
fi
rm -rf "$OUT_DIR"/multi-*
# The founding case scaled down: a layer split with accumulation 4 (every micro-batch after
# the first hands each stage's accumulated gradients to the backward on that stage).
run_multi one 4 single "$one"
run_multi one-acc4 4 single "$one" 4
run_multi dp-streams 2 data-parallel "$dev0, $dev1"
run_multi split-streams 4 layer-split "$dev0, $dev1" 4
gpus=$(python3 -c 'import json,sys; print(sum(d["kind"]=="cuda" for d in json.load(open(sys.argv[1]))["devices"]))' "$OUT_DIR/devices.json" 2>/dev/null || echo 0)
if [[ $MODE == gpu && $gpus -ge 2 ]]; then
  run_multi dp-gpus 2 data-parallel '"cuda:0", "cuda:1"'
  run_multi split-gpus 4 layer-split '"cuda:0", "cuda:1"' 4
fi
pairs=()
for d in "$OUT_DIR"/multi-*; do
  name=${d##*/multi-}
  case $name in
    one|one-acc4) ;;
    split-*) pairs+=("multi-$name=multi-one-acc4") ;;
    *) pairs+=("multi-$name=multi-one") ;;
  esac
done
compare_losses "${pairs[@]}" || multi_rc=1
log "several devices: $([[ $multi_rc -eq 0 ]] && echo passed || echo FAILED)"
[[ $multi_rc -eq 0 ]] || check_rc=1

# --- 3d. QLoRA on the device ---------------------------------------------------------
# LoRA on a quantized base (q8_0, q4_k) through `tunestudio train` on the device (the
# generic path: a weight dequantized on the GPU per product) against the CPU's native layer
# op: the same losses step by step. In --cpu mode the generic ops on the CPU stand in.
log "step 3d: QLoRA (quantized base + LoRA) on the device vs the CPU"
qlora_rc=0
run_qlora() { # name, quantize, device, ops
  local dir="$OUT_DIR/qlora-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  cat >"$dir/run.toml" <<TOML
output_dir = "$dir/out"
[model]
source = "$SHARED/fixtures/tiny-llama"
init = "pretrained"
quantize = "$2"
[data]
path = "$SHARED/datasets/alpaca_en_demo.json"
format = "alpaca"
# The tiny fixture's weights are random-like: a from-scratch rate, allowed by name.
allow = ["learning-rate"]
max_length = 64
[training]
micro_batch = 2
max_steps = 5
learning_rate = 0.001
[lora]
enabled = true
r = 8
target_modules = ["all-linear"]
[devices]
devices = [$3]
TOML
  TUNESTUDIO_OPS="$4" TUNESTUDIO_QUANT_CACHE="$dir/cache" "$BIN" train --config "$dir/run.toml" >"$dir/train.log" 2>&1 \
    || { log "train qlora-$1 failed:"; tail -n 5 "$dir/train.log"; qlora_rc=1; }
}
for q in q8_0 q4_k; do
  run_qlora "$q-cpu" "$q" '"cpu"' auto
  if [[ $MODE == cpu ]]; then run_qlora "$q-dev" "$q" '"cpu"' generic; else run_qlora "$q-dev" "$q" "$one" auto; fi
done
compare_losses qlora-q8_0-dev=qlora-q8_0-cpu qlora-q4_k-dev=qlora-q4_k-cpu || qlora_rc=1
log "QLoRA: $([[ $qlora_rc -eq 0 ]] && echo passed || echo FAILED)"
[[ $qlora_rc -eq 0 ]] || check_rc=1

# --- 3c. memory truth: predicted vs measured peak per device (issue #17) ----------
# Trains a small grid with `tunestudio train` and samples what the user's monitor shows:
# on a GPU the memory NVML reports for the training process on each device
# (`nvidia-smi --query-compute-apps`, every 100 ms: CUDA context, cuBLAS workspace, the
# allocator's pools and the tensors together), on the CPU the process's VmHWM. Printed next
# to `tunestudio plan --config` for the same run, with "measured − training tensors" (the
# runtime terms: context + workspace + allocator). Informational (goal ±5 %).
log "step 3c: predicted vs measured peak memory per device"
mem_case() { # name, precision, micro_batch, max_length
  local dir="$OUT_DIR/mem-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  cat >"$dir/run.toml" <<TOML
output_dir = "$dir/out"
[model]
source = "$SHARED/fixtures/tiny-llama"
init = "pretrained"
[data]
path = "$SHARED/datasets/alpaca_en_demo.json"
format = "alpaca"
# The tiny fixture's weights are random-like: a from-scratch rate, allowed by name.
allow = ["learning-rate"]
max_length = $4
validation_ratio = 0.02
[training]
precision = "$2"
micro_batch = $3
max_steps = 4
learning_rate = 0.001
[devices]
devices = [$one]
TOML
  "$BIN" plan --json --config "$dir/run.toml" >"$dir/plan.json" 2>"$dir/plan.err" || { log "plan $1 failed"; return; }
  "$BIN" train --config "$dir/run.toml" >"$dir/train.log" 2>&1 &
  local pid=$! peak=0 used
  while kill -0 "$pid" 2>/dev/null; do
    if [[ $MODE == gpu ]]; then
      used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
        | awk -F', *' -v p="$pid" '$1 == p { s += $2 } END { print s + 0 }')
      used=$((used * 1048576))
    else
      used=$(awk '/^VmHWM:/ { print $2 * 1024 }' "/proc/$pid/status" 2>/dev/null)
    fi
    [[ -n "$used" && "$used" -gt "$peak" ]] && peak=$used
    sleep 0.1
  done
  wait "$pid" || log "train $1 failed (see $dir/train.log)"
  python3 - "$1" "$dir/plan.json" "$peak" <<'EOF'
import json, sys
name, plan, measured = sys.argv[1], json.load(open(sys.argv[2]))["plan"], int(sys.argv[3])
for d in plan["per_device"][:1]:
    p, t = d["peak_bytes"], d.get("training_tensors_bytes", d["peak_bytes"])
    err = 100.0 * (p - measured) / measured if measured else float("nan")
    ok = abs(err) <= 5.0
    print(f"[{'PASSED' if ok else 'OFF':7}] {name:<12} {d['device']['name']}: predicted {p / 2**20:8.1f} MiB, "
          f"measured {measured / 2**20:8.1f} MiB ({err:+.1f} %); measured - training tensors "
          f"{(measured - t) / 2**20:8.1f} MiB (planned overhead {d['overhead_bytes'] / 2**20:.0f} MiB)")
EOF
}
mem_case fp32-b4-s64 fp32 4 64
mem_case bf16-b4-s256 bf16-mixed 4 256
mem_case bf16-b8-s512 bf16 8 512

# --- 4. PyTorch reference step ------------------------------------------------
torch_rc=0
if [[ $RUN_TORCH -eq 1 ]] && command -v python3 >/dev/null && python3 -c 'import torch' 2>/dev/null; then
  log "step 4: PyTorch run of the same step"
  if [[ $MODE == gpu ]]; then
    torch_args=(--config "$SHARED/model-configs/smollm2-135m.json" --device cuda --dtype bf16 --batch 8 --seq 512 --steps 10)
  else
    torch_args=(--config "$SHARED/fixtures/tiny-llama/config.json" --device cpu --dtype f32 --batch 2 --seq 64 --steps 3)
  fi
  python3 - "${torch_args[@]}" >"$OUT_DIR/torch.json" <<'EOF'
# One training step (loss sum / tokens, backward, AdamW) of a Llama-shaped model
# from a config.json with random weights, timed like tunestudio's throughput check.
import argparse, json, time, torch
p = argparse.ArgumentParser()
p.add_argument("--config"); p.add_argument("--device"); p.add_argument("--dtype")
p.add_argument("--batch", type=int); p.add_argument("--seq", type=int); p.add_argument("--steps", type=int)
a = p.parse_args()
dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
cfg = json.load(open(a.config))
torch.manual_seed(0)
try:
    from transformers import AutoConfig, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.config)).to(a.device, dtype)
    impl = "transformers"
    def loss_sum(ids):
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
except Exception as e:  # no transformers: a compact Llama in plain PyTorch
    impl = f"plain torch ({type(e).__name__})"
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]; hd = cfg.get("head_dim", H // nh)
    V = cfg["vocab_size"]; theta = cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
    class Layer(torch.nn.Module):
        def __init__(s):
            super().__init__()
            s.q, s.k, s.v, s.o = lin(H, nh*hd), lin(H, nkv*hd), lin(H, nkv*hd), lin(nh*hd, H)
            s.g, s.u, s.d = lin(H, I), lin(H, I), lin(I, H)
            s.n1, s.n2 = torch.nn.RMSNorm(H, eps=cfg["rms_norm_eps"]), torch.nn.RMSNorm(H, eps=cfg["rms_norm_eps"])
        def forward(s, x, cos, sin):
            b, t, _ = x.shape; h = s.n1(x)
            q = s.q(h).view(b, t, nh, hd).transpose(1, 2); k = s.k(h).view(b, t, nkv, hd).transpose(1, 2)
            v = s.v(h).view(b, t, nkv, hd).transpose(1, 2)
            rot = lambda z: torch.cat((-z[..., hd//2:], z[..., :hd//2]), -1)
            q, k = q*cos + rot(q)*sin, k*cos + rot(k)*sin
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + s.o(att.transpose(1, 2).reshape(b, t, nh*hd)); h = s.n2(x)
            return x + s.d(torch.nn.functional.silu(s.g(h)) * s.u(h))
    class M(torch.nn.Module):
        def __init__(s):
            super().__init__(); s.e = torch.nn.Embedding(V, H); s.layers = torch.nn.ModuleList(Layer() for _ in range(L))
            s.n = torch.nn.RMSNorm(H, eps=cfg["rms_norm_eps"])
        def forward(s, ids):
            t = ids.shape[1]; inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=ids.device).float() / hd)
            f = torch.outer(torch.arange(t, device=ids.device).float(), inv); emb = torch.cat((f, f), -1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype); x = s.e(ids)
            for layer in s.layers: x = layer(x, cos, sin)
            return s.n(x) @ s.e.weight.T
    model = M().to(a.device, dtype)
    def loss_sum(ids):
        logits = model(ids)[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ids = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), device=a.device)
sync = (lambda: torch.cuda.synchronize()) if a.device == "cuda" else (lambda: None)
def step():
    loss = loss_sum(ids); n = ids[:, 1:].numel()
    (loss / n).backward(); opt.step(); opt.zero_grad(set_to_none=True)
step(); sync()
times = []
for _ in range(a.steps):
    t0 = time.perf_counter(); step(); sync(); times.append(time.perf_counter() - t0)
times.sort(); med = times[len(times)//2]
print(json.dumps({"impl": impl, "torch": torch.__version__, "tokens_per_sec": a.batch * a.seq / med, "median_step_secs": med}))
EOF
  torch_rc=$?
  if [[ $torch_rc -eq 0 ]]; then
    python3 - "$OUT_DIR/check.json" "$OUT_DIR/torch.json" <<'EOF'
import json, sys
check = json.load(open(sys.argv[1])); torch_r = json.load(open(sys.argv[2]))
ours = next((s["metrics"].get("tokens_per_sec") for s in check["steps"] if s["name"] == "throughput"), None)
print(f"PyTorch ({torch_r['impl']}, torch {torch_r['torch']}): {torch_r['tokens_per_sec']:.0f} tokens/s, "
      f"median step {torch_r['median_step_secs']:.4f} s")
if ours:
    print(f"tunestudio: {ours:.0f} tokens/s  →  ratio tunestudio/PyTorch = {ours / torch_r['tokens_per_sec']:.2f}")
EOF
  else
    log "PyTorch step failed (exit $torch_rc); see above"
  fi
else
  log "step 4: skipped (PyTorch is not installed here, or --no-torch)"
fi

log "done in ${SECONDS}s; results in $OUT_DIR"
# The device checks decide the exit status; the PyTorch run is a comparison only.
exit $check_rc

#!/usr/bin/env bash
# Speed and memory benchmark (not a test): `tunestudio export --kind gguf` against llama.cpp's
# own path on the same model, for f16, q8_0 and q4_k_m. Not part of CI.
#
#   scripts/bench-gguf-export.sh [ROUNDS]               SHAPE=smollm2 (default), ROUNDS default 3
#   SHAPE=llama-1b scripts/bench-gguf-export.sh [ROUNDS]                  ROUNDS default 2
#
# Model (SHAPE), with random bf16 weights (seed 0; norms near 1, the rest N(0, 0.02)) written by a
# small numpy script below, tensor by tensor in blocks of rows (a few tens of MB in memory), and
# the tokenizer of assets/demo-model (SmolLM2's, vocab 49,152, which llama.cpp's converter
# recognises as `smollm`). Made once, in $WORK/model.
#   smollm2   the SmolLM2-135M shape ($TUNESTUDIO_SHARED/model-configs/smollm2-135m.json, default
#             ../shared), one model.safetensors; f16, q8_0 and q4_k_m as below.
#   llama-1b  a TinyLlama-1.1B-like Llama (issue #41's "synthetic 1.1 B Llama shape"): hidden 2048,
#             intermediate 5632, 22 layers, 32 heads, 4 KV heads, untied lm_head, but vocab 49,152
#             (not TinyLlama's 32,000) so that it matches the demo tokenizer: 1.17 B parameters
#             (2.3 GB bf16) instead of 1.10 B. Written as two shards, model-0000{1,2}-of-00002.
#             safetensors with a model.safetensors.index.json, as Hugging Face stores big models.
#             Only q4_k_m is measured (tunestudio against convert f16 + llama-quantize Q4_K_M).
#
# Per quant, both sides from that Hugging Face folder:
#   tunestudio  tunestudio export --kind gguf --quant Q --checkpoint MODEL --out FILE --force
#   llama.cpp   convert_hf_to_gguf.py MODEL --outtype f16, then for q8_0 and q4_k_m
#               llama-quantize F16FILE OUT Q8_0|Q4_K_M THREADS (two stages: the sum of their wall
#               times, and the larger of their peak RSS); for q8_0 also the converter alone
#               with --outtype q8_0 (gguf-py's numpy quantizer)
# The converter's f16 run of a round is both the f16 figure and stage 1 of that round's
# two-stage q8_0 and q4_k_m figures (the same command; it is not run three times).
# Wall seconds and peak RSS come from /usr/bin/time -f '%e %M'. Runs are interleaved
# (tunestudio, llama.cpp, tunestudio, ...) for ROUNDS rounds so that drift in the machine's
# speed hits both; the table shows medians over the rounds and the ratios tunestudio/llama.cpp.
# The model file is read once before the first round, so every run finds it in the page cache.
#
# llama.cpp: the build and the llama-cpp-python sdist's vendored source (convert_hf_to_gguf.py,
# gguf-py) that scripts/gguf-check-llamacpp.sh leaves in $LLAMACPP_CACHE (default
# ~/.cache/tunestudio/llamacpp): run that script once first if llama-quantize is missing.
# The converter's Python requirements (torch, transformers, numpy, sentencepiece, protobuf, as
# in its requirements/requirements-convert_hf_to_gguf.txt) go into a venv, $CONVERT_VENV
# (default $LLAMACPP_CACHE/convert-venv). Only PyPI is reachable here, whose torch wheel pulls
# the CUDA packages (about 5 GB the first time); the converter runs on the CPU either way.
# transformers 5 (not 4.57.6, the pin there): the demo tokenizer_config.json says
# "TokenizersBackend", a transformers 5 class that 4.x cannot load.
#
# Environment: SHAPE (smollm2 or llama-1b, above), THREADS (default: nproc; RAYON_NUM_THREADS for
# tunestudio, llama-quantize's thread argument; the converter is a Python process and uses what
# it uses), TS (the tunestudio binary; default target/release/tunestudio if built, else
# target/debug/tunestudio, whose dependencies, candle's quantizers included, are built at
# opt-level 3), WORK (default /tmp/tunestudio-bench-gguf, /tmp/tunestudio-bench-gguf-llama-1b for
# llama-1b), NICE (a niceness for every command the script runs, model generation included, both
# sides alike, e.g. 19 so that another job on the machine keeps its priority; default none for
# smollm2, 19 for llama-1b; NICE=0 for none).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"

SHAPE="${SHAPE:-smollm2}"
case "$SHAPE" in
  smollm2)  DEFAULT_ROUNDS=3; DEFAULT_WORK=/tmp/tunestudio-bench-gguf; DEFAULT_NICE=0; SHARDS=1 ;;
  llama-1b) DEFAULT_ROUNDS=2; DEFAULT_WORK=/tmp/tunestudio-bench-gguf-llama-1b; DEFAULT_NICE=19; SHARDS=2 ;;
  *) echo "usage: SHAPE=smollm2|llama-1b $0 [ROUNDS>=1] (SHAPE=$SHAPE)" >&2; exit 2 ;;
esac
ROUNDS="${1:-$DEFAULT_ROUNDS}"
case "$ROUNDS" in ''|*[!0-9]*|0) echo "usage: SHAPE=smollm2|llama-1b $0 [ROUNDS>=1]" >&2; exit 2 ;; esac
THREADS="${THREADS:-$(nproc)}"
SHARED="${TUNESTUDIO_SHARED:-$(cd .. && pwd)/shared}"
NICE="${NICE:-$DEFAULT_NICE}"
case "$NICE" in ''|*[!0-9]*) echo "NICE must be 0..19 (NICE=$NICE)" >&2; exit 2 ;; esac
if [ "$NICE" -gt 0 ]; then PRE=(nice -n "$NICE"); else PRE=(); fi
CACHE="${LLAMACPP_CACHE:-$HOME/.cache/tunestudio/llamacpp}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$CACHE/src/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
BIN="$CACHE/build-$LCP_VERSION/bin"
CONVERT_VENV="${CONVERT_VENV:-$CACHE/convert-venv}"
PY="$CONVERT_VENV/bin/python"
WORK="${WORK:-$DEFAULT_WORK}"
MODEL="$WORK/model"
case "$SHAPE" in
  smollm2)  CONFIG="$SHARED/model-configs/smollm2-135m.json" ;;
  llama-1b) CONFIG="$WORK/llama-1b-config.json" ;;   # written below
esac
if [ -z "${TS:-}" ]; then
  TS="$ROOT/target/release/tunestudio"
  [ -x "$TS" ] || TS="$ROOT/target/debug/tunestudio"
fi
export RAYON_NUM_THREADS="$THREADS"
die() { echo "error: $*" >&2; exit 1; }
log() { printf '== %s\n' "$*" >&2; }

# ---------------------------------------------------------------------------------------------
# 1. What must be there already.
# ---------------------------------------------------------------------------------------------
[ -x /usr/bin/time ] || die "/usr/bin/time is missing (apt-get install time)"
[ -x "$TS" ] || die "no tunestudio binary at $TS: cargo build --release --bin tunestudio (or set TS=)"
[ "$SHAPE" != smollm2 ] || [ -f "$CONFIG" ] || die "no model config at $CONFIG (set TUNESTUDIO_SHARED)"
for f in tokenizer.json tokenizer_config.json; do
  [ -f "$ROOT/assets/demo-model/$f" ] || die "no assets/demo-model/$f"
done
[ -x "$BIN/llama-quantize" ] || die "no $BIN/llama-quantize: run scripts/gguf-check-llamacpp.sh once (it builds llama.cpp)"
[ -f "$SRC/convert_hf_to_gguf.py" ] && [ -d "$SRC/gguf-py" ] \
  || die "no convert_hf_to_gguf.py / gguf-py in $SRC: run scripts/gguf-check-llamacpp.sh once (it unpacks the sdist)"

# ---------------------------------------------------------------------------------------------
# 2. The converter's venv.
# ---------------------------------------------------------------------------------------------
CHECK_IMPORTS='import torch, transformers, numpy, sentencepiece, safetensors, google.protobuf, yaml; assert int(transformers.__version__.split(".")[0]) >= 5'
if ! "$PY" -c "$CHECK_IMPORTS" 2>/dev/null; then
  log "venv $CONVERT_VENV: torch, transformers 5, numpy, sentencepiece, protobuf, safetensors (from PyPI; ~5 GB the first time)"
  [ -x "$PY" ] || python3 -m venv "$CONVERT_VENV" || die "cannot create a venv at $CONVERT_VENV"
  "$CONVERT_VENV/bin/pip" install -q "torch==2.11.0" "transformers>=5,<6" "numpy~=2.2.6" \
    "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" safetensors pyyaml \
    || die "pip could not install the converter's requirements into $CONVERT_VENV"
  "$PY" -c "$CHECK_IMPORTS" || die "the converter's requirements do not import from $CONVERT_VENV"
fi

# ---------------------------------------------------------------------------------------------
# 3. The model folder (made once).
# ---------------------------------------------------------------------------------------------
mkdir -p "$WORK"
if [ "$SHAPE" = llama-1b ]; then
  # TinyLlama-1.1B's config (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T) with the demo
  # tokenizer's vocabulary and special tokens.
  cat > "$CONFIG" <<'EOF'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 2048,
  "intermediate_size": 5632,
  "num_hidden_layers": 22,
  "num_attention_heads": 32,
  "num_key_value_heads": 4,
  "vocab_size": 49152,
  "max_position_embeddings": 2048,
  "rope_theta": 10000.0,
  "rms_norm_eps": 1e-05,
  "tie_word_embeddings": false,
  "hidden_act": "silu",
  "torch_dtype": "bfloat16",
  "bos_token_id": 1,
  "eos_token_id": 2,
  "pad_token_id": 2
}
EOF
fi
case "$SHAPE" in
  smollm2)  SHAPE_NAME="SmolLM2-135M shape" ;;
  llama-1b) SHAPE_NAME="TinyLlama-1.1B-like Llama shape (hidden 2048, intermediate 5632, 22 layers, 32/4 heads, untied, vocab 49,152 for the demo tokenizer)" ;;
esac
MADE="$(cat "$MODEL/.complete" 2>/dev/null || echo none)"   # the shape it holds (empty: smollm2)
if [ "${MADE:-smollm2}" != "$SHAPE" ]; then
  log "model: $SHAPE_NAME, random bf16 weights, $SHARDS safetensors file(s) -> $MODEL"
  rm -rf "$MODEL"; mkdir -p "$MODEL"
  "${PRE[@]}" "$PY" - "$CONFIG" "$MODEL" "$SHARDS" <<'EOF'
import json, struct, sys
import numpy as np

config_path, out_dir, n_shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = json.load(open(config_path))
h, inter, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
hd = cfg.get("head_dim") or h // heads
shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
for i in range(n_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (heads * hd, h),
        p + "self_attn.k_proj.weight": (kv * hd, h),
        p + "self_attn.v_proj.weight": (kv * hd, h),
        p + "self_attn.o_proj.weight": (h, heads * hd),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    })
shapes["model.norm.weight"] = (h,)
if not cfg.get("tie_word_embeddings", False):
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)

rng = np.random.default_rng(0)
def bf16(x):  # f32 -> bf16 bits, round to nearest even (as torch does)
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

# Shards in model order, split where the running byte count crosses k/n of the total (so exactly
# n files); one file is model.safetensors, several are model-0000k-of-0000n.safetensors with
# model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}), as transformers writes.
nbytes = {name: int(np.prod(shape)) * 2 for name, shape in shapes.items()}
total, start, shard_of = sum(nbytes.values()), 0, {}
for name in shapes:
    shard_of[name] = min(start * n_shards // total, n_shards - 1)
    start += nbytes[name]
files = ["model.safetensors"] if n_shards == 1 else \
    [f"model-{k + 1:05}-of-{n_shards:05}.safetensors" for k in range(n_shards)]
for k, file in enumerate(files):   # safetensors, written by hand: numpy has no bf16
    names = [name for name in shapes if shard_of[name] == k]
    header, offset = {}, 0
    for name in names:
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes[name]]}
        offset += nbytes[name]
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(f"{out_dir}/{file}", "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name in names:   # tensor by tensor, a block of rows at a time (the same random stream)
            shape = shapes[name]
            scale, base = (0.1, 1.0) if name.endswith("norm.weight") else (0.02, 0.0)
            cols = int(np.prod(shape[1:]))
            step = max(1, (1 << 22) // cols)
            for r in range(0, shape[0], step):
                block = (min(step, shape[0] - r),) + tuple(shape[1:])
                f.write(bf16(base + scale * rng.standard_normal(block, dtype=np.float32)).tobytes())
if n_shards > 1:
    index = {"metadata": {"total_size": total}, "weight_map": {name: files[shard_of[name]] for name in shapes}}
    json.dump(index, open(f"{out_dir}/model.safetensors.index.json", "w"), indent=2)
cfg["torch_dtype"] = "bfloat16"
json.dump(cfg, open(f"{out_dir}/config.json", "w"), indent=2)
print(f"{sum(int(np.prod(s)) for s in shapes.values()):,} parameters in {len(files)} file(s)")
EOF
  cp "$ROOT/assets/demo-model/tokenizer.json" "$ROOT/assets/demo-model/tokenizer_config.json" "$MODEL/"
  [ -f "$ROOT/assets/demo-model/chat_template.jinja" ] && cp "$ROOT/assets/demo-model/chat_template.jinja" "$MODEL/"
  echo "$SHAPE" > "$MODEL/.complete"
fi
"${PRE[@]}" cat "$MODEL"/*.safetensors > /dev/null   # into the page cache for every run alike
# A copy of the binary: a cargo build during the rounds must not swap it between them.
cp "$TS" "$WORK/tunestudio"; TS_SRC="$TS"; TS="$WORK/tunestudio"

# ---------------------------------------------------------------------------------------------
# 4. The runs.
# ---------------------------------------------------------------------------------------------
# measure NAME CMD...: runs CMD under /usr/bin/time (both under nice -n $NICE when NICE is set);
# appends "wall rss_kb" to $WORK/NAME.times.
# Output goes to $WORK/NAME.log; a failure stops the script with that log's tail.
measure() {
  local name="$1"; shift
  local t="$WORK/$name.time.tmp"
  if ! "${PRE[@]}" /usr/bin/time -o "$t" -f '%e %M' "$@" > "$WORK/$name.log" 2>&1; then
    echo "error: $name failed: $*" >&2; tail -15 "$WORK/$name.log" >&2; exit 1
  fi
  tail -n 1 "$t" >> "$WORK/$name.times"
  read -r wall rss < <(tail -n 1 "$t")
  printf '   %-22s %7.2f s  %6.0f MiB\n' "$name" "$wall" "$(awk -v k="$rss" 'BEGIN {print k / 1024}')" >&2
}
# (/usr/bin/time runs programs, not shell functions: these are command prefixes.)
CONVERT=("$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL")
QUANTIZE=("$BIN/llama-quantize")

rm -f "$WORK"/*.times "$WORK"/*.gguf
LOAD_BEFORE=$(cut -d ' ' -f 1-3 /proc/loadavg)
log "$SHAPE, $ROUNDS rounds, $THREADS threads${PRE:+, ${PRE[*]}}; tunestudio: $TS_SRC; llama.cpp: llama-cpp-python $LCP_VERSION"
for round in $(seq 1 "$ROUNDS"); do
  log "round $round"
  if [ "$SHAPE" = llama-1b ]; then   # q4_k_m only
    measure ts-q4_k_m     "$TS" export --kind gguf --quant q4_k_m --checkpoint "$MODEL" --out "$WORK/ts-q4_k_m.gguf" --force
    measure ll-convert-f16 "${CONVERT[@]}" --outtype f16 --outfile "$WORK/ll-f16.gguf"
    measure ll-quant-q4_k_m "${QUANTIZE[@]}" "$WORK/ll-f16.gguf" "$WORK/ll-q4_k_m.gguf" Q4_K_M "$THREADS"
    continue
  fi
  measure ts-f16        "$TS" export --kind gguf --quant f16 --checkpoint "$MODEL" --out "$WORK/ts-f16.gguf" --force
  measure ll-convert-f16 "${CONVERT[@]}" --outtype f16 --outfile "$WORK/ll-f16.gguf"
  measure ts-q8_0       "$TS" export --kind gguf --quant q8_0 --checkpoint "$MODEL" --out "$WORK/ts-q8_0.gguf" --force
  measure ll-quant-q8_0 "${QUANTIZE[@]}" "$WORK/ll-f16.gguf" "$WORK/ll-q8_0.gguf" Q8_0 "$THREADS"
  measure ts-q4_k_m     "$TS" export --kind gguf --quant q4_k_m --checkpoint "$MODEL" --out "$WORK/ts-q4_k_m.gguf" --force
  measure ll-quant-q4_k_m "${QUANTIZE[@]}" "$WORK/ll-f16.gguf" "$WORK/ll-q4_k_m.gguf" Q4_K_M "$THREADS"
  measure ll-convert-q8_0 "${CONVERT[@]}" --outtype q8_0 --outfile "$WORK/ll-direct-q8_0.gguf"
done

# ---------------------------------------------------------------------------------------------
# 5. The table.
# ---------------------------------------------------------------------------------------------
median() { sort -g | awk '{a[NR] = $1} END {if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
col() { awk -v c="$2" '{print $c}' "$WORK/$1.times"; }     # col NAME 1|2: walls or RSS (KB)
mb() { awk -v b="$(stat -c %s "$1")" 'BEGIN {printf "%.1f", b / 1e6}'; }
rmb() { awk -v k="$1" 'BEGIN {printf "%.0f", k / 1024}'; }     # KB -> MiB
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }

if [ "$SHAPE" = llama-1b ]; then
  NAMES=(ts-q4_k_m ll-convert-f16 ll-quant-q4_k_m); QS=(q4_k_m)
else
  NAMES=(ts-f16 ts-q8_0 ts-q4_k_m ll-convert-f16 ll-convert-q8_0 ll-quant-q8_0 ll-quant-q4_k_m); QS=(q8_0 q4_k_m)
fi
declare -A W R
for n in "${NAMES[@]}"; do
  W[$n]=$(col "$n" 1 | median); R[$n]=$(col "$n" 2 | median)
done
# Two stages: the sum of the stages' median walls, the larger of their median peak RSS.
for q in "${QS[@]}"; do
  W[ll-2stage-$q]=$(awk -v a="${W[ll-convert-f16]}" -v b="${W[ll-quant-$q]}" 'BEGIN {print a + b}')
  R[ll-2stage-$q]=$(awk -v a="${R[ll-convert-f16]}" -v b="${R[ll-quant-$q]}" 'BEGIN {print (a > b ? a : b)}')
done

row() {  # quant, tunestudio key, tunestudio file, llama.cpp label, wall cell, llama.cpp key, file
  printf '| %s | %.2f | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$1" "${W[$2]}" "$(rmb "${R[$2]}")" \
    "$(mb "$3")" "$4" "$5" "$(rmb "${R[$6]}")" "$(mb "$7")" "$(ratio "${W[$2]}" "${W[$6]}")" \
    "$(ratio "${R[$2]}" "${R[$6]}")"
}
stages() { printf '%.2f + %.2f = %.2f' "${W[$1]}" "${W[$2]}" "${W[$3]}"; }

PARAMS=$("$PY" - "$MODEL" <<'EOF'
import glob, json, math, struct, sys
n = 0
for p in glob.glob(f"{sys.argv[1]}/*.safetensors"):
    with open(p, "rb") as f:
        h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    n += sum(math.prod(v["shape"]) for k, v in h.items() if k != "__metadata__")
print(f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M")
EOF
)
NFILES=$(ls "$MODEL"/*.safetensors | wc -l)
echo
echo "$SHAPE_NAME: $PARAMS parameters, $(cat "$MODEL"/*.safetensors | wc -c | awk '{printf "%.0f", $1 / 1e6}') MB bf16 safetensors in $NFILES file(s), random weights; $THREADS threads, $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) cores)"
echo "medians of $ROUNDS interleaved rounds; wall seconds and peak RSS (MiB) from /usr/bin/time; files in MB (1e6 bytes)${PRE:+; every command under ${PRE[*]}}"
echo "tunestudio: $TS_SRC; llama.cpp: llama-cpp-python $LCP_VERSION's vendored source (convert_hf_to_gguf.py, llama-quantize $THREADS threads); torch $("$PY" -c 'import torch; print(torch.__version__)'), transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
echo "load average (1/5/15 min) before the rounds: $LOAD_BEFORE, after: $(cut -d ' ' -f 1-3 /proc/loadavg) (another process on the cores slows both sides)"
echo "two-stage: converter --outtype f16 + llama-quantize, wall = the sum of the two medians, peak RSS = the larger of the two"
echo
echo "| quant | tunestudio s | tunestudio RSS MiB | tunestudio file MB | llama.cpp path | llama.cpp s | llama.cpp RSS MiB | llama.cpp file MB | time ratio ts/llama | RSS ratio ts/llama |"
echo "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"
if [ "$SHAPE" != llama-1b ]; then
  row f16    ts-f16    "$WORK/ts-f16.gguf"    "convert --outtype f16" "$(printf '%.2f' "${W[ll-convert-f16]}")" ll-convert-f16 "$WORK/ll-f16.gguf"
  row q8_0   ts-q8_0   "$WORK/ts-q8_0.gguf"   "convert f16 + llama-quantize Q8_0" "$(stages ll-convert-f16 ll-quant-q8_0 ll-2stage-q8_0)" ll-2stage-q8_0 "$WORK/ll-q8_0.gguf"
  row q8_0   ts-q8_0   "$WORK/ts-q8_0.gguf"   "convert --outtype q8_0" "$(printf '%.2f' "${W[ll-convert-q8_0]}")" ll-convert-q8_0 "$WORK/ll-direct-q8_0.gguf"
fi
row q4_k_m ts-q4_k_m "$WORK/ts-q4_k_m.gguf" "convert f16 + llama-quantize Q4_K_M" "$(stages ll-convert-f16 ll-quant-q4_k_m ll-2stage-q4_k_m)" ll-2stage-q4_k_m "$WORK/ll-q4_k_m.gguf"
echo
if [ "$SHAPE" = llama-1b ]; then
  echo "converter alone (--outtype f16): $(printf '%.2f' "${W[ll-convert-f16]}") s / $(rmb "${R[ll-convert-f16]}") MiB, $(mb "$WORK/ll-f16.gguf") MB; llama-quantize alone: Q4_K_M $(printf '%.2f' "${W[ll-quant-q4_k_m]}") s / $(rmb "${R[ll-quant-q4_k_m]}") MiB"
else
  echo "llama-quantize alone: Q8_0 $(printf '%.2f' "${W[ll-quant-q8_0]}") s / $(rmb "${R[ll-quant-q8_0]}") MiB, Q4_K_M $(printf '%.2f' "${W[ll-quant-q4_k_m]}") s / $(rmb "${R[ll-quant-q4_k_m]}") MiB"
fi
echo "per-run figures: $WORK/*.times (wall s, peak RSS KB, one line per round); logs: $WORK/*.log"

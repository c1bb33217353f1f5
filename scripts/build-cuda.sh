#!/usr/bin/env bash
# Builds tunestudio with candle's `cuda` (and `nccl`) features on a machine that
# has no GPU, no NVIDIA driver and no CUDA toolkit installed.
#
# The toolchain is NVIDIA's CUDA 13.0 wheels from PyPI (installed with
# `pip install --no-deps --target`), which merge into a working toolkit tree,
# plus a `libcuda` stub generated from the driver functions cudarc binds.
# The facts behind every step are in ../shared/notes/cuda-build.md.
#
# Steps (each one can be run on its own, see --help):
#   1. wheels    pip-install the pinned CUDA 13.0 wheels into $TOOLKIT_DIR
#   2. links     libX.so -> libX.so.N symlinks, NCCL linked into cu13/lib
#   3. stub      libcuda.so stub from cudarc's `cu*` names (link time only)
#   4. build     cargo build --release --features cuda[,nccl] into target/cuda/
#   5. bundle    stripped, xz-compressed binary + smallest fixtures for a GPU machine
#   (check)      `cargo check --features cuda,nccl` in ~minutes: type-checks the
#                CUDA-only Rust code with a stand-in nvcc that skips the kernels
#
# The stub is only for linking: the real driver provides libcuda.so.1 at run
# time. Never put $CUDA_HOME/lib/stubs on a GPU machine's library path.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"

# Pinned versions: keep nvcc at 13.0.x, the GPU machines run driver 580
# (CUDA 13.0) and PTX from a newer nvcc may not load there.
WHEELS=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-cccl==13.0.85"
  "nvidia-cublas==13.0.2.14"
  "nvidia-curand==10.4.0.35"
  "nvidia-cuda-nvrtc==13.0.88"
)
# cudarc 0.19's NCCL bindings are the 2.30 ones.
NCCL_WHEEL="nvidia-nccl-cu13==2.30.7"

TOOLKIT_DIR="${TUNESTUDIO_CUDA_DIR:-$HOME/.cache/tunestudio/cuda-13.0}"
# Under target/ so that git (and the tools that copy the working tree) ignore them.
TARGET_DIR="${TUNESTUDIO_CUDA_TARGET:-$REPO_DIR/target/cuda}"
BUNDLE_DIR="${TUNESTUDIO_GPU_BUNDLE:-$REPO_DIR/target/gpu-bundle}"
COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
WITH_NCCL=1
WITH_GUI=0
STEPS=()

usage() {
  cat <<EOF
Usage: scripts/build-cuda.sh [OPTIONS] [STEP...]

Builds the CUDA (+ NCCL) tunestudio binary without a GPU, using NVIDIA's
CUDA 13.0 wheels from PyPI and a generated libcuda link stub.

Steps (default: wheels links stub build):
  wheels     pip install --no-deps --target \$TOOLKIT_DIR the pinned CUDA 13.0 wheels (~850 MB download)
  links      create libX.so -> libX.so.N symlinks and link NCCL into cu13/lib
  stub       generate and compile the libcuda.so link stub (needs gcc and cudarc's sources)
  build      cargo build --release (headless) --features cuda[,nccl] into \$TARGET_DIR
  bundle     copy a stripped, xz-compressed binary + tiny fixtures into \$BUNDLE_DIR
             for scripts/gpu-check.sh on a GPU machine (must stay under 64 MiB)
  env        print the environment the build uses (source-able), then exit
  check      type-check the cuda/nccl code (cargo check into \$TARGET_DIR-check): the headless
             build with every test/example target; a stand-in nvcc writes
             empty kernels, so minutes instead of ~19, nothing runnable (CI runs this)

Options:
  --no-nccl          build with \`cuda\` only (default: cuda + nccl)
  --gui              keep the desktop GUI in the binary (default: headless, smaller)
  --toolkit DIR      toolkit folder (default: \$TUNESTUDIO_CUDA_DIR or ~/.cache/tunestudio/cuda-13.0)
  --target-dir DIR   cargo target folder (default: \$TUNESTUDIO_CUDA_TARGET or ./target/cuda)
  --bundle-dir DIR   where \`bundle\` writes (default: \$TUNESTUDIO_GPU_BUNDLE or ./target/gpu-bundle)
  --compute-cap N    CUDA_COMPUTE_CAP for candle's kernels (default: 90 = H100/H200; candle builds sm_90a)
  -h, --help         this help

Figures measured on 2 cores: ~19 min for a clean build (8 of them nvcc compiling
candle-kernels), a 38 MB binary needing libcuda.so.1, libcublas(Lt).so.13,
libcurand.so.10, libcudart.so.13 (+ libnccl.so.2) at run time.
EOF
}

log() { printf '[build-cuda] %s\n' "$*" >&2; }
die() { printf '[build-cuda] error: %s\n' "$*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --no-nccl) WITH_NCCL=0 ;;
    --gui) WITH_GUI=1 ;;
    --toolkit) shift; TOOLKIT_DIR="${1:?--toolkit needs a folder}" ;;
    --target-dir) shift; TARGET_DIR="${1:?--target-dir needs a folder}" ;;
    --bundle-dir) shift; BUNDLE_DIR="${1:?--bundle-dir needs a folder}" ;;
    --compute-cap) shift; COMPUTE_CAP="${1:?--compute-cap needs a number like 90}" ;;
    wheels|links|stub|build|bundle|env|check) STEPS+=("$1") ;;
    *) usage >&2; die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
if [[ ${#STEPS[@]} -eq 0 ]]; then
  STEPS=(wheels links stub build)
fi

CUDA_HOME="$TOOLKIT_DIR/nvidia/cu13"
FEATURES="cuda"
[[ $WITH_NCCL -eq 1 ]] && FEATURES="cuda,nccl"

cuda_env() {
  export CUDA_HOME
  export CUDA_PATH="$CUDA_HOME"
  export PATH="$CUDA_HOME/bin:$PATH"
  export CUDA_COMPUTE_CAP="$COMPUTE_CAP"
  export CUDARC_CUDA_VERSION=13000
  # candle-kernels' build looks for nvcc through $NVCC first.
  export NVCC="$CUDA_HOME/bin/nvcc"
}

step_env() {
  cuda_env
  cat <<EOF
export CUDA_HOME="$CUDA_HOME"
export CUDA_PATH="$CUDA_HOME"
export PATH="$CUDA_HOME/bin:\$PATH"
export CUDA_COMPUTE_CAP="$COMPUTE_CAP"
export CUDARC_CUDA_VERSION=13000
export NVCC="$CUDA_HOME/bin/nvcc"
# build: cargo build --release --no-default-features --features $FEATURES --target-dir "$TARGET_DIR"
EOF
}

step_wheels() {
  command -v python3 >/dev/null || die "python3 with pip is needed to install the CUDA wheels"
  mkdir -p "$TOOLKIT_DIR"
  local wanted=("${WHEELS[@]}")
  [[ $WITH_NCCL -eq 1 ]] && wanted+=("$NCCL_WHEEL")
  local marker="$TOOLKIT_DIR/.tunestudio-wheels"
  if [[ -f "$marker" ]] && [[ "$(cat "$marker")" == "${wanted[*]}" ]] && [[ -x "$CUDA_HOME/bin/nvcc" ]]; then
    log "wheels already installed in $TOOLKIT_DIR"
    return
  fi
  log "installing ${#wanted[@]} CUDA 13.0 wheels into $TOOLKIT_DIR (~850 MB download)"
  # --upgrade replaces the whole nvidia/ folder, so links and stub are redone after this step.
  python3 -m pip install --disable-pip-version-check --no-deps --upgrade --target "$TOOLKIT_DIR" "${wanted[@]}"
  [[ -x "$CUDA_HOME/bin/nvcc" ]] || die "nvcc missing at $CUDA_HOME/bin/nvcc after installing the wheels"
  echo "${wanted[*]}" >"$marker"
}

step_links() {
  [[ -d "$CUDA_HOME/lib" ]] || die "$CUDA_HOME/lib not found: run the 'wheels' step first"
  local lib base
  # The wheels ship only versioned libraries (libcublas.so.13); `-lcublas` needs libcublas.so.
  for lib in "$CUDA_HOME"/lib/lib*.so.*; do
    [[ -e "$lib" ]] || continue
    base="$(basename "$lib")"
    base="${base%%.so.*}.so"
    [[ -e "$CUDA_HOME/lib/$base" ]] || ln -s "$(basename "$lib")" "$CUDA_HOME/lib/$base"
  done
  # The NCCL wheel installs outside cu13/.
  local nccl_dir="$TOOLKIT_DIR/nvidia/nccl/lib"
  if [[ -d "$nccl_dir" ]]; then
    for lib in "$nccl_dir"/libnccl.so*; do
      [[ -e "$lib" ]] || continue
      ln -sf "$lib" "$CUDA_HOME/lib/$(basename "$lib")"
    done
    [[ -e "$CUDA_HOME/lib/libnccl.so" ]] || ln -s libnccl.so.2 "$CUDA_HOME/lib/libnccl.so"
  elif [[ $WITH_NCCL -eq 1 ]]; then
    die "NCCL wheel not found at $nccl_dir: run the 'wheels' step (without --no-nccl)"
  fi
  # nvcc.profile uses relative paths, but the toolkit also expects lib64.
  [[ -e "$CUDA_HOME/lib64" ]] || ln -s lib "$CUDA_HOME/lib64"
  log "library symlinks ready in $CUDA_HOME/lib"
}

find_cudarc_src() {
  local dir
  dir="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1 || true)"
  if [[ -z "$dir" ]]; then
    log "cudarc sources not in the cargo registry yet: cargo fetch"
    (cd "$REPO_DIR" && cargo fetch >/dev/null)
    dir="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1 || true)"
  fi
  [[ -n "$dir" ]] || die "cudarc 0.19 sources not found under ~/.cargo/registry/src after cargo fetch"
  echo "$dir"
}

step_stub() {
  command -v gcc >/dev/null || die "gcc is needed to compile the libcuda stub"
  [[ -d "$CUDA_HOME" ]] || die "$CUDA_HOME not found: run the 'wheels' step first"
  local cudarc bindings stub_dir src names
  cudarc="$(find_cudarc_src)"
  bindings="$cudarc/src/driver/sys/mod.rs"
  [[ -f "$bindings" ]] || die "cudarc driver bindings not found at $bindings"
  stub_dir="$CUDA_HOME/lib/stubs"
  mkdir -p "$stub_dir"
  src="$stub_dir/libcuda_stub.c"
  # Every `pub fn cuXxx(` / `pub unsafe fn cuXxx(` the bindings declare. The stub
  # is never called (the real driver replaces it); the linker only needs the names.
  names="$(grep -oE 'pub (unsafe )?fn cu[A-Za-z0-9_]+' "$bindings" | awk '{print $NF}' | sort -u)"
  [[ -n "$names" ]] || die "no cu* function names found in $bindings"
  {
    echo "/* Generated by scripts/build-cuda.sh from $bindings: link-time stub only. */"
    echo "#define CUDA_ERROR_STUB_LIBRARY 34"
    for n in $names; do
      echo "int $n(void) { return CUDA_ERROR_STUB_LIBRARY; }"
    done
  } >"$src"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub_dir/libcuda.so" "$src"
  ln -sf libcuda.so "$stub_dir/libcuda.so.1"
  log "libcuda stub with $(wc -w <<<"$names") functions at $stub_dir/libcuda.so"
}

step_build() {
  [[ -x "$CUDA_HOME/bin/nvcc" ]] || die "nvcc not found at $CUDA_HOME/bin/nvcc: run the 'wheels' step first"
  [[ -f "$CUDA_HOME/lib/stubs/libcuda.so" ]] || die "libcuda stub missing: run the 'stub' step first"
  cuda_env
  local feats="$FEATURES" default_flag="--no-default-features"
  if [[ $WITH_GUI -eq 1 ]]; then
    feats="gui,$FEATURES"
  fi
  log "nvcc: $(nvcc --version | tail -n 1)"
  log "cargo build --release $default_flag --features $feats --target-dir $TARGET_DIR"
  (cd "$REPO_DIR" && cargo build --release $default_flag --features "$feats" --target-dir "$TARGET_DIR" --bin tunestudio)
  log "built $TARGET_DIR/release/tunestudio"
}

step_bundle() {
  local bin="$TARGET_DIR/release/tunestudio"
  [[ -x "$bin" ]] || die "$bin not found: run the 'build' step first"
  command -v xz >/dev/null || die "xz is needed to compress the bundle"
  rm -rf "$BUNDLE_DIR"
  mkdir -p "$BUNDLE_DIR/shared/fixtures" "$BUNDLE_DIR/shared/model-configs"
  cp "$bin" "$BUNDLE_DIR/tunestudio"
  strip "$BUNDLE_DIR/tunestudio" 2>/dev/null || true
  xz -T0 -6 -f "$BUNDLE_DIR/tunestudio"
  # The parity checks need one fixture model; the planner grid needs the configs.
  local shared="${TUNESTUDIO_SHARED:-$REPO_DIR/../shared}"
  cp -r "$shared/fixtures/tiny-llama" "$BUNDLE_DIR/shared/fixtures/"
  cp "$shared"/model-configs/*.json "$BUNDLE_DIR/shared/model-configs/"
  local size_kib tree_kib total_kib
  size_kib="$(du -sk "$BUNDLE_DIR" | cut -f1)"
  # What travels is the checkout (tracked files) plus the bundle: 64 MiB in all.
  tree_kib="$(cd "$REPO_DIR" && git ls-files -z 2>/dev/null | xargs -0 du -ck 2>/dev/null | tail -n 1 | cut -f1)"
  total_kib=$((size_kib + ${tree_kib:-0}))
  log "bundle: $BUNDLE_DIR ($((size_kib / 1024)) MiB: $(du -h "$BUNDLE_DIR/tunestudio.xz" | cut -f1) binary, xz); with the checkout $((total_kib / 1024)) MiB"
  if [[ $total_kib -gt $((64 * 1024)) ]]; then
    die "checkout + bundle is over 64 MiB ($((total_kib / 1024)) MiB): it cannot travel to the GPU machine"
  fi
  log "on the GPU machine, from the checkout root: scripts/gpu-check.sh   (report: target/gpu-check-out/check.json, or \$OUT/check.json)"
}

step_check() {
  [[ -x "$CUDA_HOME/bin/nvcc" ]] || die "nvcc not found at $CUDA_HOME/bin/nvcc: run the 'wheels' step first"
  cuda_env
  # A stand-in nvcc: version and architecture queries go to the real one (cudarc
  # and candle-kernels' build scripts ask them); compilations only create their
  # outputs empty. `cargo check` never links or loads a kernel, so this
  # type-checks every #[cfg(feature = "cuda"/"nccl")] line without the ~8 min of
  # kernel compilation. The result is not a usable build.
  local fake_dir="$TOOLKIT_DIR/fake-nvcc"
  mkdir -p "$fake_dir"
  cat >"$fake_dir/nvcc" <<FAKE
#!/usr/bin/env bash
real="$CUDA_HOME/bin/nvcc"
outdir=""; out=""; ptx=0; lib=0; srcs=()
args=("\$@")
for ((i = 0; i < \${#args[@]}; i++)); do
  a="\${args[\$i]}"
  case "\$a" in
    --version|-V|--list-gpu-code|--list-gpu-arch) exec "\$real" "\$@" ;;
    --output-directory|-odir) i=\$((i + 1)); outdir="\${args[\$i]}" ;;
    -o) i=\$((i + 1)); out="\${args[\$i]}" ;;
    --ptx|-ptx) ptx=1 ;;
    --lib|-lib) lib=1 ;;
    *.cu) srcs+=("\$a") ;;
  esac
done
if [[ \$ptx -eq 1 ]]; then
  for s in "\${srcs[@]}"; do b="\$(basename "\$s" .cu)"; : >"\${outdir:-.}/\$b.ptx"; done
elif [[ \$lib -eq 1 ]]; then
  rm -f "\$out"; ar rcs "\$out"
elif [[ -n "\$out" ]]; then
  : >"\$out"
fi
exit 0
FAKE
  chmod +x "$fake_dir/nvcc"
  local feats="cuda"
  [[ $WITH_NCCL -eq 1 ]] && feats="cuda,nccl"
  # One build covers every cuda/nccl line: the headless server binary with every test,
  # example and bench target. No studio file names either feature
  # (tests/it/headless.rs::no_cuda_line_is_studio_only), so the studio's build, whose GUI
  # crates were about half of this check's cold time, is not checked again with them.
  log "cargo check --no-default-features --features $feats --all-targets (headless, tests, examples; stand-in nvcc)"
  (cd "$REPO_DIR" && NVCC="$fake_dir/nvcc" PATH="$fake_dir:$PATH" \
    cargo check --no-default-features --features "$feats" --target-dir "${TARGET_DIR}-check" --all-targets)
  log "the cuda/nccl code type-checks (headless, all targets)"
}

for step in "${STEPS[@]}"; do
  case "$step" in
    wheels) step_wheels ;;
    links) step_links ;;
    stub) step_stub ;;
    build) step_build ;;
    bundle) step_bundle ;;
    env) step_env ;;
    check) step_check ;;
  esac
done

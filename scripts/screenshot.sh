#!/usr/bin/env bash
# Renders the real studio window under Xvfb (Mesa llvmpipe for OpenGL) and saves
# README screenshots to docs/screenshots/. Each shot starts the app with the bundled
# demo project, opens one panel, waits until the background jobs are done (and for the
# run panel, until the demo has trained some steps), saves a PNG and exits.
#
#   scripts/screenshot.sh                 # every panel
#   scripts/screenshot.sh preview run     # only these
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v xvfb-run >/dev/null; then
    echo "xvfb-run is not installed (apt-get install xvfb)" >&2
    exit 1
fi

cargo build --bin tunestudio
BIN=target/debug/tunestudio
OUT=docs/screenshots
mkdir -p "$OUT"

panels=("$@")
if [ ${#panels[@]} -eq 0 ]; then
    panels=(model dataset preview training devices run export)
fi

for panel in "${panels[@]}"; do
    steps=""
    config=""
    if [ "$panel" = run ]; then
        steps=40   # train 40 of the demo's 80 steps so the charts have curves
    fi
    if [ "$panel" = devices ]; then
        # The memory plan of a real 8B model on two 24 GiB GPUs (needs ../shared).
        if [ -f ../shared/model-configs/llama-3.1-8b.json ]; then
            config=docs/screenshots/plan-8b.toml
        fi
    fi
    echo "== $panel"
    LIBGL_ALWAYS_SOFTWARE=1 \
    TUNESTUDIO_SCREENSHOT="$OUT/$panel.png" \
    TUNESTUDIO_SCREENSHOT_PANEL="$panel" \
    TUNESTUDIO_SCREENSHOT_TRAIN_STEPS="$steps" \
    TUNESTUDIO_CONFIG="$config" \
        timeout 300 xvfb-run -a -s "-screen 0 1400x900x24" "$BIN"
done
ls -la "$OUT"

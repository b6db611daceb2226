#!/usr/bin/env bash
# The GPU check in one command (issue 22): probes of the CUDA behaviour the fast paths rely on, the CUDA tests, and
# real-size FLUX.1-dev rows of benchmarks/realscale.py, each part under its own time limit and each writing its results
# into RESULTS as it goes, so that a run stopped by a time-out keeps what was done.
#
#   tools/gpu_check.sh RESULTS [SECONDS]      # SECONDS: the whole check's time limit (default 540)
#
# Environment: PYTHON (default python3), ROWS (realscale --only keys), STEPS, CALLS, SCALE (real or tiny), PEERS (the
# peers' rows, each run in its own process beside no offload: their hooks cannot be removed; a peer whose package is
# not importable, diffusers-mm's without its wheel carried, says so and is skipped).
# Without CUDA every part says so and the script exits 0 (the test suite runs it with SCALE=tiny).
# Each row is the median of CALLS-1 steady calls (CALLS 4: three), against no offload measured in the same process,
# and against its floor (no offload plus its host-to-device bytes at the page-locked rate).
set -u
RESULTS=${1:?usage: tools/gpu_check.sh RESULTS [SECONDS]}
LIMIT=${2:-540}
PYTHON=${PYTHON:-python3}
ROWS=${ROWS:-no-offload,default,exclude,keep,residency-budget,group}
PEERS=${PEERS:-mm-auto,mm-block-pin}
STEPS=${STEPS:-10}
CALLS=${CALLS:-4}
SCALE=${SCALE:-real}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$RESULTS"
START=$(date +%s)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

left() { echo $((LIMIT - ($(date +%s) - START))); }
# part NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS (and within the whole limit), its output appended to
# logs.txt under a header (the device tool brings back at most 8 files).
part() {
    local name=$1 seconds=$2
    shift 2
    local room
    room=$(left)
    [ "$seconds" -gt "$room" ] && seconds=$room
    if [ "$seconds" -le 5 ]; then
        echo "$name: not run (the check's time limit is spent)" | tee -a "$RESULTS/summary.txt"
        return
    fi
    local t0=$(date +%s)
    echo "===== $name: $*" >>"$RESULTS/logs.txt"
    timeout --kill-after=10 "$seconds" "$@" >>"$RESULTS/logs.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc after $(($(date +%s) - t0)) s (limit $seconds s)" | tee -a "$RESULTS/summary.txt"
}

{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    "$PYTHON" - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("diffusers", "accelerate", "transformers", "safetensors"):
    try:
        print(name, __import__(name).__version__)
    except Exception as error:
        print(name, "missing:", error)
PY
} >"$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

for section in pagelock pools bandwidth mapped fingerprint; do
    part "probe-$section" 60 "$PYTHON" "$ROOT/benchmarks/gpu_probes.py" "$section" --out "$RESULTS/probes.jsonl"
done
part probe-tiny 120 "$PYTHON" "$ROOT/benchmarks/gpu_probes.py" tiny --out "$RESULTS/probes.jsonl"
part cuda-tests 150 "$PYTHON" -m pytest -p no:cacheprovider -q -s -rs "$ROOT/tests/test_block_streaming_cuda.py" \
    "$ROOT/tests/test_out_of_memory_cuda.py" "$ROOT/tests/test_fused_fingerprint_cuda.py"
part realscale 100000 "$PYTHON" "$ROOT/benchmarks/realscale.py" --scale "$SCALE" --model flux-dev --only "$ROWS" \
    --steps "$STEPS" --calls "$CALLS" --json-out "$RESULTS/realscale.json" --write "$RESULTS/realscale.md"
for peer in ${PEERS//,/ }; do
    case "$peer" in mm-*) module=diffusers_mm ;; *) module="" ;; esac
    if [ -n "$module" ] && ! "$PYTHON" -c "import $module" 2>/dev/null; then
        echo "peer-$peer: not run ($module is not importable: carry its wheel)" | tee -a "$RESULTS/summary.txt"
        continue
    fi
    part "peer-$peer" 100000 "$PYTHON" "$ROOT/benchmarks/realscale.py" --scale "$SCALE" --model flux-dev \
        --only "no-offload,$peer" --steps "$STEPS" --calls "$CALLS" --json-out "$RESULTS/peer-$peer.json"
done
exit 0

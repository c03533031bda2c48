#!/usr/bin/env bash
# The GPU check: what a session lent a GPU runs first, in one go, into one JSON file.
#
#   bench/gpu_check.sh [OUT.json]        (default: bench/results/gpu-check.json)
#
# On one CUDA GPU (meant to fit 8 minutes on an H200; not yet run on one), each part
# under its own time limit, so a part that hangs leaves the others' figures:
#   1. every CUDA test: tests/unit/edge/profiling/test_profiler_gpu.py (the profiler) and
#      tests/e2e/test_cuda.py (server-tier stages on the GPU, eager and compiled, and a CPU
#      agent feeding a GPU agent over MQTT, each held to the CPU reference loop);
#   2. bench/gpu.py at microbatch 16: the explicit, fused and fused-compiled variants,
#      MFU of the measured matmul rate and of the rated peak, torch.profiler's top
#      operators per variant, and the one-stage runtime against a plain loop (--vs-plain).
# The JSON holds each part's exit status, seconds and results; the script exits non-zero
# if a part failed. PYTHON picks the interpreter (default python3); packages missing there
# (paho-mqtt, pydantic, crc32c, tomli-w...) must be on its path first (see the device
# tool's README on carrying wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu tries the script here (CPU figures, the CUDA tests skipped)
OUT=${1:-bench/results/gpu-check.json}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1

part() {  # part NAME LIMIT_S COMMAND...: run it, keep its log, status and seconds
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - t0))" >"$WORK/$name.status"
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 15 "$WORK/$name.log"
}

part tests 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
    --junitxml "$WORK/tests.xml" \
    tests/unit/edge/profiling/test_profiler_gpu.py tests/e2e/test_cuda.py
part bench 420 "$PY" bench/gpu.py --device "$DEVICE" --microbatches 16 --profile --vs-plain \
    --out "$WORK/bench.json"

"$PY" - "$WORK" "$OUT" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {"parts": {}}
for name in ("tests", "bench"):
    rc, seconds = (work / f"{name}.status").read_text().split()
    log = (work / f"{name}.log").read_text(errors="replace")
    result["parts"][name] = {"exit": int(rc), "seconds": int(seconds), "log_tail": log[-4000:]}
xml = work / "tests.xml"
if xml.exists():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    result["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = work / "bench.json"
if bench.exists():
    result["bench"] = json.loads(bench.read_text())
    summary = {}
    for name, variant in result["bench"]["variants"].items():
        big = variant["largest_stage"]
        summary[name] = {
            "largest_stage_mfu_rated": big["mfu_rated"],
            "largest_stage_mfu_measured": big["mfu"],
            "meets_target": big["meets_target"],
        }
    if "vs_plain" in result["bench"]:
        summary["vs_plain_ratio"] = result["bench"]["vs_plain"]["ratio"]
    result["summary"] = summary
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result.get("summary", {}), indent=2))
print(f"wrote {out}")
failed = [n for n, p in result["parts"].items() if p["exit"] != 0]
sys.exit(1 if failed else 0)
EOF

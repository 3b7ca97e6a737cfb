#!/usr/bin/env bash
# The figures of BENCHMARKS.md's "load at the host's speed" on a GPU host without a package index, from a checkout:
#     bash benchmarks/gpu_host.sh [OUT]
# Wheels the host lacks (pyzmq) are taken from .whl/ when it is there; expertd runs from a copy on PYTHONPATH (its
# package folders as an install lays them out), so nothing is installed. Each benchmark's output goes to OUT too.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/expertd-gpu-host}}
mkdir -p "$OUT"
SITE=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
fi
mkdir -p "$SITE/expertd"
cp -r expertd/. "$SITE/expertd/"
for d in server client kernels tools; do cp -r "$d" "$SITE/expertd/$d"; done
export PYTHONPATH=$SITE PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nproc
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
STEPS=${STEPS:-dequant loader tests}  # or any of: gpu-daemon, a script.py of your own
for step in $STEPS; do
    case $step in
    dequant) timeout 240 python3 benchmarks/bench_dequant.py --gpu-only 2>&1 | tee "$OUT/dequant.txt" ;;
    loader) timeout 400 python3 benchmarks/bench_loader.py --only L1 --threads "${THREADS:-1,2,4,8,16}" --reps 2 \
        --per-chunk --cuda 2>&1 | tee "$OUT/loader.txt" ;;
    gpu-daemon) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_daemon.py 2>&1 | tail -5 \
        | tee "$OUT/gpu-daemon.txt" ;;
    *.py) timeout 300 python3 "$step" 2>&1 | tee "$OUT/$(basename "$step" .py).txt" ;;
    tests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_daemon.py tests/test_kernels_triton.py \
        tests/test_mxfp4_triton.py 2>&1 | tail -15 | tee "$OUT/tests.txt" ;;
    esac
done

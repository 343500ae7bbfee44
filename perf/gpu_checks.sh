#!/usr/bin/env bash
# Every GPU check of the project in one device call (the H200 lease is short):
#   device run, carry [".gpu", ".whl"]:  bash perf/gpu_checks.sh
# (env: TESTS to pick test files, QUANT_COMPARE=1 for the batch-1 GEMV comparison,
#  VARIANTS / TOKENS / BENCH_ARGS for bench_decode.py)
# 1. the CUDA tests (engine on CUDA, CUDA graphs, the budget cap, every kernel at Volundr-32B
#    shapes, KDA against fla when its wheel is carried in .whl/), 2. the end-to-end decode
#    benchmark of Volundr-32B (mixed ~3.2-bit, then bf16). Logs and JSON land in $OUT.
set -uo pipefail
source .gpu/bootstrap.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
{ git rev-parse HEAD; git status --short; \
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$OUT/env.txt" 2>&1
TESTS=${TESTS:-"tests/test_gpu_engine.py tests/test_engine.py tests/test_kernels_engram.py \
  tests/test_kernels_attention.py tests/test_kernels_norm.py tests/test_quant.py tests/test_kernels_kda.py"}
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider $TESTS -k "cuda or gpu" \
  2>&1 | tee "$OUT/gpu_tests.log"
# (KDA last: fla autotunes on its first call, which can take minutes)
if [ -n "${QUANT_COMPARE:-}" ]; then  # batch-1 GEMV: the FMA path against the tensor-core one
  timeout "${QUANT_TIMEOUT:-100}" python3 perf/kernels/bench_quant.py --m1-compare \
    --out "$OUT/gemv_compare.json" 2>&1 | tail -40 > "$OUT/gemv_compare.log"
fi
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" python3 perf/bench_decode.py --out "$OUT/decode.json" \
  --variants "${VARIANTS:-mixed:16,bf16}" --tokens "${TOKENS:-256}" --profile-dir "$OUT" \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/decode.log"

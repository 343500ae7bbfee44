#!/usr/bin/env bash
# Every GPU check of the project (one device call may run at most 600 s; session 7's timings):
#   device run, carry [".gpu", ".whl"]:
#     PART=tests bash perf/gpu_checks.sh   # every CUDA test, KDA against fla last: ~9 min, so
#                                          # two calls with TESTS split (runs 16-18)
#     PART=bench COMPARE=gemv bash perf/gpu_checks.sh   # GEMV configs (~1.5 min) + end-to-end
#                                          # decode, 2 variants (~2.5 min; ~1.2 min each after
#                                          # the first, session 8); gemm16, kda apart
# env: TESTS (test files), TEST_K (pytest -k), TEST_TIMEOUT; COMPARE (comma list of gemv, gemm16,
#      kda, chain; "" = none; CHAIN_ARGS / CHAIN_TIMEOUT for perf/kernels/bench_chain.py);
#      VARIANTS ("" = no end-to-end run) / TOKENS / BENCH_ARGS (perf/bench_decode.py),
#      BENCH_TIMEOUT; TC_CONFIGS / TC16_CONFIGS ("reps,warps,waves;...": the tensor-core configs
#      that gemv / gemm16 compare; GEMV_TIMEOUT, GEMM16_TIMEOUT); NOPDL_TESTS / NOPDL_VARIANTS:
#      tests / variants run again with VOLUNDR_PDL=0 (programmatic dependent launch, kernels/pdl.py, is on by default on sm_90;
#      decode_nopdl.json); KDA_ARGS / KDA_TIMEOUT (bench_kda.py --intra-compare).
# Output under $OUT, few files (the device returns about 8): env.txt, gpu_tests.log (-v: one
# line per test, readable even when a timeout cuts the run), bench.log, gemv_compare.json,
# gemm16_compare.json, kda_intra.jsonl, decode.json, profiles.txt.
set -uo pipefail
source .gpu/bootstrap.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
PART=${PART:-all}
mkdir -p "$OUT"
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if ls .whl/llguidance-*.whl >/dev/null 2>&1; then  # structured output (tests/test_structured.py)
  python3 -m pip install -q --no-index --no-deps .whl/llguidance-*.whl
fi
{ git rev-parse HEAD; git status --short; \
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$OUT/env.txt" 2>&1

if [ "$PART" != bench ]; then
  TESTS=${TESTS:-"tests/test_gpu_engine.py tests/test_engine.py tests/test_kernels_engram.py \
    tests/test_kernels_attention.py tests/test_kernels_norm.py tests/test_quant.py \
    tests/test_triton_only.py tests/test_gemv_chain.py tests/test_gemv_i8.py tests/test_gemv_i8_rows.py \
    tests/test_residual_fold.py \
    tests/test_kv_cache_dtype.py tests/test_sessions.py tests/test_speculative.py tests/test_speculative_mtp.py \
    tests/test_speculative_steps.py tests/test_kernels_spec.py \
    tests/test_penalties.py tests/test_structured.py tests/test_kda_rows.py tests/test_kda_low_rank.py \
    tests/test_kernels_kda.py"}
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -v --tb=short -p no:cacheprovider $TESTS \
    -k "${TEST_K:-cuda or gpu}" > "$OUT/gpu_tests.log" 2>&1
  tail -5 "$OUT/gpu_tests.log"
  if [ -n "${NOPDL_TESTS:-}" ]; then  # again without programmatic dependent launch
    echo "######## VOLUNDR_PDL=0" >> "$OUT/gpu_tests.log"
    # shellcheck disable=SC2086
    VOLUNDR_PDL=0 timeout "${NOPDL_TEST_TIMEOUT:-200}" python3 -m pytest -v --tb=short \
      -p no:cacheprovider $NOPDL_TESTS -k "cuda or gpu" >> "$OUT/gpu_tests.log" 2>&1
    tail -3 "$OUT/gpu_tests.log"
  fi
fi

if [ "$PART" != tests ]; then
  COMPARE=${COMPARE-gemv,gemm16,kda}
  if [[ ",$COMPARE," == *,gemv,* ]]; then  # batch 1: FMA path vs tensor cores
    timeout "${GEMV_TIMEOUT:-240}" python3 perf/kernels/bench_quant.py --m1-compare \
      --tc-configs "${TC_CONFIGS:-}" --out "$OUT/gemv_compare.json" 2>&1 | tail -22 \
      >> "$OUT/bench.log"
  fi
  if [[ ",$COMPARE," == *,gemm16,* ]]; then  # batch 2-16: tile path vs tensor cores
    timeout "${GEMM16_TIMEOUT:-120}" python3 perf/kernels/bench_quant.py --m16-compare \
      --tc-configs "${TC16_CONFIGS:-}" --out "$OUT/gemm16_compare.json" 2>&1 | tail -30 \
      >> "$OUT/bench.log"
  fi
  if [[ ",$COMPARE," == *,chain,* ]]; then  # dependent GEMVs: launches vs one chain launch
    timeout "${CHAIN_TIMEOUT:-400}" python3 perf/kernels/bench_chain.py --out "$OUT/chain.json" \
      ${CHAIN_ARGS:-} 2>&1 | tail -40 >> "$OUT/bench.log"
  fi
  if [[ ",$COMPARE," == *,kda,* ]]; then  # KDA prefill chunk-local stage: current vs sub vs fla
    # shellcheck disable=SC2086
    timeout "${KDA_TIMEOUT:-120}" python3 perf/kernels/bench_kda.py --out "$OUT" --intra-compare \
      ${KDA_ARGS:-} 2>&1 | tail -8 >> "$OUT/bench.log"
  fi
  VARIANTS=${VARIANTS-mixed:16@8,mixed:16@8+norfold}
  # shellcheck disable=SC2086
  [ -n "$VARIANTS" ] && timeout "${BENCH_TIMEOUT:-240}" python3 perf/bench_decode.py --out "$OUT/decode.json" \
    --variants "$VARIANTS" --tokens "${TOKENS:-256}" \
    --no-eager --prefill-lens 2048,4000 --profile-dir "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | grep -v Warning | tail -12 >> "$OUT/bench.log"
  if [ -n "${NOPDL_VARIANTS:-}" ]; then  # the same with VOLUNDR_PDL=0: a process of its own
    echo "######## VOLUNDR_PDL=0" >> "$OUT/bench.log"
    echo "######## VOLUNDR_PDL=0" >> "$OUT/profiles.txt"
    # shellcheck disable=SC2086
    VOLUNDR_PDL=0 timeout "${NOPDL_BENCH_TIMEOUT:-240}" python3 perf/bench_decode.py \
      --out "$OUT/decode_nopdl.json" --variants "$NOPDL_VARIANTS" --tokens "${TOKENS:-256}" \
      --no-eager --profile-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tail -8 \
      >> "$OUT/bench.log"
  fi
  tail -30 "$OUT/bench.log"
fi

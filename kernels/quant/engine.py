"""Entry point the model uses on CUDA: y = x @ W^T for a mixed-bit W in the kernel layout.

Strategy by the number of rows M of x, from the H200 sweep of perf/kernels/bench_quant.py
(perf/RESULTS.md, "Mixed-bit weights"; 17408x5120 figures, CUDA-graph timings):
  M = 1        FMA GEMV (`gemv.py`, BLOCK_M = 1), split-K: 2/3/4-bit 18.7 / 24.6 / 26.4 us
               (bf16 cuBLAS 47.7 us);
  2 <= M <= 16 tensor-core tile of 16 rows, one pipeline stage + register prefetch:
               42 / 61 / 45 us (3 stages: 116 / 133 / 119 us);
               opt-in VOLUNDR_QUANT_GEMM16=tc: `gemm_tc.py` (bf16x2 dequantisation shared by
               all M rows, x^T as the mma B operand; not yet measured on a GPU);
  M <= 128     64-row tensor-core tiles (M = 64: 97 / 131 / 106 us vs 137 / 144 / 320 us
               for dequantise + cuBLAS);
  M > 128      dequantise 8192 output features at a time to bf16, cuBLAS GEMM (`gemm.py`):
               M = 256: 190 / 171 / 227 us vs 238 / 314 / 267 us fused.
"""

from __future__ import annotations

import os

import torch

from volundr.kernels.quant import gemm_tc, gemv_tc
from volundr.kernels.quant.gemm import dequant_matmul
from volundr.kernels.quant.gemv import MAX_M, quant_matmul_triton

# M = 1: (bn, num_warps, waves, prefetch) per bit width; rows per thread = bn / (128 num_warps)
GEMV_CONFIG = {2: (128, 1, 8.0, True), 3: (256, 2, 4.0, True), 4: (128, 1, 8.0, False)}
# M = 1 on the tensor cores (gemv_tc.py: bf16x2 dequantisation + mma, ~1 SASS instruction per
# weight instead of ~3.5), VOLUNDR_QUANT_GEMV=tc, read once at import. H200 sweep
# (perf/RESULTS.md): reps=2, waves=24 is the best config at every measured shape and bit width,
# 1.17-1.56x the FMA path; smaller shapes (K or N < TC_MIN_DIM) keep the FMA path (unmeasured).
GEMV_PATH = os.environ.get("VOLUNDR_QUANT_GEMV", "fma")
if GEMV_PATH not in ("fma", "tc"):
    raise ValueError(f"VOLUNDR_QUANT_GEMV must be fma or tc, not {GEMV_PATH!r}")
GEMV_TC_CONFIG = {b: dict(reps=2, num_warps=1, waves=24.0) for b in (2, 3, 4)}
TC_MIN_DIM = 4096
BATCH_CONFIG = dict(bn=128, num_warps=4, waves=4.0, prefetch=True, num_stages=1)
# 2 <= M <= 16 on the tensor cores with x^T as the mma's B operand (gemm_tc.py: gemv_tc's
# bf16x2 dequantisation shared by all M rows), VOLUNDR_QUANT_GEMM16=tc, read once at import;
# default `tile` (the tl.dot tiles above). Config not yet measured on a GPU: see
# perf/kernels/bench_quant.py --m16-compare; same size floor as the M = 1 tc path.
GEMM16_PATH = os.environ.get("VOLUNDR_QUANT_GEMM16", "tile")
if GEMM16_PATH not in ("tile", "tc"):
    raise ValueError(f"VOLUNDR_QUANT_GEMM16 must be tile or tc, not {GEMM16_PATH!r}")
GEMM16_TC_CONFIG = {b: dict(reps=2, num_warps=1, waves=8.0) for b in (2, 3, 4)}
PREFILL_CONFIG = dict(bn=128, num_warps=4, waves=1.0)  # block_m 64
FUSED_MAX_M = 128


def quant_matmul(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                 bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] (any float dtype; bf16 in the engine) -> y [M, N] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    n = qa.shape[1]
    if (m == 1 and GEMV_PATH == "tc" and min(x.shape[1], n) >= TC_MIN_DIM
            and gemv_tc.supported(x, bits, group_size, n)):
        return gemv_tc.gemv_tc(x, qa, qb, sz, bits, group_size, **GEMV_TC_CONFIG[bits])
    if m == 1:
        bn, nw, waves, prefetch = GEMV_CONFIG[bits]
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=1, bn=bn,
                                   num_warps=nw, waves=waves, prefetch=prefetch)
    if (m <= MAX_M and GEMM16_PATH == "tc" and min(x.shape[1], n) >= TC_MIN_DIM
            and gemm_tc.supported(x, bits, group_size, n)):
        return gemm_tc.gemm_tc(x, qa, qb, sz, bits, group_size, **GEMM16_TC_CONFIG[bits])
    if m <= MAX_M:
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=MAX_M,
                                   **BATCH_CONFIG)
    if m <= FUSED_MAX_M:
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=64,
                                   **PREFILL_CONFIG)
    return dequant_matmul(x, qa, qb, sz, bits, group_size)

"""Entry point the model uses on CUDA: y = x @ W^T for a mixed-bit W in the kernel layout.

Strategy by the number of rows M of x, from the H200 sweep of perf/kernels/bench_quant.py
(perf/RESULTS.md, "Mixed-bit weights"; 17408x5120 figures, CUDA-graph timings):
  M = 1        integer tensor-core GEMV (`gemv_i8.py`; H100: 0.71-0.90x gemv_tc's time, run 82)
               where it takes the shape, else the bf16 tensor-core GEMV (`gemv_tc.py`): 2/3/4-bit
               15.1 / 18.5 / 19.8 us, 1.17-1.56x the FMA GEMV (`gemv.py`, BLOCK_M = 1: 18.7 /
               24.6 / 26.4 us; bf16 cuBLAS 47.7 us), which small shapes keep (K or N <
               TC_MIN_DIM) and VOLUNDR_QUANT_GEMV=fma picks;
  2 <= M <= 16 tensor-core GEMM (`gemm_tc.py`, bf16x2 dequantisation shared by all M rows, x^T
               as the mma B operand): M = 16 31.5 / 37.5 / 34.1 us, 1.17-3.1x the 16-row tl.dot
               tile (42 / 62 / 45 us; VOLUNDR_QUANT_GEMM16=tile picks it);
  M <= 128     64-row tensor-core tiles (M = 64: 97 / 131 / 106 us vs 137 / 144 / 320 us
               for dequantise + cuBLAS);
  M > 128      dequantise 8192 output features at a time to bf16, cuBLAS GEMM (`gemm.py`):
               M = 256: 190 / 171 / 227 us vs 238 / 314 / 267 us fused.
"""

from __future__ import annotations

import os

import torch

from volundr.kernels.norm.engine import swiglu as swiglu_kernel
from volundr.kernels.quant import digits, gemm_tc, gemv_chain, gemv_i8, gemv_i8_rows, gemv_tc
from volundr.kernels.quant.gemm import dequant_matmul, dequantize_t
from volundr.kernels.quant.gemv import MAX_M, quant_matmul_triton

# M = 1: (bn, num_warps, waves, prefetch) per bit width; rows per thread = bn / (128 num_warps)
GEMV_CONFIG = {2: (128, 1, 8.0, True), 3: (256, 2, 4.0, True), 4: (128, 1, 8.0, False)}
# M = 1 on the tensor cores (gemv_tc.py: bf16x2 dequantisation + mma, ~1 SASS instruction per
# weight instead of ~3.5), the default since the H200 run of 2026-12-03 (with gemm_tc below:
# Volundr-32B decode 98 -> 122 tok/s, 16 streams 766 -> 961, same greedy ids);
# VOLUNDR_QUANT_GEMV=fma, read once at import, goes back. reps=2, waves=24 is the best config
# at every measured shape and bit width; smaller shapes (K or N < TC_MIN_DIM) keep the FMA path.
# The default since 2026-12-05 (H100 runs 87-89: bench_decode, the CUDA suite's engine,
# attention, norm, quant and gemv_i8 tests; no H200 lent): the integer tensor-core GEMV
# (gemv_i8.py; H100 run 82: 0.71-0.86x gemv_tc's time at 2 and 3 bits, 0.86-0.90x at 4 (1.02x
# at 5120x5120), its digits launch included 0.78-0.97x (1.25x at 5120x5120 4-bit); decode
# 137.4 -> 159.3 tok/s, run 87) for the plain, SwiGLU, rscaled and residual-epilogue GEMVs;
# the fused norm and gated-norm paths stay on gemv_tc. VOLUNDR_QUANT_GEMV=tc keeps gemv_tc.
GEMV_PATH = os.environ.get("VOLUNDR_QUANT_GEMV", "i8")
if GEMV_PATH not in ("fma", "tc", "i8"):
    raise ValueError(f"VOLUNDR_QUANT_GEMV must be fma, tc or i8, not {GEMV_PATH!r}")
# maxnreg 128 (H200 sweep, perf/RESULTS.md "Session 5"): 2-bit (148 registers uncapped, one
# warp more per SM capped) 1-9% faster at the engine's shapes (5120x5120: 4% slower, unused at
# 2 bits); 4-bit (110 uncapped: the cap only changes ptxas's schedule) the lm_head 1.30x, the
# others within -1%..+2%; 3-bit spills under the cap (10-30% slower) and keeps its 168.
# Tried and kept off (session 6, perf/RESULTS.md): stages=2 (weights through shared memory by
# cp.async: 1.5-2.3x slower at every shape); waves 48 (the kernel bench's gate_up 3-bit 38.7 ->
# 33.2 us, but in the engine 28.2 -> 30.3 us and decode 137.4 -> 135.7 tok/s).
GEMV_TC_CONFIG = {2: dict(reps=2, num_warps=1, waves=24.0, maxnreg=128),
                  3: dict(reps=2, num_warps=1, waves=24.0),
                  4: dict(reps=2, num_warps=1, waves=24.0, maxnreg=128)}
# Per-shape overrides of GEMV_TC_CONFIG, {(N, K): {key: value}} (perf/bench_decode.py's
# +wW@NxK suffix). None by default: the pure-streaming sweep of run 16 streamed in_proj and the
# 2-bit down projection fastest at 8 programs per SM and gate_up at 48, but in the engine (H200
# run 61) in_proj at waves 8 took 19.1 instead of 16.8 us per call, 2-bit down 15.4 instead of
# 14.2, and gate_up at waves 48 moved by +-1.5 us (152.4 vs 153.3 tok/s).
GEMV_TC_SHAPE: dict[tuple[int, int], dict] = {}


def tc_config(bits: int, n: int, k: int) -> dict:
    """gemv_tc's keyword config for an N x K weight of this bit width."""
    return {**GEMV_TC_CONFIG[bits], **GEMV_TC_SHAPE.get((n, k), {})}


# Engram's k / v projections (5120 x 2048) included since run 22/23: 6.85 -> 4.79 us per call
# at M = 1 (census), 10.7 -> 9.9 at M = 16; below it (KDA's f_b / g_b, K = rank) the FMA path.
TC_MIN_DIM = 2048
BATCH_CONFIG = dict(bn=128, num_warps=4, waves=4.0, prefetch=True, num_stages=1)
# 2 <= M <= 16 on the tensor cores with x^T as the mma's B operand (gemm_tc.py: gemv_tc's
# bf16x2 dequantisation shared by all M rows), the default since 2026-12-03;
# VOLUNDR_QUANT_GEMM16=tile (the tl.dot tiles) goes back. Same size floor as the M = 1 tc path.
GEMM16_PATH = os.environ.get("VOLUNDR_QUANT_GEMM16", "tc")
if GEMM16_PATH not in ("tile", "tc"):
    raise ValueError(f"VOLUNDR_QUANT_GEMM16 must be tile or tc, not {GEMM16_PATH!r}")
# reps 2, waves 8: within 5% of the best config of the H200 comparison at every shape but the
# 2/3-bit lm_head at M = 16 (1.19x / 1.40x its best, reps 4 waves 4)
GEMM16_TC_CONFIG = {b: dict(reps=2, num_warps=1, waves=8.0) for b in (2, 3, 4)}
# Up to this many rows (2..16) on gemv_i8_rows (the integer tensor-core GEMV with the rows in the
# mma's N: 4 rows cost about what one does) instead of gemm_tc. H100 run 117, Volundr-32B decode
# graphs at batch 2 / 4 / 8 / 16: 12.22 -> 7.26, 12.64 -> 8.36, 13.65 -> 10.17, 15.33 -> 13.42 ms
# a step; a speculative step with a random drafter 19.8 -> 16.2 ms. VOLUNDR_I8_ROWS=0 turns it off.
I8_ROWS = int(os.environ.get("VOLUNDR_I8_ROWS", "16"))
# With it, at 2-16 rows the residual add + next RMSNorm split between gemv_i8_rows calls as
# RESIDUAL_NORM_FOLD does at M = 1 (the output projection's epilogue writes h, h w and per-row
# tile sums of h^2; the next input projection scales each row by its 1 / rms): ~140 norm
# launches per decode step less at batch 2-16 (batch 16, H100 run 120: 151 norm launches, 0.35 ms
# of an eager step). Right on CUDA but no faster (H100 run 123, graph ms: batch 2 -1.3%, 8 -0.4%,
# 16 +3.4%; H200 run 141: batch 2 / 4 -1.2% / -1.3%, 8 +0.1%, 16 +3.3%): opt-in,
# VOLUNDR_I8_ROWS_FOLD=1.
ROWS_FOLD = os.environ.get("VOLUNDR_I8_ROWS_FOLD", "0") == "1"
# 17 up to this many rows on gemv_i8_rows in calls of 16 rows (each reads the weights again)
# instead of the 64-row tensor-core tiles (quant_matmul_triton): a speculative check of 4-8
# sequences (20-40 rows at 4 guesses), decode batches above 16. By the kernels' times (runs
# 116/121: 16 rows 27-54 us at Volundr-32B's shapes; the tiles ~100-130 us at 64 rows, H200
# run 11) ~2x faster up to 32 rows; measured (H100 run 124): speculative checks of 4 / 8
# sequences (20 / 40 rows) 69.4 -> 26.6 and 62.6 -> 38.2 ms a step. VOLUNDR_I8_ROWS_CHUNKED=0
# turns it off.
I8_ROWS_CHUNKED = int(os.environ.get("VOLUNDR_I8_ROWS_CHUNKED", "48"))
PREFILL_CONFIG = dict(bn=128, num_warps=4, waves=1.0)  # block_m 64
# The layer's residual add + RMSNorm folded into the next tensor-core GEMV (M = 1): 142 norm
# launches per Volundr-32B token less (2.8 us each on the H200, run 8). Right on the H200 (CUDA
# tests, run 11) but slower: decode 137.4 -> 124.5 tok/s, graph 7.06 -> 7.73 ms (each GEMV
# program's prologue adds a dependent trip through memory, and the GEMVs are latency-bound,
# ~6.5 us fixed per call). Opt-in with VOLUNDR_NORM_FOLD=1.
NORM_FOLD = os.environ.get("VOLUNDR_NORM_FOLD", "0") == "1"
# KDA's gated output norm (RMSNorm over each head, times sigmoid(gate)) folded into the KDA
# decode kernel (o w sigmoid(gate) and per-head sums of squares) and its o_proj GEMV at M = 1
# (gemv_tc `gscale`: each head's 1 / rms scales its group's sums): 54 norm launches per
# Volundr-32B token less. H200 run 25: decode 149.7 -> 154.1 tok/s, graph 6.417 -> 6.351 ms.
# VOLUNDR_GATED_NORM_FOLD=0 turns it off. (Run 22 measured a first form, the gate and the sums
# of squares computed in o_proj's x loads: right, but o_proj took ~12 us more per call.)
GATED_NORM_FOLD = os.environ.get("VOLUNDR_GATED_NORM_FOLD", "1") == "1"
# That per-head scale on the integer tensor-core GEMVs, carried by x's digits (each group's
# scale sx times the head's 1 / rms, in the digits launch: digits.x_digits `gscale`): at M = 1
# o_proj on gemv_i8 (+ the digits launch) instead of gemv_tc (VOLUNDR_GATED_NORM_I8=1); in a
# speculative check (2-16 rows) kda_rows writes o w sigmoid(gate) and the sums of squares and
# o_proj runs on gemv_i8_rows, the check's 54 gated-norm launches gone
# (VOLUNDR_ROWS_GATED_NORM=1). Built in session 31; right on CUDA (H200 run 140: its kernel and
# speculative CUDA tests pass) but no faster: a perfect MTP head's k = 2 step 8.75 -> 8.81 ms
# with the check's fold (run 140), single stream 186.2 -> 185.4 tok/s with o_proj on gemv_i8
# (run 139): both opt-in.
GATED_NORM_I8 = os.environ.get("VOLUNDR_GATED_NORM_I8", "0") == "1"
ROWS_GATED_NORM = os.environ.get("VOLUNDR_ROWS_GATED_NORM", "0") == "1"
# A layer's residual add and the next RMSNorm split between two tensor-core GEMVs at M = 1
# (the output projection's epilogue writes h, h w and per-tile sums of h^2; the next input
# projection reads h w and scales its y by 1 / rms): the norm launch at every boundary between
# an o_proj / down_proj and the next gate_up / in_proj / qkv_proj (~140 per Volundr-32B token)
# goes, and unlike NORM_FOLD nothing is added before a GEMV's weight loads. H200 run 28:
# decode 151.0 -> 154.9 tok/s, graph 6.362 -> 6.269 ms (norm launches 151 -> 10 per token; the
# GEMVs' epilogue and scale cost ~0.5 us per call of the ~2 us each norm took).
# VOLUNDR_RESIDUAL_NORM_FOLD=0 turns it off.
RESIDUAL_NORM_FOLD = os.environ.get("VOLUNDR_RESIDUAL_NORM_FOLD", "1") == "1"
# An MLP's gate_up and down GEMVs at M = 1 as one persistent launch (gemv_chain.py: the down
# projection's first weights load while gate_up's last programs finish, behind a grid barrier
# instead of a kernel boundary; gate_up reads the Normed input, down does the SwiGLU, the
# residual add and the next norm as with RESIDUAL_NORM_FOLD). Off until measured on the H200
# (perf/RESULTS.md, session 16: not yet run on a GPU); VOLUNDR_GEMV_CHAIN=1 turns it on.
GEMV_CHAIN = os.environ.get("VOLUNDR_GEMV_CHAIN", "0") == "1"
# On the i8 path the GEMVs that produce a gemv_i8's x can write its int8 digits (digits.py)
# instead of a launch before it: the output projections' residual epilogues for the next input
# projection, an MLP's gate_up for its down projection (`quant_mlp_i8`): all 199 digits
# launches per token of Volundr-32B's decode step but 6 (the first layer's, and MLPs with no
# next norm to fold). Right on the GPU (H100 runs 89-92: the same greedy ids at batch 1 and 16)
# but slower: graph 6.18-6.21 vs 6.01-6.03 ms per token. Run 92's profile: each producer gets
# ~1.4 us longer (barrier, counter, re-read, two layouts), about the ~1.5 us launch it saves,
# and the launch hid partly under PDL where the producer's tail does not.
# Opt-in: VOLUNDR_I8_DIGITS_EPILOGUE=1.
DIGITS_EPILOGUE = os.environ.get("VOLUNDR_I8_DIGITS_EPILOGUE", "0") == "1"
FUSED_MAX_M = 128


def _takes_gemv_tc(x: torch.Tensor, k: int, n: int, bits: int, group_size: int) -> bool:
    """Whether a call with x [M, K'] (K = k inputs per row) and N = n outputs goes to the
    tensor-core GEMV: M = 1, the tc path on, both dims at the size floor, a supported format."""
    return (x.shape[0] == 1 and GEMV_PATH in ("tc", "i8") and min(k, n) >= TC_MIN_DIM
            and gemv_tc.supported(x, bits, group_size, n))


# 4-bit weights below this many take gemv_tc on the i8 path too: with its digits launch gemv_i8
# is 1.25x gemv_tc's time at 5120x5120 (run 82), and in decode (run 84) the 4-bit qkv
# (5632x5120) and Engram k / v (5120x2048) projections were slower (10.9 vs 9.3, 7.3 vs 5.2 us)
I8_MIN_WEIGHTS_4BIT = 1 << 26


def _takes_gemv_i8(x: torch.Tensor, k: int, n: int, bits: int, group_size: int) -> bool:
    """Whether an M = 1 call goes to the integer tensor-core GEMV (VOLUNDR_QUANT_GEMV=i8)."""
    return (GEMV_PATH == "i8" and min(k, n) >= TC_MIN_DIM
            and (bits != 4 or n * k >= I8_MIN_WEIGHTS_4BIT)
            and gemv_i8.supported(x, bits, group_size, n, k,
                                     gemv_i8.config(bits, n, k)["reps"]))


def _rows_kw(x: torch.Tensor, k: int, n: int, bits: int, group_size: int) -> dict | None:
    """gemv_i8_rows's config for x [M, K'] (K = k inputs per row, M <= 16) against N = n
    outputs where it takes the call (the i8 path, both dims at the size floor, a supported
    format), else None."""
    kw = gemv_i8_rows.config(bits, x.shape[0], n, k)
    ok = (GEMV_PATH == "i8" and min(k, n) >= TC_MIN_DIM
          and gemv_i8_rows.supported(x, bits, group_size, n, k, kw["reps"], kw["unroll"]))
    return kw if ok else None


def _rows_config(x: torch.Tensor, k: int, n: int, bits: int, group_size: int) -> dict | None:
    """`_rows_kw` where M = x.shape[0] is in 2..I8_ROWS, else None."""
    return _rows_kw(x, k, n, bits, group_size) if 1 < x.shape[0] <= I8_ROWS else None


def quant_matmul(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                 bits: int, group_size: int, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (any float dtype; bf16 in the engine) -> y [M, N] in x's dtype.

    swiglu: x [M, 2K] holds an MLP's (gate, up) and y = (SiLU(gate) * up) @ W^T. The tensor-core
    decode paths (M <= 16) fuse the SwiGLU into their x loads (one launch less per MLP); the
    others run the SwiGLU kernel first."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    n = qa.shape[1]
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    if _takes_gemv_i8(x, k, n, bits, group_size):
        return gemv_i8.gemv_i8(x, qa, qb, sz, bits, group_size, swiglu=swiglu,
                               **gemv_i8.config(bits, n, k))
    if _takes_gemv_tc(x, k, n, bits, group_size):
        return gemv_tc.gemv_tc(x, qa, qb, sz, bits, group_size, swiglu=swiglu,
                               **tc_config(bits, n, k))
    if _rows_config(x, k, n, bits, group_size) is not None:
        xp = _pad_rows(x, eager_rows(m, x.is_cuda))
        rows_kw = _rows_config(xp, k, n, bits, group_size)
        if rows_kw is not None:
            return gemv_i8_rows.gemv_i8_rows(xp, qa, qb, sz, bits, group_size, swiglu=swiglu,
                                             **rows_kw)[:m]
    if I8_ROWS >= gemv_i8_rows.MAX_ROWS < m <= I8_ROWS_CHUNKED:
        y = _rows_chunked(x, qa, qb, sz, bits, group_size, swiglu)
        if y is not None:
            return y
    if (1 < m <= MAX_M and GEMM16_PATH == "tc" and min(k, n) >= TC_MIN_DIM
            and gemm_tc.supported(x, bits, group_size, n)):
        return gemm_tc.gemm_tc(x, qa, qb, sz, bits, group_size, swiglu=swiglu,
                               **GEMM16_TC_CONFIG[bits])
    if swiglu:
        x = swiglu_kernel(x[:, :k], x[:, k:])
    if m == 1:
        bn, nw, waves, prefetch = GEMV_CONFIG[bits]
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=1, bn=bn,
                                   num_warps=nw, waves=waves, prefetch=prefetch)
    if m <= MAX_M:
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=MAX_M,
                                   **BATCH_CONFIG)
    if m <= FUSED_MAX_M:
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=64,
                                   **PREFILL_CONFIG)
    return dequant_matmul(x, qa, qb, sz, bits, group_size)


def _rows_chunked(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                  bits: int, group_size: int, swiglu: bool) -> torch.Tensor | None:
    """y [M, N] of x [M, K'] (M > 16) as gemv_i8_rows calls of up to 16 rows, written into
    y's row blocks; None where a chunk does not take it (I8_ROWS_CHUNKED)."""
    m, n = x.shape[0], qa.shape[1]
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    step = gemv_i8_rows.MAX_ROWS
    last = m - (m - 1) // step * step  # rows of the last call
    x = _pad_rows(x, m - last + eager_rows(last, x.is_cuda))
    chunks = [(i, _rows_kw(x[i:i + step], k, n, bits, group_size))
              for i in range(0, x.shape[0], step)]
    if any(kw is None for _, kw in chunks):
        return None
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for i, kw in chunks:
        gemv_i8_rows.gemv_i8_rows(x[i:i + step], qa, qb, sz, bits, group_size, swiglu=swiglu,
                                  out=y[i:i + step], **kw)
    return y[:m]


def eager_rows(m: int, cuda: bool = True) -> int:
    """The rows a gemv_i8_rows call of m rows runs as. Its row count is a constexpr (one
    compile per count and weight shape): outside CUDA-graph capture m > 2 rounds up to a power
    of two, the decode graphs' batch sizes, so eager steps (a short prefill, a step's logits
    rows, a chunked call's last rows) reuse the variants that graph capture and the start-up
    warm-up compiled instead of compiling one per count from 3 to 15 while serving (~1 s each,
    every running request waiting: perf/RESULTS.md, session 39). The weights, read once
    whatever the rows, dominate its time; the zero rows cost a copy of x. Captures keep m
    (cuda: whether x is on a CUDA device, the only place a capture can be)."""
    if m <= 2 or cuda and torch.cuda.is_current_stream_capturing():
        return m
    return 1 << (m - 1).bit_length()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [M, K] with zero rows appended up to `rows` (x itself where M >= rows)."""
    if rows <= x.shape[0]:
        return x
    xp = x.new_zeros(rows, x.shape[1])
    xp[:x.shape[0]] = x
    return xp


def quant_matmul_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                          bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, h): h = x + residual and y = RMSNorm(h) @ W^T (norm weight [K]) in one launch, for
    x, residual [1, K]; None where no kernel folds the norm (NORM_FOLD off, M > 1, a shape or
    dtype the tensor-core GEMV does not take): the caller then runs the norm kernel first."""
    if not (NORM_FOLD and _takes_gemv_tc(x, x.shape[1], qa.shape[1], bits, group_size)
            and x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
            and residual.dtype == norm_weight.dtype == x.dtype):
        return None
    h = torch.empty_like(x)
    y = gemv_tc.gemv_tc(x, qa, qb, sz, bits, group_size, norm=(residual, norm_weight, eps, h),
                        **tc_config(bits, qa.shape[1], x.shape[1]))
    return y, h


def folds_group_scale(m: int, k: int, n: int, dtype: torch.dtype, bits: int, group_size: int,
                      head_dim: int) -> bool:
    """Whether `quant_matmul_group_scaled` takes an x [m, k] of `dtype` for this layer (N = n):
    GATED_NORM_FOLD on, head dim = group size, and what the tensor-core GEMV takes (M = 1) or,
    with ROWS_GATED_NORM, gemv_i8_rows (2-16 rows)."""
    x = torch.empty(m, k, dtype=dtype, device="meta")
    if not (GATED_NORM_FOLD and head_dim == group_size):
        return False
    if m == 1:
        return _takes_gemv_tc(x, k, n, bits, group_size)
    return ROWS_GATED_NORM and _rows_config(x, k, n, bits, group_size) is not None


def quant_matmul_group_scaled(x: torch.Tensor, gs: torch.Tensor, eps: float, qa: torch.Tensor,
                              qb: torch.Tensor, sz: torch.Tensor, bits: int,
                              group_size: int) -> torch.Tensor | None:
    """y = sum over groups g of rsqrt(sum(gs[g]) / G + eps) x_g @ W_g^T in one launch (and the
    digits' on gemv_i8), for x [1, K] and gs [K / G, P] fp32 partial sums of squares: KDA's
    gated output norm, its per-head scale folded into o_proj (x = o w sigmoid(gate) and gs
    from the KDA decode kernel); x [M, K] and gs [M, K / G, P] (kda_rows) row by row. None
    where the GEMV does not take it (`folds_group_scale`)."""
    m, k, n = x.shape[0], x.shape[1], qa.shape[1]
    if not (folds_group_scale(m, k, n, x.dtype, bits, group_size, group_size)
            and x.is_contiguous() and gs.is_contiguous()):
        return None
    if m > 1:
        return gemv_i8_rows.gemv_i8_rows(x, qa, qb, sz, bits, group_size, gscale=(gs, eps),
                                         **_rows_config(x, k, n, bits, group_size))
    if GATED_NORM_I8 and _takes_gemv_i8(x, k, n, bits, group_size):
        return gemv_i8.gemv_i8(x, qa, qb, sz, bits, group_size, gscale=(gs, eps),
                               **gemv_i8.config(bits, n, k))
    return gemv_tc.gemv_tc(x, qa, qb, sz, bits, group_size, gscale=(gs, eps),
                           **tc_config(bits, n, k))


def quant_matmul_residual_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                               qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
                               group_size: int, swiglu: bool = False,
                               gscale: tuple | None = None,
                               digits_in: torch.Tensor | None = None) -> tuple | None:
    """(h, xw, ss, dg) for a layer's output projection y = x @ W^T (x [1, K]; swiglu and gscale as
    in quant_matmul / quant_matmul_group_scaled) followed by the residual add and the next
    RMSNorm, in one launch: h = y + residual [1, N] (the next residual stream), xw = h w [1, N]
    (w = norm_weight) and ss [1, tiles] fp32 sums of h^2, so that RMSNorm(h) = xw rsqrt(sum(ss)
    / N + eps), which `quant_matmul_rscaled` folds into the next GEMV, and on the i8 path
    (DIGITS_EPILOGUE, N a multiple of 512) dg: xw's digits for it (digits.empty), else None.
    digits_in: x's digits made before (digits.empty's layout; for gemv_i8, else unread).
    None where it does not apply (RESIDUAL_NORM_FOLD off, gscale with GATED_NORM_FOLD off,
    a shape or dtype the tensor-core GEMV does not take). M > 1 (x [M, K], residual [M, N]):
    on gemv_i8_rows with ROWS_FOLD (gscale [M, K / G, P] with ROWS_GATED_NORM; no digits_in),
    ss [M, tiles], dg None."""
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    n = qa.shape[1]
    if x.shape[0] > 1:
        return _rows_residual_norm(x, residual, norm_weight, qa, qb, sz, bits, group_size,
                                   swiglu, gscale)
    if not (RESIDUAL_NORM_FOLD and (gscale is None or GATED_NORM_FOLD)
            and _takes_gemv_tc(x, k, n, bits, group_size)
            and x.is_contiguous() and residual.is_contiguous() and norm_weight.is_contiguous()
            and residual.shape == (1, n) and residual.dtype == norm_weight.dtype == x.dtype):
        return None
    i8 = (gscale is None or GATED_NORM_I8) and _takes_gemv_i8(x, k, n, bits, group_size)
    cfg = gemv_i8.config(bits, n, k) if i8 else tc_config(bits, n, k)
    tiles = (gemv_i8.tiles(n, cfg["reps"]) if i8
             else gemv_tc.tiles(n, cfg["reps"], cfg["num_warps"]))
    h, xw = torch.empty_like(residual), torch.empty_like(residual)
    ss = torch.empty(1, tiles, dtype=torch.float32, device=x.device)
    res = (residual, norm_weight, xw, ss)
    bn = 32 * cfg["reps"] * (1 if i8 else cfg["num_warps"])  # the tile's rows
    dg = (digits.empty(n, x.device) if GEMV_PATH == "i8" and DIGITS_EPILOGUE
          and digits.fits(n, bn) else None)
    if i8:
        gemv_i8.gemv_i8(x, qa, qb, sz, bits, group_size, out=h, swiglu=swiglu, residual=res,
                        out_digits=dg, **cfg, gscale=gscale,
                        digits=None if digits_in is None else digits.views(digits_in, bits))
    else:
        gemv_tc.gemv_tc(x, qa, qb, sz, bits, group_size, out=h, swiglu=swiglu, gscale=gscale,
                        residual=res, out_digits=dg, **cfg)
    return h, xw, ss, dg


def _rows_residual_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor, bits: int,
                        group_size: int, swiglu: bool, gscale: tuple | None) -> tuple | None:
    """quant_matmul_residual_norm at M > 1 (gemv_i8_rows' residual epilogue, ROWS_FOLD)."""
    m, n = x.shape[0], qa.shape[1]
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    kw = (_rows_config(x, k, n, bits, group_size) if ROWS_FOLD and RESIDUAL_NORM_FOLD
          and (gscale is None or ROWS_GATED_NORM and GATED_NORM_FOLD) else None)
    if (kw is None or not (x.is_contiguous() and residual.is_contiguous()
                           and norm_weight.is_contiguous() and residual.shape == (m, n)
                           and residual.dtype == norm_weight.dtype == x.dtype)):
        return None
    h, xw = torch.empty_like(residual), torch.empty_like(residual)
    ss = torch.empty(m, gemv_i8.tiles(n, kw["reps"]), dtype=torch.float32, device=x.device)
    gemv_i8_rows.gemv_i8_rows(x, qa, qb, sz, bits, group_size, swiglu=swiglu, out=h,
                              residual=(residual, norm_weight, xw, ss), gscale=gscale, **kw)
    return h, xw, ss, None


def quant_matmul_rscaled(xw: torch.Tensor, ss: torch.Tensor, eps: float, qa: torch.Tensor,
                         qb: torch.Tensor, sz: torch.Tensor, bits: int, group_size: int,
                         dg: torch.Tensor | None = None) -> torch.Tensor | None:
    """y = (xw @ W^T) rsqrt(sum(ss) / K + eps) for xw [1, K] and ss [P] fp32 (what
    `quant_matmul_residual_norm` wrote: y = RMSNorm(h) @ W^T; dg its digits of xw, if any);
    None where the GEMV does not take it (then the caller makes RMSNorm(h) itself). M > 1:
    xw [M, K], ss [M, P], row by row on gemv_i8_rows (ROWS_FOLD)."""
    if xw.shape[0] > 1:
        kw = (_rows_config(xw, xw.shape[1], qa.shape[1], bits, group_size)
              if ROWS_FOLD and RESIDUAL_NORM_FOLD else None)
        if (kw is None or not xw.is_contiguous() or ss.dim() != 2
                or ss.shape[0] != xw.shape[0]):
            return None
        return gemv_i8_rows.gemv_i8_rows(xw, qa, qb, sz, bits, group_size, rscale=(ss, eps),
                                         **kw)
    if not (RESIDUAL_NORM_FOLD and _takes_gemv_tc(xw, xw.shape[1], qa.shape[1], bits, group_size)
            and xw.is_contiguous() and ss.is_contiguous() and ss.dim() == 1):
        return None
    if _takes_gemv_i8(xw, xw.shape[1], qa.shape[1], bits, group_size):
        return gemv_i8.gemv_i8(xw, qa, qb, sz, bits, group_size, rscale=(ss, eps),
                               digits=None if dg is None else digits.views(dg, bits),
                               **gemv_i8.config(bits, qa.shape[1], xw.shape[1]))
    return gemv_tc.gemv_tc(xw, qa, qb, sz, bits, group_size, rscale=(ss, eps),
                           **tc_config(bits, qa.shape[1], xw.shape[1]))


def quant_mlp_i8(xw: torch.Tensor, ss: torch.Tensor, eps: float, dg: torch.Tensor | None,
                 up: tuple, down: tuple, residual: torch.Tensor,
                 norm_weight: torch.Tensor) -> tuple | None:
    """An MLP at M = 1 on gemv_i8 with no digits launch (DIGITS_EPILOGUE): gate_up =
    RMSNorm(h) @ Wup^T from xw = h w [1, K], its sums of squares ss [P] and dg, xw's digits
    from the epilogue that made it (None: a launch makes them), gate_up's epilogue writing
    the digits of SiLU(gate) * up; then the down projection on them with the residual add and
    the next RMSNorm (weight norm_weight): (h', xw', ss', dg') as `quant_matmul_residual_norm`
    returns them. up, down = (qa, qb, sz, bits, group_size) of the fused gate_up and the down
    projection. None where it does not apply (DIGITS_EPILOGUE or RESIDUAL_NORM_FOLD off,
    either GEMV not on gemv_i8, a shape the epilogue does not take)."""
    (qa1, qb1, sz1, b1, g1), (qa2, qb2, sz2, b2, g2) = up, down
    k, n1, n2 = xw.shape[1], qa1.shape[1], qa2.shape[1]
    if not (DIGITS_EPILOGUE and RESIDUAL_NORM_FOLD and n1 % 2 == 0 and xw.is_contiguous()
            and ss.is_contiguous() and ss.dim() == 1 and residual.shape == (1, n2)
            and residual.is_contiguous() and norm_weight.is_contiguous()
            and residual.dtype == norm_weight.dtype == xw.dtype and sz2.shape[0] * g2 == n1 // 2
            and _takes_gemv_i8(xw, k, n1, b1, g1) and _takes_gemv_i8(xw, n1 // 2, n2, b2, g2)
            and _takes_gemv_tc(xw, n1 // 2, n2, b2, g2)  # (what the down's call checks too)
            and digits.fits(n1 // 2, 32 * gemv_i8.config(b1, n1, k)["reps"])):
        return None
    sd = digits.empty(n1 // 2, xw.device)
    gu = gemv_i8.gemv_i8(xw, qa1, qb1, sz1, b1, g1, rscale=(ss, eps), out_swiglu_digits=sd,
                         digits=None if dg is None else digits.views(dg, b1),
                         **gemv_i8.config(b1, n1, k))
    r = quant_matmul_residual_norm(gu, residual, norm_weight, qa2, qb2, sz2, b2, g2,
                                   swiglu=True, digits_in=sd)
    assert r is not None  # (its conditions were checked above)
    return r


def quant_matmul_grouped(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                         bits: int, group_size: int) -> torch.Tensor:
    """J linears of one shape on J inputs: x [M, J, K] (unit stride along K), W the J weights
    stacked along N (output rows j N/J .. (j + 1) N/J - 1 belong to input j) -> y [M, N].

    KDA's f_b and g_b (5120 x 128 each, on the two low-rank halves): at decode one launch of
    the FMA GEMV / 16-row tiles instead of two (each ~3 us, almost all launch latency); the
    64-row tiles up to FUSED_MAX_M rows; above, one dequantisation and J cuBLAS matmuls (no
    per-call copies of weight slices)."""
    m, j, k = x.shape
    n = qa.shape[1]
    nj = n // j
    if m == 1 and nj % GEMV_CONFIG[bits][0] == 0:
        bn, nw, waves, prefetch = GEMV_CONFIG[bits]
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=1, bn=bn,
                                   num_warps=nw, waves=waves, prefetch=prefetch)
    if 1 < m <= MAX_M and nj % BATCH_CONFIG["bn"] == 0:
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=MAX_M,
                                   **BATCH_CONFIG)
    if m <= FUSED_MAX_M and nj % PREFILL_CONFIG["bn"] == 0:
        return quant_matmul_triton(x, qa, qb, sz, bits, group_size, block_m=64,
                                   **PREFILL_CONFIG)
    # long prefill: W^T [K, N] dequantised once, then one cuBLAS matmul per input
    wt = dequantize_t(qa, qb, sz, bits, group_size, k, dtype=x.dtype)
    return torch.cat([x[:, i] @ wt[:, i * nj:(i + 1) * nj] for i in range(j)], dim=-1)


def quant_mlp_chain(xw: torch.Tensor, ss: torch.Tensor, eps: float, up: tuple, down: tuple,
                    residual: torch.Tensor, norm_weight: torch.Tensor,
                    o_proj: tuple | None = None) -> tuple | None:
    """An MLP at M = 1 in one launch (GEMV_CHAIN): gate_up = RMSNorm(h) @ Wup^T from xw = h w
    [1, K] and its sums of squares ss [P] (what `quant_matmul_residual_norm` made), then
    y = SwiGLU(gate_up) @ Wdown^T with the residual add and the next RMSNorm (weight
    norm_weight) in its epilogue: (h', xw', ss') as `quant_matmul_residual_norm` returns them.
    up, down = (qa, qb, sz, bits, group_size) of the fused gate_up and the down projection.

    o_proj = (x, gscale, (qa, qb, sz, bits, group_size), w): the mixer's output projection as
    the chain's first stage, `quant_matmul_residual_norm(x, residual, w, ..., gscale=gscale)`
    (w: the MLP's input norm, eps its eps), whose (h, xw, ss) are then the MLP's input (xw
    and ss as given are not used: pass None) and h the residual its down projection adds;
    returns (h, h', xw', ss').

    None where it does not apply (GEMV_CHAIN or RESIDUAL_NORM_FOLD off, gscale with
    GATED_NORM_FOLD off, a shape, format or dtype the tensor-core GEMV does not take). The
    stages keep the engine's GEMV configs (tc_config) but for their waves and register caps,
    which gemv_chain sets for the one kernel."""
    (qa1, qb1, sz1, b1, g1), (qa2, qb2, sz2, b2, g2) = up, down
    k, n1, n2 = residual.shape[1], qa1.shape[1], qa2.shape[1]
    cfgs = [tc_config(b1, n1, k), tc_config(b2, n2, n1 // 2)]
    ok = (GEMV_CHAIN and RESIDUAL_NORM_FOLD and n1 % 2 == 0 and n2 == k
          and _takes_gemv_tc(residual, k, n1, b1, g1)
          and _takes_gemv_tc(residual, n1 // 2, n2, b2, g2)
          and residual.is_contiguous() and norm_weight.is_contiguous()
          and residual.dtype == norm_weight.dtype)
    if o_proj is not None:
        xo, gs, (qa0, qb0, sz0, b0, g0), w0 = o_proj
        ok = (ok and (gs is None or GATED_NORM_FOLD) and _takes_gemv_tc(xo, xo.shape[1], k, b0, g0)
              and xo.is_contiguous() and w0.is_contiguous() and residual.shape == (1, k)
              and w0.dtype == xo.dtype == residual.dtype)
        cfgs.insert(0, tc_config(b0, k, xo.shape[1]))
    else:
        ok = (ok and xw.is_contiguous() and ss.is_contiguous() and ss.dim() == 1
              and residual.shape == (1, n2) and xw.dtype == residual.dtype)
    if not ok or len({c.get("num_warps", 1) for c in cfgs}) > 1:
        return None
    dt, dev = residual.dtype, residual.device

    def res_out(cfg):  # h, h w and the tiles' sums of h^2 [1, P] of a residual epilogue
        # (ss [1, P] as quant_matmul_residual_norm makes it: the next input projection folds
        # the scale from ss[0]; a 1-D ss made it fall back to the norm in torch, run 66)
        return (torch.empty(1, k, dtype=dt, device=dev), torch.empty(1, k, dtype=dt, device=dev),
                torch.empty(1, gemv_tc.tiles(k, cfg["reps"], cfg["num_warps"]),
                            dtype=torch.float32, device=dev))

    stages = []
    if o_proj is not None:
        h0, xw, ss0 = res_out(cfgs[0])
        stages.append(dict(x=xo, qa=qa0, qb=qb0, sz=sz0, bits=b0, group_size=g0, out=h0,
                           gscale=gs, residual=(residual, w0, xw, ss0), **cfgs[0]))
        residual, ss = h0, ss0[0]
    gate_up = torch.empty(1, n1, dtype=dt, device=dev)
    h, xw2, ss2 = res_out(cfgs[-1])
    stages.append(dict(x=xw, qa=qa1, qb=qb1, sz=sz1, bits=b1, group_size=g1, out=gate_up,
                       rscale=(ss, eps), **cfgs[-2]))
    stages.append(dict(x=gate_up, qa=qa2, qb=qb2, sz=sz2, bits=b2, group_size=g2, out=h,
                       swiglu=True, residual=(residual, norm_weight, xw2, ss2), **cfgs[-1]))
    gemv_chain.gemv_chain(stages)
    return (h, xw2, ss2) if o_proj is None else (residual, h, xw2, ss2)

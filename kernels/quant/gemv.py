"""Mixed-bit matmul kernels: y [M, N] = x [M, K] @ W^T with W in the kernel layout (pack.py).

One template serves 2, 3 and 4 bits. A program owns BN output rows (each thread 4 adjacent rows
per 128-bit load) and a range of groups along K (split-K, so that N = 5120 still fills the GPU);
the next group's words are loaded while the current one is computed (register double
buffering). Split partials go to a fp32 workspace; the last program of an output tile (atomic
counter, reset by that program) sums them in a fixed order: one launch, deterministic.

M = 1 (decode), FMA path, no int->float conversion and no per-element scale math: slot i's bits
are shifted to the top of an fp32 mantissa at p and OR-ed with the exponent of 1.0,
    f = bitcast(((word >> sh) & mask) | 0x3F800000) = 1 + q * 2^(p - 23)      (exact),
so sum_k q_k x_k = sum_i 2^(23 - p_i) (F_i - X_i), F_i = sum f x, X_i = sum x over the slot's
inputs, and a group adds s * (sum q x - z * sum x). Slots share a shift in windows (4 slots at
2/3 bits, 2 at 4 bits, p in [14, 21]), so a value costs one LOP3 and one FFMA plus a fraction
of a shift; 3-bit merges a window's high bits with one select per two slots. Values sit in the
top 9 mantissa bits: the fp32 cancellation in F_i - X_i stays far below bf16 rounding.

M >= 2, tensor-core path: f = 1 + q / 2^b is exact in bf16, so dot(x, f) on bf16 operands with
fp32 accumulation gives X + sum q x / 2^b per group.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl

MAX_M = 16


@triton.jit
def _shift(v, SH: tl.constexpr):
    if SH > 0:
        return v << SH
    elif SH < 0:
        return v >> (-SH)
    else:
        return v


@triton.jit
def _load_words(ptr, row0, N, rn, nmask, ok, RB: tl.constexpr, DIM3: tl.constexpr):
    """Word rows row0 .. row0 + RB of a plane for output rows rn: int32 [RB, BN] (or
    [1, RB, BN] for the tensor-core path)."""
    if DIM3:
        r = tl.arange(0, RB)[None, :, None]
        return tl.load(ptr + (row0 + r) * N + rn[None, None, :],
                       mask=nmask[None, None, :] & ok, other=0)
    else:
        r = tl.arange(0, RB)[:, None]
        return tl.load(ptr + (row0 + r) * N + rn[None, :], mask=nmask[None, :] & ok, other=0)


@triton.jit
def _load_group(qa_ptr, qb_ptr, sz_ptr, g, N, rn, nmask, ok, BITS: tl.constexpr,
                WA: tl.constexpr, USE_DOT: tl.constexpr):
    """Group g's words: (a0, a1, b, sz). 3-bit FMA path: the two halves of the A rows and the
    B rows; 3-bit dot path: all A rows and B expanded to them (high bit of slot i at 2i + 1);
    otherwise all A rows (a1, b unused copies)."""
    H: tl.constexpr = WA // 2
    szw = tl.load(sz_ptr + g * N + rn, mask=nmask & ok, other=0)
    if BITS == 3 and not USE_DOT:
        a0 = _load_words(qa_ptr, g * WA, N, rn, nmask, ok, H, False)
        a1 = _load_words(qa_ptr, g * WA + H, N, rn, nmask, ok, H, False)
        b = _load_words(qb_ptr, g * H, N, rn, nmask, ok, H, False)
    elif BITS == 3:
        a0 = _load_words(qa_ptr, g * WA, N, rn, nmask, ok, WA, True)
        a1 = a0
        r = tl.arange(0, WA)[None, :, None]
        b = tl.load(qb_ptr + (g * H + r % H) * N + rn[None, None, :],
                    mask=nmask[None, None, :] & ok, other=0)
        b = b << (r >= H).to(tl.int32)
    else:
        a0 = _load_words(qa_ptr, g * WA, N, rn, nmask, ok, WA, USE_DOT)
        a1 = a0
        b = a0
    return a0, a1, b, szw


@triton.jit
def _fma_block(a, b, x_ptr, kbase, lo_mask, RB: tl.constexpr, BITS: tl.constexpr,
               PA: tl.constexpr, WA: tl.constexpr, NW: tl.constexpr, BN: tl.constexpr):
    """One row of x times RB words per output row (a [RB, BN]; for 3-bit b with the high bit of
    slot i at bit 2i + 1), inputs kbase + i * WA + r. Returns sum_i c_i F_i [BN] with
    c_i = 2^(23 - p_i) (see _x_sums for the matching sums of x)."""
    r = tl.arange(0, RB)
    acc = tl.zeros([BN], dtype=tl.float32)
    TOP: tl.constexpr = 23 - BITS
    for w in tl.static_range(32 // PA // NW):  # windows of NW slots share one shift
        SH = TOP - PA * (w * NW + NW - 1)  # slot w * NW + j lands at p = SH + PA * (w * NW + j)
        aw = _shift(a, SH)
        if BITS == 3:
            # high bit of slot i at 2i + 1 -> p + 2. Slots j and j + 2 of the window sit 4 bits
            # apart, so one select (a single LOP3) merges their low bits with their high bits
            bw = _shift(b, SH + 1)
            P0 = SH + PA * w * NW
            m_even = (lo_mask << P0) | (lo_mask << (P0 + 4))
            m_odd = m_even << 2
            t_even = (aw & m_even) | (bw & ~m_even)
            t_odd = (aw & m_odd) | (bw & ~m_odd)
        for j in tl.static_range(NW):
            i = w * NW + j
            P = SH + PA * i
            # masks derived from the runtime lo_mask sit in registers: ptxas fuses the and + or
            # into one LOP3 (with both as immediates it needs two)
            if BITS == 3:
                if j % 2 == 0:
                    v = t_even & (((lo_mask << 1) | 1) << P)
                else:
                    v = t_odd & (((lo_mask << 1) | 1) << P)
            else:
                v = aw & (lo_mask << P)
            f = (v | 0x3F800000).to(tl.float32, bitcast=True)  # [RB, BN]
            xk = tl.load(x_ptr + kbase + i * WA + r).to(tl.float32)  # [RB]
            acc += tl.sum(f * xk[:, None], axis=0) * (1 << (23 - P))
    return acc


@triton.jit
def _x_sums(x_ptr, g, G: tl.constexpr, BITS: tl.constexpr, PA: tl.constexpr,
            WA: tl.constexpr, NW: tl.constexpr):
    """X = sum x and X' = sum c x over group g, c = 2^(23 - p) of each input's slot
    (slot i = (k % G) // WA sits at p = 23 - BITS - PA * (NW - 1 - i % NW))."""
    k = tl.arange(0, G)
    x = tl.load(x_ptr + g * G + k).to(tl.float32)
    c = (1 << (BITS + PA * (NW - 1 - (k // WA) % NW))).to(tl.float32)
    return tl.sum(x, axis=0), tl.sum(x * c, axis=0)


@triton.jit
def _dot_group(a, b, x_ptr, g, stride_xm, rm, mmask,
               BITS: tl.constexpr, PA: tl.constexpr, WA: tl.constexpr, G: tl.constexpr,
               BN: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Prefill tiles on the tensor cores: f = 1 + q / 2^BITS is exact in bf16, so
    dot(x, f) = X + sum q x / 2^BITS with fp32 accumulation. a, b: [1, WA, BN] (b: [1, WA, BN]
    with the high bit of slot i at bit 2i + 1). Returns (F [BM, BN], X [BM, 1])."""
    i3 = tl.arange(0, 32 // PA)[:, None, None]
    v = (a >> (PA * i3)) & ((1 << PA) - 1)  # [S, WA, BN]: slot i, word row r
    if BITS == 3:
        v = v | (((b >> (2 * i3 + 1)) & 1) << 2)
    f = ((v << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)
    f = tl.reshape(f, [G, BN]).to(DOT_DTYPE)  # row i * WA + r = input g * G + i * WA + r
    xt = tl.load(x_ptr + rm[:, None] * stride_xm + (g * G + tl.arange(0, G))[None, :],
                 mask=mmask[:, None], other=0.0).to(DOT_DTYPE)
    if DOT_DTYPE == tl.float32:
        fd = tl.dot(xt, f, input_precision="ieee")
    else:
        fd = tl.dot(xt, f)
    return fd, tl.sum(xt.to(tl.float32), axis=1)[:, None]


@triton.jit
def quant_matmul_kernel(x_ptr, qa_ptr, qb_ptr, sz_ptr, y_ptr, ws_ptr, cnt_ptr,
                        M, N, stride_xm, stride_ym, num_groups, groups_per_split, num_splits,
                        lo_mask, x_group_n, stride_xj,
                        BITS: tl.constexpr, PA: tl.constexpr, WA: tl.constexpr, G: tl.constexpr,
                        NW: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
                        SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        PREFETCH: tl.constexpr):
    pdl.trigger()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    # grouped x (x_group_n | BN): output rows j x_group_n .. read x[:, j] (several small
    # linears on different inputs in one launch); otherwise x_group_n = N, one x
    x_ptr += ((pid_n * BN) // x_group_n) * stride_xj
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rm < M
    acc = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
    g0 = pid_k * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, num_groups)
    # PREFETCH: register double buffering, group g + 1's words are in flight while g computes
    a0n, a1n, bn_, szn = _load_group(qa_ptr, qb_ptr, sz_ptr, g0, N, rn, nmask, True, BITS, WA,
                                     USE_DOT)
    pdl.wait()  # PDL: the first group's weights are in flight; x comes from the kernel before
    for g in range(g0, g1):
        if PREFETCH:
            a0, a1, b, szw = a0n, a1n, bn_, szn
            a0n, a1n, bn_, szn = _load_group(qa_ptr, qb_ptr, sz_ptr, g + 1, N, rn, nmask,
                                             g + 1 < g1, BITS, WA, USE_DOT)
        else:
            a0, a1, b, szw = _load_group(qa_ptr, qb_ptr, sz_ptr, g, N, rn, nmask, True, BITS,
                                         WA, USE_DOT)
        s = (szw << 16).to(tl.float32, bitcast=True)[None, :]
        z = (szw & -65536).to(tl.float32, bitcast=True)[None, :]
        if USE_DOT:
            fd, xd = _dot_group(a0, b, x_ptr, g, stride_xm, rm, mmask,
                                BITS, PA, WA, G, BN, DOT_DTYPE)
            acc += s * ((1 << BITS) * fd - ((1 << BITS) + z) * xd)
        else:  # BLOCK_M == 1
            if BITS == 3:
                fs = _fma_block(a0, b, x_ptr, g * G, lo_mask, WA // 2, BITS, PA, WA, NW, BN)
                fs += _fma_block(a1, b << 1, x_ptr, g * G + WA // 2, lo_mask, WA // 2, BITS, PA,
                                 WA, NW, BN)
            else:
                fs = _fma_block(a0, b, x_ptr, g * G, lo_mask, WA, BITS, PA, WA, NW, BN)
            xs, xps = _x_sums(x_ptr, g, G, BITS, PA, WA, NW)
            acc += s * (fs[None, :] - xps - z * xs)
    ymask = mmask[:, None] & nmask[None, :]
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT_K:
        m_tiles = tl.num_programs(2)
        lm = tl.arange(0, BLOCK_M)[:, None]
        w_off = ((pid_k * m_tiles + pid_m) * BLOCK_M + lm).to(tl.int64) * N + rn[None, :]
        tl.store(ws_ptr + w_off, acc, mask=ymask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this tile sums all partials
            off = (pid_m * BLOCK_M + lm).to(tl.int64) * N + rn[None, :]
            tot = sum_splits(ws_ptr + off, m_tiles.to(tl.int64) * BLOCK_M * N, num_splits, ymask,
                             acc)
            tl.store(y_ptr + y_off, tot.to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
    else:
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=ymask)


def _dot_dtype(x: torch.Tensor):
    """bf16 operands on the GPU (f = 1 + q/2^b is exact in bf16; x is bf16 already). The CPU
    interpreter's bf16 dot is broken (triton 3.6), so there, and for fp32 x, dot in fp32."""
    if os.environ.get("TRITON_INTERPRET") == "1" or x.dtype == torch.float32:
        return tl.float32
    return tl.bfloat16


_WORKSPACE: dict = {}
_RETIRED: list = []  # outgrown workspaces: CUDA graphs captured earlier still point into them


def _workspace(device: torch.device, n_tiles: int, elems: int):
    """fp32 partials and zeroed tile counters, kept per device and grown on demand (reused by
    every call on the stream: each launch leaves its counters at zero)."""
    key = (device.type, device.index)
    ws, cnt = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < elems:
        _RETIRED.append(ws)
        ws = torch.empty(max(elems, 1 << 20), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < n_tiles:
        _RETIRED.append(cnt)
        cnt = torch.zeros(max(n_tiles, 4096), dtype=torch.int32, device=device)
    _WORKSPACE[key] = (ws, cnt)
    return ws, cnt


@triton.jit
def sum_splits(ptr, split_stride, num_splits, mask, like, CHUNK: tl.constexpr = 16):
    """sum over k < num_splits of the fp32 partials at ptr + k * split_stride (ptr: a tensor of
    pointers shaped like `like`), added in k order: bit for bit the plain loop's result. The
    CHUNK loads of a chunk are issued before its adds, so the last program of a split-K tile
    waits one L2 round trip per CHUNK partials, not one per 4 (what ptxas's unrolling of the
    plain loop gave: 9 dependent trips at 34 splits; H200 run 15 put the split-K ending at
    1.6-3.8 us of a GEMV). Masked-off splits read 0."""
    tot = tl.zeros_like(like)
    for k0 in range(0, num_splits, CHUNK):
        parts = ()
        for i in tl.static_range(CHUNK):
            off = split_stride * (k0 + i)  # int64 where the caller passes an int64 stride
            parts = parts + (tl.load(ptr + off, mask=mask & (k0 + i < num_splits), other=0.0,
                                     cache_modifier=".cg"),)
        for i in tl.static_range(CHUNK):
            tot += parts[i]
    return tot


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k(n_tiles: int, num_groups: int, device: torch.device, waves: float,
            splits: int | None = None) -> tuple[int, int]:
    """(groups_per_split, num_splits) giving about `waves` programs per SM, or about `splits`
    splits when given."""
    if splits is None:
        splits = max(1, int(waves * _num_sms(device)) // max(n_tiles, 1))
    gps = triton.cdiv(num_groups, min(num_groups, splits))
    return gps, triton.cdiv(num_groups, gps)


def quant_matmul_triton(x: torch.Tensor, qa: torch.Tensor, qb: torch.Tensor, sz: torch.Tensor,
                        bits: int, group_size: int, out: torch.Tensor | None = None,
                        block_m: int | None = None, bn: int = 128, num_warps: int = 1,
                        waves: float = 4.0, splits: int | None = None,
                        num_stages: int | None = None, prefetch: bool = True) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype; x has unit stride along K.

    Grouped: x [M, J, K] (any strides but the last) and output row block j (N / J rows, a
    multiple of bn) uses x[:, j]: J linears of one shape on J inputs in one launch.

    block_m 1 (M = 1 only): the FMA path; otherwise tensor-core tiles of block_m rows (16 for
    decode batches, 64 or 128 for prefill). Split-K when the (N, M) tiles alone would leave
    SMs idle."""
    n = qa.shape[1]
    if x.dim() == 3:
        m, j, k = x.shape
        group_n, stride_xj = n // j, x.stride(1)
        assert n % j == 0 and group_n % bn == 0, (n, j, bn)
    else:
        (m, k), group_n, stride_xj = x.shape, n, 0
    assert x.stride(-1) == 1
    if block_m is None:
        block_m = 1 if m == 1 else (MAX_M if m <= MAX_M else 64)
    assert block_m > 1 or m == 1
    pa = 4 if bits == 4 else 2
    wa = group_size * pa // 32
    num_groups = k // group_size
    n_tiles, m_tiles = triton.cdiv(n, bn), triton.cdiv(m, block_m)
    gps, ns = split_k(n_tiles * m_tiles, num_groups, x.device, waves, splits)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if ns > 1:
        ws, cnt = _workspace(x.device, n_tiles * m_tiles, ns * m_tiles * block_m * n)
    else:
        ws, cnt = out, out
    extra = {} if num_stages is None else {"num_stages": num_stages}
    quant_matmul_kernel[(n_tiles, ns, m_tiles)](
        x, qa, qb if qb.numel() else qa, sz, out, ws, cnt,
        m, n, x.stride(0), out.stride(0), num_groups, gps, ns, (1 << pa) - 1, group_n, stride_xj,
        BITS=bits, PA=pa, WA=wa, G=group_size, NW=2 if pa == 4 else 4, BLOCK_M=block_m,
        BN=bn, SPLIT_K=ns > 1, USE_DOT=block_m > 1,
        DOT_DTYPE=_dot_dtype(x), PREFETCH=prefetch, num_warps=num_warps,
        launch_pdl=pdl.ON.value, **extra)
    return out

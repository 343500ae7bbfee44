"""x's int8 digits for the integer tensor-core GEMV (gemv_i8.py): their layout, the launch
that makes them, and the epilogue in which the GEMV producing x writes them instead.

Per group g of G = 128 inputs (naive.naive_x_digits is the reference):

    xi = floor(x * XMAX / max|x_g| + 1/2) in [-XMAX, XMAX],   sx = max|x_g| / XMAX
    xi = 128 d1 + d0,   d1 = (xi + 64) >> 7 in [-127, 127],   d0 = xi - 128 d1 in [-64, 63]

xd int32 [2, groups, WA, NB]: digit d's bytes of group g in the order gemv_i8's mma B
fragments read them (WA word rows, NB registers per word: 8 x 4 for 2 and 3 bits, 16 x 2 for
4 bits); xg fp32 [groups, 2] = (sx, sx sum xi).

`x_digits` makes them from x in one small launch before each GEMV. The GEMV that produces
x can write them instead (`empty`, `views`): a residual epilogue (`epilogue`: x' = h w is in
hand there) or an MLP's gate_up (`swiglu_epilogue`: x' = SiLU(gate) * up for the down
projection), and the launch goes (the decode step had one per batch-1 GEMV on gemv_i8: 199
per token). A group of x' spans tiles of the producer: a counter per group tells the last of
them to come, which reads the group back and writes its digits. The producer does not know
the consumer's bit width, so it writes both layouts (20 KiB at K = 5120).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.quant.gemv import _workspace
from volundr.kernels.quant.naive import XMAX

XMAX_C = tl.constexpr(XMAX)
G_DIGITS = 128  # the group of the digits (gemv_i8 takes G = 128 only)
G_DIGITS_C = tl.constexpr(G_DIGITS)


def nb(bits: int) -> int:
    """A registers (of 4 codes) per word: slot i of a word sits in register i % NB, byte i // NB."""
    return 2 if bits == 4 else 4


def plane_rows(bits: int, g: int = 128) -> int:
    """WA: A-plane word rows per group."""
    return g * (4 if bits == 4 else 2) // 32


# ---- the digits of GN groups -------------------------------------------------------------------
@triton.jit
def _scale(xv):
    """xv [GN, G] fp32 -> (xi int32 [GN, G], sx [GN], sx sum xi [GN])."""
    amax = tl.max(tl.abs(xv), axis=1)
    sx = tl.where(amax > 0, amax / XMAX_C, 1.0)
    inv = XMAX_C / tl.where(amax > 0, amax, 1.0)
    xi = tl.floor(xv * tl.expand_dims(inv, 1) + 0.5).to(tl.int32)
    xi = tl.minimum(tl.maximum(xi, -XMAX_C), XMAX_C)
    return xi, sx, sx * tl.sum(xi, axis=1).to(tl.float32)


@triton.jit
def _store_xd(xi, g0, xd_ptr, num_groups, GN: tl.constexpr, WA: tl.constexpr,
              NB: tl.constexpr):
    """Groups g0 .. g0 + GN - 1 of xd [2, num_groups, WA, NB] from xi [GN, G]."""
    sh = 8 * tl.arange(0, 4)[None, None, None, :]
    d1 = (xi + 64) >> 7
    d0 = xi - 128 * d1
    for d in tl.static_range(2):
        v = d1 if d == 0 else d0
        # k = (NB b + e) WA + r -> [c, r, e, b], bytes b packed into one int32
        v = tl.permute(tl.reshape(v, [GN, 4, NB, WA]), (0, 3, 2, 1))
        w = tl.sum((v & 0xFF) << sh, axis=3)  # [GN, WA, NB]
        if NB == 2:  # 4-bit: per pair of rows (pair, e, row of the pair)
            w = tl.reshape(tl.permute(tl.reshape(w, [GN, WA // 2, 2, 2]), (0, 1, 3, 2)),
                           [GN, WA, NB])
        else:  # e in the order 0, 2, 1, 3
            w = tl.reshape(tl.permute(tl.reshape(w, [GN, WA, 2, 2]), (0, 1, 3, 2)),
                           [GN, WA, NB])
        off = (((d * num_groups + g0 + tl.arange(0, GN))[:, None, None] * WA
                + tl.arange(0, WA)[None, :, None]) * NB + tl.arange(0, NB)[None, None, :])
        tl.store(xd_ptr + off, w)


@triton.jit
def _digits_kernel(x_ptr, xd_ptr, xg_ptr, num_groups, up_off, x_row, G: tl.constexpr,
                   WA: tl.constexpr, NB: tl.constexpr, SWIGLU: tl.constexpr, gs_ptr=None,
                   n_gs=1, eps=0.0, GSCALE: tl.constexpr = False, NGS: tl.constexpr = 1):
    """Program (st, row): the 4 groups of set st of x's row `row` (x_row elements apart), as
    naive_x_digits lays them out (row r's xd and xg r whole arrays apart). SWIGLU: x =
    SiLU(x[:K]) * x[K:] (up_off = K) rounded to x's dtype, as gemv_tc's loads make it.
    GSCALE: group g of row r scaled by rsqrt(sum(gs[r, g, :n_gs]) / G + eps) through its xg
    (sx and sx sum xi; xi is scale-free): KDA's gated output norm, per head (G channels)."""
    pdl.trigger()
    pdl.wait()
    st, row = tl.program_id(0), tl.program_id(1)
    x_ptr += row * x_row
    xd_ptr += row * (2 * num_groups * WA * NB)
    xg_ptr += row * (2 * num_groups)
    offs = st * 4 * G + tl.arange(0, 4 * G)
    xv = tl.load(x_ptr + offs).to(tl.float32)
    if SWIGLU:
        up = tl.load(x_ptr + up_off + offs).to(tl.float32)
        xv = (xv * tl.sigmoid(xv) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    xi, sx, xq = _scale(tl.reshape(xv, [4, G]))
    g4 = st * 4 + tl.arange(0, 4)
    if GSCALE:
        p = tl.arange(0, NGS)
        gs = tl.load(gs_ptr + (row * num_groups + g4[:, None]) * n_gs + p[None, :],
                     mask=p[None, :] < n_gs, other=0.0)
        r = tl.rsqrt(tl.sum(gs, axis=1) / G + eps)
        sx, xq = sx * r, xq * r
    tl.store(xg_ptr + g4 * 2, sx)
    tl.store(xg_ptr + g4 * 2 + 1, xq)
    _store_xd(xi, st * 4, xd_ptr, num_groups, 4, WA, NB)


def x_digits(x: torch.Tensor, bits: int, group_size: int = 128, swiglu: bool = False,
             gscale: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (swiglu: [M, 2K], gate then up) -> (xd int32 [2, K / G, WA, NB], xg fp32
    [K / G, 2]) in one launch, each with a leading [M] when M > 1 (gemv_i8_rows); row r is
    naive.naive_x_digits(x[r:r + 1]). K a multiple of 4 G. gscale = (gs [M, K / G, P] fp32
    partial sums of squares, eps): row r's group g times rsqrt(sum(gs[r, g]) / G + eps), so
    that a GEMV on these digits computes (GroupScaled(x, gs, eps).value()) @ W^T without the
    norm's rounding to x's dtype (what gemv_tc's `gscale` computes)."""
    k = x.shape[-1] // 2 if swiglu else x.shape[-1]
    groups, m = k // group_size, x.shape[0]
    assert groups % 4 == 0 and x.stride(-1) == 1
    wa, n_b = plane_rows(bits, group_size), nb(bits)
    lead = (m,) if m > 1 else ()
    xd = torch.empty(*lead, 2, groups, wa, n_b, dtype=torch.int32, device=x.device)
    xg = torch.empty(*lead, groups, 2, dtype=torch.float32, device=x.device)
    gkw = {}
    if gscale is not None:
        gs, eps = gscale
        gs = gs.reshape(m, groups, -1)
        assert gs.dtype == torch.float32 and gs.is_contiguous() and not swiglu
        gkw = dict(gs_ptr=gs, n_gs=gs.shape[-1], eps=eps, GSCALE=True,
                   NGS=triton.next_power_of_2(gs.shape[-1]))
    _digits_kernel[(groups // 4, m)](x, xd, xg, groups, k, x.stride(0), G=group_size, WA=wa,
                                     NB=n_b, SWIGLU=swiglu, launch_pdl=pdl.ON.value, **gkw)
    return xd, xg


# ---- written by the producer's epilogue ---------------------------------------------------------
def fits(n: int, bn: int) -> bool:
    """Whether a producer with N = n outputs in tiles of bn rows can write the digits of its x':
    whole sets of 4 groups (what gemv_i8 reads) and tiles that split a group evenly."""
    return n % (4 * G_DIGITS) == 0 and G_DIGITS % bn == 0


def empty(n: int, device: torch.device) -> torch.Tensor:
    """The buffer `epilogue` fills for x' [1, n]: int32 [130 n / 128] = xd for 2 / 3 bits
    [2, groups, 8, 4], xd for 4 bits [2, groups, 16, 2], xg [groups, 2] (fp32 bits)."""
    return torch.empty(130 * (n // G_DIGITS), dtype=torch.int32, device=device)


def views(dg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xd, xg) for a consumer of `bits` from an `empty` buffer, as x_digits returns them."""
    groups = dg.numel() // 130
    wa, n_b = plane_rows(bits), nb(bits)
    off = 0 if bits != 4 else 64 * groups
    return (dg[off:off + 64 * groups].view(2, groups, wa, n_b),
            dg[128 * groups:].view(torch.float32).view(groups, 2))


@triton.jit
def _write_group(xv, grp, dg_ptr, num_groups):
    """Group grp's digits from its x' values xv [G] fp32 into dg (`empty`'s layout)."""
    xi, sx, xq = _scale(tl.reshape(xv, [1, G_DIGITS_C]))
    xg_ptr = dg_ptr + 128 * num_groups
    one = tl.arange(0, 1)
    tl.store(xg_ptr + grp * 2 + one, sx.to(tl.int32, bitcast=True))
    tl.store(xg_ptr + grp * 2 + 1 + one, xq.to(tl.int32, bitcast=True))
    _store_xd(xi, grp, dg_ptr, num_groups, 1, 8, 4)
    _store_xd(xi, grp, dg_ptr + 64 * num_groups, num_groups, 1, 16, 2)


@triton.jit
def epilogue(xs_ptr, dg_ptr, dcnt_ptr, pid_n, N, BN: tl.constexpr):
    """After tile pid_n (rows pid_n BN ..) stored its x' = h w into xs [N]: the last of the
    G / BN tiles of a group to get here (a counter per group in dcnt, left at zero) reads the
    group's x' back past L1 and writes its digits into dg (`empty`'s layout), as x_digits
    would from xs. The counter's acq_rel orders the other tiles' xs stores before the reads."""
    TPG: tl.constexpr = G_DIGITS_C // BN
    grp = pid_n // TPG
    tl.debug_barrier()  # every thread's xs stores are issued before the release / the reads
    last = True
    if TPG > 1:
        last = tl.atomic_add(dcnt_ptr + grp, 1, sem="acq_rel") == TPG - 1
    if last:
        offs = grp * G_DIGITS_C + tl.arange(0, G_DIGITS_C)
        xv = tl.load(xs_ptr + offs, cache_modifier=".cg").to(tl.float32)
        _write_group(xv, grp, dg_ptr, N // G_DIGITS_C)
        if TPG > 1:
            tl.atomic_xchg(dcnt_ptr + grp, 0)  # ready for the next launch


@triton.jit
def swiglu_epilogue(y_ptr, dg_ptr, dcnt_ptr, pid_n, N, BN: tl.constexpr):
    """After tile pid_n stored its rows of y [N] = an MLP's fused (gate, up), I = N / 2: the
    last of the 2 G / BN tiles holding group g's gate rows (g G ..) and up rows (I + g G ..)
    reads both back past L1 and writes the digits of x = SiLU(gate) * up, rounded to y's
    dtype as the down projection's loads make it (x_digits with swiglu), into dg. One
    counter per group in dcnt, left at zero."""
    TPG: tl.constexpr = G_DIGITS_C // BN
    half = N // 2
    grp = ((pid_n * BN) % half) // G_DIGITS_C
    tl.debug_barrier()  # every thread's y stores are issued before the release / the reads
    if tl.atomic_add(dcnt_ptr + grp, 1, sem="acq_rel") == 2 * TPG - 1:
        offs = grp * G_DIGITS_C + tl.arange(0, G_DIGITS_C)
        g = tl.load(y_ptr + offs, cache_modifier=".cg").to(tl.float32)
        u = tl.load(y_ptr + half + offs, cache_modifier=".cg").to(tl.float32)
        xv = (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty).to(tl.float32)
        _write_group(xv, grp, dg_ptr, half // G_DIGITS_C)
        tl.atomic_xchg(dcnt_ptr + grp, 0)  # ready for the next launch


def epilogue_kwargs(dg: torch.Tensor, n: int, bn: int, cnt: torch.Tensor, n_tiles: int,
                    swiglu: bool = False) -> dict:
    """Kernel arguments of `epilogue` (swiglu: `swiglu_epilogue`, x' = SiLU(gate) * up of
    N / 2) for a producer of N = n in tiles of bn rows whose workspace counters `cnt`
    (gemv._workspace) hold n_tiles + one per group of x': the split-K counters first."""
    nx = n // 2 if swiglu else n
    assert (n % 2 == 0 or not swiglu) and fits(nx, bn)
    assert dg.dtype == torch.int32 and dg.numel() == 130 * (nx // G_DIGITS)
    assert cnt.numel() >= n_tiles + nx // G_DIGITS
    return dict(dg_ptr=dg, dcnt_ptr=cnt[n_tiles:], DIGITS=not swiglu, SWD=swiglu)


def workspace(out: torch.Tensor, n: int, n_tiles: int, splits: int, bn: int,
              residual: tuple | None, out_digits: torch.Tensor | None,
              out_swiglu_digits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(ws, cnt, kwargs) of a GEMV launch (gemv_tc, gemv_i8) with N = n in n_tiles tiles of bn
    rows and `splits` splits: split-K's partials and tile counters (gemv._workspace; `out`
    stands for both where neither is read), then one counter per group of the digits it
    writes, and `epilogue_kwargs` for them ({} without). out_digits: a residual epilogue's;
    out_swiglu_digits: an MLP gate_up's, of SiLU(gate) * up (at most one of the two)."""
    assert out_digits is None or out_swiglu_digits is None
    dg, swd = (out_digits, False) if out_swiglu_digits is None else (out_swiglu_digits, True)
    ws, cnt = out, out
    if splits > 1 or dg is not None:  # tile counters, then the digits' group counters
        ws, cnt = _workspace(out.device, n_tiles + (0 if dg is None else n // G_DIGITS),
                             splits * n)
    if dg is None:
        return ws, cnt, {}
    assert (residual is not None) != swd, "out_digits: with residual; swiglu ones: without"
    return ws, cnt, epilogue_kwargs(dg, n, bn, cnt, n_tiles, swd)

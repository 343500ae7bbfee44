"""gemv_i8_rows (kernels/quant/gemv_i8_rows.py). CPU: its lanes emulated (gemv_i8's PTX steps
fed one group's word rows per lane column and the digits of up to 4 x rows per B, through
test_gemv_i8.run_asm) == direct integer sums, at 2, 3 and 4 bits, for 1-8 rows, with a wrong
feed caught; x_digits of several rows == naive_x_digits row by row (TRITON_INTERPRET=1 in a
subprocess, this file as a script). CUDA: the GEMV == the naive reference for 1-16 rows,
SwiGLU x and split-K or not; the engine's rows path."""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl
from interpreted import run_interpreted  # (tests/ is on the path)
from test_gemv_i8 import int_digits, run_asm  # (tests/ is on the path, pytest or script)

from volundr.kernels.quant import gemv_i8_rows as gr
from volundr.kernels.quant.naive import naive_quant_matmul, naive_x_digits
from volundr.kernels.quant.pack import to_kernel_layout

CUDA = torch.cuda.is_available()


def emulated_rows_error(bits: int, m: int, seed: int = 0, feed=None) -> int:
    """One group of 128 inputs, 32 output rows (one warp, rows 4 quad + j) and m <= 8 x rows
    through the emulated PTX as gemv_i8_rows_kernel feeds it: lane (quad, c) holds word rows
    4c..4c + 3 (4-bit) or c, 4 + c (2, 3 bits) of the group, B lane (quad, c) the digits of x row
    4 b + quad // 2 (digit quad % 2) at those rows; D lane (quad, c) then holds x row 4 b + c's
    sums. Returns the largest |difference| from the direct sums of codes x digits (0 when
    right). feed: (bits, lane c) -> the word rows lane c's A words come from (its digits stay
    the kernel's), to inject a wrong mapping."""
    gen = torch.Generator().manual_seed(seed)
    g = 128
    n_b = gr.nb(bits)
    q = torch.randint(0, 2**bits, (32, g), generator=gen)
    x = torch.randn(m, g, generator=gen).to(torch.bfloat16)
    xds = [naive_x_digits(x[r:r + 1], bits, g)[0][:, 0] for r in range(m)]  # [2, WA, NB]
    qa, qb = to_kernel_layout(q.to(torch.uint8), bits, g)  # [WA, 32], 3-bit [WA / 2, 32]
    asm = gr.consts(bits)["ASM_STEP"]
    lanes = range(32)
    rows_of = (lambda b, c: [4 * c + s for s in range(4)] if b == 4 else [c, 4 + c])
    a_rows = feed or rows_of

    def words(plane: torch.Tensor, row_of) -> list[list[int]]:  # 4 tensors (j) of 32 lanes
        return [[int(plane[row_of(lane % 4), 4 * (lane // 4) + j]) for lane in lanes]
                for j in range(4)]

    def digits(b: int, i: int) -> list[list[int]]:  # B tensor i (4 registers j) of x block b
        out = []
        for j in range(4):
            vals = []
            for lane in lanes:
                quad, c = lane // 4, lane % 4
                r = 4 * b + quad // 2
                rws = rows_of(bits, c)
                if r >= m:
                    vals.append(0)
                elif bits == 4:  # pair i: rows (2i, 2i + 1) of block c in xd's order
                    blk = xds[r][quad % 2, rws[0]:rws[0] + 4, :].reshape(-1)
                    vals.append(int(blk[4 * i + j]))
                else:
                    vals.append(int(xds[r][quad % 2, rws[i], j]))
            out.append(vals)
        return out

    d1, d0 = int_digits(x.float())
    err = 0
    for b in range((m + 3) // 4):
        acc = [[0] * 32 for _ in range(16)]
        xb = digits(b, 0) + digits(b, 1)
        for i in range(2):
            ins = {16 + t: acc[t] for t in range(16)}
            if bits == 4:
                w = words(qa, lambda c, i=i: a_rows(4, c)[2 * i]) + \
                    words(qa, lambda c, i=i: a_rows(4, c)[2 * i + 1])
                ins.update({32 + t: v for t, v in enumerate(w)})
                ins.update({40 + t: v for t, v in enumerate(xb)})
            else:
                ins.update({32 + t: v for t, v in
                            enumerate(words(qa, lambda c, i=i: a_rows(bits, c)[i]))})
                o = 36
                if bits == 3:
                    ins.update({36 + t: v for t, v in
                                enumerate(words(qb, lambda c: a_rows(3, c)[0] % 4))})
                    o = 40
                ins.update({o + t: v for t, v in enumerate(xb)})
            acc = run_asm(asm[i], ins, 16)
        s1 = torch.tensor(acc[0:4]).t() + (torch.tensor(acc[8:12]).t() >> (8 // n_b))
        s0 = torch.tensor(acc[4:8]).t() + (torch.tensor(acc[12:16]).t() >> (8 // n_b))
        for lane in lanes:
            quad, c = lane // 4, lane % 4
            r = 4 * b + c
            if r >= m:
                continue
            for j in range(4):
                row = q[4 * quad + j].to(torch.int64)
                err = max(err, abs(int((row * d1[r]).sum()) - int(s1[lane, j])),
                          abs(int((row * d0[r]).sum()) - int(s0[lane, j])))
    return err


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rows_lanes_emulated(bits):
    for m, seed in ((1, 0), (4, 1), (6, 2)):
        assert emulated_rows_error(bits, m, seed) == 0, (bits, m)


def test_rows_wrong_feed_is_caught():
    """Lane columns fed another lane's word rows (the digits stay) give wrong sums."""
    for bits in (2, 3, 4):
        wrong = (lambda b, c: [4 * ((c + 1) % 4) + s for s in range(4)] if b == 4
                 else [(c + 1) % 4, 4 + c])
        assert emulated_rows_error(bits, 4, 0, wrong) > 0


def test_rows_config_takes_only_supported_tiles():
    """The engine's config per rows and bits is one gemv_i8_rows takes at Volundr-32B's shapes;
    4-bit up to 4 rows prefetches 2 groups a trip, so an odd group count keeps 1 a trip."""
    x = torch.zeros(1, 17408, dtype=torch.bfloat16)
    for bits, m, n, k in ((4, 2, 17408, 5120), (4, 4, 5120, 17408), (4, 8, 17408, 5120),
                          (2, 8, 17408, 5120), (3, 16, 34816, 5120), (4, 3, 5120, 640)):
        kw = gr.config(bits, m, n, k)
        assert gr.supported(x[:, :k].expand(m, k), bits, 128, n, k, kw["reps"], kw["unroll"])
        assert kw.get("prefetch", False) == (bits == 4 and m <= 4 and k != 640), (bits, m, k)


def check_rows_digits(device: str) -> None:
    from volundr.kernels.quant.digits import x_digits

    gen = torch.Generator().manual_seed(5)
    for bits in (2, 4):
        for swiglu in (False, True):
            x = torch.randn(3, 1024 * (2 if swiglu else 1), generator=gen).to(torch.bfloat16)
            x = x.to(device)
            xd, xg = x_digits(x, bits, swiglu=swiglu)
            assert xd.shape[0] == 3 and xg.shape[0] == 3
            for r in range(3):
                rd, rg = naive_x_digits(x[r:r + 1], bits, swiglu=swiglu)
                one_d, one_g = x_digits(x[r:r + 1], bits, swiglu=swiglu)
                assert torch.equal(xd[r], one_d) and torch.equal(xg[r], one_g), (bits, r)
                # (one row == naive is test_gemv_i8's check_digits; here: rows don't mix)
                assert torch.allclose(xg[r][:, 0], rg[:, 0], rtol=1 / 128 if swiglu else 0)
    # gscale (KDA's gated output norm per head): the same digits, each group's xg times its
    # row's rsqrt(sum(gs[r, g]) / G + eps), for 3 rows and for one (gs [groups, P] there)
    eps = 1e-6
    for bits in (2, 3, 4):
        for m in (3, 1):
            x = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).to(device)
            gs = (torch.rand(m, 8, 3, generator=gen) * 40).to(device)
            gs[0, 1] = 0  # a head of zeros: 1 / sqrt(eps)
            xd, xg = x_digits(x, bits, gscale=(gs if m > 1 else gs[0], eps))
            rd, rg = x_digits(x, bits)
            r = torch.rsqrt(gs.sum(-1) / 128 + eps).reshape(xg.shape[:-1])
            assert torch.equal(xd, rd), (bits, m)
            assert torch.allclose(xg, rg * r[..., None], rtol=1e-6, atol=0), (bits, m)


def test_rows_digits_interpreter():
    out = run_interpreted(__file__, "digits")
    assert "rows digits ok" in out and "epilogue ok" in out, out[-3000:]


def check_epilogue() -> None:
    """gemv_i8_rows._epilogue (pure Triton; the interpreter) on given final sums y [R, N] laid
    out as the kernel's lanes hold them: plain, RSCALE (each row times its rsqrt(sum(rs) / K +
    eps)) and RES (h = y rounded + r rounded, h w, each row's tile sums of h^2) == the same
    in torch, for R not a multiple of 4 (masked rows) and two blocks of rows."""
    @triton.jit
    def kernel(yin_ptr, y_ptr, rs_ptr, n_rs, r_ptr, nw_ptr, xs_ptr, ss_ptr, K,
               N: tl.constexpr, R: tl.constexpr, RB: tl.constexpr, L: tl.constexpr,
               RSCALE: tl.constexpr, NRS: tl.constexpr, RES: tl.constexpr):
        pid_n = tl.program_id(0)
        c4, q4, j4, n, nmask = gr._lane_rows(pid_n, N, 32 * L, 8, L)
        for b in tl.static_range(RB):
            xc = 4 * b + c4
            y = tl.load(yin_ptr + xc * N + n, mask=xc < R, other=0.0)
            gr._epilogue(y, b, c4, n, pid_n, N, R, K, y_ptr, rs_ptr, n_rs, 1e-6, RSCALE, NRS,
                         r_ptr, nw_ptr, xs_ptr, ss_ptr, RES)

    gen = torch.Generator().manual_seed(7)
    bf = torch.bfloat16
    m, n, k, reps = 6, 256, 512, 2
    tiles = gr.tiles(n, reps)
    yin = torch.randn(m, n, generator=gen) * 3
    rs = torch.rand(m, 3, generator=gen) * 50
    r = torch.randn(m, n, generator=gen).to(bf)
    w = (torch.rand(n, generator=gen) + 0.5).to(bf)
    def _rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for rscale, res in ((False, False), (True, False), (False, True), (True, True)):
        y = torch.full((m, n), float("nan"), dtype=bf)
        xs = torch.full((m, n), float("nan"), dtype=bf)
        ss = torch.full((m, tiles), float("nan"))
        kernel[(tiles,)](yin, y, rs, 3, r, w, xs, ss, k, N=n, R=m, RB=2, L=reps,
                         RSCALE=rscale, NRS=4, RES=res)
        ref = yin * torch.rsqrt(rs.sum(1, keepdim=True) / k + 1e-6) if rscale else yin
        if res:  # (the interpreter truncates fp32 -> bf16 where the GPU rounds: 2 roundings
            # of h, so up to 2 bf16 ulps of the larger of y and h per element)
            h = (ref.to(bf).float() + r.float()).to(bf).float()
            mag = torch.maximum(ref.abs(), h.abs())
            assert ((y.float() - h).abs() <= mag * 2 * 2.0 ** -7 + 1e-6).all(), "h"
            assert torch.equal(xs, (y.float() * w.float()).to(bf)) or _rel(
                xs, y.float() * w.float()) < 8e-3, "h w"
            want = y.float().pow(2).view(m, tiles, 32 * reps).sum(-1)  # of the h written
            assert torch.allclose(ss, want, rtol=1e-5), "sums of h^2"
        else:
            assert torch.allclose(y.float(), ref.to(bf).float(), rtol=1e-2, atol=1e-2), rscale


def _layer(n: int, k: int, bits: int, seed: int):
    from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    qa, qb = to_kernel_layout(q, bits, 128)
    s = (torch.rand(n, k // 128, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(n, k // 128, generator=gen) * (2**bits - 1)).to(torch.bfloat16)
    return qa.cuda(), qb.cuda(), pack_scale_zero(s, z).cuda()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k", [(1024, 512), (17408, 5120), (5120, 17408)])
def test_cuda_gemv_i8_rows(bits, n, k):
    layer = _layer(n, k, bits, n + k + bits)

    def rel(y, r):
        return ((y.float() - r).norm() / r.norm()).item()

    small = n * k < 1 << 20  # the configs at the small shape, the default at Volundr-32B's
    for m in (1, 3, 5, 16) if small else (2, 8, 13):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)
        for kw in ({}, {"splits": 1}, {"reps": 1, "unroll": 2}, {"prefetch": True, "unroll": 2},
                   {"prefetch": True, "splits": 1}) if small else (
                       {}, {"prefetch": True}, gr.config(bits, m, n, k)):  # (the engine's)
            y = gr.gemv_i8_rows(x, *layer, bits, 128, **kw)
            assert y.shape == (m, n) and rel(y, ref) < 4e-3, (m, kw, rel(y, ref))
        gu = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
        xs = (torch.nn.functional.silu(gu[:, :k].float()) * gu[:, k:].float()).to(torch.bfloat16)
        y = gr.gemv_i8_rows(gu, *layer, bits, 128, swiglu=True)
        assert rel(y, naive_quant_matmul(xs.float(), *layer, bits, 128, k)) < 4e-3, m


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [(4, 3), (2, 4), (3, 2)])
def test_cuda_rows_residual_epilogue_and_rscale(bits):
    """The residual epilogue per row (h = y + r rounded as the unfolded path rounds, h w, each
    row's tile sums of h^2) and the next GEMV's per-row 1 / rms scale == the naive matmul,
    residual add, RMSNorm and matmul; split-K or not, 2-16 rows, SwiGLU x or not."""
    eps = 1e-6
    bf = torch.bfloat16
    for (d, k, n_next), m, kw in (((5120, 5120, 17408), 2, {}), ((5120, 17408, 5120), 5, {}),
                                  ((1024, 512, 1024), 16, {"splits": 1}),
                                  ((1024, 512, 1024), 3, {"splits": 2})):
        swiglu = k == 17408
        qp, qc = _layer(d, k, bits[0], d + m), _layer(n_next, d, bits[1], k + m)
        xin = torch.randn(m, 2 * k if swiglu else k, device="cuda").to(bf)
        x = xin.float()
        if swiglu:
            x = (torch.nn.functional.silu(x[:, :k]) * x[:, k:]).to(bf).float()
        r = torch.randn(m, d, device="cuda").to(bf)
        w = (torch.rand(d, device="cuda") + 0.5).to(bf)
        cfg = {**gr.config(bits[0], m, d, k), **kw}
        h = torch.full((m, d), float("nan"), device="cuda", dtype=bf)
        xw = torch.full_like(h, float("nan"))
        ss = torch.full((m, gr.tiles(d, cfg["reps"])), float("nan"), device="cuda")
        gr.gemv_i8_rows(xin, *qp, bits[0], 128, swiglu=swiglu, out=h, residual=(r, w, xw, ss),
                        **cfg)
        h_ref = (naive_quant_matmul(x, *qp, bits[0], 128, k).to(bf).float() + r.float())
        assert ((h.float() - h_ref).norm() / h_ref.norm()).item() < 4e-3, (m, "h")
        assert torch.equal(xw, (h.float() * w.float()).to(bf)), (m, "h w")
        ratio = ss.sum(1) / h.float().pow(2).sum(1)
        assert ((ratio - 1).abs() < 1e-4).all(), (m, "sums of h^2")
        norm = (h.float() * torch.rsqrt(h.float().pow(2).mean(1, keepdim=True) + eps)
                * w.float()).to(bf)
        z_ref = naive_quant_matmul(norm.float(), *qc, bits[1], 128, d)
        z = gr.gemv_i8_rows(xw, *qc, bits[1], 128, rscale=(ss, eps),
                            **{**gr.config(bits[1], m, n_next, d), **kw})
        assert ((z.float() - z_ref).norm() / z_ref.norm()).item() < 8e-3, (m, "next GEMV")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_engine_rows_path(monkeypatch):
    """VOLUNDR_I8_ROWS=8: the engine's 2-8-row matmuls (plain and with the MLP's SwiGLU) take
    gemv_i8_rows, == the naive reference; 9 rows stay on gemm_tc. I8_ROWS_CHUNKED=48 (the default):
    20 and 33 rows as 16-row calls; eagerly, 3-15 rows (and a chunked call's rest) padded to a
    power of two."""
    from volundr.kernels.quant import engine as qe

    monkeypatch.setattr(qe, "I8_ROWS", 8)
    calls = []
    monkeypatch.setattr(gr, "gemv_i8_rows", lambda *a, _f=gr.gemv_i8_rows, **kw:
                        calls.append(a[0].shape[0]) or _f(*a, **kw))
    for bits in (2, 3, 4):
        n, k = 5120, 5120
        layer = _layer(n, k, bits, bits)
        for m in (2, 8, 9):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)
            y = qe.quant_matmul(x, *layer, bits, 128)
            assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
            gu = torch.randn(m, 2 * k, device="cuda").to(torch.bfloat16)
            xs = (torch.nn.functional.silu(gu[:, :k].float()) * gu[:, k:].float())
            y = qe.quant_matmul(gu, *layer, bits, 128, swiglu=True)
            ref = naive_quant_matmul(xs.to(torch.bfloat16).float(), *layer, bits, 128, k)
            assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3
    assert calls == [2, 2, 8, 8] * 3
    # I8_ROWS_CHUNKED=48: 17-48 rows as calls of 16 (the last one the rest)
    monkeypatch.setattr(qe, "I8_ROWS", 16)
    monkeypatch.setattr(qe, "I8_ROWS_CHUNKED", 48)
    calls.clear()
    for bits in (2, 3, 4):
        layer = _layer(5120, 5120, bits, bits)
        for m in (20, 33):
            x = torch.randn(m, 5120, device="cuda").to(torch.bfloat16)
            ref = naive_quant_matmul(x.float(), *layer, bits, 128, 5120)
            y = qe.quant_matmul(x, *layer, bits, 128)
            assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3, (bits, m)
    assert calls == [16, 4, 16, 16, 1] * 3
    # outside graph capture 3-15 rows run as the next power of two (qe.eager_rows: no compile
    # per row count while serving): the same rows as gemv_i8_rows on exactly m rows
    calls.clear()
    for bits in (2, 3, 4):
        layer = _layer(5120, 5120, bits, bits)
        for m in (3, 5, 13, 29):
            x = torch.randn(m, 5120, device="cuda").to(torch.bfloat16)
            y = qe.quant_matmul(x, *layer, bits, 128)
            ref = naive_quant_matmul(x.float(), *layer, bits, 128, 5120)
            assert y.shape == (m, 5120) and y.is_contiguous()
            assert ((y.float() - ref).norm() / ref.norm()).item() < 4e-3, (bits, m)
            if m <= 16:
                exact = gr.gemv_i8_rows(x, *layer, bits, 128,
                                        **qe._rows_config(x, 5120, 5120, bits, 128))
                assert ((y.float() - exact.float()).norm() / exact.norm()).item() < 1e-3
    assert calls == [4, 3, 8, 5, 16, 13, 16, 16] * 3


if __name__ == "__main__":
    if sys.argv[1:] == ["digits"]:
        check_rows_digits("cpu")
        print("rows digits ok")
        check_epilogue()
        print("epilogue ok")

"""The integer tensor-core GEMV (volundr.kernels.quant.gemv_i8).

CPU: its inline PTX on 32 emulated lanes (mma.m16n8k32's fragment layout from the PTX ISA)
against direct integer sums, for 2, 3 and 4 bits, with mutations caught; the digits launch
under TRITON_INTERPRET=1 (a subprocess: this file as a script) == naive_x_digits. The PTX
itself cannot run in the interpreter. CUDA: the GEMV == the naive reference at Volundr-32B
shapes, and the engine's path with VOLUNDR_QUANT_GEMV=i8.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

from volundr.kernels.quant import gemv_i8 as gi
from volundr.kernels.quant.naive import XMAX, naive_quant_matmul, naive_x_digits
from volundr.kernels.quant.pack import to_kernel_layout

CUDA = torch.cuda.is_available()


# ---- the PTX, emulated ---------------------------------------------------------------------------
def run_asm(asm: str, ins: dict[int, list[int]], n_out: int) -> list[list[int]]:
    """Runs one of gemv_i8's PTX blocks on 32 lanes: shr / shl / and / or per lane, each
    mma.m16n8k32 (u8 A, s8 B) with its fragments as the PTX ISA lays them out (lane = 4 g + c;
    A: a0 row g cols 4c.., a1 row g + 8, a2 row g cols 16 + 4c.., a3 row g + 8; B: b0 rows 4c..
    col g, b1 rows 16 + 4c..; C / D: row g cols 2c, 2c + 1, then row g + 8). ins: operand
    index -> its 32 lanes' values (outputs start at 0). Returns the outputs [n_out][32]."""
    regs = [{f"${i}": 0 for i in range(n_out)} for _ in range(32)]
    for i, vals in ins.items():
        for lane in range(32):
            regs[lane][f"${i}"] = int(vals[lane]) & 0xFFFFFFFF

    def u8(v: int) -> list[int]:
        return [(v >> (8 * i)) & 0xFF for i in range(4)]

    def s8(v: int) -> list[int]:
        return [b - 256 if b > 127 else b for b in u8(v)]

    def ops(line: str) -> list[str]:
        return [o.strip(" {};") for o in line.split(" ", 1)[1].split(",")]

    def cd(g: int, q: int) -> list[tuple[int, int]]:
        return [(g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1)]

    for line in asm.splitlines():
        line = line.strip()
        if line.startswith(("shr.u32", "shl.b32", "and.b32", "or.b32")):
            d, x, y = ops(line)
            op = line[:3]
            for r in regs:
                v = r[y] if y in r else int(y, 0)
                r[d] = (r[x] >> v if op == "shr" else (r[x] << v) & 0xFFFFFFFF if op == "shl"
                        else r[x] & v if op == "and" else r[x] | v)
        elif line.startswith("mma"):
            o = ops(line)
            dn, an, bn, cn = o[0:4], o[4:8], o[8:10], o[10:14]
            a = torch.zeros(16, 32, dtype=torch.int64)
            b = torch.zeros(32, 8, dtype=torch.int64)
            c = torch.zeros(16, 8, dtype=torch.int64)
            for lane, r in enumerate(regs):
                g, q = lane // 4, lane % 4
                for i, (row, col) in enumerate([(g, 4 * q), (g + 8, 4 * q), (g, 16 + 4 * q),
                                                (g + 8, 16 + 4 * q)]):
                    a[row, col:col + 4] = torch.tensor(u8(r[an[i]]))
                for i, row in enumerate([4 * q, 16 + 4 * q]):
                    b[row:row + 4, g] = torch.tensor(s8(r[bn[i]]))
                for i, (row, col) in enumerate(cd(g, q)):  # s32
                    v = r[cn[i]] & 0xFFFFFFFF
                    c[row, col] = v - (v >> 31 << 32)
            dm = c + a @ b
            for lane, r in enumerate(regs):
                for i, (row, col) in enumerate(cd(lane // 4, lane % 4)):
                    r[dn[i]] = int(dm[row, col])
        else:
            assert line in ("{", "}") or line.startswith(".reg"), line
    return [[regs[lane][f"${i}"] for lane in range(32)] for i in range(n_out)]


def int_digits(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d1, d0) int64 of fp32 groups xf [groups, G] (gemv_i8.py's module doc), in the groups'
    own element order: the direct sums' side of the emulations."""
    amax = xf.abs().amax(1, keepdim=True)
    xi = torch.floor(xf * (XMAX / amax) + 0.5).clamp(-XMAX, XMAX).to(torch.int64)
    d1 = torch.div(xi + 64, 128, rounding_mode="floor")
    return d1, xi - 128 * d1


def emulated_error(bits: int, seed: int = 0, asm=None) -> int:
    """One set (4 groups of 128; rows 4 quad + j of one warp, lane c holding group c) through
    the emulated PTX of every step as gemv_i8_kernel feeds it, against the direct sums of
    codes x digits. Returns the largest |difference| (0 when right). asm: (bits, step index)
    -> PTX, to inject a mutation."""
    asm = asm or (lambda b, i: gi.consts(b)["ASM_STEP"][i])
    gen = torch.Generator().manual_seed(seed)
    g = 128
    wa, n_b = gi.plane_rows(bits, g), gi.nb(bits)
    q = torch.randint(0, 2**bits, (32, 4 * g), generator=gen)
    x = torch.randn(1, 4 * g, generator=gen).to(torch.bfloat16)
    xd, _ = naive_x_digits(x, bits, g)
    qa, qb = to_kernel_layout(q.to(torch.uint8), bits, g)  # [4 WA, 32], 3-bit [4 WA / 2, 32]
    acc = [[0] * 32 for _ in range(16)]
    lanes = range(32)

    def words(plane: torch.Tensor, rows: int, r: int) -> list[list[int]]:
        return [[int(plane[(lane % 4) * rows + r, 4 * (lane // 4) + j]) for lane in lanes]
                for j in range(4)]

    for blk in range(wa // 4):
        # the block's B registers (NB x 4 steps in xd's order); zero where the lane supplies
        # no column of its group (sel in the kernel)
        xb = [[int(xd[lane // 4 % 2, lane % 4, 4 * blk:4 * blk + 4, :].reshape(-1)[f])
               if (lane // 4) // 2 == lane % 4 else 0 for lane in lanes] for f in range(4 * n_b)]
        steps = range(2) if bits == 4 else range(4)
        for st in steps:
            ins = {16 + i: acc[i] for i in range(16)}
            if bits == 4:
                w = words(qa, wa, 4 * blk + 2 * st) + words(qa, wa, 4 * blk + 2 * st + 1)
                ins.update({32 + i: v for i, v in enumerate(w)})
                ins.update({40 + f: xb[f] for f in range(8)})
                acc = run_asm(asm(4, st), ins, 16)
            else:
                ins.update({32 + j: v for j, v in enumerate(words(qa, wa, 4 * blk + st))})
                o = 36
                if bits == 3:
                    ins.update({36 + j: v for j, v in enumerate(words(qb, wa // 2, st))})
                    o = 40
                ins.update({o + f: xb[f] for f in range(16)})
                acc = run_asm(asm(bits, blk * 4 + st if bits == 3 else st), ins, 16)
    s1 = torch.tensor(acc[0:4]).t() + (torch.tensor(acc[8:12]).t() >> (8 // n_b))  # [lane, j]
    s0 = torch.tensor(acc[4:8]).t() + (torch.tensor(acc[12:16]).t() >> (8 // n_b))
    d1, d0 = int_digits(x.float().view(4, g))
    err = 0
    for lane in lanes:
        quad, c = lane // 4, lane % 4
        for j in range(4):
            row = q[4 * quad + j, c * g:(c + 1) * g].to(torch.int64)
            err = max(err, abs(int((row * d1[c]).sum()) - int(s1[lane, j])),
                      abs(int((row * d0[c]).sum()) - int(s0[lane, j])))
    return err


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_ptx_operand_order(bits):
    for seed in (0, 1):
        assert emulated_error(bits, seed) == 0


def test_ptx_mutations_are_caught():
    """A wrong shift, mask or operand in the PTX changes the emulated sums."""
    cases = {
        4: lambda s: s.replace("0xf0f0f0f0", "0x0f0f0f0f", 1),
        2: lambda s: s.replace("shr.u32 s0, $32, 4", "shr.u32 s0, $32, 2"),
        3: lambda s: s.replace("0x10101010", "0x08080808", 1),
    }
    for bits, mut in cases.items():
        assert emulated_error(bits, 0, lambda b, i, m=mut: m(gi.consts(b)["ASM_STEP"][i])) > 0
    swap_h = lambda b, i: gi.asm_step3m(i % 4, 1 - i // 4)  # the two blocks' bit positions
    assert emulated_error(3, 0, swap_h) > 0


def test_naive_digits_reconstruct_x():
    """sx (128 d1 + d0) is x to 15 bits of its group's max; a zero group gives zeros."""
    x = torch.randn(1, 1024).to(torch.bfloat16)
    x[0, 128:256] = 0
    for bits in (2, 3, 4):
        xd, xg = naive_x_digits(x, bits)
        assert xd.shape == (2, 8, gi.plane_rows(bits), gi.nb(bits)) and xg.shape == (8, 2)
        assert (xd[:, 1] == 0).all() and xg[1, 1] == 0 and xg[1, 0] == 1
    # the digit bytes of every element, in any order: their values reconstruct x per group
    d = xd.contiguous().view(torch.int8).reshape(2, 8, -1).to(torch.int64)
    xi = 128 * d[0] + d[1]  # [groups, 128] (permuted inside each group)
    xf = x.float().view(8, 128)
    back = (xi * xg[:, :1]).sort(1).values
    assert torch.allclose(back, xf.sort(1).values, atol=1e-4 * xf.abs().max().item())
    assert torch.allclose(xg[:, 1], xi.sum(1).float() * xg[:, 0])


def test_digits_launch_interpreter():
    assert "digits ok" in run_interpreted(__file__, "digits")


def _xi(xd: torch.Tensor) -> torch.Tensor:
    """xd -> xi = 128 d1 + d0 [groups, G] (in xd's element order)."""
    d = xd.contiguous().view(torch.int8).reshape(2, xd.shape[1], -1).to(torch.int64)
    return 128 * d[0] + d[1]


def check_digits(device: str) -> None:
    """x_digits == naive_x_digits, SwiGLU too: the same layout and scales; xi may differ by
    one where x sx^-1 + 1/2 lands within an fp32 rounding of an integer (a fused multiply-add
    on the GPU, numpy's order in the interpreter), and xg's sums follow the kernel's own xi;
    sx equal except with SwiGLU (its bf16 product may differ by an ulp)."""
    gen = torch.Generator().manual_seed(3)
    for bits in (2, 3, 4):
        for swiglu in (False, True):
            x = torch.randn(1, 1024 * (2 if swiglu else 1), generator=gen).to(torch.bfloat16)
            x[0, :128] = 0  # a zero group: sx = 1
            x = x.to(device)
            xd, xg = gi.x_digits(x, bits, swiglu=swiglu)
            rd, rg = naive_x_digits(x, bits, swiglu=swiglu)
            xi, ri = _xi(xd), _xi(rd)
            diff = (xi - ri).abs()
            if swiglu:  # SiLU's rounding may move the bf16 product by an ulp (2^-8 relative)
                assert (diff <= 1 + ri.abs() / 128).all(), (bits, swiglu)
            else:
                assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (bits, swiglu)
            assert torch.allclose(xg[:, 0], rg[:, 0], rtol=1 / 128 if swiglu else 0, atol=0)
            assert torch.allclose(xg[:, 1].cpu(), (xg[:, 0] * xi.sum(1).float()).cpu(),
                                  rtol=1e-5, atol=1e-6), (bits, swiglu)


def _layer(n: int, k: int, bits: int, seed: int, device: str = "cuda"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    qa, qb = to_kernel_layout(q, bits, 128)
    s = (torch.rand(n, k // 128, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(n, k // 128, generator=gen) * (2**bits - 1)).to(torch.bfloat16)
    from volundr.kernels.quant.pack import pack_scale_zero

    return qa.to(device), qb.to(device), pack_scale_zero(s, z).to(device)


def check_digits_epilogue(device: str, n: int = 512, k: int = 512) -> None:
    """A residual epilogue with out_digits writes x' = h w's digits for either consumer
    width exactly as x_digits(x') makes them, with one tile per group (reps 4) and two (reps
    2: the second tile to finish writes them), split-K and not, twice in a row (the group
    counters are left at zero); gemv_tc (runs in the interpreter) and, on CUDA, gemv_i8.
    A group of x' all zero gives sx = 1 and zero digits."""
    from volundr.kernels.quant import digits as dgt
    from volundr.kernels.quant.gemv import _workspace
    from volundr.kernels.quant.gemv_tc import gemv_tc

    gen = torch.Generator().manual_seed(5)
    x, r, w = (torch.randn(1, d, generator=gen).to(torch.bfloat16).to(device)
               for d in (k, n, n))
    w[0, 128:256] = 0
    runs = [(gemv_tc, 4, dict(reps=r_, splits=sp)) for r_ in (2, 4) for sp in (1, 2)]
    if device == "cuda":
        runs += [(gi.gemv_i8, b, dict(splits=sp)) for b in (2, 3, 4) for sp in (1, 2)]
    for fn, bits, kw in runs:
        layer = _layer(n, k, bits, bits, device)
        bn = 32 * kw.get("reps", 2)
        for _ in range(2):
            xs = torch.full_like(r, 100.0)  # (a read of xs before its store would show)
            ss = torch.empty(n // bn, dtype=torch.float32, device=device)
            dg = dgt.empty(n, x.device).fill_(-1)
            fn(x, *layer, bits, 128, residual=(r, w, xs, ss), out_digits=dg, **kw)
            for b in (2, 3, 4):  # (xi as in check_digits: within one where fp32 rounds)
                xd, xg = dgt.views(dg, b)
                rd, rg = dgt.x_digits(xs, b)
                diff = (_xi(xd) - _xi(rd)).abs()
                assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (fn, bits, kw, b)
                assert torch.equal(xg[:, 0], rg[:, 0]), (fn.__name__, bits, kw, b)
                assert torch.allclose(xg[:, 1], rg[:, 1], rtol=1e-4, atol=1e-4 * rg[:, 0].max())
            assert (xg[1] == torch.tensor([1.0, 0.0], device=device)).all()
        cnt = _workspace(x.device, 1, 1)[1]
        assert not cnt.any(), "group counters left at zero"
    # an MLP's gate_up (N = 2 n: gate rows, then up rows) writing the digits of SiLU(gate) * up
    runs = [(gemv_tc, 4, dict(reps=r_, splits=sp)) for r_ in (2, 4) for sp in (1, 2)]
    if device == "cuda":
        runs += [(gi.gemv_i8, b, dict(splits=sp)) for b in (2, 3) for sp in (1, 2)]
    ss = torch.rand(3, device=device) * k
    for fn, bits, kw in runs:
        layer = _layer(2 * n, k, bits, bits + 1, device)
        for rscale in (None, (ss, 1e-6)):
            dg = dgt.empty(n, x.device).fill_(-1)
            y = fn(x, *layer, bits, 128, rscale=rscale, out_swiglu_digits=dg, **kw)
            for b in (2, 4):
                xd, xg = dgt.views(dg, b)
                rd, rg = dgt.x_digits(y, b, swiglu=True)
                diff = (_xi(xd) - _xi(rd)).abs()
                assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (fn, bits, kw, b)
                assert torch.equal(xg[:, 0], rg[:, 0]), (fn.__name__, bits, kw, b)
        assert not _workspace(x.device, 1, 1)[1].any(), "group counters left at zero"


# ---- CUDA ----------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
def test_cuda_digits():
    check_digits("cuda")
    check_digits_epilogue("cuda", 5120, 5120)
    check_digits_epilogue("cuda", 1024, 17408)


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n,k", [(5120, 5120), (17408, 5120), (5120, 17408), (1024, 512)])
def test_cuda_gemv_i8(bits, n, k):
    """== the naive reference (x through its digits: ~1e-3 relative), split-K and not, early
    weights and not, SwiGLU x, the norm's row scale."""
    layer = _layer(n, k, bits, n + k + bits)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    ref = naive_quant_matmul(x.float(), *layer, bits, 128, k)

    def rel(y, r):
        return ((y.float() - r).norm() / r.norm()).item()

    engine_cfg = gi.config(bits, n, k)  # the engine's, SHAPE_CONFIG's tiles of 4 reps included
    for kw in ({}, {"splits": 1}, {"early": False, "waves": 8.0}, {"maxnreg": None},
               engine_cfg):
        y = gi.gemv_i8(x, *layer, bits, 128, **kw)
        assert y.dtype == x.dtype and rel(y, ref) < 4e-3, (kw, rel(y, ref))
    gu = torch.randn(1, 2 * k, device="cuda").to(torch.bfloat16)
    xs = (torch.nn.functional.silu(gu[:, :k].float()) * gu[:, k:].float()).to(torch.bfloat16)
    y = gi.gemv_i8(gu, *layer, bits, 128, swiglu=True)
    assert rel(y, naive_quant_matmul(xs.float(), *layer, bits, 128, k)) < 4e-3
    ss = torch.rand(7, device="cuda") * k
    y = gi.gemv_i8(x, *layer, bits, 128, rscale=(ss, 1e-6))
    assert rel(y, ref * torch.rsqrt(ss.sum() / k + 1e-6)) < 4e-3
    r, w = (torch.randn(1, n, device="cuda").to(torch.bfloat16) for _ in range(2))
    for kw in ({}, {"splits": 1}, engine_cfg):  # the residual epilogue (split-K's last
        # program and not)
        tiles = gi.tiles(n, kw.get("reps", 2))
        xs, ss = torch.empty_like(r), torch.full((tiles,), float("nan"), device="cuda")
        h = gi.gemv_i8(x, *layer, bits, 128, residual=(r, w, xs, ss), **kw)
        href = (ref.to(torch.bfloat16).float() + r.float()).to(torch.bfloat16).float()
        assert rel(h, href) < 4e-3
        assert torch.equal(xs, (h.float() * w.float()).to(torch.bfloat16))
        assert torch.allclose(ss.sum(), (h.float() ** 2).sum(), rtol=1e-4)
    digits = gi.x_digits(x, bits)  # shared by two GEMVs
    assert torch.equal(gi.gemv_i8(x, *layer, bits, 128, digits=digits),
                       gi.gemv_i8(x, *layer, bits, 128))


@gpu
def test_cuda_engine_i8_path(monkeypatch):
    """VOLUNDR_QUANT_GEMV=i8: quant_matmul (plain, SwiGLU), quant_matmul_rscaled and
    quant_matmul_residual_norm take gemv_i8 and agree with gemv_tc's results to the digits'
    precision; a small 4-bit weight stays on gemv_tc."""
    from volundr.kernels.quant import engine

    n, k, bits = 5120, 5120, 3
    layer = _layer(n, k, bits, 7)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    gu = torch.randn(1, 2 * k, device="cuda").to(torch.bfloat16)
    ss = torch.rand(5, device="cuda") * k
    r, w = (torch.randn(1, n, device="cuda").to(torch.bfloat16) for _ in range(2))

    def run():
        h, xw, hs, _ = engine.quant_matmul_residual_norm(gu, r, w, *layer, bits, 128,
                                                         swiglu=True)
        return (engine.quant_matmul(x, *layer, bits, 128),
                engine.quant_matmul(gu, *layer, bits, 128, swiglu=True),
                engine.quant_matmul_rscaled(x, ss, 1e-6, *layer, bits, 128), h, xw,
                hs.sum().reshape(1, 1))

    monkeypatch.setattr(engine, "GEMV_PATH", "tc")
    tc = run()
    monkeypatch.setattr(engine, "GEMV_PATH", "i8")
    called = []
    monkeypatch.setattr(gi, "x_digits", lambda *a, _f=gi.x_digits, **k: called.append(1)
                        or _f(*a, **k))
    i8 = run()
    assert len(called) == 4
    for a, b in zip(tc, i8):
        assert ((a.float() - b.float()).norm() / a.float().norm()).item() < 4e-3
    small = _layer(n, k, 4, 8)  # 4-bit below I8_MIN_WEIGHTS_4BIT: gemv_tc (no digits)
    y = engine.quant_matmul(x, *small, 4, 128)
    assert len(called) == 4
    assert torch.equal(y, engine.gemv_tc.gemv_tc(x, *small, 4, 128, **engine.tc_config(4, n, k)))


@gpu
def test_cuda_engine_digits_epilogue(monkeypatch):
    """VOLUNDR_I8_DIGITS_EPILOGUE=1: quant_matmul_residual_norm returns x's digits (gemv_i8's
    epilogue, and gemv_tc's with KDA's gated norm) and quant_matmul_rscaled reads them instead
    of a digits launch, with the result of the launch's digits; quant_mlp_i8 runs an MLP
    without one."""
    from volundr.kernels.quant import engine

    monkeypatch.setattr(engine, "GEMV_PATH", "i8")
    monkeypatch.setattr(engine, "DIGITS_EPILOGUE", True)
    n, k = 5120, 17408
    down, up = _layer(n, k, 2, 11), _layer(15680, n, 4, 12)
    gu = torch.randn(1, 2 * k, device="cuda").to(torch.bfloat16)
    r, w = (torch.randn(1, n, device="cuda").to(torch.bfloat16) for _ in range(2))
    h, xw, ss, dg = engine.quant_matmul_residual_norm(gu, r, w, *down, 2, 128, swiglu=True)
    assert dg is not None
    called = []
    monkeypatch.setattr(gi, "x_digits", lambda *a, _f=gi.x_digits, **kw: called.append(1)
                        or _f(*a, **kw))
    y = engine.quant_matmul_rscaled(xw, ss[0], 1e-6, *up, 4, 128, dg)
    assert not called
    ref = engine.quant_matmul_rscaled(xw, ss[0], 1e-6, *up, 4, 128)
    assert called and ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3
    o = _layer(n, n, 4, 13)  # gemv_tc with the gated norm's scales as the producer
    gs = torch.rand(n // 128, 4, device="cuda") * 128
    x = torch.randn(1, n, device="cuda").to(torch.bfloat16)
    h, xw, ss, dg = engine.quant_matmul_residual_norm(x, r, w, *o, 4, 128, gscale=(gs, 1e-6))
    xd, xg = engine.digits.views(dg, 3)
    rd, rg = gi.x_digits(xw, 3)
    assert (_xi(xd) - _xi(rd)).abs().max() <= 1 and torch.equal(xg[:, 0], rg[:, 0])
    # an MLP on gemv_i8 with no digits launch (gate_up's epilogue writes the down projection's)
    # == its two GEMVs through the engine's single paths
    gate_up, down = (*_layer(4096, n, 3, 14), 3, 128), (*_layer(n, 2048, 2, 15), 2, 128)
    called.clear()
    h1, xw1, ss1, dg1 = engine.quant_mlp_i8(xw, ss[0], 1e-6, dg, gate_up, down, r, w)
    assert not called and dg1 is not None
    gu = engine.quant_matmul_rscaled(xw, ss[0], 1e-6, *gate_up, dg)
    h2, xw2, ss2, dg2 = engine.quant_matmul_residual_norm(gu, r, w, *down, swiglu=True)
    assert len(called) == 1  # the SwiGLU digits' launch
    for a, b in ((h1, h2), (xw1, xw2), (ss1, ss2)):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3


if __name__ == "__main__":
    if sys.argv[1:] == ["digits"]:
        check_digits("cpu")
        check_digits_epilogue("cpu")
        print("digits ok")

"""Every Triton kernel the engine launches compiles for the H200 (sm_90), on a machine without a
GPU: the kernels' own wrappers run on CPU tensors under a stand-in driver that reports an sm_90
target, and each launch compiles (warm-up) instead of running.

Why: TRITON_INTERPRET=1 (the CPU correctness tests) accepts code the compiler refuses (e.g. a
module global that is not a constexpr), and device time is scarce: a kernel that does not
compile should fail here, not in a GPU session. Outputs are never looked at; this checks
compilation only (a subprocess, so the stand-in driver never reaches other tests).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

SMS = 132  # the H200's SM count, for the wrappers that size grids from it


def _install_fake_driver() -> list[str]:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, jit

    class Sm90Driver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    driver.set_active(Sm90Driver())
    compiled: list[str] = []
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(self.__name__)
        if kwargs.get("launch_pdl"):
            PDL_PTX.append((self.__name__, kernel.asm["ptx"]))
        if self.__name__ in ("gemv_tc_kernel", "gemm_tc_kernel", "gemv_chain_kernel",
                             "gemv_i8_kernel", "gemv_i8_rows_kernel"):
            TC_TTGIR.append((self.__name__, kernel.asm["ttgir"]))
        return kernel

    jit.JITFunction.run = compile_only
    return compiled


PDL_PTX: list[tuple[str, str]] = []  # (name, PTX) of each kernel launched with PDL
TC_TTGIR: list[tuple[str, str]] = []  # (name, TTGIR) of each tensor-core GEMV / GEMM compile
FRAGMENT = ("sizePerThread = [1, 1, 1, 4]", "threadsPerWarp = [4, 8, 1, 1]")


def fragment_layout_errors(kernels: list[tuple[str, str]]) -> list[str]:
    """The tensor-core kernels' inline PTX (pack = 4: a lane's 4 words / 4 outputs) is right
    only on the mma fragment layout (gemv_tc.py's docstring: 4 consecutive elements per lane,
    lane = 4 quad + c); Triton picks layouts from the loads' alignment, and a ragged N once
    gave gemm_tc a 2-wide one (wrong results on the H200). Read off the TTGIR of one-warp
    compiles: every pack-4 inline asm produces tensors of that layout."""
    errors = []
    for name, ttgir in kernels:
        layouts = dict(re.findall(r"^#(\w+) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M))
        for line in ttgir.splitlines():
            if "elementwise_inline_asm" not in line or "packed_element = 4" not in line:
                continue
            for lay in re.findall(r"tensor<4x\d+x\d+x4x(?:f32|i32), #(\w+)>",
                                  line.split("->")[-1]):
                if not all(f in layouts.get(lay, "") for f in FRAGMENT):
                    errors.append(f"{name}: inline asm on #{lay} = {layouts.get(lay)}")
    return sorted(set(errors))


def pdl_order_errors(kernels: list[tuple[str, str]]) -> list[str]:
    """kernels/pdl.py's rule, read off the PTX of each PDL-launched kernel: it triggers, and it
    waits before its first global store or atomic (the wait sits at the top, so the text order
    is the execution order there)."""
    errors = []
    for name, ptx in kernels:
        wait = ptx.find("griddepcontrol.wait")
        if "griddepcontrol.launch_dependents" not in ptx or wait < 0:
            errors.append(f"{name}: no trigger or no wait")
            continue
        # instructions only: "red." also ends "st.shared." (a layout change through shared
        # memory may come before the wait)
        first = re.search(r"(?<![\w.])(st\.global|atom\.|red\.)", ptx)
        if first and first.start() < wait:
            errors.append(f"{name}: a global store or atomic before griddepcontrol.wait")
    return errors


def chain_errors(ptxs: list[str]) -> list[str]:
    """The GEMV chain's PTX (kernels/grid_sync.py): PDL's trigger and wait, a release arrive
    and an acquire poll per barrier, and the reads of earlier stages' outputs past L1."""
    need = ("griddepcontrol.launch_dependents", "griddepcontrol.wait",
            "atom.global.gpu.release.add", "ld.global.gpu.acquire", "ld.global.cg")
    if os.environ.get("VOLUNDR_GRID_BACKOFF_NS", "0") != "0":  # the polls' backoff
        need += ("nanosleep.u32",)
    if not ptxs:
        return ["gemv_chain_kernel: not compiled with PDL"]
    return [f"gemv_chain_kernel: no {n}" for ptx in ptxs for n in need if n not in ptx]


def compile_all() -> list[str]:
    compiled = _install_fake_driver()
    import volundr.kernels.attention.decode as decode
    import volundr.kernels.quant.gemv as gemv
    from volundr.kernels.attention import cache as attn_cache
    from volundr.kernels.attention import engine as attn
    from volundr.kernels.attention import prefill
    from volundr.kernels.engram.lookup import embedding_lookup, engram_lookup
    from volundr.kernels.kda import engine as kda
    from volundr.kernels.norm.engine import rms_norm, rms_norm_gated, swiglu
    from volundr.kernels.quant import engine as quant
    from volundr.kernels.quant import gemv_chain
    from volundr.kernels.quant.fit import minmax_quant
    from volundr.kernels.quant.pack import pack_scale_zero, to_kernel_layout

    decode._num_sms = gemv._num_sms = gemv_chain._num_sms = lambda *_: SMS
    bf = torch.bfloat16

    # norms and SwiGLU
    x = torch.randn(4, 5120, dtype=bf)
    rms_norm(x, x[0], 1e-6)
    rms_norm(x, x[0], 1e-6, x)
    h = torch.randn(4, 40, 128, dtype=bf)
    rms_norm_gated(h, h[0, 0], h, 1e-6)
    swiglu(x, x)

    # lookups from host tables
    ids = torch.randint(0, 100, (4, 3))
    embedding_lookup(ids, torch.randn(100, 5120, dtype=bf), torch.empty(4, 5120, dtype=bf))
    z8 = torch.zeros(8, dtype=torch.long)
    engram_lookup(ids, torch.randn(800, 256, dtype=bf), z8, z8 + 100,
                  torch.full((8,), 2, dtype=torch.int32), z8 + 1,
                  torch.empty(4, 8 * 256, dtype=bf))

    # paged attention: store, decode (1 token each), prefill (varlen); bf16 caches, then fp8
    # (the engine's paths: store, default decode, prefill desc / phased / paged)
    # (on CPU tensors the wrapper assumes 4 SMs: one sequence is what makes the decode split)
    for lens, kdt in [([1], bf), ([5, 40], bf), ([1], attn_cache.FP8),
                      ([5, 40], attn_cache.FP8)]:
        kc = torch.zeros(64, 16, 2, 128, dtype=kdt)
        vc = torch.zeros_like(kc)
        n, t = len(lens), sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        q = torch.randn(t, 40, 128, dtype=bf)
        kv = torch.randn(t, 2, 128, dtype=bf)
        attn.store_kv(kv, kv, kc, vc, torch.arange(t))
        tables = torch.arange(n * 4, dtype=torch.int32).view(n, 4)
        ctx = torch.tensor([60] * n, dtype=torch.int32)
        # a long max context: the decode splits over the KV length (split + merge kernels)
        attn.paged_attention(q, kc, vc, tables, cu, ctx, 0.088, max(lens), 8192)
        if kdt != bf:
            if max(lens) > 1:
                kn, vn = kv, kv.clone()
                for impl in ("desc", "phased", "paged"):
                    prefill.paged_prefill_attention(q, kc, vc, tables, cu, ctx, 0.088,
                                                    max(lens), kn, vn, impl=impl)
            continue
        if max(lens) == 1:  # the split kernel's table entries in order / only a tile ahead;
            for variant in (dict(early_idx=False, num_stages=5),
                            dict(early_idx=False, bt_ahead=True),
                            dict(partial_dtype=torch.bfloat16)):  # (bf16 partials too)
                decode.paged_decode_attention(q, kc, vc, tables, cu, ctx, 0.088, 8192,
                                              **variant)
            # every KV head in one program, at perf/kernels/bench_attention.py's configs
            for bn, stages in ((32, 4), (16, 6)):
                decode.paged_decode_attention(q, kc, vc, tables, cu, ctx, 0.088, 8192,
                                              block_n=bn, num_warps=8, num_stages=stages,
                                              min_split=128, all_heads=True)
        # prefill's two-phase kernel (prefill_phased.py): the new tokens' K/V through TMA
        # descriptors (k, v column slices of a fused projection, as in the engine) or gathered;
        # the configs perf/kernels/bench_attention.py times (shared memory checked on the GPU)
        if max(lens) > 1:
            qkv = torch.randn(t, 44, 128, dtype=bf)
            kn, vn = qkv[:, 40:42], qkv[:, 42:44]
            for impl, cfg in [("desc", {}), ("desc", dict(block_n=64, num_stages=4)),
                              ("desc", dict(warp_specialize=True, num_stages=2)),
                              ("phased", {})]:
                prefill.paged_prefill_attention(q, kc, vc, tables, cu, ctx, 0.088, max(lens),
                                                kn, vn, impl=impl, **cfg)

    # KDA: conv, recurrent (decode and short varlen), chunked prefill (every stage-1
    # implementation, the sub one in two launches too); raw gates in the kernels
    from volundr.kernels.kda import chunk

    H, K = 40, 128
    state = torch.zeros(6, H, K, K)
    modes = [("fused", False), ("sub", False), ("sub", True), ("split", False)]
    for lens, (mode, split) in zip(([1, 1, 1], [3, 2], [100, 70], [100, 70], [100, 70],
                                    [100, 70]), [modes[0]] * 3 + modes[1:]):
        chunk.CONFIG["intra"], chunk.CONFIG["sub_split"] = mode, split
        n, t = len(lens), sum(lens)
        cu_list = [0] + torch.tensor(lens).cumsum(0).tolist()
        cu = torch.tensor(cu_list, dtype=torch.int32)
        slots = torch.arange(n)
        qkv = torch.randn(t, 3 * H * K, dtype=bf)
        qkv = kda.causal_conv(qkv, torch.randn(3 * H * K, 4, dtype=bf),
                              torch.zeros(6, 3 * H * K, 3, dtype=bf), slots, cu, "silu")
        q, k, v = qkv.view(t, 3, H, K).unbind(1)
        g, beta = torch.randn(t, H, K, dtype=bf), torch.randn(t, H, dtype=bf)
        kda.kda_mixer(q, k, v, g, beta, state, slots, cu, cu_list, K ** -0.5,
                      A_log=torch.zeros(H, dtype=bf), dt_bias=torch.zeros(H * K, dtype=bf))
    # the decode step in one launch (conv + KDA): qkv a column slice of a wider projection,
    # beta a column slice
    for n in (3, 16):
        wide = torch.randn(n, 3 * H * K + 64, dtype=bf)
        kda.kda_decode(wide[:, :3 * H * K], torch.randn(3 * H * K, 4, dtype=bf),
                       torch.zeros(16, 3 * H * K, 3, dtype=bf), torch.randn(n, H, K, dtype=bf),
                       torch.randn(n, H + 8, dtype=bf)[:, 8:], torch.zeros(16, H, K, K),
                       torch.arange(n), K ** -0.5, torch.zeros(H, dtype=bf),
                       torch.zeros(H * K, dtype=bf))
    # with the gated output norm's elementwise part (the gate a column slice)
    kda.kda_decode(wide[:1, :3 * H * K], torch.randn(3 * H * K, 4, dtype=bf),
                   torch.zeros(16, 3 * H * K, 3, dtype=bf), torch.randn(1, H, K, dtype=bf),
                   torch.randn(1, H + 8, dtype=bf)[:, 8:], torch.zeros(16, H, K, K),
                   torch.arange(1), K ** -0.5, torch.zeros(H, dtype=bf),
                   torch.zeros(H * K, dtype=bf),
                   gated=(torch.randn(1, 2 * H * K, dtype=bf)[:, H * K:].view(1, H, K),
                          torch.ones(K, dtype=bf)))
    # a speculative check's conv + KDA (2 sequences x 3 rows, the second a padding one) and its
    # commit, one launch each
    from volundr.kernels.kda.rows import kda_rows
    wide = torch.randn(6, 3 * H * K + 64, dtype=bf)
    fz = torch.randn(6, 2 * H * K, dtype=bf)
    rows_args = (wide[:, :3 * H * K], torch.randn(3 * H * K, 4, dtype=bf),
                 torch.zeros(16, 3 * H * K, 3, dtype=bf), fz[:, :H * K].view(6, H, K),
                 torch.randn(6, H + 8, dtype=bf)[:, 8:], torch.zeros(16, H, K, K),
                 torch.tensor([5, -1, -1, -1]), torch.tensor([0, 3, 3, 3, 6], dtype=torch.int32),
                 K ** -0.5, torch.zeros(H, dtype=bf), torch.zeros(H * K, dtype=bf))
    kda_rows(*rows_args)
    kda_rows(*rows_args, update=True)
    kda_rows(*rows_args, gated=(fz[:, H * K:].view(6, H, K), torch.ones(K, dtype=bf)))

    # mixed-bit matmuls: every path of the dispatch at every width, the tensor-core paths included
    def layer(n: int, bits: int, g: int = 128) -> tuple[torch.Tensor, ...]:
        """qa, qb, sz of a random [n, 1024] linear in the kernel layout."""
        qw, s, zr = minmax_quant(torch.randn(n, 1024) / 32, bits, g)
        return *to_kernel_layout(qw, bits, g), pack_scale_zero(s, zr)

    for bits in (2, 3, 4):
        qa, qb, sz = layer(256, bits)
        for m in (1, 16, 64, 256):
            quant.quant_matmul(torch.randn(m, 1024, dtype=bf), qa, qb, sz, bits, 128)
        paths = (quant.GEMV_PATH, quant.GEMM16_PATH, quant.TC_MIN_DIM)
        quant.GEMV_PATH, quant.GEMM16_PATH, quant.TC_MIN_DIM = "tc", "tc", 0
        for m in (1, 4, 16):  # the opt-in tensor-core GEMV (M = 1) and GEMM (2 <= M <= 16)
            quant.quant_matmul(torch.randn(m, 1024, dtype=bf), qa, qb, sz, bits, 128)
            # with the MLP's SwiGLU in the x loads (x = the gate_up output)
            quant.quant_matmul(torch.randn(m, 2048, dtype=bf), qa, qb, sz, bits, 128,
                               swiglu=True)
        quant.GEMV_PATH = "i8"  # the integer tensor-core GEMV: plain, SwiGLU, the norm's scale
        quant.quant_matmul(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128)
        quant.quant_matmul(torch.randn(1, 2048, dtype=bf), qa, qb, sz, bits, 128, swiglu=True)
        assert quant.quant_matmul_rscaled(torch.randn(1, 1024, dtype=bf), torch.rand(8), 1e-6,
                                          qa, qb, sz, bits, 128) is not None
        rows_, quant.I8_ROWS = quant.I8_ROWS, 16  # gemv_i8_rows (opt-in): 2 and 5 rows of x
        quant.quant_matmul(torch.randn(2, 1024, dtype=bf), qa, qb, sz, bits, 128)
        quant.quant_matmul(torch.randn(5, 2048, dtype=bf), qa, qb, sz, bits, 128, swiglu=True)
        gated_ = quant.ROWS_GATED_NORM, quant.GATED_NORM_I8  # the head scale in x's digits
        quant.ROWS_GATED_NORM = quant.GATED_NORM_I8 = True
        for m, gs in ((3, torch.rand(3, 8, 4)), (1, torch.rand(8, 4))):
            assert quant.quant_matmul_group_scaled(torch.randn(m, 1024, dtype=bf), gs, 1e-6, qa,
                                                   qb, sz, bits, 128) is not None
        quant.ROWS_GATED_NORM, quant.GATED_NORM_I8 = gated_
        fold_, quant.ROWS_FOLD = quant.ROWS_FOLD, True  # the residual norm per row (opt-in)
        u3 = torch.randn(3, 3, 1024, dtype=bf)
        r = quant.quant_matmul_residual_norm(u3[0], u3[1], u3[2, 0], *layer(1024, bits), bits,
                                             128)
        assert r is not None and r[2].shape[0] == 3
        assert quant.quant_matmul_rscaled(r[1], r[2], 1e-6, qa, qb, sz, bits, 128) is not None
        quant.ROWS_FOLD = fold_
        quant.gemv_i8_rows.gemv_i8_rows(torch.randn(5, 1024, dtype=bf), qa, qb, sz, bits, 128,
                                        prefetch=True)  # the loop-carried prefetch (a knob)
        chunked_, quant.I8_ROWS_CHUNKED = quant.I8_ROWS_CHUNKED, 48  # 20 rows: 16 + 4 (opt-in)
        assert quant._rows_chunked(torch.randn(20, 1024, dtype=bf), qa, qb, sz, bits, 128,
                                   False) is not None
        quant.I8_ROWS_CHUNKED = chunked_
        quant.I8_ROWS = rows_
        quant.gemv_i8.gemv_i8(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128,
                              early=False, splits=1)
        quant.gemv_i8.gemv_i8(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128, late=True)
        v = torch.randn(3, 1, 256, dtype=bf)  # the residual epilogue (the MLP's down_proj)
        assert quant.quant_matmul_residual_norm(torch.randn(1, 2048, dtype=bf), v[0], v[1, 0],
                                                qa, qb, sz, bits, 128, swiglu=True)
        # N = 1024: the epilogue writes x's digits (gemv_i8's and gemv_tc's, gscale), which
        # the next gemv_i8 reads
        u, big = torch.randn(3, 1, 1024, dtype=bf), layer(1024, bits)
        digits_, quant.DIGITS_EPILOGUE = quant.DIGITS_EPILOGUE, True
        h, xw, hs, dg = quant.quant_matmul_residual_norm(
            torch.randn(1, 2048, dtype=bf), u[0], u[1, 0], *big, bits, 128, swiglu=True)
        assert dg is not None and quant.quant_matmul_rscaled(xw, hs[0], 1e-6, qa, qb, sz, bits,
                                                             128, dg) is not None
        assert quant.quant_matmul_residual_norm(
            u[2], u[0], u[1, 0], *big, bits, 128, gscale=(torch.rand(8, 4), 1e-6))[3] is not None
        if bits != 4:  # an MLP with its SwiGLU digits from gate_up's epilogue (4-bit: gemv_tc)
            r = quant.quant_mlp_i8(xw, hs[0], 1e-6, dg, (*layer(2048, bits), bits, 128),
                                   (*big, bits, 128), u[0], u[1, 0])
            assert r is not None and r[3] is not None
        quant.gemv_tc.gemv_tc(torch.randn(1, 1024, dtype=bf), *layer(2048, bits), bits, 128,
                              reps=2, out_swiglu_digits=quant.digits.empty(1024, "cpu"))
        quant.DIGITS_EPILOGUE = digits_
        quant.GEMV_PATH = "tc"
        for m in (1, 4):  # two stacked linears on two inputs (KDA's f_b, g_b)
            quant.quant_matmul_grouped(torch.randn(m, 2, 1024, dtype=bf), qa, qb, sz, bits, 128)
        # the set loop pipelined through shared memory (cp.async; opt-in config)
        quant.gemv_tc.gemv_tc(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128, reps=1,
                              splits=1, stages=2)
        quant.gemm_tc.gemm_tc(torch.randn(16, 1024, dtype=bf), qa, qb, sz, bits, 128, reps=1,
                              splits=1, stages=2)
        # the words and scales through TMA descriptors (the fragment layout check below)
        quant.gemv_tc.gemv_tc(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128, reps=2,
                              stages=2, tma=True)
        # whole sets of weights before the PDL wait
        quant.gemv_tc.gemv_tc(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128, reps=1,
                              splits=1, early=4)
        # per-group scales (KDA's gated output norm; the sums of squares come from KDA)
        quant.gemv_tc.gemv_tc(torch.randn(1, 1024, dtype=bf), qa, qb, sz, bits, 128, reps=1,
                              gscale=(torch.rand(8, 4), 1e-6))
        # a ragged N (not a multiple of the tile, nor of 16), 1 and 2 batch tiles; G = 64
        for g in (128, 64) if bits == 4 else (128,):
            ragged = layer(200, bits, g)
            for m in (1, 5, 12):
                tc = quant.gemv_tc.gemv_tc if m == 1 else quant.gemm_tc.gemm_tc
                tc(torch.randn(m, 1024, dtype=bf), *ragged, bits, g, reps=1)
        # dependent GEMVs in one persistent launch (gemv_chain.py): an MLP (gate_up with the
        # norm's scale, down with the SwiGLU and a residual epilogue), through the engine; a
        # layer's tail (o_proj first), with the L2 prefetch before each barrier
        chain_, quant.GEMV_CHAIN = quant.GEMV_CHAIN, True
        up, dn, o = layer(2048, bits), layer(1024, bits), layer(1024, 4)  # K = 1024 each
        v = torch.randn(3, 1, 1024, dtype=bf)
        assert quant.quant_mlp_chain(v[0], torch.rand(8), 1e-6, (*up, bits, 128),
                                     (*dn, bits, 128), v[1], v[2, 0])
        quant.GEMV_CHAIN = chain_
        h0, xw0, xw1, h1 = (torch.empty(1, 1024, dtype=bf) for _ in range(4))
        gu, ss0, ss1 = torch.empty(1, 2048, dtype=bf), torch.empty(16), torch.empty(16)
        kw = dict(group_size=128, reps=2, maxnreg=128)
        gemv_chain.gemv_chain([
            dict(x=v[0], qa=o[0], qb=o[1], sz=o[2], bits=4, out=h0,
                 residual=(v[1], v[2, 0], xw0, ss0), **kw),
            dict(x=xw0, qa=up[0], qb=up[1], sz=up[2], bits=bits, out=gu, rscale=(ss0, 1e-6),
                 **kw),
            dict(x=gu, qa=dn[0], qb=dn[1], sz=dn[2], bits=bits, out=h1, swiglu=True,
                 residual=(h0, v[2, 0], xw1, ss1), **kw)], prefetch=True)
        fold, quant.NORM_FOLD = quant.NORM_FOLD, True  # residual add + RMSNorm in the GEMV
        v = torch.randn(3, 1, 1024, dtype=bf)
        assert quant.quant_matmul_rms_norm(v[0], v[1], v[2, 0], 1e-6, qa, qb, sz, bits, 128)
        quant.NORM_FOLD = fold
        quant.GEMV_PATH, quant.GEMM16_PATH, quant.TC_MIN_DIM = paths
    return compiled


@pytest.mark.parametrize("pdl", ["0", "1", "1+prefetch+top+early"])
def test_kernels_compile_for_sm90(pdl):
    """pdl=1: programmatic dependent launch (volundr.kernels.pdl; the default on sm_90, where
    the GEMVs trigger late and load their first weights early), here without the early loads;
    then with the GEMVs' L2 prefetches (off by default), top trigger and early loads, and the
    GEMV chain's barrier polls with a backoff."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", VOLUNDR_PDL=pdl[0],
               VOLUNDR_PDL_PREFETCH="1" if "prefetch" in pdl else "0",
               VOLUNDR_PDL_TRIGGER="top" if "top" in pdl else "late",
               VOLUNDR_PDL_EARLY="4:2,3:2,2:1" if "early" in pdl else "0",
               VOLUNDR_GRID_BACKOFF_NS="200" if "early" in pdl else "0")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    names = set(r.stdout.split())
    expected = {"_rms_norm_kernel", "_rms_norm_gated_kernel", "_swiglu_kernel", "_lookup_kernel",
                "_store_kv_kernel", "_decode_split_kernel", "_decode_split_heads_kernel",
                "_decode_merge_kernel",
                "_prefill_kernel", "_prefill_phased_kernel", "_fused_recurrent_kda_kernel",
                "_conv_seq_kernel", "_kda_decode_kernel", "_kda_rows_kernel",
                "_chunk_kda_fwd_kernel", "_chunk_kda_intra_kernel",
                "_chunk_kda_intra_sub_kernel", "_kda_intra_a_kernel",
                "quant_matmul_kernel",
                "dequant_kernel", "gemv_tc_kernel", "gemv_chain_kernel", "gemv_i8_kernel",
                "gemv_i8_rows_kernel", "_digits_kernel"}
    assert expected <= names, f"not compiled: {expected - names}"


if __name__ == "__main__":
    print(" ".join(sorted(set(compile_all()))))
    bad = fragment_layout_errors(TC_TTGIR)
    if len(TC_TTGIR) < 20 or bad:
        sys.exit(f"tensor-core kernels off the fragment layout ({len(TC_TTGIR)} compiles): {bad}")
    if os.environ.get("VOLUNDR_PDL") == "1":
        names = {n for n, _ in PDL_PTX}
        # the chain's stage-0 item loop is laid out with its tail above its head: text order
        # is not execution order there (its waits come first by construction, gemv_chain.py)
        errors = pdl_order_errors([k for k in PDL_PTX if k[0] != "gemv_chain_kernel"])
        errors += chain_errors([ptx for n, ptx in PDL_PTX if n == "gemv_chain_kernel"])
        if len(names) < 10 or errors:  # GEMVs, norms, SwiGLU, conv, KDA decode, attention
            sys.exit(f"PDL kernels {sorted(names)}: {errors}")


def test_pdl_order_check_catches_a_store_before_the_wait():
    good = "griddepcontrol.launch_dependents;\ngriddepcontrol.wait;\nld.global\nst.global"
    bad = "griddepcontrol.launch_dependents;\nst.global.b32\ngriddepcontrol.wait;"
    assert pdl_order_errors([("good", good)]) == []
    # a layout change through shared memory before the wait is no global store
    trig, wait = "griddepcontrol.launch_dependents;\n", "\ngriddepcontrol.wait;"
    shared = trig + "st.shared.b16 [%r60], %rs1;" + wait
    assert pdl_order_errors([("shared", shared)]) == []
    red = trig + "\tred.global.add.f32 [%rd1], %f1;" + wait
    assert pdl_order_errors([("red", red)]) != []
    assert pdl_order_errors([("bad", bad)]) == ["bad: a global store or atomic before "
                                               "griddepcontrol.wait"]
    assert pdl_order_errors([("none", "st.global")]) == ["none: no trigger or no wait"]


def test_early_weights_setting_parses():
    """VOLUNDR_PDL_EARLY: blocks of weights each GEMV bit width loads before the PDL wait."""
    from volundr.kernels.pdl import parse_early

    assert parse_early("0") == {} == parse_early("") and parse_early("1") == {4: 1}
    assert parse_early("3") == {4: 3}
    assert parse_early("4:2,3:2") == {4: 2, 3: 2} == parse_early("4:2/3:2/2:0")

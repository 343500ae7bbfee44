"""Paged attention / KV store Triton kernels == naive references on fresh random inputs.

CPU: the kernels run under TRITON_INTERPRET=1 in a subprocess (this file run as a script), so
the variable never reaches other test modules. The interpreter computes bf16 tl.dot on the raw
uint16 bits (Triton 3.6), so CPU attention checks use fp16/fp32, which run the same kernel code;
bf16 is checked on CUDA at Volundr-32B shapes (40 q heads, 2 KV heads, head_dim 128).
fp8 (e4m3) caches: on the CPU with K/V on the fp8 grid (the interpreter rounds wrongly across
a binade, cache.fp8_round), so every kernel must reproduce the cache's values exactly; on CUDA
also K/V off the grid, rounded by store_kv and by prefill's read of the new tokens.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from interpreted import run_interpreted  # (tests/ is on the path)

from volundr.kernels.attention.cache import FP8
from volundr.kernels.attention.naive import naive_paged_attention, naive_store_kv

CUDA = torch.cuda.is_available()


def make_paged(q_lens, ctx_lens, H, KVH, D, BS, dtype, device, gen, kv_dtype=None):
    """Random ragged batch over a paged cache (of kv_dtype, None: dtype) with shuffled
    (non-contiguous) block tables."""
    N = len(q_lens)
    nblk = [(c + BS - 1) // BS for c in ctx_lens]
    max_blocks = max(nblk) + 1
    num_blocks = sum(nblk) + 7
    kv_dtype = kv_dtype or dtype
    kc = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(kv_dtype).to(device)
    vc = torch.randn(num_blocks, BS, KVH, D, generator=gen).to(kv_dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.full((N, max_blocks), -1, dtype=torch.int32)  # unused entries: never read
    i = 0
    for n, b in enumerate(nblk):
        bt[n, :b] = perm[i:i + b].int()
        i += b
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, D, generator=gen).to(dtype).to(device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return q, kc, vc, bt.to(device), cu.to(device), ctx.to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output (unwritten or NaN)"
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def new_kv(kc, vc, bt, cu, ctx, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K/V [T, KVH, D] read back from the cache (what store_kv stored), in
    dtype (None: the cache's), as column slices of one wider buffer: strided rows, like the
    engine's split of the fused QKV."""
    BS, KVH, D = kc.shape[1:]
    T = int(cu[-1])
    kv = torch.zeros(T, 3 * KVH * D, dtype=dtype or kc.dtype, device=kc.device)
    k = kv[:, KVH * D:2 * KVH * D].view(T, KVH, D)
    v = kv[:, 2 * KVH * D:].view(T, KVH, D)
    for n in range(len(cu) - 1):
        s, e, c = int(cu[n]), int(cu[n + 1]), int(ctx[n])
        pos = torch.arange(c - (e - s), c, device=kc.device)
        page, row = bt[n, pos // BS].long(), pos % BS
        k[s:e], v[s:e] = kc[page, row].to(k.dtype), vc[page, row].to(v.dtype)
    return k, v


def check_attention(q_lens, ctx_lens, H, KVH, D, BS, dtype, device, seed, **kw) -> None:
    """kw: decode=True (the decode kernel), max_context_len, with_new (pass the new tokens'
    K/V as k_new / v_new), kv_dtype (the cache's; default dtype), any other:
    paged_prefill_attention's (no kw: the engine entry)."""
    from volundr.kernels.attention.decode import paged_decode_attention
    from volundr.kernels.attention.engine import paged_attention
    from volundr.kernels.attention.prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, bt, cu, ctx = make_paged(q_lens, ctx_lens, H, KVH, D, BS, dtype, device, gen,
                                        kw.pop("kv_dtype", None))
    scale = D ** -0.5
    ref = naive_paged_attention(q, kc, vc, bt, cu, ctx, scale)
    # max_context_len may exceed every context (a CUDA graph captured at max_model_len)
    mq, mc = max(q_lens), kw.pop("max_context_len", max(ctx_lens))
    kn, vn = new_kv(kc, vc, bt, cu, ctx, dtype) if kw.pop("with_new", False) else (None, None)
    if kw.pop("decode", False):
        out = paged_decode_attention(q, kc, vc, bt, cu, ctx, scale, mc, **kw)
    elif kw:
        out = paged_prefill_attention(q, kc, vc, bt, cu, ctx, scale, mq, kn, vn, **kw)
    else:
        out = paged_attention(q, kc, vc, bt, cu, ctx, scale, mq, mc, kn, vn)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed={seed} q_lens={q_lens} ctx={ctx_lens} {kw}: rel err {err}"


def check_store(T, KVH, D, BS, dtype, device, seed, kv_dtype=None, on_grid=False) -> None:
    """store_kv == naive_store_kv into a cache of kv_dtype (None: dtype); with an fp8 cache
    some values past +-448 (saturated); on_grid: every other value on the fp8 grid."""
    from volundr.kernels.attention.engine import store_kv

    gen = torch.Generator().manual_seed(seed)
    nb = (T + BS - 1) // BS + 3
    kv_dtype = kv_dtype or dtype
    kc = torch.randn(nb, BS, KVH, D, generator=gen).to(kv_dtype).to(device)
    vc = torch.randn(nb, BS, KVH, D, generator=gen).to(kv_dtype).to(device)
    # k, v as column slices of one fused projection: strided, like a real qkv split
    kv = torch.randn(T, 3 * KVH * D, generator=gen) * 4
    if kv_dtype == FP8:
        if on_grid:
            kv = kv.to(FP8).float()
        kv.view(-1)[torch.randperm(kv.numel(), generator=gen)[:7]] = 1000.0
        kv.view(-1)[torch.randperm(kv.numel(), generator=gen)[:7]] = -600.0
    kv = kv.to(dtype).to(device)
    k = kv[:, KVH * D:2 * KVH * D].view(T, KVH, D)
    v = kv[:, 2 * KVH * D:].view(T, KVH, D)
    slots = torch.randperm(nb * BS, generator=gen)[:T].int()
    slots[torch.randperm(T, generator=gen)[: max(1, T // 5)]] = -1  # padding tokens
    slots = slots.to(device)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    naive_store_kv(k, v, kc2, vc2, slots)
    # (fp8 tensors compare as their bytes)
    same = [torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                        b.view(torch.uint8) if b.dtype == FP8 else b)
            for a, b in ((kc, kc2), (vc, vc2))]
    assert all(same), f"seed={seed} {kv_dtype}"
    if kv_dtype == FP8:  # values past +-448 were stored saturated (T=1: the token is padding)
        stored = slots >= 0
        big = k[stored].float().abs().max().item() > 448 if stored.any() else False
        assert (kc.float().abs().max() == 448.0) == big and torch.isfinite(kc.float()).all()


# Ragged prefixes, partial last blocks, chunked prefill (q_len > 1 over a
# cached prefix), a decode row inside a prefill batch, an empty sequence.
# (q_lens, ctx_lens, (H, KVH, D, block_size))
PREFILL_CASES = [
    ([5, 1, 7], [9, 3, 7], (4, 2, 32, 4)),
    ([13, 0, 4, 22], [40, 6, 4, 23], (6, 2, 16, 8)),
    ([33], [50], (4, 1, 32, 16)),
]
# The two-phase kernel (prefill_phased.py): no prefix, several sequences, q_len not a multiple
# of BLOCK_M, prefixes not a multiple of BLOCK_N, a single new token, an empty sequence.
PHASED_CASES = [
    ([37], [37], (4, 2, 16, 4)),
    ([20, 9, 33], [20, 9, 33], (6, 2, 32, 8)),
    ([13, 0, 4, 22, 1], [40, 6, 4, 23, 17], (6, 2, 16, 8)),
]
# impl, launch config (BLOCK_M > BLOCK_N: several diagonal tiles)
PHASED_CFGS = [("desc", dict(block_m=16, block_n=8)), ("desc", dict(block_m=32, block_n=32)),
               ("phased", dict(block_m=16, block_n=8))]
# (ctx_lens, q_lens): one new token each; a q_len-0 row. Per sequence, splits of
# max(ceil(ctx / num_splits) rounded up to block_n, min_split) tokens: some sequences get fewer
# (non-empty) splits than num_splits.
DECODE_CASES = [([9, 1, 37, 16], [1, 1, 1, 1]), ([70, 5, 33], [1, 0, 1])]
# the split kernel as by default (early_idx), its table entries in order, only a tile ahead;
# every KV head in one program
DECODE_VARIANTS = [{}, dict(early_idx=False), dict(early_idx=False, bt_ahead=True),
                   dict(all_heads=True), dict(partial_dtype=torch.bfloat16)]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def run_cpu(group: str) -> None:
    """Interpreter checks at small shapes (called in a TRITON_INTERPRET=1 subprocess)."""
    for dtype in (torch.float16, torch.float32):
        if group == "prefill":
            for ql, cl, (H, KVH, D, BS) in PREFILL_CASES:
                check_attention(ql, cl, H, KVH, D, BS, dtype, "cpu", _seed(),
                                block_m=16, block_n=8)
            check_attention([6, 3], [10, 3], 4, 2, 16, 4, dtype, "cpu", _seed())  # via engine
        elif group == "phased":
            for ql, cl, (H, KVH, D, BS) in PHASED_CASES:
                for impl, cfg in PHASED_CFGS:
                    check_attention(ql, cl, H, KVH, D, BS, dtype, "cpu", _seed(), impl=impl,
                                    with_new=True, **cfg)
            check_attention([6, 3], [10, 3], 4, 2, 16, 4, dtype, "cpu", _seed(), impl="desc",
                            with_new=True, warp_specialize=True, block_m=16, block_n=8)
            # the engine's default flipped (prefill.IMPL): with k_new / v_new, and without
            # (falls back to the paged kernel)
            from volundr.kernels.attention import prefill
            impl, cfgs = prefill.IMPL, prefill.CONFIGS["desc"]
            prefill.IMPL, prefill.CONFIGS["desc"] = "desc", dict(block_m=16, block_n=8)
            for with_new in (True, False):
                check_attention([9, 3], [12, 3], 4, 2, 16, 4, dtype, "cpu", _seed(),
                                with_new=with_new)
            prefill.IMPL, prefill.CONFIGS["desc"] = impl, cfgs
        elif group == "decode":
            for cl, ql in DECODE_CASES:
                for ns in (None, 1, 3):
                    check_attention(ql, cl, 6, 2, 32, 8, dtype, "cpu", _seed(), decode=True,
                                    num_splits=ns, block_n=8, min_split=8)
                # (default early_idx) the table entries in order / only a tile ahead; every
                # KV head in one program; 16-bit partials (fp16 here: bf16's rounding is above
                # the fp16 tolerance; the CUDA test takes bf16 at bf16's)
                for variant in DECODE_VARIANTS[1:]:
                    if "partial_dtype" in variant:
                        if dtype == torch.float32:
                            continue
                        variant = dict(partial_dtype=torch.float16)
                    check_attention(ql, cl, 6, 2, 32, 8, dtype, "cpu", _seed(), decode=True,
                                    num_splits=3, block_n=8, min_split=8, **variant)
                check_attention(ql, cl, 6, 2, 32, 8, dtype, "cpu", _seed(), decode=True,
                                num_splits=1, block_n=8, all_heads=True)
            check_attention([1, 1], [50, 3], 4, 2, 16, 4, dtype, "cpu", _seed(), decode=True,
                            num_splits=4, block_n=8, min_split=16, max_context_len=1000)
            check_attention([1, 1], [20, 7], 4, 2, 16, 4, dtype, "cpu", _seed())  # via engine
        elif group == "store":
            check_store(23, 2, 16, 4, dtype, "cpu", _seed())
            check_store(23, 2, 16, 4, dtype, "cpu", _seed(), kv_dtype=FP8, on_grid=True)
        elif group == "fp8":  # fp8 caches: decode, the paged / two-phase prefill, the engine
            for cl, ql in DECODE_CASES:
                for ns, variant in ((None, {}), (3, {}), (3, DECODE_VARIANTS[1]),
                                    (1, dict(all_heads=True)), (3, dict(f16=True))):
                    if variant.get("f16") and dtype == torch.float32:
                        continue  # float16 dots: fp16's tolerance
                    check_attention(ql, cl, 6, 2, 32, 8, dtype, "cpu", _seed(), decode=True,
                                    num_splits=ns, block_n=8, min_split=8, kv_dtype=FP8,
                                    **variant)
            ql, cl, (H, KVH, D, BS) = PREFILL_CASES[1]
            check_attention(ql, cl, H, KVH, D, BS, dtype, "cpu", _seed(), block_m=16,
                            block_n=8, kv_dtype=FP8)
            ql, cl, (H, KVH, D, BS) = PHASED_CASES[2]
            for impl, cfg in PHASED_CFGS:
                check_attention(ql, cl, H, KVH, D, BS, dtype, "cpu", _seed(), impl=impl,
                                with_new=True, kv_dtype=FP8, **cfg)
            check_attention([1, 1], [20, 7], 4, 2, 16, 4, dtype, "cpu", _seed(),
                            kv_dtype=FP8)  # via engine
    if group == "store":
        check_store(9, 2, 32, 8, torch.bfloat16, "cpu", _seed())
        check_store(9, 2, 32, 8, torch.bfloat16, "cpu", _seed(), kv_dtype=FP8, on_grid=True)


@pytest.mark.parametrize("group", ["store", "prefill", "phased", "decode", "fp8"])
def test_interpreter(group):
    run_interpreted(__file__, group)


# --- CUDA, Volundr-32B shapes: 40 q heads, 2 KV heads, head_dim 128, block_size 16, bf16 ---
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([512], [512]),
    ([1000, 1, 513, 37], [1000, 4001, 2513, 117]),  # chunked prefill over cached prefixes
    ([2048, 300], [6000, 300]),
])
def test_cuda_prefill(q_lens, ctx_lens):
    check_attention(q_lens, ctx_lens, 40, 2, 128, 16, torch.bfloat16, "cuda", _seed())


@gpu
@pytest.mark.parametrize("impl", ["desc", "phased"])
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([4096], [4096]),
    ([1000, 1, 513, 37], [1000, 1, 513, 37]),  # varlen, no prefix
    ([1000, 1, 513, 37], [1000, 4001, 2513, 117]),  # chunked prefill over cached prefixes
    ([2048, 300], [6000, 300]),
])
@pytest.mark.parametrize("cfg", [{}, dict(block_n=64, num_stages=4)])
def test_cuda_prefill_phased(impl, q_lens, ctx_lens, cfg):
    check_attention(q_lens, ctx_lens, 40, 2, 128, 16, torch.bfloat16, "cuda", _seed(),
                    impl=impl, with_new=True, **cfg)


@gpu
def test_cuda_prefill_phased_matches_paged():
    """The new kernel (TMA) against the old one on the same inputs: same math, so close."""
    from volundr.kernels.attention.prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(_seed())
    q, kc, vc, bt, cu, ctx = make_paged([3000, 700], [3000, 1900], 40, 2, 128, 16,
                                        torch.bfloat16, "cuda", gen)
    kn, vn = new_kv(kc, vc, bt, cu, ctx)
    old = paged_prefill_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5, 3000, impl="paged")
    new = paged_prefill_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5, 3000, kn, vn,
                                  impl="desc")
    assert rel_err(new, old) < 1e-2


@gpu
def test_cuda_prefill_via_engine_with_new_kv():
    check_attention([800, 33], [800, 500], 40, 2, 128, 16, torch.bfloat16, "cuda", _seed(),
                    with_new=True)


@gpu
@pytest.mark.parametrize("ctx_lens", [[1], [17, 4096, 33000, 250], [70000], [5] * 16])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("variant", range(len(DECODE_VARIANTS)))
def test_cuda_decode(ctx_lens, num_splits, variant):
    """DECODE_VARIANTS[variant]: the default split kernel (indices before the PDL wait, table
    entries a tile ahead) / entries in order / only ahead / every KV head in one program /
    bfloat16 partials."""
    check_attention([1] * len(ctx_lens), ctx_lens, 40, 2, 128, 16, torch.bfloat16, "cuda",
                    _seed(), decode=True, num_splits=num_splits, **DECODE_VARIANTS[variant])


@gpu
@pytest.mark.parametrize("ctx_lens", [[40, 3000, 70000], [300] * 8])
def test_cuda_decode_graph_sized(ctx_lens):
    """Splits sized for max_model_len (as a captured CUDA graph is) on shorter contexts."""
    check_attention([1] * len(ctx_lens), ctx_lens, 40, 2, 128, 16, torch.bfloat16, "cuda",
                    _seed(), decode=True, max_context_len=262144)


@gpu
def test_cuda_decode_via_engine():
    check_attention([1, 0, 1], [3000, 40, 129], 40, 2, 128, 16, torch.bfloat16, "cuda", _seed())


@gpu
@pytest.mark.parametrize("T", [1, 16, 777])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_cuda_store(T, kv_dtype):
    """fp8: values off the grid, rounded by sm_90's conversion as torch rounds them."""
    check_store(T, 2, 128, 16, torch.bfloat16, "cuda", _seed(), kv_dtype=kv_dtype)


@gpu
@pytest.mark.parametrize("ctx_lens", [[17, 4096, 33000, 250], [70000]])
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("f16", [False, True])
def test_cuda_decode_fp8(ctx_lens, num_splits, f16):
    check_attention([1] * len(ctx_lens), ctx_lens, 40, 2, 128, 16, torch.bfloat16, "cuda",
                    _seed(), decode=True, num_splits=num_splits, kv_dtype=FP8, f16=f16)


@gpu
@pytest.mark.parametrize("impl", [None, "desc", "phased", "paged"])
def test_cuda_prefill_fp8(impl):
    """The new tokens' K/V in bf16 off the fp8 grid: store_kv rounds them into the cache, and
    the desc kernel, which reads them from k_new / v_new, must round them the same way (the
    reference reads the cache)."""
    from volundr.kernels.attention.engine import paged_attention, store_kv
    from volundr.kernels.attention.prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(_seed())
    q_lens, ctx_lens = [800, 33], [3000, 500]
    q, kc, vc, bt, cu, ctx = make_paged(q_lens, ctx_lens, 40, 2, 128, 16, torch.bfloat16,
                                        "cuda", gen, FP8)
    kn = (torch.randn(sum(q_lens), 2, 128, generator=gen) * 3).to(torch.bfloat16).cuda()
    vn = (torch.randn(sum(q_lens), 2, 128, generator=gen) * 3).to(torch.bfloat16).cuda()
    slots = torch.cat([bt[n, p // 16].long() * 16 + p % 16 for n, p in enumerate(
        torch.arange(c - ql, c, device="cuda") for ql, c in zip(q_lens, ctx_lens))])
    store_kv(kn, vn, kc, vc, slots)
    assert not torch.equal(kc.view(-1, 2, 128)[slots].float(), kn.float())  # (rounded)
    ref = naive_paged_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5)
    if impl is None:
        out = paged_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5, 800, 3000, kn, vn)
    else:
        out = paged_prefill_attention(q, kc, vc, bt, cu, ctx, 128 ** -0.5, 800, kn, vn,
                                      impl=impl)
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)


if __name__ == "__main__":
    run_cpu(sys.argv[1])

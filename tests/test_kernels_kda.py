"""KDA Triton kernels (volundr.kernels.kda) == the naive references, on fresh random inputs.

CPU: the kernels run under TRITON_INTERPRET=1 in one child process (`python THIS_FILE`): Triton
reads the variable when a kernel is decorated, so setting it in this process would leak into
other test modules. The interpreter's bf16 `tl.dot` is wrong, so CPU cases use fp32 and fp16.
GPU (skipped without CUDA): Volundr-32B shapes (H=40, K=V=128) in bf16 against the fp32
references, and against fla's `chunk_kda` / `fused_recurrent_kda` when `fla` is importable.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from volundr.kernels.kda.naive import (
    kda_gate,
    naive_causal_conv1d,
    naive_chunk_kda,
    naive_recurrent_kda,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(lens, H, K, V, dtype, device="cpu", decay=1.0, slots=None):
    """Packed inputs for sequences of `lens` tokens; q/k are strided views of one qkv buffer."""
    T, N = sum(lens), len(lens)
    qkv = torch.randn(1, T, 3, H, K, dtype=dtype, device=device)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    v = torch.randn(1, T, H, V, dtype=dtype, device=device)
    g_raw = torch.randn(1, T, H, K, device=device) * decay
    A_log = torch.rand(H, device=device) * 2 - 0.5
    dt_bias = torch.randn(H * K, device=device) * 0.5
    b_raw = torch.randn(1, T, H, device=device)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    pool = torch.randn(slots or N, H, K, V, device=device)
    idx = torch.randperm(slots or N, device=device)[:N]
    return dict(q=q, k=k, v=v, g_raw=g_raw, A_log=A_log, dt_bias=dt_bias, b_raw=b_raw, cu=cu,
                pool=pool, idx=idx, g=kda_gate(g_raw, A_log, dt_bias), beta=b_raw.sigmoid())


def reference(x, chunk_size=None):
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x["pool"][x["idx"]].clone(), output_final_state=True,
              cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=True)
    if chunk_size:
        o, s, bounds = naive_chunk_kda(*args, chunk_size=chunk_size, return_chunk_states=True, **kw)
        return o, s, torch.stack([b for seq in bounds for b in seq])
    return naive_recurrent_kda(*args, **kw)


def check_recurrent(lens, H, K, V, dtype, tol, fused_gate, device="cpu"):
    from volundr.kernels.kda import fused_recurrent_kda
    x = make(lens, H, K, V, dtype, device, slots=len(lens) + 3)
    o_ref, s_ref = reference(x)
    pool = x["pool"].clone()
    gate = dict(g=x["g_raw"], beta=x["b_raw"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True) if fused_gate else \
        dict(g=x["g"], beta=x["beta"])
    o, _, hs = fused_recurrent_kda(x["q"], x["k"], x["v"], initial_state=pool, cu_seqlens=x["cu"],
                                   ssm_state_indices=x["idx"], use_qk_l2norm_in_kernel=True,
                                   return_intermediate_states=True, **gate)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
    untouched[x["idx"]] = False
    assert torch.equal(pool[untouched], x["pool"][untouched]), "other slots were written"
    last = x["cu"][1:].long() - 1
    errs = [rel(o, o_ref), rel(pool[x["idx"]], s_ref), rel(hs[last], s_ref)]
    assert max(errs) < tol, f"recurrent {lens} {dtype}: {errs}"


def check_chunk(lens, H, K, V, dtype, tol, BT, fused_gate, decay=1.0, device="cpu"):
    from volundr.kernels.kda import chunk_kda
    x = make(lens, H, K, V, dtype, device, decay=decay, slots=len(lens) + 2)
    o_ref, s_ref, b_ref = reference(x, chunk_size=BT)
    pool = x["pool"].clone()
    gate = dict(g=x["g_raw"], beta=x["b_raw"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True) if fused_gate else \
        dict(g=x["g"], beta=x["beta"])
    o, _, hc = chunk_kda(x["q"], x["k"], x["v"], initial_state=pool, cu_seqlens=x["cu"],
                         ssm_state_indices=x["idx"], use_qk_l2norm_in_kernel=True,
                         return_chunk_states=True, chunk_size=BT, **gate)
    errs = [rel(o, o_ref), rel(pool[x["idx"]], s_ref), rel(hc, b_ref)]
    assert max(errs) < tol, f"chunk {lens} BT={BT} {dtype}: {errs}"


class _Capture:
    """Stands in for chunk._chunk_kda_fwd_kernel: records what stage 1 handed to it."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append([a.clone() for a in args[:6]])  # w, u, qg, kg, Aqk, gl
            return self.kernel[grid](*args, **kw)
        return launch


def run_intra_modes(x, BT, fused_gate, modes=("fused", "sub"), cfg=None):
    """chunk_kda once per stage-1 mode; per mode (o, pool, chunk states, stage-1 outputs).
    cfg: chunk.CONFIG entries for the runs other than "fused" (launch variants)."""
    from volundr.kernels.kda import chunk
    gate = dict(g=x["g_raw"], beta=x["b_raw"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True) if fused_gate else \
        dict(g=x["g"], beta=x["beta"])
    saved, kernel = dict(chunk.CONFIG), chunk._chunk_kda_fwd_kernel
    out = {}
    try:
        for mode in modes:
            chunk.CONFIG.update(saved, intra=mode, **((cfg or {}) if mode != "fused" else {}))
            chunk._chunk_kda_fwd_kernel = cap = _Capture(kernel)
            pool = x["pool"].clone()
            o, _, hc = chunk.chunk_kda(x["q"], x["k"], x["v"], initial_state=pool,
                                       cu_seqlens=x["cu"], ssm_state_indices=x["idx"],
                                       use_qk_l2norm_in_kernel=True, return_chunk_states=True,
                                       chunk_size=BT, **gate)
            out[mode] = (o, pool, hc, cap.seen[0])
    finally:
        chunk.CONFIG.update(saved)
        chunk._chunk_kda_fwd_kernel = kernel
    return out


def check_chunk_intra(mode, lens, H, K, V, dtype, tol, BT, fused_gate, decay=1.0, device="cpu",
                      stage_tol=None, cfg=None):
    """A stage-1 implementation (VOLUNDR_KDA_INTRA=sub or split) == the naive reference, and its
    outputs (w, u, qg, kg, Aqk, 2^G_last) == those of the fused stage 1."""
    x = make(lens, H, K, V, dtype, device, decay=decay, slots=len(lens) + 2)
    o_ref, s_ref, b_ref = reference(x, chunk_size=BT)
    out = run_intra_modes(x, BT, fused_gate, ("fused", mode), cfg)
    o, pool, hc, stage = out[mode]
    errs = [rel(o, o_ref), rel(pool[x["idx"]], s_ref), rel(hc, b_ref)]
    assert max(errs) < tol, f"{mode} chunk {lens} BT={BT} {dtype}: {errs}"
    names = ("w", "u", "qg", "kg", "Aqk", "gl")
    stage_errs = {n: rel(a, b) for n, a, b in zip(names, stage, out["fused"][3])}
    assert max(stage_errs.values()) < (stage_tol or tol), f"{mode} vs fused stage 1: {stage_errs}"


def check_conv(lens, C, W, with_state, device="cpu", dtype=torch.float32):
    from volundr.kernels.kda import causal_conv1d
    x = torch.randn(sum(lens), C, dtype=dtype, device=device)
    w = torch.randn(C, W, device=device, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    pool = torch.randn(len(lens) + 2, C, W - 1, device=device, dtype=dtype)
    idx = torch.randperm(len(lens) + 2, device=device)[:len(lens)]
    tails = pool[idx].clone() if with_state else None
    y_ref = naive_causal_conv1d(x, w, tails, cu, "silu")
    got = pool.clone()
    y = causal_conv1d(x, w, got if with_state else None, cu, idx if with_state else None, "silu")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(y, y_ref) < tol, f"conv {lens} C={C} W={W}: {rel(y, y_ref)}"
    if with_state:
        assert rel(got[idx], tails) < tol, f"conv state {lens}"


def make_ref_from_raw(x, dtype):
    """The reference for logits rounded to `dtype` (as the engine's bf16 projections give)."""
    y = dict(x, g=kda_gate(x["g_raw"].to(dtype), x["A_log"], x["dt_bias"]),
             beta=x["b_raw"].to(dtype).float().sigmoid())
    return reference(y)


def check_engine(device="cpu", dtype=torch.float32, H=2, K=32, tol=1e-4):
    """engine.kda_mixer / causal_conv (what volundr.ops calls on CUDA) == the ops' naive math."""
    from volundr.kernels.kda import engine
    for lens in ([1, 1, 1], [3, 2, 3], [40, 1, 70]):
        x = make(lens, H, K, K, dtype, device, slots=6)
        o_ref, s_ref = reference(x)
        pool = x["pool"].clone()
        cu_list = x["cu"].tolist()
        o = engine.kda_mixer(x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], pool,
                             x["idx"], x["cu"], cu_list, K ** -0.5)
        errs = [rel(o, o_ref[0]), rel(pool[x["idx"]], s_ref)]
        assert max(errs) < tol, f"engine.kda_mixer {lens}: {errs}"
        # the engine's form: gate and beta logits, activations applied in the kernels
        pool = x["pool"].clone()
        o = engine.kda_mixer(x["q"][0], x["k"][0], x["v"][0], x["g_raw"][0].to(dtype),
                             x["b_raw"][0].to(dtype), pool, x["idx"], x["cu"], cu_list,
                             K ** -0.5, A_log=x["A_log"], dt_bias=x["dt_bias"])
        ref = make_ref_from_raw(x, dtype)
        errs = [rel(o, ref[0][0]), rel(pool[x["idx"]], ref[1])]
        assert max(errs) < tol, f"engine.kda_mixer raw gates {lens}: {errs}"
        C = 3 * H * K
        xc = torch.randn(sum(lens), C, device=device, dtype=dtype)
        w = torch.randn(C, 4, device=device, dtype=dtype)
        st = torch.randn(6, C, 3, device=device, dtype=dtype)
        tails = st[x["idx"]].clone()
        y_ref = naive_causal_conv1d(xc, w, tails, x["cu"], "silu")
        y = engine.causal_conv(xc, w, st, x["idx"], x["cu"], "silu")
        assert rel(y, y_ref) < tol and rel(st[x["idx"]], tails) < tol, f"engine.causal_conv {lens}"


def make_decode(N, H, K, V, W, dtype, device, slots, pad=(), extra_cols=0):
    """One decode step's inputs in the engine's layouts: qkv a column slice of a wider projection
    (row stride C + extra_cols), beta a column slice, rows in `pad` padding (slot -1)."""
    C = 2 * H * K + H * V
    wide = torch.randn(N, C + extra_cols, dtype=dtype, device=device)
    bwide = torch.randn(N, H + 3, dtype=dtype, device=device)
    ids = torch.randperm(slots, device=device)[:N]
    ids[list(pad)] = -1
    return dict(qkv=wide[:, extra_cols // 2:extra_cols // 2 + C],
                g=torch.randn(N, H, K, dtype=dtype, device=device), beta=bwide[:, 1:1 + H],
                ids=ids)


def decode_reference(x, w, cs, pool, A_log, dt_bias, H, K, V, scale):
    """Naive conv then naive recurrent KDA on the live rows; cs and pool updated in place."""
    live = (x["ids"] >= 0).nonzero().squeeze(1)
    ids, n = x["ids"][live], live.numel()
    cu = torch.arange(n + 1, dtype=torch.int32, device=ids.device)
    tails = cs[ids].clone()
    y = naive_causal_conv1d(x["qkv"][live], w, tails, cu, "silu")
    cs[ids] = tails
    q, k = y[:, :H * K].view(1, n, H, K), y[:, H * K:2 * H * K].view(1, n, H, K)
    v = y[:, 2 * H * K:].view(1, n, H, V)
    g = kda_gate(x["g"][live], A_log, dt_bias).unsqueeze(0)
    beta = x["beta"][live].float().sigmoid().unsqueeze(0)
    o, final = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=pool[ids],
                                   output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=True)
    pool[ids] = final
    return live, o[0]


def check_decode(Ns, H, K, V, W, dtype, tol, device="cpu", steps=3, extra_cols=0, pad=(),
                 BV=None, naive=True, via_ops=False):
    """kda_decode (conv + KDA in one launch) == engine.causal_conv + engine.kda_mixer (the two
    kernels) == the naive reference, over consecutive decode steps (so the carried conv tails
    and states are checked, not only one step's output); untouched slots stay untouched and the
    arrival counters are back at zero after every launch. via_ops: ops.kda_decode with the
    kernels on every device (it takes the two kernels for convs wider than 4 or above
    engine.DECODE_FUSED_MAX_T sequences)."""
    from unittest import mock

    from volundr import ops
    from volundr.kernels.kda import decode, engine
    slots = max(Ns) + 3
    C, scale = 2 * H * K + H * V, K ** -0.5
    w = torch.randn(C, W, dtype=dtype, device=device)
    A_log = torch.rand(H, device=device) * 2 - 0.5
    dt_bias = torch.randn(H * K, device=device) * 0.5
    cs0 = torch.randn(slots, C, W - 1, dtype=dtype, device=device)
    pool0 = torch.randn(slots, H, K, V, device=device)
    for N in Ns:
        fused = [cs0.clone(), pool0.clone()]
        split = [cs0.clone(), pool0.clone()]
        ref = [cs0.clone(), pool0.clone()]
        x = make_decode(N, H, K, V, W, dtype, device, slots, pad if N > max(pad, default=-1)
                        else (), extra_cols)
        for step in range(steps):
            if step:  # new token, same sequences
                x = dict(make_decode(N, H, K, V, W, dtype, device, slots, (), extra_cols),
                         ids=x["ids"])
            args = (x["qkv"], w, fused[0], x["g"], x["beta"], fused[1], x["ids"], scale, A_log,
                    dt_bias)
            cu = torch.arange(N + 1, dtype=torch.int32, device=device)
            if via_ops:  # the kernels also for CPU tensors (the interpreter)
                with mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name)):
                    o = ops.kda_decode(*args[:7], cu, list(range(N + 1)), *args[7:])
            else:
                o = decode.kda_decode(*args, BV=BV)
                assert not decode._COUNTERS[(o.device.type, o.device.index)].any(), "counters"
            y = engine.causal_conv(x["qkv"], w, split[0], x["ids"], cu)
            q, k = y[:, :H * K].view(N, H, K), y[:, H * K:2 * H * K].view(N, H, K)
            o2 = engine.kda_mixer(q, k, y[:, 2 * H * K:].view(N, H, V), x["g"], x["beta"],
                                  split[1], x["ids"], cu, list(range(N + 1)), scale,
                                  A_log=A_log, dt_bias=dt_bias)
            live = (x["ids"] >= 0).nonzero().squeeze(1)
            what = f"decode N={N} step {step} {dtype}"
            assert torch.equal(fused[0], split[0]), f"{what}: conv state != two kernels"
            errs = [rel(o[live], o2[live]), rel(fused[1], split[1])]
            assert max(errs) < tol, f"{what} vs two kernels: {errs}"
            if not via_ops:  # (the two kernels leave padding rows' o undefined)
                assert not o[x["ids"] < 0].any(), f"{what}: padding rows' o is not 0"
            if naive:
                _, o3 = decode_reference(x, w, ref[0], ref[1], A_log, dt_bias, H, K, V, scale)
                assert torch.equal(fused[0], ref[0]), f"{what}: conv state != naive"
                errs = [rel(o[live], o3), rel(fused[1], ref[1])]
                assert max(errs) < tol, f"{what} vs naive: {errs}"


def check_decode_gated(N, H, K, V, W, dtype, tol, device="cpu", BV=None, pad=(), via_ops=False):
    """kda_decode with the gated output norm's elementwise part in its epilogue (gated=(z, w))
    == the plain kernel's o, then o w sigmoid(z) in PyTorch; its per-block sums of squares add
    up to each head's sum of o^2; both states as the plain kernel leaves them; padding rows 0.
    z is a column slice of a wider [N, 2 H V] tensor, as KDA's gate. via_ops: ops.kda_decode
    with the kernels on every device (its unfused route for W = 5). Returns (o, u, ss, z, w)."""
    from unittest import mock

    from volundr import ops
    from volundr.kernels.kda import decode
    slots, C, scale = N + 3, 2 * H * K + H * V, K ** -0.5
    w = torch.randn(C, W, dtype=dtype, device=device)
    A_log = torch.rand(H, device=device) * 2 - 0.5
    dt_bias = torch.randn(H * K, device=device) * 0.5
    cs, pool = (torch.randn(slots, C, W - 1, dtype=dtype, device=device),
                torch.randn(slots, H, K, V, device=device))
    plain = [cs.clone(), pool.clone()]
    x = make_decode(N, H, K, V, W, dtype, device, slots, pad)
    z = torch.randn(N, 2 * H * V, dtype=dtype, device=device)[:, H * V:].view(N, H, V)
    nw = (torch.rand(V, device=device) + 0.5).to(dtype)
    cu = torch.arange(N + 1, dtype=torch.int32, device=device)

    def run(st, gated):
        args = (x["qkv"], w, st[0], x["g"], x["beta"], st[1], x["ids"])
        if not via_ops:
            return decode.kda_decode(*args, scale, A_log, dt_bias, BV=BV, gated=gated)
        with mock.patch.object(ops, "_fast", lambda t, name: ops._fast_module(name)):
            return ops.kda_decode(*args, cu, list(range(N + 1)), scale, A_log, dt_bias, gated)

    o = run(plain, None)
    u, ss = run((cs, pool), (z, nw))
    assert torch.equal(cs, plain[0]) and rel(pool, plain[1]) < 1e-6, "states"
    of = o.float()
    live = x["ids"] >= 0
    u_ref = (of * nw.float() * torch.sigmoid(z.float())).to(dtype)
    assert rel(u[live], u_ref[live]) < tol, ("u", rel(u[live], u_ref[live]))
    assert ss.dtype == torch.float32 and ss.shape[:2] == (N, H)
    err = rel(ss.sum(-1)[live], of.pow(2).sum(-1)[live])
    assert err < 1e-5, ("sums of squares", err)
    if not via_ops:
        assert ss.shape[2] == -(-V // min(BV or decode.CONFIG["BV"], V)), ss.shape
        assert not u[~live].any() and not ss[~live].any(), "padding rows"
    return o, u, ss, z, nw


def check_ops_decode(N=4, H=2, K=16, V=16, W=4, pad=(1,)):
    """ops.kda_decode's CPU path (the naive composition) == the reference, padding skipped."""
    from volundr import ops
    slots, C, scale = N + 3, 2 * H * K + H * V, K ** -0.5
    w = torch.randn(C, W)
    A_log, dt_bias = torch.rand(H), torch.randn(H * K) * 0.5
    cs, pool = torch.randn(slots, C, W - 1), torch.randn(slots, H, K, V)
    cs2, pool2 = cs.clone(), pool.clone()
    x = make_decode(N, H, K, V, W, torch.float32, "cpu", slots, pad, extra_cols=6)
    cu = torch.arange(N + 1, dtype=torch.int32)
    o = ops.kda_decode(x["qkv"], w, cs, x["g"], x["beta"], pool, x["ids"], cu, list(range(N + 1)),
                       scale, A_log, dt_bias)
    live, o_ref = decode_reference(x, w, cs2, pool2, A_log, dt_bias, H, K, V, scale)
    assert torch.equal(cs, cs2) and rel(pool, pool2) < 1e-6 and rel(o[live], o_ref) < 1e-6
    assert not o[x["ids"] < 0].any()


f32, f16 = torch.float32, torch.float16
INTERPRETER_CASES = {
    "recurrent_varlen_gate_fp32": lambda: check_recurrent([3, 1, 5], 2, 32, 32, f32, 1e-5, True),
    "recurrent_decode_fp16": lambda: check_recurrent([1, 1, 1, 1], 3, 16, 32, f16, 5e-3, False),
    "chunk64_varlen_gate_fp32": lambda: check_chunk([5, 70, 33], 2, 32, 64, f32, 1e-4, 64, True),
    "chunk32_fp16": lambda: check_chunk([100], 1, 64, 32, f16, 5e-3, 32, False),
    "chunk16_huge_decay_fp32": lambda: check_chunk([1, 45], 2, 16, 16, f32, 1e-4, 16, False, 40.0),
    "sub_chunk64_varlen_gate_fp32":
        lambda: check_chunk_intra("sub", [5, 70, 33], 2, 32, 64, f32, 1e-4, 64, True),
    "sub_chunk64_fp16": lambda: check_chunk_intra("sub", [150], 1, 64, 32, f16, 5e-3, 64, False),
    "sub_chunk32_fp16": lambda: check_chunk_intra("sub", [100], 1, 64, 32, f16, 5e-3, 32, False),
    "sub_chunk16_huge_decay_fp32":
        lambda: check_chunk_intra("sub", [1, 45], 2, 16, 16, f32, 1e-4, 16, False, 40.0),
    "sub_chunk64_huge_decay_varlen_fp32":
        lambda: check_chunk_intra("sub", [130, 7, 64], 2, 32, 32, f32, 1e-4, 64, True, 40.0),
    "sub_split_chunk64_varlen_fp32":  # phases 0-2 and phase 3 as two launches
        lambda: check_chunk_intra("sub", [3, 90], 2, 32, 32, f32, 1e-4, 64, False, 5.0,
                                  cfg=dict(sub_split=True, sub_maxnreg=168, sub_maxnreg_wu=128)),
    # the two-launch stage 1 (block-row programs + block inverse): every chunk size, ragged
    # chunks, huge decays, channel blocks of 8 and 32
    "split_chunk64_varlen_gate_fp32":
        lambda: check_chunk_intra("split", [5, 70, 33], 2, 32, 64, f32, 1e-4, 64, True),
    "split_chunk64_fp16": lambda: check_chunk_intra("split", [150], 1, 64, 32, f16, 5e-3, 64,
                                                    False, cfg=dict(split_BK_a=32, split_BV=16,
                                                                    split_inv_apart=False)),
    "split_chunk32_fp16": lambda: check_chunk_intra("split", [100], 1, 64, 32, f16, 5e-3, 32,
                                                    False, cfg=dict(split_BK_a=8)),
    "split_chunk16_huge_decay_fp32":
        lambda: check_chunk_intra("split", [1, 45], 2, 16, 16, f32, 1e-4, 16, False, 40.0),
    "split_chunk64_huge_decay_varlen_fp32":
        lambda: check_chunk_intra("split", [130, 7, 64], 2, 32, 32, f32, 1e-4, 64, True, 40.0),
    # the diagonal blocks by levels of small dots in the block-row kernel (split_diag="levels"),
    # and the element-wise diagonal kernel's other launch settings
    "split_levels_chunk64_varlen_gate_fp32":
        lambda: check_chunk_intra("split", [5, 70, 33], 2, 32, 64, f32, 1e-4, 64, True,
                                  cfg=dict(split_diag="levels")),
    "split_levels_chunk16_huge_decay_fp32":
        lambda: check_chunk_intra("split", [1, 45], 2, 16, 16, f32, 1e-4, 16, False, 40.0,
                                  cfg=dict(split_diag="levels")),
    "split_elem_rolled_chunk32_huge_decay_varlen_fp16":
        lambda: check_chunk_intra("split", [130, 7, 64], 2, 32, 32, f16, 5e-3, 32, True, 40.0,
                                  cfg=dict(split_warps_d=2, split_unroll_d=False)),
    # M in 16 bit and phase 3's w / u dots in it (the default), and in fp32
    "split_m16_chunk64_huge_decay_varlen_fp16":
        lambda: check_chunk_intra("split", [130, 7, 64], 2, 32, 32, f16, 5e-3, 64, True, 40.0,
                                  cfg=dict(split_M16=True)),
    "split_m32_chunk32_fp16":  # M in fp32 (and so the w / u dots in tf32)
        lambda: check_chunk_intra("split", [5, 70, 33], 2, 32, 32, f16, 5e-3, 32, False,
                                  cfg=dict(split_M16=False, split_stages=1)),
    "conv_decode": lambda: check_conv([1, 1, 1], 48, 4, True),
    "conv_varlen": lambda: check_conv([5, 1, 2, 40], 80, 4, True),
    "conv_no_state_w3": lambda: check_conv([7, 3], 16, 3, False),
    "engine_ops": check_engine,
    # conv + KDA decode in one launch: batches 1..6, a padding row, a strided qkv, 2 or 4
    # V-block programs per head (BV < V), W = 3
    "decode_fused_fp32": lambda: check_decode([1, 3, 6], 4, 32, 32, 4, f32, 1e-5, pad=(2,),
                                              extra_cols=10, BV=8),
    "decode_fused_fp16_bv8_v16": lambda: check_decode([2, 5], 4, 32, 16, 4, f16, 5e-3, pad=(0,),
                                                      extra_cols=6, BV=8),
    "decode_fused_w3_k24": lambda: check_decode([3], 2, 24, 32, 3, f32, 1e-5, BV=16),
    # ops.kda_decode: fused (W = 2), the two kernels for W = 5 and above DECODE_FUSED_MAX_T
    "decode_ops_dispatch": lambda: [check_decode([n], 2, 16, 16, w, f32, 1e-5, steps=2,
                                                 via_ops=True, pad=(1,))
                                       for n, w in ((3, 2), (3, 5), (17, 4))],
    # with the gated output norm's elementwise part and per-block sums of squares (2 blocks
    # per head, a padding row; fp16 rounding of o before the gate); and ops' unfused route
    "decode_gated": lambda: [check_decode_gated(3, 2, 32, 16, 4, f32, 1e-5, BV=8, pad=(1,)),
                             check_decode_gated(2, 4, 32, 32, 3, f16, 2e-3, BV=16),
                             check_decode_gated(3, 2, 16, 16, 5, f32, 1e-5, via_ops=True)],
}


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", KDA_TEST_SEED=str(random.randrange(2**31)))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=600)
    res = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            res[d["case"]] = d
    assert res, f"interpreter run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return res


@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_kernels_interpreter(interpreter_results, case):
    d = interpreter_results.get(case)
    assert d is not None, f"{case} did not run"
    assert d["ok"], f"{case} (seed {d['seed']}): {d['msg']}"


def test_naive_chunk_equals_recurrent():
    x = make([9, 40, 1], 2, 16, 8, torch.float32, decay=3.0)
    o_r, s_r = reference(x)
    for bt in (8, 16):
        o_c, s_c, _ = reference(x, chunk_size=bt)
        assert rel(o_c, o_r) < 1e-4 and rel(s_c, s_r) < 1e-4


# ---- GPU: Volundr-32B shapes (H = 40, K = V = 128), bf16 inputs against fp32 references
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
bf16 = torch.bfloat16
GPU_TOL = 2e-2  # bf16 intermediates and bf16 state operands in the chunk matmuls, as fla


@cuda
@pytest.mark.parametrize("lens", [[1] * 64, [4] * 8, [1, 16, 2]])
def test_gpu_recurrent(lens):
    check_recurrent(lens, 40, 128, 128, bf16, GPU_TOL, fused_gate=len(lens) != 64, device="cuda")


@cuda
@pytest.mark.parametrize("lens", [[4096], [1000, 37, 3000, 64]])
def test_gpu_chunk(lens):
    check_chunk(lens, 40, 128, 128, bf16, GPU_TOL, 64, fused_gate=len(lens) > 1, device="cuda")


@cuda
@pytest.mark.parametrize("mode", ["sub", "split"])
@pytest.mark.parametrize("lens,decay", [([4096], 1.0), ([1000, 37, 3000, 64], 1.0),
                                        ([2048, 5, 300], 40.0)])
def test_gpu_chunk_intra(mode, lens, decay):
    """VOLUNDR_KDA_INTRA=sub / split at Volundr shapes: == the fp32 reference and == the fused
    stage 1 (bf16 intermediates: stage-1 outputs agree to bf16 rounding plus tf32 dots)."""
    check_chunk_intra(mode, lens, 40, 128, 128, bf16, GPU_TOL, 64, fused_gate=len(lens) > 1,
                      decay=decay, device="cuda", stage_tol=GPU_TOL)


@cuda
@pytest.mark.parametrize("mode,cfg", [
    ("sub", dict(sub_maxnreg=168)),
    ("sub", dict(sub_split=True, sub_maxnreg=168, sub_maxnreg_wu=128)),
    ("split", dict(split_BK_a=16, split_warps_a=4)),
    ("split", dict(split_diag="levels")),
    ("split", dict(split_warps_d=8, split_unroll_d=False, split_BK_a=16)),
    ("split", dict(split_M16=False, split_stages=1)),
    ("split", dict(split_inv_apart=False, split_maxnreg=168)),
    ("split", dict(split_inv_prec="tf32x3", split_warps_inv=4))])
def test_gpu_chunk_intra_variants(mode, cfg):
    """Launch variants: register caps, two launches of the sub path, the split path's blocks."""
    check_chunk_intra(mode, [1000, 37, 3000, 64], 40, 128, 128, bf16, GPU_TOL, 64,
                      fused_gate=True, decay=8.0, device="cuda", stage_tol=GPU_TOL, cfg=cfg)


@cuda
def test_gpu_conv_and_engine():
    check_conv([1] * 64, 15360, 4, True, "cuda", bf16)
    check_conv([1000, 3, 50], 15360, 4, True, "cuda", bf16)
    check_engine("cuda", bf16, H=40, K=128, tol=GPU_TOL)


def test_ops_kda_decode_cpu():
    check_ops_decode()


@cuda
@pytest.mark.parametrize("N", [1, 16])
@pytest.mark.parametrize("cfg", [{}, {"BV": 16}, {"num_warps": 4}])
def test_gpu_kda_decode(N, cfg):
    """Volundr shapes: the fused decode == the two kernels (and the naive reference), over
    several steps; at batch 16 with padding rows and a strided qkv; per launch setting."""
    from volundr.kernels.kda import decode
    saved = dict(decode.CONFIG)
    try:
        decode.CONFIG.update(cfg)
        check_decode([N], 40, 128, 128, 4, bf16, GPU_TOL, device="cuda", steps=3,
                     pad=(3, 9) if N > 1 else (), extra_cols=256 if N > 1 else 0)
    finally:
        decode.CONFIG.update(saved)


@cuda
@pytest.mark.parametrize("bits", [2, 4])
def test_gpu_gated_norm_folded_into_o_proj(bits, monkeypatch):
    """Volundr shapes: the KDA decode kernel's gated epilogue (batch 1 and 16 with padding,
    both launch settings) and, at batch 1, its output through a mixed-bit o_proj that folds the
    per-head scale into its GEMV (the model's default decode path) ==
    the gated RMSNorm then the naive matmul; the unfolded GroupScaled value is never made."""
    from unittest import mock

    from volundr.kernels.norm.naive import naive_rms_norm_gated
    from volundr.kernels.quant import engine, quantize_random_linear
    from volundr.kernels.quant.naive import naive_quant_matmul
    from volundr.model.layers import GroupScaled

    monkeypatch.setattr(engine, "GATED_NORM_FOLD", True)
    check_decode_gated(16, 40, 128, 128, 4, bf16, 4e-3, "cuda", BV=16, pad=(3, 9))
    o, u, ss, z, nw = check_decode_gated(1, 40, 128, 128, 4, bf16, 4e-3, "cuda")
    lin = quantize_random_linear(5120, 5120, bits, 128, "cuda", seed=bits)
    assert lin.folds_gated_norm(u.view(1, -1), 128) and not lin.folds_gated_norm(u.view(1, -1),
                                                                                   64)
    with mock.patch.object(GroupScaled, "value", side_effect=AssertionError("not folded")):
        y = lin(GroupScaled(u.view(1, -1), ss, 1e-6))
    x_ref = naive_rms_norm_gated(o, nw, z, 1e-6).view(1, -1)
    ref = naive_quant_matmul(x_ref.float(), lin.qa, lin.qb, lin.sz, bits, 128, 5120)
    assert rel(y, ref) < 8e-3, rel(y, ref)
    assert rel(GroupScaled(u.view(1, -1), ss, 1e-6).value(), x_ref) < 8e-3  # the unfolded path


@cuda
def test_gpu_kda_decode_graph():
    """Captured in a CUDA graph: replays == eager calls, bitwise (deterministic), both states."""
    from volundr.kernels.kda import decode
    N, H, K, W, slots = 8, 40, 128, 4, 12
    C = 3 * H * K
    w = torch.randn(C, W, dtype=bf16, device="cuda")
    A_log, dt_bias = torch.rand(H, device="cuda"), torch.randn(H * K, device="cuda") * 0.5
    cs = torch.randn(slots, C, W - 1, dtype=bf16, device="cuda")
    pool = torch.randn(slots, H, K, K, device="cuda")
    x = make_decode(N, H, K, K, W, bf16, "cuda", slots, (5,), extra_cols=64)
    static = {k: v.clone() for k, v in x.items()}
    cs_e, pool_e = cs.clone(), pool.clone()

    def step():
        return decode.kda_decode(static["qkv"], w, cs, static["g"], static["beta"], pool,
                                 static["ids"], K ** -0.5, A_log, dt_bias)
    step()  # warm up (compile, counters) outside the capture
    cs.copy_(cs_e)
    pool.copy_(pool_e)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        o_g = step()
    cs.copy_(cs_e)  # the capture ran nothing; start both from the same states
    pool.copy_(pool_e)
    for _ in range(3):
        y = make_decode(N, H, K, K, W, bf16, "cuda", slots, (), extra_cols=64)
        for k in ("qkv", "g", "beta"):
            static[k].copy_(y[k])
        gr.replay()
        o_e = decode.kda_decode(y["qkv"], w, cs_e, y["g"], y["beta"], pool_e, x["ids"],
                                K ** -0.5, A_log, dt_bias)
        assert torch.equal(o_g, o_e) and torch.equal(cs, cs_e) and torch.equal(pool, pool_e)


@cuda
def test_gpu_matches_fla():
    fla = pytest.importorskip("fla.ops.kda")
    from volundr.kernels.kda import chunk_kda, fused_recurrent_kda
    for lens, ours, theirs in (([2048, 100, 3000], chunk_kda, fla.chunk_kda),
                               ([1] * 32, fused_recurrent_kda, fla.fused_recurrent_kda)):
        x = make(lens, 40, 128, 128, bf16, "cuda")
        h0 = x["pool"][x["idx"]]
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_f, s_f = theirs(*args, initial_state=h0.clone(), cu_seqlens=x["cu"].long(), **kw)
        o, s = ours(*args, initial_state=h0.clone(), cu_seqlens=x["cu"], **kw)
        assert rel(o, o_f) < GPU_TOL and rel(s, s_f) < GPU_TOL, (ours.__name__, rel(o, o_f))


def _main() -> None:
    seed = int(os.environ.get("KDA_TEST_SEED", "0"))
    for name, fn in INTERPRETER_CASES.items():
        torch.manual_seed(seed)
        try:
            fn()
            out = dict(case=name, ok=True, msg="", seed=seed)
        except Exception as e:  # report every case, keep going
            out = dict(case=name, ok=False, msg=f"{type(e).__name__}: {e}", seed=seed)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main()

"""Dependent M = 1 tensor-core GEMVs in one persistent launch: weights keep streaming across
the boundary between them.

Why: a batch-1 decode step is a chain of GEMVs, each waiting for the one before. Run as
separate launches, each pays a ramp-up (its first HBM trip after the predecessor drained; PDL's
early launch and early weight loads hide part of it) and a tail (its last wave and split-K
sums, while HBM idles). The H200 floors (perf/RESULTS.md, session 15) put the sum of per-kernel
streaming floors at ~255 tok/s for Volundr-32B: 300 needs the next GEMV's weights in flight
while the current one finishes.

Here P programs, all resident at once (sized from the compiled kernel's occupancy, launched
cooperatively), run stage after stage. A stage is what one gemv_tc call does (same tiles and
split-K items, `gemv_tc._tile`: with the same splits, the same sums bit for bit): program p
takes items p, p + P, ...
Between stages a grid barrier (kernels/grid_sync.py): a program that has finished its items of
stage s arrives; in stage s + 1 it first loads the weights its first item starts with (each set's
first `early` blocks, and with `prefetch` its first sets into L2), and only then waits
for every program to have arrived, so HBM keeps streaming while the stage before ends.
Stage 0 waits for the kernel before by PDL, as gemv_tc does; the last stage triggers the kernel
after. Data a stage reads from an earlier one (x, the residual, the sums of squares) is loaded
past L1; split-K workspace and tile counters are shared and reset as in gemv_tc.

Under TRITON_INTERPRET=1 programs run one by one and a barrier would never open: the chain
runs as one launch per stage (`ONLY`), which checks everything but the barrier.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from volundr.kernels import pdl
from volundr.kernels.grid_sync import arrive
from volundr.kernels.quant import gemv_tc
from volundr.kernels.quant.gemv import _num_sms, _workspace

MAX_STAGES = 4
# Blocks of weight words (of a set's 2-4) that each set of a later stage loads before its
# barrier wait: what keeps HBM busy while the stage before ends (gemv_tc's `early`).
EARLY = 1
# Cooperative launch: the driver refuses a grid that cannot be resident at once (an error,
# not a hang). VOLUNDR_GEMV_CHAIN_COOP=0 launches normally (P still sized from occupancy).
COOPERATIVE = os.environ.get("VOLUNDR_GEMV_CHAIN_COOP", "1") == "1"

# the order of a stage's runtime values (S[i]) and constexprs (C[i]) in the kernel's tuples
_RUNTIME = ("x", "qa", "qb", "sz", "y", "N", "num_groups", "sets_per_split", "num_splits",
            "up_off", "n_tiles", "r_ptr", "nw_ptr", "xs_ptr", "ss_ptr", "rs_ptr", "n_rs",
            "gs_ptr", "eps")
# (Triton 3.6 types a constexpr tuple's elements: a stage's tuples go into C wrapped as
# constexprs, and its XS, a tuple of tuples, is a kernel parameter of its own)
_CONST = ("BITS", "G", "WA", "L", "Q", "SPLIT_K", "EVEN", "SH", "MSK", "OFFS", "ASM_STEP",
          "ASM_XSUM", "ASM_PAIRS", "CONS_STEP", "CONS_XSUM", "ASM_KEEP", "PREFETCH_L2",
          "PF_ASM", "SWIGLU", "EARLY_W", "GSCALE", "NPART", "RES", "RSCALE", "NRS", "PF_SETS")


@triton.jit
def _stage(S, IDX: tl.constexpr, C: tl.constexpr, XS: tl.constexpr, ws_ptr, cnt_ptr, bar_ptr,
           USE_ASM: tl.constexpr, LATE_TRIGGER: tl.constexpr, GRID: tl.constexpr):
    """Stage IDX (values S[IDX], constexprs C and XS): this program's items (pid_n, pid_k) of
    the stage's gemv_tc grid. GRID: the first item waits on barrier IDX - 1 (after its early
    weight loads) instead of PDL's wait."""
    (x, qa, qb, sz, y, N, num_groups, sps, ns, up_off, n_tiles, r_ptr, nw_ptr, xs_ptr, ss_ptr,
     rs_ptr, n_rs, gs_ptr, eps) = S[IDX]
    BITS: tl.constexpr = C[0]
    G: tl.constexpr = C[1]
    WA: tl.constexpr = C[2]
    L: tl.constexpr = C[3]
    Q: tl.constexpr = C[4]
    SPLIT_K: tl.constexpr = C[5]
    EVEN: tl.constexpr = C[6]
    SH: tl.constexpr = C[7]
    MSK: tl.constexpr = C[8]
    OFFS: tl.constexpr = C[9]
    ASM_STEP: tl.constexpr = C[10]
    ASM_XSUM: tl.constexpr = C[11]
    ASM_PAIRS: tl.constexpr = C[12]
    CONS_STEP: tl.constexpr = C[13]
    CONS_XSUM: tl.constexpr = C[14]
    ASM_KEEP: tl.constexpr = C[15]
    PREFETCH_L2: tl.constexpr = C[16]
    PF_ASM: tl.constexpr = C[17]
    SWIGLU: tl.constexpr = C[18]
    EARLY_W: tl.constexpr = C[19]
    GSCALE: tl.constexpr = C[20]
    NPART: tl.constexpr = C[21]
    RES: tl.constexpr = C[22]
    RSCALE: tl.constexpr = C[23]
    NRS: tl.constexpr = C[24]
    PF_SETS: tl.constexpr = C[25]
    BAR: tl.constexpr = IDX - 1 if IDX > 0 else 0
    pid = tl.program_id(0)
    for item in range(pid, n_tiles * ns, tl.num_programs(0)):
        gemv_tc._tile(item % n_tiles, item // n_tiles, x, qa, qb, sz, y, ws_ptr, cnt_ptr, N,
                      num_groups, sps, ns, up_off, BITS, G, WA, L, Q, SPLIT_K, USE_ASM, SH, MSK,
                      OFFS, ASM_STEP, ASM_XSUM, ASM_PAIRS, CONS_STEP, CONS_XSUM, XS, ASM_KEEP,
                      EVEN, PREFETCH_L2, PF_ASM, SWIGLU, LATE_TRIGGER, r_ptr, nw_ptr, None,
                      xs_ptr, ss_ptr, eps, False, 1, EARLY_W, gs_ptr, GSCALE, NPART, RES, rs_ptr,
                      n_rs, RSCALE, NRS, GRID_WAIT=GRID, bar_ptr=bar_ptr + BAR,
                      bar_target=tl.num_programs(0), wait_now=item == pid, CG=GRID,
                      PF_SETS=PF_SETS)


@triton.jit
def gemv_chain_kernel(S, ws_ptr, cnt_ptr, bar_ptr, C0: tl.constexpr, X0: tl.constexpr,
                      C1: tl.constexpr = None, X1: tl.constexpr = None,
                      C2: tl.constexpr = None, X2: tl.constexpr = None,
                      C3: tl.constexpr = None, X3: tl.constexpr = None,
                      NS: tl.constexpr = 1, USE_ASM: tl.constexpr = True,
                      LATE_TRIGGER: tl.constexpr = False, ONLY: tl.constexpr = -1):
    """Grid (P,): NS stages, stage i = (S[i], Ci, Xi): a gemv_tc call's values (_RUNTIME
    order), constexprs (_CONST order) and XS; barrier counters bar[0 .. NS - 1] (zero at
    entry, zero again at exit). ONLY >= 0: that stage alone, no barriers (the interpreter's
    one launch per stage)."""
    if not LATE_TRIGGER:
        pdl.trigger()
    if ONLY == 0:
        _stage(S, 0, C0, X0, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER, False)
    elif ONLY == 1:
        _stage(S, 1, C1, X1, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER, False)
    elif ONLY == 2:
        _stage(S, 2, C2, X2, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER, False)
    elif ONLY == 3:
        _stage(S, 3, C3, X3, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER, False)
    else:
        _stage(S, 0, C0, X0, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER and NS == 1,
               False)
        pdl.wait()  # (a program without items in stage 0 arrives too: after the wait)
        if NS > 1:
            arrive(bar_ptr)
            _stage(S, 1, C1, X1, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER and NS == 2,
                   True)
        if NS > 2:
            arrive(bar_ptr + 1)
            _stage(S, 2, C2, X2, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER and NS == 3,
                   True)
        if NS > 3:
            arrive(bar_ptr + 2)
            _stage(S, 3, C3, X3, ws_ptr, cnt_ptr, bar_ptr, USE_ASM, LATE_TRIGGER, True)
        # the last program out resets the counters: every other one has passed every wait
        tl.debug_barrier()
        done = tl.atomic_add(bar_ptr + NS - 1, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            for i in range(NS):
                tl.atomic_xchg(bar_ptr + i, 0)


@functools.cache
def _barriers(device: torch.device) -> torch.Tensor:
    """Zeroed barrier counters, one set per device (each launch leaves them at zero)."""
    return torch.zeros(MAX_STAGES, dtype=torch.int32, device=device)


def _pack(args: tuple, kw: dict, n_tiles: int) -> tuple[tuple, tuple, tuple]:
    """A stage's (runtime tuple, constexpr tuple, XS) from gemv_tc.launch_args' output."""
    names = ("x", "qa", "qb", "sz", "y", "ws", "cnt", "N", "num_groups", "sets_per_split",
             "num_splits", "up_off")
    v = dict(zip(names, args), n_tiles=n_tiles, **kw)
    y = v["y"]
    for name in ("r_ptr", "nw_ptr", "xs_ptr", "ss_ptr", "rs_ptr", "gs_ptr"):
        if v.get(name) is None:  # (unused: the stage's constexprs say so) any tensor will do
            v[name] = y
    v.setdefault("n_rs", 1)
    v.setdefault("eps", 0.0)
    defaults = dict(GSCALE=False, NPART=1, RES=False, RSCALE=False, NRS=1, PF_SETS=0)
    # (a tuple inside a constexpr tuple goes in as a constexpr: Triton 3.6 cannot type it)
    const = tuple(v.get(k, defaults.get(k)) for k in _CONST)
    const = tuple(tl.constexpr(c) if isinstance(c, tuple) else c for c in const)
    return tuple(v[k] for k in _RUNTIME), const, v["XS"]


def occupancy(n_regs: int, shared: int, num_warps: int) -> int:
    """Programs of one kernel resident per SM on sm_90: 64 warps, 32 blocks, 64 K registers
    (allocated per warp in units of 256) and 228 KiB of shared memory (1 KiB reserved per
    block)."""
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps) if n_regs else 32
    by_smem = 233472 // (shared + 1024)
    return max(0, min(32, 64 // num_warps, by_regs, by_smem))


_PROGRAMS: dict[tuple, int] = {}


def gemv_chain(stages: list[dict], programs: int | None = None, prefetch: int = 0,
               early: int = EARLY, cooperative: bool | None = None) -> list[torch.Tensor]:
    """Run gemv_tc calls that depend on each other as one launch; returns their outputs.

    stages: 1..MAX_STAGES keyword dicts of gemv_tc (x, qa, qb, sz, bits, group_size, and out,
    reps, swiglu, gscale, residual, rscale, early, maxnreg as there); a later stage's x (or
    residual / rscale tensors) may be an earlier stage's output, which must then be given as
    its `out`. One num_warps for all; one kernel has one register cap: the lowest of the
    stages' maxnreg where every stage has one, else none. NORM and pipelined stages are not
    taken. programs: P (default: as many as can be resident at once; a stage's waves are
    ignored: its split-K is set so that its items are about P, unless it gives `splits`).
    prefetch: each item's first `prefetch` sets of weights (-1: all of them) go to L2 before
    it waits (prefetch instructions; stages whose tiles are whole). early: blocks of weight
    words each set loads before its wait in stages after the first, where the stage does not
    say (gemv_tc's `early`; the first stage keeps gemv_tc's default, as it waits for the
    kernel before). cooperative: None = COOPERATIVE."""
    assert 1 <= len(stages) <= MAX_STAGES, len(stages)
    x0 = stages[0]["x"]
    dev = x0.device
    num_warps = stages[0].get("num_warps", 1)
    assert all(s.get("num_warps", 1) == num_warps and s.get("norm") is None
               and s.get("stages", 1) == 1 for s in stages), \
        "one num_warps; no norm, no pipelined stages"
    caps = [s.get("maxnreg") for s in stages]
    maxnreg = min(caps) if all(caps) else None
    stages = [{**s, "maxnreg": maxnreg, **({} if i == 0 or "early" in s else {"early": early})}
              for i, s in enumerate(stages)]
    coop = COOPERATIVE if cooperative is None else cooperative
    interp = gemv_tc._interpreting()
    key = tuple((s["bits"], s["group_size"], s["qa"].shape, s.get("reps", 4), s.get("early"),
                 bool(s.get("swiglu")), s.get("gscale") is not None,
                 s.get("residual") is not None, s.get("rscale") is not None) for s in stages)
    key = (dev.type, dev.index, key, maxnreg, prefetch, pdl.LATE_TRIGGER)
    p = programs or _PROGRAMS.get(key)
    if p is None:  # as many as fit at once (the registers, and so P, depend on P's splits)
        p = _num_sms(dev) * (4 if interp else 16)
        for _ in range(3 if dev.type == "cuda" and not interp else 0):
            grid, (args, kw) = _launch(stages, p, prefetch, interp, coop)
            kern = gemv_chain_kernel.warmup(*args, grid=grid, **kw)
            kern._init_handles()
            fit = _num_sms(dev) * occupancy(kern.n_regs, kern.metadata.shared, num_warps)
            if fit == p:
                break
            p = fit
        _PROGRAMS[key] = p
    grid, (args, kw) = _launch(stages, p, prefetch, interp, coop)
    if interp:
        for i in range(len(stages)):
            gemv_chain_kernel[grid](*args, **{**kw, "ONLY": i})
        return [s[4] for s in args[0]]
    while True:
        try:
            gemv_chain_kernel[grid](*args, **kw)
            return [s[4] for s in args[0]]
        except RuntimeError as e:  # the driver counts fewer resident programs than occupancy()
            if programs or "cooperative" not in str(e).lower() or p <= _num_sms(dev):
                raise
            p -= _num_sms(dev)
            _PROGRAMS[key] = p
            grid, (args, kw) = _launch(stages, p, prefetch, interp, coop)


def _launch(stages: list[dict], p: int, prefetch: int, interp: bool, coop: bool) -> tuple:
    """(grid, (positional args, keyword args)) of the chain kernel for P = p programs."""
    dev = stages[0]["x"].device
    packed, n_tiles_max, ws_elems = [], 1, 0
    for s in stages:
        kw = {k: v for k, v in s.items() if k not in ("x", "qa", "qb", "sz", "bits",
                                                      "group_size")}
        reps, nw = kw.get("reps", 4), kw.get("num_warps", 1)
        kw["waves"] = p / _num_sms(dev)  # items (tiles x splits) about P
        grid, args, lkw = gemv_tc.launch_args(s["x"], s["qa"], s["qb"], s["sz"], s["bits"],
                                              s["group_size"], **kw)
        n_tiles, ns = grid
        if prefetch and not interp and lkw["EVEN"]:
            bn = 4 * reps * 8 * nw
            lkw.update(PREFETCH_L2=True, PF_ASM=pdl.prefetch_l2_asm(4 * bn),
                       PF_SETS=max(prefetch, 0))
        packed.append(_pack(args, lkw, n_tiles))
        n_tiles_max = max(n_tiles_max, n_tiles)
        ws_elems = max(ws_elems, ns * args[7])
    ws, cnt = _workspace(dev, n_tiles_max, ws_elems)
    kw = {f"{c}{i}": pk[j] for i, pk in enumerate(packed) for j, c in ((1, "C"), (2, "X"))}
    kw.update(NS=len(stages), USE_ASM=not interp, LATE_TRIGGER=pdl.LATE_TRIGGER,
              num_warps=stages[0].get("num_warps", 1), launch_pdl=pdl.ON.value)
    if stages[0].get("maxnreg") is not None:
        kw["maxnreg"] = stages[0]["maxnreg"]
    if not interp:
        kw["launch_cooperative_grid"] = coop
    return (p,), ((tuple(pk[0] for pk in packed), ws, cnt, _barriers(dev)), kw)

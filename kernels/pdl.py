"""Programmatic dependent launch (PDL): on by default on sm_90+ GPUs (H100, H200), where
VOLUNDR_PDL=0 turns it off (and VOLUNDR_PDL=1 forces it); read once at import.

A batch-1 decode step is a chain of ~680 short kernels, and each pays its launch and its
first trip to HBM after the kernel before it has drained (perf/RESULTS.md: a 5120x5120 GEMV
takes ~10 us for 14 MB of weights). With PDL a kernel is launched while its predecessor still
runs and waits for it (`griddepcontrol.wait`: its whole grid finished, memory visible) before
it reads anything the predecessor wrote: the launch and the programs' start overlap the
predecessor's tail.

Rules that keep it correct:
* `trigger()` at the top of a kernel lets a PDL-launched successor start once every program of
  this grid has begun; it changes nothing for successors launched normally (a no-op then).
* A PDL-launched kernel calls `wait()` on every path, before it reads anything an earlier kernel
  wrote and before its first store or atomic: then its completion still implies its
  predecessors' (ordering stays transitive along the stream).
The decode chain's kernels (GEMVs, norms, KDA, conv, attention) launch with PDL (`launch_pdl=ON`).

Measured on the H200 (perf/RESULTS.md, session 5, run 9, same tree and run): Volundr-32B decode
graph 7.27 -> 7.07 ms per token, 131.5 -> 134.5 tok/s, the same greedy tokens. The tensor-core
GEMVs can also prefetch their weights into L2 before waiting (VOLUNDR_PDL_PREFETCH=1); with
them run 6 was slower than without PDL (graph 8.90 vs 7.87 ms): the prefetches compete with the
running kernel for HBM. They are off by default.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _enabled() -> bool:
    """VOLUNDR_PDL if set; else whether GPU 0 is sm_90+ (PDL and griddepcontrol need Hopper).
    Never under the CPU interpreter (no PTX: both helpers compile to nothing there)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    env = os.environ.get("VOLUNDR_PDL")
    if env is not None:
        return env == "1"
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9


ON = tl.constexpr(_enabled())
# With PDL, the tensor-core GEMVs can also prefetch their weights into L2 before waiting
PREFETCH = os.environ.get("VOLUNDR_PDL_PREFETCH", "0") == "1"
# The tensor-core GEMV triggers its successor after its main loop (VOLUNDR_PDL_TRIGGER=top: at
# its top, as every other kernel does). H200 run 15, end to end: graph 7.09 -> 6.88 ms per
# token, 135.9 -> 140.2 tok/s, same ids; the GEMVs whose programs are all resident at once
# (5120-row outputs: 800-880 one-warp programs) gain 2.4-2.9 us each, as their successor's
# programs no longer sit waiting beside them; the large grids move by +-0.3 us.
LATE_TRIGGER = os.environ.get("VOLUNDR_PDL_TRIGGER", "late") != "top"
# The 4-bit tensor-core GEMVs load each set's first block of weight words before they wait
# (VOLUNDR_PDL_EARLY=0: after; into registers, a few loads per lane, unlike the L2 prefetch of
# all their weights), hiding the first HBM trip of programs made resident while the kernel
# before drains. H200 run 16, with the late trigger: 4-bit GEMVs 0.5-0.7 us faster each, graph
# 6.68 -> 6.59 ms per token (145.2 -> 147.8 tok/s), same ids. Not at 3 bits: the kernel bench
# of run 14 had 3-bit gain 9-20%, but in the engine (run 15) 3-bit gate_up lost 4.9 us per call.
# VOLUNDR_PDL_EARLY="bits:blocks,..." sets blocks per bit width (e.g. "4:2,3:2"; a set has 4
# blocks of 4 weight rows at 4 bits, 2 at 2 and 3): more loads in flight at once for more
# registers. H200 run 19: 2 or 4 blocks slower than 1 at every engine shape (kernel bench),
# 2 at 4 bits +0.10 ms of graph time per token.


def parse_early(text: str) -> dict[int, int]:
    """VOLUNDR_PDL_EARLY -> {bits: blocks}: "0" or "" none, "k" k blocks at 4 bits, "b:k,..."
    each ("/" also separates)."""
    if not text.strip():
        return {}
    if ":" not in text:
        return {4: int(text)} if int(text) else {}
    pairs = (item.split(":") for item in text.replace("/", ",").split(",") if item)
    return {int(b): int(k) for b, k in pairs if int(k)}


EARLY_WEIGHTS = parse_early(os.environ.get("VOLUNDR_PDL_EARLY", "1"))


@triton.jit
def trigger():
    """Let a PDL-launched successor start (a hint; no effect on normal launches)."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def wait():
    """Block until the preceding kernel has finished and its writes are visible."""
    if ON:
        gdc_wait()


def prefetch_l2_asm(nbytes: int) -> str:
    """PTX for `tl.inline_asm_elementwise` (operand: one int64 address per element; result: a
    dummy int32): L2 prefetches of the nbytes (a multiple of 128) from there, one per 128-byte
    line. (A bulk prefetch would be one instruction per row, but its address
    must be uniform: ptxas loops over the lanes.)"""
    assert nbytes % 128 == 0
    lines = [f"prefetch.global.L2 [$1+{o}];" for o in range(0, nbytes, 128)]
    return "\n".join(lines + ["mov.u32 $0, 0;"])

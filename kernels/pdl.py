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
# VOLUNDR_PDL_TRIGGER=late: the tensor-core GEMV triggers after its main loop instead of at the
# top (run 9: with PDL the 5120x5120 GEMVs, whose programs all start at once, got 2.1 us
# slower; one suspect is the successor's programs resident and waiting beside them all along)
LATE_TRIGGER = os.environ.get("VOLUNDR_PDL_TRIGGER", "top") == "late"
# VOLUNDR_PDL_EARLY=1: the 3/4-bit tensor-core GEMVs load each set's first block of weight words
# before they wait (into registers: a few loads per lane, unlike the L2 prefetch of all their
# weights). Session 6 found ~6.5 us of every GEMV call fixed latency; this hides the first HBM
# trip of programs made resident while the kernel before drains. Kernel bench (run 14): 3-bit
# 9-20% faster at the engine's shapes, 4-bit 1-6%; off until measured end to end.
EARLY_WEIGHTS = os.environ.get("VOLUNDR_PDL_EARLY", "0") == "1"


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

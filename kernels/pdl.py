"""Programmatic dependent launch (sm_90+), opt-in with VOLUNDR_PDL=1 (read once at import).

A batch-1 decode step is a chain of ~900 short kernels, and each mixed-bit GEMV pays its launch
and its first trip to HBM after the kernel before it has drained (perf/RESULTS.md: a 5120x5120
call takes 8-10 us for 2-7 MB of weights). With PDL a GEMV is launched while its predecessor
still runs, fetches the weights it will need first (which no earlier kernel writes) and only
then waits for the predecessor (`griddepcontrol.wait`: its whole grid finished, memory
visible) before it reads x or writes anything.

Rules that keep it correct:
* `trigger()` at the top of a kernel lets a PDL-launched successor start once every program of
  this grid has begun; it changes nothing for successors launched normally (a no-op then).
* A PDL-launched kernel calls `wait()` on every path, before it reads anything an earlier kernel
  wrote and before its first store or atomic: then its completion still implies its
  predecessors' (ordering stays transitive along the stream).
Only the GEMVs are launched with PDL (`launch_pdl=ON`); the kernels that precede them trigger.
Off by default: on the H200 (run 6, perf/RESULTS.md) it gave the same tokens but made the
Volundr-32B decode step slower (graph 8.90 vs 7.87 ms), the GEMVs themselves included; why is
not analysed yet.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# no PTX under the CPU interpreter: there both helpers compile to nothing
ON = tl.constexpr(os.environ.get("VOLUNDR_PDL") == "1"
                  and os.environ.get("TRITON_INTERPRET") != "1")
# With PDL, the tensor-core GEMVs also prefetch their weights into L2 before waiting;
# VOLUNDR_PDL_PREFETCH=0 keeps only the early launch (to tell the two effects apart: the
# prefetches compete with the running kernel for the same HBM bandwidth)
PREFETCH = os.environ.get("VOLUNDR_PDL_PREFETCH", "1") == "1"


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

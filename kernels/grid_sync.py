"""A grid-wide barrier between the stages of a persistent kernel (kernels/quant/gemv_chain.py).

A stage ends with `arrive(bar)`: the program's stores are ordered before a release increment of
the stage's counter. The next stage's programs first issue what does not depend on the stage
before (their first weight loads), then `grid_wait(bar, P)`: an acquire poll until all P
programs of the launch have arrived. Data that other programs wrote in the same launch must be
read past L1 (`.cg`), which is not coherent across SMs within a launch.

Correct only if all P programs are resident at once: the launcher sizes P from the compiled
kernel's occupancy and launches cooperatively (the driver refuses a grid that cannot be
co-resident rather than letting it hang), and such a kernel triggers its PDL successor only in
its last stage (a successor's programs waiting beside it could otherwise hold SM slots that
its own programs need). Under TRITON_INTERPRET=1 programs run one after another, so a poll
would never end: the chain runs there as one launch per stage instead.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Nanoseconds each poll of a waiting program sleeps before the next (0: none). Every resident
# program (thousands) polls one counter: a backoff spares the L2 slice that holds it, which
# also serves weight lines. VOLUNDR_GRID_BACKOFF_NS, read once at import; not yet measured.
BACKOFF_NS = tl.constexpr(int(os.environ.get("VOLUNDR_GRID_BACKOFF_NS", "0")))


@triton.jit
def arrive(bar_ptr):
    """This program's stores of the stage are done (every thread's), then counter += 1."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release")


@triton.jit
def grid_wait(bar_ptr, target):
    """Until the counter at bar_ptr reaches target (acquire: the arrived programs' stores are
    visible to this program's threads after the barrier below)."""
    c = tl.atomic_add(bar_ptr, 0, sem="acquire")
    while c < target:
        if BACKOFF_NS > 0:
            c = tl.inline_asm_elementwise(f"nanosleep.u32 {BACKOFF_NS}; mov.b32 $0, $1;", "=r,r",
                                          [c], dtype=tl.int32, is_pure=False, pack=1)
        c = tl.atomic_add(bar_ptr, 0, sem="acquire")
    tl.debug_barrier()

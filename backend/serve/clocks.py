"""What stalls the engine thread besides the GPU: Python's cycle collector and Triton's JIT.

Both run inside an `llm.step()` without the step asking for them, and either can take seconds:
a full collection over many objects, or a kernel compiled for a specialisation not seen before
(a step composition whose integer arguments are newly divisible by 16, a new constexpr block
size). The engine loop reads these clocks before and after each step and logs their share of a
slow one, and each step that made Triton specialise a kernel (volundr.warmup is meant to leave
none for a running server).
"""

from __future__ import annotations

import threading
import time


class GcClock:
    """Seconds Python's cycle collector has run in this process since it was added to
    gc.callbacks (a full collection over many objects can stall the engine thread)."""

    def __init__(self):
        self.total = 0.0
        self._t: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.total += time.perf_counter() - self._t
            self._t = None


class JitClock:
    """Triton kernel specialisations made in this process while installed: `count`, the seconds
    they took (`total`: compiled, or loaded from Triton's disk cache) and their kernels' names
    (`names`, in order). Through triton.knobs.runtime's jit_cache_hook (called before a
    specialisation is made) and jit_post_compile_hook (after), so a kernel launch that finds
    its specialisation made costs nothing more. Hooks installed before are still called (the
    cache hook's answer, which may skip the compile, is theirs)."""

    def __init__(self):
        self.count = 0
        self.total = 0.0
        self.names: list[str] = []
        self._started = threading.local()
        self._prev: tuple | None = None

    def install(self) -> bool:
        """False where this Triton has no such hooks (nothing is counted then)."""
        try:
            from triton import knobs

            rt = knobs.runtime
            self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return False
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after
        return True

    def uninstall(self) -> None:
        if self._prev is None:
            return
        from triton import knobs

        rt = knobs.runtime
        if rt.jit_cache_hook == self._before:
            rt.jit_cache_hook = self._prev[0]
        if rt.jit_post_compile_hook == self._after:
            rt.jit_post_compile_hook = self._prev[1]
        self._prev = None

    def _before(self, **kwargs) -> bool | None:
        self._started.t = time.perf_counter()
        prev = self._prev[0] if self._prev else None
        return prev(**kwargs) if prev is not None else False

    def _after(self, **kwargs) -> None:
        t = getattr(self._started, "t", None)
        if t is not None:
            self.total += time.perf_counter() - t
            self._started.t = None
        self.count += 1
        self.names.append(getattr(kwargs.get("fn"), "name", "?"))
        prev = self._prev[1] if self._prev else None
        if prev is not None:
            prev(**kwargs)

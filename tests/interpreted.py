"""A test file run as a script under TRITON_INTERPRET=1, its Triton kernels on the CPU, in a child
process: the variable is read when Triton is imported, so it must reach no other test.

The interpreter is not the GPU in two ways the checks must allow for: it casts fp32 to bf16 by
truncation (a GPU rounds to nearest; every bf16 output sits up to an ulp low in magnitude, so
small bf16 cases drift ~0.5% from the naive references), and it computes bf16 tl.dot on the raw
uint16 bits (Triton 3.6). Check the math in fp16 / fp32 there, bf16 loosely or on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(file: str, *args: str, timeout: int = 600, **env: str) -> str:
    """`python file *args` with TRITON_INTERPRET=1, no CUDA device and `env`; asserts that it
    exits 0 and returns its stdout."""
    e = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **env)
    r = subprocess.run([sys.executable, file, *args], env=e, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout

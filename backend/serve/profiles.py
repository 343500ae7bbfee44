"""Serving profiles: one row per target machine; `--profile` picks one, flags override fields.

gpu_gib is the GPU memory budget handed to the engine's memory plan (weights, KDA/conv state per
sequence, attention KV for the rest); a little is left to the CUDA context and the server.
Volundr-32B needs about 11 GB of GPU memory for its mixed 2/3/4-bit compute weights; its
embedding and Engram tables stay in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from volundr.session import DEFAULT_SESSION_GIB


@dataclass(frozen=True)
class Profile:
    name: str
    device: str  # "cpu" | "cuda"
    gpu_gib: float | None  # None on the CPU
    max_num_seqs: int  # running sequences (each holds one KDA/conv state slot)
    max_num_batched_tokens: int  # tokens per engine step (chunked prefill)
    max_model_len: int  # context per sequence (capped by the checkpoint's own)
    shm_mib: int  # Python backend shared memory per model instance, initial size
    max_inflight: int  # ensemble backpressure, where the server supports it
    note: str
    tensor_parallel_size: int = 1  # GPUs cuda:0..N-1 of one machine (--tp)
    # tokens per engine step when only decodes run (the host syncs once per step): on the H200
    # 4 gave 100 vs 97 tok/s greedy single stream (run 5), 8 gave 138.9 vs 134.5 and 989 vs
    # 968 with 16 streams (run 9, perf/RESULTS.md). The price: a stopped sequence computes up
    # to 7 discarded tokens, tokens stream 8 at a time (~60 ms apart at 139 tok/s), and a
    # request arriving meanwhile waits for the step to end (admission then gets steps of 1).
    decode_steps: int = 1
    # attention KV cache: auto (the model dtype), bf16, fp8 (EngineConfig.kv_cache_dtype)
    kv_cache_dtype: str = "auto"
    # host memory for parked sessions (EngineConfig.session_gib): an agent's session waiting
    # on a tool keeps its state here, not on the GPU
    session_gib: float = DEFAULT_SESSION_GIB


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("cpu", "cpu", None, 8, 256, 2048, 16, 64,
                "tests, CI and the tiny checkpoint on any machine"),
        # fp8 KV: the memory plan's pool at 16 GiB holds 292K tokens (bf16: 146K), so the
        # whole 262K context fits the budget (and long-context decode reads half the bytes)
        Profile("16gb", "cuda", 16.0, 1, 2048, 262144, 64, 8,
                "16 GB GPUs: one conversation (RTX 4080, RTX 4060 Ti 16 GB)", decode_steps=8,
                kv_cache_dtype="fp8"),
        Profile("24gb", "cuda", 23.0, 4, 4096, 262144, 64, 32,
                "24 GB GPUs: server, 4 concurrent (RTX 3090/4090, L4, A10)", decode_steps=8),
        Profile("48gb", "cuda", 46.0, 16, 8192, 262144, 128, 256,
                "48 GB and larger: server, 16 concurrent (L40S, A6000, A100, H100, H200)",
                decode_steps=8),
    )
}


def profiles_table() -> str:
    """The profiles as a Markdown table (README, --help)."""
    rows = ["| profile | device | GPU budget | sequences | tokens/step | context | for |",
            "|---|---|---|---|---|---|---|"]
    for p in PROFILES.values():
        gib = f"{p.gpu_gib:g} GiB" if p.gpu_gib else "-"
        rows.append(f"| `{p.name}` | {p.device} | {gib} | {p.max_num_seqs} | "
                    f"{p.max_num_batched_tokens} | {p.max_model_len} | {p.note} |")
    return "\n".join(rows)

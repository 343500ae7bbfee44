"""GPU memory plan: how many attention-KV tokens fit a budget after weights, states and workspace.

The model runner sizes its paged KV pool from `plan_memory(...).kv_gpu_tokens`; `python -m
volundr.converter inspect --gpu-gib G` prints the same plan. The layout follows VOLUNDR.md:
compute and MTP weights on the GPU at their stored precision, token embedding and Engram tables in
host memory, a fixed per-sequence recurrent state (KDA state + conv tails, Engram conv tails), and
attention KV per token (at the KV cache's own width: 1 byte per element for an fp8 cache, so a
budget holds about twice the tokens of a bf16 one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from volundr.config import VolundrConfig
from volundr.model.weights import HOST_PARTS, expected_tensors

GIB = 1 << 30
MIB = 1 << 20
# CUDA context, allocator slack and kernel workspaces that no formula below accounts for.
FIXED_RESERVE_BYTES = 512 * MIB
GPU_PARTS = ("compute", "mtp")
# `fits` also asks for a minimal KV pool (16 blocks of 16 tokens) besides weights and states.
MIN_KV_TOKENS = 256


@dataclass(frozen=True)
class MemoryPlan:
    gpu_budget_bytes: int | None  # None: no budget given (plan for the full context)
    weights_gpu_bytes: int
    host_bytes: int
    state_bytes_per_seq: int
    kv_bytes_per_token: int
    max_num_seqs: int
    activation_reserve_bytes: int
    kv_gpu_tokens: int
    fits: bool
    weight_bits: float  # average stored bits per GPU weight, group scales included
    kv_dtype: str = "bfloat16"  # the attention KV cache's element type (torch's name)

    @property
    def state_bytes(self) -> int:
        return self.state_bytes_per_seq * self.max_num_seqs

    @property
    def kv_gpu_bytes(self) -> int:
        return self.kv_gpu_tokens * self.kv_bytes_per_token

    def as_dict(self) -> dict:
        return {**asdict(self), "state_bytes": self.state_bytes, "kv_gpu_bytes": self.kv_gpu_bytes}

    def describe(self) -> str:
        def gib(b: int) -> str:
            if b >= GIB:
                return f"{b / GIB:.2f} GiB"
            return f"{b / MIB:.1f} MiB" if b >= MIB else f"{b / 1024:.1f} KiB"

        budget = "none (full context)" if self.gpu_budget_bytes is None else gib(
            self.gpu_budget_bytes)
        lines = [
            f"GPU budget:                 {budget}",
            f"weights on GPU:             {gib(self.weights_gpu_bytes)} "
            f"({self.weight_bits:.2f} bits/weight)",
            f"recurrent state:            {gib(self.state_bytes_per_seq)} per sequence x "
            f"{self.max_num_seqs} = {gib(self.state_bytes)}",
            f"activation/workspace:       {gib(self.activation_reserve_bytes)}",
            f"attention KV (incl. MTP):   {self.kv_bytes_per_token / 1024:.1f} KiB per token "
            f"({self.kv_dtype}) -> {self.kv_gpu_tokens:,} tokens ({gib(self.kv_gpu_bytes)})",
            f"host memory (embed+Engram): {gib(self.host_bytes)}",
        ]
        if self.fits:
            lines.append("fits: yes")
        else:
            need = self.weights_gpu_bytes + self.state_bytes + self.activation_reserve_bytes
            lines.append(f"fits: NO - weights + states + workspace need {gib(need)} (plus KV), "
                         f"more than the {budget} budget; use a quantized checkpoint, fewer "
                         "sequences or a larger GPU")
        return "\n".join(lines)


def weight_bytes(cfg: VolundrConfig, parts: tuple[str, ...] = GPU_PARTS,
                 dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes, parameters) of the tensors of `parts` at their stored precision: quantized linears
    (cfg.quantization.bits) take bits/8 per weight plus a bf16 scale and zero per group."""
    bits = cfg.quantization.bits if cfg.quantization is not None else {}
    group = cfg.quantization.group_size if cfg.quantization is not None else 128
    total, params = 0, 0
    for name, spec in expected_tensors(cfg).items():
        if spec.part not in parts:
            continue
        n = 1
        for x in spec.shape:
            n *= x
        params += n
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in bits:
            out_f, in_f = spec.shape
            groups = out_f * -(-in_f // group)
            total += -(-n * bits[module] // 8) + groups * 2 * 2
        else:
            total += n * dtype_bytes
    return total, params


def state_bytes_per_seq(cfg: VolundrConfig, dtype_bytes: int = 2) -> int:
    """Fixed per-sequence state: fp32 KDA state and conv tails of q, k, v (model dtype) of every
    KDA layer, plus the conv tail of every Engram layer (`cfg.kda_state_bytes` + Engram for
    bf16)."""
    k, e = cfg.kda, cfg.engram
    kda = k.num_heads * k.head_dim * k.head_dim * 4 + 3 * k.num_heads * k.head_dim * (
        k.conv_size - 1) * dtype_bytes
    engram = (e.conv_size - 1) * cfg.hidden_size * dtype_bytes
    return len(cfg.kda_layers) * kda + len(e.layers) * engram


def kv_bytes_per_token(cfg: VolundrConfig, dtype_bytes: int = 2) -> int:
    """K and V of one token in every attention layer and the MTP block's attention layer, which
    keeps its own paged cache of the same length (`cfg.kv_bytes_per_token` covers the main
    layers only)."""
    layers = len(cfg.attention_layers) + cfg.mtp.num_layers
    return layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def activation_reserve(cfg: VolundrConfig, max_num_batched_tokens: int) -> int:
    """Workspace for one forward step: per batched token, fp32 hidden, gate+up MLP activations
    and a row of logits (an upper bound: nano-vllm-style runners compute logits only for the last
    token of each sequence), plus FIXED_RESERVE_BYTES. The logits term is not what prefill
    allocates, but the allocator's reserved peak needs the room: measured on an H100 (Volundr-32B,
    perf/RESULTS.md session 25) graphs plus a prefill's peak took 0.9-1.0 GiB allocated and
    2.1 GiB reserved at 2048-token chunks (this gives 2.80), 2.2 and 3.7 GiB at 8192 (this gives
    9.6); a tighter formula (twice the fp32 hidden + MLP per token, logits per sequence) ran
    out of memory under 46 GiB at 8192-token chunks with 1.4 GiB reserved but unallocated."""
    per_token = (cfg.hidden_size + 2 * cfg.intermediate_size + cfg.vocab_size) * 4
    return max_num_batched_tokens * per_token + FIXED_RESERVE_BYTES


def plan_memory(cfg: VolundrConfig, gpu_gib: float | None, max_num_seqs: int = 1,
                max_num_batched_tokens: int = 512, dtype_bytes: int = 2,
                kv_dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
    """The memory plan of `cfg` on a GPU of `gpu_gib` GiB (None: no budget, KV for every
    sequence's full context). `dtype_bytes` is the activation / unquantized weight width;
    `kv_dtype` the attention KV cache's (torch.float8_e4m3fn: 1 byte per element)."""
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
    if gpu_gib is not None and gpu_gib <= 0:
        raise ValueError(f"gpu_gib must be positive, got {gpu_gib}")
    w, n = weight_bytes(cfg, GPU_PARTS, dtype_bytes)
    host, _ = weight_bytes(cfg.replace(quantization=None), HOST_PARTS, 2)
    state = state_bytes_per_seq(cfg, dtype_bytes)
    kv = kv_bytes_per_token(cfg, kv_dtype.itemsize)
    reserve = activation_reserve(cfg, max_num_batched_tokens)
    if gpu_gib is None:
        budget, tokens, fits = None, max_num_seqs * cfg.max_position_embeddings, True
    else:
        budget = int(gpu_gib * GIB)
        free = budget - w - state * max_num_seqs - reserve
        tokens = max(0, free // kv) if kv else (cfg.max_position_embeddings if free >= 0 else 0)
        fits = free >= 0 and (kv == 0 or tokens >= MIN_KV_TOKENS)
    return MemoryPlan(gpu_budget_bytes=budget, weights_gpu_bytes=w, host_bytes=host,
                      state_bytes_per_seq=state, kv_bytes_per_token=kv,
                      max_num_seqs=max_num_seqs, activation_reserve_bytes=reserve,
                      kv_gpu_tokens=int(tokens), fits=fits,
                      weight_bits=8 * w / max(n, 1),
                      kv_dtype=str(kv_dtype).removeprefix("torch."))

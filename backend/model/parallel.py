"""Megatron-style tensor parallelism: split linears, a vocab-parallel lm_head, checkpoint sharding.

With `tp` ranks (one process per device, `volundr.distributed`), rank r holds:
  attention   q heads [r*H/tp, (r+1)*H/tp); the KV heads split the same way when tp <= Hkv,
              otherwise each rank holds the one KV head its q heads read (replicated)
  KDA         heads [r*H/tp, (r+1)*H/tp): q/k/v/f_b/g_b/b rows, conv taps, A_log, dt_bias, and
              the recurrent + conv state of those heads (the low-rank f_a/g_a are replicated)
  MLP         rows of gate/up, the matching columns of down
  W_o, down   columns (row-parallel): partial sums, one all-reduce per projection
  lm_head     vocab rows [r*V/tp, (r+1)*V/tp); logits are gathered on rank 0 (the only rank
              that samples), so `ParallelLMHead` returns None on the other ranks
Everything else (norms, Engram projections, MTP's eh_proj) is replicated; the residual stream is
the same on every rank after each all-reduce. The token embedding and Engram tables are host
lookup tables, shared by the rank processes (see volundr.distributed).

At tp == 1 the classes are plain `nn.Linear`s and no collective runs, so results are bit-identical
to the single-device model. Collectives use torch.distributed's default process group: one
tensor-parallel engine per process.

Quantized checkpoints shard the same way: `X.qweight`, `X.scales` and `X.zeros` follow the rule of
`X.weight`, assuming they are [out, packed in] / [out, in / group] (packed along the input, as the
weight they replace); a row-parallel split then needs whole groups on each rank (`check_tp`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from volundr.config import ConfigError, VolundrConfig


@dataclass(frozen=True)
class TP:
    """This process's place in the tensor-parallel group."""
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads a rank holds: a share of them, or 1 when ranks outnumber them (replicated)."""
    return max(1, num_kv_heads // tp)


ALL_REDUCE_PATHS = ("nccl", "symm")
_ONE_SHOT: dict = {}  # this process's symmetric buffer and group name (enable_one_shot)


def enable_one_shot(device: torch.device, max_numel: int, dtype: torch.dtype) -> None:
    """Decode-sized all-reduces (up to max_numel elements of dtype) through symmetric memory's
    one-shot all-reduce (torch.ops.symm_mem: each rank copies x into its buffer and one kernel
    reads every peer's over NVLink and sums; no multicast) instead of NCCL. Collective: every
    rank calls it, before its graphs are captured. Prepared for the next two-GPU run
    (VOLUNDR_TP_ALLREDUCE=symm); not yet run on GPUs."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(max_numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buf, group)
    _ONE_SHOT.update(buf=buf, group=group)


def all_reduce(x: torch.Tensor, tp: TP) -> torch.Tensor:
    """Sum of x over the ranks (in place), a no-op at tp == 1."""
    if tp.size > 1:
        buf = _ONE_SHOT.get("buf")
        if (buf is not None and x.is_cuda and x.dtype == buf.dtype and x.is_contiguous()
                and x.numel() <= buf.numel()):
            b = buf[:x.numel()].view_as(x)
            b.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(b, "sum", _ONE_SHOT["group"], out=x)
        else:
            dist.all_reduce(x)
    return x


class ColumnParallelLinear(nn.Linear):
    """y_r = x W_r^T, W_r = rows [r*out/tp, (r+1)*out/tp) of W [out, in]: no communication; the
    caller works on its slice of the outputs (its heads)."""

    def __init__(self, in_features: int, out_features: int, tp: TP = TP()):
        if out_features % tp.size:
            raise ConfigError(f"{out_features} output features do not split over {tp.size} ranks")
        super().__init__(in_features, out_features // tp.size, bias=False)
        self.tp = tp


class RowParallelLinear(nn.Linear):
    """y = sum_r x_r W_r^T, W_r = columns [r*in/tp, (r+1)*in/tp) of W [out, in], x_r the matching
    slice of the input (this rank's heads): a partial product, then one all-reduce."""

    def __init__(self, in_features: int, out_features: int, tp: TP = TP()):
        if in_features % tp.size:
            raise ConfigError(f"{in_features} input features do not split over {tp.size} ranks")
        super().__init__(in_features // tp.size, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.tp)


class ParallelLMHead(ColumnParallelLinear):
    """Vocab-parallel lm_head: [M, d] -> logits [M, V] on rank 0, None on the other ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        local = F.linear(x, self.weight)  # [M, V / tp]
        if self.tp.size == 1:
            return local
        # An all-gather, not a gather to rank 0: NCCL all-gathers are captured in CUDA graphs
        # (the decode step's), and the logits of a decode batch are small.
        m, v = local.shape
        parts = local.new_empty(self.tp.size * m, v)  # rank r's logits in rows [r*M, (r+1)*M)
        _all_gather(parts, local.contiguous())
        if self.tp.rank:
            return None
        return parts.view(self.tp.size, m, v).permute(1, 0, 2).reshape(m, -1)


# torch 2.13 renamed all_gather_into_tensor (the GPU machine's torch 2.11 has the old name only)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---- checkpoint sharding -------------------------------------------------------------------
# (pattern on the module name, how its tensors split). "col": dim 0 by rank; "row": dim 1 by
# rank; "kv": the KV heads (dim 0) split or replicated. A module not listed is replicated.
_RULES = [
    (re.compile(r"\.self_attn\.q_proj$"), "col"),
    (re.compile(r"\.self_attn\.[kv]_proj$"), "kv"),
    (re.compile(r"\.self_attn\.o_proj$"), "row"),
    (re.compile(r"\.kda\.([qkv]_proj|[qkv]_conv1d|f_b_proj|g_b_proj|b_proj)$"), "col"),
    (re.compile(r"\.kda$"), "col"),  # A_log [H], dt_bias [H * K]: by head
    (re.compile(r"\.kda\.o_proj$"), "row"),
    (re.compile(r"\.mlp\.(gate_proj|up_proj)$"), "col"),
    (re.compile(r"\.mlp\.down_proj$"), "row"),
    (re.compile(r"^lm_head$"), "col"),
]
_SUFFIXES = ("weight", "qweight", "scales", "zeros", "A_log", "dt_bias")


def shard_rule(name: str) -> str | None:
    """'col' | 'row' | 'kv' | None (replicated) for checkpoint tensor `name`."""
    module, _, leaf = name.rpartition(".")
    if leaf not in _SUFFIXES:
        return None
    for pattern, rule in _RULES:
        if pattern.search(module):
            return rule
    return None


def check_tp(cfg: VolundrConfig, tp: int) -> None:
    """Raises ConfigError naming every size of `cfg` that does not split over `tp` ranks."""
    if tp < 1:
        raise ConfigError("tensor_parallel_size must be >= 1")
    if tp == 1:
        return
    bad = [f"{what}={n}" for what, n in (
        ("num_attention_heads", cfg.num_attention_heads), ("kda.num_heads", cfg.kda.num_heads),
        ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)) if n % tp]
    kvh = cfg.num_key_value_heads
    if kvh % tp and tp % kvh:
        bad.append(f"num_key_value_heads={kvh} (needs a multiple or a divisor of {tp})")
    q = cfg.quantization
    if q is not None:
        for what, n in (("attention o_proj", cfg.num_attention_heads * cfg.head_dim),
                        ("KDA o_proj", cfg.kda.num_heads * cfg.kda.head_dim),
                        ("MLP down_proj", cfg.intermediate_size)):
            g = 1 << (min(q.group_size, n).bit_length() - 1)  # the quantizer's group: the
            while g > 1 and n % g:                             # largest power of two <= the
                g //= 2                                        # group size dividing n
            if n % g or (n // g) % tp:
                bad.append(f"{what}: {n // g} groups of {g} inputs do not split over {tp}")
    if bad:
        raise ConfigError(f"this model does not split over {tp} tensor-parallel ranks: "
                          + ", ".join(bad))


def shard_tensor(cfg: VolundrConfig, name: str, t: torch.Tensor, rank: int,
                 tp: int) -> torch.Tensor:
    """Rank `rank`'s part of checkpoint tensor `name` (a view)."""
    rule = shard_rule(name) if tp > 1 else None
    if rule is None:
        return t
    if rule == "row":
        return t.chunk(tp, dim=1)[rank] if t.shape[1] % tp == 0 else _uneven(name, t, tp)
    if rule == "kv" and tp > cfg.num_key_value_heads:
        kvh = cfg.num_key_value_heads
        rows = t.shape[0] // kvh  # one KV head's rows (head_dim, or its packed equivalent)
        head = rank * kvh // tp  # the KV head that this rank's q heads read
        return t[head * rows:(head + 1) * rows]
    return t.chunk(tp, dim=0)[rank] if t.shape[0] % tp == 0 else _uneven(name, t, tp)


def _uneven(name: str, t: torch.Tensor, tp: int):
    raise ConfigError(f"{name} {tuple(t.shape)} does not split over {tp} ranks")


def shard_state_dict(cfg: VolundrConfig, sd: dict[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of `tp`'s checkpoint: split tensors sliced (contiguous: views along dim 0,
    copies along dim 1), the rest as they are. With tied embeddings the lm_head shard is cut
    from the embedding rows."""
    check_tp(cfg, tp)
    out = {name: shard_tensor(cfg, name, t, rank, tp).contiguous() for name, t in sd.items()}
    if tp > 1 and cfg.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = shard_tensor(cfg, "lm_head.weight",
                                             sd["model.embed_tokens.weight"], rank, tp)
    return out


def rank_config(cfg: VolundrConfig, tp: int) -> VolundrConfig:
    """The config whose model is one rank's share (for memory planning): local attention, KV,
    KDA heads and MLP width. The vocabulary stays whole (a conservative lm_head estimate)."""
    if tp == 1:
        return cfg
    check_tp(cfg, tp)
    return cfg.replace(num_attention_heads=cfg.num_attention_heads // tp,
                       num_key_value_heads=local_kv_heads(cfg.num_key_value_heads, tp),
                       intermediate_size=cfg.intermediate_size // tp,
                       kda=dataclasses.replace(cfg.kda, num_heads=cfg.kda.num_heads // tp))

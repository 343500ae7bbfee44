"""Named model configurations and their random initialisation.

Presets: `tiny` and `draft-tiny` (tests, demo; vocabulary of the shipped tokenizer), `volundr-32b`
and `volundr-draft` (the sizes of ../shared/VOLUNDR.md), and `volundr-32b-q` (volundr-32b with a
mixed 2/3/4-bit quantization_config of about 3.2 bits per weight incl. group scales, for memory
planning; no quantized weights are generated).

Initialisation (per tensor, see `init_tensor`) keeps activations well scaled in a random model:
linear weights N(0, 1/sqrt(fan_in)), residual-output projections (o_proj, down_proj) scaled by
1/sqrt(2) more, norms 1, A_log = log U(1, 16), dt_bias = softplus^-1(dt) with dt log-uniform in
[1e-3, 0.1], conv taps N(0, 1/sqrt(conv_size)), embeddings and Engram tables N(0, 1), lm_head
N(0, 1/sqrt(hidden)) with each row scaled by exp(N(0, 0.3^2)). On tiny this gives every mixer and
MLP an output of ~0.4 rms against the embedding's 1 (the context matters, so state bugs change
the argmax), varied greedy outputs, and a median top-2 logit gap of ~0.4 (~0.2
without the row scaling).
Each tensor draws from its own generator seeded by (seed, name), so a tensor's values do not
depend on which other tensors are built.
"""

from __future__ import annotations

import math
import random
import zlib

import torch

from volundr.config import (
    EngramConfig,
    KDAConfig,
    MTPConfig,
    QuantConfig,
    VisionConfig,
    VolundrConfig,
)
from volundr.model.weights import HOST_PARTS, TensorSpec, expected_tensors

PRESETS = ("tiny", "draft-tiny", "volundr-32b", "volundr-32b-q", "volundr-draft")
LM_HEAD_ROW_SIGMA = 0.3


def hash_seeds(n: int, seed: int = 0) -> tuple[int, ...]:
    """n distinct odd Engram hash seeds < 2**31, fixed by `seed`."""
    rng = random.Random(f"volundr-engram-{seed}")
    out: list[int] = []
    while len(out) < n:
        s = rng.randrange(1 << 20, 1 << 31) | 1
        if s not in out:
            out.append(s)
    return tuple(out)


def get_config(name: str, *, vocab_size: int | None = None, eos_token_id=(2, 0),
               pad_token_id: int = 0, seed: int = 0) -> VolundrConfig:
    """The config of preset `name`. Tiny presets take the vocabulary size and special ids from
    the tokenizer (`vocab_size` None = the shipped tokenizer's 4096)."""
    eos = tuple(eos_token_id)
    if name in ("tiny", "draft-tiny"):
        vocab = vocab_size or 4096
        common = dict(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      full_attention_interval=4, rms_norm_eps=1e-6,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      eos_token_id=eos, pad_token_id=pad_token_id)
        if name == "tiny":
            return VolundrConfig(
                hidden_size=64, num_hidden_layers=8, intermediate_size=128,
                kda=KDAConfig(num_heads=4, head_dim=16, conv_size=4, low_rank_dim=16),
                engram=EngramConfig(layers=(1, 5), ngram_orders=(2, 3), heads_per_order=4,
                                    rows_per_head=1009, dim=16, conv_size=4, pad_id=pad_token_id,
                                    hash_seeds=hash_seeds(8, seed)),
                mtp=MTPConfig(num_layers=1), **common)
        return VolundrConfig(
            hidden_size=32, num_hidden_layers=4, intermediate_size=64,
            kda=KDAConfig(num_heads=4, head_dim=16, conv_size=4, low_rank_dim=16),
            engram=EngramConfig(layers=()), mtp=MTPConfig(num_layers=0), **common)
    # Full sizes: the shipped tokenizer is not theirs; their special ids follow the same order.
    common = dict(vocab_size=vocab_size or 262144, full_attention_interval=4, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, tie_word_embeddings=False,
                  eos_token_id=eos, pad_token_id=pad_token_id)
    if name in ("volundr-32b", "volundr-32b-q"):
        cfg = VolundrConfig(
            hidden_size=5120, num_hidden_layers=72, intermediate_size=17408,
            num_attention_heads=40, num_key_value_heads=2, head_dim=128,
            kda=KDAConfig(num_heads=40, head_dim=128, conv_size=4, low_rank_dim=128),
            engram=EngramConfig(layers=(1, 15), ngram_orders=(2, 3), heads_per_order=4,
                                rows_per_head=524288, dim=256, conv_size=4, pad_id=pad_token_id,
                                hash_seeds=hash_seeds(8, seed)),
            mtp=MTPConfig(num_layers=1), vision=VisionConfig(), **common)
        return cfg.replace(quantization=mixed_quantization(cfg)) if name.endswith("-q") else cfg
    if name == "volundr-draft":
        return VolundrConfig(
            hidden_size=1024, num_hidden_layers=16, intermediate_size=3072,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            kda=KDAConfig(num_heads=8, head_dim=128, conv_size=4, low_rank_dim=128),
            engram=EngramConfig(layers=()), mtp=MTPConfig(num_layers=0), **common)
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def mixed_quantization(cfg: VolundrConfig) -> QuantConfig:
    """A mixed-precision plan of about 3.2 bits/weight (incl. scales), as in VOLUNDR.md: MLPs of
    the middle half of the layers at 2 bits, the other MLPs at 3, every other linear at 4."""
    n = cfg.num_hidden_layers
    bits: dict[str, int] = {}
    for name, spec in expected_tensors(cfg).items():
        if not spec.linear or not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        bits[module] = 4
        if ".mlp." in module and module.startswith("model.layers."):
            layer = int(module.split(".")[2])
            bits[module] = 2 if n // 4 <= layer < n - n // 4 else 3
    return QuantConfig(method="volundr-mixed", group_size=128, bits=bits)


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


@torch.no_grad()
def init_tensor(name: str, spec: TensorSpec, cfg: VolundrConfig, seed: int,
                device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One tensor of a random checkpoint, shape `spec.shape`, built on `device` in row chunks
    (fp32 draws, at most ~64M elements at a time, then cast to `dtype`)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_tensor_seed(seed, name))
    shape = spec.shape
    leaf = name.rsplit(".", 1)[-1]
    mod = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    if leaf == "A_log":
        u = torch.rand(shape, generator=gen, device=device) * 15 + 1
        return u.log().to(dtype)
    if leaf == "dt_bias":
        lo, hi = math.log(1e-3), math.log(0.1)
        dt = (torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo).exp()
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)  # softplus^-1(dt)
    if "conv1d" in mod:
        std = 1.0 / math.sqrt(shape[-1])
    elif spec.part in HOST_PARTS:
        std = 1.0
    elif name == "lm_head.weight":
        std = 1.0 / math.sqrt(cfg.hidden_size)
    elif len(shape) == 2:
        std = 1.0 / math.sqrt(shape[1])
        if mod in ("o_proj", "down_proj"):
            std /= math.sqrt(2)
    else:
        raise ValueError(f"no init rule for tensor {name} {shape}")
    out = torch.empty(shape, device=device, dtype=dtype)
    rows = shape[0]
    row_scale = None
    if name == "lm_head.weight":
        # log-normal row norms give the logits a heavier top tail: larger top-2 gaps (median
        # ~0.4 instead of ~0.2 logits on tiny) while greedy outputs stay varied.
        row_scale = torch.exp(LM_HEAD_ROW_SIGMA * torch.randn(
            (rows, *[1] * (len(shape) - 1)), generator=gen, device=device))
    per_row = max(1, out.numel() // max(rows, 1))
    step = max(1, (64 << 20) // per_row)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        chunk = torch.randn((r1 - r0, *shape[1:]), generator=gen, device=device)
        if row_scale is not None:
            chunk *= row_scale[r0:r1]
        out[r0:r1] = (chunk * std).to(dtype)
    return out


def random_state_dict(cfg: VolundrConfig, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      parts: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of `cfg`, built one at a time straight on `device`.
    Embedding and Engram tables end up on the CPU (drawn on `device` and copied, one tensor at a
    time: a GPU draws the 3.5 B host parameters of volundr-32b far faster than the CPU).
    `parts` limits it to some parts (e.g. ("compute", "mtp")). Values depend on the device's
    generator: a CPU build equals the tiny checkpoint of the same seed, a CUDA build does not."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in expected_tensors(cfg).items():
        if parts is not None and spec.part not in parts:
            continue
        t = init_tensor(name, spec, cfg, seed, device, dtype)
        out[name] = t.cpu() if spec.part in HOST_PARTS else t
    return out

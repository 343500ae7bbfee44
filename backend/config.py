"""Model configuration: one frozen, validated dataclass read from a checkpoint's config.json.

Every size of Volundr lives here (see ../shared/VOLUNDR.md); nothing else in the project
hard-codes a dimension. `VolundrConfig.from_dict` rejects a config.json that is inconsistent,
naming the field, so a bad checkpoint fails at load time with a clear message.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """config.json is missing a field or holds an inconsistent value."""


def _next_primes(start: int, count: int) -> list[int]:
    """The `count` smallest distinct primes >= start (Engram table sizes, one per head)."""

    def is_prime(n: int) -> bool:
        if n < 2:
            return False
        if n % 2 == 0:
            return n == 2
        i = 3
        while i * i <= n:
            if n % i == 0:
                return False
            i += 2
        return True

    out, n = [], max(2, start)
    while len(out) < count:
        if is_prime(n):
            out.append(n)
        n += 1
    return out


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_size: int = 4
    low_rank_dim: int = 0  # rank of the f (gate) and g (output gate) projections; 0 -> head_dim

    @property
    def rank(self) -> int:
        return self.low_rank_dim or self.head_dim


@dataclass(frozen=True)
class EngramConfig:
    layers: tuple[int, ...] = ()
    ngram_orders: tuple[int, ...] = (2, 3)
    heads_per_order: int = 4
    rows_per_head: int = 524288
    dim: int = 256
    conv_size: int = 4
    pad_id: int = 0
    # One seed per (order, head), order-major: the multiplicative-XOR hash of VOLUNDR.md.
    hash_seeds: tuple[int, ...] = ()

    @property
    def num_tables(self) -> int:
        return len(self.ngram_orders) * self.heads_per_order

    @property
    def table_sizes(self) -> list[int]:
        """Rows of each of the num_tables tables: distinct primes >= rows_per_head."""
        return _next_primes(self.rows_per_head, self.num_tables)

    @property
    def max_order(self) -> int:
        return max(self.ngram_orders) if self.ngram_orders else 1


@dataclass(frozen=True)
class MTPConfig:
    num_layers: int = 0


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    merge_size: int = 2
    max_pixels: int = 1003520


@dataclass(frozen=True)
class QuantConfig:
    method: str = "volundr-mixed"
    group_size: int = 128
    bits: dict[str, int] = field(default_factory=dict)  # module name -> 2 | 3 | 4


@dataclass(frozen=True)
class VolundrConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    kda: KDAConfig
    engram: EngramConfig
    mtp: MTPConfig = MTPConfig()
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int = 0
    vision: VisionConfig | None = None
    quantization: QuantConfig | None = None
    model_type: str = "volundr"

    # ---- derived layout -------------------------------------------------------------------
    def is_attention(self, layer: int) -> bool:
        """Layer i is full attention iff i % interval == interval - 1 (3, 7, 11, ... for 4)."""
        return layer % self.full_attention_interval == self.full_attention_interval - 1

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_attention(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_attention(i)]

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every attention layer for one token (18 KiB for Volundr-32B)."""
        return len(self.attention_layers) * 2 * self.num_key_value_heads * self.head_dim * 2

    @property
    def kda_state_bytes(self) -> int:
        """fp32 recurrent state + bf16 conv tails of all KDA layers for one sequence."""
        k = self.kda
        state = k.num_heads * k.head_dim * k.head_dim * 4
        conv = 3 * k.num_heads * k.head_dim * (k.conv_size - 1) * 2
        return len(self.kda_layers) * (state + conv)

    # ---- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VolundrConfig:
        d = dict(d)
        if d.get("model_type", "volundr") != "volundr":
            raise ConfigError(f"config.json: model_type is {d.get('model_type')!r}, not 'volundr'")
        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "kda",
        ]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json: missing field(s) {', '.join(missing)}")

        def sub(klass, value):
            if value is None:
                return None
            if not isinstance(value, dict):
                raise ConfigError(f"config.json: {klass.__name__} must be an object")
            names = {f.name for f in dataclasses.fields(klass)}
            unknown = set(value) - names
            if unknown:
                raise ConfigError(f"config.json: unknown field(s) {sorted(unknown)} in "
                                  f"{klass.__name__}")
            value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
            return klass(**value)

        eos = d.get("eos_token_id", ())
        qc = d.get("quantization_config")
        if qc is not None:
            qc = QuantConfig(method=qc.get("method", "volundr-mixed"),
                             group_size=int(qc.get("group_size", 128)),
                             bits={k: int(v) for k, v in qc.get("bits", {}).items()})
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(d["head_dim"]),
            kda=sub(KDAConfig, d["kda"]),
            engram=sub(EngramConfig, d.get("engram", {})) or EngramConfig(),
            mtp=sub(MTPConfig, d.get("mtp", {})) or MTPConfig(),
            full_attention_interval=int(d.get("full_attention_interval", 4)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_id=tuple(eos) if isinstance(eos, list) else (int(eos),),
            pad_token_id=int(d.get("pad_token_id", 0) or 0),
            vision=sub(VisionConfig, d.get("vision_config")),
            quantization=qc,
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> VolundrConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        def plain(obj):
            if obj is None:
                return None
            return {k: list(v) if isinstance(v, tuple) else v
                    for k, v in dataclasses.asdict(obj).items()}

        d: dict[str, Any] = {
            "model_type": "volundr",
            "architectures": ["VolundrForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "full_attention_interval": self.full_attention_interval,
            "kda": plain(self.kda),
            "engram": plain(self.engram),
            "mtp": plain(self.mtp),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.vision is not None:
            d["vision_config"] = plain(self.vision)
        if self.quantization is not None:
            q = self.quantization
            d["quantization_config"] = {"method": q.method, "group_size": q.group_size,
                                        "bits": dict(q.bits)}
        return d

    def replace(self, **kw: Any) -> VolundrConfig:
        return dataclasses.replace(self, **kw)

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config.json: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            need(getattr(self, name) > 0, f"{name} must be positive")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.full_attention_interval >= 1, "full_attention_interval must be >= 1")
        need(self.kda.num_heads > 0 and self.kda.head_dim > 0, "kda sizes must be positive")
        need(self.kda.conv_size >= 2, "kda.conv_size must be >= 2")
        e = self.engram
        for layer in e.layers:
            need(0 <= layer < self.num_hidden_layers, f"engram layer {layer} out of range")
        if e.layers:
            need(len(e.hash_seeds) == e.num_tables,
                 f"engram.hash_seeds needs {e.num_tables} seeds (orders x heads_per_order), "
                 f"has {len(e.hash_seeds)}")
            need(all(o >= 1 for o in e.ngram_orders), "engram.ngram_orders must be >= 1")
            need(e.rows_per_head >= 2 and e.dim > 0, "engram sizes must be positive")
            need(0 <= e.pad_id < self.vocab_size, "engram.pad_id must be a token id")
        need(self.mtp.num_layers in (0, 1), "mtp.num_layers must be 0 or 1")
        for t in self.eos_token_id:
            need(0 <= t < self.vocab_size, f"eos_token_id {t} out of the vocabulary")
        if self.quantization is not None:
            need(self.quantization.method == "volundr-mixed",
                 f"unknown quantization method {self.quantization.method!r}")
            for m, b in self.quantization.bits.items():
                need(b in (2, 3, 4, 8), f"quantization bits of {m} must be 2, 3, 4 or 8")

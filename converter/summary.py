"""`python -m volundr.converter inspect DIR|--preset NAME [--gpu-gib G] [--json]`.

Architecture, parameter counts by part and the memory plan (volundr.memory) of a checkpoint.
Only config.json is read, so it works for a directory without weights and for presets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from volundr.config import VolundrConfig
from volundr.memory import plan_memory
from volundr.model.weights import count_parameters

PARTS = ("compute", "embedding", "engram", "mtp", "vision")


def _config(args: argparse.Namespace) -> tuple[VolundrConfig, str]:
    if args.preset and args.model_dir:
        raise ValueError("give either a checkpoint directory or --preset, not both")
    if args.preset:
        from volundr.converter.presets import get_config

        return get_config(args.preset), f"preset {args.preset}"
    if not args.model_dir:
        raise ValueError("give a checkpoint directory (or --preset NAME)")
    p = Path(args.model_dir)
    if not p.exists():
        from volundr.converter.loader import resolve_model_dir

        p = resolve_model_dir(args.model_dir, allow_patterns=["config.json"])
    return VolundrConfig.from_json(p), str(p)


def summary(cfg: VolundrConfig, plan) -> dict:
    counts = count_parameters(cfg)
    e = cfg.engram
    return {
        "architecture": {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "intermediate_size": cfg.intermediate_size,
            "attention_layers": cfg.attention_layers, "kda_layers": cfg.kda_layers,
            "attention_heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim],
            "kda_heads": [cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_size,
                          cfg.kda.rank],
            "engram_layers": list(e.layers),
            "engram_tables": [len(e.table_sizes), e.rows_per_head, e.dim] if e.layers else [],
            "mtp_layers": cfg.mtp.num_layers,
            "vision": cfg.vision is not None,
            "quantization": None if cfg.quantization is None else {
                "method": cfg.quantization.method, "group_size": cfg.quantization.group_size,
                "num_quantized": len(cfg.quantization.bits)},
            "max_position_embeddings": cfg.max_position_embeddings,
        },
        "parameters": {p: counts.get(p, 0) for p in PARTS} | {"total": sum(counts.values())},
        "memory": plan.as_dict(),
    }


def _fmt_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def render(source: str, cfg: VolundrConfig, s: dict, plan) -> str:
    a, p = s["architecture"], s["parameters"]
    h, kvh, hd = a["attention_heads"]
    kh, kd, kc, kr = a["kda_heads"]
    lines = [
        f"Volundr checkpoint: {source}",
        f"  vocab {a['vocab_size']:,}, hidden {a['hidden_size']}, layers "
        f"{a['num_hidden_layers']}, intermediate {a['intermediate_size']}, "
        f"max positions {a['max_position_embeddings']:,}",
        f"  attention layers ({len(a['attention_layers'])}): {a['attention_layers']}"
        f" - {h} heads / {kvh} KV heads x {hd}",
        f"  KDA layers ({len(a['kda_layers'])}): {a['kda_layers']}"
        f" - {kh} heads x {kd}, conv {kc}, rank {kr}",
        f"  Engram layers: {a['engram_layers'] or 'none'}"
        + (f" - {a['engram_tables'][0]} tables x ~{a['engram_tables'][1]:,} rows x "
           f"{a['engram_tables'][2]}" if a["engram_layers"] else ""),
        f"  MTP layers: {a['mtp_layers']}, vision: {'yes' if a['vision'] else 'no'}"
        + (f", quantized linears: {a['quantization']['num_quantized']}"
           if a["quantization"] else ""),
        "Parameters:",
    ]
    for part in PARTS + ("total",):
        note = ""
        if part == "vision" and cfg.vision is not None and p["vision"] == 0:
            note = "  (vision_config present; its tensors come with the vision tower)"
        lines.append(f"  {part:<10} {_fmt_count(p[part]):>10}  ({p[part]:,}){note}")
    lines.append("Memory plan:")
    lines += ["  " + line for line in plan.describe().splitlines()]
    return "\n".join(lines)


def inspect_main(args: argparse.Namespace) -> int:
    cfg, source = _config(args)
    import torch

    from volundr.engine import kv_cache_torch_dtype

    kv_dtype = kv_cache_torch_dtype(getattr(args, "kv_cache_dtype", "auto"), torch.bfloat16)
    plan = plan_memory(cfg, args.gpu_gib, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kv_dtype=kv_dtype)
    s = summary(cfg, plan)
    if args.json:
        print(json.dumps({"source": source, **s}, indent=2))
    else:
        print(render(source, cfg, s, plan))
    return 0

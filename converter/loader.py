"""Find and load a Volundr checkpoint, checking every tensor against config.json.

`resolve_model_dir` takes a local directory or a Hugging Face repo id (fetched with
`huggingface_hub.snapshot_download`). `load_checkpoint` reads model.safetensors or a sharded
checkpoint (model.safetensors.index.json + shards), compares names and shapes with
`expected_tensors(cfg)` before reading any data, and raises `CheckpointError` naming every
missing, unexpected and wrong-shaped tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from volundr.config import VolundrConfig
from volundr.model.weights import HOST_PARTS, expected_tensors

QUANT_SUFFIXES = ("qweight", "scales", "zeros")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config.json."""


class ModelNotFoundError(FileNotFoundError):
    """Neither a local checkpoint directory nor a reachable Hugging Face repo."""


def resolve_model_dir(name_or_path: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local checkpoint directory, or the snapshot directory of Hugging Face repo `owner/name`
    (only the files matching `allow_patterns`, default HUB_PATTERNS, are fetched)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    s = str(name_or_path)
    if p.exists():
        raise ModelNotFoundError(f"{s} is a file; pass a checkpoint directory")
    if not _REPO_ID.match(s) or s.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"no checkpoint directory {s!r} (and it is not a Hugging Face "
                                 "repo id of the form owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=s,
                                      allow_patterns=allow_patterns or HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, network error: all end here
        raise ModelNotFoundError(
            f"{s!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "The hub may be unreachable or offline (HF_HUB_OFFLINE); pass a local checkpoint "
            "directory instead (e.g. one written by `python -m volundr.converter tiny DIR`)."
        ) from None


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).exists()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are not there: "
                                  f"{', '.join(missing)}")
        return {name: model_dir / f for name, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    files = [single] if single.exists() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors, "
                              "model.safetensors.index.json or *.safetensors")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            present = set(sf.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"index maps {name} to {f.name}, which lacks it")
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


def check_tensors(cfg: VolundrConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError listing every missing, unexpected and wrong-shaped tensor."""
    expected = expected_tensors(cfg)
    quant = cfg.quantization.bits if cfg.quantization is not None else {}
    missing, wrong = [], []
    allowed: set[str] = set()
    for name, spec in expected.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in quant and name not in shapes:
            qnames = [f"{module}.{s}" for s in QUANT_SUFFIXES]
            allowed.update(qnames)
            missing += [q for q in qnames if q not in shapes]
            continue
        allowed.add(name)
        if name not in shapes:
            missing.append(name)
        elif shapes[name] != spec.shape:
            wrong.append(f"{name}: expected {list(spec.shape)}, found {list(shapes[name])}")
    unexpected = sorted(set(shapes) - allowed)
    if missing or wrong or unexpected:
        lines = ["checkpoint does not match config.json:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if wrong:
            lines.append(f"  wrong shape ({len(wrong)}): " + "; ".join(wrong))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        raise CheckpointError("\n".join(lines))


def load_checkpoint(model_dir: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None,
                    ) -> tuple[VolundrConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a checkpoint directory (or HF repo id).

    Compute tensors go to `device`; embedding and Engram tables stay on the CPU. Floating
    tensors are cast to `dtype` when given (packed quantized weights keep theirs).
    """
    d = resolve_model_dir(model_dir)
    cfg = VolundrConfig.from_json(d / "config.json")
    files = _weight_files(d)
    check_tensors(cfg, _shapes(files))
    parts = {n: s.part for n, s in expected_tensors(cfg).items()}
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in names:
                t = sf.get_tensor(name)
                if dtype is not None and t.is_floating_point() and not name.endswith(".qweight"):
                    t = t.to(dtype)
                if parts.get(_base_name(name)) not in HOST_PARTS:
                    t = t.to(device)
                tensors[name] = t
    return cfg, tensors


def _base_name(name: str) -> str:
    """The expected_tensors name behind a quantized tensor name (X.qweight -> X.weight)."""
    for s in QUANT_SUFFIXES:
        if name.endswith("." + s):
            return name[: -len(s)] + "weight"
    return name

"""The model repository: the copy in git stays valid; `volundr-serve` writes a filled copy.

Each Python model reads its `parameters` (model_dir, profile values) from its config.pbtxt; the
runtime copy gets them filled in, so one checkout can serve any checkpoint without edits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

MODELS = ("preprocessing", "volundr_llm", "postprocessing", "volundr")
_PARAM = re.compile(r'(parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"\s*value:\s*\{\s*'
                    r'string_value:\s*)"(?P<val>(?:[^"\\]|\\.)*)"')


def source_repository() -> Path:
    """model_repository/ of this checkout (the package is installed editable from it)."""
    return Path(__file__).resolve().parents[2] / "model_repository"


def model_parameters(model_config: str | dict) -> dict[str, str]:
    """{key: string_value} of a model's config (Triton passes it to initialize() as JSON)."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    return {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}


def resolve_model_dir(value: str) -> Path:
    """The checkpoint directory from a filled parameter, else $VOLUNDR_MODEL_DIR."""
    value = value or os.environ.get("VOLUNDR_MODEL_DIR", "")
    if not value:
        raise RuntimeError("model_dir is empty: start the server with `volundr-serve`, which fills "
                           "config.pbtxt, or set VOLUNDR_MODEL_DIR")
    path = Path(value)
    if not (path / "tokenizer.json").exists():
        raise RuntimeError(f"model_dir {value!r} has no tokenizer.json")
    return path


def _pbtxt_string(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def fill_parameters(text: str, values: dict[str, str]) -> str:
    """Set the string_value of existing `parameters` entries; unknown keys are an error."""
    seen: set[str] = set()

    def sub(m: re.Match) -> str:
        key = m.group("key")
        if key not in values:
            return m.group(0)
        seen.add(key)
        return f'{m.group(1)}"{_pbtxt_string(str(values[key]))}"'

    out = _PARAM.sub(sub, text)
    missing = set(values) - seen
    if missing:
        raise KeyError(f"config.pbtxt has no parameters {sorted(missing)}")
    return out


def set_max_inflight(text: str, n: int) -> str:
    """Add `max_inflight_requests` to ensemble_scheduling (only newer Triton releases know it)."""
    head = f"ensemble_scheduling {{\n  max_inflight_requests: {n}"
    return re.sub(r"ensemble_scheduling\s*\{", head, text, count=1)


def write_runtime_repository(dest: Path, params: dict[str, dict[str, str]],
                             max_inflight: int | None = None, src: Path | None = None) -> Path:
    """Copy the repository to `dest` with `params[model]` filled into each config.pbtxt."""
    src = src or source_repository()
    if not (src / "volundr" / "config.pbtxt").exists():
        raise FileNotFoundError(f"no model repository at {src}")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for model in MODELS:
        cfg = dest / model / "config.pbtxt"
        text = fill_parameters(cfg.read_text(), params.get(model, {}))
        if model == "volundr" and max_inflight:
            text = set_max_inflight(text, max_inflight)
        cfg.write_text(text)
    return dest

"""Request tensors of `volundr_llm` -> prompt ids, SamplingParams, stop strings, stream flag.

Names follow the TRT-LLM ensemble where one exists. Every error is a ValueError whose message
starts with "invalid request:" or "prompt too long:" (the proxy maps both to HTTP 400).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from volundr.sampling_params import SamplingParams
from volundr.serve.stop import validate_stops
from volundr.session import MAX_SESSION_ID_CHARS

Getter = Callable[[str], "np.ndarray | None"]


@dataclass(frozen=True)
class LLMRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    session_id: str | None = None  # park / resume the engine state under it (volundr.session)
    priority: int = 0  # lower is admitted first


@dataclass(frozen=True)
class ControlRequest:
    abort_request_id: str | None  # abort the generation started with this Triton request id
    return_stats: bool
    close_session_id: str | None = None  # drop this session's parked state (volundr.session)


def generation_defaults(model_dir: str | Path) -> dict:
    """temperature / top_p / top_k / min_p (do_sample false: temperature 0) and
    repetition_penalty from generation_config.json, used when a request does not set them."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    cfg = json.loads(path.read_text())
    keys = ("temperature", "top_p", "top_k", "min_p")
    out = ({"temperature": 0.0} if cfg.get("do_sample") is False
           else {k: cfg[k] for k in keys if k in cfg})
    if "repetition_penalty" in cfg:
        out["repetition_penalty"] = cfg["repetition_penalty"]
    return out


def _bad(msg: str) -> ValueError:
    return ValueError(f"invalid request: {msg}")


def _scalar(get: Getter, name: str):
    arr = get(name)
    if arr is None or arr.size == 0:
        return None
    if arr.size != 1:
        raise _bad(f"{name} must hold one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _strings(arr: np.ndarray | None, name: str) -> list[str]:
    if arr is None:
        return []
    out = []
    for v in arr.reshape(-1):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise _bad(f"{name} is not valid UTF-8") from None
        out.append(str(v))
    return out


def parse_control(get: Getter) -> ControlRequest | None:
    """A control request (no generation): `abort_request_id`, `close_session_id` and/or
    `return_stats`."""
    abort = _strings(get("abort_request_id"), "abort_request_id")
    close = _strings(get("close_session_id"), "close_session_id")
    stats = _scalar(get, "return_stats")
    if not abort and not close and not bool(stats):
        return None
    return ControlRequest(abort[0] if abort else None, bool(stats), close[0] if close else None)


def parse_llm_request(get: Getter, max_model_len: int, defaults: dict | None = None
                      ) -> LLMRequest:
    ids = get("input_ids")
    if ids is None or ids.size == 0:
        raise _bad("input_ids is required (or send return_stats / abort_request_id)")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise _bad(f"send one sequence per request (batch size 1), got {ids.shape[0]}")
    prompt = [int(t) for t in ids.reshape(-1)]
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt too long: the prompt has {len(prompt)} tokens; this model's "
                         f"context is {max_model_len} tokens, including the output")
    d = dict(defaults or {})
    max_tokens = _scalar(get, "max_tokens")
    if max_tokens is None or int(max_tokens) == 0:  # 0 / absent: up to the end of the context
        max_tokens = max_model_len - len(prompt)
    seed = _scalar(get, "seed")
    if seed is None:
        seed = _scalar(get, "random_seed")
    top_k = _scalar(get, "top_k")
    stop_ids = get("stop_token_ids")
    kw = {
        "max_tokens": int(max_tokens),
        "temperature": float(_opt(_scalar(get, "temperature"), d.get("temperature", 1.0))),
        "top_p": float(_opt(_scalar(get, "top_p"), d.get("top_p", 1.0))),
        "top_k": int(_opt(top_k, d.get("top_k", 0))),
        "min_p": float(_opt(_scalar(get, "min_p"), d.get("min_p", 0.0))),
        "seed": None if seed is None else int(seed),
        "stop_token_ids": () if stop_ids is None else tuple(int(t) for t in stop_ids.reshape(-1)),
        "ignore_eos": bool(_opt(_scalar(get, "ignore_eos"), False)),
        "min_tokens": int(_opt(_scalar(get, "min_tokens"), 0)),
        "presence_penalty": float(_opt(_scalar(get, "presence_penalty"), 0.0)),
        "frequency_penalty": float(_opt(_scalar(get, "frequency_penalty"), 0.0)),
        "repetition_penalty": float(_opt(_scalar(get, "repetition_penalty"),
                                         d.get("repetition_penalty", 1.0))),
        "logit_bias": _logit_bias(_strings(get("logit_bias"), "logit_bias")),
        "logprobs": _opt_int(_scalar(get, "top_logprobs")),
        "json_schema": next(iter(_strings(get("json_schema"), "json_schema")), None) or None,
        "grammar": next(iter(_strings(get("grammar"), "grammar")), None) or None,
    }
    if kw["top_p"] == 0.0:
        kw["top_p"] = 1.0  # TRT-LLM clients send 0 for "off"
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        raise _bad(str(e)) from None
    try:
        stops = validate_stops(_strings(get("stop"), "stop"))
    except ValueError as e:
        raise _bad(str(e)) from None
    stream = bool(_opt(_scalar(get, "stream"), False))
    session = _strings(get("session_id"), "session_id")
    if len(session) > 1 or any(len(s) > MAX_SESSION_ID_CHARS for s in session):
        raise _bad(f"session_id must be one string of at most {MAX_SESSION_ID_CHARS} characters")
    priority = int(_opt(_scalar(get, "priority"), 0))
    return LLMRequest(prompt, params, stops, stream, session[0] if session else None, priority)


def _logit_bias(texts: list[str]) -> dict[int, float]:
    """OpenAI's logit_bias as JSON text, {"token id": bias}; none: {}."""
    if not texts or not texts[0]:
        return {}
    try:
        obj = json.loads(texts[0])
        if not isinstance(obj, dict):
            raise ValueError
        return {int(k): float(v) for k, v in obj.items()}
    except (ValueError, TypeError):
        raise _bad('logit_bias must be a JSON object of token ids to numbers, e.g. '
                   '{"42": -100}') from None


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _opt(v, default):
    return default if v is None else v

"""OpenAI request bodies (validated with pydantic) and OpenAI-style error responses."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from volundr.chat import validate_tool_choice
from volundr.session import MAX_SESSION_ID_CHARS

# Request fields travel to Triton as INT32 / INT64 tensors: larger values must not wrap around.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Sampling options this server does not implement, with the value that means "off".
# Choices per request (`n`): each one is its own sequence in the engine.
MAX_N = 16


class APIError(Exception):
    """Raised anywhere in a handler; rendered as {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# vLLM's older names of structured_outputs' fields (guided_json: structured_outputs.json)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # Unknown fields (user, store, metadata, ...) are accepted and ignored, as agent
    # frameworks send many of them.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    # vLLM's extension: waiting requests are admitted lower values first
    priority: int | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX)
    # vLLM's: token ids that end the reply as the end-of-sequence token does (not emitted)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    # vLLM's: no end-of-sequence or stop_token_ids token before this many tokens
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)

    @field_validator("n", "stream", "ignore_eos", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):  # the OpenAI API allows null for these
        return cls.model_fields[info.field_name].default if v is None else v

    def limit(self) -> int | None:
        n = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        if n is not None and n < 1:
            field = "max_completion_tokens" if self.max_completion_tokens is not None \
                else "max_tokens"
            raise APIError(400, f"{field} must be at least 1, got {n}", param=field)
        return n

    def check(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        self.num_logprobs()
        for k, v in (self.logit_bias or {}).items():
            if not k.strip().isdigit() or not -100.0 <= v <= 100.0:
                raise APIError(400, "logit_bias maps token ids to biases in [-100, 100], got "
                               f"{k!r}: {v!r}", param="logit_bias")
        self.structured_outputs()
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids or ()):
            raise APIError(400, "stop_token_ids must be token ids (>= 0)",
                           param="stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true",
                           param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16:
            raise APIError(400, "at most 16 stop strings are supported", param="stop")
        self.limit()
        self.session_id()

    def json_schema(self) -> str | None:
        """response_format as the engine's json_schema input (JSON text of a JSON Schema the
        output must match, token by token: volundr.structured), or None for free text:
        {"type": "json_object"} is any object, {"type": "json_schema", "json_schema":
        {"name": ..., "schema": S}} is S."""
        fmt = (self.model_extra or {}).get("response_format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs json_schema.schema, a "
                               "JSON Schema object", param="response_format")
            return json.dumps(schema, ensure_ascii=False)
        raise APIError(400, f"response_format must be an object of type text, json_object or "
                       f"json_schema, got {fmt if kind is None else kind!r}",
                       param="response_format")

    def structured_outputs(self) -> tuple[str | None, str | None]:
        """(json_schema, grammar) inputs of the request: response_format (json_schema), or
        vLLM's `structured_outputs` {"json": S} / {"regex": R} / {"choice": [...]} /
        {"grammar": Lark} (extra_body; its older guided_json / guided_regex / guided_choice /
        guided_grammar fields too) -- one of them at most."""
        extra = self.model_extra or {}
        so = extra.get("structured_outputs")
        if so is not None and not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        given = {k: v for k, v in (so or {}).items() if v is not None}
        given.update({k[7:]: extra[k] for k in GUIDED if extra.get(k) is not None})
        schema = self.json_schema()
        if len(given) + (schema is not None) > 1:
            raise APIError(400, "give one of response_format (json), structured_outputs' json / "
                           "regex / choice / grammar", param="structured_outputs")
        if not given:
            return schema, None
        (kind, v), = given.items()
        if kind == "json" and isinstance(v, (dict, str)):
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), None
        if kind in ("regex", "grammar") and isinstance(v, str) and v:
            from llguidance import LLMatcher

            return None, v if kind == "grammar" else LLMatcher.grammar_from_regex(v)
        if kind == "choice" and isinstance(v, list) and v and all(isinstance(c, str) for c in v):
            return None, "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in v)
        raise APIError(400, f"structured_outputs {kind!r}: expected " + {
            "json": "a JSON Schema", "regex": "a regular expression", "grammar": "a Lark grammar",
            "choice": "a list of strings"}.get(kind, "one of json, regex, choice, grammar"),
            param="structured_outputs")

    def session_id(self) -> str | None:
        """The `session_id` extension (extra_body in the OpenAI SDK): an agent's turns under
        one id resume the engine's state of the turn before instead of re-reading the history
        (volundr.session). With n > 1 only choice 0 continues the session."""
        v = (self.model_extra or {}).get("session_id")
        if v is None:
            return None
        if not isinstance(v, str) or not 1 <= len(v) <= MAX_SESSION_ID_CHARS:
            raise APIError(400, f"session_id must be a string of 1 to {MAX_SESSION_ID_CHARS} "
                           "characters", param="session_id")
        return v

    def stops(self) -> list[str] | None:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s] or None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """Alternatives per token to return with each token's logprob (the volundr input
        top_logprobs), or None: no logprobs. Completions: `logprobs` 0-5."""
        lp = self.logprobs
        if lp is None or lp is False:
            return None
        if isinstance(lp, bool) or not 0 <= lp <= 5:
            raise APIError(400, f"logprobs must be an integer from 0 to 5, got {lp!r}",
                           param="logprobs")
        return lp


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call comes back (as vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # vLLM's: the reply continues the final (assistant) message instead of opening a new one
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's for reasoning models: none / minimal render the prompt with thinking off, low to
    # high with it on (the template's enable_thinking; chat_template_kwargs' own value wins)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def num_logprobs(self) -> int | None:
        """Chat: `logprobs` true, with `top_logprobs` (0-20) alternatives per token."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise APIError(400, "logprobs must be true or false", param="logprobs")
        n = self.top_logprobs
        if n is not None and not 0 <= n <= 20:
            raise APIError(400, f"top_logprobs must be from 0 to 20, got {n}",
                           param="top_logprobs")
        if not self.logprobs:
            if n:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return n or 0

    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def auto_session_id(self) -> str:
        """A session id from the conversation's opening (the messages up to the first user
        turn, the tools and the model), the same for every later turn of it: the proxy's
        --auto-session, for clients that send no session_id. Conversations that open alike
        share it; the engine's token check keeps that correct (a mismatch runs from scratch)."""
        first = next((i for i, m in enumerate(self.messages) if m.get("role") == "user"),
                     len(self.messages) - 1)
        key = json.dumps([self.model, self.tools, self.messages[:first + 1]], sort_keys=True,
                         ensure_ascii=False, default=str)
        return "auto-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def forced_tool_choice(self) -> str | dict | None:
        """tool_choice when it forces a call ("required" or a named function), else None."""
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        return self.tool_choice if forced and self.tools_active() else None

    def template_kwargs(self) -> dict | None:
        """chat_template_kwargs as sent to preprocessing: a forced tool_choice travels as its
        key "tool_choice" (preprocessing pre-fills the call's opening), and only the request's
        own tool_choice does, so the prompt always matches what the reply is parsed as."""
        kw = {k: v for k, v in (self.chat_template_kwargs or {}).items() if k != "tool_choice"}
        if (forced := self.forced_tool_choice()) is not None:
            kw["tool_choice"] = forced
        if self.reasoning_effort is not None:
            kw.setdefault("enable_thinking", self.reasoning_effort not in ("none", "minimal"))
        if any(self.structured_outputs()):  # the reply is the form from its first token
            kw.setdefault("enable_thinking", False)
        if not self.add_generation_prompt:
            kw["add_generation_prompt"] = False
        if self.continue_final_message:
            kw["continue_final_message"] = True
        return kw or None

    def check(self) -> None:
        super().check()
        try:  # the rule preprocessing applies too, checked here before Triton
            validate_tool_choice(self.tool_choice, self.tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if self.forced_tool_choice() is not None and any(self.structured_outputs()):
            raise APIError(400, "response_format / structured_outputs cannot be combined with "
                           "a tool_choice that forces a call (the call has its own grammar)",
                           param="response_format")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(400, "continue_final_message needs add_generation_prompt "
                               "false", param="continue_final_message")
            last = self.messages[-1]
            if not isinstance(last, dict) or last.get("role") != "assistant":
                raise APIError(400, "continue_final_message needs a final assistant message",
                               param="messages")
        if not self.add_generation_prompt and self.forced_tool_choice() is not None:
            raise APIError(400, "a tool_choice that forces a call needs add_generation_prompt "
                           "(the call opens the reply)", param="tool_choice")


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool | None = False
    # candidates generated, of which the n with the highest cumulative logprob come back
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        extra = self.model_extra or {}
        if extra.get("suffix"):  # "" and null are fine
            raise APIError(400, "suffix (text after the completion) is not supported",
                           param="suffix")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_N:
                raise APIError(400, f"best_of must be from n ({self.n}) to {MAX_N}, got "
                               f"{self.best_of}", param="best_of")
            if self.stream and self.best_of > self.n:
                raise APIError(400, "best_of > n cannot be streamed (the best are known at "
                               "the end)", param="best_of")

    def candidates(self) -> int:
        """Sequences to generate: best_of, else n."""
        return self.best_of or self.n

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, "send one prompt per request (a string)", param="prompt")
            return self.prompt[0]
        return self.prompt


def parse_body(raw: bytes | dict, kind: type[BaseModel]) -> Any:
    """A request body (bytes, or its JSON object) -> a validated request model, or
    APIError(400)."""
    data = raw if isinstance(raw, dict) else load_json(raw)
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"{loc}: {err['msg']}" if loc else err["msg"],
                       param=loc or None) from None
    req.check()
    return req


def load_json(raw: bytes) -> dict:
    """Bytes of a request body -> its JSON object, or APIError(400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte "
                       f"{e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                       f"column {e.colno}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


FinishReason = Literal["stop", "length", "tool_calls"]


def finish_reason(reason: str) -> FinishReason:
    return "length" if reason == "length" else "stop"

"""preprocessing: a raw prompt or OpenAI chat messages -> input_ids with the checkpoint's chat
template and tokenizer (dynamic batching: one execute may carry several requests)."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from volundr.chat import (
    forced_tool_prefix,
    json_grammar,
    load_chat_template,
    render_chat,
    think_first,
    tool_call_grammar,
)
from volundr.serve.repo import model_parameters, resolve_model_dir


def _text(request, name: str) -> str | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy().reshape(-1)
    if arr.size != 1:
        raise ValueError(f"invalid request: {name} must hold one string")
    v = arr[0]
    try:
        return v.decode("utf-8") if isinstance(v, bytes) else str(v)
    except UnicodeDecodeError:
        raise ValueError(f"invalid request: {name} is not valid UTF-8") from None


def _json(request, name: str, kind: type):
    raw = _text(request, name)
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid request: {name} is not valid JSON ({e})") from None
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"invalid request: {name} must be a JSON {kind.__name__}")
    return value


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_dir = resolve_model_dir(model_parameters(args["model_config"]).get("model_dir", ""))
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        try:
            self.template = load_chat_template(model_dir)
        except ValueError:
            self.template = None  # raw prompts still work; messages get a clear error
        # (a grammar names these as tokens; other tags it matches as text)
        self.specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                         if t.special}

    def _prompt(self, request) -> tuple[str, str]:
        """(the prompt, the grammar its reply must follow: the request's, its json_schema's, a
        forced or strict call's; "" for none)."""
        grammar = _text(request, "grammar") or ""
        schema = _json(request, "json_schema", dict)
        if schema is not None and grammar:
            raise ValueError("invalid request: give json_schema or grammar, not both")
        text = _text(request, "text_input")
        messages = _json(request, "messages", list)
        if (text is None) == (messages is None):
            raise ValueError("invalid request: send exactly one of text_input and messages")
        if text is not None:
            if not text:
                raise ValueError("invalid request: text_input is empty")
            try:
                return text, grammar or self._json_grammar(schema, think=False)
            except ValueError as e:
                raise ValueError(f"invalid request: {e}") from None
        if self.template is None:
            raise ValueError("invalid request: this checkpoint has no chat template; "
                             "send text_input")
        tools = _json(request, "tools", list)
        kwargs = _json(request, "chat_template_kwargs", dict) or {}
        # (vLLM's add_generation_prompt / continue_final_message travel here too: render
        # arguments, not template variables)
        gen = kwargs.pop("add_generation_prompt", True) is not False
        cont = kwargs.pop("continue_final_message", False) is True
        # Not a template variable: a tool_choice that forces a call pre-fills its opening
        # after the generation prompt (volundr.chat.forced_tool_prefix; the OpenAI proxy sends
        # it here and reads the reply as continuing it).
        tool_choice = kwargs.pop("tool_choice", None)
        try:
            if not gen and forced_tool_prefix(tool_choice):  # (its grammar assumes the prefill)
                raise ValueError("a tool_choice that forces a call needs add_generation_prompt")
            prompt = render_chat(self.template, messages, tools=tools or None,
                                 tool_choice=tool_choice, add_generation_prompt=gen,
                                 continue_final_message=cont, **kwargs)
            calls = tool_call_grammar(tools, tool_choice, self.specials)
            if calls and (grammar or schema is not None):
                raise ValueError("grammar / json_schema cannot be combined with a tool_choice "
                                 "that forces a call or strict tools (the calls have theirs)")
            # thinking on (the template's default): the reasoning first, then the value
            # (not when the reply continues a message)
            think = kwargs.get("enable_thinking", True) is not False and gen
            if grammar and think:
                grammar = think_first(grammar, self.specials)
            return prompt, grammar or calls or self._json_grammar(schema, think)
        except ValueError as e:
            raise ValueError(f"invalid request: {e}") from None
        except TypeError as e:  # e.g. chat_template_kwargs naming messages or tools
            raise ValueError(f"invalid request: chat_template_kwargs: {e}") from None

    def _json_grammar(self, schema: dict | None, think: bool) -> str:
        """The grammar of a reply matching the json_schema input ("" without one), checked
        here so that a bad schema is the request's error, named as such."""
        if schema is None:
            return ""
        grammar = json_grammar(schema, think, self.specials)
        try:
            from llguidance import LLMatcher
        except ImportError:  # (volundr_llm then says that structured output needs it)
            return grammar
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"json_schema cannot be compiled: {error}")
        return grammar

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                prompt, grammar = self._prompt(request)
                ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1)),
                pb_utils.Tensor("input_length", np.asarray([[len(ids)]], dtype=np.int32)),
                pb_utils.Tensor("grammar", np.asarray([[grammar.encode("utf-8")]],
                                                      dtype=np.object_)),
            ]))
        return responses

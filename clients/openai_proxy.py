"""OpenAI-compatible API in front of the Triton `volundr` ensemble (FastAPI + uvicorn).

    python -m volundr.clients.openai_proxy --triton-grpc 127.0.0.1:8001 --port 30000

POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (GET / DELETE
/v1/responses/{id}: openai_responses), GET /v1/models, GET /health. Streaming is SSE
ending in `data: [DONE]`. Errors are OpenAI error JSON: 400 invalid request or prompt longer
than the context, 404 unknown model, 429 server busy (backpressure), 503 Triton unavailable.
A client that disconnects gets its Triton request cancelled and its sequence aborted (blocks and
state slot freed). `n` choices are n Triton requests for the same prompt (openai_fanout), choice
i seeded with `seed` + i; a failing choice or a client gone cancels them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from volundr.clients.openai_fanout import FanOut, Item, choice_seed
from volundr.clients.openai_reasoning import add_reasoning_args
from volundr.clients.openai_render import (
    ChatRender,
    CompletionRender,
    merge_full,
    share_id,
    total_usage,
)
from volundr.clients.openai_responses import PARAMS, ResponsesCall, ResponseStore
from volundr.clients.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    load_json,
    parse_body,
)
from volundr.clients.triton import Delta, TritonRequestError, TritonUnavailable, VolundrTriton


@dataclass(frozen=True)
class ProxyConfig:
    triton_grpc: str = "127.0.0.1:8001"
    served_model_name: str = "volundr"
    max_model_len: int | None = None
    ensemble: str = "volundr"
    # Chat: a leading <think>...</think> goes to reasoning_content (off: all of it is content).
    reasoning_split: bool = True
    # The chat template opens <think> in the generation prompt (Volundr's does not), so the
    # generated text starts inside the reasoning.
    reasoning_opened: bool = False
    # Chat requests without a session_id get one from their conversation's opening
    # (ChatRequest.auto_session_id): every agent framework's turns resume (volundr.session).
    auto_session: bool = False


# Request fields that the server's 400 messages start with (preprocessing, the engine).
ERROR_PARAMS = {"messages", "tools", "tool_choice", "stop", "chat_template_kwargs", "max_tokens",
                "seed", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "json_schema", "grammar",
                "min_tokens", "stop_token_ids"}


def triton_error(e: Exception) -> APIError:
    if isinstance(e, TritonUnavailable):
        return APIError(503, str(e), "service_unavailable", code="service_unavailable")
    msg = str(e)
    if "server busy:" in msg:
        return APIError(429, msg[msg.find("server busy:"):], "rate_limit_error",
                        code="server_busy")
    for marker, code in (("prompt too long:", "context_length_exceeded"),
                         ("invalid request:", None)):
        at = msg.find(marker)
        if at >= 0:
            text = msg[at + len(marker):].strip()
            # "messages[2]: unknown role ...", "stop: ...": name the request field it is about
            m = re.match(r"(\w+)", text)
            param = m.group(1) if m and m.group(1) in ERROR_PARAMS else None
            param = {"json_schema": "response_format", "grammar": "structured_outputs"}.get(
                param, param)  # (the request fields they come from)
            return APIError(400, text, code=code, param=param)
    return APIError(500, f"inference failed: {msg}", "server_error", code="internal_error")


def _tensors(req: ChatRequest | CompletionRequest) -> dict:
    fields = {"max_tokens": req.limit(), "temperature": req.temperature, "top_p": req.top_p,
              "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed, "stop": req.stops(),
              "presence_penalty": req.presence_penalty or None,
              "frequency_penalty": req.frequency_penalty or None,
              "repetition_penalty": req.repetition_penalty,
              "logit_bias": json.dumps(req.logit_bias) if req.logit_bias else None,
              "top_logprobs": req.num_logprobs(),
              "ignore_eos": req.ignore_eos or None, "stream": req.stream,
              "priority": req.priority, "stop_token_ids": req.stop_token_ids or None,
              "min_tokens": req.min_tokens or None}
    fields["json_schema"], fields["grammar"] = req.structured_outputs()
    if isinstance(req, ChatRequest):
        fields["messages"] = json.dumps(req.messages, ensure_ascii=False)
        if req.tools_active():
            fields["tools"] = json.dumps(req.tools, ensure_ascii=False)
        if kwargs := req.template_kwargs():  # with a forced tool_choice (a prefill)
            fields["chat_template_kwargs"] = json.dumps(kwargs)
    else:
        fields["text_input"] = req.text()
    for k, v in fields.items():  # lone surrogates (\ud800 in JSON) cannot travel as UTF-8
        try:
            json.dumps(v, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{k} contains text that is not valid Unicode (an unpaired "
                           "surrogate)", param=k) from None
    return fields


class EventStream(StreamingResponse):
    """A streaming response that notices a client going away while nothing is being written
    (Starlette, on ASGI >= 2.4, only notices on the next write), and always closes its
    iterator and its choices' Triton streams (`fan`; even when `_sse` never started), which
    aborts their sequences."""

    def __init__(self, content, fan: FanOut, **kw) -> None:
        super().__init__(content, **kw)
        self.fan = fan

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client is gone
            finally:
                tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.fan.aclose()


def create_app(cfg: ProxyConfig) -> FastAPI:
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if "triton" in state:
            await state["triton"].close()

    app = FastAPI(title="Volundr OpenAI-compatible API", lifespan=lifespan)

    def triton() -> VolundrTriton:
        if "triton" not in state:  # created on the serving event loop
            state["triton"] = VolundrTriton(cfg.triton_grpc, ensemble=cfg.ensemble)
        return state["triton"]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)  # unknown path, wrong method: OpenAI error JSON too
    async def _http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        kind).response()

    @app.exception_handler(Exception)  # a bug: still an OpenAI error object, not plain text
    async def _internal_error(request: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error",
                        code="internal_error").response()

    def check_model(name: str) -> None:
        if name != cfg.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"`{cfg.served_model_name}`.", param="model", code="model_not_found")

    def model_card() -> dict:
        card = {"id": cfg.served_model_name, "object": "model", "created": 0,
                "owned_by": "volundr"}
        if cfg.max_model_len:
            card["max_model_len"] = cfg.max_model_len
        return card

    @app.get("/health")
    async def health():
        if await triton().ready():
            return {"status": "ok"}
        return APIError(503, "Triton is not ready", "service_unavailable",
                        code="service_unavailable").response()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    async def run(request: Request, req, make_render, full=None, events=None):
        """`make_render(i)`: the render of choice i (state of its own, one per choice). full /
        events: what the rendered response / the stream of SSE lines become (the Responses
        API's); as they are without."""
        check_model(req.model)
        fields = _tensors(req)
        count = req.candidates() if isinstance(req, CompletionRequest) else req.n
        if count > req.n:  # best_of: ranked by each candidate's tokens' logprobs
            fields["top_logprobs"] = fields["top_logprobs"] or 0
        renders = share_id([make_render(i) for i in range(count)])
        rid = f"{renders[0].id_prefix}-{uuid.uuid4().hex}"
        session = req.session_id()
        if session is None and cfg.auto_session and isinstance(req, ChatRequest):
            session = req.auto_session_id()
        fan = FanOut([triton().stream(  # n requests at once: the engine batches them
            VolundrTriton.inputs(**{**fields, "seed": choice_seed(req.seed, i),
                                    "session_id": session if i == 0 else None}),
            request_id=f"{rid}-{i}") for i in range(count)])
        if not req.stream:
            out = await _collect(request, fan, renders, req.n)
            return JSONResponse(out if full is None else full(out))
        try:  # the first response decides the HTTP status (e.g. 400 prompt too long)
            first = await fan.first()
        except (TritonRequestError, TritonUnavailable) as e:
            raise triton_error(e) from None
        lines = _sse(fan, first, renders)
        return EventStream(lines if events is None else events(lines), fan,
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def chat_render(req: ChatRequest):
        return lambda i: ChatRender(req, cfg.served_model_name, reasoning=cfg.reasoning_split,
                                    reasoning_opened=cfg.reasoning_opened, index=i)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_body(await request.body(), ChatRequest)
        return await run(request, req, chat_render(req))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(await request.body(), CompletionRequest)
        return await run(request, req,
                         lambda i: CompletionRender(req, cfg.served_model_name, index=i))

    responses = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(request: Request):
        call = ResponsesCall(load_json(await request.body()), responses, cfg.served_model_name)

        def full(out: dict) -> dict:
            choice = out["choices"][0]
            return call.finished(choice["message"], choice["finish_reason"], out["usage"],
                                 logprobs=choice.get("logprobs"))

        try:
            req = parse_body(call.chat, ChatRequest)
            return await run(request, req, chat_render(req), full, call.events)
        except APIError as e:  # named by the Responses field it came from
            e.param = PARAMS.get(e.param, e.param)
            raise

    def stored(rid: str) -> dict:
        found = responses.get(rid)
        if found is None:
            raise APIError(404, f"Response with id '{rid}' not found.", "not_found_error",
                           param="response_id")
        return found[1]

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        return stored(rid)

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        stored(rid)
        responses.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    return app


def best_of(per_choice: list[list[Delta]], n: int) -> list[int]:
    """The n candidates with the highest cumulative logprob (vLLM's best_of), best first (ties
    in candidate order)."""
    score = [sum(e["logprob"] for d in ds for e in d.logprobs or []) for ds in per_choice]
    return sorted(range(len(per_choice)), key=lambda i: -score[i])[:n]


async def _collect(request: Request, fan: FanOut, renders: list, n: int) -> dict:
    """The response of a non-streamed request: all choices' deltas (aborted if the client goes
    away meanwhile, or one fails: FanOut), rendered; with more candidates than n (best_of)
    the n best as choices 0..n-1, every candidate's tokens counted in usage."""
    task = asyncio.ensure_future(fan.collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()  # closes the streams: VolundrTriton.stream sends the aborts
                await asyncio.gather(task, return_exceptions=True)
                await fan.aclose()
                raise APIError(499, "client closed the request", "client_closed")
    finally:
        if not task.done():  # this handler cancelled
            task.cancel()
            fan.cancel()
    try:
        per_choice = task.result()
    except (TritonRequestError, TritonUnavailable) as e:
        raise triton_error(e) from None
    fulls = [r.full(ds) for r, ds in zip(renders, per_choice)]
    out = merge_full(fulls)
    if len(fulls) > n:
        out["choices"] = [{**fulls[c]["choices"][0], "index": j}
                          for j, c in enumerate(best_of(per_choice, n))]
    return out


async def _sse(fan: FanOut, first: list[Item], renders: list) -> AsyncIterator[str]:
    """The choices' chunks as they come, each choice's own role chunk first and finish chunk
    last; then one usage chunk for all of them (include_usage)."""
    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    lasts: list[Delta | None] = [None] * len(renders)

    def chunks(i: int, d: Delta | None) -> list[dict]:
        if d is None:  # choice i has ended
            return renders[i].finish(lasts[i], usage=False)
        lasts[i] = d
        return renders[i].delta(d)

    try:
        for r in renders:
            for obj in r.start():
                yield event(obj)
        for i, d in first:
            for obj in chunks(i, d):
                yield event(obj)
        async for i, d in fan:
            for obj in chunks(i, d):
                yield event(obj)
        if renders[0].req.include_usage():
            yield event(renders[0].usage_chunk(total_usage(lasts)))
    except (TritonRequestError, TritonUnavailable) as e:
        err = triton_error(e)
        yield event({"error": {"message": err.message, "type": err.type, "param": err.param,
                               "code": err.code}})
    finally:
        with anyio.CancelScope(shield=True):  # a disconnect lands here
            await fan.aclose()  # VolundrTriton.stream then aborts the running sequences
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m volundr.clients.openai_proxy")
    ap.add_argument("--triton-grpc", default="127.0.0.1:8001")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--served-model-name", default="volundr")
    ap.add_argument("--max-model-len", type=int, default=None)
    add_reasoning_args(ap)
    ap.add_argument("--auto-session", action="store_true",
                    help="chat requests without a session_id resume the engine state of their "
                    "conversation's previous turn (a session id from its opening messages)")
    args = ap.parse_args(argv)
    cfg = ProxyConfig(args.triton_grpc, args.served_model_name, args.max_model_len,
                      reasoning_split=not args.no_reasoning_split,
                      reasoning_opened=args.reasoning_opened_in_prompt,
                      auto_session=args.auto_session)
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()

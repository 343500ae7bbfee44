"""A small asyncio client for the Volundr model repository (tritonclient.grpc.aio streaming).

    async with VolundrTriton("127.0.0.1:8001") as t:
        async for d in t.stream(t.inputs(text_input="Hello", max_tokens=16, stream=True)):
            print(d.text, end="")

Both `volundr` (the ensemble) and `volundr_llm` are decoupled, so every call goes through the
bidirectional gRPC stream. Leaving the `stream()` loop early aborts the generation: for
`volundr_llm` by cancelling the call (the model polls is_cancelled()); for the ensemble by sending
`volundr_llm` an abort for the request id and draining the stream, because Triton 2.51 neither
passes an ensemble cancellation on to the running step nor completes a cancelled ensemble
request.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

_TYPES = {"text_input": "BYTES", "messages": "BYTES", "tools": "BYTES",
          "chat_template_kwargs": "BYTES", "stop": "BYTES", "session_id": "BYTES",
          "logit_bias": "BYTES", "top_logprobs": "INT32", "json_schema": "BYTES",
          "grammar": "BYTES",
          "abort_request_id": "BYTES", "close_session_id": "BYTES", "max_tokens": "INT32",
          "top_k": "INT32",
          "priority": "INT32", "stop_token_ids": "INT32", "input_ids": "INT32",
          "min_tokens": "INT32",
          "temperature": "FP32", "top_p": "FP32", "min_p": "FP32", "seed": "INT64",
          "presence_penalty": "FP32", "frequency_penalty": "FP32", "repetition_penalty": "FP32",
          "random_seed": "UINT64", "ignore_eos": "BOOL", "stream": "BOOL", "return_stats": "BOOL"}
_NP = {"BYTES": object, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
       "FP32": np.float32, "BOOL": bool}


class TritonUnavailable(RuntimeError):
    """The server cannot be reached (not started, stopped, or still loading)."""


class TritonRequestError(RuntimeError):
    """The server answered with an error for this request (bad input, prompt too long...)."""


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str  # "" until the last response
    num_input_tokens: int
    num_output_tokens: int
    final: bool
    num_cached_tokens: int = 0  # prompt tokens resumed from the session's parked state
    # with top_logprobs: OpenAI's logprobs "content" entries of this delta's tokens
    logprobs: list | None = None


def make_input(name: str, value) -> InferInput:
    """One request tensor with the batch dimension: scalars -> [1, 1], lists -> [1, n]."""
    kind = _TYPES[name]
    if isinstance(value, (list, tuple)):
        arr = np.asarray([[v.encode() if isinstance(v, str) else v for v in value]],
                         dtype=_NP[kind])
        if kind == "BYTES" and arr.size == 0:
            arr = np.zeros((1, 0), dtype=object)
    else:
        v = value.encode() if isinstance(value, str) else value
        if kind == "BYTES" and isinstance(v, (dict, list)):
            v = json.dumps(v).encode()
        arr = np.asarray([[v]], dtype=_NP[kind])
    t = InferInput(name, list(arr.shape), kind)
    t.set_data_from_numpy(arr)
    return t


def _scalar(result, name: str, default=0):
    arr = result.as_numpy(name)
    return default if arr is None or arr.size == 0 else arr.reshape(-1)[0]


class VolundrTriton:
    def __init__(self, url: str, ensemble: str = "volundr", llm: str = "volundr_llm"):
        self.url, self.ensemble, self.llm = url, ensemble, llm
        self.client = grpcclient.InferenceServerClient(url)
        self._background: set = set()  # stream readers and aborts in flight (strong refs)

    async def __aenter__(self) -> VolundrTriton:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Waits for the streams to end on their own first: closing the channel under a stream
        whose final response has arrived cancels it, and Triton 2.51 can then fail to unload the
        model at shutdown."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_model_ready(self.ensemble)
        except (InferenceServerException, grpc.RpcError):
            return False

    @staticmethod
    def inputs(**fields) -> list[InferInput]:
        """Request tensors from keyword arguments; None values are left out."""
        return [make_input(k, v) for k, v in fields.items() if v is not None]

    def _open(self, model: str, inputs: list[InferInput], request_id: str):
        """Starts one request on a gRPC stream; a reader task moves its responses to a queue,
        so that a consumer being cancelled never cancels the call by accident."""
        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": request_id}

        call = self.client.stream_infer(requests())
        q: asyncio.Queue = asyncio.Queue()
        reader = self._spawn(self._pump(call, q))
        return call, q, reader

    async def _pump(self, call, q: asyncio.Queue) -> None:
        done = False
        try:
            async for result, error in call:
                if done:
                    continue
                if error is not None:
                    q.put_nowait(TritonRequestError(error.message()))
                    done = True
                    continue
                params = result.get_response().parameters
                done = "triton_final_response" in params and \
                    params["triton_final_response"].bool_param
                q.put_nowait((result, done))
            # After the final response the server ends the stream itself (we half-closed it):
            # cancelling it there instead races with Triton 2.51's bookkeeping and can leave a
            # model unable to unload at shutdown.
            if not done:
                q.put_nowait(TritonRequestError("the stream ended without a final response"))
        except grpc.RpcError as e:
            if done:
                return
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                q.put_nowait(TritonUnavailable(f"Triton at {self.url} is unavailable: "
                                               f"{e.details()}"))
            else:
                q.put_nowait(TritonRequestError(e.details() or str(e.code())))

    async def stream(self, inputs: list[InferInput], request_id: str | None = None,
                     model: str | None = None) -> AsyncIterator[Delta]:
        """Text deltas from the ensemble (or another model with the same outputs)."""
        request_id = request_id or uuid.uuid4().hex
        model = model or self.ensemble
        call, q, reader = self._open(model, inputs, request_id)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                result, final = item
                reason = _scalar(result, "finish_reason", b"")
                text = _scalar(result, "text_output", b"")
                lps = _scalar(result, "logprobs", b"")
                lps = lps.decode("utf-8") if isinstance(lps, bytes) else str(lps)
                finished = final
                yield Delta(text.decode("utf-8") if isinstance(text, bytes) else str(text),
                            reason.decode() if isinstance(reason, bytes) else str(reason),
                            int(_scalar(result, "num_input_tokens")),
                            int(_scalar(result, "num_output_tokens")), final,
                            int(_scalar(result, "num_cached_tokens")),
                            json.loads(lps) if lps else None)
                if final:
                    return
        finally:
            if not finished:
                # Left early (a client went away). Cancelling an ensemble call in Triton 2.51
                # neither reaches the running step nor completes the ensemble request (it stays
                # in flight until shutdown), so: abort the sequence in volundr_llm and let the
                # reader drain the stream to its final response. A task, not an await: the
                # consumer may be a cancelled task, where every await is cancelled again.
                if model == self.ensemble:
                    self._spawn(self._abort_and_drain(request_id, call, reader))
                else:
                    call.cancel()  # direct volundr_llm: its is_cancelled() sees this

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _abort_and_drain(self, request_id: str, call, reader, timeout_s: float = 60.0):
        await self.abort(request_id)
        try:
            await asyncio.wait_for(asyncio.shield(reader), timeout_s)
        except Exception:  # timed out (or the stream failed): give up on it
            call.cancel()

    async def _control(self, **fields) -> dict:
        call, q, reader = self._open(self.llm, self.inputs(**fields), uuid.uuid4().hex)
        item = await q.get()
        if isinstance(item, Exception):
            raise item
        return json.loads(_scalar(item[0], "stats", b"{}"))

    async def abort(self, request_id: str) -> dict:
        """Aborts the running generation with this request id; returns the engine stats after."""
        try:
            return await self._control(abort_request_id=request_id)
        except (TritonUnavailable, TritonRequestError):
            return {}

    async def close_session(self, session_id: str) -> dict:
        """Drops the session's parked state (an agent's task is done); returns the engine
        stats after, with closed: 1 if there was one."""
        return await self._control(close_session_id=session_id)

    async def stats(self) -> dict:
        """Engine stats: num_blocks_total/free, num_slots_total/free, running, waiting, ..."""
        return await self._control(return_stats=True)

"""volundr_llm: the Volundr engine as a decoupled Triton Python model.

`execute` only parses and enqueues; the engine runs on one background thread (EngineLoop, in
volundr.serve.triton_llm) that streams responses through each request's response_sender as tokens
come, polls cancellation every step and aborts cancelled sequences. The last response of a
request carries TRITONSERVER_RESPONSE_COMPLETE_FINAL. The engine's metrics (volundr.serve.metrics)
join Triton's own at its metrics endpoint.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from volundr.serve.llm_inputs import generation_defaults, parse_control, parse_llm_request
from volundr.serve.metrics import EngineMetrics
from volundr.serve.repo import model_parameters, resolve_model_dir
from volundr.serve.triton_llm import Chunk, EngineLoop, llm_kwargs, logprobs_json, wants_warmup

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _ids(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(1, -1)


def _one(value, dtype) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


class _Sender:
    """The engine thread's view of one request (volundr.serve.triton_llm.Sink)."""

    def __init__(self, request):
        self.sender = request.get_response_sender()

    def send(self, chunk: Chunk, final: bool) -> None:
        tensors = [
            pb_utils.Tensor("output_ids", _ids(chunk.output_ids)),
            pb_utils.Tensor("prefix_ids", _ids(chunk.prefix_ids)),
            pb_utils.Tensor("trim_chars", _one(chunk.trim_chars, np.int32)),
            pb_utils.Tensor("finish_reason", _one(chunk.finish_reason.encode(), object)),
            pb_utils.Tensor("num_input_tokens", _one(chunk.num_input_tokens, np.int32)),
            pb_utils.Tensor("num_output_tokens", _one(chunk.num_output_tokens, np.int32)),
            pb_utils.Tensor("num_cached_tokens", _one(chunk.num_cached_tokens, np.int32)),
            pb_utils.Tensor("logprobs", _one(logprobs_json(chunk).encode(), object)),
        ]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                         flags=FINAL if final else 0)

    def error(self, message: str) -> None:
        resp = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        self.sender.send(resp, flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def stats(self, stats: dict) -> None:
        out = pb_utils.Tensor("stats", _one(json.dumps(stats).encode(), object))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from volundr.llm import LLM  # torch loads here, not at import of the stub

        params = model_parameters(args["model_config"])
        model_dir = resolve_model_dir(params.get("model_dir", ""))
        self.llm = LLM(model_dir, **llm_kwargs(params))
        self.defaults = generation_defaults(self.llm.model_dir)
        if wants_warmup(params, self.llm.engine.ecfg.device):
            from volundr.warmup import warm_up

            pb_utils.Logger.log_info(f"volundr_llm: {warm_up(self.llm.engine).summary()}")
        self.metrics = EngineMetrics(pb_utils.MetricFamily, {
            "model": args["model_name"], "version": args["model_version"]})
        self.loop = EngineLoop(self.llm,
                               max_in_flight=int(params.get("max_inflight") or 0) or None,
                               metrics=self.metrics).start()
        pb_utils.Logger.log_info(f"volundr_llm: {self.llm.model_dir} on "
                                 f"{self.llm.engine.ecfg.device}, context "
                                 f"{self.llm.max_model_len}, KV cache "
                                 f"{str(self.llm.engine.ecfg.kv_dtype).removeprefix('torch.')}, "
                                 f"stats {self.llm.stats()}")

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = _Sender(request)

            def get(name: str, request=request):
                t = pb_utils.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()

            try:
                control = parse_control(get)
                if control is not None:
                    if control.close_session_id:
                        self.loop.close_session(control.close_session_id, sender.stats)
                    elif control.abort_request_id:
                        self.loop.abort(control.abort_request_id, sender.stats)
                    else:
                        self.loop.stats(sender.stats)
                    continue
                req = parse_llm_request(get, self.llm.max_model_len, self.defaults)
            except ValueError as e:
                sender.error(str(e))
                continue
            self.loop.submit(request.request_id(), req.prompt_ids, req.params, req.stops,
                             req.stream, sender, req.session_id, req.priority)
        return None

    def finalize(self) -> None:
        pb_utils.Logger.log_info("volundr_llm: stopping the engine thread")
        self.loop.shutdown()
        self.loop.metrics = self.metrics = None  # (metrics before their families)
        self.llm.close()  # stops tensor-parallel workers, if any
        pb_utils.Logger.log_info("volundr_llm: engine thread stopped")

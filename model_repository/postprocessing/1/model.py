"""postprocessing: stateless, exact incremental detokenization (volundr.serve.detok).

text_output = decode(prefix_ids + output_ids)[len(decode(prefix_ids)):], minus trim_chars at the
end (a stop string and anything after it). Counts and finish_reason pass through; logprobs
(volundr_llm's ids) come out with each token's text (volundr.serve.detok.logprobs_with_text).
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from volundr.serve.detok import Utf8Boundary, logprobs_with_text, text_delta
from volundr.serve.repo import model_parameters, resolve_model_dir

PASS = ("finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_dir = resolve_model_dir(model_parameters(args["model_config"]).get("model_dir", ""))
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.boundary = Utf8Boundary(self.tokenizer)

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            def arr(name: str, request=request) -> np.ndarray:
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            out_ids, prefix = arr("output_ids").reshape(-1), arr("prefix_ids").reshape(-1)
            trim = int(arr("trim_chars").reshape(-1)[0])
            text = text_delta(self.tokenizer, prefix.tolist(), out_ids.tolist())
            if trim > 0:
                text = text[:max(0, len(text) - trim)]
            tensors = [pb_utils.Tensor("text_output",
                                       np.asarray([[text.encode("utf-8")]], dtype=object))]
            tensors += [pb_utils.Tensor(name, arr(name)) for name in PASS]
            lps = arr("logprobs").reshape(-1)[0]
            lps = lps.decode("utf-8") if isinstance(lps, bytes) else str(lps)
            tensors.append(pb_utils.Tensor("output_logprobs", np.asarray(
                [[logprobs_with_text(self.boundary, lps).encode("utf-8")]], dtype=object)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

"""Speculative decoding through the real servers (conftest.py's `volundr-serve` runs with
`--drafter tiny`): greedy requests over tritonclient and the OpenAI SDK give the tokens of the
offline engine without a drafter, sampled ones decode speculatively too, and the engine's stats
count speculative steps."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from test_serving import engine_stats, wait_idle
from tokenizers import Tokenizer
from triton_helpers import grpc_stream

from volundr.clients.triton import VolundrTriton
from volundr.llm import LLM
from volundr.sampling_params import SamplingParams

pytestmark = pytest.mark.server


def test_greedy_through_triton_equals_the_engine_without_a_drafter(serving, tiny_dir):
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    texts = ["The smith Volundr forged", "Rings of gold hung on a bast rope", "Once"]
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    before = engine_stats(serving.grpc_url)
    served = []
    for ids in prompts:
        [r] = grpc_stream(serving.grpc_url, "volundr_llm", VolundrTriton.inputs(
            input_ids=ids, max_tokens=24, temperature=0.0, ignore_eos=True))
        served.append(r.as_numpy("output_ids").reshape(-1).tolist())
    after = wait_idle(serving.grpc_url)
    assert after["spec_steps"] > before["spec_steps"]  # (a random drafter: few guesses kept)
    assert after["num_blocks_free"] == after["num_blocks_total"], after
    with LLM(tiny_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=256,
             max_model_len=2048) as llm:  # no drafter
        want = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                    ignore_eos=True))
    assert served == [w["token_ids"] for w in want]


def test_openai_greedy_and_sampled_with_a_drafter(serving):
    client = openai.OpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none")
    kw = dict(model="volundr", prompt="Tell me of Volundr.", max_tokens=12,
              extra_body={"ignore_eos": True})
    a = client.completions.create(temperature=0.0, **kw)
    b = client.completions.create(temperature=0.0, stream=True, **kw)
    text = "".join(c.choices[0].text for c in b if c.choices)
    assert a.usage.completion_tokens == 12 and text == a.choices[0].text
    s = client.completions.create(temperature=0.9, seed=3, **kw)  # seeded: not speculative
    assert s.usage.completion_tokens == 12
    before = engine_stats(serving.grpc_url)["spec_seqs"]
    u = client.completions.create(temperature=0.9, **kw)  # speculative sampling
    assert u.usage.completion_tokens == 12
    assert engine_stats(serving.grpc_url)["spec_seqs"] > before

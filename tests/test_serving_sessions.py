"""Sessions through the real servers (conftest.py's `volundr-serve`): a request's session_id
parks its state when it ends and the next turn resumes it (volundr.session) — tritonclient to
volundr_llm with token ids, and the OpenAI SDK through the proxy (extra_body session_id, usage's
prompt_tokens_details.cached_tokens; a proxy with --auto-session, no id sent), and
close_session_id; `priority` the same ways."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_serving import engine_stats, wait_idle
from tokenizers import Tokenizer
from triton_helpers import grpc_stream

from volundr.clients.triton import VolundrTriton
from volundr.serve.stack import free_port

pytestmark = pytest.mark.server


def _llm(url: str, ids: list[int], session: str | None, max_tokens: int = 8):
    """(output ids, num_cached_tokens) of one greedy volundr_llm request."""
    [r] = grpc_stream(url, "volundr_llm", VolundrTriton.inputs(
        input_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        session_id=session))
    return (r.as_numpy("output_ids").reshape(-1).tolist(),
            int(r.as_numpy("num_cached_tokens").reshape(-1)[0]))


def test_volundr_llm_session_turns_resume_from_the_parked_state(serving, tiny_dir):
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    ids = tok.encode("The smith Volundr forged a ring of gold", add_special_tokens=False).ids
    before = engine_stats(serving.grpc_url)
    out1, cached1 = _llm(serving.grpc_url, ids, "grpc-session-1")
    assert cached1 == 0 and len(out1) == 8
    s = wait_idle(serving.grpc_url)  # parked: every block and slot free again
    assert s["num_blocks_free"] == s["num_blocks_total"], s
    assert s["num_slots_free"] == s["num_slots_total"], s
    assert s["sessions_parked"] >= 1 and s["sessions_host_bytes"] > 0, s
    turn2 = ids + out1 + tok.encode(" and then", add_special_tokens=False).ids
    out2, cached2 = _llm(serving.grpc_url, turn2, "grpc-session-1")
    assert cached2 == len(ids) + len(out1) - 1  # all but turn 1's last token (never fed)
    fresh, cached = _llm(serving.grpc_url, turn2, None)
    assert cached == 0 and out2 == fresh
    after = engine_stats(serving.grpc_url)
    assert after["sessions_resumed"] == before["sessions_resumed"] + 1, after
    # the agent's task is done: close_session_id drops the parked state
    closed = asyncio.run(_close(serving.grpc_url, "grpc-session-1"))
    assert closed["closed"] == 1 and closed["sessions_parked"] == after["sessions_parked"] - 1
    assert asyncio.run(_close(serving.grpc_url, "grpc-session-1"))["closed"] == 0
    assert _llm(serving.grpc_url, turn2 + out2 + [5], "grpc-session-1")[1] == 0


async def _close(url: str, session_id: str) -> dict:
    async with VolundrTriton(url) as t:
        return await t.close_session(session_id)


def test_openai_chat_turns_with_a_session_id(serving):
    """Turn 2 carries turn 1's messages and a reply that is not the generated text token for
    token (here another text, as when a client drops the reasoning): the state parked at the
    end of turn 1's prompt supplies those tokens; the reply equals the same request without a
    session."""
    client = openai.OpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none")
    msgs = [{"role": "user", "content": "Which tool reads the weather?"}]

    def chat(messages, session=None, max_tokens=6):
        body = {"ignore_eos": True, **({"session_id": session} if session else {})}
        return client.chat.completions.create(messages=messages, max_tokens=max_tokens,
                                              model="volundr", temperature=0.0,
                                              extra_body=body)

    r1 = chat(msgs, "oai-session-1")
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    msgs2 = msgs + [{"role": "assistant", "content": "The weather tool."},
                    {"role": "user", "content": "And tomorrow?"}]
    r2 = chat(msgs2, "oai-session-1")
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens
    fresh = chat(msgs2)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == fresh.choices[0].message.content
    assert r2.usage.prompt_tokens == fresh.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="session_id"):
        client.chat.completions.create(messages=msgs, model="volundr", max_tokens=1,
                                       extra_body={"session_id": 7})


def test_priority_travels_through_triton_and_the_proxy(serving, tiny_dir):
    """`priority` (engine-tested in test_engine.py) reaches volundr_llm from tritonclient and
    from the OpenAI SDK (vLLM's extension) and the request runs."""
    [r] = grpc_stream(serving.grpc_url, "volundr_llm", VolundrTriton.inputs(
        input_ids=[20, 21, 22], max_tokens=3, ignore_eos=True, priority=-2))
    assert r.as_numpy("output_ids").size == 3
    client = openai.OpenAI(base_url=f"{serving.proxy_url}/v1", api_key="none")
    c = client.completions.create(model="volundr", prompt="Hi", max_tokens=2,
                                  extra_body={"priority": 4, "ignore_eos": True})
    assert c.usage.completion_tokens == 2


def test_auto_session_proxy_resumes_turns_without_a_session_id(serving, tmp_path):
    """A second proxy with --auto-session in front of the same Triton: chat turns that carry
    no session_id resume their conversation's previous turn."""
    port = free_port()
    log = open(tmp_path / "proxy.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "volundr.clients.openai_proxy",
                             "--triton-grpc", serving.grpc_url, "--port", str(port),
                             "--auto-session"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        msgs = [{"role": "system", "content": f"Agent {tmp_path.name}."},
                {"role": "user", "content": "Plan the trip."}]
        kw = dict(model="volundr", max_tokens=4, temperature=0.0,
                  extra_body={"ignore_eos": True})
        r1 = client.chat.completions.create(messages=msgs, **kw)
        msgs2 = msgs + [{"role": "assistant", "content": "Step one."},
                        {"role": "user", "content": "Go on."}]
        r2 = client.chat.completions.create(messages=msgs2, **kw)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()

"""tritonclient helpers shared by the serving tests (CPU, test_serving.py; GPU,
test_triton_only.py): only tritonclient's gRPC client, which the GPU machine has."""

from __future__ import annotations

import queue

import tritonclient.grpc as grpcclient


def grpc_stream(url: str, model: str, inputs: list, cancel_after: int | None = None,
                request_id: str = "") -> list:
    """tritonclient's callback streaming API; returns the results (raises on an error)."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(model, inputs, request_id=request_id)
    results = []
    try:
        while True:
            result, error = q.get(timeout=60)
            if error is not None:
                raise error
            results.append(result)
            params = result.get_response().parameters
            if params["triton_final_response"].bool_param:
                break
            if cancel_after is not None and len(results) >= cancel_after:
                break
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return results


def texts(results) -> list[str]:
    return [r.as_numpy("text_output").reshape(-1)[0].decode() for r in results]

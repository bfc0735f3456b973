"""The Open Inference Protocol's own clients against a running llmrpc: tritonclient (gRPC and
HTTP) and kserve. Run with .venv-oip's Python (they need protobuf<7, beside our 7), by
test_kserve_clients.py:

    .venv-oip/bin/python tests/gateway/oip_clients.py '{"grpc": "127.0.0.1:P", "http":
        "127.0.0.1:Q", "model": "tiny", "key": "..."}'

prints one JSON object: each scenario's name -> what the client saw (or {"raised": ...}).
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys

import numpy as np

# tritonclient is imported by its scenarios alone: see main()

GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


def text_input(module, prompt: str, **options):
    tensor = module.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_), **options)
    return tensor


def raised(error) -> dict:  # a tritonclient.utils.InferenceServerException
    return {"raised": True, "status": str(error.status()), "message": error.message()}


def grpc_scenarios(address: str, model: str, auth: dict) -> dict:
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    client = triton_grpc.InferenceServerClient(address)
    seen: dict = {
        "live": client.is_server_live(headers=auth),
        "ready": client.is_server_ready(headers=auth),
        "model_ready": client.is_model_ready(model, headers=auth),
        "server_name": client.get_server_metadata(headers=auth).name,
        "metadata_inputs": [t.name for t in client.get_model_metadata(model, headers=auth).inputs],
    }
    result = client.infer(
        model, [text_input(triton_grpc, "Hello")], parameters=GREEDY, headers=auth
    )
    seen["text_output"] = result.as_numpy("text_output")[0].decode()
    for name, call in {
        "bad_parameter": lambda: client.infer(
            model, [text_input(triton_grpc, "Hi")], parameters={"temperature": "hot"},
            headers=auth,
        ),
        "unknown_model": lambda: client.infer(
            "no-such-model", [text_input(triton_grpc, "Hi")], headers=auth
        ),
        "no_key": lambda: client.infer(model, [text_input(triton_grpc, "Hi")]),
    }.items():  # fmt: skip
        try:
            call()
            seen[name] = {"raised": False}
        except InferenceServerException as error:
            seen[name] = raised(error)
    seen["stream"] = grpc_stream(client, model, auth)
    client.close()
    return seen


def grpc_stream(client, model: str, auth: dict) -> dict:
    import tritonclient.grpc as triton_grpc

    replies: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)), headers=auth)
    client.async_stream_infer(
        model, [text_input(triton_grpc, "Hello")], parameters={**GREEDY, "stream": True},
        request_id="s1", enable_empty_final_response=True,
    )  # fmt: skip
    pieces, errors, final = [], [], False
    while not final:
        result, error = replies.get(timeout=60)
        if error is not None:
            errors.append(str(error))
            break
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        pieces.append(result.as_numpy("text_output")[0].decode())
    client.stop_stream()
    return {"pieces": pieces, "errors": errors, "final": final}


def http_scenarios(address: str, model: str, auth: dict) -> dict:
    # each call its own copy: tritonclient.http writes its binary header into the dict given
    import tritonclient.http as triton_http
    from tritonclient.utils import InferenceServerException

    client = triton_http.InferenceServerClient(address)
    seen: dict = {
        "live": client.is_server_live(headers=dict(auth)),
        "ready": client.is_server_ready(headers=dict(auth)),
        "model_ready": client.is_model_ready(model, headers=dict(auth)),
        "metadata_name": client.get_model_metadata(model, headers=dict(auth))["name"],
    }
    for name, binary in (("text_output_binary", True), ("text_output_json", False)):
        output = triton_http.InferRequestedOutput("text_output", binary_data=binary)
        result = client.infer(
            model, [text_input(triton_http, "Hello", binary_data=binary)],
            outputs=[output], parameters=GREEDY, headers=dict(auth),
        )  # fmt: skip
        value = result.as_numpy("text_output")[0]
        seen[name] = value.decode() if isinstance(value, bytes) else value
    for name, call in {
        "bad_parameter": lambda: client.infer(
            model, [text_input(triton_http, "Hi")], parameters={"top_p": 7.5}, headers=dict(auth)
        ),
        "unknown_model": lambda: client.infer(
            "no-such-model", [text_input(triton_http, "Hi")], headers=dict(auth)
        ),
        "no_key": lambda: client.infer(model, [text_input(triton_http, "Hi")]),
    }.items():
        try:
            call()
            seen[name] = {"raised": False}
        except InferenceServerException as error:
            seen[name] = raised(error)
    client.close()
    return seen


async def kserve_scenarios(grpc_address: str, http_address: str, model: str, auth: dict):
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest
    from kserve.inference_client import RESTConfig

    def request() -> InferRequest:
        tensor = InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
        # kserve's InferRequest takes no float parameter: a number goes as its string
        parameters = {**GREEDY, "temperature": "0.0"}
        return InferRequest(model_name=model, infer_inputs=[tensor], parameters=parameters)

    seen: dict = {}
    grpc_client = InferenceGRPCClient(grpc_address)
    seen["grpc_ready"] = await grpc_client.is_server_ready(headers=tuple(auth.items()))
    response = await grpc_client.infer(request(), headers=tuple(auth.items()))
    seen["grpc_text_output"] = _kserve_text(response)
    await grpc_client.close()
    rest = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
    response = await rest.infer(f"http://{http_address}", request(), model, headers=auth)
    seen["rest_text_output"] = _kserve_text(response)
    await rest.close()
    return seen


def _kserve_text(response) -> str:
    (output,) = [o for o in response.outputs if o.name == "text_output"]
    value = output.as_numpy()[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def main() -> None:
    config = json.loads(sys.argv[1])
    auth = {"authorization": f"Bearer {config['key']}"}
    model = config["model"]
    report = {}
    # tritonclient and kserve each register package `inference` in protobuf's pool, under
    # different file names, so they cannot share a process: config["run"] picks the scenarios.
    for name, run in {
        "grpc": lambda: grpc_scenarios(config["grpc"], model, auth),
        "http": lambda: http_scenarios(config["http"], model, auth),
        "kserve": lambda: asyncio.run(
            kserve_scenarios(config["grpc"], config["http"], model, auth)
        ),
    }.items():
        if name not in config["run"]:
            continue
        try:
            report[name] = run()
        except Exception as error:  # noqa: BLE001 - reported, the test names it
            report[name] = {"crashed": f"{type(error).__name__}: {error}"}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

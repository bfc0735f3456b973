"""``/v1/embeddings`` through the OpenAI SDK (float and base64, dimensions), vLLM's ``/v1/score``
and ``/v1/rerank``, and their 400s, against a MiniLM replica."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from embedding_models import minilm_dir, sentences
from envoy_support import Replica, ServerLoop
from gateway_support import RunningGateway, in_process_gateway

from llmrpc.clients import Client
from llmrpc.engine.config import EngineConfig, ModelConfig
from llmrpc.server.settings import FrontendConfig

TEXTS = sentences(5)


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop) -> Iterator[Replica]:
    config = EngineConfig(model=ModelConfig(model=str(minilm_dir()), dtype="float32"))
    # The engine on a thread: it starts in seconds (test_embed_grpc covers the engine process).
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, disable_frontend_multiprocessing=True)
    started = server_loop.start_replica(config, frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    yield from in_process_gateway(server_loop, replica)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    return model.encode(TEXTS)


def post(gateway: RunningGateway, path: str, body: dict) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=60)


def test_sdk_float_embeddings_match_sentence_transformers(sdk: openai.OpenAI, reference):
    answer = sdk.embeddings.create(model=str(minilm_dir()), input=TEXTS)
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in answer.data])
    cosines = (got * reference).sum(axis=1) / np.linalg.norm(got, axis=1)
    assert cosines.min() >= 0.9999
    assert answer.model == str(minilm_dir())
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)


def test_sdk_base64_decodes_to_the_float_vectors(sdk: openai.OpenAI):
    floats = sdk.embeddings.create(model="", input=TEXTS[0], encoding_format="float")
    # Without encoding_format the SDK asks for base64 and decodes it itself (little-endian
    # float32, with numpy): the same floats must come out.
    raw = sdk.embeddings.with_raw_response.create(model="", input=TEXTS[0])
    assert raw.http_request.read() and b'"base64"' in raw.http_request.content
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str)
    np.testing.assert_allclose(raw.parse().data[0].embedding, floats.data[0].embedding, rtol=1e-6)
    # Asked for explicitly, base64 is handed over as the string.
    text = sdk.embeddings.create(model="", input=TEXTS[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(text.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(decoded, floats.data[0].embedding, rtol=1e-6)


def test_sdk_dimensions_and_token_ids(sdk: openai.OpenAI, grpc_client: Client):
    answer = sdk.embeddings.create(model="", input=TEXTS[1], dimensions=32)
    vector = np.array(answer.data[0].embedding)
    assert vector.shape == (32,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    ids = grpc_client.tokenize(TEXTS[1]).token_ids
    by_ids = sdk.embeddings.create(model="", input=[ids, ids[:4]])
    by_text = sdk.embeddings.create(model="", input=TEXTS[1])
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, rtol=1e-5)
    assert by_ids.usage.prompt_tokens == len(ids) + 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a", "dimensions": 385}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["ok", [101, 999_999, 102]]}, "input[1]"),
        ({"input": [101] * 600}, "input"),
        ({"input": []}, "input"),
    ],
    ids=["dimensions", "encoding-format", "bad-token", "too-long", "empty"],
)
def test_bad_requests_name_the_parameter(gateway, body, param):
    reply = post(gateway, "/v1/embeddings", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def _same_scores(got: list[dict], expected: list[dict], key: str) -> None:
    """The same entries with the same scores up to float rounding: a second call's texts can be
    batched with each other differently, and the engine's kernels are not batch-invariant unless
    asked (--batch-invariant), so a score's last bits can differ between two calls."""
    assert [{**d, key: None} for d in got] == [{**d, key: None} for d in expected]
    np.testing.assert_allclose([d[key] for d in got], [d[key] for d in expected], rtol=1e-6)


def test_score_is_the_cosine_of_embeddings(gateway, reference):
    body = {"text_1": TEXTS[0], "text_2": TEXTS[:3]}
    answer = post(gateway, "/v1/score", body).json()
    scores = [d["score"] for d in answer["data"]]
    np.testing.assert_allclose(scores, reference[:3] @ reference[0], atol=1e-4)
    assert scores[0] == pytest.approx(1.0, abs=1e-5)
    pairs = post(gateway, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:4]}).json()
    expected = (reference[:2] * reference[2:4]).sum(axis=1)
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], expected, atol=1e-4)
    _same_scores(post(gateway, "/score", body).json()["data"], answer["data"], "score")  # alias
    mismatched = post(gateway, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"


def test_rerank_orders_documents_by_relevance(gateway, reference):
    body = {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 3}
    answer = post(gateway, "/v1/rerank", body).json()
    expected = reference[1:] @ reference[0]
    order = list(np.argsort(-expected)[:3])
    assert [r["index"] for r in answer["results"]] == order
    assert [r["document"]["text"] for r in answer["results"]] == [TEXTS[1 + i] for i in order]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in answer["results"]], expected[order], atol=1e-4
    )
    assert answer["usage"]["total_tokens"] > 0
    for alias in ("/rerank", "/v2/rerank"):  # vLLM's other paths for it
        results = post(gateway, alias, body).json()["results"]
        _same_scores(results, answer["results"], "relevance_score")

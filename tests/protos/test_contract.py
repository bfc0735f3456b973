"""The v1 API contract: stubs in sync with the protos, buf lint, HTTP annotations, presence."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2, json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from llmrpc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    embedding_pb2,
    generation_pb2,
    generation_pb2_grpc,
    tokenization_pb2,
    tokenization_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS_DIR = REPO_ROOT / "protos"
API_FILES = (common_pb2, generation_pb2, tokenization_pb2, admin_pb2, embedding_pb2)

# (service, method) -> (HTTP verb, path): the native REST surface, as Envoy and grpc-gateway see it.
EXPECTED_ROUTES = {
    ("GenerationService", "Generate"): ("post", "/v1/generate"),
    ("GenerationService", "GenerateStream"): ("post", "/v1/generate:stream"),
    ("TokenizationService", "Tokenize"): ("post", "/v1/tokenize"),
    ("TokenizationService", "Detokenize"): ("post", "/v1/detokenize"),
    ("AdminService", "GetServerInfo"): ("get", "/v1/admin/server_info"),
    ("AdminService", "GetModelInfo"): ("get", "/v1/admin/model_info"),
    ("AdminService", "ListModels"): ("get", "/v1/admin/models"),
    ("AdminService", "Abort"): ("post", "/v1/admin/abort"),
    ("AdminService", "GetLoad"): ("get", "/v1/admin/load"),
    ("AdminService", "ResetPrefixCache"): ("post", "/v1/admin/reset_prefix_cache"),
    ("AdminService", "Sleep"): ("post", "/v1/admin/sleep"),
    ("AdminService", "WakeUp"): ("post", "/v1/admin/wake_up"),
    ("AdminService", "IsSleeping"): ("get", "/v1/admin/is_sleeping"),
    ("AdminService", "LoadLoraAdapter"): ("post", "/v1/admin/load_lora_adapter"),
    ("AdminService", "UnloadLoraAdapter"): ("post", "/v1/admin/unload_lora_adapter"),
    ("AdminService", "ListLoraAdapters"): ("get", "/v1/admin/lora_adapters"),
    ("EmbeddingService", "Embed"): ("post", "/v1/embed"),
}
# Paths served by the OpenAI-compatible gateway (OpenAI's and vLLM's); ours must not shadow them.
OPENAI_PATHS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/audio",
    "/v1/score",
    "/v1/rerank",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/version",
)
SIXTY_FOUR_BIT_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def load_generator() -> ModuleType:
    path = PROTOS_DIR / "generate.py"
    spec = importlib.util.spec_from_file_location("llmrpc_protos_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


def all_methods():
    for module in (generation_pb2, tokenization_pb2, admin_pb2, embedding_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            yield from service.methods


def all_messages() -> list[Descriptor]:
    found: list[Descriptor] = []
    pending = [m for module in API_FILES for m in module.DESCRIPTOR.message_types_by_name.values()]
    while pending:
        message = pending.pop()
        found.append(message)
        pending.extend(message.nested_types)
    return found


# --- generated stubs and lint ------------------------------------------------------------------


def test_committed_stubs_match_the_protos() -> None:
    result = run_script("protos/generate.py", "--check")
    assert result.returncode == 0, f"stubs out of date:\n{result.stdout}{result.stderr}"


def test_check_reports_hand_edited_missing_and_stale_stubs(tmp_path: Path) -> None:
    generator = load_generator()
    generator.generate_into(tmp_path / "fresh")
    fresh = tmp_path / "fresh" / "llmrpc" / "v1"
    committed = tmp_path / "committed"
    shutil.copytree(generator.API_DIR, committed)
    assert generator.differing_files(fresh, committed) == []

    edited = committed / "generation_pb2.py"
    edited.write_text(edited.read_text() + "# hand edit\n")
    (committed / "admin_pb2.pyi").unlink()
    (committed / "removed_pb2_grpc.py").write_text("")
    assert generator.differing_files(fresh, committed) == [
        "admin_pb2.pyi",
        "generation_pb2.py",
        "removed_pb2_grpc.py",
    ]


def test_buf_lint_standard_passes() -> None:
    result = run_script("protos/lint.py")
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_descriptor_set_has_imports_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "llmrpc.binpb"
    result = run_script("protos/generate.py", "--descriptor-set", str(path))
    assert result.returncode == 0, result.stderr
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
    files = {f.name: f for f in descriptor_set.file}
    assert {"google/api/annotations.proto", "google/api/http.proto"} <= files.keys()
    assert "google/protobuf/descriptor.proto" in files
    generation = files["llmrpc/v1/generation.proto"]
    comments = [loc.leading_comments for loc in generation.source_code_info.location]
    assert any("Returns the whole output" in c for c in comments)
    names = [f.name for f in descriptor_set.file]  # dependencies come before their users
    for file in descriptor_set.file:
        assert all(names.index(dep) < names.index(file.name) for dep in file.dependency)


# --- HTTP annotations --------------------------------------------------------------------------


def test_every_rpc_has_its_expected_http_route() -> None:
    routes = {}
    for method in all_methods():
        options = method.GetOptions()
        assert options.HasExtension(annotations_pb2.http), f"{method.full_name} has no http rule"
        rule = options.Extensions[annotations_pb2.http]
        routes[(method.containing_service.name, method.name)] = (
            rule.WhichOneof("pattern"),
            getattr(rule, rule.WhichOneof("pattern")),
        )
    assert routes == EXPECTED_ROUTES


@pytest.mark.parametrize("method", list(all_methods()), ids=lambda m: m.full_name)
def test_http_rule_is_transcodable(method) -> None:
    rule = method.GetOptions().Extensions[annotations_pb2.http]
    assert rule.response_body == "", "response_body is only for google.api.HttpBody fields"
    assert not rule.additional_bindings, "one binding per path"
    assert rule.body == ("*" if rule.WhichOneof("pattern") == "post" else "")


def test_rest_paths_are_unique_and_clear_of_openai_paths() -> None:
    paths = [path for _, path in EXPECTED_ROUTES.values()]
    assert len(set(paths)) == len(paths)
    for path in paths:
        plain = path.split(":")[0]
        for openai in OPENAI_PATHS:
            assert plain != openai and not plain.startswith(openai + "/"), (path, openai)


def test_no_64_bit_integers_so_json_gets_numbers() -> None:
    for message in all_messages():
        for field in message.fields:
            assert field.type not in SIXTY_FOUR_BIT_TYPES, field.full_name


def test_unary_and_streaming_generation_share_messages() -> None:
    service = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    unary, stream = service.methods_by_name["Generate"], service.methods_by_name["GenerateStream"]
    assert unary.input_type is stream.input_type is generation_pb2.GenerateRequest.DESCRIPTOR
    assert unary.output_type is stream.output_type is generation_pb2.GenerateResponse.DESCRIPTOR
    assert not unary.server_streaming and stream.server_streaming
    assert not unary.client_streaming and not stream.client_streaming
    assert "stream" not in generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name


# --- presence of tunables ----------------------------------------------------------------------

TUNABLE_MESSAGES = (
    common_pb2.SamplingParams,
    common_pb2.StoppingCriteria,
    common_pb2.OutputOptions,
    common_pb2.Chat,
    generation_pb2.GenerateRequest,
    tokenization_pb2.TokenizeRequest,
    tokenization_pb2.DetokenizeRequest,
)
# Identity fields, where empty has a meaning of its own (server-made id, default model, base
# model without a LoRA adapter).
NOT_TUNABLES = {"request_id", "model", "lora"}


@pytest.mark.parametrize("message", TUNABLE_MESSAGES, ids=lambda m: m.DESCRIPTOR.name)
def test_every_scalar_tunable_is_optional(message) -> None:
    for field in message.DESCRIPTOR.fields:
        if field.is_repeated or field.name in NOT_TUNABLES:
            continue
        assert field.has_presence, f"{field.full_name} must be `optional`"


def test_explicit_zero_tunables_survive_the_wire() -> None:
    request = generation_pb2.GenerateRequest(
        text="hi",
        sampling=common_pb2.SamplingParams(temperature=0.0, top_k=0),
        stopping=common_pb2.StoppingCriteria(min_tokens=0, ignore_eos=False),
    )
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed.sampling.HasField("temperature") and parsed.sampling.HasField("top_k")
    assert not parsed.sampling.HasField("top_p") and not parsed.sampling.HasField("seed")
    assert parsed.stopping.HasField("min_tokens") and parsed.stopping.HasField("ignore_eos")
    assert not parsed.stopping.HasField("max_tokens")
    assert not parsed.HasField("add_special_tokens") and not parsed.HasField("output")


# --- round trips -------------------------------------------------------------------------------


def full_generate_request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id="req-1",
        model="smollm2",
        chat=common_pb2.Chat(
            messages=[
                common_pb2.ChatMessage(role="system", content="Be brief."),
                common_pb2.ChatMessage(role="user", content="What is the capital of France?"),
            ],
            add_generation_prompt=True,
        ),
        sampling=common_pb2.SamplingParams(
            temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, seed=4_000_000_000
        ),
        stopping=common_pb2.StoppingCriteria(
            max_tokens=64,
            min_tokens=2,
            stop=["\n\n"],
            stop_token_ids=[2],
            ignore_eos=False,
            include_stop_str_in_output=True,
            time_limit_ms=30_000,
        ),
        output=common_pb2.OutputOptions(skip_special_tokens=False),
        add_special_tokens=False,
    )


@pytest.mark.parametrize("input_kind", ["text", "token_ids", "chat"])
def test_generate_request_round_trips(input_kind: str) -> None:
    request = full_generate_request()
    if input_kind == "text":
        request.text = "Hello"
    elif input_kind == "token_ids":
        request.token_ids.ids.extend([1, 9690, 42])
    assert request.WhichOneof("input") == input_kind
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request and parsed.WhichOneof("input") == input_kind
    as_json = json_format.MessageToJson(request, preserving_proto_field_name=True)
    assert json_format.Parse(as_json, generation_pb2.GenerateRequest()) == request


def test_generate_response_round_trips_with_json_numbers() -> None:
    response = generation_pb2.GenerateResponse(
        request_id="req-1",
        text=" Paris.",
        token_ids=[7042, 30],
        finish_reason=generation_pb2.FINISH_REASON_STOP_STRING,
        stop_string="\n\n",
        usage=generation_pb2.Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=8),
    )
    assert generation_pb2.GenerateResponse.FromString(response.SerializeToString()) == response
    as_dict = json_format.MessageToDict(response, preserving_proto_field_name=True)
    assert as_dict["token_ids"] == [7042, 30]
    assert as_dict["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "cached_tokens": 8}
    assert as_dict["finish_reason"] == "FINISH_REASON_STOP_STRING"
    response.stop_token_id = 2  # the matched stop is one or the other
    assert response.WhichOneof("matched_stop") == "stop_token_id"


def test_unfinished_stream_delta_reads_as_not_finished() -> None:
    delta = generation_pb2.GenerateResponse(request_id="req-1", text="Par", token_ids=[7042])
    assert delta.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED == 0
    assert delta.WhichOneof("matched_stop") is None and not delta.HasField("usage")


def test_tokenization_and_admin_messages_round_trip() -> None:
    messages = [
        tokenization_pb2.TokenizeRequest(model="m", text="hi", add_special_tokens=True),
        tokenization_pb2.TokenizeResponse(
            token_ids=[1, 2], token_strings=["<s>", "hi"], count=2, max_model_len=2048
        ),
        tokenization_pb2.DetokenizeRequest(token_ids=[1, 2], skip_special_tokens=True),
        tokenization_pb2.DetokenizeResponse(text="hi"),
        admin_pb2.GetServerInfoResponse(
            version="0.1.0",
            api_version="v1",
            capabilities=admin_pb2.ServerCapabilities(tls=True, device="cpu"),
            config={"max_model_len": "2048"},
        ),
        admin_pb2.GetModelInfoResponse(
            model="m",
            max_model_len=2048,
            vocab_size=49152,
            eos_token_ids=[2],
            bos_token_id=0,
            has_chat_template=True,
            dtype="bfloat16",
            block_size=16,
            num_kv_blocks=1024,
            default_sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
            default_stopping=common_pb2.StoppingCriteria(min_tokens=0, ignore_eos=False),
        ),
        admin_pb2.ListModelsResponse(
            models=[admin_pb2.Model(id="m", max_model_len=2048, owned_by="llmrpc")]
        ),
        admin_pb2.AbortRequest(request_ids=["a", "b"]),
        admin_pb2.AbortResponse(aborted_request_ids=["a"]),
    ]
    for message in messages:
        parsed = type(message).FromString(message.SerializeToString())
        assert parsed == message
        as_json = json_format.MessageToJson(message, preserving_proto_field_name=True)
        assert json_format.Parse(as_json, type(message)()) == message
    model_info = admin_pb2.GetModelInfoResponse.FromString(messages[5].SerializeToString())
    assert model_info.HasField("bos_token_id")  # token 0 is a real BOS, not "none"


def test_grpc_stubs_expose_every_service() -> None:
    assert hasattr(generation_pb2_grpc, "GenerationServiceStub")
    assert hasattr(generation_pb2_grpc, "add_GenerationServiceServicer_to_server")
    assert hasattr(tokenization_pb2_grpc, "TokenizationServiceStub")
    assert hasattr(admin_pb2_grpc, "AdminServiceStub")

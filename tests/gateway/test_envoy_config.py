"""``llmrpc envoy-config``: every variant passes ``envoy --mode validate`` (real Envoy 1.40), the
descriptor set is complete and ordered, and bad flag combinations are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from envoy_support import TestCa, envoy_config, validate
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2, descriptor_pool

from llmrpc.gateway import envoy, envoy_cli
from llmrpc.gateway.descriptors import api_descriptor_set, api_service_names

HTTP_RULE = annotations_pb2.http
BACKENDS = ("--backend", "127.0.0.1:50051", "--backend", "127.0.0.1:50052")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("envoy-certs")
    ca = TestCa(directory)
    server_cert, server_key = ca.issue("envoy", ("localhost",))
    client_cert, client_key = ca.issue("client", ("envoy-client",))
    paths = dict(ca=ca.cert, cert=server_cert, key=server_key, ccert=client_cert, ckey=client_key)
    return {name: str(path) for name, path in paths.items()}


VARIANTS = {
    "plain": [],
    "with-gateway-cors-descriptor-file": [
        *("--gateway", "127.0.0.1:8000", "--gateway", "127.0.0.1:8001"),
        *("--cors-allowed-origin", "https://app.example", "--cors-allowed-origin", "*"),
        *("--descriptor-out", "{dir}/api.pb"),
    ],
    "tls-front": ["--tls-cert-file", "{cert}", "--tls-key-file", "{key}"],
    "mtls-front-san": [
        *("--tls-cert-file", "{cert}", "--tls-key-file", "{key}", "--tls-client-ca-file", "{ca}"),
        *("--tls-client-san", "dns:envoy-client", "--tls-client-san", "uri:spiffe://td/ns/a"),
        *("--gateway", "127.0.0.1:8000"),
    ],
    "mtls-upstream": [
        *("--upstream-ca-file", "{ca}", "--upstream-cert-file", "{ccert}"),
        *("--upstream-key-file", "{ckey}", "--upstream-sni", "localhost"),
    ],
    "dns-names-health-service": [
        *("--backend", "localhost:50053", "--gateway", "localhost:8000"),
        *("--health-check-service", "llmrpc.v1.GenerationService", "--listen", "[::]:8443"),
    ],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_generated_config_passes_envoy_validation(variant, certs, tmp_path: Path):
    args = [arg.format(dir=tmp_path, **certs) for arg in VARIANTS[variant]]
    config = envoy_config(tmp_path, *BACKENDS, *args)
    result = validate(config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"configuration '{config}' OK" in result.stdout


def test_validation_catches_a_broken_config(tmp_path: Path):
    """The check above can fail: a mistyped field is refused by Envoy."""
    config = envoy_config(tmp_path, *BACKENDS)
    text = config.read_text().replace("stream_sse_style_delimited", "stream_sse_delimited")
    config.write_text(text)
    assert validate(config).returncode != 0


def _transcoder(bootstrap: dict) -> dict:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = manager["typed_config"]["http_filters"]
    return next(f for f in filters if f["name"].endswith("grpc_json_transcoder"))["typed_config"]


def test_descriptor_out_writes_the_set_the_config_names(tmp_path: Path):
    out = tmp_path / "api.pb"
    config = envoy_config(tmp_path, *BACKENDS, "--descriptor-out", str(out))
    transcoder = _transcoder(yaml.safe_load(config.read_text()))
    assert transcoder["proto_descriptor"] == str(out)
    assert "proto_descriptor_bin" not in transcoder
    written = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert written == api_descriptor_set()


def test_descriptor_set_builds_in_order_with_every_method_bound_to_http():
    """Files load one by one into an empty pool (dependencies first, as Envoy loads them)."""
    descriptor_set = api_descriptor_set()
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_set.file:
        pool.Add(file)
    stream = pool.FindMethodByName("llmrpc.v1.GenerationService.GenerateStream")
    assert stream.output_type.full_name == "llmrpc.v1.GenerateResponse"
    assert pool.FindMessageTypeByName("google.rpc.BadRequest")  # error details as JSON
    methods = {
        f"{file.package}.{service.name}.{method.name}": method.options.Extensions[HTTP_RULE]
        for file in descriptor_set.file
        for service in file.service
        if f"{file.package}.{service.name}" in api_service_names()
        for method in service.method
    }
    assert methods["llmrpc.v1.GenerationService.Generate"].post == "/v1/generate"
    unbound = [name for name, rule in methods.items() if not rule.WhichOneof("pattern")]
    assert len(methods) >= 10 and not unbound


def test_no_route_to_the_rest_gateway_takes_a_native_json_path():
    """The transcoder serves the API's own HTTP bindings; a gateway route matching one of them
    would send it to the OpenAI gateway instead."""
    native = []
    for file in api_descriptor_set().file:
        for service in file.service:
            for method in service.method:
                rule = method.options.Extensions[HTTP_RULE]
                for binding in (rule, *rule.additional_bindings):
                    kind = binding.WhichOneof("pattern")
                    if kind:
                        native.append(getattr(binding, kind))
    assert "/v1/generate" in native and "/v1/admin/models" in native

    def taken(path: str, match: dict) -> bool:
        prefix = match.get("path_separated_prefix")
        return match.get("path") == path or (
            prefix is not None and (path == prefix or path.startswith(prefix + "/"))
        )

    matches = envoy.gateway_matches()
    assert {"path_separated_prefix": "/v1/responses"} in matches  # what the table gives
    assert not [(p, m) for p in native for m in matches if taken(p.split(":")[0], m)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert-file", "c.pem"], "--tls-cert-file and --tls-key-file go together"),
        (["--tls-client-san", "dns:x"], "--tls-client-san needs --tls-client-ca-file"),
        (
            [
                "--tls-cert-file",
                "c",
                "--tls-key-file",
                "k",
                "--tls-client-ca-file",
                "ca",
                "--tls-client-san",
                "h:x",
            ],
            "expected TYPE:VALUE",
        ),
        (["--upstream-cert-file", "c.pem"], "need --upstream-ca-file"),
        (["--upstream-ca-file", "ca", "--upstream-cert-file", "c"], "go together"),
        (["--gateway", "nohostport"], "--gateway 'nohostport': expected HOST:PORT"),
        (["--health-check-interval", "0"], "--health-check-interval and"),
        (["--unhealthy-threshold", "0"], "--unhealthy-threshold and"),
        (["--panic-threshold", "101"], "--panic-threshold must be a percentage"),
    ],
)
def test_bad_flag_combinations_are_refused_by_name(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        envoy_cli.main([*BACKENDS, *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_backend_is_required(capsys):
    with pytest.raises(SystemExit):
        envoy_cli.main([])
    assert "--backend" in capsys.readouterr().err

"""The ``llmrpc serve`` flag table: every flag of ``vllm serve`` and our own, one row each.

A row gives the flag's names, vLLM's default, its value parser, its state (works / refused /
inert, see ``flags``) and, for a flag that works, the configuration field it sets. Changing a
flag's state is changing its row. ``options`` builds the parser, ``--help`` and the
configurations from this table alone.

The REST gateway's options (``--port``, ``--h11-max-incomplete-event-size``...) are declared
once, on the gateway's settings fields in ``common.rest_settings``, which ``llmrpc gateway``
reads too; their rows here (``_rest``) only name them, keeping their place in ``--help``. They
fill the gateway's own settings objects (``FrontendConfig.rest_http``, ``rest_cors``,
``rest_api``).
"""

from __future__ import annotations

import dataclasses

from llmrpc.common.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from llmrpc.common.rest_options import declared_options
from llmrpc.engine.config import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
)
from llmrpc.engine.request import DEFAULT_MAX_JSON_WHITESPACE
from llmrpc.server.flags import (
    Flag,
    compilation_config,
    human_readable_int,
    inert,
    int_or_none,
    json_object,
    ours,
    refused,
    rest_flag,
    works,
)
from llmrpc.server.reasoning_parsers import reasoning_parser_names
from llmrpc.server.settings import DEFAULT_GRPC_PORT, MIB, REST_SECTIONS
from llmrpc.server.tool_parsers import tool_parser_names

# Why a flag is refused or inert; each is the end of a sentence naming the flag.
EPLB = (
    "balances expert load by moving redundant experts between ranks; this build places the "
    "experts once (--enable-expert-parallel) and never moves them"
)
MULTI_NODE = (
    "spreads data-parallel engines over several machines; here --data-parallel-size runs them "
    "all on this one: for several machines run one server each behind Envoy (llmrpc "
    "envoy-config) or as Kubernetes replicas (llmrpc k8s-manifests), docs/scaling.md"
)
MULTIMODAL = "needs multimodal inputs, which this build does not support"
TOOL_SERVER = "needs built-in tool servers (MCP, demo tools) for the Responses API, not served here"
NO_HUB = "needs the model hub; this build loads local folders and .gguf files only"
KV_TRANSFER = "needs disaggregated serving (KV transfer), which this build does not support"
NOT_SUPPORTED = "is not supported by this build"
CUDA_GRAPHS_ONLY = (
    "Graphs are captured on a CUDA device with --attention-backend triton, unless --enforce-eager, "
    "--enable-lora, --tensor-parallel-size above 1, --model-impl transformers or an encoder "
    "model (a warning says which); set on the CPU, this flag stops start-up."
)
COMPILATION_HELP = (
    'torch.compile of decode steps: 0 (default) eager; 1-3 (-O3, {"level": 3}, {"mode": 3}; '
    "other keys refused) compile the native model's forward at start-up, one graph for all "
    "batch sizes, run by steps of decodes and prompt chunks with up to 256 tokens of context, "
    "cached in $TORCHINDUCTOR_CACHE_DIR (default ~/.cache/llmrpc/inductor): the first start "
    "on a machine compiles, later ones read the cache. A quantized model's graph runs steps "
    "of at most the tokens its "
    "packed kernels take (see --quantization). With --attention-backend triton (the only "
    "backend compiled on CUDA) its kernels are operations of the graph, and CUDA graphs "
    "capture the compiled forward. A failure raised in Python is logged once, then steps run "
    "eager; a fault on the device is not recovered from (CUDA's error is sticky)."
)
KV_EVENTS_HELP = (
    "The prefix cache's events, vLLM's JSON: {\"enable_kv_cache_events\": true} records each "
    "block entering the cache (its chained hash and tokens), leaving it, and a whole-cache "
    "reset, and serves them on the gRPC port by vllm.grpc.engine.VllmEngine/SubscribeKvEvents "
    "(the smg router's cache-aware routing reads them). buffer_steps (default 10000): batches "
    "kept for a subscriber that resumes from a batch number; max_queue_size (default 100000): "
    "batches a subscriber may fall behind before its stream ends with DATA_LOSS. There is no "
    "ZeroMQ publisher: publisher, endpoint, replay_endpoint, hwm and topic are refused. "
    "docs/api.md: smg."
)
SPECULATIVE_HELP = (
    "Speculative decoding, vLLM's JSON (or dotted keys: --speculative-config.method ngram): "
    '{"method": "ngram", "num_speculative_tokens": K} proposes, after a decoding request\'s '
    "last token, up to K tokens that followed an earlier occurrence of its longest suffix of "
    "prompt_lookup_min to prompt_lookup_max tokens (default 5 and 5) in its own prompt and "
    "output, and verifies them in one step; the output keeps the model's distribution "
    "exactly (greedy in float32: the same tokens). Drafts are cut to those whose chance of "
    "acceptance pays for their rows at the batch's measured step cost, and a request whose "
    "drafts all fail backs off for 1, 2, 4 ... 32 steps; disable_by_batch_size N: no drafts in "
    "a step of N or more requests; max_model_len N: none past N tokens. "
    '{"model": DRAFT, "num_speculative_tokens": K} (method draft_model): the model DRAFT, '
    "with the served model's tokenizer, proposes its K likeliest next tokens, with a KV cache "
    "of its own in --kv-cache-memory. Other methods (eagle, medusa, mtp ...) and keys "
    "stop start-up, as do --tensor-parallel-size above 1 and --batch-invariant with it. "
    "Default: off."
)
OLD_FEATURE = (
    "belongs to a feature of older vLLM releases that this engine does not have; accepted so "
    "old command lines still start"
)


# The REST gateway's options, declared on the gateway's settings fields (common.rest_settings)
# and taken by llmrpc gateway too: a row names one, which keeps its place in --help.
_REST_FLAGS = {
    declared.name: rest_flag(declared, section)
    for section, settings_class in REST_SECTIONS.items()
    for declared in declared_options(settings_class)
}


def _rest(name: str) -> Flag:
    return _REST_FLAGS[name]


def _group(name: str, *flags: Flag) -> list[Flag]:
    return [dataclasses.replace(flag, group=name) for flag in flags]


_OURS = _group(
    "llmrpc (our own flags)",
    ours("--grpc-port", DEFAULT_GRPC_PORT, int, "frontend.grpc_port", "gRPC port; always on."),
    ours("--rest-gateway", True, None, "frontend.rest_gateway",
         "Serve the OpenAI-compatible REST gateway on --host/--port (--no-rest-gateway: gRPC "
         "only)."),
    _rest("--max-request-body-size"),
    _rest("--request-body-timeout"),
    _rest("--request-header-timeout"),
    _rest("--rest-keep-alive-timeout"),
    _rest("--rest-max-connections"),
    ours(
        "--health-port", None, int, "frontend.health_port",
        "A second, plaintext port serving grpc.health.v1 alone, for Kubernetes gRPC probes "
        "(which cannot use TLS). Default: none.",
    ),
    ours("--admin-api-key", (), str, "frontend.admin_api_key",
         "Bearer key(s) for the admin-only RPCs (ResetPrefixCache, Sleep, WakeUp), where "
         "--api-key keys then get PERMISSION_DENIED, and for aborting any caller's request "
         "(other keys abort only their own). An admin key also generates. Default: the "
         "LLMRPC_ADMIN_API_KEY environment variable, if set; without one, --api-key keys may "
         "call the admin-only RPCs.",
         nargs="+", secret=True),
    _rest("--responses-store-max-bytes"),
    _rest("--strict-request-fields"),
    ours("--log-level", "info", str, "logs.level", "Logging level.",
         choices=("debug", "info", "warning", "error", "critical")),
    ours("--log-stats-interval", 10.0, float, "logs.stats_interval_s",
         "Seconds between periodic stats lines (see --disable-log-stats).", metavar="SECONDS"),
    ours("--attention-backend", "auto", str, "model.attention_backend",
         "Kernels of attention, norms, rotary and sampling: triton (CUDA; on the CPU only under "
         "TRITON_INTERPRET=1), torch, or auto (triton on CUDA, torch elsewhere).",
         choices=("auto", "torch", "triton")),
    ours("--batch-invariant", False, None, "model.batch_invariant",
         "A request's tokens (greedy or seeded) do not depend on the rest of the batch. Needs "
         "--dtype bfloat16 on a CPU with AVX512-BF16 or AVX2 (our blocked linear kernels), "
         "no --quantization; refused elsewhere (on CUDA too)."),
    ours("--kv-cache-memory", 4.0, float, "cache.kv_cache_memory_gib",
         "GiB of host memory for the KV cache when the engine runs on the CPU (on CUDA, "
         "--gpu-memory-utilization sizes it); it sets the number of KV blocks unless "
         "--num-gpu-blocks-override does.", metavar="GIB"),
    ours("--drain-delay", 0.0, float, "frontend.drain_delay_s",
         "On SIGTERM, health turns NOT_SERVING at once (REST /health: 503) and new calls, gRPC "
         "and REST, are still served for this many seconds, so load balancers can stop routing "
         "here; then the server stops. Set it to the probe period behind a load balancer.",
         metavar="SECONDS"),
    ours("--shutdown-grace", 10.0, float, "frontend.shutdown_grace_s",
         "After the drain delay, calls in flight (REST streams included) get this long to "
         "finish; new calls get UNAVAILABLE (REST: 503). A second SIGTERM cancels them at once.",
         metavar="SECONDS"),
    ours("--engine-stall-timeout", 60.0, float, "frontend.engine_stall_timeout_s",
         "Health turns NOT_SERVING (REST /health: 503) while the engine has requests in flight "
         "and has not finished a step for this many seconds (stopped, or a step that does not "
         "return), or, idle, has not reported for this long (5 s at least; it reports every "
         "second); SERVING again once it steps. GetLoad says engine_stalled. Raise it above "
         "your longest step: a full --max-num-batched-tokens prefill of a large model on a "
         "CPU. Default: 60.", metavar="SECONDS"),
    ours("--max-waiting-requests", None, int, "limits.max_waiting_requests",
         "Most sequences (n per prompt; a REST request's prompts count whole) waiting for a "
         "place in the batch; past it, RESOURCE_EXHAUSTED with a RetryInfo detail. Default: no "
         "bound."),
    ours("--max-prompts-per-request", DEFAULT_MAX_PROMPTS_PER_REQUEST, int,
         "limits.max_prompts_per_request",
         "Most prompts (completions' prompt, embeddings' input, Embed's inputs) in one "
         "request; more are a 400 / INVALID_ARGUMENT."),
    ours("--max-sequences-per-request", DEFAULT_MAX_SEQUENCES_PER_REQUEST, int,
         "limits.max_sequences_per_request",
         "Most sequences (prompts x n) in one request; more are a 400 / INVALID_ARGUMENT."),
    ours("--grpc-max-receive-message-size", 16 * MIB, human_readable_int,
         "limits.max_receive_message_size",
         "Largest request message in bytes (16M = 16 MiB); larger ones get RESOURCE_EXHAUSTED.",
         metavar="BYTES"),
    ours("--grpc-max-send-message-size", 16 * MIB, human_readable_int,
         "limits.max_send_message_size", "Largest response message in bytes.", metavar="BYTES"),
    ours("--grpc-keepalive-time", 60.0, float, "limits.keepalive_time_s",
         "Seconds between the server's keepalive pings on a connection.", metavar="SECONDS"),
    ours("--grpc-keepalive-timeout", 20.0, float, "limits.keepalive_timeout_s",
         "Seconds to wait for a keepalive ping's answer before closing the connection.",
         metavar="SECONDS"),
    ours("--grpc-keepalive-min-ping-interval", 10.0, float, "limits.min_ping_interval_s",
         "Shortest interval allowed between a client's pings; a client pinging more often is "
         "disconnected (GOAWAY too_many_pings).", metavar="SECONDS"),
    ours("--grpc-max-connection-age", None, float, "limits.max_connection_age_s",
         "Close connections after this many seconds, so clients spread over new replicas. "
         "Default: never.", metavar="SECONDS"),
    ours("--grpc-max-connection-age-grace", None, float, "limits.max_connection_age_grace_s",
         "Calls in flight on a connection past its age get this long to finish. Default: "
         "unlimited.", metavar="SECONDS"),
    ours("--grpc-max-concurrent-streams", 256, int, "limits.max_concurrent_streams",
         "Most calls in flight on one connection; more wait on the client (256: a full batch "
         "of the default --max-num-seqs)."),
    ours("--grpc-max-connections", None, int, "limits.max_connections",
         "Most connections the gRPC port holds at once; more are closed as they are accepted, "
         "before any handshake. Default: a quarter of the process's open-file limit (which "
         "llmrpc serve raises to its hard limit at start-up)."),
    ours("--grpc-handshake-timeout", 10.0, float, "limits.handshake_timeout_s",
         "Seconds a new gRPC connection has to finish its TLS and HTTP/2 handshake.",
         metavar="SECONDS"),
    ours("--grpc-request-message-timeout", 30.0, float, "limits.request_message_timeout_s",
         "Seconds a call has, from its headers, to send its request message; later, the call "
         "ends DEADLINE_EXCEEDED. A call with a wrong API key ends before its message is read.",
         metavar="SECONDS"),
)  # fmt: skip

_FRONTEND = _group(
    "frontend",
    works("--config", None, str, None,
          "YAML file of flags: keys are flag names without the leading dashes; the command line "
          "wins over the file.", metavar="FILE"),
    works("--host", None, str, "frontend.host",
          "Address the gRPC server and the REST gateway listen on. Default: all addresses."),
    _rest("--port"),
    _rest("--uds"),
    _rest("--uvicorn-log-level"),
    _rest("--disable-uvicorn-access-log"),
    _rest("--allow-credentials"),
    _rest("--allowed-origins"),
    _rest("--allowed-methods"),
    _rest("--allowed-headers"),
    works("--api-key", (), str, "frontend.api_key",
          "Bearer key(s) every call must send: gRPC metadata or the REST header "
          "'authorization: Bearer KEY' (else UNAUTHENTICATED, HTTP 401). Health, reflection, "
          "/health, /version and /metrics are exempt. Default: the VLLM_API_KEY environment "
          "variable, if set.", nargs="+", secret=True),
    works("--ssl-keyfile", None, str, "tls.keyfile", "Private key (PEM) of --ssl-certfile."),
    works("--ssl-certfile", None, str, "tls.certfile",
          "Server certificate chain (PEM): TLS on the gRPC port and the REST gateway."),
    works("--ssl-ca-certs", None, str, "tls.ca_certs",
          "CA certificates (PEM) that client certificates must chain to."),
    works("--ssl-cert-reqs", 0, int, "tls.cert_reqs",
          "Client certificates: 0 not asked for, 2 required (mutual TLS). 1 (optional) is "
          "honoured by the REST gateway and served as 0 on gRPC, with a warning: gRPC servers "
          "can only require client certificates or not ask.",
          choices=(0, 1, 2)),
    works("--enable-ssl-refresh", False, None, "tls.refresh",
          "Serve replaced certificate and key files to new connections without a restart."),
    _rest("--root-path"),
    _rest("--middleware"),
    _rest("--disable-fastapi-docs"),
    _rest("--enable-request-id-headers"),
    _rest("--h11-max-incomplete-event-size"),
    _rest("--h11-max-header-count"),
    works("--chat-template", None, str, "frontend.chat_template",
          "Chat template for chat input: the path of a readable file, else the template "
          "itself when the value holds a brace or a line break (anything else is refused). "
          "Default: the tokenizer's."),
    _rest("--chat-template-content-format"),
    works("--trust-request-chat-template", False, None, "frontend.trust_request_chat_template",
          "Accept chat templates sent with requests (chat.chat_template; chat_template on "
          "REST). Off: such requests get INVALID_ARGUMENT. On: they render off the event loop, "
          "stopped after 2 s, their text refused past 4,194,304 characters; a template can still "
          "use memory while it runs, so trust its senders."),
    ours("--hide-model-path", False, None, "frontend.hide_model_path",
         "Answers name no server folder: model roots and adapter paths are names, the served "
         "name defaults to --model's last component (docs/security.md: Model paths)."),
    _rest("--response-role"),
    works("--lora-modules", None, str, "lora.lora_modules",
          "LoRA adapters loaded at start-up (needs --enable-lora): name=path, or JSON "
          '{"name": ..., "path": ..., "base_model_name": ...}; path is a local PEFT folder.',
          nargs="+"),
    _rest("--return-tokens-as-token-ids"),
    works("--enable-auto-tool-choice", False, None, "parsing.enable_auto_tool_choice",
          "Chat tool_choice auto: calls read by --tool-call-parser."),
    works("--tool-call-parser", None, str, "parsing.tool_call_parser",
          f"Tool-call format: {', '.join(tool_parser_names())}, or a plugin's.",
          metavar="NAME"),
    works("--tool-parser-plugin", "", str, "parsing.tool_parser_plugin",
          "Python file registering tool parsers.", metavar="FILE"),
    works("--exclude-tools-when-tool-choice-none", False, None,
          "parsing.exclude_tools_when_tool_choice_none",
          "No tools in prompts of tool_choice none."),
    refused("--tool-server", None, str, TOOL_SERVER),
    _rest("--enable-prompt-tokens-details"),
    _rest("--enable-force-include-usage"),
    _rest("--enable-server-load-tracking"),
    _rest("--enable-tokenizer-info-endpoint"),
    works("--enable-log-requests", False, None, "logs.enable_log_requests",
          "Log each generation request: prompt (cut at --max-log-len) and parameters."),
    inert("--disable-log-requests", False, None,
          "is deprecated in vLLM: requests are logged only with --enable-log-requests"),
    works("--enable-log-outputs", False, None, "logs.enable_log_outputs",
          "Log each request's output when it finishes (cut at --max-log-len)."),
    works("--max-log-len", None, int, "logs.max_log_len",
          "Most prompt or output characters (and token ids) in a logged line. Default: all."),
    works("--disable-log-stats", False, None, "logs.disable_log_stats",
          "No periodic stats line (running, waiting, KV cache usage, throughput)."),
    works("--log-config-file", None, str, "logs.config_file",
          "JSON logging configuration (logging.config.dictConfig) for every logger; formats "
          "may use %%(request_id)s."),
    works("--disable-frontend-multiprocessing", False, None,
          "frontend.disable_frontend_multiprocessing",
          "Run the engine core on a thread of the server's process, sharing one GIL with gRPC, "
          "REST and the tokenizers. Default: a process of its own, the only one that loads "
          "torch, over local ZeroMQ sockets; if it dies the server reports NOT_SERVING and exits "
          "1."),
    refused("--api-server-count", 1, int,
            "runs several API server processes; this build serves gRPC and REST from one "
            "process"),
    refused("--headless", False, None, "would serve no frontend; this build always serves gRPC"),
)  # fmt: skip

_MODEL = _group(
    "model",
    works("--model", None, str, "model.model",
          "Model to serve (the same as MODEL): a local folder holding config.json, or a .gguf "
          "file. Default: the packaged SmolLM2-135M-Instruct."),
    works("--served-model-name", None, str, "model.served_model_name",
          "Name(s) clients use in the model field; the first is used when a request names "
          "none. Default: the "
          "--model string, or SmolLM2-135M-Instruct for the packaged model.", nargs="+"),
    works("--tokenizer", None, str, "model.tokenizer",
          "Tokenizer folder or .gguf file. Default: the model's."),
    refused("--tokenizer-mode", "auto", str, NOT_SUPPORTED,
            choices=("auto", "slow", "mistral", "custom")),
    refused("--tokenizer-revision", None, str, NO_HUB),
    refused("--revision", None, str, NO_HUB),
    refused("--code-revision", None, str, NO_HUB),
    inert("--trust-remote-code", False, None,
          "has nothing to trust: a model folder's own Python code is never run, only llmrpc's "
          "models and Transformers' built-in ones"),
    refused("--hf-config-path", None, str, NOT_SUPPORTED),
    inert("--hf-token", None, str, "has no hub to authenticate to",
          nargs="?", const=True, secret=True),
    works("--hf-overrides", {}, json_object, "model.hf_overrides",
          "JSON object of entries set on the model's Hugging Face config before the model is "
          "built."),
    refused("--config-format", "auto", str, NOT_SUPPORTED, choices=("auto", "hf", "mistral")),
    works("--dtype", "auto", str, "model.dtype",
          "Weight and activation dtype; auto: bfloat16 unless the checkpoint is float16.",
          choices=DTYPES),
    works("--seed", 0, int, "model.seed",
          "Seeds the sampling of requests that set no seed (each draws its own from this one, "
          "in arrival order) and the random weights of --load-format dummy."),
    works("--max-model-len", None, human_readable_int, "model.max_model_len",
          "Context window in tokens (prompt plus output); takes 1k/1K/25.6k/2m: lower case "
          "is powers of 1000, upper case powers of 1024. Default: the model's own (its "
          "shortest attention window under --disable-sliding-window or the Transformers "
          "fallback)."),
    works(("--quantization", "-q"), None, str, "model.quantization",
          "Weight-only quantization when the model loads: int8 (per output channel), int4 "
          "(groups of 32 inputs) or gguf (a .gguf --model served from its Q4_0, Q4_1, Q5_0, "
          "Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks). Linear layers and lm_head are packed; "
          "docs/serving.md says when each kernel runs and when a step dequantizes. Default: "
          "none (a .gguf is dequantized to --dtype).",
          choices=QUANTIZATION_METHODS),
    works("--rope-scaling", {}, json_object, "model.rope_scaling",
          "JSON rope scaling over the model's own (rope_type default, linear or llama3)."),
    works("--rope-theta", None, float, "model.rope_theta", "Rope base frequency override."),
    works("--enforce-eager", False, None, "compilation.enforce_eager",
          "Level 0 (eager) whatever -O says, and no CUDA graphs; a warning names the level it "
          "overrides."),
    works("--max-seq-len-to-capture", None, int, "compilation.max_seq_len_to_capture",
          "Longest context (capped at --max-model-len) of a decode step replayed from a CUDA "
          "graph; a step with a longer one runs eager. It sets the width of the graphs' block "
          "tables. Default 8192. " + CUDA_GRAPHS_ONLY),
    works("--max-logprobs", 20, int, "model.max_logprobs",
          "Most logprobs a request may ask for per token; -1: no limit."),
    works("--logprobs-mode", "raw_logprobs", str, "model.logprobs_mode",
          "What logprobs report: log-softmax of the raw or processed (after penalties, "
          "temperature, top-k/p) logits, or those logits themselves.",
          choices=("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")),
    works("--disable-sliding-window", False, None, "model.disable_sliding_window",
          "Cap the context of a model with attention windows at its window and attend over all "
          "of it. Without it, the native models attend within each layer's window over their "
          "whole context (--model-impl transformers caps it at the window as this flag does)."),
    inert("--disable-cascade-attn", False, None,
          "turns off cascade attention, which the engine's attention does not use"),
    works("--skip-tokenizer-init", False, None, "model.skip_tokenizer_init",
          "Load no tokenizer: token ids in, token ids out (text input, stop strings refused)."),
    refused("--enable-prompt-embeds", False, None, NOT_SUPPORTED),
    works("--generation-config", "auto", str, "model.generation_config",
          "Default sampling: auto (the model's generation_config.json; for the packaged "
          "default model, temperature 0.2 and top_p 0.9 as its model card samples), vllm "
          "(built-in defaults) or a folder holding one."),
    works("--override-generation-config", {}, json_object, "model.override_generation_config",
          "JSON defaults over the generation config (temperature, top_p, top_k, min_p, "
          "repetition_penalty, max_new_tokens)."),
    works("--enable-sleep-mode", False, None, "model.enable_sleep_mode",
          "Allow AdminService Sleep and WakeUp (free the KV cache, and the weights at level 2)."),
    works("--model-impl", "auto", str, "model.model_impl",
          "vllm: our native models; transformers: Transformers' own causal LM on our KV "
          "cache (one whose attention goes through Transformers' attention interface); auto: "
          "native when there is one.",
          choices=("auto", "vllm", "transformers")),
    works("--runner", "auto", str, "model.runner",
          "pooling: embeddings only (generation refused); generate: text, and embeddings of a "
          "decoder beside it; auto: pooling for BERT encoders, else generate; draft refused.",
          choices=("auto", "generate", "pooling", "draft")),
    works("--convert", "auto", str, "model.convert",
          "embed: a decoder LM as an embedder (LAST pooling, normalized); classify, reward "
          "refused.", choices=("auto", "none", "embed", "classify", "reward")),
    works("--task", None, str, "model.task",
          "embed (embedding): --convert embed; auto, generate: no change; others refused."),
    refused("--logits-processors", None, str, NOT_SUPPORTED, nargs="+"),
    refused("--logits-processor-pattern", None, str, NOT_SUPPORTED),
    works("--override-pooler-config", {}, json_object, "model.override_pooler_config",
          'JSON over the model\'s pooling: {"pooling_type": "LAST|MEAN|CLS", "normalize": '
          "true|false}; other keys refused."),
    refused("--override-attention-dtype", None, str, NOT_SUPPORTED),
    refused("--allowed-local-media-path", "", str, MULTIMODAL),
    inert("--disable-async-output-proc", False, None,
          "turns off asynchronous output processing; this engine turns each step's tokens into "
          "outputs within the step"),
    inert("--override-neuron-config", {}, json_object, "configures AWS Neuron devices"),
)  # fmt: skip

_LOADING = _group(
    "loading",
    works("--load-format", "auto", str, "model.load_format",
          "dummy: random weights, for tests and benchmarks; auto, safetensors and gguf all "
          "read what --model names (a folder's safetensors files, or a .gguf file converted "
          "once).",
          choices=LOAD_FORMATS),
    inert("--download-dir", None, str, "has nothing to download: models are local"),
    refused("--model-loader-extra-config", {}, json_object, NOT_SUPPORTED),
    inert("--ignore-patterns", None, str, "has nothing to download: models are local",
          nargs="+"),
    inert("--use-tqdm-on-load", True, None,
          "switches the weight-loading progress bar; here converting a .gguf file always shows "
          "one and reading safetensors weights shows none"),
    inert("--pt-load-map-location", "cpu", str, "applies to .pt checkpoints, not read here"),
)  # fmt: skip

_STRUCTURED_OUTPUT = _group(
    "structured output and reasoning",
    works("--guided-decoding-backend", "auto", str, "structured_output.backend",
          "Structured output: xgrammar, guidance, or auto (xgrammar, then guidance).",
          metavar="NAME"),
    works("--guided-decoding-disable-fallback", False, None, "structured_output.disable_fallback",
          "auto: xgrammar alone."),
    works("--guided-decoding-disable-any-whitespace", False, None,
          "structured_output.disable_any_whitespace", "JSON without optional whitespace."),
    ours("--structured-output-max-whitespace", DEFAULT_MAX_JSON_WHITESPACE, int_or_none,
         "structured_output.max_whitespace",
         "JSON: at most N whitespace characters in a row between tokens (both backends); none: "
         "unbounded.", metavar="N"),
    ours("--structured-output-compile-timeout", DEFAULT_COMPILE_TIMEOUT_S, float,
         "structured_output.compile_timeout_s",
         "Seconds a grammar has to compile; past them its request fails (INVALID_ARGUMENT, "
         "HTTP 400).", metavar="SECONDS"),
    works("--guided-decoding-disable-additional-properties", False, None,
          "structured_output.disable_additional_properties",
          "guidance: JSON objects closed to unnamed properties (xgrammar's always are)."),
    works("--reasoning-parser", "", str, "parsing.reasoning_parser",
          f"Chat reasoning_content format: {', '.join(reasoning_parser_names())}, or a plugin's.",
          metavar="NAME"),
    works("--reasoning-parser-plugin", "", str, "parsing.reasoning_parser_plugin",
          "Python file registering reasoning parsers.", metavar="FILE"),
    inert("--enable-reasoning", False, None,
          "is deprecated in vLLM: --reasoning-parser alone splits reasoning"),
)  # fmt: skip

_PARALLELISM = _group(
    "parallelism",
    works(("--tensor-parallel-size", "-tp"), 1, int, "parallel.tensor_parallel_size",
          "Ranks the model is split over: rank 0 is the engine process, ranks 1..N-1 processes "
          "of their own (see --distributed-executor-backend), joined by torch.distributed: gloo "
          "on the CPU; on CUDA NCCL, rank r on cuda:r of the visible devices (fewer than N "
          "visible: refused), each rank's KV cache sized by --gpu-memory-utilization of its own "
          "device (unless --num-gpu-blocks-override), all taking the fewest blocks of any rank. "
          "Each holds its share of the attention heads (KV heads copied where there are fewer "
          "than ranks), MLP features and vocabulary, and its heads' part of the KV cache; every "
          "step costs two all-reduces per layer. MoE models: each rank holds its share of every "
          "expert's features (or, with --enable-expert-parallel, its share of the experts). "
          "Native Llama-family and MoE models whose heads split evenly (not OLMoE); refused "
          "with --enable-lora, --runner pooling, --quantization, --model-impl transformers, "
          "-O1..3, --enable-sleep-mode. Each rank takes its share of the cores "
          "(OMP_NUM_THREADS each, if set). A rank that dies stops the server. The NCCL path is "
          "untested here (no GPU in this build's tests)."),
    refused(("--pipeline-parallel-size", "-pp"), 1, int,
            "splits a model by layers; this build splits one by tensor parallelism only "
            "(--tensor-parallel-size)"),
    works(("--data-parallel-size", "-dp"), 1, int, "frontend.data_parallel_size",
          "Engine processes on this machine behind this one server, each with its own copy of "
          "the model and KV cache (--kv-cache-memory each); a new request goes to the engine "
          "holding the fewest unfinished requests (counting each of n samples), or, with "
          "prefix caching, to the engine that last took its prompt's longest known prefix of "
          "up to 8 blocks while that one holds at most 2 more; admin calls reach every "
          "engine. On the CPU the engines split the cores (OMP_NUM_THREADS each, unless set); "
          "on CUDA each takes one GPU (CUDA_VISIBLE_DEVICES). Health is SERVING once all "
          "serve; one engine's death stops the server. Not with "
          "--disable-frontend-multiprocessing."),
    refused(("--data-parallel-rank", "-dpn"), None, int, MULTI_NODE),
    refused(("--data-parallel-start-rank", "-dpr"), None, int, MULTI_NODE),
    works(("--data-parallel-size-local", "-dpl"), None, int,
          "frontend.data_parallel_size_local",
          "Accepted only equal to --data-parallel-size: every engine runs on this machine."),
    refused(("--data-parallel-address", "-dpa"), None, str, MULTI_NODE),
    refused(("--data-parallel-rpc-port", "-dpp"), None, int, MULTI_NODE),
    refused(("--data-parallel-backend", "-dpb"), "mp", str, MULTI_NODE, choices=("mp", "ray")),
    refused("--data-parallel-hybrid-lb", False, None, MULTI_NODE),
    works("--distributed-executor-backend", None, str, "parallel.distributed_executor_backend",
          "How tensor-parallel ranks run: mp (the default for --tensor-parallel-size > 1) starts "
          "ranks 1..N-1 as processes on this machine; ray as Ray actors (one CPU each; on CUDA "
          "also one GPU, which the actor computes on) on the "
          "running cluster RAY_ADDRESS names (ray start --head; pip install 'llmrpc[ray]'; the "
          "model path must exist on every node); uni (the default for one rank) runs the engine "
          "alone and refuses more ranks; external_launcher is refused.",
          choices=("mp", "ray", "uni", "external_launcher")),
    works("--enable-expert-parallel", False, None, "parallel.enable_expert_parallel",
          "With --tensor-parallel-size N, each rank holds 1/N of a MoE model's experts whole "
          "(the experts must split evenly) instead of 1/N of every expert's features; every "
          "rank routes every token and one all-reduce sums the experts' parts, as without it. "
          "Attention is split as without it. With one rank, or on a model without experts, "
          "it changes nothing."),
    refused("--enable-eplb", False, None, EPLB),
    refused("--num-redundant-experts", 0, int, EPLB),
    refused("--eplb-window-size", 1000, int, EPLB),
    refused("--eplb-step-interval", 3000, int, EPLB),
    refused("--eplb-log-balancedness", False, None, EPLB),
    inert("--max-parallel-loading-workers", None, int,
          "applies when several workers load the model; here one thread loads it"),
    inert("--disable-custom-all-reduce", False, None, "applies to several devices; one is used"),
    refused("--worker-cls", "auto", str, NOT_SUPPORTED),
    refused("--worker-extension-cls", "", str, NOT_SUPPORTED),
    inert("--ray-workers-use-nsight", False, None, "profiles Ray workers; there are none"),
    refused("--enable-multimodal-encoder-data-parallel", False, None, MULTIMODAL),
)  # fmt: skip

_KV_CACHE = _group(
    "KV cache",
    works("--block-size", 16, int, "cache.block_size",
          "Tokens per KV cache block (a power of two)."),
    works("--gpu-memory-utilization", 0.9, float, "cache.gpu_memory_utilization",
          "On CUDA: the share of device memory to use; the KV cache gets what the largest step, "
          "run at start-up, leaves. On the CPU --kv-cache-memory sizes it (this one is unused)."),
    inert("--swap-space", 4.0, float, "sizes swap for preemption; preemption recomputes here"),
    works("--kv-cache-dtype", "auto", str, "cache.cache_dtype",
          "auto (the model's dtype), or fp8 (= fp8_e4m3) or fp8_e5m2: 2-4x the tokens in the "
          "same memory, stored over a per-layer scale (1; none read from checkpoints). On the "
          "CPU it skips the C++ decode kernel (slower). fp8_inc (Gaudi) is refused.",
          choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")),
    works("--num-gpu-blocks-override", None, int, "cache.num_gpu_blocks_override",
          "Exact number of KV cache blocks, overriding --kv-cache-memory."),
    works("--enable-prefix-caching", True, None, "cache.enable_prefix_caching",
          "Reuse the KV cache of shared prompt prefixes."),
    works("--prefix-caching-hash-algo", "builtin", str, "cache.prefix_caching_hash_algo",
          "Block hash of the prefix cache: builtin (fast), sha256, or sha256_cbor_64bit.",
          choices=("builtin", "sha256", "sha256_cbor_64bit")),
    refused("--cpu-offload-gb", 0.0, float, NOT_SUPPORTED),
    inert("--calculate-kv-scales", False, None, "applies to fp8 KV caches, not used here"),
    inert("--kv-sharing-fast-prefill", False, None,
          "speeds up the prefill of models whose layers share KV caches, which this engine "
          "does not do"),
    inert("--mamba-cache-dtype", "auto", str, "applies to Mamba models, not served here"),
    inert("--mamba-ssm-cache-dtype", "auto", str, "applies to Mamba models, not served here"),
)  # fmt: skip

_SCHEDULER = _group(
    "scheduler",
    works("--max-num-batched-tokens", 2048, human_readable_int,
          "scheduler.max_num_batched_tokens",
          "Most tokens computed in one engine step. Decodes take theirs first; the prompts in "
          "progress, and the queue as one while a request there may take a seat, share the rest "
          "equally, and what the queue leaves goes back to the prompts: a long prefill does "
          "not hold back a waiting request that fits the queue's share."),
    works("--max-num-seqs", 256, int, "scheduler.max_num_seqs", "Most requests in one batch."),
    works("--enable-chunked-prefill", True, None, "scheduler.enable_chunked_prefill",
          "Split long prompts over steps, each shared with the decodes and the queue; off: a "
          "prompt is computed in one step, and one that does not fit what a step leaves waits "
          "with those behind it."),
    works("--max-num-partial-prefills", 1, int, "scheduler.max_num_partial_prefills",
          "Most prompts one step may leave part-computed; a waiting prompt that would be one "
          "more waits, and shorter ones behind it that fit the step whole go first."),
    works("--max-long-partial-prefills", 1, int, "scheduler.max_long_partial_prefills",
          "Of those, how many may be long (see --long-prefill-token-threshold)."),
    works("--long-prefill-token-threshold", 0, human_readable_int,
          "scheduler.long_prefill_token_threshold",
          "A prompt with more than this many tokens left to compute is long; it also caps "
          "the tokens one prompt computes in a step (0: off)."),
    works("--scheduling-policy", "fcfs", str, "scheduler.scheduling_policy",
          "fcfs, or priority: a request's priority (lower first), ties by arrival. Callers "
          "(API keys, else connections) take turns within a priority; see docs/serving.md.",
          choices=("fcfs", "priority")),
    works("--preemption-mode", None, str, "scheduler.preemption_mode",
          "recompute (the default); swap is refused: preemption recomputes, never swaps.",
          choices=("recompute", "swap")),
    refused("--num-lookahead-slots", 0, int, NOT_SUPPORTED),
    refused("--scheduler-delay-factor", 0.0, float, NOT_SUPPORTED),
    works("--cuda-graph-sizes", [], int, "compilation.cuda_graph_sizes",
          "Batch sizes at which decodes-only steps are captured as CUDA graphs at start-up "
          "(a step is padded to the next size; a larger one runs eager): one value N gives 1, "
          "2, 4 and the multiples of 8 up to N, several give those sizes; each capped at "
          "--max-num-seqs. Default: N = min(2 x --max-num-seqs, 512). " + CUDA_GRAPHS_ONLY,
          nargs="+", metavar="SIZE"),
    refused("--scheduler-cls", "vllm.core.scheduler.Scheduler", str, NOT_SUPPORTED),
    inert("--disable-hybrid-kv-cache-manager", False, None,
          "turns off the hybrid KV cache manager (for models mixing attention types); this "
          "engine's KV cache has one kind of block for every layer"),
    inert("--async-scheduling", False, None,
          "overlaps scheduling with model execution on an accelerator; this engine schedules "
          "each step before running it"),
    inert("--disable-chunked-mm-input", False, None,
          "applies to multimodal inputs, which this build does not support"),
    inert("--num-scheduler-steps", 1, int, OLD_FEATURE),
    inert("--multi-step-stream-outputs", True, None, OLD_FEATURE),
)  # fmt: skip

_LORA = _group(
    "LoRA",
    works("--enable-lora", False, None, "lora.enabled",
          "Serve PEFT LoRA adapters (native models): a request names one (gRPC lora, OpenAI "
          "model); a batch mixes adapters and the base model. Refused with -O1..3 and "
          "--batch-invariant."),
    works("--enable-lora-bias", False, None, "lora.enable_lora_bias",
          "Take adapters whose lora_B has a bias (PEFT lora_bias=True); else they are refused."),
    works("--max-loras", 1, int, "lora.max_loras",
          "Adapters one step may mix; requests of one more adapter wait (base-model ones pass)."),
    works("--max-lora-rank", 16, int, "lora.max_lora_rank",
          "Largest adapter rank; a higher one is refused at load (INVALID_ARGUMENT).",
          choices=(1, 8, 16, 32, 64, 128, 256, 320, 512)),
    inert("--lora-extra-vocab-size", 256, int,
          "reserves rows for adapters' added tokens; adapters with added tokens (embedding "
          "targets) are refused here, so no rows are needed"),
    works("--lora-dtype", "auto", str, "lora.lora_dtype",
          "dtype of the adapters' weights: auto, the model's (one that differs from the "
          "model's is refused at start-up).",
          choices=("auto", "float16", "bfloat16", "float32")),
    works("--max-cpu-loras", None, int, "lora.max_cpu_loras",
          "Adapters kept in host memory (default --max-loras); others are read again when used."),
    inert("--fully-sharded-loras", False, None,
          "shards LoRA layers across tensor-parallel ranks; LoRA runs on one rank here (refused "
          "with --tensor-parallel-size above 1), with nothing to shard"),
    refused("--long-lora-scaling-factors", None, float,
            "needs long-context LoRA (per-adapter rope scaling), which this build does not "
            "support", nargs="+"),
    refused("--default-mm-loras", None, json_object, MULTIMODAL),
)  # fmt: skip

_MULTIMODAL = _group(
    "multimodal",
    refused("--limit-mm-per-prompt", {}, json_object, MULTIMODAL),
    refused("--media-io-kwargs", {}, json_object, MULTIMODAL),
    refused("--mm-processor-kwargs", None, json_object, MULTIMODAL),
    refused("--mm-processor-cache-gb", 4.0, float, MULTIMODAL),
    refused("--disable-mm-preprocessor-cache", False, None, MULTIMODAL),
    refused("--interleave-mm-strings", False, None, MULTIMODAL),
    refused("--skip-mm-profiling", False, None, MULTIMODAL),
)  # fmt: skip

_OBSERVABILITY = _group(
    "observability",
    works("--otlp-traces-endpoint", None, str, "tracing.otlp_traces_endpoint",
          "OpenTelemetry collector URL (http://, or https:// for TLS) for spans of each gRPC "
          "call and REST request, continuing a caller's W3C traceparent, and of each sample's "
          "engine phases (queue, prefill, decode, detokenize); every span carries "
          "gen_ai.request.id. OTLP/gRPC, or OTLP/HTTP with "
          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf. docs/serving.md: Tracing.",
          metavar="URL"),
    works("--collect-detailed-traces", None, str, "tracing.collect_detailed_traces",
          "Needs --otlp-traces-endpoint. model: gen_ai.latency.time_in_model_forward, worker: "
          "gen_ai.latency.time_in_model_execute (forward and sampling), all: both; summed over "
          "the engine steps a sample was in (shared with their batch). docs/serving.md: "
          "Tracing.",
          nargs="+", metavar="MODULE"),
    inert("--show-hidden-metrics-for-version", None, str,
          "has nothing to show: the gateway's /metrics hides no deprecated metric"),
)  # fmt: skip

_OTHER = _group(
    "other",
    works("--speculative-config", None, json_object, "speculative.config", SPECULATIVE_HELP,
          metavar="JSON"),
    refused("--kv-transfer-config", None, json_object, KV_TRANSFER),
    works("--kv-events-config", None, json_object, "cache.kv_events_config", KV_EVENTS_HELP,
          metavar="JSON"),
    works(("--compilation-config", "-O"), {}, compilation_config, "compilation.config",
          COMPILATION_HELP, metavar="LEVEL|JSON"),
    inert("--additional-config", {}, json_object, "configures other hardware platforms"),
    inert("--use-v2-block-manager", False, None, OLD_FEATURE),
    inert("--enable-prompt-adapter", False, None, OLD_FEATURE),
    inert("--prompt-adapters", None, str, OLD_FEATURE, nargs="+"),
    inert("--max-prompt-adapters", 1, int, OLD_FEATURE),
    inert("--max-prompt-adapter-token", 0, int, OLD_FEATURE),
    inert("--qlora-adapter-name-or-path", None, str, OLD_FEATURE),
    works("--device", "auto", str, "model.device",
          "Where the engine runs: cuda (the current device), cpu, or auto (cuda where torch "
          "sees one).",
          choices=("auto", "cuda", "cpu")),
)  # fmt: skip

FLAGS: tuple[Flag, ...] = (
    *_MODEL,
    *_FRONTEND,
    *_OURS,
    *_LOADING,
    *_STRUCTURED_OUTPUT,
    *_PARALLELISM,
    *_KV_CACHE,
    *_SCHEDULER,
    *_LORA,
    *_MULTIMODAL,
    *_OBSERVABILITY,
    *_OTHER,
)

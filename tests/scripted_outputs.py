"""Scripted model outputs: the real engine, with the sampler's choice replaced for chosen
requests, so a test decides the text a request generates (tool calls, reasoning...) and
everything else (detokenization, stops, streaming, the server) runs for real.

``script_outputs`` runs inside the engine core (``call_in_core``, thread mode: this
module must be importable there). A scripted request generates its tokens one per step, then an
EOS token. Also here: a chat template with tools in the style of Qwen2.5 and Hermes models
(calls as ``<tool_call>`` JSON, arguments rendered with ``tojson``, so a dict reads as an
object and a string as a quoted string).
"""

from __future__ import annotations

from engine_plugin import call_in_core

_SCRIPTS = "_test_scripts"  # the core's dict: engine request id -> token ids to generate


class _ScriptedSampler:
    def __init__(self, real, scripts: dict[str, list[int]]) -> None:
        self._real = real
        self._scripts = scripts

    def __call__(self, logits, requests, generators):
        sampled = self._real(logits, requests, generators)
        for row, request in enumerate(requests):
            script = self._scripts.get(request.request_id)
            if script is not None:
                position = request.num_output_tokens
                eos = min(request.eos_token_ids)
                sampled.token_ids[row] = script[position] if position < len(script) else eos
        return sampled

    def __getattr__(self, name):
        return getattr(self._real, name)


def script_outputs(core, scripts: dict[str, list[int]]) -> None:
    """Requests with these engine ids (``rid``, or ``rid#i`` for sample i of n > 1) generate
    these token ids, then EOS."""
    if _SCRIPTS not in core.__dict__:
        core.__dict__[_SCRIPTS] = {}
        core.sampler = _ScriptedSampler(core.sampler, core.__dict__[_SCRIPTS])
    core.__dict__[_SCRIPTS].update(scripts)


async def script(server, request_id: str, *texts: str) -> int:
    """Script ``request_id`` (one text) or its samples (several) to generate ``texts`` on
    ``server`` (a ``RunningServer``: its engine, texts in its tokenizer's ids); returns the most
    tokens one of them takes (for max_tokens: add one for EOS)."""
    engine, tokenizer = server.engine, server.tokenization.tokenizer
    tokens = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    if len(texts) == 1:
        scripts = {request_id: tokens[0]}
    else:
        scripts = {f"{request_id}#{i}": ids for i, ids in enumerate(tokens)}
    await call_in_core(engine, script_outputs, scripts)
    return max(len(ids) for ids in tokens)


# Transformers renders with trim_blocks: a line break right after a tag is dropped, so the
# template writes its line breaks as expressions.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system{{ '\\n' }}# Tools{{ '\\n' }}<tools>"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\\n' }}</tools><|im_end|>{{ '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant{{ '\\n' }}"
    "{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content }}"
    "{%- for call in message.tool_calls %}{{ '\\n' }}<tool_call>{{ '\\n' }}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "{{ '\\n' }}</tool_call>{%- endfor %}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user{{ '\\n' }}<tool_response id={{ message.tool_call_id }}>{{ '\\n' }}"
    "{{ message.content }}{{ '\\n' }}</tool_response><|im_end|>{{ '\\n' }}"
    "{%- else %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>"
    "{{ '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
)

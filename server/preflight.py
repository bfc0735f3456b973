"""What ``llmrpc serve`` checks before it binds a port or loads anything: every file a flag names.

The model, tokenizer and generation config (``--model``, ``--tokenizer``,
``--generation-config``), the chat template (``--chat-template``) and the TLS files
(``--ssl-*``) are found and read here, cheaply, so a mistake is one line naming the flag at once
rather than after the ports are bound and the model is half loaded. Loading checks them again;
these checks only come first.
"""

from __future__ import annotations

from llmrpc.common.chat_template import read_chat_template
from llmrpc.common.tls_files import check_tls_files
from llmrpc.engine.config import EngineConfig
from llmrpc.engine.loading.model_source import check_model_sources
from llmrpc.server.settings import FrontendConfig


def check_before_binding(engine_config: EngineConfig, frontend: FrontendConfig) -> None:
    """ValueError naming the flag for the first file that is missing or wrong."""
    check_model_sources(engine_config.model)
    if frontend.chat_template is not None:
        read_chat_template(frontend.chat_template)
    tls = frontend.tls
    if tls.enabled:
        check_tls_files(tls.keyfile, tls.certfile, tls.ca_certs)

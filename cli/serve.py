"""``llmrpc serve``: the gRPC server and, beside it in the same process, the REST gateway.

Start-up order: the flags are parsed, every file they name is checked (``server.preflight``) and
the REST gateway's settings are built, all before torch is imported (with the engine in a process
of its own, the default, this process never imports it); then the gRPC server and
the REST app are built (``--middleware`` is imported). A bad value found on the way ends the
program with one line naming the flag, exit status 2, before any port is bound. Then the REST
port is bound, then the gRPC ports (a port in use: one line naming the flag and the address,
exit status 1), and only then is the model loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys

from llmrpc.common.fd_limit import raise_open_file_limit
from llmrpc.engine.config import EngineConfig
from llmrpc.server import options
from llmrpc.server.logs import configure_logging
from llmrpc.server.preflight import check_before_binding
from llmrpc.server.settings import BindError, FrontendConfig

logger = logging.getLogger("llmrpc.cli.serve")


def run_serve(serve_parser: argparse.ArgumentParser, argv: list[str]) -> int:
    serve_values = options.parse_serve_values(serve_parser, argv)
    engine_config, frontend = options.configs_or_exit(serve_parser, serve_values)
    from llmrpc.cli import rest  # FastAPI: once the flags are known good
    from llmrpc.gateway.server import BindError as RestBindError

    try:
        configure_logging(frontend.logs)
        check_before_binding(engine_config, frontend)
        if frontend.rest_gateway:
            rest.gateway_settings(frontend)
    except ValueError as error:
        serve_parser.error(str(error))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: never wait on the network
    options.warn_about_inert_flags(serve_values, logger)
    from llmrpc.engine.memory import limit_arenas

    limit_arenas()  # before the engine, gRPC and tokenizer threads start allocating
    raise_open_file_limit()  # before the listeners' connection caps are derived from it

    # SIGINT/SIGTERM before the server's own handlers are set: remembered, and acted on once
    # they are (not a KeyboardInterrupt, nor asyncio.run cancelling the start half done)
    signalled: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: signalled.append(signum))
    try:
        return asyncio.run(serve(engine_config, frontend, signalled))
    except (BindError, RestBindError) as error:
        logger.error("%s", error)
        return 1
    except ValueError as error:  # a flag value found wrong before any port was bound
        serve_parser.error(str(error))


async def serve(
    engine_config: EngineConfig, frontend: FrontendConfig, signalled: list[int] | None = None
) -> int:
    """The gRPC server until it stops, with the REST gateway beside it unless
    --no-rest-gateway; the exit status. ``signalled``: signals received before it starts."""
    if not frontend.disable_frontend_multiprocessing:
        _keep_torch_out()
    from llmrpc.cli import rest
    from llmrpc.server import app  # the engine: imported only when serving

    beside = None
    if frontend.rest_gateway:
        beside = functools.partial(rest.in_process_gateway, frontend)
    return await app.serve(engine_config, frontend, beside=beside, signalled=signalled)


def _keep_torch_out() -> None:
    """The engine runs in its own process, which loads torch; this one (gRPC, REST, tokenizing)
    needs none of it, and importing it here costs ~220 MB of RSS and 1.4-2.6 s of start-up.
    Transformers imports torch wherever it is installed, unless ``find_spec`` reports it absent,
    which a ``None`` in ``sys.modules`` does; any later ``import torch`` here then fails loudly.
    Transformers' one-line notice that PyTorch is missing is silenced: it is missing on purpose."""
    if "torch" in sys.modules:  # already loaded (a caller in the same process): nothing to save
        return
    sys.modules["torch"] = None
    previous = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        import transformers  # noqa: F401 - imported now, while its notice is off
    finally:
        if previous is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = previous

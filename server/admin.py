"""AdminService: server and model facts, abort, load figures, prefix cache reset, sleep/wake."""

from __future__ import annotations

import logging

from llmrpc.server import convert, lora
from llmrpc.server.auth import caller_var
from llmrpc.server.errors import FailedPrecondition, InvalidArgument, handle_errors
from llmrpc.server.state import API_VERSION, SERVICE_NAMES, ServerState, server_version
from llmrpc.v1 import admin_pb2, admin_pb2_grpc

logger = logging.getLogger(__name__)

MAX_ABORT_REQUEST_IDS = 1024  # a bound on the one list AdminService takes; batches can repeat
SLEEP_MODE_OFF = "sleep mode is off; start the server with --enable-sleep-mode"
_RUNNERS = {  # the engine's ModelInfo.runner -> GetModelInfoResponse.Runner
    "generate": admin_pb2.GetModelInfoResponse.RUNNER_GENERATE,
    "pooling": admin_pb2.GetModelInfoResponse.RUNNER_POOLING,
}


def abortable(state: ServerState, request_ids: list[str], field: str = "request_ids") -> list[str]:
    """Those of ``request_ids`` the caller may abort: any for an admin, else its own (to it,
    another caller's request is not found). InvalidArgument naming ``field`` past
    MAX_ABORT_REQUEST_IDS."""
    if len(request_ids) > MAX_ABORT_REQUEST_IDS:
        count = len(request_ids)
        raise InvalidArgument(field, f"at most {MAX_ABORT_REQUEST_IDS}, got {count}")
    caller = caller_var.get()
    if caller.admin:
        return request_ids
    return state.owners.owned_by(request_ids, caller.key_digest)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @handle_errors
    async def GetServerInfo(self, request, context):
        state = self.state
        engine = state.engine
        capabilities = admin_pb2.ServerCapabilities(
            tls=state.tls,
            auth_required=state.auth_required,
            admin_auth_required=state.admin_auth_required,
            prefix_caching=state.effective_config.get("enable_prefix_caching") == "True",
            device=engine.device if engine is not None else "",
            services=[*SERVICE_NAMES, *state.extra_services],
        )
        if engine is not None:
            stats = engine.stats
            capabilities.kv_cache_bytes = stats.kv_cache_bytes
            capabilities.device_memory_total_bytes = stats.device_memory_total_bytes
        kernels = engine.model_info.kernels if engine is not None else ()
        return admin_pb2.GetServerInfoResponse(
            version=server_version(),
            api_version=API_VERSION,
            capabilities=capabilities,
            config=state.effective_config,
            kernels=[
                admin_pb2.KernelChoice(
                    op=k.op, num_layers=k.num_layers, rows=k.rows, kernel=k.kernel,
                    times_us=k.times_us,
                )
                for k in kernels
            ],
        )  # fmt: skip

    @handle_errors
    async def GetModelInfo(self, request, context):
        name = self.state.model_name(request.model)
        info = self.state.require_engine().model_info
        response = convert.model_info_response(name, info)
        response.runner = _RUNNERS[info.runner]
        if info.runner == "pooling":  # a generating model makes no embeddings
            response.embedding_size = info.embedding_size
        return response

    @handle_errors
    async def ListModels(self, request, context):
        engine = self.state.require_engine()
        adapters = await engine.list_lora_adapters()
        return convert.list_models_response(engine.model_info, adapters, self.state.hide_model_path)

    @handle_errors
    async def Abort(self, request, context):
        request_ids = abortable(self.state, list(request.request_ids))
        aborted = await self.state.require_engine().abort(request_ids)
        if aborted:
            logger.info("aborted %d request(s): %s", len(aborted), ", ".join(aborted))
        return admin_pb2.AbortResponse(aborted_request_ids=aborted)

    @handle_errors
    async def GetLoad(self, request, context):
        engine = self.state.require_engine()
        # A data-parallel client (engine/client/data_parallel.py) has each engine's figures too.
        response = convert.load_response(engine.stats, getattr(engine, "engine_stats", []))
        response.figures_age_seconds = engine.figures_age_s
        response.engine_stalled = engine.stalled
        ages = getattr(engine, "engine_figures_ages", [])
        stalls = getattr(engine, "engine_stalls", [])
        for each, age, stalled in zip(response.engines, ages, stalls, strict=True):
            each.figures_age_seconds, each.stalled = age, stalled
        return response

    @handle_errors
    async def ResetPrefixCache(self, request, context):
        if not await self.state.require_engine().reset_prefix_cache():
            raise FailedPrecondition(
                "prefix_cache", "requests hold KV cache blocks; retry once they finish"
            )
        logger.info("prefix cache reset")
        return admin_pb2.ResetPrefixCacheResponse()

    def _sleep_mode_engine(self):
        """The engine, for Sleep and WakeUp: both need ``--enable-sleep-mode``, so without it
        WakeUp refuses as Sleep does rather than report success for a state the server can
        never be in (UNAVAILABLE while the model loads comes first: a retry may then work)."""
        engine = self.state.require_engine()
        if self.state.effective_config.get("enable_sleep_mode") != "True":
            raise FailedPrecondition("engine", SLEEP_MODE_OFF)
        return engine

    @handle_errors
    async def Sleep(self, request, context):
        engine = self._sleep_mode_engine()
        level = request.level if request.HasField("level") else 1
        with convert.engine_errors(request):
            await engine.sleep(level)
        return admin_pb2.SleepResponse()

    @handle_errors
    async def WakeUp(self, request, context):
        engine = self._sleep_mode_engine()
        with convert.engine_errors(request):
            await engine.wake_up()
        return admin_pb2.WakeUpResponse()

    @handle_errors
    async def IsSleeping(self, request, context):
        return admin_pb2.IsSleepingResponse(is_sleeping=self.state.require_engine().is_sleeping)

    @handle_errors
    async def LoadLoraAdapter(self, request, context):
        return await lora.load(self.state.require_engine(), request, self.state.hide_model_path)

    @handle_errors
    async def UnloadLoraAdapter(self, request, context):
        return await lora.unload(self.state.require_engine(), request)

    @handle_errors
    async def ListLoraAdapters(self, request, context):
        return await lora.list_adapters(self.state.require_engine(), self.state.hide_model_path)

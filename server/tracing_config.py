"""``--otlp-traces-endpoint`` and ``--collect-detailed-traces``, checked (``server/tracing.py``
does the tracing). Plain: importing it imports nothing of OpenTelemetry."""

from __future__ import annotations

from dataclasses import dataclass

from llmrpc.common import tracing as otlp

DETAILED_MODULES = ("model", "worker", "all")


def _modules(values: tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's forms: ``model worker`` and ``model,worker`` alike."""
    return tuple(part.strip() for value in values for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class TracingConfig:
    """``--otlp-traces-endpoint`` and ``--collect-detailed-traces``."""

    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        otlp.check_endpoint("--otlp-traces-endpoint", self.otlp_traces_endpoint)
        modules = _modules(self.collect_detailed_traces or ())
        for module in modules:
            if module not in DETAILED_MODULES:
                raise ValueError(
                    f"--collect-detailed-traces: {module!r} is not one of "
                    f"{', '.join(DETAILED_MODULES)}"
                )
        if modules and self.otlp_traces_endpoint is None:
            raise ValueError("--collect-detailed-traces requires --otlp-traces-endpoint")

    @property
    def enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None

    @property
    def model_forward(self) -> bool:
        return bool({"model", "all"} & set(_modules(self.collect_detailed_traces or ())))

    @property
    def model_execute(self) -> bool:
        return bool({"worker", "all"} & set(_modules(self.collect_detailed_traces or ())))

"""``--tensor-parallel-size`` and ``--distributed-executor-backend`` (``--pipeline-parallel-size``
is a refused row of the flag table).

Imported by the frontend: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uni for one rank, mp for more
    enable_expert_parallel: bool = False  # MoE experts split whole over the ranks

    def __post_init__(self) -> None:
        size, backend = self.tensor_parallel_size, self.distributed_executor_backend
        if size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
        if backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(
                f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}"
            )
        if backend == "external_launcher":
            raise ValueError(
                "--distributed-executor-backend external_launcher is refused: this build starts "
                "its tensor-parallel ranks itself (mp: local processes; ray: Ray actors)"
            )
        if backend == "uni" and size > 1:
            raise ValueError(
                f"--distributed-executor-backend uni runs one process; --tensor-parallel-size "
                f"{size} needs mp"
            )

    @property
    def enabled(self) -> bool:
        return self.tensor_parallel_size > 1


def check_parallel_options(parallel: ParallelConfig, lora_enabled: bool, runner: str) -> None:
    """Features this build does not combine with tensor parallelism, refused when the engine's
    configuration is built (the rest, which needs the model's config, in ``executor.py``)."""
    if not parallel.enabled:
        return
    size = parallel.tensor_parallel_size
    if lora_enabled:
        raise ValueError(
            f"--enable-lora is refused with --tensor-parallel-size {size}: LoRA layers are not "
            "sharded in this build"
        )
    if runner == "pooling":
        raise ValueError(
            f"--runner pooling is refused with --tensor-parallel-size {size}: pooling models run "
            "on one rank only in this build"
        )

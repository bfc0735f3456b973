"""Generate the Python stubs of the llmrpc v1 API, check them, or write a descriptor set.

    python protos/generate.py                        write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py
                                                     beside the protos in protos/llmrpc/v1/
                                                     and in protos/llmrpc/kserve/ and
                                                     protos/llmrpc/vllm_engine/
    python protos/generate.py --check                exit 1, listing them, if the committed stubs
                                                     differ from freshly generated ones
    python protos/generate.py --descriptor-set PATH  write a FileDescriptorSet (with imports and
                                                     source info) for Envoy's grpc_json_transcoder

Protos import each other as "llmrpc/v1/x.proto" relative to protos/, so protoc emits
`from llmrpc.v1 import x_pb2`, matching the import package that pyproject.toml maps to
protos/llmrpc/v1. google/api protos come from the installed googleapis-common-protos wheel.
The foreign protocols served beside it (KServe v2 / the Open Inference Protocol, package
`inference`, in protos/llmrpc/kserve/ -> llmrpc.kserve; vLLM's engine service as the smg router
calls it, packages `vllm.grpc.engine` and `smg.grpc.common`, in protos/llmrpc/vllm_engine/ ->
llmrpc.vllm_engine) are generated the same way; the descriptor set (Envoy's transcoder) holds
the v1 API alone.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
API_DIR = PROTOS_DIR / "llmrpc" / "v1"
KSERVE_DIR = PROTOS_DIR / "llmrpc" / "kserve"
VLLM_ENGINE_DIR = PROTOS_DIR / "llmrpc" / "vllm_engine"
# every folder of protos whose stubs are committed
STUB_DIRS = (API_DIR, KSERVE_DIR, VLLM_ENGINE_DIR)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(dirs: tuple[Path, ...] = STUB_DIRS) -> list[str]:
    """The .proto files in ``dirs``, relative to protos/ (the names protoc records)."""
    found = (p for directory in dirs for p in directory.glob("*.proto"))
    return sorted(p.relative_to(PROTOS_DIR).as_posix() for p in found)


def googleapis_include() -> Path:
    """The site-packages dir holding google/api/*.proto from googleapis-common-protos."""
    spec = importlib.util.find_spec("google.api.annotations_pb2")
    if spec is None or spec.origin is None:
        raise RuntimeError("googleapis-common-protos is not installed")
    root = Path(spec.origin).resolve().parents[2]
    if not (root / "google" / "api" / "annotations.proto").is_file():
        raise RuntimeError(f"no google/api/annotations.proto under {root}")
    return root


def grpc_tools_include() -> Path:
    """grpc_tools' bundled well-known protos (google/protobuf/*.proto)."""
    return Path(str(importlib.resources.files("grpc_tools") / "_proto"))


def include_paths() -> list[Path]:
    # Order matters: our protos first, then the well-known types matching this protoc.
    return [PROTOS_DIR, grpc_tools_include(), googleapis_include()]


def run_protoc(out_args: list[str], dirs: tuple[Path, ...] = STUB_DIRS) -> None:
    args = [sys.executable, "-m", "grpc_tools.protoc"]
    args += [f"-I{path}" for path in include_paths()]
    args += out_args + proto_files(dirs)
    result = subprocess.run(args, cwd=PROTOS_DIR, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed ({result.returncode}):\n{result.stderr}")


def generate_into(out_dir: Path) -> None:
    """Writes the stubs under out_dir/llmrpc/ (v1/, kserve/, vllm_engine/)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = str(out_dir)
    run_protoc([f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"])


def generated_names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def differing_files(fresh_dir: Path, committed_dir: Path = API_DIR) -> list[str]:
    """Generated file names missing, stale or changed (byte for byte) in committed_dir."""
    fresh, committed = generated_names(fresh_dir), generated_names(committed_dir)
    differing = fresh ^ committed
    for name in fresh & committed:
        if not filecmp.cmp(fresh_dir / name, committed_dir / name, shallow=False):
            differing.add(name)
    return sorted(differing)


def sync(fresh_dir: Path, names: list[str], committed_dir: Path = API_DIR) -> None:
    """Makes committed_dir's generated files match fresh_dir for the given names."""
    for name in names:
        source, target = fresh_dir / name, committed_dir / name
        if source.exists():
            shutil.copyfile(source, target)
        else:
            target.unlink()


def write_descriptor_set(path: Path) -> None:
    """A FileDescriptorSet of the API with its imports and comments."""
    path.parent.mkdir(parents=True, exist_ok=True)
    run_protoc(
        [f"--descriptor_set_out={path.resolve()}", "--include_imports", "--include_source_info"],
        (API_DIR,),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare stubs; write nothing")
    mode.add_argument("--descriptor-set", type=Path, metavar="PATH", help="write a descriptor set")
    args = parser.parse_args(argv)
    if args.descriptor_set is not None:
        write_descriptor_set(args.descriptor_set)
        print(f"wrote {args.descriptor_set}")
        return 0
    with tempfile.TemporaryDirectory(prefix="llmrpc-protos-") as tmp:
        generate_into(Path(tmp))
        differing = []  # paths of stubs, relative to the repository
        for committed_dir in STUB_DIRS:
            fresh_dir = Path(tmp) / committed_dir.relative_to(PROTOS_DIR)
            names = differing_files(fresh_dir, committed_dir)
            differing += [(committed_dir / name).relative_to(PROTOS_DIR.parent) for name in names]
            if not args.check:
                sync(fresh_dir, names, committed_dir)
    for path in differing:
        print(f"{'out of date' if args.check else 'wrote'}: {path}")
    if args.check and differing:
        print("run: python protos/generate.py", file=sys.stderr)
    return 1 if args.check and differing else 0


if __name__ == "__main__":
    sys.exit(main())

"""A FileDescriptorSet of the llmrpc.v1 API, built at run time from the generated modules.

Envoy's grpc_json_transcoder needs one (``proto_descriptor``/``proto_descriptor_bin``). Building
it from the ``_pb2`` modules' own descriptors needs no protoc (grpcio-tools is dev-only) and
always matches the stubs this package serves. Files come dependencies first, as protoc's
``--include_imports`` writes them: Envoy adds them to its descriptor pool in order.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from google.rpc import error_details_pb2, status_pb2

from llmrpc.v1 import admin_pb2, embedding_pb2, generation_pb2, tokenization_pb2

_API_MODULES = (generation_pb2, tokenization_pb2, admin_pb2, embedding_pb2)

# With convert_grpc_status the transcoder prints google.rpc.Status, whose details are Any
# messages (BadRequest, RetryInfo...): their types must be in the set to be printed as JSON.
_ERROR_MODULES = (status_pb2, error_details_pb2)


def api_service_names() -> list[str]:
    """Fully qualified names of the llmrpc.v1 services, e.g. ``llmrpc.v1.GenerationService``."""
    return [
        service.full_name
        for module in _API_MODULES
        for service in module.DESCRIPTOR.services_by_name.values()
    ]


def _files_in_dependency_order(roots: list[FileDescriptor]) -> list[FileDescriptor]:
    ordered: list[FileDescriptor] = []
    seen: set[str] = set()

    def visit(file: FileDescriptor) -> None:
        if file.name in seen:
            return
        seen.add(file.name)
        for dependency in file.dependencies:
            visit(dependency)
        ordered.append(file)

    for root in roots:
        visit(root)
    return ordered


def api_descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """The API's files and everything they import (google/api/http.proto, descriptor.proto...)."""
    roots = [module.DESCRIPTOR for module in (*_API_MODULES, *_ERROR_MODULES)]
    descriptor_set = descriptor_pb2.FileDescriptorSet()
    for file in _files_in_dependency_order(roots):
        descriptor_set.file.add().MergeFromString(file.serialized_pb)
    return descriptor_set


def api_descriptor_set_bytes() -> bytes:
    return api_descriptor_set().SerializeToString()

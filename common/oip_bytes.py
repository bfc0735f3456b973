"""The binary form of a BYTES tensor in the Open Inference Protocol (KServe v2, Triton): each
element as its length (4 bytes, little-endian), then its bytes. gRPC's raw_input_contents and
raw_output_contents and REST's binary tensor extension carry BYTES tensors this way. Numeric
tensors are their elements packed little-endian (``NUMERIC`` gives each type's format)."""

from __future__ import annotations

import struct

_LENGTH = struct.Struct("<I")

# datatype -> (its contents field, its raw element format)
NUMERIC = {
    "BOOL": ("bool_contents", "?"),
    "INT8": ("int_contents", "b"),
    "INT16": ("int_contents", "h"),
    "INT32": ("int_contents", "i"),
    "INT64": ("int64_contents", "q"),
    "UINT8": ("uint_contents", "B"),
    "UINT16": ("uint_contents", "H"),
    "UINT32": ("uint_contents", "I"),
    "UINT64": ("uint64_contents", "Q"),
    "FP32": ("fp32_contents", "f"),
    "FP64": ("fp64_contents", "d"),
}


def split_elements(raw: bytes) -> list[bytes]:
    """The elements of a BYTES tensor in its binary form; ValueError if it is cut short."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + _LENGTH.size > len(raw):
            raise ValueError("raw BYTES data ends inside an element's length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + length > len(raw):
            raise ValueError("raw BYTES data is shorter than an element's length")
        elements.append(raw[offset : offset + length])
        offset += length
    return elements


def join_elements(elements: list[bytes]) -> bytes:
    """The binary form of a BYTES tensor of ``elements``."""
    return b"".join(_LENGTH.pack(len(element)) + element for element in elements)

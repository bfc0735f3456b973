"""Weight-only quantization's packed linear layers: weights held packed, and their packing.

- ``Int8Linear``: per-output-channel symmetric int8, ``w = q * scale[n]`` with ``q`` in
  [-127, 127] and ``scale[n] = max|w[n, :]| / 127``; computed by
  ``torch.ops.aten._weight_int8pack_mm``.
- ``Int4Linear``: group-wise asymmetric int4 over groups of ``GROUP_SIZE`` (32) inputs,
  ``w = (u - 8) * scale + zero`` with ``u`` in [0, 15], ``scale = (max - min) / 15`` and
  ``zero = min + 8 * scale`` per group. In bfloat16 on a CPU with AVX2 and FMA (AVX512-BF16
  and AVX512-VNNI where present), computed by our kernel (``kernel_ops/csrc/int4_linear.cpp``:
  integer dot products with the inputs quantized to int8 per row and group of 32, as llama.cpp
  computes) on weights in its blocked layout; elsewhere by
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on weights packed by
  ``_convert_weight_to_int4pack_for_cpu`` (whose dequantization is exactly that formula, with
  ``scales_and_zeros`` shaped ``[in / 32, out, 2]``).
- ``Q8Linear`` and ``Q8BlockLinear``: int8 codes with a scale (and a zero) per 32 inputs, or a
  scale per 16 (GGUF's 5-, 6- and 8-bit blocks), in our blocked layout where our kernel computes,
  else as two int4 halves (``gguf_blocks`` builds them).

Scales (and zeros) are held in the model's dtype, as the kernels require.

torch's packed kernels are fast only with bfloat16 activations, and only for few rows: their
cost grows with every row, where a dense matmul reuses each weight across rows, and in float16
or float32 they are 10-50x slower than a dense matmul of the same dtype. So a layer uses its
packed kernel in bfloat16 for at most ``dense_above`` rows, measured at load on the machine that
serves (``tuning``: typically decode steps of small batches, and for our int4 kernel, which
reuses each unpacked weight across 12 rows, longer prefills), and otherwise dequantizes its
weight for that call and runs the dense matmul: a long prefill chunk, and every call under
``--dtype float16`` or ``float32``. Dequantizing is exact in float32, so a quantized float32
model computes what the same model holding the dequantized weights computes (slowly: measured
5-30x slower than the unquantized float32 model, whose linear layers are packed for oneDNN).

The two helpers at the end put a packed layer into a model and hand the freed float weights'
memory back; ``plan`` and ``gguf_blocks`` both swap layers with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools

import torch
from torch import nn
from torch.nn import functional as F

from llmrpc.kernels import cpu_ops
from llmrpc.kernels.layer import INT4, Q8, LinearSpec

GROUP_SIZE = 32  # int4 group size, and the block size of GGUF's Q4_0, Q4_1 and Q8_0
# Rows up to which the packed kernels beat dequantize-then-dense in bfloat16: each layer's
# dense_above starts here, and engine/quantization/tuning.py sets it at load from timings on the
# machine that serves. Measured once (one thread, CPU not recorded, SmolLM2-135M's
# shapes): int8 960x576 at 32 rows 220 us vs 118 + 103 us, at 64 rows 439 vs 284 us; int4 at
# 64 rows 393 us vs 526 + 166 us, at 256 rows 1543 vs 1086 us.
INT8_DENSE_ABOVE = 32
INT4_DENSE_ABOVE = 128
# Rows up to which our blocked int4 kernel beats dequantize-then-dense (one thread, 30 layers of
# SmolLM2-135M's shapes): 156 vs 474 ms at 256 rows, 643 vs 990 at 1024, 1274 vs 1061 at 2048.
BLOCKED_DENSE_ABOVE = 1024
_FAST_DTYPES = (torch.bfloat16,)  # float16's packed kernels are as slow as float32's


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed; subclasses say how it is packed."""

    dense_above: int
    # Rows from which the packed call runs the AMX tile path (dequantized a few blocks at a
    # time, then bfloat16 tiles: kernel_ops/csrc/int4_linear.cpp) instead of the integer dot
    # products: set at load by engine/quantization/tuning.py where it measured faster; 0: never.
    tiles_from: int = 0

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the scales: the model's dtype, which the packed kernels compute in."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        dtype = rows.dtype
        # A compiled graph holds one branch: engine/runner/compilation.py runs it for steps of at
        # most dense_above rows only.
        few_rows = torch.compiler.is_compiling() or rows.shape[0] <= self.dense_above
        if few_rows and dtype in _FAST_DTYPES and dtype == self.dtype:
            y = self.packed_matmul(rows)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(rows, self.dequantize(dtype), self.bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def packed_matmul(self, x: torch.Tensor, tiles_from: int | None = None) -> torch.Tensor:
        """``x W^T`` by the packed kernel: ``x`` is ``[rows, in_features]`` in ``self.dtype``;
        ``tiles_from`` (None: ``self.tiles_from``) where the layer has the tile path."""
        raise NotImplementedError

    @property
    def has_tiles(self) -> bool:
        """Whether ``packed_matmul`` can take the AMX tile path (``tiles_from``)."""
        return False

    def layer_spec(self) -> LinearSpec | None:
        """The packed call as ``torch.ops.llmrpc_cpu.decode_layer`` makes it
        (``kernel_ops/layer.py``), for the rows ``forward`` runs it for; None where that call is
        not one it makes."""
        return None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` the packed one stands for, in ``dtype``."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, in ``self.dtype`` (an embedding's lookup)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}"
        )


class Int8Linear(QuantizedLinear):
    """Per-output-channel symmetric int8: ``W[n, k] = qweight[n, k] * scales[n]``."""

    dense_above = INT8_DENSE_ABOVE

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias=None) -> None:
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.contiguous())  # int8 [out, in]
        self.register_buffer("scales", scales.contiguous())  # [out], the model's dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias=None, dtype=torch.bfloat16) -> Int8Linear:
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales)).to(dtype)
        # Rounded against the scale as held, so q * scale is the nearest point to w.
        qweight = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127)
        return cls(qweight.to(torch.int8), scales, bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def packed_matmul(self, x: torch.Tensor, tiles_from: int | None = None) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantize(self, dtype=None) -> torch.Tensor:
        dtype = dtype or self.dtype
        # q has 8 bits and the scale at most 24: the product is exact in float32, rounded once
        # in a narrower dtype.
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scales[ids].float()[:, None]).to(self.dtype)


class Int4Linear(QuantizedLinear):
    """Group-wise int4: ``W[n, k] = (u - 8) * scale + zero``, with one ``(scale, zero)`` per
    ``GROUP_SIZE`` inputs, packed one of two ways:

    - blocked, in bfloat16 where our kernel is built (AVX2 and FMA, or AVX512-BF16 and VNNI)
      (``kernel_ops/csrc/int4_linear.cpp`` describes the layout, whose chunks the AVX2 build
      splits: ``split``): ``qweight`` ``[out / 16, in / 32, 8, 32]`` and ``scales_and_zeros``
      ``[out / 16, in / 32, 2, 16]``, computed by ``torch.ops.llmrpc_cpu.int4_linear``;
    - torch's CPU packing otherwise: ``qweight`` from ``_convert_weight_to_int4pack_for_cpu`` and
      ``scales_and_zeros`` ``[in / 32, out, 2]``, computed by ``_weight_int4pack_mm_for_cpu``.
    """

    def __init__(self, packed, scales_and_zeros, bias=None, blocked: bool = False) -> None:
        if blocked:
            blocks, num_groups, _, lanes = scales_and_zeros.shape
            out_features = blocks * lanes
        else:
            num_groups, out_features, _ = scales_and_zeros.shape
        super().__init__(num_groups * GROUP_SIZE, out_features, bias)
        self.blocked = blocked
        self.split = blocked and _split_nibbles()  # the chunks' layout (_pack_int4)
        # torch's packing, read at load: a compiled graph cannot run the probes (torch.equal)
        self.torch_layout = None if blocked else _torch_int4_layout()
        self.dense_above = BLOCKED_DENSE_ABOVE if blocked else INT4_DENSE_ABOVE
        self.register_buffer("qweight", packed)  # uint8
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    @staticmethod
    def supports(out_features: int, in_features: int) -> bool:
        """Both packings take ``out % 16 == 0`` and whole groups of inputs."""
        return out_features % 16 == 0 and in_features % GROUP_SIZE == 0

    @property
    def packed_rows(self) -> int:
        if self.blocked:
            return self.qweight.shape[0] * 16
        return self.scales_and_zeros.shape[1]

    @classmethod
    def from_codes(cls, codes, scales, zeros, bias=None, dtype=torch.bfloat16) -> Int4Linear:
        """``codes`` ``[out, in]`` in [0, 15]; ``scales`` and ``zeros`` ``[out, in / 32]``."""
        packed, scales_and_zeros, blocked = _pack_int4(codes, scales, zeros, dtype)
        return cls(packed, scales_and_zeros, bias, blocked)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias=None, dtype=torch.bfloat16) -> Int4Linear:
        out_features, in_features = weight.shape
        groups = weight.detach().float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).to(dtype)
        zeros = (low + 8 * scales.float()).to(dtype)
        # The nearest code under the scale and zero as held; a constant group (scale 0) is its
        # zero, code 8.
        scale, zero = scales.float()[..., None], zeros.float()[..., None]
        codes = torch.where(
            scale > 0, torch.round((groups - zero) / torch.where(scale > 0, scale, 1)) + 8, 8.0
        ).clamp_(0, 15)
        return cls.from_codes(codes.view(out_features, in_features), scales, zeros, bias, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self._buffers["scales_and_zeros"].dtype  # see packed_matmul

    @property
    def has_tiles(self) -> bool:
        return self.blocked and tiles_available()

    def packed_matmul(self, x: torch.Tensor, tiles_from: int | None = None) -> torch.Tensor:
        # The buffers from the module's dict: nn.Module.__getattr__ took about 1 us a buffer, 3 of
        # a call's 10 us on a 1-row decode step (torch 2.13; a step makes 120 such calls).
        buffers = self._buffers
        if self.blocked:
            return torch.ops.llmrpc_cpu.int4_linear.default(
                x.contiguous(),
                buffers["qweight"],
                buffers["scales_and_zeros"],
                self.tiles_from if tiles_from is None else tiles_from,
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, GROUP_SIZE, self.scales_and_zeros
        )

    def layer_spec(self) -> LinearSpec | None:
        if not self.blocked or self.dtype not in _FAST_DTYPES:
            return None
        return LinearSpec(
            INT4, self.qweight, self.dtype, self.scales_and_zeros, self.bias,
            tiles_from=self.tiles_from, max_rows=self.dense_above,
        )  # fmt: skip

    def codes(self) -> torch.Tensor:
        """The 4-bit codes ``[packed_rows, in]`` (uint8), unpacked from the layout."""
        if self.blocked:
            return self._blocked_codes(self.qweight)
        return _unpack_torch_int4(self.qweight, self.packed_rows, self.in_features)

    def _blocked_codes(self, blocks: torch.Tensor) -> torch.Tensor:
        """The codes ``[16 * len(blocks), in]`` of blocked ``qweight`` rows ``blocks``."""
        num_blocks, groups = blocks.shape[:2]
        nibbles = torch.stack([blocks & 15, blocks >> 4], dim=3)  # [.., group, chunk, 2, 32]
        if self.split:  # [.., chunk, low/high: outputs 0-7/8-15, output, input]
            nibbles = nibbles.view(num_blocks, groups, 8, 2, 8, 4).permute(0, 3, 4, 1, 2, 5)
        else:  # [.., chunk, low/high: inputs 0-1/2-3, output, input]
            nibbles = nibbles.view(num_blocks, groups, 8, 2, 16, 2).permute(0, 4, 1, 2, 3, 5)
        return nibbles.reshape(num_blocks * 16, self.in_features)

    def dequantize(self, dtype=None) -> torch.Tensor:
        return self._dequantize_codes(self.codes(), slice(None)).to(dtype or self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocked and cpu_ops.loaded():
            return _quantized_rows(self.qweight, self.scales_and_zeros, ids, True)
        return self.torch_rows(ids)

    def torch_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` by torch's operations (the C++ lookup computes the same bits)."""
        return self._dequantize_codes(self._row_codes(ids), ids).to(self.dtype)

    def _scales_zeros(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and zeros ``[rows, in / 32]`` in float32."""
        if self.blocked:
            both = self.scales_and_zeros.permute(0, 3, 1, 2).reshape(self.packed_rows, -1, 2)
            both = both[rows]
            return both[..., 0].float(), both[..., 1].float()
        return (
            self.scales_and_zeros[:, rows, 0].t().float(),
            self.scales_and_zeros[:, rows, 1].t().float(),
        )

    def _dequantize_codes(self, codes: torch.Tensor, rows) -> torch.Tensor:
        # (u - 8) * scale is exact in float32 (4 bits times at most 24); + zero rounds once.
        num_rows = codes.shape[0]
        scales, zeros = self._scales_zeros(rows)
        grouped = codes.view(num_rows, -1, GROUP_SIZE).float()
        return ((grouped - 8) * scales[..., None] + zeros[..., None]).view(
            num_rows, self.in_features
        )

    def _row_codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The codes of rows ``ids`` only, read where the layout packs them."""
        if self.split:  # [ids, group, chunk, 4 inputs], outputs 8-15 in the high nibbles
            quads = _row_bytes(self.qweight, ids, 4)
            high = (ids % 16 >= 8).to(torch.uint8)[:, None, None, None] * 4
            return ((quads >> high) & 15).view(ids.shape[0], self.in_features)
        if self.blocked:
            pairs = _row_bytes(self.qweight, ids)  # [ids, group, chunk, input of the pair]
            # [ids, group, chunk, low/high nibble, input of the pair] is input order
            nibbles = torch.stack([pairs & 15, pairs >> 4], dim=3)
            return nibbles.view(ids.shape[0], self.in_features)
        in_features = self.in_features
        rows, halves, tail_halves = self.torch_layout
        num_blocks, tail = divmod(self.packed_rows, rows)
        in_block = ids < num_blocks * rows
        lane = torch.where(in_block, ids % rows, ids - num_blocks * rows)
        width = torch.where(in_block, rows, max(tail, 2))  # rows the lane's bytes hold
        by_halves = torch.where(in_block, halves, tail_halves)
        byte = torch.where(by_halves, lane % (width // 2), lane // 2)
        high = torch.where(by_halves, lane >= width // 2, lane % 2 == 1)
        start = torch.where(
            in_block, ids // rows * (in_features * rows // 2), num_blocks * in_features * rows // 2
        )
        k = torch.arange(in_features, device=ids.device)
        packed = self.qweight.view(-1)[(start + byte)[:, None] + k[None, :] * (width // 2)[:, None]]
        return (packed >> (high * 4)[:, None].to(torch.uint8)) & 15


def _unpack_torch_layout(flat, num_rows, in_features, rows, halves, tail_halves):
    """Codes ``[num_rows, in]`` of torch's int4 CPU packing ``flat`` (uint8): blocks of ``rows``
    rows as ``[in, rows / 2]`` bytes, then the ``num_rows % rows`` left as ``[in, tail / 2]``;
    a byte holds rows ``j`` and ``j + width / 2`` (halves) or ``2j`` and ``2j + 1``."""
    num_blocks, tail = divmod(num_rows, rows)
    parts = []
    for count, width, by_halves, start in (
        (num_blocks, rows, halves, 0),
        (1 if tail else 0, tail, tail_halves, num_blocks * in_features * rows // 2),
    ):
        if not count:
            continue
        block = flat[start : start + count * in_features * width // 2]
        block = block.view(count, in_features, width // 2)
        low_high = (block & 15, block >> 4)
        if by_halves:
            codes = torch.cat(low_high, dim=2)  # [count, in, width]
        else:
            codes = torch.stack(low_high, dim=3).view(count, in_features, width)
        parts.append(codes.transpose(1, 2).reshape(count * width, in_features))
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


@functools.cache
def _torch_int4_layout() -> tuple[int, bool, bool]:
    """``(rows per block, halves, tail halves)`` of torch's int4 CPU packing, which depends on
    the vector unit torch dispatches to (AVX-512: blocks of 64 rows, a byte holding rows j and
    j + 32; AVX2: 32 and j + 16; plain C++: 32, rows 2j and 2j + 1): found by packing probes."""
    probes = {}
    for num_rows in (16, 48, 96, 208):
        codes = (torch.arange(num_rows)[:, None] * 7 + torch.arange(32)) % 16
        flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        probes[num_rows] = (codes.to(torch.uint8), flat.view(-1))
    for layout in itertools.product((64, 32), (True, False), (False, True)):
        if all(
            torch.equal(_unpack_torch_layout(flat, n, 32, *layout), codes)
            for n, (codes, flat) in probes.items()
        ):
            return layout
    raise RuntimeError(
        "torch's int4 packing on this CPU is not a layout this build reads back; use "
        "--quantization int8, or int4 on a CPU with AVX-512"
    )


def _unpack_torch_int4(qweight: torch.Tensor, num_rows: int, in_features: int) -> torch.Tensor:
    return _unpack_torch_layout(qweight.view(-1), num_rows, in_features, *_torch_int4_layout())


def _quantized_rows(qweight, scales, ids: torch.Tensor, zeros: bool) -> torch.Tensor:
    """Rows ``ids`` of a blocked int4 or int8-code weight, dequantized by the C++ lookup
    (``torch.ops.llmrpc_cpu.quantized_rows``): an embedding's, where the head holds its weight."""
    return torch.ops.llmrpc_cpu.quantized_rows.default(qweight, scales, ids, zeros)


def _row_bytes(qweight: torch.Tensor, ids: torch.Tensor, width: int = 2) -> torch.Tensor:
    """The bytes ``[ids, groups, chunks, width]`` of rows ``ids`` in a blocked weight ``[out / 16,
    groups, chunks, 32]``: bytes ``width * (row % (32 / width))`` and the next of each chunk (2: the
    pairs of int8 codes and of int4 ones; 4: split int4 chunks, rows 8-15 in the high nibbles)."""
    _, groups, chunks, _ = qweight.shape
    chunk_starts = torch.arange(groups * chunks, device=ids.device) * 32
    starts = (ids // 16) * (groups * chunks * 32) + (ids % (32 // width)) * width
    index = starts[:, None, None] + chunk_starts[:, None] + torch.arange(width, device=ids.device)
    return qweight.view(-1)[index].view(ids.shape[0], groups, chunks, width)


@functools.cache
def tiles_available() -> bool:
    """Whether the blocked kernels' AMX tile path exists here (the build has it, the CPU has
    AMX-BF16 and Linux granted the tiles)."""
    return blocked_kernel_available() and torch.ops.llmrpc_cpu.int4_tiles_supported()


@functools.cache
def _split_nibbles() -> bool:
    """Whether blocked int4 chunks take the split layout (the AVX2 build's kernel reads it:
    ``kernel_ops/csrc/int4_linear.cpp`` describes both)."""
    return torch.ops.llmrpc_cpu.int4_split_nibbles()


def blocked_kernel_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether our int4 kernel computes ``dtype`` here: bfloat16 only, with the CPU kernels
    built with AVX2 and FMA (or AVX512-BF16 and VNNI)."""
    return (
        dtype == torch.bfloat16 and cpu_ops.load() and torch.ops.llmrpc_cpu.int4_linear_supported()
    )


def _pack_int4(codes, scales, zeros, dtype) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(qweight, scales_and_zeros, blocked)`` for codes ``[out, in]`` in [0, 15] and
    ``scales``/``zeros`` ``[out, in / 32]``: blocked where our kernel computes ``dtype``."""
    out_features, in_features = codes.shape
    groups = in_features // GROUP_SIZE
    if blocked_kernel_available(dtype):
        if _split_nibbles():  # [block, low/high nibble, output, group, chunk, input]
            parts = codes.to(torch.uint8).reshape(out_features // 16, 2, 8, groups, 8, 4)
            parts = parts.permute(0, 3, 4, 1, 2, 5)  # block, group, chunk, nibble, output, input
        else:  # [block, output, group, chunk, low/high nibble, input of the pair]
            parts = codes.to(torch.uint8).reshape(out_features // 16, 16, groups, 8, 2, 2)
            parts = parts.permute(0, 2, 3, 4, 1, 5)  # block, group, chunk, nibble, output, input
        packed = parts[:, :, :, 0] | (parts[:, :, :, 1] << 4)
        both = torch.stack([scales, zeros], dim=-1).to(dtype)  # [out, groups, 2]
        both = both.view(out_features // 16, 16, groups, 2).permute(0, 2, 3, 1)
        return packed.reshape(-1, groups, 8, 32).contiguous(), both.contiguous(), True
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return packed, torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype), False


class Q8BlockLinear(Int4Linear):
    """Int8 codes with one scale and zero per 32 inputs (``W = d * q + z``: GGUF's Q8_0 with
    ``z = 0``, its 5-bit types as ``q - 16``) exactly, as two int4 halves of one packed weight:
    ``q = 16 * hi + lo`` with ``hi`` in [-8, 7] and ``lo`` in [0, 15]; rows ``[0, out)`` hold
    ``hi`` (scale ``16 d``, zero 0) and rows ``[out, 2 out)`` hold ``lo`` (scale ``d``, zero
    ``8 d + z``); ``y`` is the sum of the two halves' outputs."""

    def __init__(self, packed, scales_and_zeros, bias=None, blocked: bool = False) -> None:
        super().__init__(packed, scales_and_zeros, bias, blocked)
        self.out_features //= 2  # the halves are one output each

    @classmethod
    def from_blocks(cls, q, d, bias=None, dtype=torch.bfloat16, zeros=None) -> Q8BlockLinear:
        """``q`` int8 ``[out, in]``; ``d`` and ``zeros`` (None: 0) ``[out, in / 32]`` (float32)."""
        q = q.to(torch.int32)
        hi = torch.div(q, 16, rounding_mode="floor")
        lo = q - 16 * hi
        codes = torch.cat([hi + 8, lo])
        scales = torch.cat([16 * d, d])
        low_zeros = 8 * d if zeros is None else 8 * d + zeros
        packed, scales_and_zeros, blocked = _pack_int4(
            codes, scales, torch.cat([torch.zeros_like(d), low_zeros]), dtype
        )
        return cls(packed, scales_and_zeros, bias, blocked)

    def packed_matmul(self, x: torch.Tensor, tiles_from: int | None = None) -> torch.Tensor:
        both = super().packed_matmul(x, tiles_from)
        return both[:, : self.out_features] + both[:, self.out_features :]

    def layer_spec(self) -> None:
        return None  # two halves summed: not one call

    def dequantize(self, dtype=None) -> torch.Tensor:
        # Both halves are multiples of d and their sum has at most 8 + 11 significant bits:
        # exact in float32 (with a zero, rounded once more).
        halves = self._dequantize_codes(self.codes(), slice(None))
        return (halves[: self.out_features] + halves[self.out_features :]).to(dtype or self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        both = torch.cat([ids, ids + self.out_features])
        halves = self._dequantize_codes(self._row_codes(both), both)
        return (halves[: len(ids)] + halves[len(ids) :]).to(self.dtype)


class Q8Linear(QuantizedLinear):
    """Int8 codes in our blocked layout (``kernel_ops/csrc/int4_linear.cpp`` describes it):
    ``qweight`` ``[out / 16, in / 32, 16, 32]`` holding ``q + 128``, and ``scales`` in one of three
    layouts: ``[out / 16, in / 32, 16]``, one ``d`` per 32 inputs (``W = d * q``: GGUF's Q8_0 and
    Q5_0); ``[out / 16, in / 32, 2, 16]`` with ``zeros``, ``(d, z)`` per 32 (``W = d * q + z``:
    Q5_1, Q5_K, Q4_K beside them); or the same shape without, one ``d`` per 16 inputs (Q6_K).
    Computed by ``torch.ops.llmrpc_cpu.q8_linear`` (bfloat16 with AVX2 and FMA, or AVX512-BF16
    and VNNI; ``Q8BlockLinear`` elsewhere)."""

    dense_above = BLOCKED_DENSE_ABOVE

    def __init__(self, qweight, scales, bias=None, zeros: bool = False) -> None:
        blocks, groups = scales.shape[:2]
        super().__init__(groups * GROUP_SIZE, blocks * 16, bias)
        self.zeros = zeros
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_blocks(cls, q, d, bias=None, dtype=torch.bfloat16, zeros=None) -> Q8Linear:
        """``q`` int8 ``[out, in]``; ``d`` ``[out, in / 32]`` or ``[out, in / 16]`` (float32);
        ``zeros`` ``[out, in / 32]`` or None (only with a ``d`` per 32)."""
        out_features, in_features = q.shape
        groups = in_features // GROUP_SIZE
        # [block, output, group, input pair, input of the pair] -> block, group, pair, output, input
        shifted = (q.to(torch.int16) + 128).to(torch.uint8)
        parts = shifted.view(out_features // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)
        qweight = parts.reshape(out_features // 16, groups, 16, 32).contiguous()
        if zeros is not None:
            d = torch.stack([d, zeros], dim=-1)  # [out, groups, 2]: (d, z)
        # [block, output, group, plane] -> block, group, plane, output
        planes = d.to(dtype).view(out_features // 16, 16, groups, -1).permute(0, 2, 3, 1)
        if planes.shape[2] == 1:
            planes = planes[:, :, 0]
        return cls(qweight, planes.contiguous(), bias, zeros is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self._buffers["scales"].dtype  # as Int4Linear.packed_matmul reads them

    @property
    def has_tiles(self) -> bool:
        return tiles_available()

    def packed_matmul(self, x: torch.Tensor, tiles_from: int | None = None) -> torch.Tensor:
        buffers = self._buffers  # as Int4Linear.packed_matmul reads them
        return torch.ops.llmrpc_cpu.q8_linear.default(
            x.contiguous(),
            buffers["qweight"],
            buffers["scales"],
            self.zeros,
            self.tiles_from if tiles_from is None else tiles_from,
        )

    def layer_spec(self) -> LinearSpec | None:
        if self.dtype not in _FAST_DTYPES:
            return None
        return LinearSpec(
            Q8, self.qweight, self.dtype, self.scales, self.bias, tiles_from=self.tiles_from,
            zeros=self.zeros, max_rows=self.dense_above,
        )  # fmt: skip

    def _weights(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Float32 ``[ids, in]`` of rows ``ids``' codes ``q`` (``[ids, groups, 32]``, float)."""
        planes = 1 if self.scales.dim() == 3 else 2
        groups = self.scales.shape[1]
        base = ids // 16 * (groups * planes * 16) + ids % 16
        index = (
            base[:, None, None]
            + (torch.arange(groups) * (planes * 16))[:, None]
            + torch.arange(planes) * 16
        )
        params = self.scales.view(-1)[index].float()  # [ids, group, plane]
        if self.zeros:  # q * d + z
            weight = q * params[..., :1] + params[..., 1:]
        else:  # a d per 32, or per 16 (q has 8 bits and d at most 24: exact in float32)
            weight = q.view(len(ids), groups, planes, -1) * params[..., None]
        return weight.reshape(len(ids), self.in_features)

    def dequantize(self, dtype=None) -> torch.Tensor:
        # [block, group, input pair, output, input of the pair] -> [output, input]
        blocks, groups = self.qweight.shape[:2]
        q = self.qweight.view(blocks, groups, 16, 16, 2).permute(0, 3, 1, 2, 4).float() - 128
        ids = torch.arange(self.out_features)
        weight = self._weights(q.reshape(self.out_features, groups, GROUP_SIZE), ids)
        return weight.to(dtype or self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if cpu_ops.loaded():
            return _quantized_rows(self.qweight, self.scales, ids, self.zeros)
        return self.torch_rows(ids)

    def torch_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` by torch's operations (the C++ lookup computes the same bits)."""
        # [ids, group, input pair, input of the pair] is input order
        q = _row_bytes(self.qweight, ids).float() - 128
        return self._weights(q.view(len(ids), -1, GROUP_SIZE), ids).to(self.dtype)


def packed_bytes(module: nn.Module) -> int:
    """Bytes of a module's buffers and parameters, each tensor counted once."""
    tensors = {id(t): t for t in (*module.buffers(), *module.parameters())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---------------------------------------------------------------------------------------------
# Putting packed layers into a model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def release_freed_memory() -> None:
    """Hand the heap freed by the float weights back to the system (glibc keeps it otherwise,
    and the process's resident memory would not drop)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)

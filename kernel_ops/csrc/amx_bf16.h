// The AMX bfloat16 tile kernel of bf16_linear.cpp, for the other kernels of this build that
// produce weights in its blocked layout ([blocks, pairs, 16, 2]) on the fly (int4_linear.cpp's
// quantized layers, dequantized a few blocks at a time).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace llmrpc_cpu {

// Whether the build has the tile kernel and Linux granted the tiles to this process.
bool amx_bf16_available();

// Columns [0, 16 * num_blocks) of y (rows of `ldy` outputs) = x W^T, no bias, for `num_blocks`
// blocks of `pairs` input pairs (a multiple of 16) in the blocked layout, on the calling thread.
// x: `rows` contiguous rows of 2 * pairs inputs. Only where amx_bf16_available().
void amx_bf16_blocks(const at::BFloat16* weight, int64_t pairs, int64_t num_blocks,
                     const at::BFloat16* x, at::BFloat16* y, int64_t ldy, int64_t rows);

}  // namespace llmrpc_cpu

// Group-wise int4 weights times bfloat16 activations on the CPU: y = x W^T, with
// W[n, k] = (u[n, k] - 8) * scale[n, g] + zero[n, g] for the group g = k / 32 of 32 inputs.
//
// Weight layout (packed by engine/quantization/layers.py, `Int4Linear`): outputs in blocks of 16, each
// block's inputs in groups of 32, each group 256 bytes: 8 chunks of 32 bytes, chunk c covering
// inputs 4c..4c+3 of the group. Byte j of a chunk holds output j / 2 of the block: its low nibble
// the code for input 4c + j % 2, its high nibble the code for input 4c + 2 + j % 2. Scales and
// zeros: [blocks, groups, 2, 16] (scale, zero of the block's 16 outputs), in bfloat16. The AVX2
// build's kernel reads the chunks split instead (int4_split_nibbles() says which): byte 4m + t of
// chunk c holds input 4c + t of output m in its low nibble and of output 8 + m in its high one.
//
// The inputs are quantized first, as llama.cpp quantizes them for its integer dot products: per
// row and group, dx = max |x| / 127 and q = round(x * (1 / dx)) in int8. Each group's dot products
// of the codes with q are exact in int32 (AVX512-VNNI, 64 multiply-adds an instruction), and the
// group adds scale * dx * dot + (zero - 8 * scale) * dx * sum(q) to the row's float32 total: the
// same terms in the same order whatever the number of rows, so a row's output does not depend
// on the rows beside it.
//
// The same kernel computes int8 codes (GGUF's Q8_0, W[n, k] = d[n, g] * q[n, k], and the 5- and
// 6-bit types written as int8 codes): each group 512 bytes, 16 chunks of 32, chunk p covering
// inputs 2p and 2p + 1 of the group, byte j holding q + 128 for output j / 2 and input 2p + j % 2.
// Its scales come in three layouts:
// - [blocks, groups, 16]: one d per 32 inputs; per group it adds d * dx * dot - 128 * d * dx * sum(q);
// - [blocks, groups, 2, 16] with zeros: (d, zero) per 32 inputs, W = d * q + zero, adding
//   d * dx * dot + (zero - 128 * d) * dx * sum(q);
// - [blocks, groups, 2, 16] without: one d for each half of 16 inputs (GGUF's Q6_K), each half
//   adding its own d * dx * dot - 128 * d * dx * sum(q) over its 16 inputs.
//
// Registered as torch.ops.llmrpc_cpu.int4_linear and q8_linear (their tiles_from: the rows from
// which a call takes the tile path described below; 0 never); int4_linear_supported() says
// whether this build has the kernels (the ones above with AVX512-BF16 and AVX512-VNNI, else the
// AVX2 ones further down with AVX2 and FMA; in a plain C++ build the engine keeps torch's
// kernels), int4_tiles_supported() whether it has the tile path (and AMX-BF16).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_bf16.h"
#include "avx2_bf16.h"
#include "kernel_threads.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockOutputs = 16;
constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = kBlockOutputs * kGroup / 2;  // int4; Q8_0 twice that
// Weights are read in address order; asking for the bytes this far ahead took one row's pass over
// SmolLM2's 30 layers (53 MB, one thread) from 2.9-3.1 to 1.9-2.2 ms (distances of 1 to 64 KB
// tried; 16-32 KB best).
constexpr int64_t kPrefetchAhead = 16384;

// What a group's scales hold: int4 weights always a (scale, zero) pair per 32 inputs; int8 codes
// one of the three layouts described at the top.
enum class Scales { kInt4, kQ8, kQ8Zeros, kQ8Halves };

// Rows computed together: each unpacked weight serves all of them. Per kind, by measurement
// (tests/bench/kernel_bench.py's shapes, 1 thread, AMD EPYC family 26): int8 codes at 128-512
// rows did 153-160 GMAC/s in tiles of 12 rows, 219-229 in tiles of 9-11; with a scale per 16
// inputs (whose first half's sums stay live beside the rest) 123-127 at 12, 173-181 at 4-6.
template <Scales kScales>
constexpr int kMaxRows = kScales == Scales::kInt4      ? 12
                         : kScales == Scales::kQ8Halves ? 6
                                                        : 10;

template <Scales kScales>
constexpr bool kIsQ8 = kScales != Scales::kInt4;

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
inline __m512 load_bf16x16(const at::BFloat16* values) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Each row's inputs, group by group: d = max |x| / 127, q = round(x * (1 / d)) (ties to even)
// as int8, d * sum(q), and (where d_halves is given) d * sum(q) over each half of 16 (d_halves:
// [2][rows * groups]). The same for a row whatever the rows beside it.
void quantize_rows(const at::BFloat16* x, int64_t rows, int64_t groups, int8_t* q, float* d,
                   float* d_sum, float* d_halves) {
  for (int64_t i = 0; i < rows * groups; ++i) {
    const __m512 first = load_bf16x16(x + i * kGroup);
    const __m512 second = load_bf16x16(x + i * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
    const float scale = amax / 127.f;
    const __m512 inverse = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(first, inverse));
    const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(second, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtsepi32_epi8(low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtsepi32_epi8(high));
    d[i] = scale;
    d_sum[i] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(low, high)));
    if (d_halves != nullptr) {  // only a scale per 16 inputs needs them
      d_halves[i] = scale * static_cast<float>(_mm512_reduce_add_epi32(low));
      d_halves[rows * groups + i] = scale * static_cast<float>(_mm512_reduce_add_epi32(high));
    }
  }
}

// The weights of a group's inputs 4c..4c+3 for the block's 16 outputs, one output a 32-bit lane
// holding its 4 codes as bytes: what VNNI's unsigned x signed dot product takes.
template <bool kQ8>
inline __m512i unpack_chunk(const uint8_t* chunks, int c) {
  if constexpr (kQ8) {  // two 32-byte chunks of 16 outputs x 2 inputs
    const __m512i first = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 64 * c)));
    const __m512i second = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 64 * c + 32)));
    return _mm512_or_si512(first, _mm512_slli_epi32(second, 16));
  } else {  // lane o: bytes (u0 | u2 << 4, u1 | u3 << 4) -> (u0, u1, u2, u3)
    const __m512i pairs = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c)));
    // (pairs | pairs << 12) & 0x0F0F0F0F
    return _mm512_ternarylogic_epi32(pairs, _mm512_slli_epi32(pairs, 12),
                                     _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
  }
}

// Outputs of one block of 16 for R rows (q: R rows of `ldq` int8; d, d_sum: R rows of `groups`;
// d_halves: the two halves' sums, `halves_stride` apart). Each row sums a group's even and odd
// chunks in two int32 registers (two dependency chains); the running float totals, touched once a
// group, live in memory.
template <int R, Scales kScales>
void block_rows(const uint8_t* weight, const at::BFloat16* scales, const int8_t* q, int64_t ldq,
                const float* d, const float* d_sum, const float* d_halves, int64_t halves_stride,
                int64_t groups, at::BFloat16* y, int64_t ldy) {
  constexpr bool kQ8 = kIsQ8<kScales>;
  constexpr bool kHalves = kScales == Scales::kQ8Halves;
  constexpr bool kZeros = kScales == Scales::kInt4 || kScales == Scales::kQ8Zeros;
  const __m512 offset = _mm512_set1_ps(kQ8 ? 128.f : 8.f);
  constexpr int64_t kBytes = kQ8 ? 2 * kGroupBytes : kGroupBytes;
  constexpr int64_t kScalesPerGroup = kScales == Scales::kQ8 ? kBlockOutputs : 2 * kBlockOutputs;
  alignas(64) float total[R][kBlockOutputs];
  for (int r = 0; r < R; ++r) _mm512_store_ps(total[r], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunks = weight + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunks + kPrefetchAhead + line), _MM_HINT_T0);
    }
    __m512i even[R], odd[R], first_half[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      if constexpr (kHalves) {
        if (c == 4) {  // inputs 0-15 done: their dots apart from the second half's
          for (int r = 0; r < R; ++r) {
            first_half[r] = _mm512_add_epi32(even[r], odd[r]);
            even[r] = odd[r] = _mm512_setzero_si512();
          }
        }
      }
      const __m512i first = unpack_chunk<kQ8>(chunks, c);
      const __m512i second = unpack_chunk<kQ8>(chunks, c + 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* inputs = q + r * ldq + g * kGroup + 4 * c;
        int32_t bits[2];
        std::memcpy(bits, inputs, sizeof(bits));
        even[r] = _mm512_dpbusd_epi32(even[r], first, _mm512_set1_epi32(bits[0]));
        odd[r] = _mm512_dpbusd_epi32(odd[r], second, _mm512_set1_epi32(bits[1]));
      }
    }
    const at::BFloat16* group_scales = scales + g * kScalesPerGroup;
    const __m512 scale = load_bf16x16(group_scales);
    if constexpr (kHalves) {
      const __m512 second_scale = load_bf16x16(group_scales + kBlockOutputs);
      const __m512 shift = _mm512_mul_ps(offset, scale);
      const __m512 second_shift = _mm512_mul_ps(offset, second_scale);
      for (int r = 0; r < R; ++r) {
        const int64_t i = r * groups + g;
        const __m512 dx = _mm512_set1_ps(d[i]);
        __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first_half[r]), _mm512_mul_ps(scale, dx),
                                     _mm512_load_ps(total[r]));
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r])),
                              _mm512_mul_ps(second_scale, dx), sum);
        sum = _mm512_fnmadd_ps(shift, _mm512_set1_ps(d_halves[i]), sum);
        sum = _mm512_fnmadd_ps(second_shift, _mm512_set1_ps(d_halves[halves_stride + i]), sum);
        _mm512_store_ps(total[r], sum);
      }
    } else {
      // zero - offset * scale (int4: zero - 8 * scale; Q8_0: -128 * d)
      const __m512 zero =
          kZeros ? load_bf16x16(group_scales + kBlockOutputs) : _mm512_setzero_ps();
      const __m512 shift = _mm512_fnmadd_ps(offset, scale, zero);
      for (int r = 0; r < R; ++r) {
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
        __m512 sum = _mm512_fmadd_ps(dots, _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g])),
                                     _mm512_load_ps(total[r]));
        sum = _mm512_fmadd_ps(shift, _mm512_set1_ps(d_sum[r * groups + g]), sum);
        _mm512_store_ps(total[r], sum);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(total[r]))));
  }
}

template <int R, Scales kScales>
void rows_of_block(const uint8_t* weight, const at::BFloat16* scales, const int8_t* q,
                   int64_t ldq, const float* d, const float* d_sum, const float* d_halves,
                   int64_t halves_stride, int64_t groups, at::BFloat16* y, int64_t ldy,
                   int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_of_block<R - 1, kScales>(weight, scales, q, ldq, d, d_sum, d_halves, halves_stride,
                                    groups, y, ldy, rows);
      return;
    }
  }
  block_rows<R, kScales>(weight, scales, q, ldq, d, d_sum, d_halves, halves_stride, groups, y,
                         ldy);
}

template <Scales kScales>
void blocked_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                    at::Tensor& y) {
  constexpr bool kQ8 = kIsQ8<kScales>;
  const int64_t rows = x.size(0), blocks = weight.size(0), groups = weight.size(1);
  auto q = at::empty({rows, groups * kGroup}, x.options().dtype(at::kChar));
  auto d = at::empty({4, rows, groups}, x.options().dtype(at::kFloat));
  int8_t* qs = q.data_ptr<int8_t>();
  float* ds = d.data_ptr<float>();
  float* d_sums = ds + rows * groups;
  float* d_halves = ds + 2 * rows * groups;
  quantize_rows(x.data_ptr<at::BFloat16>(), rows, groups, qs, ds, d_sums,
                kScales == Scales::kQ8Halves ? d_halves : nullptr);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::BFloat16* sc = scales.data_ptr<at::BFloat16>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const int64_t ldq = groups * kGroup, ldy = blocks * kBlockOutputs;
  const int64_t block_bytes = groups * (kQ8 ? 2 : 1) * kGroupBytes;
  const int64_t block_scales = scales.numel() / blocks;
  // rows in tiles of near-equal size (int4's 16 rows: 8 + 8, not 12 + 4)
  const int64_t num_tiles = (rows + kMaxRows<kScales> - 1) / kMaxRows<kScales>;
  const int64_t tile = (rows + num_tiles - 1) / std::max<int64_t>(num_tiles, 1);
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < rows; r += tile) {
        rows_of_block<kMaxRows<kScales>, kScales>(
            w + b * block_bytes, sc + b * block_scales, qs + r * ldq, ldq, ds + r * groups,
            d_sums + r * groups, d_halves + r * groups, rows * groups, groups,
            out + r * ldy + b * kBlockOutputs, ldy, std::min<int64_t>(tile, rows - r));
      }
    }
  });
}

// The tile path: a few blocks at a time dequantized into bfloat16 pair lines (bf16_linear.cpp's
// blocked layout: line p of a group holds inputs 2p and 2p + 1 of the block's 16 outputs, output
// j / 2 at position j), W = u * scale + (zero - offset * scale) in float32 rounded once, then
// AMX's bfloat16 tiles over every row (amx_bf16.h). The dequantization is paid once a call
// whatever the rows, each further row costs far less than with the dot products above (30
// layers of SmolLM2's shapes, one thread, Intel Xeon with AMX: 17 against 4-7 ms at 1 row, level
// at about 16, 21 against 33 ms at 32 rows, 42 against 139 at 128); which path serves which rows
// is measured at load (engine/quantization/tuning.py). The activations stay in bfloat16 (not
// quantized to int8), so its outputs are the dense path's (dequantize, then matmul) up to the
// order of the sums. An int4 chunk c gives lines 2c (low nibbles, inputs 4c and 4c + 1) and
// 2c + 1 (high nibbles); an int8 chunk p is line p.
constexpr int64_t kTileBlocks = 8;  // blocks dequantized at a time: 8 x 16 outputs

template <Scales kScales>
void dequantize_block(const uint8_t* weight, const at::BFloat16* scales, int64_t groups,
                      at::BFloat16* lines) {
  constexpr bool kQ8 = kIsQ8<kScales>;
  constexpr bool kZeros = kScales == Scales::kInt4 || kScales == Scales::kQ8Zeros;
  constexpr int64_t kBytes = kQ8 ? 2 * kGroupBytes : kGroupBytes;
  constexpr int64_t kScalesPerGroup = kScales == Scales::kQ8 ? kBlockOutputs : 2 * kBlockOutputs;
  const __m512 offset = _mm512_set1_ps(kQ8 ? 128.f : 8.f);
  // positions 0-15 of a line are outputs 0-7 (two inputs each), 16-31 outputs 8-15
  const __m512i first_outputs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i last_outputs =
      _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunks = weight + g * kBytes;
    const at::BFloat16* group_scales = scales + g * kScalesPerGroup;
    // [half][first or last 16 positions]: Q6_K's halves of 16 inputs have a scale each
    __m512 scale[2][2], shift[2][2];
    for (int half = 0; half < 2; ++half) {
      const bool second = kScales == Scales::kQ8Halves && half == 1;
      const __m512 d = load_bf16x16(group_scales + (second ? kBlockOutputs : 0));
      const __m512 zero =
          kZeros ? load_bf16x16(group_scales + kBlockOutputs) : _mm512_setzero_ps();
      const __m512 shifted = _mm512_fnmadd_ps(offset, d, zero);  // zero - offset * d
      scale[half][0] = _mm512_permutexvar_ps(first_outputs, d);
      scale[half][1] = _mm512_permutexvar_ps(last_outputs, d);
      shift[half][0] = _mm512_permutexvar_ps(first_outputs, shifted);
      shift[half][1] = _mm512_permutexvar_ps(last_outputs, shifted);
    }
    at::BFloat16* out = lines + g * 16 * 32;
    // one line from its 32 codes as two vectors of 16 (positions 0-15 and 16-31)
    const auto line = [&](int64_t p, __m512i first, __m512i last, int half) {
      const __m512bh values = _mm512_cvtne2ps_pbh(
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(last), scale[half][1], shift[half][1]),
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), scale[half][0], shift[half][0]));
      _mm512_storeu_si512(out + 32 * p, reinterpret_cast<__m512i>(values));
    };
    for (int64_t c = 0; c < (kQ8 ? 16 : 8); ++c) {
      const uint8_t* bytes = chunks + 32 * c;
      const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i last = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      if constexpr (kQ8) {
        line(c, first, last, c >= 8 ? 1 : 0);
      } else {  // the low nibbles are line 2c, the high ones line 2c + 1
        const __m512i nibble = _mm512_set1_epi32(0x0F);
        line(2 * c, _mm512_and_si512(first, nibble), _mm512_and_si512(last, nibble), 0);
        line(2 * c + 1, _mm512_srli_epi32(first, 4), _mm512_srli_epi32(last, 4), 0);
      }
    }
  }
}

template <Scales kScales>
void tiled_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                  at::Tensor& y) {
  constexpr bool kQ8 = kIsQ8<kScales>;
  const int64_t rows = x.size(0), blocks = weight.size(0), groups = weight.size(1);
  const int64_t pairs = groups * kGroup / 2, block_lines = pairs * 32;
  const int64_t block_bytes = groups * (kQ8 ? 2 : 1) * kGroupBytes;
  const int64_t block_scales = scales.numel() / blocks;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::BFloat16* sc = scales.data_ptr<at::BFloat16>();
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const int64_t ldy = blocks * kBlockOutputs;
  at::parallel_for(0, (blocks + kTileBlocks - 1) / kTileBlocks, 1, [&](int64_t begin, int64_t end) {
    // each thread's lines, kept between calls rather than allocated and zeroed in each
    thread_local std::vector<at::BFloat16> lines;
    if (static_cast<int64_t>(lines.size()) < kTileBlocks * block_lines) {
      lines.resize(kTileBlocks * block_lines);
    }
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileBlocks, count = std::min(kTileBlocks, blocks - first);
      for (int64_t i = 0; i < count; ++i) {
        dequantize_block<kScales>(w + (first + i) * block_bytes, sc + (first + i) * block_scales,
                                  groups, lines.data() + i * block_lines);
      }
      llmrpc_cpu::amx_bf16_blocks(lines.data(), pairs, count, xs,
                                  out + first * kBlockOutputs, ldy, rows);
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The AVX2 kernels, for CPUs without AVX512-VNNI (or without AVX512-BF16): the same sums, with
// AVX2's integer products. The inputs are quantized as above (the same q, d and sums); each 32-bit
// word of them is broadcast to every lane:
// - against int4 codes, in the split layout, the word holds q[4c..4c+3] as bytes: vpmaddubsw
//   multiplies the unsigned codes by the signed inputs and adds pairs of products into 16 bits, so
//   lanes 2m and 2m + 1 take output m's inputs 4c, 4c + 1 and 4c + 2, 4c + 3 (output 8 + m's from
//   the high nibbles). Over a group a lane adds 16 products (at most 16 * 15 * 127 = 30480, exact
//   in 16 bits), and vpmaddwd by ones adds each output's two lanes into 32 bits, in output order.
//   One broadcast serves both nibbles; the layout of pairs (the AVX-512 kernel's) took one a
//   product, widened its sums by interleaving and permuted its scales: SmolLM2's four int4 layer
//   shapes, one thread, AMD EPYC family 25, ran at 67-69 GMAC/s at 32 rows and 33-34 at 1 row in
//   it, 82-87 and 41-42 split (tests/bench/kernel_bench.py).
// - against int8 codes (q + 128, up to 255: too wide for vpmaddubsw's 16-bit sums), the word holds
//   the pair (q[2p], q[2p + 1]) as two int16: vpmaddwd multiplies each code, widened to 16 bits, and
//   adds an output's two products into 32 bits, exact; a chunk's first 16 bytes are outputs 0-7,
//   the next 8-15.
// Each row's terms come in the same order whatever the rows beside it, so a row's output does not
// depend on them; where a scale covers 16 inputs (Q6_K) each half is added to the total on its
// own, where the AVX-512 kernel adds the halves' dot products first (some last bits differ).
// Rows a tile: each row's sums and totals take 4 registers of AVX2's 16, the loops' own several
// (the same shapes, 32 rows: int4 split 85 GMAC/s at 3 rows a tile, 67 at 4, where 4 rows' sums
// and totals alone fill the 16; int8 codes 56 at 3, 49 at 2, 38 at 4).
constexpr int kInt4Rows = 3, kQ8Rows = 3;

using llmrpc_cpu::load_bf16x8;
using llmrpc_cpu::round_to_bf16;

inline float max_of_lanes(__m256 values) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(values), _mm256_extractf128_ps(values, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

inline int32_t sum_of_lanes(__m256i values) {
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(values), _mm256_extracti128_si256(values, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, 0xB1)));
}

// Inputs 16k..16k+15 of a group as int16 in order, from their int32 values in two registers.
inline __m256i ordered_int16(__m256i first, __m256i second) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(first, second), 0xD8);
}

// Each row's inputs, group by group, quantized as quantize_rows does, into `words`: where kQuads,
// 8 a group, word c holding q[4c..4c+3] as bytes; else 16 a group, word p holding the int16 pair
// (q[2p], q[2p + 1]). Then d, d * sum(q) and, where d_halves is given, d * sum(q) of each half of
// 16 ([2][rows * groups]).
// The input words a group takes: 8 quads of bytes (against int4 codes) or 16 int16 pairs.
template <bool kQuads>
constexpr int64_t kGroupWords = kQuads ? 8 : 16;

template <bool kQuads>
void quantize_rows_avx2(const at::BFloat16* x, int64_t rows, int64_t groups, int32_t* words,
                        float* d, float* d_sum, float* d_halves) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < rows * groups; ++i) {
    __m256 values[4];
    __m256 top = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      values[k] = load_bf16x8(x + i * kGroup + 8 * k);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, values[k]));
    }
    const float scale = max_of_lanes(top) / 127.f;
    const __m256 inverse = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(values[k], inverse));
    const int32_t first = sum_of_lanes(_mm256_add_epi32(q[0], q[1]));
    const int32_t second = sum_of_lanes(_mm256_add_epi32(q[2], q[3]));
    d[i] = scale;
    d_sum[i] = scale * static_cast<float>(first + second);
    if (d_halves != nullptr) {
      d_halves[i] = scale * static_cast<float>(first);
      d_halves[rows * groups + i] = scale * static_cast<float>(second);
    }
    __m256i* out = reinterpret_cast<__m256i*>(words + i * kGroupWords<kQuads>);
    if constexpr (kQuads) {
      // packs interleave the 128-bit lanes: words q[0..3], q[8..11], q[16..19], q[24..27], then
      // q[4..7], ..., put back in input order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(out, _mm256_permutevar8x32_epi32(
                                   bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    } else {
      _mm256_storeu_si256(out, ordered_int16(q[0], q[1]));
      _mm256_storeu_si256(out + 1, ordered_int16(q[2], q[3]));
    }
  }
}

struct Avx2Rows {
  const int32_t* words;  // row r's words of group g from words[r * ldw + 16 * g] (int4: 8 * g)
  const float *d, *d_sum, *d_halves;  // [rows, groups], d_halves [2][rows * groups]
  int64_t ldw, groups, halves_stride, ldy;
  at::BFloat16* y;
};

// Outputs of one int4 block of 16 for R rows (int4's scales: (scale, zero) per 32 inputs), from
// the split layout: a chunk's low nibbles are outputs 0-7, its high ones 8-15.
template <int R>
void int4_block_avx2(const uint8_t* weight, const at::BFloat16* scales, const Avx2Rows& o) {
  const __m256i nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256 offset = _mm256_set1_ps(8.f);
  __m256 totals[R][2];  // outputs 0-7, 8-15
  for (int r = 0; r < R; ++r) totals[r][0] = totals[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < o.groups; ++g) {
    const uint8_t* chunks = weight + g * kGroupBytes;
    for (int64_t line = 0; line < kGroupBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunks + kPrefetchAhead + line), _MM_HINT_T0);
    }
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int c = 0; c < 8; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c));
      const __m256i low = _mm256_and_si256(bytes, nibbles);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibbles);
      for (int r = 0; r < R; ++r) {
        // q[4c..4c+3] in every lane: 16-bit lanes 2m and 2m + 1 take inputs 4c, 4c + 1 and
        // 4c + 2, 4c + 3 of output m (low) and 8 + m (high)
        const __m256i quad = _mm256_set1_epi32(o.words[r * o.ldw + 8 * g + c]);
        sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_maddubs_epi16(low, quad));
        sums[r][1] = _mm256_add_epi16(sums[r][1], _mm256_maddubs_epi16(high, quad));
      }
    }
    // scale and zero - 8 * scale of outputs 0-7 and 8-15
    const at::BFloat16* group_scales = scales + g * 2 * kBlockOutputs;
    __m256 scale[2], shift[2];
    for (int k = 0; k < 2; ++k) {
      scale[k] = load_bf16x8(group_scales + 8 * k);
      shift[k] = _mm256_fnmadd_ps(offset, scale[k], load_bf16x8(group_scales + 16 + 8 * k));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * o.groups + g;
      const __m256 dx = _mm256_set1_ps(o.d[i]), d_sum = _mm256_set1_ps(o.d_sum[i]);
      for (int k = 0; k < 2; ++k) {
        const __m256i dots = _mm256_madd_epi16(sums[r][k], ones);  // each output's two lanes
        const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale[k], dx),
                                           totals[r][k]);
        totals[r][k] = _mm256_fmadd_ps(shift[k], d_sum, sum);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < 2; ++k) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.y + r * o.ldy + 8 * k),
                       round_to_bf16(totals[r][k]));
    }
  }
}

// Outputs of one int8 block of 16 for R rows, in any of the three scale layouts.
template <int R, Scales kScales>
void q8_block_avx2(const uint8_t* weight, const at::BFloat16* scales, const Avx2Rows& o) {
  constexpr bool kHalves = kScales == Scales::kQ8Halves;
  constexpr bool kZeros = kScales == Scales::kQ8Zeros;
  constexpr int64_t kScalesPerGroup = kScales == Scales::kQ8 ? kBlockOutputs : 2 * kBlockOutputs;
  constexpr int kSpans = kHalves ? 2 : 1;  // spans of inputs with a scale each
  constexpr int kSpanChunks = 16 / kSpans;
  const __m256 offset = _mm256_set1_ps(128.f);
  __m256 totals[R][2];  // outputs 0-7, 8-15
  for (int r = 0; r < R; ++r) totals[r][0] = totals[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < o.groups; ++g) {
    const uint8_t* chunks = weight + g * 2 * kGroupBytes;
    for (int64_t line = 0; line < 2 * kGroupBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(chunks + kPrefetchAhead + line), _MM_HINT_T0);
    }
    const at::BFloat16* group_scales = scales + g * kScalesPerGroup;
    for (int span = 0; span < kSpans; ++span) {
      __m256i dots[R][2];
      for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
      // two chunks an iteration, as the int4 loop takes them (tests/bench/kernel_bench.py, AMD EPYC
      // family 25: 28-30, 53 and 56 GMAC/s at 1, 8 and 32 rows, against 25, 48-49 and 53 for GCC
      // 12's own unrolling; 4 chunks an iteration within the noise of 2)
#pragma GCC unroll 2
      for (int p = span * kSpanChunks; p < (span + 1) * kSpanChunks; ++p) {
        const __m256i first = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunks + 32 * p)));
        const __m256i second = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunks + 32 * p + 16)));
        for (int r = 0; r < R; ++r) {
          const __m256i pair = _mm256_set1_epi32(o.words[r * o.ldw + 16 * g + p]);
          dots[r][0] = _mm256_add_epi32(dots[r][0], _mm256_madd_epi16(first, pair));
          dots[r][1] = _mm256_add_epi32(dots[r][1], _mm256_madd_epi16(second, pair));
        }
      }
      // d and zero - 128 * d (Q8_0: -128 * d) for outputs 0-7 and 8-15
      const at::BFloat16* span_scales = group_scales + span * kBlockOutputs;
      __m256 scale[2], shift[2];
      for (int k = 0; k < 2; ++k) {
        scale[k] = load_bf16x8(span_scales + 8 * k);
        const __m256 zero = kZeros ? load_bf16x8(group_scales + kBlockOutputs + 8 * k)
                                   : _mm256_setzero_ps();
        shift[k] = _mm256_fnmadd_ps(offset, scale[k], zero);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = r * o.groups + g;
        const __m256 dx = _mm256_set1_ps(o.d[i]);
        const __m256 d_sum =
            _mm256_set1_ps(kHalves ? o.d_halves[span * o.halves_stride + i] : o.d_sum[i]);
        for (int k = 0; k < 2; ++k) {
          const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][k]),
                                             _mm256_mul_ps(scale[k], dx), totals[r][k]);
          totals[r][k] = _mm256_fmadd_ps(shift[k], d_sum, sum);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < 2; ++k) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.y + r * o.ldy + 8 * k),
                       round_to_bf16(totals[r][k]));
    }
  }
}

template <int R, Scales kScales>
void rows_of_block_avx2(const uint8_t* weight, const at::BFloat16* scales, const Avx2Rows& o,
                        int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return rows_of_block_avx2<R - 1, kScales>(weight, scales, o, rows);
  }
  if constexpr (kScales == Scales::kInt4) {
    int4_block_avx2<R>(weight, scales, o);
  } else {
    q8_block_avx2<R, kScales>(weight, scales, o);
  }
}

// Calls whose quantized inputs take up to this many words (a decode step's) quantize into a
// buffer the calling thread keeps; larger ones into a new tensor.
constexpr int64_t kKeptWords = 65536;

template <Scales kScales>
void blocked_linear_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                         at::Tensor& y) {
  constexpr bool kQ8 = kIsQ8<kScales>;
  const int64_t rows = x.size(0), blocks = weight.size(0), groups = weight.size(1);
  // words, then d, d * sum(q) and the halves' sums (4 floats a group)
  const int64_t ldw = groups * kGroupWords<!kQ8>;
  const int64_t needed = rows * (ldw + 4 * groups);
  thread_local std::vector<int32_t> kept(kKeptWords);
  at::Tensor allocated;
  int32_t* words = kept.data();
  if (needed > kKeptWords) {
    allocated = at::empty({needed}, x.options().dtype(at::kInt));
    words = allocated.data_ptr<int32_t>();
  }
  float* ds = reinterpret_cast<float*>(words + rows * ldw);
  static_assert(sizeof(float) == sizeof(int32_t));
  float* d_sums = ds + rows * groups;
  float* d_halves = ds + 2 * rows * groups;
  quantize_rows_avx2<!kQ8>(x.data_ptr<at::BFloat16>(), rows, groups, words, ds, d_sums,
                           kScales == Scales::kQ8Halves ? d_halves : nullptr);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::BFloat16* sc = scales.data_ptr<at::BFloat16>();
  const int64_t ldy = blocks * kBlockOutputs;
  const int64_t block_bytes = groups * (kQ8 ? 2 : 1) * kGroupBytes;
  const int64_t block_scales = scales.numel() / blocks;
  constexpr int kRows = kQ8 ? kQ8Rows : kInt4Rows;
  const int64_t num_tiles = (rows + kRows - 1) / kRows;
  const int64_t tile = (rows + num_tiles - 1) / std::max<int64_t>(num_tiles, 1);
  const Avx2Rows all{words, ds, d_sums, d_halves, ldw, groups, rows * groups, ldy,
                     y.data_ptr<at::BFloat16>()};
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < rows; r += tile) {
        Avx2Rows part = all;
        part.words += r * all.ldw;
        part.d += r * groups;
        part.d_sum += r * groups;
        part.d_halves += r * groups;
        part.y += r * ldy + b * kBlockOutputs;
        rows_of_block_avx2<kRows, kScales>(w + b * block_bytes, sc + b * block_scales, part,
                                           std::min<int64_t>(tile, rows - r));
      }
    }
  });
}
#endif

bool tiles_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return llmrpc_cpu::amx_bf16_available();
#else
  return false;
#endif
}

// Whether int4 chunks take the split layout described at the top (the AVX2 kernel's).
bool split_nibbles() {
#if !(defined(__AVX512BF16__) && defined(__AVX512VNNI__)) && defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

bool supported() {
#if (defined(__AVX512BF16__) && defined(__AVX512VNNI__)) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

// Checks the layouts the kernel reads (each message names the tensor and its shape), then runs it.
at::Tensor checked_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          bool q8, bool zeros, int64_t tiles_from) {
  const char* name = q8 ? "q8_linear" : "int4_linear";
  const int64_t chunks = q8 ? 16 : 8;
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() && weight.scalar_type() == at::kByte &&
              weight.size(2) == chunks && weight.size(3) == 32,
              name, ": weight must be contiguous uint8 [out / 16, in / 32, ", chunks, ", 32]");
  TORCH_CHECK(supported(), name, ": this build has no kernel (it takes AVX2 and FMA)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be a contiguous [rows, in_features] bfloat16 tensor");
  const int64_t blocks = weight.size(0), groups = weight.size(1);
  TORCH_CHECK(x.size(1) == groups * kGroup, name, ": x has ", x.size(1),
              " features, the weight takes ", groups * kGroup);
  const bool pairs = !q8 || scales.dim() == 4;
  const std::vector<int64_t> shape = pairs ? std::vector<int64_t>{blocks, groups, 2, kBlockOutputs}
                                           : std::vector<int64_t>{blocks, groups, kBlockOutputs};
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kBFloat16 &&
              scales.sizes() == at::IntArrayRef(shape),
              name, q8 ? ": scales must be contiguous bfloat16 [out / 16, in / 32, 16] or "
                         "[out / 16, in / 32, 2, 16]"
                       : ": scales_zeros must be contiguous bfloat16 [out / 16, in / 32, 2, 16]");
  TORCH_CHECK(!zeros || pairs, name, ": zeros=True takes scales [out / 16, in / 32, 2, 16]");
  auto y = at::empty({x.size(0), blocks * kBlockOutputs}, x.options());
  TORCH_CHECK(tiles_from >= 0, name, ": tiles_from must be 0 (never) or a row count, got ",
              tiles_from);
  const llmrpc_cpu::KernelThreadsScope threads;
  // One switch a path, written out: dispatching all three through one generic lambda made GCC 12
  // compile the AVX2 int8-code kernel 8-15% slower at 32 rows (AMD EPYC family 25).
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  if (tiles_from > 0 && x.size(0) >= tiles_from) {
    TORCH_CHECK(tiles_supported(), name, ": tiles_from needs AMX-BF16 tiles, which this build or "
                "CPU lacks");
    if (!q8) {
      tiled_linear<Scales::kInt4>(x, weight, scales, y);
    } else if (!pairs) {
      tiled_linear<Scales::kQ8>(x, weight, scales, y);
    } else if (zeros) {
      tiled_linear<Scales::kQ8Zeros>(x, weight, scales, y);
    } else {
      tiled_linear<Scales::kQ8Halves>(x, weight, scales, y);
    }
    return y;
  }
  if (!q8) {
    blocked_linear<Scales::kInt4>(x, weight, scales, y);
  } else if (!pairs) {
    blocked_linear<Scales::kQ8>(x, weight, scales, y);
  } else if (zeros) {
    blocked_linear<Scales::kQ8Zeros>(x, weight, scales, y);
  } else {
    blocked_linear<Scales::kQ8Halves>(x, weight, scales, y);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(tiles_from == 0 || x.size(0) < tiles_from, name,
              ": tiles_from needs AMX-BF16 tiles, which this build or CPU lacks");
  if (!q8) {
    blocked_linear_avx2<Scales::kInt4>(x, weight, scales, y);
  } else if (!pairs) {
    blocked_linear_avx2<Scales::kQ8>(x, weight, scales, y);
  } else if (zeros) {
    blocked_linear_avx2<Scales::kQ8Zeros>(x, weight, scales, y);
  } else {
    blocked_linear_avx2<Scales::kQ8Halves>(x, weight, scales, y);
  }
#endif
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& scales_zeros, int64_t tiles_from) {
  return checked_linear(x, weight, scales_zeros, false, true, tiles_from);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     bool zeros, int64_t tiles_from) {
  return checked_linear(x, weight, scales, true, zeros, tiles_from);
}

// Rows `ids` of a blocked weight (int4 codes where the group has 8 chunks, else int8 codes, with
// the scale layouts above), dequantized as the Python layers' rows() compute them: in float32, the
// product and then the zero each rounded (the product is kept apart from the add, which fusing
// them into one multiply-add would round once), then rounded to the scales' dtype. An embedding
// tied to the head reads its rows so: a row of SmolLM2's Q8_0 head took 7 us against 169 by torch's
// operations (one thread, AMD EPYC family 25): about 2% of a one-row step of the packaged GGUF model.
template <typename T>
void dequantized_rows(const uint8_t* weight, const T* scales, const int64_t* ids, int64_t count,
                      int64_t groups, Scales layout, T* out) {
  const bool int4 = layout == Scales::kInt4, split = split_nibbles();
  const int64_t group_bytes = int4 ? kGroupBytes : 2 * kGroupBytes;
  const int64_t planes = layout == Scales::kQ8 ? 1 : 2;  // scale planes of 16 a group
  const bool with_zeros = int4 || layout == Scales::kQ8Zeros;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t block = ids[n] / kBlockOutputs, lane = ids[n] % kBlockOutputs;
      T* row = out + n * groups * kGroup;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* chunks = weight + (block * groups + g) * group_bytes;
        const T* params = scales + (block * groups + g) * planes * kBlockOutputs + lane;
        for (int64_t k = 0; k < kGroup; ++k) {
          float q, scale, zero = 0.f;
          if (int4) {  // chunk k / 4, in the split layout or the one of pairs
            const uint8_t byte = split ? chunks[32 * (k / 4) + 4 * (lane % 8) + k % 4]
                                       : chunks[32 * (k / 4) + 2 * lane + k % 2];
            const bool high = split ? lane >= 8 : k % 4 >= 2;
            q = static_cast<float>((high ? byte >> 4 : byte & 15) - 8);
            scale = static_cast<float>(params[0]);
            zero = static_cast<float>(params[kBlockOutputs]);
          } else {  // chunk k / 2 holds inputs 2p and 2p + 1
            q = static_cast<float>(chunks[32 * (k / 2) + 2 * lane + k % 2] - 128);
            const int64_t plane = layout == Scales::kQ8Halves ? k / 16 : 0;
            scale = static_cast<float>(params[plane * kBlockOutputs]);
            if (layout == Scales::kQ8Zeros) zero = static_cast<float>(params[kBlockOutputs]);
          }
          volatile float product = q * scale;  // rounded here, as torch's multiply rounds it
          const float value = product;
          row[g * kGroup + k] = static_cast<T>(with_zeros ? value + zero : value);
        }
      }
    }
  });
}

at::Tensor quantized_rows(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& ids,
                          bool zeros) {
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() && weight.scalar_type() == at::kByte &&
                  (weight.size(2) == 8 || weight.size(2) == 16) && weight.size(3) == 32,
              "quantized_rows: weight must be contiguous uint8 [out / 16, in / 32, 8 or 16, 32]");
  const bool int4 = weight.size(2) == 8;
  const int64_t blocks = weight.size(0), groups = weight.size(1);
  const bool pairs = scales.dim() == 4;
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == blocks && scales.size(1) == groups &&
                  scales.size(-1) == kBlockOutputs && (!pairs || scales.size(2) == 2) &&
                  (pairs || scales.dim() == 3) && (pairs || !int4) && (!zeros || pairs),
              "quantized_rows: scales must be contiguous [out / 16, in / 32, 2, 16] (int4 codes, "
              "or int8 codes with zeros or a scale per 16 inputs) or [out / 16, in / 32, 16]");
  TORCH_CHECK(ids.dim() == 1 && !ids.is_floating_point(), "quantized_rows: ids must be 1-D integers");
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t out_features = blocks * kBlockOutputs;
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows.numel(); ++n) {
    TORCH_CHECK(row_ids[n] >= 0 && row_ids[n] < out_features, "quantized_rows: ids must lie in [0, ",
                out_features, "), got ", row_ids[n]);
  }
  const Scales layout = int4     ? Scales::kInt4
                        : !pairs ? Scales::kQ8
                        : zeros  ? Scales::kQ8Zeros
                                 : Scales::kQ8Halves;
  auto out = at::empty({rows.numel(), groups * kGroup}, scales.options());
  const llmrpc_cpu::KernelThreadsScope threads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scales.scalar_type(), "quantized_rows", [&] {
    dequantized_rows<scalar_t>(weight.data_ptr<uint8_t>(), scales.data_ptr<scalar_t>(), row_ids,
                               rows.numel(), groups, layout, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales_zeros, int tiles_from=0) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor weight, Tensor scales, bool zeros=False, int tiles_from=0) "
        "-> Tensor");
  m.def("quantized_rows(Tensor weight, Tensor scales, Tensor ids, bool zeros=False) -> Tensor");
  m.def("int4_linear_supported() -> bool", &supported);
  m.def("int4_tiles_supported() -> bool", &tiles_supported);
  m.def("int4_split_nibbles() -> bool", &split_nibbles);
}

TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("quantized_rows", &quantized_rows);
}

// Group-wise int4 weights times bfloat16 activations on the CPU: y = x W^T, with
// W[n, k] = (u[n, k] - 8) * scale[n, g] + zero[n, g] for the group g = k / 32 of 32 inputs.
//
// Weight layout (packed by engine/quantization.py, `Int4Linear`): outputs in blocks of 16, each
// block's inputs in groups of 32, each group 256 bytes: 8 chunks of 32 bytes, chunk c covering
// inputs 4c..4c+3 of the group. Byte j of a chunk holds output j / 2 of the block: its low nibble
// the code for input 4c + j % 2, its high nibble the code for input 4c + 2 + j % 2. So the low
// (and the high) nibbles of a chunk, widened to 16 bits, are 16 outputs x 2 inputs in the order
// AVX512-BF16's dot product takes them. Scales and zeros: [blocks, groups, 2, 16] (scale, zero
// of the block's 16 outputs), in bfloat16.
//
// Per group the kernel sums x * (128 + u) in float32 (a code widened to 16 bits and or-ed with
// 0x4300 is the bfloat16 of 128 + u; its products with bfloat16 inputs are exact in float32),
// then adds scale * that sum + (zero - 136 * scale) * (sum of the group's inputs): the same
// float32 terms in the same order whatever the number of rows, so a row's output does not
// depend on the rows beside it.
//
// The same kernel computes GGUF's Q8_0 (W[n, k] = d[n, g] * q[n, k], q int8): each group 512
// bytes, 16 chunks of 32, chunk p covering inputs 2p and 2p + 1 of the group, byte j holding
// q + 128 for output j / 2 and input 2p + j % 2 (widened to float32 then bfloat16: exact); the
// scales [blocks, groups, 16]; per group it adds d * sum(x * (q + 128)) - 128 * d * sum(x).
//
// Registered as torch.ops.llmrpc_cpu.int4_linear and q8_linear; int4_linear_supported() says
// whether this build has the AVX512-BF16 kernels (elsewhere the engine keeps torch's kernels).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockOutputs = 16;
constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = kBlockOutputs * kGroup / 2;  // int4; Q8_0 twice that
constexpr int kMaxRows = 12;  // rows computed together: each unpacked weight serves all of them

#if defined(__AVX512BF16__)
inline __m512 load_bf16x16(const at::BFloat16* values) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 32 bytes as 32 bfloat16 of their unsigned values (exact: at most 255).
inline __m512i bytes_to_bf16(const uint8_t* bytes) {
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16));
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
}

inline __m512bh broadcast_pair(const at::BFloat16* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// Outputs of one block of 16 for R rows (x: R rows of `ldx`; sums: R rows of `groups`), int4
// or Q8_0 weights. Each row sums a group's inputs 4c, 4c + 1 and 4c + 2, 4c + 3 in two registers
// (two dependency chains of 8 dot products, not one of 16); the running totals, touched once a
// group, live in memory.
template <int R, bool kQ8>
void block_rows(const uint8_t* weight, const at::BFloat16* scales, const at::BFloat16* x,
                int64_t ldx, const float* sums, int64_t groups, at::BFloat16* y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i bias = _mm512_set1_epi16(0x4300);
  const __m512 offset = _mm512_set1_ps(kQ8 ? 128.f : 136.f);
  constexpr int64_t kBytes = kQ8 ? 2 * kGroupBytes : kGroupBytes;
  constexpr int64_t kScales = kQ8 ? kBlockOutputs : 2 * kBlockOutputs;
  alignas(64) float total[R][kBlockOutputs];
  for (int r = 0; r < R; ++r) _mm512_store_ps(total[r], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunks = weight + g * kBytes;
    __m512 low_sum[R], high_sum[R];
    for (int r = 0; r < R; ++r) low_sum[r] = high_sum[r] = _mm512_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      __m512i low, high;  // the weights of inputs 4c, 4c + 1 and of 4c + 2, 4c + 3
      if constexpr (kQ8) {
        low = bytes_to_bf16(chunks + 64 * c);
        high = bytes_to_bf16(chunks + 64 * c + 32);
      } else {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c));
        low = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low4)), bias);
        high = _mm512_or_si512(
            _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4)), bias);
      }
      for (int r = 0; r < R; ++r) {
        const at::BFloat16* inputs = x + r * ldx + g * kGroup + 4 * c;
        low_sum[r] = _mm512_dpbf16_ps(low_sum[r], reinterpret_cast<__m512bh>(low),
                                      broadcast_pair(inputs));
        high_sum[r] = _mm512_dpbf16_ps(high_sum[r], reinterpret_cast<__m512bh>(high),
                                       broadcast_pair(inputs + 2));
      }
    }
    const __m512 scale = load_bf16x16(scales + g * kScales);
    // int4: zero - 136 * scale; Q8_0: -128 * d
    const __m512 zero = kQ8 ? _mm512_setzero_ps() : load_bf16x16(scales + g * kScales + kBlockOutputs);
    const __m512 shift = _mm512_fnmadd_ps(offset, scale, zero);
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_fmadd_ps(_mm512_add_ps(low_sum[r], high_sum[r]), scale,
                                   _mm512_load_ps(total[r]));
      sum = _mm512_fmadd_ps(shift, _mm512_set1_ps(sums[r * groups + g]), sum);
      _mm512_store_ps(total[r], sum);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(total[r]))));
  }
}

template <int R, bool kQ8>
void rows_of_block(const uint8_t* weight, const at::BFloat16* scales, const at::BFloat16* x,
                   int64_t ldx, const float* sums, int64_t groups, at::BFloat16* y, int64_t ldy,
                   int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) {
      rows_of_block<R - 1, kQ8>(weight, scales, x, ldx, sums, groups, y, ldy, rows);
      return;
    }
  }
  block_rows<R, kQ8>(weight, scales, x, ldx, sums, groups, y, ldy);
}

template <bool kQ8>
void blocked_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                    at::Tensor& y) {
  const int64_t rows = x.size(0), blocks = weight.size(0), groups = weight.size(1);
  // The sum of each row's inputs over each group, in float32 and input order.
  auto sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  float* group_sums = sums.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) {
        total += static_cast<float>(xs[(r * groups + g) * kGroup + k]);
      }
      group_sums[r * groups + g] = total;
    }
  }
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::BFloat16* sc = scales.data_ptr<at::BFloat16>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const int64_t ldx = groups * kGroup, ldy = blocks * kBlockOutputs;
  const int64_t block_bytes = groups * (kQ8 ? 2 : 1) * kGroupBytes;
  const int64_t block_scales = groups * (kQ8 ? 1 : 2) * kBlockOutputs;
  // rows in tiles of near-equal size (16 rows: 8 + 8, not 12 + 4)
  const int64_t num_tiles = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t tile = (rows + num_tiles - 1) / std::max<int64_t>(num_tiles, 1);
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < rows; r += tile) {
        rows_of_block<kMaxRows, kQ8>(w + b * block_bytes, sc + b * block_scales, xs + r * ldx,
                                     ldx, group_sums + r * groups, groups,
                                     out + r * ldy + b * kBlockOutputs, ldy,
                                     std::min<int64_t>(tile, rows - r));
      }
    }
  });
}
#endif

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Checks the layouts the kernel reads (each message names the tensor and its shape), then runs it.
template <bool kQ8>
at::Tensor checked_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const char* name = kQ8 ? "q8_linear" : "int4_linear";
  const int64_t chunks = kQ8 ? 16 : 8;
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() && weight.scalar_type() == at::kByte &&
              weight.size(2) == chunks && weight.size(3) == 32,
              name, ": weight must be contiguous uint8 [out / 16, in / 32, ", chunks, ", 32]");
  TORCH_CHECK(supported(), name, ": this build has no AVX512-BF16 kernel");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, name,
              ": x must be a contiguous [rows, in_features] bfloat16 tensor");
  const int64_t blocks = weight.size(0), groups = weight.size(1);
  TORCH_CHECK(x.size(1) == groups * kGroup, name, ": x has ", x.size(1),
              " features, the weight takes ", groups * kGroup);
  const std::vector<int64_t> shape = kQ8 ? std::vector<int64_t>{blocks, groups, kBlockOutputs}
                                         : std::vector<int64_t>{blocks, groups, 2, kBlockOutputs};
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kBFloat16 &&
              scales.sizes() == at::IntArrayRef(shape),
              name, kQ8 ? ": scales must be contiguous bfloat16 [out / 16, in / 32, 16]"
                        : ": scales_zeros must be contiguous bfloat16 [out / 16, in / 32, 2, 16]");
  auto y = at::empty({x.size(0), blocks * kBlockOutputs}, x.options());
#if defined(__AVX512BF16__)
  blocked_linear<kQ8>(x, weight, scales, y);
#endif
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& scales_zeros) {
  return checked_linear<false>(x, weight, scales_zeros);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  return checked_linear<true>(x, weight, scales);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales_zeros) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int4_linear_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("q8_linear", &q8_linear);
}

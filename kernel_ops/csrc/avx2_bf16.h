// bfloat16 loads and stores in AVX2 registers, for the kernels' AVX2 paths (bf16_linear.cpp's
// fused multiply-add kernel, int4_linear.cpp's integer dot products): AVX2 has no bfloat16
// instructions, so both are done on the bits.
#pragma once

#if defined(__AVX2__)
#include <ATen/ATen.h>
#include <immintrin.h>

namespace llmrpc_cpu {

// 8 floats rounded to nearest even bfloat16 (NaN to the quiet NaN), as c10::BFloat16 rounds.
inline __m128i round_to_bf16(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

// 8 bfloat16 as floats (exact).
inline __m256 load_bf16x8(const at::BFloat16* values) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

}  // namespace llmrpc_cpu
#endif

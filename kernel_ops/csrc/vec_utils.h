// Float32 vector loads and stores of float32, bfloat16 and float16 data for the engine's CPU
// kernels, on ATen's Vectorized<float> (AVX-512, AVX2 or plain C++, as the build selects).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace llmrpc_cpu {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline Vec load_float(const T* data) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(data);
  } else {
    Vec out;
    at::vec::load_to_float<T>(data, out);
    return out;
  }
}

// Stores Vec::size() values (fewer with count), rounded to T.
template <typename T>
inline void store_float(T* data, const Vec& values, int64_t count = Vec::size()) {
  if constexpr (std::is_same_v<T, float>) {
    values.store(data, count);
  } else {
    at::vec::convert_from_float<T>(values, values).store(data, count);
  }
}

// Stores 2 * Vec::size() values, rounded to T: a whole vector of T where T is 16 bits wide (a
// partial store of one goes through a temporary buffer, several times slower).
template <typename T>
inline void store_float2(T* data, const Vec& first, const Vec& second) {
  if constexpr (std::is_same_v<T, float>) {
    first.store(data);
    second.store(data + Vec::size());
  } else {
    at::vec::convert_from_float<T>(first, second).store(data);
  }
}

// The sum and the largest of a vector's lanes (the plain C++ Vectorized's own reduce_add and
// reduce_max do not compile in torch 2.13's headers).
inline float sum_lanes(const Vec& values) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return values.reduce_add();
#else
  float lanes[Vec::size()];
  values.store(lanes);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
#endif
}

inline float max_lanes(const Vec& values) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return values.reduce_max();
#else
  float lanes[Vec::size()];
  values.store(lanes);
  float top = lanes[0];
  for (float lane : lanes) top = lane > top ? lane : top;
  return top;
#endif
}

// The value T holds for each lane (the rounding an operation in T applies).
template <typename T>
inline Vec round_to(const Vec& values) {
  if constexpr (std::is_same_v<T, float>) {
    return values;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(values, values)));
  }
}

}  // namespace llmrpc_cpu

// Runs the statement with scalar_t the C++ type of a float32, bfloat16 or float16 tensor's dtype;
// any other dtype is refused, naming the operation.
#define LLMRPC_DISPATCH(dtype, name, ...)                                                   \
  switch (dtype) {                                                                          \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                        \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; }              \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }                      \
    default: TORCH_CHECK(false, name ": dtype must be float32, bfloat16 or float16");      \
  }


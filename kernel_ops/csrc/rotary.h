// Rotate-half rotary embedding of one head, shared by the rotary kernel (elementwise.cpp) and the
// fused decode attention (decode_attention.cpp), so both round alike.
#pragma once

#include "vec_utils.h"

namespace llmrpc_cpu {

// out = round(round(x * cos) + round(rotate_half(x) * sin)) over one head of head_dim values:
// the first half x_lo * cos - x_hi * sin, the second x_hi * cos + x_lo * sin. cos and sin hold
// head_dim values each. out may be x (each pair of values is read before either is written).
template <typename T>
inline void rotate_head(const T* x, T* out, const T* c, const T* s, int64_t head_dim) {
  constexpr int64_t kV = Vec::size();
  const int64_t half = head_dim / 2;
  const auto rotated_lo = [&](int64_t at) {
    return round_to<T>(load_float(x + at) * load_float(c + at)) +
           round_to<T>(load_float(x + half + at).neg() * load_float(s + at));
  };
  const auto rotated_hi = [&](int64_t at) {
    return round_to<T>(load_float(x + half + at) * load_float(c + half + at)) +
           round_to<T>(load_float(x + at) * load_float(s + half + at));
  };
  int64_t i = 0;
  if (half % (2 * kV) == 0) {
    for (; i < half; i += 2 * kV) {
      const Vec lo0 = rotated_lo(i), lo1 = rotated_lo(i + kV);
      const Vec hi0 = rotated_hi(i), hi1 = rotated_hi(i + kV);
      store_float2(out + i, lo0, lo1);
      store_float2(out + half + i, hi0, hi1);
    }
  } else if (half % kV == 0) {
    for (; i < half; i += kV) {
      const Vec lo = rotated_lo(i), hi = rotated_hi(i);
      store_float(out + i, lo);
      store_float(out + half + i, hi);
    }
  }
  for (; i < half; ++i) {
    const float lo = static_cast<float>(x[i]), hi = static_cast<float>(x[half + i]);
    const auto rnd = [](float v) { return static_cast<float>(static_cast<T>(v)); };
    const float new_lo = rnd(lo * static_cast<float>(c[i])) + rnd(-hi * static_cast<float>(s[i]));
    const float new_hi = rnd(hi * static_cast<float>(c[half + i])) + rnd(lo * static_cast<float>(s[half + i]));
    out[i] = static_cast<T>(new_lo);
    out[half + i] = static_cast<T>(new_hi);
  }
}

}  // namespace llmrpc_cpu

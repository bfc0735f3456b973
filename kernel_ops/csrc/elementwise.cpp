// Fused elementwise operations of a decoder layer on the CPU, each one pass over its rows where
// the torch path takes 3 to 8 operations. Each rounds where the torch path rounds (after every
// operation torch runs in the model's dtype), so in float32 they agree to float rounding and in
// bfloat16/float16 to the last bit in almost every element.
//
// Registered as torch.ops.llmrpc_cpu.{rms_norm,fused_add_rms_norm,silu_and_mul,rotary}, and
// row_max (the greedy sampler's), with
// parallel_team_size: how many threads at::parallel_for, which every kernel here divides its work
// with, runs on (1 when the extension was built without OpenMP, whatever torch was told), and
// set_kernel_threads / kernel_team_size: our kernels' own count (kernel_threads.h), which these
// take too.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "kernel_threads.h"
#include "rotary.h"
#include "vec_utils.h"

namespace llmrpc_cpu {
namespace {

constexpr int64_t kV = Vec::size();

inline int64_t rows_of(const at::Tensor& x) {
  return x.numel() / x.size(-1);
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)), the mean in float32 (as the torch path).
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t hidden, float eps) {
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + kV <= hidden; i += kV) {
    const Vec v = load_float(x + i);
    sum = at::vec::fmadd(v, v, sum);
  }
  float total = sum_lanes(sum);
  for (; i < hidden; ++i) total += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float factor = 1.f / std::sqrt(total / static_cast<float>(hidden) + eps);
  const Vec scale(factor);
  for (i = 0; i + 2 * kV <= hidden; i += 2 * kV) {
    const Vec first = load_float(weight + i) * round_to<T>(load_float(x + i) * scale);
    const Vec second = load_float(weight + i + kV) * round_to<T>(load_float(x + i + kV) * scale);
    store_float2(out + i, first, second);
  }
  for (; i + kV <= hidden; i += kV) {
    const Vec normed = round_to<T>(load_float(x + i) * scale);
    store_float(out + i, load_float(weight + i) * normed);
  }
  for (; i < hidden; ++i) {
    const float normed = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * factor));
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t hidden = x.size(-1);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows_of(x), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(src + r * hidden, w, dst + r * hidden, hidden, static_cast<float>(eps));
    }
  });
}

// residual = round(x + residual); x = rms_norm(residual) (in place, as the decoder layer needs).
template <typename T>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             double eps) {
  const int64_t hidden = x.size(-1);
  T* xs = x.data_ptr<T>();
  T* res = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows_of(x), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xs + r * hidden;
      T* rr = res + r * hidden;
      int64_t i = 0;
      for (; i + 2 * kV <= hidden; i += 2 * kV) {
        store_float2(rr + i, load_float(xr + i) + load_float(rr + i),
                     load_float(xr + i + kV) + load_float(rr + i + kV));
      }
      for (; i + kV <= hidden; i += kV) store_float(rr + i, load_float(xr + i) + load_float(rr + i));
      for (; i < hidden; ++i) rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
      norm_row(rr, w, xr, hidden, static_cast<float>(eps));
    }
  });
}

// out = round(silu(gate)) * up for x = [gate | up] along the last dimension.
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t width = out.size(-1);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const Vec one(1.f);
  at::parallel_for(0, rows_of(out), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * 2 * width;
      const T* up = gate + width;
      T* o = dst + r * width;
      const auto silu_times_up = [&](int64_t at) {
        const Vec g = load_float(gate + at);
        // exp to 1 ulp in float32; a 16-bit result rounds the 20-ulp polynomial's error away
        const Vec e = std::is_same_v<T, float> ? g.neg().exp() : g.neg().exp_u20();
        return round_to<T>(g / (one + e)) * load_float(up + at);
      };
      int64_t i = 0;
      for (; i + 2 * kV <= width; i += 2 * kV) store_float2(o + i, silu_times_up(i), silu_times_up(i + kV));
      for (; i + kV <= width; i += kV) store_float(o + i, silu_times_up(i));
      for (; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float silu = static_cast<float>(static_cast<T>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<T>(silu * static_cast<float>(up[i]));
      }
    }
  });
}

// In place, x[t, h] = round(round(x * cos) + round(rotate_half(x) * sin)) for x [tokens, heads,
// head_dim] (rows of heads dense, tokens at any stride) and cos/sin [tokens, head_dim] dense.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t token_stride = x.stride(0);
  T* base = x.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = sin.data_ptr<T>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        T* row = base + t * token_stride + h * head_dim;
        rotate_head(row, row, cos_base + t * head_dim, sin_base + t * head_dim, head_dim);
      }
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), name, ": tensors must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), name,
              ": weight must have one value per element of the last dimension");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight and input must share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = at::empty_like(x);
  const KernelThreadsScope threads;  // the heavy kernels' count where one is set
  LLMRPC_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(x, weight, eps, out));
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
              residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must be contiguous and match the input");
  const KernelThreadsScope threads;  // the heavy kernels' count where one is set
  LLMRPC_DISPATCH(x.scalar_type(), "fused_add_rms_norm",
                  fused_add_rms_norm_impl<scalar_t>(x, residual, weight, eps));
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0,
              "silu_and_mul: input must be contiguous with an even last dimension");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, x.options());
  const KernelThreadsScope threads;  // the heavy kernels' count where one is set
  LLMRPC_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(x, out));
  return out;
}

void rotary(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary: x must be [tokens, heads, head_dim] with dense rows of heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
              sin.sizes() == cos.sizes(), "rotary: cos and sin must be dense [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos, sin and x must share a dtype");
  const KernelThreadsScope threads;  // the heavy kernels' count where one is set
  LLMRPC_DISPATCH(x.scalar_type(), "rotary", rotary_impl<scalar_t>(x, cos, sin));
}

// Each row's largest value and the first index holding it, for [rows, width] float32 (greedy
// sampling's choice, as torch.max(dim=-1) gives it); a row holding NaN gives NaN and the index
// `width`. torch's max with indices walks a row one element at a time: 52 us for one row of
// 49152 (one thread, AMD EPYC family 25), where this takes 11-13 us (the chunked torch path 80).
std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& values) {
  TORCH_CHECK(values.dim() == 2 && values.is_contiguous() && values.scalar_type() == at::kFloat,
              "row_max: values must be contiguous [rows, width] float32");
  const int64_t rows = values.size(0), width = values.size(1);
  TORCH_CHECK(width > 0, "row_max: rows must hold at least one value");
  auto best = at::empty({rows}, values.options());
  auto index = at::empty({rows}, values.options().dtype(at::kLong));
  const float* data = values.data_ptr<float>();
  float* best_out = best.data_ptr<float>();
  int64_t* index_out = index.data_ptr<int64_t>();
  const KernelThreadsScope threads;  // the heavy kernels' count where one is set
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = data + r * width;
      // four running maxima (one would wait on each maximum before the next), NaN kept
      Vec top[4] = {Vec(-std::numeric_limits<float>::infinity()), top[0], top[0], top[0]};
      int64_t j = 0;
      for (; j + 4 * kV <= width; j += 4 * kV) {
        for (int k = 0; k < 4; ++k) top[k] = at::vec::maximum(top[k], Vec::loadu(x + j + k * kV));
      }
      for (; j + kV <= width; j += kV) top[0] = at::vec::maximum(top[0], Vec::loadu(x + j));
      float lanes[4 * kV];
      for (int k = 0; k < 4; ++k) top[k].store(lanes + k * kV);
      float peak = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (float lane : lanes) {
        nan |= std::isnan(lane);
        peak = lane > peak ? lane : peak;
      }
      for (; j < width; ++j) {
        nan |= std::isnan(x[j]);
        peak = x[j] > peak ? x[j] : peak;
      }
      best_out[r] = nan ? std::numeric_limits<float>::quiet_NaN() : peak;
      int64_t first = width;
      if (!nan) {
        const Vec wanted(peak);
        for (j = 0; j + kV <= width && first == width; j += kV) {
          const int equal = ~(Vec::loadu(x + j) == wanted).zero_mask() & ((1 << kV) - 1);
          if (equal != 0) first = j + __builtin_ctz(equal);
        }
        for (; j < width && first == width; ++j) {
          if (x[j] == peak) first = j;
        }
      }
      index_out[r] = first;
    }
  });
  return {best, index};
}

}  // namespace
}  // namespace llmrpc_cpu

namespace llmrpc_cpu {
namespace {

int64_t parallel_team_size() {
  const int64_t threads = at::get_num_threads();
  std::vector<std::atomic<bool>> ran(threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { ran[at::get_thread_num()] = true; });
  int64_t count = 0;
  for (const auto& flag : ran) count += flag;
  return count;
}

// The team a heavy kernel (kernel_threads.h) would run on now.
int64_t kernel_team_size() {
  const KernelThreadsScope threads;
  return parallel_team_size();
}

void set_kernel_threads(int64_t count) {
  TORCH_CHECK(count >= 0, "set_kernel_threads: count must be 0 (torch's) or more, got ", count);
  kernel_threads().store(count, std::memory_order_relaxed);
}

}  // namespace
}  // namespace llmrpc_cpu

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("parallel_team_size() -> int", &llmrpc_cpu::parallel_team_size);
  m.def("kernel_team_size() -> int", &llmrpc_cpu::kernel_team_size);
  m.def("set_kernel_threads(int count) -> ()", &llmrpc_cpu::set_kernel_threads);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("row_max(Tensor values) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) {
  m.impl("rms_norm", &llmrpc_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &llmrpc_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &llmrpc_cpu::silu_and_mul);
  m.impl("rotary", &llmrpc_cpu::rotary);
  m.impl("row_max", &llmrpc_cpu::row_max);
}

// One Llama-family decoder layer of a decodes-only step in one call: the input norm (with the
// residual add), the qkv projection, rotary, the KV store and attention, the output projection,
// the post-attention norm, the gate and up projection, SiLU and the down projection. Each part is
// the kernel the layer's Python calls in turn (called here through the dispatcher, so a profile
// still shows them), with the same bits; what the call saves is the Python between them: eight
// module calls and eight operation calls a layer.
//
// Registered as torch.ops.llmrpc_cpu.decode_layer; kernel_ops/layer.py describes each linear
// layer to it and engine/models/llama.py decides when a layer takes it.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "kernel_threads.h"

namespace {

// What the ints of one linear layer hold (kernel_ops/layer.py writes them): its kind, then the
// kind's arguments.
constexpr int64_t kInt4 = 0, kQ8 = 1, kBf16 = 2, kPacked = 3;
constexpr int64_t kMeta = 9;     // kind, tiles_from, zeros, then bf16_linear's 6 kernels by bucket
constexpr int64_t kTensors = 3;  // weight, scales, bias
constexpr int64_t kLinears = 4;  // qkv, o, gate_up, down

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Optional = std::optional<at::Tensor>;

at::Tensor linear(const at::Tensor& x, const c10::List<Optional>& tensors, at::IntArrayRef meta,
                  int64_t index) {
  static const auto int4 = handle<at::Tensor(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, int64_t)>("llmrpc_cpu::int4_linear");
  static const auto q8 = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           bool, int64_t)>("llmrpc_cpu::q8_linear");
  static const auto bf16 = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&,
                                             at::IntArrayRef)>("llmrpc_cpu::bf16_linear");
  static const auto packed = handle<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const Optional&)>("llmrpc_cpu::packed_linear");
  const at::IntArrayRef m = meta.slice(index * kMeta, kMeta);
  const Optional weight = tensors.get(index * kTensors);
  const Optional scales = tensors.get(index * kTensors + 1);
  const Optional bias = tensors.get(index * kTensors + 2);
  TORCH_CHECK(weight.has_value(), "decode_layer: linear layer ", index, " has no weight");
  const int64_t kind = m[0];
  if (kind == kBf16) {
    const at::IntArrayRef kernels = m[3] < 0 ? at::IntArrayRef() : m.slice(3, 6);
    return bf16.call(x, *weight, bias, kernels);
  }
  if (kind == kPacked) return packed.call(x, *weight, bias);
  TORCH_CHECK(kind == kInt4 || kind == kQ8, "decode_layer: linear layer ", index, " has kind ",
              kind, ", none of 0 (int4), 1 (q8), 2 (bf16 blocks), 3 (oneDNN packed)");
  TORCH_CHECK(scales.has_value(), "decode_layer: linear layer ", index, " has no scales");
  at::Tensor y = kind == kInt4 ? int4.call(x, *weight, *scales, m[1])
                               : q8.call(x, *weight, *scales, m[2] != 0, m[1]);
  if (bias.has_value()) y.add_(*bias);  // as QuantizedLinear adds it after the packed call
  return y;
}

at::Tensor decode_layer(const at::Tensor& hidden, at::Tensor& residual, bool first,
                        const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                        const c10::List<Optional>& linears, at::IntArrayRef meta,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_heads, double scale) {
  static const auto rms_norm =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("llmrpc_cpu::rms_norm");
  static const auto add_rms_norm = handle<void(at::Tensor&, at::Tensor&, const at::Tensor&,
                                               double)>("llmrpc_cpu::fused_add_rms_norm");
  static const auto silu_and_mul =
      handle<at::Tensor(const at::Tensor&)>("llmrpc_cpu::silu_and_mul");
  static const auto attention =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                        at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        int64_t, double)>("llmrpc_cpu::decode_attention_qkv");
  TORCH_CHECK(static_cast<int64_t>(linears.size()) == kLinears * kTensors &&
                  static_cast<int64_t>(meta.size()) == kLinears * kMeta,
              "decode_layer: linears must hold ", kLinears * kTensors, " tensors and meta ",
              kLinears * kMeta, " ints (qkv, o, gate_up, down)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && residual.sizes() == hidden.sizes() &&
                  residual.is_contiguous() && residual.scalar_type() == hidden.scalar_type(),
              "decode_layer: hidden and residual must be dense [tokens, hidden] of one dtype");
  const llmrpc_cpu::KernelThreadsScope threads;
  at::Tensor x;
  if (first) {  // the first layer starts the residual stream
    residual.copy_(hidden);
    x = rms_norm.call(hidden, input_norm, eps);
  } else {  // the add writes both: hidden, an input here, stays as it was
    x = hidden.clone();
    add_rms_norm.call(x, residual, input_norm, eps);
  }
  const at::Tensor qkv = linear(x, linears, meta, 0);
  const at::Tensor heads = attention.call(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                          block_tables, seq_lens, num_heads, scale);
  at::Tensor o = linear(heads.view({hidden.size(0), -1}), linears, meta, 1);
  add_rms_norm.call(o, residual, post_norm, eps);
  const at::Tensor gate_up = linear(o, linears, meta, 2);
  return linear(silu_and_mul.call(gate_up), linears, meta, 3);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("decode_layer(Tensor hidden, Tensor(a!) residual, bool first, Tensor input_norm, "
        "Tensor post_norm, float eps, Tensor?[] linears, int[] meta, Tensor cos, Tensor sin, "
        "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, int num_heads, float scale) -> Tensor");
}

// oneDNN's packed weights are MKLDNN tensors: the call dispatches on their key or on hidden's.
TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
TORCH_LIBRARY_IMPL(llmrpc_cpu, MkldnnCPU, m) { m.impl("decode_layer", &decode_layer); }

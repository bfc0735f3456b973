// One Llama-family decoder layer of a decodes-only step in one call: the input norm (with the
// residual add), the qkv projection, rotary, the KV store and attention, the output projection,
// the post-attention norm, the gate and up projection, SiLU and the down projection. Each part is
// the kernel the layer's Python calls in turn (called here through the dispatcher, so a profile
// still shows them), with the same bits; what the call saves is the Python between them: eight
// module calls and eight operation calls a layer.
//
// Registered as torch.ops.llmrpc_cpu.decode_layer, and decode_layers for all of a model's layers in
// one call; kernel_ops/layer.py describes each linear layer to them and engine/models/llama.py
// decides when a layer, or the whole stack, takes them.

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

// What every layer of a step shares: rotary's cos and sin, where the step's rows go in the caches,
// the sequences' blocks and lengths, and the attention's heads and scale.
struct Step {
  const at::Tensor &cos, &sin, &slot_mapping, &block_tables, &seq_lens;
  int64_t num_heads;
  double scale;
};

// A layer after its input norm (x: the normed rows): attention, the output projection, the
// post-attention add and norm, and the MLP; its linear layers are `linears` and `meta`'s
// `layer`-th four.
at::Tensor layer_after_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& post_norm,
                            double eps, const c10::List<Optional>& linears, at::IntArrayRef meta,
                            int64_t layer, at::Tensor& key_cache, at::Tensor& value_cache,
                            const Step& step) {
  static const auto add_rms_norm = handle<void(at::Tensor&, at::Tensor&, const at::Tensor&,
                                               double)>("llmrpc_cpu::fused_add_rms_norm");
  static const auto silu_and_mul =
      handle<at::Tensor(const at::Tensor&)>("llmrpc_cpu::silu_and_mul");
  static const auto attention =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                        at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        int64_t, double)>("llmrpc_cpu::decode_attention_qkv");
  const int64_t first = layer * kLinears;
  const at::Tensor qkv = linear(x, linears, meta, first);
  const at::Tensor heads =
      attention.call(qkv, step.cos, step.sin, key_cache, value_cache, step.slot_mapping,
                     step.block_tables, step.seq_lens, step.num_heads, step.scale);
  at::Tensor o = linear(heads.view({x.size(0), -1}), linears, meta, first + 1);
  add_rms_norm.call(o, residual, post_norm, eps);
  const at::Tensor gate_up = linear(o, linears, meta, first + 2);
  return linear(silu_and_mul.call(gate_up), linears, meta, first + 3);
}

// The input norm: on the first layer it starts the residual stream from `hidden`; on a later one
// it adds `hidden` into the stream, writing both (hence a copy where the caller keeps `hidden`).
at::Tensor input_norm(const at::Tensor& hidden, bool owned, at::Tensor& residual, bool first,
                      const at::Tensor& weight, double eps) {
  static const auto rms_norm =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("llmrpc_cpu::rms_norm");
  static const auto add_rms_norm = handle<void(at::Tensor&, at::Tensor&, const at::Tensor&,
                                               double)>("llmrpc_cpu::fused_add_rms_norm");
  if (first) {
    residual.copy_(hidden);
    return rms_norm.call(hidden, weight, eps);
  }
  at::Tensor x = owned ? hidden : hidden.clone();
  add_rms_norm.call(x, residual, weight, eps);
  return x;
}

void check_rows(const at::Tensor& hidden, const at::Tensor& residual, const char* name) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && residual.sizes() == hidden.sizes() &&
                  residual.is_contiguous() && residual.scalar_type() == hidden.scalar_type(),
              name, ": hidden and residual must be dense [tokens, hidden] of one dtype");
}

at::Tensor decode_layer(const at::Tensor& hidden, at::Tensor& residual, bool first,
                        const at::Tensor& input_norm_weight, const at::Tensor& post_norm,
                        double eps, const c10::List<Optional>& linears, at::IntArrayRef meta,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_heads, double scale) {
  TORCH_CHECK(static_cast<int64_t>(linears.size()) == kLinears * kTensors &&
                  static_cast<int64_t>(meta.size()) == kLinears * kMeta,
              "decode_layer: linears must hold ", kLinears * kTensors, " tensors and meta ",
              kLinears * kMeta, " ints (qkv, o, gate_up, down)");
  check_rows(hidden, residual, "decode_layer");
  const llmrpc_cpu::KernelThreadsScope threads;
  const Step step{cos, sin, slot_mapping, block_tables, seq_lens, num_heads, scale};
  const at::Tensor x = input_norm(hidden, false, residual, first, input_norm_weight, eps);
  return layer_after_norm(x, residual, post_norm, eps, linears, meta, 0, key_cache, value_cache,
                          step);
}

// Every layer of a model in turn, as decode_layer runs one (norms: each layer's input and
// post-attention norm weights; linears and meta: each layer's four, in order), from the first
// layer's input: (the last layer's MLP output, the residual stream before it). What it saves
// beside decode_layer is the Python of each layer's call and checks: a one-row eager step of
// SmolLM2 on one thread of an AMD EPYC (family 25, AVX2) ran 1.10x as fast in bfloat16 and 1.2x
// with -q gguf (the two calls taking turns in one process).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, at::TensorList norms, double eps, const c10::List<Optional>& linears,
    at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin, at::TensorList key_caches,
    at::TensorList value_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, int64_t num_heads, double scale) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(value_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(linears.size()) == layers * kLinears * kTensors &&
                  static_cast<int64_t>(meta.size()) == layers * kLinears * kMeta,
              "decode_layers: for ", layers, " layers (key caches) it takes ", layers,
              " value caches, ", 2 * layers, " norms, ", layers * kLinears * kTensors,
              " linear tensors and ", layers * kLinears * kMeta, " ints of meta; got ",
              value_caches.size(), ", ", norms.size(), ", ", linears.size(), " and ", meta.size());
  at::Tensor residual = at::empty_like(hidden);
  check_rows(hidden, residual, "decode_layers");
  const llmrpc_cpu::KernelThreadsScope threads;
  const Step step{cos, sin, slot_mapping, block_tables, seq_lens, num_heads, scale};
  at::Tensor out = hidden;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor x = input_norm(out, layer > 0, residual, layer == 0, norms[2 * layer], eps);
    at::Tensor key_cache = key_caches[layer], value_cache = value_caches[layer];
    out = layer_after_norm(x, residual, norms[2 * layer + 1], eps, linears, meta, layer,
                           key_cache, value_cache, step);
  }
  return {out, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("decode_layer(Tensor hidden, Tensor(a!) residual, bool first, Tensor input_norm, "
        "Tensor post_norm, float eps, Tensor?[] linears, int[] meta, Tensor cos, Tensor sin, "
        "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, int num_heads, float scale) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor[] norms, float eps, Tensor?[] linears, int[] meta, "
        "Tensor cos, Tensor sin, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, float scale) "
        "-> (Tensor, Tensor)");
}

// oneDNN's packed weights are MKLDNN tensors: the call dispatches on their key or on hidden's.
TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
}
TORCH_LIBRARY_IMPL(llmrpc_cpu, MkldnnCPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
}

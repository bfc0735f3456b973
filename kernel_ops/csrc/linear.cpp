// llmrpc_cpu::packed_linear: y = x W^T + b with W packed by mkldnn::_reorder_linear_weight
// (kernel_ops/linear.py's PackedLinear), as one operation of ours for torch.compile.
//
// Eager PackedLinear calls mkldnn::_linear_pointwise itself. Under torch.compile that cannot stay:
// inductor lowers mkldnn::_linear_pointwise only when the weight is a graph constant (freezing),
// and freezing turns off inductor's compile cache, so every start would pay the whole compile.
// Behind an operation of our own the weight stays an input of the graph, the cache works, and the
// C++ wrapper inductor generates calls this through the dispatcher without going back to Python
// (a Python custom op there made the compiled decode step slower than eager).

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernel_threads.h"

namespace llmrpc_cpu {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "packed_linear: x must be a contiguous [rows, "
              "features] matrix");
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  const KernelThreadsScope threads;  // oneDNN reads the calling thread's OpenMP team size
  return linear.call(x, packed_weight, bias, "none", c10::List<std::optional<at::Scalar>>(),
                     std::nullopt);
}

}  // namespace llmrpc_cpu

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

// The packed weight is an MKLDNN tensor: the call dispatches on its key or on x's.
TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) { m.impl("packed_linear", &llmrpc_cpu::packed_linear); }
TORCH_LIBRARY_IMPL(llmrpc_cpu, MkldnnCPU, m) {
  m.impl("packed_linear", &llmrpc_cpu::packed_linear);
}

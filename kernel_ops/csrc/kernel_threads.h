// The thread count of our kernels (linear layers, decode attention, norms, activations and
// rotary), set apart from torch's own.
//
// A compiled decode step (torch.compile) holds for the thread count it was compiled at: changing
// torch's count ends its graph. So an engine whose step is compiled keeps torch's count fixed and
// gives the idle core to these kernels alone (engine/runner/threads.py decides when): set_kernel_
// threads(n) makes each of them run its parallel loops on n threads, restoring the calling
// thread's count before it returns, so the compiled graph's guard never sees a change. 0 (the
// default) leaves them on torch's count.
#pragma once

#include <atomic>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace llmrpc_cpu {

inline std::atomic<int64_t>& kernel_threads() {
  static std::atomic<int64_t> count{0};
  return count;
}

// For the life of the scope, the calling thread's OpenMP team size (which at::parallel_for and
// oneDNN read) is kernel_threads(), where that is set.
class KernelThreadsScope {
 public:
  KernelThreadsScope() {
#ifdef _OPENMP
    const int want = static_cast<int>(kernel_threads().load(std::memory_order_relaxed));
    if (want > 0 && !omp_in_parallel()) {
      const int current = omp_get_max_threads();
      if (current != want) {
        saved_ = current;
        omp_set_num_threads(want);
      }
    }
#endif
  }
  ~KernelThreadsScope() {
#ifdef _OPENMP
    if (saved_ > 0) omp_set_num_threads(saved_);
#endif
  }
  KernelThreadsScope(const KernelThreadsScope&) = delete;
  KernelThreadsScope& operator=(const KernelThreadsScope&) = delete;

 private:
  int saved_ = 0;
};

}  // namespace llmrpc_cpu

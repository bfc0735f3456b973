// Paged prefill attention on the CPU: the query rows of one sequence's prompt chunk attend
// causally to the sequence's positions up to their own, keys and values read in place from the
// block-structured KV cache (no gathered copy, no [queries, keys] matrix).
//
// Flash-style, as torch's CPU attention computes it: for each KV head and tile of query
// positions, key chunks in turn; each chunk's scores scaled after the dot product, a running
// maximum and total per query row, the exponentials (ATen's exp_u20, as torch's flash attention
// takes them) rounded to the cache's dtype for the weighted sum of values (their float32 total
// divides it at the end), every sum in float32.
//
// A tile holds kQueries positions times the group of query heads sharing the KV head: its rows,
// laid one per vector lane (scores [key][row], output [dim][row]), so the softmax's maxima,
// totals and rescaling are lane-wise with no horizontal sums. Where the cache is bfloat16 and
// the CPU has AVX512-BF16, both products take bfloat16 pair dot products (the scores from the
// cache rows as they are, the values from pairs of key rows interleaved); elsewhere float32
// multiply-adds on the rows converted.
//
// Registered as torch.ops.llmrpc_cpu.prefill_attention; kernel_ops/attention.py calls it for the
// prompt chunks it takes (no sliding window, no logit softcap, the cache in the query's dtype)
// where kernel_ops/attention_tuning.py timed it faster than torch's scaled_dot_product_attention
// for the chunk's rows, and torch's for the rest.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernel_threads.h"
#include "vec_utils.h"

namespace {

using llmrpc_cpu::load_float;
using llmrpc_cpu::round_to;
using llmrpc_cpu::store_float;
using llmrpc_cpu::Vec;

constexpr int64_t kV = Vec::size();
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kQueries = 32;  // query positions a tile
constexpr int64_t kKeys = 64;     // keys a chunk
constexpr int kRowVecs = 2;       // row vectors a product's registers hold
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kKeyBlock = 8, kDimBlock = 8;  // 16 sums in registers of 32
#else
constexpr int kKeyBlock = 4, kDimBlock = 4;  // 8 sums in registers of 16
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kPairDots = true;
#else
constexpr bool kPairDots = false;
#endif

// One sequence's prompt chunk and where its keys and values lie.
template <typename T>
struct Chunk {
  const T* query;  // [tokens, num_heads, head_dim], rows query_stride apart
  const T* keys;
  const T* values;
  const int64_t* table;  // the sequence's blocks
  T* out;                // [tokens, num_heads, head_dim], dense
  // offset: the positions before the chunk's first row
  int64_t tokens, query_stride, num_heads, num_kv_heads, group, head_dim, block_size, offset;
  float scale;

  // key position `pos` of KV head h in a cache
  const T* row(const T* cache, int64_t pos, int64_t h) const {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    return cache + (slot * num_kv_heads + h) * head_dim;
  }
};

// A thread's buffers for one tile: R rows (kQueries positions times the group; the positions
// past the chunk's end repeat its last one and are never stored).
struct Tile {
  int64_t rows = 0;
  std::vector<float> queries;  // [head_dim][rows], or [head_dim / 2][rows] bfloat16 pairs
  std::vector<float> scores;   // [kKeys][rows]
  std::vector<float> out;      // [head_dim][rows]
  std::vector<float> keys;     // [kKeys][head_dim] as float32 (the multiply-add path)
  std::vector<float> values;   // [kKeys][head_dim] float32, or [kKeys / 2][head_dim] pairs
  std::vector<float> probs;    // [kKeys / 2][rows] bfloat16 pairs (the pair path)
  std::vector<float> position, peak, total, factor;  // per row

  void size(int64_t r, int64_t head_dim) {
    rows = r;
    queries.resize(head_dim * r);
    scores.resize(kKeys * r);
    out.resize(head_dim * r);
    keys.resize(kKeys * head_dim);
    values.resize(kKeys * head_dim);
    probs.resize(kKeys / 2 * r);
    position.resize(r);
    peak.resize(r);
    total.resize(r);
    factor.resize(r);
  }
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
inline __m512 pair_dot(__m512 sum, uint32_t pair, const float* lanes) {
  return _mm512_dpbf16_ps(sum, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair))),
                          reinterpret_cast<__m512bh>(_mm512_loadu_si512(lanes)));
}

inline uint32_t pair_at(const void* row, int64_t index) {
  uint32_t pair;
  std::memcpy(&pair, static_cast<const char*>(row) + index * 4, 4);
  return pair;
}

// scores[k][r] for keys [k0, k0 + KB) from bfloat16 key rows and queries as pairs [dp][rows].
template <int KB>
void pair_scores(const at::BFloat16* const* key_rows, const float* queries, int64_t rows,
                 int64_t r0, int64_t pairs, float* scores, int64_t k0) {
  __m512 sums[KB][kRowVecs];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < kRowVecs; ++v) sums[k][v] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < pairs; ++dp) {
    const float* q = queries + dp * rows + r0;
    for (int k = 0; k < KB; ++k) {
      const uint32_t pair = pair_at(key_rows[k0 + k], dp);
      for (int v = 0; v < kRowVecs; ++v) sums[k][v] = pair_dot(sums[k][v], pair, q + v * kV);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < kRowVecs; ++v) _mm512_storeu_ps(scores + (k0 + k) * rows + r0 + v * kV, sums[k][v]);
}

// out[d][r] = out[d][r] * rescale[r] + the probabilities' pairs [kp][rows] dotted with the
// value pairs [kp][head_dim], for dims [d0, d0 + DB).
template <int DB>
void pair_values(const float* values, const float* probs, const float* rescale, int64_t rows,
                 int64_t r0, int64_t key_pairs, int64_t head_dim, float* out, int64_t d0) {
  __m512 sums[DB][kRowVecs];
  for (int v = 0; v < kRowVecs; ++v) {
    const __m512 factor = _mm512_loadu_ps(rescale + r0 + v * kV);
    for (int d = 0; d < DB; ++d) {
      sums[d][v] = _mm512_mul_ps(_mm512_loadu_ps(out + (d0 + d) * rows + r0 + v * kV), factor);
    }
  }
  for (int64_t kp = 0; kp < key_pairs; ++kp) {
    const float* p = probs + kp * rows + r0;
    const float* value = values + kp * head_dim + d0;
    for (int d = 0; d < DB; ++d) {
      const uint32_t pair = pair_at(value, d);
      for (int v = 0; v < kRowVecs; ++v) sums[d][v] = pair_dot(sums[d][v], pair, p + v * kV);
    }
  }
  for (int d = 0; d < DB; ++d)
    for (int v = 0; v < kRowVecs; ++v) _mm512_storeu_ps(out + (d0 + d) * rows + r0 + v * kV, sums[d][v]);
}
#endif

// scores[k][r] for keys [k0, k0 + KB) from float32 keys [kKeys][head_dim] and queries
// [head_dim][rows].
template <int KB>
void float_scores(const float* keys, const float* queries, int64_t rows, int64_t r0,
                  int64_t head_dim, float* scores, int64_t k0) {
  Vec sums[KB][kRowVecs];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < kRowVecs; ++v) sums[k][v] = Vec(0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec q[kRowVecs];
    for (int v = 0; v < kRowVecs; ++v) q[v] = Vec::loadu(queries + d * rows + r0 + v * kV);
    for (int k = 0; k < KB; ++k) {
      const Vec key(keys[(k0 + k) * head_dim + d]);
      for (int v = 0; v < kRowVecs; ++v) sums[k][v] = at::vec::fmadd(key, q[v], sums[k][v]);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < kRowVecs; ++v) sums[k][v].store(scores + (k0 + k) * rows + r0 + v * kV);
}

// out[d][r] = out[d][r] * rescale[r] + sum over keys [0, n) of probs[k][r] * values[k][d], for
// dims [d0, d0 + DB).
template <int DB>
void float_values(const float* values, const float* probs, const float* rescale, int64_t rows,
                  int64_t r0, int64_t n, int64_t head_dim, float* out, int64_t d0) {
  Vec sums[DB][kRowVecs];
  for (int v = 0; v < kRowVecs; ++v) {
    const Vec factor = Vec::loadu(rescale + r0 + v * kV);
    for (int d = 0; d < DB; ++d) sums[d][v] = Vec::loadu(out + (d0 + d) * rows + r0 + v * kV) * factor;
  }
  for (int64_t k = 0; k < n; ++k) {
    Vec p[kRowVecs];
    for (int v = 0; v < kRowVecs; ++v) p[v] = Vec::loadu(probs + k * rows + r0 + v * kV);
    for (int d = 0; d < DB; ++d) {
      const Vec value(values[k * head_dim + d0 + d]);
      for (int v = 0; v < kRowVecs; ++v) sums[d][v] = at::vec::fmadd(value, p[v], sums[d][v]);
    }
  }
  for (int d = 0; d < DB; ++d)
    for (int v = 0; v < kRowVecs; ++v) sums[d][v].store(out + (d0 + d) * rows + r0 + v * kV);
}

// Tile `t` of KV head h: query positions [t * kQueries, ...) of the chunk, each with the group's
// heads, over keys [0, its last position].
template <typename T>
void attend_tile(const Chunk<T>& c, int64_t h, int64_t t, Tile& tile) {
  constexpr bool pairs = kPairDots && std::is_same_v<T, at::BFloat16>;
  const int64_t D = c.head_dim, R = tile.rows;
  const int64_t first = t * kQueries, count = std::min(kQueries, c.tokens - first);
  // rows: position-major, head within the group second
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = first + std::min(r / c.group, count - 1);
    tile.position[r] = static_cast<float>(c.offset + i);
    const T* q = c.query + i * c.query_stride + (h * c.group + r % c.group) * D;
    if constexpr (pairs) {
      for (int64_t dp = 0; dp < D / 2; ++dp) std::memcpy(&tile.queries[dp * R + r], q + 2 * dp, 4);
    } else {
      for (int64_t d = 0; d < D; ++d) tile.queries[d * R + r] = static_cast<float>(q[d]);
    }
  }
  std::fill(tile.out.begin(), tile.out.end(), 0.f);
  std::fill(tile.peak.begin(), tile.peak.end(), -std::numeric_limits<float>::infinity());
  std::fill(tile.total.begin(), tile.total.end(), 0.f);
  float* factor = tile.factor.data();  // per row: what the chunk's new peak scales the old sums by
  const int64_t limit = c.offset + first + count;  // keys [0, limit)
  const T* key_rows[kKeys];
  for (int64_t k0 = 0; k0 < limit; k0 += kKeys) {
    const int64_t n = std::min(kKeys, limit - k0);
    for (int64_t k = 0; k < n; ++k) key_rows[k] = c.row(c.keys, k0 + k, h);
    float* scores = tile.scores.data();  // [k][r]
    if constexpr (pairs) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      const auto rows = reinterpret_cast<const at::BFloat16* const*>(key_rows);
      const float* queries = tile.queries.data();
      for (int64_t r0 = 0; r0 < R; r0 += kRowVecs * kV) {
        int64_t k = 0;
        for (; k + kKeyBlock <= n; k += kKeyBlock) pair_scores<kKeyBlock>(rows, queries, R, r0, D / 2, scores, k);
        for (; k < n; ++k) pair_scores<1>(rows, queries, R, r0, D / 2, scores, k);
      }
#endif
    } else {
      float* keys = tile.keys.data();
      for (int64_t k = 0; k < n; ++k) {
        for (int64_t d = 0; d < D; d += kV) load_float(key_rows[k] + d).store(keys + k * D + d);
      }
      for (int64_t r0 = 0; r0 < R; r0 += kRowVecs * kV) {
        int64_t k = 0;
        for (; k + kKeyBlock <= n; k += kKeyBlock) float_scores<kKeyBlock>(keys, tile.queries.data(), R, r0, D, scores, k);
        for (; k < n; ++k) float_scores<1>(keys, tile.queries.data(), R, r0, D, scores, k);
      }
    }
    // softmax, lane-wise: scale, mask keys past each row's position, the new peak and total
    const bool diagonal = k0 + n - 1 > c.offset + first;  // some row cannot see the last key
    for (int64_t v = 0; v < R / kV; ++v) {
      const int64_t r = v * kV;
      const Vec position = Vec::loadu(tile.position.data() + r);
      const Vec lowest(-std::numeric_limits<float>::infinity());
      Vec top = Vec::loadu(tile.peak.data() + r);
      const Vec old_peak = top;
      for (int64_t k = 0; k < n; ++k) {
        Vec s = Vec::loadu(scores + k * R + r) * Vec(c.scale);
        if (diagonal) s = Vec::blendv(s, lowest, Vec(static_cast<float>(k0 + k)) > position);
        s.store(scores + k * R + r);
        top = at::vec::maximum(top, s);
      }
      Vec sum(0.f);
      for (int64_t k = 0; k < n; ++k) {
        const Vec e = (Vec::loadu(scores + k * R + r) - top).exp_u20();  // torch's exponential
        round_to<T>(e).store(scores + k * R + r);
        sum = sum + e;
      }
      const Vec scale_old = (old_peak - top).exp();  // 0 on the first chunk
      (Vec::loadu(tile.total.data() + r) * scale_old + sum).store(tile.total.data() + r);
      top.store(tile.peak.data() + r);
      scale_old.store(factor + r);
    }
    // out[d][r] = out[d][r] * factor[r] + probabilities times values
    if constexpr (pairs) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      const int64_t key_pairs = (n + 1) / 2;  // a last odd key pairs with zeros
      auto* value_pairs = reinterpret_cast<uint32_t*>(tile.values.data());
      const auto widen = [&](int64_t k, int64_t d) {  // 16 values of key k as the low halves
        if (k >= n) return _mm512_setzero_si512();
        const auto* row = reinterpret_cast<const __m256i*>(c.row(c.values, k0 + k, h) + d);
        return _mm512_cvtepu16_epi32(_mm256_loadu_si256(row));
      };
      for (int64_t kp = 0; kp < key_pairs; ++kp) {  // [kp][d]: (value 2kp, value 2kp + 1) of dim d
        for (int64_t d = 0; d < D; d += 16) {
          const __m512i pair = _mm512_or_si512(widen(2 * kp, d), _mm512_slli_epi32(widen(2 * kp + 1, d), 16));
          _mm512_storeu_si512(value_pairs + kp * D + d, pair);
        }
      }
      // [kp][r]: (prob 2kp, prob 2kp + 1) of row r; the rounded exponentials are bfloat16 values
      // already, their high 16 bits
      auto* prob_pairs = reinterpret_cast<uint32_t*>(tile.probs.data());
      const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int64_t kp = 0; kp < key_pairs; ++kp) {
        for (int64_t r = 0; r < R; r += 16) {
          const __m512i a = _mm512_castps_si512(_mm512_loadu_ps(scores + 2 * kp * R + r));
          const __m512i b = 2 * kp + 1 < n ? _mm512_castps_si512(_mm512_loadu_ps(scores + (2 * kp + 1) * R + r))
                                           : _mm512_setzero_si512();
          _mm512_storeu_si512(prob_pairs + kp * R + r,
                              _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, high_half)));
        }
      }
      for (int64_t r0 = 0; r0 < R; r0 += kRowVecs * kV) {
        for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
          pair_values<kDimBlock>(tile.values.data(), tile.probs.data(), factor, R, r0, key_pairs, D, tile.out.data(), d0);
        }
      }
#endif
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T* value = c.row(c.values, k0 + j, h);
        for (int64_t d = 0; d < D; d += kV) load_float(value + d).store(tile.values.data() + j * D + d);
      }
      for (int64_t r0 = 0; r0 < R; r0 += kRowVecs * kV) {
        for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
          float_values<kDimBlock>(tile.values.data(), scores, factor, R, r0, n, D, tile.out.data(), d0);
        }
      }
    }
  }
  // out / total, rounded to T, for the tile's own rows
  float row[kMaxHeadDim];
  for (int64_t r = 0; r < count * c.group; ++r) {
    for (int64_t d = 0; d < D; ++d) row[d] = tile.out[d * R + r];
    T* out = c.out + ((first + r / c.group) * c.num_heads + h * c.group + r % c.group) * D;
    for (int64_t d = 0; d < D; d += kV) store_float(out + d, Vec::loadu(row + d) / Vec(tile.total[r]));
  }
}

template <typename T>
void run(const Chunk<T>& c) {
  const int64_t tiles = (c.tokens + kQueries - 1) / kQueries, items = tiles * c.num_kv_heads;
  // Items by work (later tiles see more keys), then dealt from both ends in turn: each thread's
  // contiguous share of the range gets light and heavy tiles alike.
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Tile tile;
    tile.size(kQueries * c.group, c.head_dim);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t by_work = p % 2 == 0 ? p / 2 : items - 1 - p / 2;
      attend_tile<T>(c, by_work % c.num_kv_heads, by_work / c.num_kv_heads, tile);
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_ids,
                             int64_t seq_len, double scale) {
  constexpr const char* kName = "prefill_attention";
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, kName, ": query must be 3-D and the cache 4-D");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              kName, ": key and value caches must be dense and of one shape");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              kName, ": query and caches must share a dtype");
  const int64_t tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, kName, ": query and cache head sizes differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, kName, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(head_dim % kV == 0 && head_dim % 16 == 0 && head_dim <= kMaxHeadDim, kName,
              ": head_dim must be a multiple of 16 and at most ", kMaxHeadDim);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == head_dim, kName, ": query heads must be dense");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 && block_ids.is_contiguous(),
              kName, ": block_ids must be a dense int64 vector");
  TORCH_CHECK(tokens >= 1 && tokens <= seq_len && seq_len <= block_ids.size(0) * block_size, kName,
              ": ", tokens, " query rows cannot end a sequence of ", seq_len, " positions in ",
              block_ids.size(0), " blocks of ", block_size);
  const int64_t* table = block_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < key_cache.size(0), kName, ": block id ", table[b], " out of range");
  }
  auto out = at::empty({tokens, num_heads, head_dim}, query.options());
  const llmrpc_cpu::KernelThreadsScope threads;
  LLMRPC_DISPATCH(query.scalar_type(), "prefill_attention", {
    run<scalar_t>(Chunk<scalar_t>{query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                  value_cache.data_ptr<scalar_t>(), table, out.data_ptr<scalar_t>(),
                                  tokens, query.stride(0), num_heads, num_kv_heads,
                                  num_heads / num_kv_heads, head_dim, block_size, seq_len - tokens,
                                  static_cast<float>(scale)});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_ids, "
        "int seq_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

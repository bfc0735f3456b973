// Paged decode attention on the CPU: one new query token per sequence; its keys and values are
// read in place from the block-structured KV cache (no gathered copy), and the scores, softmax and
// weighted sum are computed in float32 whatever the cache dtype.
//
// Registered as torch.ops.llmrpc_cpu.decode_attention, and as decode_attention_qkv with the step's
// rotary and KV store before it (from the qkv projection's rows: one call a layer where the
// layer's Python took three, and the views between them). kernel_ops/cpu_ops.py builds it for this
// machine's vector width (AVX-512, AVX2 or plain C++) and loads it; kernel_ops/attention.py keeps the
// pure-torch path the tests hold it to.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernel_threads.h"
#include "rotary.h"
#include "vec_utils.h"

namespace {

using llmrpc_cpu::load_float;
using llmrpc_cpu::round_to;
using llmrpc_cpu::store_float;
using llmrpc_cpu::Vec;
constexpr int64_t kMaxHeadDim = 256;

// Asks for a cache block before it is read: blocks lie anywhere in the cache, so the hardware
// prefetcher cannot follow a sequence from one block to the next.
template <typename T>
inline void prefetch_block(const T* block, int64_t bytes) {
  const char* start = reinterpret_cast<const char*>(block);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

// `bytes` from each of `rows` rows `stride` bytes apart. Kept out of line: inlined beside the
// whole-block prefetch below, it took a call of 32 sequences 12-17% longer, though such calls
// never reach it (Llama-3-8B's heads, bfloat16, AMD EPYC family 26).
__attribute__((noinline)) void prefetch_slices(const char* start, int64_t rows, int64_t stride,
                                               int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) prefetch_block(start + r * stride, bytes);
}

// KV heads [first, last) of a sequence, and the cache lines of a block they read: the whole block
// where they are all its heads, else their slice of each of its rows.
struct HeadSpan {
  int64_t first, last, num_kv_heads, head_dim, block_size;
  template <typename T>
  void prefetch(const T* block) const {
    const int64_t head = head_dim * static_cast<int64_t>(sizeof(T));
    if (last - first == num_kv_heads) return prefetch_block(block, block_size * num_kv_heads * head);
    prefetch_slices(reinterpret_cast<const char*>(block + first * head_dim), block_size,
                    num_kv_heads * head, (last - first) * head);
  }
};

// The cache lines of one block's span (HeadSpan), asked for a few at a time while another block is
// computed. Blocks lie apart in memory, so the hardware prefetcher cannot fill in, and a block's
// lines asked for at once (96 for SmolLM2's 6 KB) are more than a core keeps in flight: reading
// blocks of 6 KB in random order, one thread, AMD EPYC family 26, went at 13 GB/s asking 96 lines
// at a time and 20 GB/s asking up to 8.
struct LineStream {
  const char* row = nullptr;  // the current row's slice
  int64_t rows = 0, slice = 0, stride = 0, offset = 0;
  template <typename T>
  LineStream(const HeadSpan& span, const T* block) {
    const int64_t head = span.head_dim * static_cast<int64_t>(sizeof(T));
    const bool whole = span.last - span.first == span.num_kv_heads;
    row = reinterpret_cast<const char*>(block + span.first * span.head_dim);
    rows = whole ? 1 : span.block_size;  // a whole block is one run of lines
    slice = whole ? span.block_size * span.num_kv_heads * head : (span.last - span.first) * head;
    stride = span.num_kv_heads * head;
  }
  LineStream() = default;
  int64_t lines() const { return rows * ((slice + 63) / 64); }
  void ask(int64_t count) {
    for (; count > 0 && rows > 0; --count) {
      __builtin_prefetch(row + offset);
      offset += 64;
      if (offset >= slice) offset = 0, row += stride, --rows;
    }
  }
};

// How far ahead of the block computed its lines are asked for: keys in the first pass, each KV
// head's values in the second (1 to 4 tried; 2 as fast as any).
constexpr int64_t kBlocksAhead = 2;

#if defined(CPU_CAPABILITY_AVX512)
// The 16 lane sums of 16 vectors, in order, as one vector: a transpose-and-add tree (45
// instructions, where 16 separate horizontal sums take about 130).
inline Vec sum_each(const Vec* vectors) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = vectors[i];
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of 4 inputs, in order
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  // across the four 128-bit lanes: (0+1, 2+3) then (0+1+2+3)
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}
#elif defined(CPU_CAPABILITY_AVX2)
// The 8 lane sums of 8 vectors, in order, as one vector: the AVX-512 tree above on 8 lanes (21
// instructions, where 8 separate horizontal sums take 48).
inline Vec sum_each(const Vec* vectors) {
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = vectors[i];
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // per 128-bit lane: the lane's sums of 4 inputs, in order
    quads[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Scores of Vec::size() consecutive positions (rows of one block, [positions, num_kv_heads,
// head_dim]) for the query heads of KV heads [first, last): scores[i * padded + p] for head i and
// position p. Rows past the sequence's length are computed too (they lie in the block) and masked
// by the softmax.
template <typename T>
inline void block_scores(const T* rows, int64_t num_kv_heads, int64_t first, int64_t last,
                         int64_t group, int64_t head_dim, const Vec* q, float* scores,
                         int64_t padded, LineStream& ahead, int64_t lines_a_head) {
  constexpr int64_t kV = Vec::size();
  const int64_t chunks = head_dim / kV;
  alignas(64) float keys[kV * kMaxHeadDim];
  Vec dots[kV];
  for (int64_t h = first; h < last; ++h) {
    ahead.ask(lines_a_head);
    for (int64_t p = 0; p < kV; ++p) {
      const T* row = rows + (p * num_kv_heads + h) * head_dim;
      for (int64_t c = 0; c < chunks; ++c) load_float(row + c * kV).store(keys + p * head_dim + c * kV);
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i = h * group + g;
      const Vec* qi = q + i * chunks;
      // chunk by chunk across the positions: kV independent multiply-add chains, where one
      // position's chunks in turn waited on each multiply-add (the same sums in the same order).
      // With the value sums in halves below, one row of SmolLM2's heads over 160 and 500
      // positions took 17 and 44 us against 23 and 62 (AVX2 build, AMD EPYC family 25).
      for (int64_t p = 0; p < kV; ++p) dots[p] = qi[0] * Vec::loadu(keys + p * head_dim);
      for (int64_t c = 1; c < chunks; ++c) {
        for (int64_t p = 0; p < kV; ++p) {
          dots[p] = at::vec::fmadd(qi[c], Vec::loadu(keys + p * head_dim + c * kV), dots[p]);
        }
      }
      sum_each(dots).store(scores + i * padded);
    }
  }
}
#endif

// out[t] = sum over positions of probs[t * padded + pos] * v_pos / totals[t], for the `tiles` query heads
// (consecutive, sharing one KV head) whose probabilities start at `probs`. CHUNKS and TILES known
// at compile time keep the accumulators in registers; 0 means "given at run time".
template <typename T, int CHUNKS, int TILES>
void weighted_values_fixed(int64_t chunks, int64_t tiles, const T* v_head, const int64_t* table,
                           int64_t len, int64_t block_size, int64_t block_stride,
                           int64_t row_stride, const float* probs, int64_t padded,
                           const float* totals, Vec* scratch, T* out, int64_t head_dim) {
  constexpr int64_t kV = Vec::size();
  if constexpr (CHUNKS > 0) chunks = CHUNKS;
  if constexpr (TILES > 0) tiles = TILES;
  Vec local[(CHUNKS > 0 && TILES > 0) ? CHUNKS * TILES : 1];
  Vec* acc = (CHUNKS > 0 && TILES > 0) ? local : scratch;
  for (int64_t j = 0; j < chunks * tiles; ++j) acc[j] = Vec(0.f);
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const T* block = v_head + table[b] * block_stride;
    const T* ahead_block =
        b + kBlocksAhead < num_blocks ? v_head + table[b + kBlocksAhead] * block_stride : nullptr;
    const char* ahead = reinterpret_cast<const char*>(ahead_block);
    const int64_t first = b * block_size, last = std::min(len, first + block_size);
    for (int64_t pos = first; pos < last; ++pos) {
      const T* row = block + (pos - first) * row_stride;
      if (ahead != nullptr) {  // this row's slice kBlocksAhead blocks on
        const char* line = ahead + (pos - first) * row_stride * static_cast<int64_t>(sizeof(T));
        for (int64_t c = 0; c < chunks * kV * static_cast<int64_t>(sizeof(T)); c += 64) {
          __builtin_prefetch(line + c);
        }
      }
      Vec v[CHUNKS > 0 ? CHUNKS : kMaxHeadDim / Vec::size()];
      for (int64_t c = 0; c < chunks; ++c) v[c] = load_float(row + c * kV);
      for (int64_t t = 0; t < tiles; ++t) {
        const Vec p(probs[t * padded + pos]);
        for (int64_t c = 0; c < chunks; ++c) acc[t * chunks + c] = at::vec::fmadd(p, v[c], acc[t * chunks + c]);
      }
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const Vec total(totals[t]);
    for (int64_t c = 0; c < chunks; ++c) store_float(out + t * head_dim + c * kV, acc[t * chunks + c] / total);
  }
}

template <typename T, int CHUNKS>
void weighted_values_tiles(int64_t chunks, int64_t tiles, const T* v_head, const int64_t* table,
                           int64_t len, int64_t block_size, int64_t block_stride,
                           int64_t row_stride, const float* probs, int64_t padded,
                           const float* totals, Vec* scratch, T* out, int64_t head_dim) {
#define LLMRPC_VALUES(TILES)                                                                    \
  weighted_values_fixed<T, CHUNKS, TILES>(chunks, tiles, v_head, table, len, block_size,        \
                                          block_stride, row_stride, probs, padded, totals, scratch, \
                                          out, head_dim)
  switch (tiles) {
    case 1: LLMRPC_VALUES(1); break;
    case 2: LLMRPC_VALUES(2); break;
    case 3: LLMRPC_VALUES(3); break;
    default: LLMRPC_VALUES(4); break;
  }
#undef LLMRPC_VALUES
}

template <typename T>
void weighted_values(int64_t chunks, int64_t tiles, const T* v_head, const int64_t* table,
                     int64_t len, int64_t block_size, int64_t block_stride, int64_t row_stride,
                     const float* probs, int64_t padded, const float* totals, Vec* scratch, T* out,
                     int64_t head_dim) {
  // Chunks a pass keeps in registers for up to four heads: a wider head takes passes over slices
  // of its values (each output's sums the same, in the same order). Eight chunks' sums for four
  // heads outgrow AVX2's 16 registers (they were kept on the stack). Llama-3-8B's heads of 128
  // (16 chunks) took the generic loop before: passes of 4 took one row of 1024 positions from
  // 277-308 to 162-186 us, 8 rows from 3.0-3.3 to 2.1-2.2 ms (AVX2 build, AMD EPYC family 26).
  constexpr int64_t kSlice = Vec::size() == 16 ? 8 : 4;
  if (chunks == 4) {
    weighted_values_tiles<T, 4>(chunks, tiles, v_head, table, len, block_size, block_stride,
                                row_stride, probs, padded, totals, scratch, out, head_dim);
  } else if (chunks % kSlice == 0) {
    for (int64_t slice = 0; slice < chunks; slice += kSlice) {
      const int64_t offset = slice * Vec::size();
      weighted_values_tiles<T, kSlice>(kSlice, tiles, v_head + offset, table, len, block_size,
                                       block_stride, row_stride, probs, padded, totals, scratch,
                                       out + offset, head_dim);
    }
  } else {
    weighted_values_fixed<T, 0, 0>(chunks, tiles, v_head, table, len, block_size, block_stride,
                                   row_stride, probs, padded, totals, scratch, out, head_dim);
  }
}

// Scores of blocks [b0, b1) of one sequence for the query heads of the KV heads of `span`
// (query head h * group + g with KV head h; q holds the sequence's query heads as vectors), into
// rows of `padded` floats a head. A block holds [block_size, num_kv_heads, head_dim] contiguously.
template <typename T>
void score_blocks(const Vec* q, const HeadSpan span, int64_t group, const T* k_base,
                  const int64_t* table, int64_t len, int64_t b0, int64_t b1, int64_t block_stride,
                  float* scores, int64_t padded) {
  constexpr int64_t kV = Vec::size();
  const int64_t num_kv_heads = span.num_kv_heads, head_dim = span.head_dim;
  const int64_t block_size = span.block_size, chunks = head_dim / kV;
  Vec kv[kMaxHeadDim / Vec::size()];
  // The first blocks' keys now, then each block's keys kBlocksAhead blocks ahead, a few lines at a
  // time (LineStream).
  for (int64_t b = b0; b < std::min(b0 + kBlocksAhead, b1); ++b) {
    span.prefetch(k_base + table[b] * block_stride);
  }
  for (int64_t b = b0; b < b1; ++b) {
    LineStream ahead;
    if (b + kBlocksAhead < b1) {
      ahead = LineStream(span, k_base + table[b + kBlocksAhead] * block_stride);
    }
    const T* block = k_base + table[b] * block_stride;
    const int64_t first = b * block_size, last = std::min(len, first + block_size);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (block_size % kV == 0) {  // kV positions a call (the softmax pads rows to whole vectors)
      const int64_t asks = (block_size / kV) * (span.last - span.first);
      const int64_t lines_an_ask = (ahead.lines() + asks - 1) / asks;
      for (int64_t start = first; start < last; start += kV) {
        block_scores(block + (start - first) * num_kv_heads * head_dim, num_kv_heads, span.first,
                     span.last, group, head_dim, q, scores + start, padded, ahead, lines_an_ask);
      }
      continue;
    }
#endif
    ahead.ask(ahead.lines());
    for (int64_t pos = first; pos < last; ++pos) {
      const T* row = block + (pos - first) * num_kv_heads * head_dim;
      for (int64_t h = span.first; h < span.last; ++h) {
        for (int64_t c = 0; c < chunks; ++c) kv[c] = load_float(row + h * head_dim + c * kV);
        for (int64_t g = 0; g < group; ++g) {
          const Vec* qi = q + (h * group + g) * chunks;
          Vec dot = qi[0] * kv[0];
          for (int64_t c = 1; c < chunks; ++c) dot = at::vec::fmadd(qi[c], kv[c], dot);
          scores[(h * group + g) * padded + pos] = llmrpc_cpu::sum_lanes(dot);
        }
      }
    }
  }
}

// Softmax of one head's `len` scores, in place, as torch's CPU attention computes it (HF models'
// default): scores scaled after the dot product, the exponentials rounded to T for the weighted
// sum; returns their float32 total, which divides that sum at the end. Without the rounding the
// packaged 135M model's bf16 greedy answer to a test prompt changed. The row is padded to whole
// vectors (`padded`); the padding is masked.
template <typename T>
float softmax_row(float* s, int64_t len, int64_t padded, float scale) {
  constexpr int64_t kV = Vec::size();
  const float lowest = -std::numeric_limits<float>::infinity();
  for (int64_t pos = len; pos < padded; ++pos) s[pos] = lowest;
  Vec top(lowest);
  for (int64_t j = 0; j < padded; j += kV) {
    const Vec scaled = Vec::loadu(s + j) * Vec(scale);
    scaled.store(s + j);
    top = at::vec::maximum(top, scaled);
  }
  const Vec peak(llmrpc_cpu::max_lanes(top));
  Vec total(0.f);
  for (int64_t j = 0; j < padded; j += kV) {
    const Vec e = (Vec::loadu(s + j) - peak).exp();
    round_to<T>(e).store(s + j);
    total = total + e;
  }
  return llmrpc_cpu::sum_lanes(total);
}

// Query heads [first_head, last_head) of one sequence as float vectors, head i at q[i * chunks].
template <typename T>
void load_query(const T* query, int64_t first_head, int64_t last_head, int64_t head_dim, Vec* q) {
  constexpr int64_t kV = Vec::size();
  const int64_t chunks = head_dim / kV;
  for (int64_t i = first_head; i < last_head; ++i) {
    for (int64_t c = 0; c < chunks; ++c) {
      q[i * chunks + c] = load_float(query + i * head_dim + c * kV);
    }
  }
}

// One sequence, the KV heads of `span`: query head h * group + g attends with KV head h over
// positions [0, len), found through the sequence's row of the block table; the span's part of each
// block is read once for keys and once for values.
template <typename T>
void attend(const T* query, const HeadSpan span, int64_t group, const T* k_base,
            const T* v_base, const int64_t* table, int64_t len, int64_t block_stride, float scale,
            std::vector<float>& scores, std::vector<Vec>& q, std::vector<Vec>& acc, T* out,
            const int64_t* next_table) {
  constexpr int64_t kV = Vec::size();
  const int64_t num_kv_heads = span.num_kv_heads, head_dim = span.head_dim;
  const int64_t block_size = span.block_size;
  const int64_t chunks = head_dim / kV;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t first_head = span.first * group, last_head = span.last * group;
  load_query(query, first_head, last_head, head_dim, q.data());
  const int64_t padded = (len + kV - 1) / kV * kV;  // rows padded to whole vectors for the softmax
  scores.resize(num_heads * padded + num_heads);  // the softmax totals after the rows
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  score_blocks(q.data(), span, group, k_base, table, len, 0, num_blocks, block_stride,
               scores.data(), padded);
  // The first blocks' values while the softmax runs (the rest come kBlocksAhead blocks ahead of
  // their pass).
  for (int64_t b = 0; b < std::min(kBlocksAhead, num_blocks); ++b) {
    span.prefetch(v_base + table[b] * block_stride);
  }
  float* totals = scores.data() + num_heads * padded;
  for (int64_t i = first_head; i < last_head; ++i) {
    totals[i] = softmax_row<T>(scores.data() + i * padded, len, padded, scale);
  }
  if (next_table != nullptr) {  // the next sequence's first keys, while this one's values are summed
    span.prefetch(k_base + next_table[0] * block_stride);
  }
  for (int64_t h = span.first; h < span.last; ++h) {
    for (int64_t g = 0; g < group; g += 4) {
      const int64_t i = h * group + g;
      weighted_values<T>(chunks, std::min<int64_t>(4, group - g), v_base + h * head_dim, table, len,
                         block_size, block_stride, num_kv_heads * head_dim, scores.data() + i * padded,
                         padded, totals + i, acc.data(), out + i * head_dim, head_dim);
    }
  }
}

// Fewer sequences than threads, with long contexts: each sequence's work split three ways in
// turn, every split giving each output the sums it has in attend (the same bits): its scores by
// runs of blocks, its softmax by heads, its value sums by KV head and slice of the head's
// dimensions. Split by KV heads only, SmolLM2's 3 over 2 threads gave one thread twice the
// other's work: a decode step at a context of 4000 (-q gguf, 2 threads, AVX2 build, AMD EPYC
// family 26) took 7.1-7.2 ms that way, 6.3-6.5 ms this way.
template <typename T>
void attend_split(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens,
                  int64_t num_seqs, int64_t q_stride, int64_t max_blocks, const HeadSpan all,
                  int64_t group, int64_t block_stride, float scale, int64_t parts, T* o) {
  constexpr int64_t kV = Vec::size();
  const int64_t num_kv_heads = all.num_kv_heads, head_dim = all.head_dim, chunks = head_dim / kV;
  const int64_t num_heads = num_kv_heads * group, block_size = all.block_size;
  std::vector<int64_t> padded(num_seqs), offset(num_seqs + 1, 0);
  for (int64_t n = 0; n < num_seqs; ++n) {
    padded[n] = (lens[n] + kV - 1) / kV * kV;
    offset[n + 1] = offset[n] + num_heads * padded[n];
  }
  // every score is written before it is read (the softmax masks the padding): no zeroing
  const std::unique_ptr<float[]> scores(new float[offset[num_seqs]]);
  std::vector<float> totals(num_seqs * num_heads);
  at::parallel_for(0, num_seqs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> q_vecs(num_heads * chunks);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / parts, part = item % parts;
      const int64_t num_blocks = (lens[n] + block_size - 1) / block_size;
      load_query(q + n * q_stride, 0, num_heads, head_dim, q_vecs.data());
      score_blocks(q_vecs.data(), all, group, k, tables + n * max_blocks, lens[n],
                   part * num_blocks / parts, (part + 1) * num_blocks / parts, block_stride,
                   scores.get() + offset[n], padded[n]);
    }
  });
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / num_heads, i = item % num_heads;
      totals[item] = softmax_row<T>(scores.get() + offset[n] + i * padded[n], lens[n], padded[n],
                                    scale);
    }
  });
  // A head's dimensions in slices of 4 vectors or more (fewer keep too few sums in flight: halves
  // of a head of 64 in the AVX-512 build took a call of 4000 positions, from cache, 1.3-1.5x
  // longer), halved while there are fewer than two KV head slices a thread.
  int64_t slices = 1;
  while (chunks / (2 * slices) >= 4 && num_kv_heads * slices < 2 * at::get_num_threads()) {
    slices *= 2;
  }
  const int64_t slice_chunks = chunks / slices;
  at::parallel_for(0, num_seqs * num_kv_heads * slices, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> acc(num_heads * chunks);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / (num_kv_heads * slices), h = item / slices % num_kv_heads;
      const int64_t dims = item % slices * slice_chunks * kV;
      for (int64_t g = 0; g < group; g += 4) {
        const int64_t i = h * group + g;
        weighted_values<T>(slice_chunks, std::min<int64_t>(4, group - g), v + h * head_dim + dims,
                           tables + n * max_blocks, lens[n], block_size, block_stride,
                           num_kv_heads * head_dim, scores.get() + offset[n] + i * padded[n],
                           padded[n], totals.data() + n * num_heads + i, acc.data(),
                           o + (n * num_heads + i) * head_dim + dims, head_dim);
      }
    }
  });
}

// Positions from which every sequence of a call takes attend_split (its three parallel loops cost
// what they save at 256 positions; at 1000 and 4000 it was faster, above).
constexpr int64_t kSplitFrom = 256;

template <typename T>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const int64_t* lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* k = key_cache.data_ptr<T>();
  const T* v = value_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  // Fewer sequences than threads (a step of one or a few streams): each sequence split over
  // several threads, so every thread has work; long ones as attend_split splits them, the rest by
  // KV heads (a head's sums are the same in any split).
  const int64_t threads = at::get_num_threads();
  if (num_seqs < threads && *std::min_element(lens, lens + num_seqs) >= kSplitFrom) {
    const HeadSpan all{0, num_kv_heads, num_kv_heads, head_dim, key_cache.size(1)};
    return attend_split<T>(q, k, v, tables, lens, num_seqs, query.stride(0), max_blocks, all, group,
                           key_cache.stride(0), static_cast<float>(scale),
                           (threads + num_seqs - 1) / num_seqs, o);
  }
  const int64_t parts =
      num_seqs >= threads ? 1 : std::min(num_kv_heads, (threads + num_seqs - 1) / num_seqs);
  at::parallel_for(0, num_seqs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<Vec> q_vecs(num_heads * head_dim / Vec::size()), acc(q_vecs.size());
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / parts, part = item % parts;
      const HeadSpan span{part * num_kv_heads / parts, (part + 1) * num_kv_heads / parts,
                          num_kv_heads, head_dim, key_cache.size(1)};
      attend<T>(q + n * query.stride(0), span, group, k, v, tables + n * max_blocks, lens[n],
                key_cache.stride(0), static_cast<float>(scale), scores, q_vecs, acc,
                o + n * num_heads * head_dim,
                parts == 1 && n + 1 < end ? tables + (n + 1) * max_blocks : nullptr);
    }
  });
}

// The checks of both operations, `name` naming the one called: query [num_seqs, num_heads,
// head_dim]; key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables [num_seqs, max_blocks] int64; seq_lens [num_seqs] int64.
void check_attention(const char* name, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, name, ": query must be 3-D and the cache 4-D");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(),
              name, ": key and value caches differ in shape or layout");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              name, ": query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              name, ": block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), name, ": block_tables and seq_lens must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, name, ": query and cache head sizes differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, name, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(head_dim % Vec::size() == 0 && head_dim <= kMaxHeadDim,
              name, ": head_dim must be a multiple of ", Vec::size(), " and at most ", kMaxHeadDim);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == head_dim && key_cache.is_contiguous() &&
              value_cache.is_contiguous(), name, ": query heads and cache blocks must be dense");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs,
              name, ": one block-table row and one length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t num_blocks = key_cache.size(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_seqs; ++n) {
    TORCH_CHECK(lens[n] >= 1 && lens[n] <= max_blocks * block_size, name, ": sequence length out of range");
    for (int64_t b = 0; b < (lens[n] + block_size - 1) / block_size; ++b) {  // the blocks it reads
      const int64_t block = tables[n * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, name, ": block id ", block, " out of range");
    }
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  check_attention("decode_attention", query, key_cache, value_cache, block_tables, seq_lens);
  auto out = at::empty(query.sizes(), query.options());
  const llmrpc_cpu::KernelThreadsScope threads;
  LLMRPC_DISPATCH(query.scalar_type(), "decode_attention",
                  run<scalar_t>(query, key_cache, value_cache, block_tables, seq_lens.data_ptr<int64_t>(), scale, out));
  return out;
}

// Each row's query heads rotated into `query`, its key heads rotated into its slot of key_cache
// and its value heads copied into the same slot of value_cache.
template <typename T>
void rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const int64_t* slots, at::Tensor& query, at::Tensor& key_cache,
                      at::Tensor& value_cache) {
  const int64_t tokens = qkv.size(0), num_heads = query.size(1);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  const int64_t slot_size = num_kv_heads * head_dim;
  const T* rows = qkv.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = sin.data_ptr<T>();
  T* q = query.data_ptr<T>();
  T* k = key_cache.data_ptr<T>();
  T* v = value_cache.data_ptr<T>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = rows + t * qkv.stride(0);
      const T* c = cos_base + t * head_dim;
      const T* s = sin_base + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        llmrpc_cpu::rotate_head(row + h * head_dim, q + (t * num_heads + h) * head_dim, c, s, head_dim);
      }
      const T* key = row + num_heads * head_dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        llmrpc_cpu::rotate_head(key + h * head_dim, k + slots[t] * slot_size + h * head_dim, c, s, head_dim);
      }
      std::memcpy(v + slots[t] * slot_size, key + slot_size, slot_size * sizeof(T));
    }
  });
}

// A decode step's attention from the qkv projection's rows, in one call where the layer takes
// three (rotary, the KV store, decode_attention), with the same bits: qkv [tokens, (num_heads +
// 2 * num_kv_heads) * head_dim] (rows dense, tokens at any stride); each row's query and key heads
// are rotated by its cos/sin ([tokens, head_dim] values, as the rotary kernel rotates), its key and
// value stored in slot slot_mapping[t] of the caches, and then every row attends as in
// decode_attention (a row may read the keys rows before it stored: prompt chunks run as rows).
// The qkv rows are left as they were.
at::Tensor decode_attention_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, int64_t num_heads, double scale) {
  constexpr const char* kName = "decode_attention_qkv";
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && key_cache.dim() == 4,
              kName, ": qkv must be [tokens, width] with dense rows and the cache 4-D");
  const int64_t tokens = qkv.size(0), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(num_heads >= 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, kName,
              ": qkv rows must hold ", num_heads, " query heads and ", num_kv_heads,
              " key and value heads of ", head_dim, " values, not ", qkv.size(1));
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim &&
              sin.sizes() == cos.sizes(), kName, ": cos and sin must be dense [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              kName, ": cos, sin and qkv must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == tokens, kName, ": slot_mapping must be int64, one slot per row");
  auto query = at::empty({tokens, num_heads, head_dim}, qkv.options());
  check_attention(kName, query, key_cache, value_cache, block_tables, seq_lens);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, kName, ": slot ", slots[t], " out of range");
  }
  auto out = at::empty_like(query);
  const llmrpc_cpu::KernelThreadsScope threads;
  LLMRPC_DISPATCH(qkv.scalar_type(), "decode_attention_qkv", {
    rotate_and_store<scalar_t>(qkv, cos, sin, slots, query, key_cache, value_cache);
    run<scalar_t>(query, key_cache, value_cache, block_tables, seq_lens.data_ptr<int64_t>(), scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(llmrpc_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("decode_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_qkv", &decode_attention_qkv);
}

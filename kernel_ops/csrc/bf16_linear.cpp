// bfloat16 weights times bfloat16 activations on the CPU: y = x W^T + b with W held in a blocked
// layout (packed by kernel_ops/linear.py, `BlockedLinear`): outputs in blocks of 16, each block's
// inputs in pairs, [out / 16, in / 2, 16, 2], so one 64-byte load is the 16 outputs x 2 inputs
// AVX512-BF16's dot product takes.
//
// Each output sums its inputs' pairs in one float32 chain, in input order, adds the bias in
// float32 and rounds once: the same terms in the same order whatever the number of rows, the
// tiling or the thread that serves it, so a row's output does not depend on the rows beside it.
//
// Tiles: NB blocks x R rows, NB x R accumulators; each weight load serves R rows and each input
// broadcast NB blocks. Up to 6 rows, 4 blocks x every row; 7 to 12 rows, 2 blocks x every row
// (the weights are read once either way); past 12, 4 blocks x up to 6 rows, rows shared evenly
// between the tiles. The weights are prefetched 16 KB ahead in the order the tiles read them,
// which oneDNN's packed GEMV does not do. Which kernel serves which row counts is measured on the
// machine at start-up (kernel_ops/linear_tuning.py; docs/performance.md has figures, each with its
// CPU; on the Intel Xeon with AMX measured there, dot products won at one row, AMX tiles past it).
//
// A second kernel reads the same layout with AMX tiles (where the CPU has AMX-BF16 and the
// build its flags): a weight tile is 16 consecutive pair lines of a block (16 pairs x 16 outputs
// x 2, 64 bytes a line: the layout is AMX's B-tile layout already), an input tile 16 rows x 32
// inputs of x. Each output's pairs are summed in input order in one float32 chain, so a row's
// output does not depend on the rows beside it either; but the tiles add a pair's two products
// their own way, so the two kernels differ in some outputs' last bit (both within the rounding
// bound the tests check). --batch-invariant therefore gives a layer one kernel for every call.
//
// A third kernel serves one row alone: each block's pairs as one stream in four chains (p mod 4).
// At one row the dot-product kernel's one chain per output makes it read four blocks at once;
// one stream read faster (AMD EPYC family 26, one thread: 37 against 33 GB/s over a SmolLM2
// step's weights). Its sums are in another order, so its outputs differ from the others' in
// some last bits, and --batch-invariant never takes it.
//
// A fourth kernel serves CPUs without AVX512-BF16 (AVX2 and FMA): float32 fused multiply-adds over
// the same layout, each weight converted in registers (fma_linear below), with a one-row form
// that reads one block at a time as the third does, and a form for many rows that converts a
// block's weights a segment at a time into float32 lines for tiles of more rows (the same sums).
//
// Registered as torch.ops.llmrpc_cpu.bf16_linear(x, weight, bias, kernel_by_bucket): the kernel
// for each bucket of rows per call (ROW_BUCKET_ENDS: 1, 2-8, 9-32, 33-128, 129-1024, more), 0 the
// dot-product kernel, 1 the AMX one, 2 the one-row one (first bucket only), 3 the AVX2 one, 4 its
// one-row form (first bucket only), 5 its float32-segment form; none given: the dot products where
// built, else the AVX2 one.
// kernel_ops/linear_tuning.py chooses them by timing each. bf16_linear_supported() says whether
// this build has the dot products (AVX512-BF16), bf16_amx_supported() whether it has the tiles
// and Linux granted them, bf16_fma_supported() whether it has the AVX2 kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_bf16.h"
#include "avx2_bf16.h"
#include "kernel_threads.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLMRPC_AMX_BF16 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kPrefetchAhead = 16384;
// Rows from which threads split the rows, not the blocks: below, two threads reading every
// weight cost more than the uneven split saves. SmolLM2-135M's layers in bfloat16, 2 threads,
// AMD EPYC family 26: split by rows 0.97-0.99x oneDNN's time at 512 rows (by blocks 1.00-1.03x),
// 0.99x at 256 (1.00-1.01x), but 0.95-0.97x at 96-128 rows, where by blocks took 0.92-0.95x.
constexpr int64_t kRowSplitMin = 192;

struct Operands {
  const at::BFloat16* weight;
  const at::BFloat16* x;
  const at::BFloat16* bias;  // null: none
  at::BFloat16* y;
  int64_t pairs, block_stride, ldx, ldy;
};

// Blocks [block, block + NB) times rows [row, row + R).
template <int NB, int R>
void tile(const Operands& o, int64_t block, int64_t row, bool prefetch) {
  // The tile reads NB lines a pair, one per block. The prefetch runs kPrefetchAhead bytes ahead
  // in that order: further along these blocks, then into the next NB once these end.
  constexpr int64_t ahead = kPrefetchAhead / (64 * NB);
  const int64_t wrap = (NB - 1) * o.block_stride;
  const at::BFloat16* weight = o.weight + block * o.block_stride;
  const at::BFloat16* x = o.x + row * o.ldx;
  __m512 sums[NB][R];
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < R; ++r) sums[b][r] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < o.pairs; ++p) {
    __m512bh w[NB];
    for (int b = 0; b < NB; ++b) {
      const at::BFloat16* line = weight + b * o.block_stride + p * 32;
      if (prefetch) {
        const at::BFloat16* next = line + ahead * 32 + (p + ahead < o.pairs ? 0 : wrap);
        _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T0);
      }
      w[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(line));
    }
    for (int r = 0; r < R; ++r) {
      int32_t bits;
      std::memcpy(&bits, x + r * o.ldx + 2 * p, sizeof(bits));
      const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
      for (int b = 0; b < NB; ++b) sums[b][r] = _mm512_dpbf16_ps(sums[b][r], w[b], pair);
    }
  }
  for (int b = 0; b < NB; ++b) {
    __m512 bias = _mm512_setzero_ps();
    if (o.bias != nullptr) {
      const __m256i bits =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.bias + 16 * (block + b)));
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(sums[b][r], bias));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.y + (row + r) * o.ldy + 16 * (block + b)),
                          reinterpret_cast<__m256i>(out));
    }
  }
}

// A tile of `rows` (1 to R) rows.
template <int NB, int R>
void tile_of(const Operands& o, int64_t block, int64_t row, int64_t rows, bool prefetch) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<NB, R - 1>(o, block, row, rows, prefetch);
  }
  tile<NB, R>(o, block, row, prefetch);
}

// Every row for the blocks [begin, end), NB at a time (the last ones one at a time), rows in
// near-equal tiles of at most R. Only a block group's first tile prefetches: the others find
// its weights in the cache.
template <int NB, int R>
void blocks_rows(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  const int64_t num_tiles = (rows + R - 1) / R;
  int64_t b = begin;
  for (; b + NB <= end; b += NB) {
    for (int64_t t = 0, row = 0; t < num_tiles; ++t) {
      const int64_t tile_rows = (rows - row) / (num_tiles - t);
      tile_of<NB, R>(o, b, row, tile_rows, t == 0);
      row += tile_rows;
    }
  }
  if constexpr (NB > 1) {
    if (b < end) blocks_rows<1, R>(o, rows, b, end);
  }
}

// One row, blocks [begin, end) one at a time (the one-row kernel): a block's pairs read as one
// stream, summed in four float32 chains (pair p into chain p mod 4, a tail of fewer than four
// into chain 0), the chains added (0 + 1) + (2 + 3) at the end. Every line is prefetched
// kGemvAhead bytes ahead.
constexpr int64_t kGemvAhead = 4096;

inline __m512 dot_pair(__m512 sum, const at::BFloat16* line, int32_t pair) {
  return _mm512_dpbf16_ps(sum, reinterpret_cast<__m512bh>(_mm512_loadu_si512(line)),
                          reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)));
}

void gemv_blocks(const Operands& o, int64_t begin, int64_t end) {
  constexpr int64_t ahead = kGemvAhead / sizeof(at::BFloat16);
  for (int64_t block = begin; block < end; ++block) {
    const at::BFloat16* weight = o.weight + block * o.block_stride;
    __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
    int64_t p = 0;
    for (; p + 4 <= o.pairs; p += 4) {
      const at::BFloat16* lines = weight + p * 32;
      int32_t pairs[4];
      std::memcpy(pairs, o.x + 2 * p, sizeof(pairs));
      for (int c = 0; c < 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(lines + ahead + 32 * c), _MM_HINT_T0);
        sums[c] = dot_pair(sums[c], lines + 32 * c, pairs[c]);
      }
    }
    for (; p < o.pairs; ++p) {
      int32_t pair;
      std::memcpy(&pair, o.x + 2 * p, sizeof(pair));
      sums[0] = dot_pair(sums[0], weight + p * 32, pair);
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
    if (o.bias != nullptr) {
      const __m256i bits =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.bias + 16 * block));
      const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(wide));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.y + 16 * block),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
  }
}
#endif

#if defined(LLMRPC_AMX_BF16)
// The tiles' shapes: 0-3 hold sums (rows of input tile m, 16 outputs of weight tile n: tile
// 2m + n), 4-5 the input tiles m = 0, 1, 6-7 the weight tiles n = 0, 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles(int64_t rows0, int64_t rows1) {
  TileConfig config;
  const int64_t rows_of[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    if (rows_of[t] == 0) continue;  // unused: left unconfigured
    config.rows[t] = static_cast<uint8_t>(rows_of[t]);
    config.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC 12 drops the stores into `config` before its builtin (it does not
  // see the builtin read them); an asm with the config as its memory operand keeps them.
  asm volatile("ldtilecfg %0" : : "m"(config));
}

// Linux gives a process AMX's tile registers only once it asks for them.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr int kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// A sum tile's rows (`stride` floats apart), plus the bias, rounded once into y.
void store_sums(const Operands& o, const float* sums, int64_t stride, int64_t block, int64_t row,
                int64_t rows) {
  __m512 bias = _mm512_setzero_ps();
  if (o.bias != nullptr) {
    const __m256i bits =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.bias + 16 * block));
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 sum = _mm512_loadu_ps(sums + stride * r);
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(sum, bias));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.y + (row + r) * o.ldy + 16 * block),
                        reinterpret_cast<__m256i>(out));
  }
}

// Blocks are taken kAmxBlocks at a time (their weights stay in the L2 cache while every row
// passes). Past kAmxChunks chunks of 32 inputs (2048), the inputs go in passes of kAmxChunks
// chunks, so that a pass's rows of x stay in the L2 cache beside the group's weights; between
// passes the group's sums are kept in float32 in `partial` ([rows, kPartialStride]), stored and
// loaded exactly: each output is still one chain, in input order. (On an Intel Xeon with AMX,
// 1 thread, each against oneDNN in its own run: an 8192-input layer at 512 rows took 1.01x its
// time, 1.52x in one pass; passes of 512 inputs made SmolLM2's 210 layers 1.36x at 512 rows, and
// of 1024 the 2048- and 8192-input layers slower than passes of 2048.)
constexpr int64_t kAmxBlocks = 8;
constexpr int64_t kAmxChunks = 64;
constexpr int64_t kPartialStride = 16 * kAmxBlocks;  // floats

struct Pass {
  int64_t begin, end;  // chunks of 32 inputs
  bool first, last;
  float* partial;       // null: one pass over every input
  int64_t first_block;  // the group's first block: column 0 of `partial`
};

float* partial_at(const Pass& pass, int64_t block, int64_t row) {
  if (pass.partial == nullptr) return nullptr;
  return pass.partial + row * kPartialStride + 16 * (block - pass.first_block);
}

// Sum tile T starts at zero, or at the sums the passes before left. (Macros, not templates: the
// tile intrinsics spell their register number into the instruction.)
#define LLMRPC_START_SUMS(T, pass, at)          \
  do {                                          \
    if ((pass).first) {                         \
      _tile_zero(T);                            \
    } else {                                    \
      _tile_loadd(T, (at), 4 * kPartialStride); \
    }                                           \
  } while (0)

// Sum tile T is kept for the next pass, or (the last) rounded into y.
#define LLMRPC_END_SUMS(T, o, pass, at, block, row, rows)                             \
  do {                                                                              \
    if ((at) != nullptr) {                                                          \
      _tile_stored(T, (at), 4 * kPartialStride);                                    \
      if ((pass).last) store_sums((o), (at), kPartialStride, (block), (row), (rows)); \
    } else {                                                                        \
      alignas(64) float sums[16 * 16];                                              \
      _tile_stored(T, sums, 64);                                                    \
      store_sums((o), sums, 16, (block), (row), (rows));                            \
    }                                                                               \
  } while (0)

// Blocks [block, block + NT) times rows [row, row + rows0 + rows1), MT input tiles of rows0 and
// rows1 rows (as configured), over the pass's inputs.
template <int MT, int NT>
void amx_tile(const Operands& o, int64_t block, int64_t row, int64_t rows0, int64_t rows1,
              const Pass& pass) {
  float* const at[4] = {partial_at(pass, block, row), partial_at(pass, block + 1, row),
                        partial_at(pass, block, row + 16), partial_at(pass, block + 1, row + 16)};
  LLMRPC_START_SUMS(0, pass, at[0]);
  if constexpr (NT > 1) LLMRPC_START_SUMS(1, pass, at[1]);
  if constexpr (MT > 1) LLMRPC_START_SUMS(2, pass, at[2]);
  if constexpr (MT > 1 && NT > 1) LLMRPC_START_SUMS(3, pass, at[3]);
  const auto* w0 = reinterpret_cast<const char*>(o.weight + block * o.block_stride);
  const auto* w1 = w0 + 2 * o.block_stride;
  const auto* x0 = reinterpret_cast<const char*>(o.x + row * o.ldx);
  const auto* x1 = x0 + 32 * o.ldx;
  const int64_t x_stride = 2 * o.ldx;
  for (int64_t chunk = pass.begin; chunk < pass.end; ++chunk) {
    _tile_loadd(6, w0 + 1024 * chunk, 64);
    if constexpr (NT > 1) _tile_loadd(7, w1 + 1024 * chunk, 64);
    _tile_loadd(4, x0 + 64 * chunk, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) {
      _tile_loadd(5, x1 + 64 * chunk, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  LLMRPC_END_SUMS(0, o, pass, at[0], block, row, rows0);
  if constexpr (NT > 1) LLMRPC_END_SUMS(1, o, pass, at[1], block + 1, row, rows0);
  if constexpr (MT > 1) LLMRPC_END_SUMS(2, o, pass, at[2], block, row + 16, rows1);
  if constexpr (MT > 1 && NT > 1) LLMRPC_END_SUMS(3, o, pass, at[3], block + 1, row + 16, rows1);
}

template <int MT>
void amx_blocks(const Operands& o, int64_t row, int64_t rows0, int64_t rows1, int64_t end,
                const Pass& pass) {
  int64_t b = pass.first_block;
  for (; b + 2 <= end; b += 2) amx_tile<MT, 2>(o, b, row, rows0, rows1, pass);
  if (b < end) amx_tile<MT, 1>(o, b, row, rows0, rows1, pass);
}

// Every row for the blocks [begin, end): a group of blocks at a time, each pass of inputs over
// 32 rows at a time, then the rest, each shape of tiles configured once per pass.
void amx_blocks_rows(const Operands& o, int64_t rows, int64_t begin, int64_t end) {
  const int64_t chunks = o.pairs / 16, step = std::min(chunks, kAmxChunks);
  std::vector<float> partial(step < chunks ? rows * kPartialStride : 0);
  const int64_t full = rows / 32 * 32, rest = rows - full;
  for (int64_t first = begin; first < end; first += kAmxBlocks) {
    const int64_t last = std::min(first + kAmxBlocks, end);
    for (int64_t chunk = 0; chunk < chunks; chunk += step) {
      const Pass pass{chunk, std::min(chunk + step, chunks), chunk == 0, chunk + step >= chunks,
                      partial.empty() ? nullptr : partial.data(), first};
      if (full > 0) {
        configure_tiles(16, 16);
        for (int64_t row = 0; row < full; row += 32) amx_blocks<2>(o, row, 16, 16, last, pass);
      }
      if (rest > 16) {
        configure_tiles(16, rest - 16);
        amx_blocks<2>(o, full, 16, rest - 16, last, pass);
      } else if (rest > 0) {
        configure_tiles(rest, 0);
        amx_blocks<1>(o, full, rest, 0, last, pass);
      }
    }
  }
  _tile_release();
}
#endif

// Kernel ids (kernel_ops/linear_tuning.py's BLOCKED_KERNEL_IDS).
constexpr int64_t kDotProducts = 0, kAmxTiles = 1, kOneRow = 2, kFma = 3, kFmaOneRow = 4,
                  kFmaSegments = 5;

#if defined(__AVX2__) && defined(__FMA__)
// The fused multiply-add kernel (AVX2 and FMA: Intel Core and Xeon since Haswell, AMD since
// Excavator), for CPUs without AVX512-BF16. x is converted to float32 once per call (`xf`); a
// weight line's 16 outputs x 2 inputs are read as two 8-lane halves, each lane one output's pair:
// input 2p is the lane shifted left 16 bits, input 2p + 1 the lane with its low 16 bits cleared
// (both exact). Each output sums its inputs in one float32 chain, in input order, so a row's output
// does not depend on the rows beside it; its roundings differ from the dot products' (which this
// build may lack) in some last bits.
struct Avx2Operands {
  const at::BFloat16* weight;
  const float* x;
  const at::BFloat16* bias;  // null: none
  at::BFloat16* y;
  int64_t pairs, block_stride, ldx, ldy;
};

constexpr int64_t kFmaChunkBytes = 256 * 1024;
// The float32-segment form reads a chunk's inputs a segment at a time, so its chunks can outgrow
// L2 a little; each chunk reads the weights again (SmolLM2's 120 body layers at 512 rows, AVX2
// build on AMD EPYC family 26: 1.02-1.04x oneDNN's float32 time with 256 KB, 0.99-1.00x with 512).
constexpr int64_t kFmaSegmentChunkBytes = 512 * 1024;

using llmrpc_cpu::load_bf16x8;
using llmrpc_cpu::round_to_bf16;

// Blocks [block, block + NB) times rows [row, row + R): NB x 2 x R accumulators of 8 outputs.
template <int NB, int R>
void fma_tile(const Avx2Operands& o, int64_t block, int64_t row) {
  const at::BFloat16* weight = o.weight + block * o.block_stride;
  const float* x = o.x + row * o.ldx;
  const __m256i odd_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 sums[NB][2][R];
  for (int b = 0; b < NB; ++b) {
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < R; ++r) sums[b][h][r] = _mm256_setzero_ps();
    }
  }
  for (int64_t p = 0; p < o.pairs; ++p) {
    if constexpr (R == 1) {  // each line's two products at once: fewer registers live
      const __m256 even = _mm256_broadcast_ss(x + 2 * p), odd = _mm256_broadcast_ss(x + 2 * p + 1);
      for (int b = 0; b < NB; ++b) {
        for (int h = 0; h < 2; ++h) {
          const __m256i line = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(weight + b * o.block_stride + p * 32 + 16 * h));
          const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
          const __m256 high = _mm256_castsi256_ps(_mm256_and_si256(line, odd_half));
          sums[b][h][0] = _mm256_fmadd_ps(high, odd, _mm256_fmadd_ps(low, even, sums[b][h][0]));
        }
      }
      continue;
    }
    __m256i lines[NB][2];
    for (int b = 0; b < NB; ++b) {
      for (int h = 0; h < 2; ++h) {
        lines[b][h] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(weight + b * o.block_stride + p * 32 + 16 * h));
      }
    }
    __m256 w[NB][2];
    for (int b = 0; b < NB; ++b) {
      for (int h = 0; h < 2; ++h) w[b][h] = _mm256_castsi256_ps(_mm256_slli_epi32(lines[b][h], 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 even = _mm256_broadcast_ss(x + r * o.ldx + 2 * p);
      for (int b = 0; b < NB; ++b) {
        for (int h = 0; h < 2; ++h) sums[b][h][r] = _mm256_fmadd_ps(w[b][h], even, sums[b][h][r]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      for (int h = 0; h < 2; ++h) {
        w[b][h] = _mm256_castsi256_ps(_mm256_and_si256(lines[b][h], odd_half));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 odd = _mm256_broadcast_ss(x + r * o.ldx + 2 * p + 1);
      for (int b = 0; b < NB; ++b) {
        for (int h = 0; h < 2; ++h) sums[b][h][r] = _mm256_fmadd_ps(w[b][h], odd, sums[b][h][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int h = 0; h < 2; ++h) {
      const int64_t first = 16 * (block + b) + 8 * h;
      const __m256 bias = o.bias != nullptr ? load_bf16x8(o.bias + first) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o.y + (row + r) * o.ldy + first),
                         round_to_bf16(_mm256_add_ps(sums[b][h][r], bias)));
      }
    }
  }
}

template <int NB, int R>
void fma_tile_of(const Avx2Operands& o, int64_t block, int64_t row, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return fma_tile_of<NB, R - 1>(o, block, row, rows);
  }
  fma_tile<NB, R>(o, block, row);
}

// Every row for the blocks [begin, end), NB at a time (the last ones one at a time), rows in
// near-equal tiles of at most R.
template <int NB, int R>
void fma_blocks_rows(const Avx2Operands& o, int64_t rows, int64_t begin, int64_t end) {
  const int64_t num_tiles = (rows + R - 1) / R;
  int64_t b = begin;
  for (; b + NB <= end; b += NB) {
    for (int64_t t = 0, row = 0; t < num_tiles; ++t) {
      const int64_t tile_rows = (rows - row) / (num_tiles - t);
      fma_tile_of<NB, R>(o, b, row, tile_rows);
      row += tile_rows;
    }
  }
  if constexpr (NB > 1) {
    if (b < end) fma_blocks_rows<1, R>(o, rows, b, end);
  }
}

// Many rows, a block's weights converted to float32 a segment of inputs at a time: the segment's
// lines ([pair][even input's 16 outputs][odd input's 16 outputs], 8 KB) stay in the L1 cache while
// every tile of rows reads them, and each tile carries its sums from segment to segment in a buffer
// (the same chain, in input order: the sums of fma_tile, bit for bit).
constexpr int64_t kSegmentPairs = 64;

void fma_convert_segment(const at::BFloat16* weight, int64_t pairs, float* out) {
  const __m256i odd_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int h = 0; h < 2; ++h) {
      const __m256i line =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight + p * 32 + 16 * h));
      _mm256_storeu_ps(out + p * 32 + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(line, 16)));
      _mm256_storeu_ps(out + p * 32 + 16 + 8 * h,
                       _mm256_castsi256_ps(_mm256_and_si256(line, odd_half)));
    }
  }
}

// R rows' sums of 16 outputs (sums: 16 floats a row) carried over `pairs` converted lines; x is
// the first row's inputs at the segment's start.
template <int R>
void fma_segment_tile(const float* lines, int64_t pairs, const float* x, int64_t ldx,
                      float* sums) {
  // Two arrays of R, each loop unrolled: GCC 12 then keeps the sums in registers (one [2][R]
  // array kept them on the stack, stored at every pair).
  __m256 low[R], high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    low[r] = _mm256_loadu_ps(sums + 16 * r);
    high[r] = _mm256_loadu_ps(sums + 16 * r + 8);
  }
#pragma GCC unroll 2
  for (int64_t p = 0; p < pairs; ++p) {
    const float* line = lines + p * 32;
    __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);  // the even input
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 in = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      low[r] = _mm256_fmadd_ps(w0, in, low[r]);
      high[r] = _mm256_fmadd_ps(w1, in, high[r]);
    }
    w0 = _mm256_loadu_ps(line + 16);  // the odd one
    w1 = _mm256_loadu_ps(line + 24);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 in = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
      low[r] = _mm256_fmadd_ps(w0, in, low[r]);
      high[r] = _mm256_fmadd_ps(w1, in, high[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + 16 * r, low[r]);
    _mm256_storeu_ps(sums + 16 * r + 8, high[r]);
  }
}

template <int R>
void fma_segment_tile_of(const float* lines, int64_t pairs, const float* x, int64_t ldx,
                         float* sums, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return fma_segment_tile_of<R - 1>(lines, pairs, x, ldx, sums, rows);
  }
  fma_segment_tile<R>(lines, pairs, x, ldx, sums);
}

// Every row for the blocks [begin, end): rows in near-equal tiles of at most 6, 12 sums each.
void fma_segment_blocks_rows(const Avx2Operands& o, int64_t rows, int64_t begin, int64_t end) {
  constexpr int64_t R = 6;
  thread_local std::vector<float> lines(kSegmentPairs * 32);
  thread_local std::vector<float> sums;
  sums.resize(rows * 16);
  const int64_t num_tiles = (rows + R - 1) / R;
  for (int64_t b = begin; b < end; ++b) {
    std::fill(sums.begin(), sums.end(), 0.f);
    for (int64_t p = 0; p < o.pairs; p += kSegmentPairs) {
      const int64_t pairs = std::min(kSegmentPairs, o.pairs - p);
      const at::BFloat16* segment = o.weight + b * o.block_stride + p * 32;
      fma_convert_segment(segment, pairs, lines.data());
      // the weights after this segment (the next block's first segment after a block's last),
      // asked for while the tiles run
      const char* next = reinterpret_cast<const char*>(segment + pairs * 32);
      for (int64_t line = 0; line < kSegmentPairs * 64; line += 64) {
        _mm_prefetch(next + line, _MM_HINT_T1);
      }
      for (int64_t t = 0, row = 0; t < num_tiles; ++t) {
        const int64_t tile_rows = (rows - row) / (num_tiles - t);
        fma_segment_tile_of<R>(lines.data(), pairs, o.x + row * o.ldx + 2 * p, o.ldx,
                               sums.data() + row * 16, tile_rows);
        row += tile_rows;
      }
    }
    const __m256 bias_low = o.bias != nullptr ? load_bf16x8(o.bias + 16 * b) : _mm256_setzero_ps();
    const __m256 bias_high =
        o.bias != nullptr ? load_bf16x8(o.bias + 16 * b + 8) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* out = o.y + r * o.ldy + 16 * b;
      const float* sum = sums.data() + 16 * r;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                       round_to_bf16(_mm256_add_ps(_mm256_loadu_ps(sum), bias_low)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8),
                       round_to_bf16(_mm256_add_ps(_mm256_loadu_ps(sum + 8), bias_high)));
    }
  }
}

// One row, one block at a time (the one-row kernel's way on this build): each block's pairs as one
// stream in four chains (p mod 4), the weights asked for kFmaGemvAhead bytes ahead. Its sums are in
// another order than fma_tile's, so some outputs' last bits differ.
constexpr int64_t kFmaGemvAhead = 4096;

void fma_gemv_blocks(const Avx2Operands& o, int64_t begin, int64_t end) {
  constexpr int64_t ahead = kFmaGemvAhead / sizeof(at::BFloat16);
  const __m256i odd_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t block = begin; block < end; ++block) {
    const at::BFloat16* weight = o.weight + block * o.block_stride;
    __m256 sums[4][2];
    for (int c = 0; c < 4; ++c) sums[c][0] = sums[c][1] = _mm256_setzero_ps();
    const auto add_pair = [&](int c, int64_t p) {
      const __m256 even = _mm256_broadcast_ss(o.x + 2 * p);
      const __m256 odd = _mm256_broadcast_ss(o.x + 2 * p + 1);
      for (int h = 0; h < 2; ++h) {
        const __m256i line =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight + p * 32 + 16 * h));
        const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
        const __m256 high = _mm256_castsi256_ps(_mm256_and_si256(line, odd_half));
        sums[c][h] = _mm256_fmadd_ps(high, odd, _mm256_fmadd_ps(low, even, sums[c][h]));
      }
    };
    int64_t p = 0;
    for (; p + 4 <= o.pairs; p += 4) {
      for (int c = 0; c < 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(weight + p * 32 + ahead + 32 * c), _MM_HINT_T0);
        add_pair(c, p + c);
      }
    }
    for (; p < o.pairs; ++p) add_pair(0, p);
    for (int h = 0; h < 2; ++h) {
      const int64_t first = 16 * block + 8 * h;
      __m256 sum = _mm256_add_ps(_mm256_add_ps(sums[0][h], sums[1][h]),
                                 _mm256_add_ps(sums[2][h], sums[3][h]));
      if (o.bias != nullptr) sum = _mm256_add_ps(sum, load_bf16x8(o.bias + first));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o.y + first), round_to_bf16(sum));
    }
  }
}

// Calls of up to this many inputs in all (a decode step's) convert x into a buffer the calling
// thread keeps; larger ones into a new tensor.
constexpr int64_t kFmaKeptFloats = 16384;

void fma_linear(const at::BFloat16* weight, const at::Tensor& x, const at::BFloat16* bias,
                at::BFloat16* y, int64_t rows, int64_t blocks, int64_t pairs, int64_t kernel) {
  const int64_t count = rows * pairs * 2;
  thread_local std::vector<float> kept(kFmaKeptFloats);
  at::Tensor converted;
  float* xf = kept.data();
  if (count > kFmaKeptFloats) {
    converted = x.to(at::kFloat);
    xf = converted.data_ptr<float>();
  } else {
    const at::BFloat16* in = x.data_ptr<at::BFloat16>();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(xf + i, load_bf16x8(in + i));
    for (; i < count; ++i) xf[i] = static_cast<float>(in[i]);
  }
  const Avx2Operands o{weight, xf, bias, y, pairs, pairs * 32, pairs * 2, blocks * 16};
  if (kernel == kFmaOneRow) {  // one block at a time
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      fma_gemv_blocks(o, begin, end);
    });
    return;
  }
  // One row: four blocks a tile (eight chains, each weight used once). More: one block, up to 4
  // rows a tile (8 accumulators, with the weight lines and their halves in registers; each weight
  // line serves every row of the tile), or with kFmaSegments its float32 segments and up to 6 rows
  // a tile; the rows in chunks whose float32 inputs fit kFmaChunkBytes, every block of a thread's
  // share for one chunk before the next: the chunk stays in the core's L2 cache while the weights
  // pass.
  const int64_t group = rows == 1 ? 4 : 1;
  const int64_t chunk_bytes = kernel == kFmaSegments ? kFmaSegmentChunkBytes : kFmaChunkBytes;
  const int64_t chunk = std::max<int64_t>(24, chunk_bytes / (8 * pairs) / 4 * 4);
  at::parallel_for(0, (blocks + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = group * begin, last = std::min(group * end, blocks);
    if (rows == 1 && kernel == kFma) return fma_blocks_rows<4, 1>(o, rows, first, last);
    for (int64_t row = 0; row < rows; row += chunk) {
      Avx2Operands part = o;
      part.x += row * o.ldx;
      part.y += row * o.ldy;
      const int64_t part_rows = std::min(chunk, rows - row);
      if (kernel == kFmaSegments) {
        fma_segment_blocks_rows(part, part_rows, first, last);
      } else {
        fma_blocks_rows<1, 4>(part, part_rows, first, last);
      }
    }
  });
}
#endif

// Upper ends of the buckets of rows per call that kernel_by_bucket indexes (the last: any more).
constexpr int64_t kRowBucketEnds[] = {1, 8, 32, 128, 1024};

int64_t row_bucket(int64_t rows) {
  int64_t bucket = 0;
  for (const int64_t end : kRowBucketEnds) {
    if (rows <= end) return bucket;
    ++bucket;
  }
  return bucket;
}

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool amx_supported() {
#if defined(LLMRPC_AMX_BF16)
  return amx_permitted();
#else
  return false;
#endif
}

bool fma_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef kernel_by_bucket) {
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.size(2) == 16 &&
                  weight.size(3) == 2,
              "bf16_linear: weight must be contiguous bfloat16 [out / 16, in / 2, 16, 2]");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be a contiguous [rows, in_features] bfloat16 tensor");
  const int64_t rows = x.size(0), blocks = weight.size(0), pairs = weight.size(1);
  TORCH_CHECK(x.size(1) == 2 * pairs, "bf16_linear: x has ", x.size(1),
              " features, the weight takes ", 2 * pairs);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16 && bias->size(0) == blocks * 16,
                "bf16_linear: bias must be a contiguous bfloat16 vector of ", blocks * 16);
  }
  TORCH_CHECK(kernel_by_bucket.empty() || kernel_by_bucket.size() == 6,
              "bf16_linear: kernel_by_bucket takes 6 kernels, one per bucket of rows");
  const int64_t fallback = supported() ? kDotProducts : kFma;
  const int64_t kernel =
      kernel_by_bucket.empty() ? fallback : kernel_by_bucket[row_bucket(rows)];
  TORCH_CHECK(kernel >= kDotProducts && kernel <= kFmaSegments, "bf16_linear: kernel ", kernel,
              " is none of 0 (dot products), 1 (AMX tiles), 2 (one row), 3 (AVX2 FMA), 4 (AVX2 "
              "FMA, one row), 5 (AVX2 FMA, float32 segments)");
  const bool fma = kernel == kFma || kernel == kFmaOneRow || kernel == kFmaSegments;
  TORCH_CHECK(fma || supported(), "bf16_linear: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(!fma || fma_supported(), "bf16_linear: this build has no AVX2 kernel");
  TORCH_CHECK(kernel != kAmxTiles || (amx_supported() && pairs % 16 == 0),
              "bf16_linear: the AMX kernel needs AMX-BF16 and inputs in multiples of 32");
  auto y = at::empty({rows, blocks * 16}, x.options());
  // No rows (a step that pools and takes no logits) fall in the first bucket: whichever kernel
  // it names, there is nothing to compute.
  if (rows == 0) return y;
  const llmrpc_cpu::KernelThreadsScope threads;
  TORCH_CHECK((kernel != kOneRow && kernel != kFmaOneRow) || rows == 1,
              "bf16_linear: the one-row kernel takes one row, not ", rows);
#if defined(__AVX2__) && defined(__FMA__)
  if (fma) {
    fma_linear(weight.data_ptr<at::BFloat16>(), x,
               bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
               y.data_ptr<at::BFloat16>(), rows, blocks, pairs, kernel);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  const Operands o{weight.data_ptr<at::BFloat16>(),
                   x.data_ptr<at::BFloat16>(),
                   bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
                   y.data_ptr<at::BFloat16>(),
                   pairs,
                   pairs * 32,
                   pairs * 2,
                   blocks * 16};
#if defined(LLMRPC_AMX_BF16)
  if (kernel == kAmxTiles) {  // threads take pairs of blocks
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      amx_blocks_rows(o, rows, 2 * begin, std::min(2 * end, blocks));
    });
    return y;
  }
#endif
  // Many rows: each thread takes every block for its share of the rows (a split by blocks
  // leaves one thread a group more where the groups do not divide evenly). A row's sums are the
  // same whichever tile or thread computes it.
  const int64_t parts = rows >= kRowSplitMin ? at::get_num_threads() : 1;
  if (parts > 1) {
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first = rows * t / parts, last = rows * (t + 1) / parts;
        Operands part = o;
        part.x += first * o.ldx;
        part.y += first * o.ldy;
        blocks_rows<4, 6>(part, last - first, 0, blocks);
      }
    });
    return y;
  }
  // Threads take groups of 4 blocks.
  at::parallel_for(0, (blocks + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = 4 * begin, last = std::min(4 * end, blocks);
    if (kernel == kOneRow) {
      gemv_blocks(o, first, last);
    } else if (rows > 6 && rows <= 12) {
      blocks_rows<2, 12>(o, rows, first, last);
    } else {
      blocks_rows<4, 6>(o, rows, first, last);
    }
  });
#endif
  return y;
}

}  // namespace

namespace llmrpc_cpu {

bool amx_bf16_available() { return amx_supported(); }

void amx_bf16_blocks(const at::BFloat16* weight, int64_t pairs, int64_t num_blocks,
                     const at::BFloat16* x, at::BFloat16* y, int64_t ldy, int64_t rows) {
#if defined(LLMRPC_AMX_BF16)
  const Operands o{weight, x, nullptr, y, pairs, pairs * 32, pairs * 2, ldy};
  amx_blocks_rows(o, rows, 0, num_blocks);
#else
  TORCH_CHECK(false, "amx_bf16_blocks: this build has no AMX tile kernel");
#endif
}

}  // namespace llmrpc_cpu

TORCH_LIBRARY_FRAGMENT(llmrpc_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias, int[] kernel_by_bucket=[]) -> Tensor");
  m.def("bf16_linear_supported() -> bool", &supported);
  m.def("bf16_amx_supported() -> bool", &amx_supported);
  m.def("bf16_fma_supported() -> bool", &fma_supported);
}

TORCH_LIBRARY_IMPL(llmrpc_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}

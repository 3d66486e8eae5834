// y = x W^T (+ b) in bfloat16 on AVX512_BF16's pair dot product (VDPBF16PS: exact products,
// float32 sums), the weight packed once so that each 64-byte load holds two K-neighbours of 16
// output columns ([N/16, K/2, 16, 2]). On SmolLM2's projections it beat zentorch's prepacked bf16
// GEMM at every row count up to a few hundred (16 rows: 14.5 vs 15.5-19 ms for 30 layers' weights
// read from memory) and matched it at 2,048 (BENCHMARKS.md); its sums are the same to the bit there.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>

namespace {

constexpr int64_t kCols = 16;    // output columns per packed block: one zmm of float32 sums
constexpr int kTileBlocks = 2;   // blocks of 16 columns per tile ...
constexpr int kTileRows = 8;     // ... times rows of x: 16 accumulators, no spills
constexpr int64_t kRowChunk = 64;  // rows per task, so that long prefills spread over threads
// Calls of up to kFewRows rows (decodes) stream each weight from memory once, in the first tile's
// pass over its column group: there, tiles of 12 rows (24 accumulators, more sums per weight byte)
// and a prefetch into L2 kFewRowsPrefetch steps of K ahead (one 64-byte line a block a step) keep
// that stream ahead of the sums. In-engine, steps of 8 and 16 decodes took 0.92-0.94x and
// 0.93-0.98x the time on 2 Zen 4 cores with an L1 prefetch 8 lines ahead; on a 286-token prefill
// (weights in cache after the first tile) both cost 3.5% (BENCHMARKS.md). Into L2 and 64 lines
// ahead, 30 layers' projections alone at 8 and 16 rows took 0.76-0.87x and 0.83-0.91x the time of
// that (32-96 lines ahead within 8% of each other), but whole steps only 0.92-0.99x and 0.97-1.01x.
constexpr int64_t kFewRows = 32;
constexpr int kFewRowsTileRows = 12;
constexpr int64_t kFewRowsPrefetch = 64;

#if defined(__AVX512BF16__)
// MR rows x NR column blocks over all of K. (The unroll pragmas keep the accumulators in registers:
// without them GCC 12 keeps the array on the stack.)
template <int MR, int NR, bool PREFETCH>
void tile(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w, const float* bias, uint16_t* y,
          int64_t ldy) {
  __m512 acc[MR * NR];
#pragma GCC unroll 24
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t block_stride = k * kCols;
  for (int64_t kk = 0; kk < k; kk += 2) {
    __m512bh wv[NR];
#pragma GCC unroll 2
    for (int n = 0; n < NR; ++n) {
      if constexpr (PREFETCH)  // past the block's end on the last steps: a prefetch never faults
        _mm_prefetch(reinterpret_cast<const char*>(w + n * block_stride + (kk + 2 * kFewRowsPrefetch) * kCols),
                     _MM_HINT_T1);
      wv[n] = (__m512bh)_mm512_loadu_si512(w + n * block_stride + kk * kCols);
    }
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * ldx + kk));
#pragma GCC unroll 2
      for (int n = 0; n < NR; ++n) acc[m * NR + n] = _mm512_dpbf16_ps(acc[m * NR + n], wv[n], a);
    }
  }
#pragma GCC unroll 2
  for (int n = 0; n < NR; ++n) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + n * kCols) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m)  // round to nearest even, as torch's bf16 output
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n * kCols),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m * NR + n], b)));
  }
}

template <int NR, bool PREFETCH>
void row_tile(int64_t rows, const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w, const float* bias,
              uint16_t* y, int64_t ldy) {
  switch (rows) {
    case 1: return tile<1, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 2: return tile<2, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 3: return tile<3, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 4: return tile<4, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 5: return tile<5, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 6: return tile<6, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 7: return tile<7, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 8: return tile<8, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 9: return tile<9, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 10: return tile<10, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    case 11: return tile<11, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
    default: return tile<12, NR, PREFETCH>(x, ldx, k, w, bias, y, ldy);
  }
}

// A tile over the group's nr (1 or 2) blocks.
template <bool PREFETCH>
void group_tile(int64_t nr, int64_t rows, const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w,
                const float* bias, uint16_t* y, int64_t ldy) {
  if (nr == 2) row_tile<2, PREFETCH>(rows, x, ldx, k, w, bias, y, ldy);
  else row_tile<1, PREFETCH>(rows, x, ldx, k, w, bias, y, ldy);
}
#endif

}  // namespace

bool bf16_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w [N, K] bfloat16, N a multiple of 16 and K of 2 -> [N / 16, K / 2, 16, 2] bfloat16.
at::Tensor bf16_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bfloat16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kCols == 0 && k % 2 == 0, "N must be a multiple of 16 and K even, got ", n, " x ", k);
  return w.contiguous().view({n / kCols, kCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16 (rows contiguous); packed from bf16_pack_weight; bias [N] float32 or None.
// Returns [M, N] bfloat16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_supported(), "bf16_linear needs a CPU with AVX512_BF16 (built with -march=native)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(3) == 2, "packed must come from bf16_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(packed.size(1) * 2 == k, "x has ", k, " columns, the weight ", packed.size(1) * 2);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias must be [N] float32");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  auto y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__AVX512BF16__)
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w_ptr = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* y_ptr = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* b_ptr = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0);
  const int64_t blocks = n / kCols;
  const int64_t groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t chunks = (m + kRowChunk - 1) / kRowChunk;
  const bool few_rows = m <= kFewRows;
  // Few rows split evenly over the fewest tiles of at most kFewRowsTileRows (13: 7 + 6, not 12 + 1): a
  // tile of a row or two runs its pass over the weights at a fraction of the rate. 30 layers'
  // projections, alone: 13 and 25 rows 0.89-0.96x and 0.93x the time, 28-32 rows 0.96-0.97x (Zen 4).
  const int64_t few_row_tiles = std::max<int64_t>(1, (m + kFewRowsTileRows - 1) / kFewRowsTileRows);
  const int64_t tile_rows = few_rows ? (m + few_row_tiles - 1) / few_row_tiles : kTileRows;
  // Tasks are (column group, row chunk), group-major: a thread's consecutive tasks reuse a group's
  // weights from its cache.
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = task / chunks, chunk = task % chunks;
      const int64_t block = group * kTileBlocks, nr = std::min<int64_t>(kTileBlocks, blocks - block);
      const uint16_t* w = w_ptr + block * k * kCols;
      const float* b = b_ptr ? b_ptr + block * kCols : nullptr;
      const int64_t row_end = std::min(m, (chunk + 1) * kRowChunk);
      for (int64_t r = chunk * kRowChunk; r < row_end; r += tile_rows) {
        const int64_t rows = std::min<int64_t>(tile_rows, row_end - r);
        uint16_t* out = y_ptr + r * n + block * kCols;
        if (few_rows) group_tile<true>(nr, rows, x_ptr + r * ldx, ldx, k, w, b, out, n);
        else group_tile<false>(nr, rows, x_ptr + r * ldx, ldx, k, w, b, out, n);
      }
    }
  });
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("bf16_linear_supported() -> bool");
  m.def("bf16_pack_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) {
  m.impl("bf16_pack_weight", &bf16_pack_weight);
  m.impl("bf16_linear", &bf16_linear);
}

TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) { m.impl("bf16_linear_supported", &bf16_linear_supported); }

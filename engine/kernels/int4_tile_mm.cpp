// y = x W^T in bfloat16 for a weight kept in 4 bits as GGML's Q4_0/Q4_1 store it (w = q * d + m, q in
// 0..15, one float16 d and m per group of 32 along K), on AVX512_BF16's pair dot product. For the
// few-row calls of a bf16 model (decodes), which read every weight from memory once: 4.6 bits a
// weight against bf16's 16. torch's int4 CPU kernel served these before; on 2 Zen 5 cores this one
// takes 0.75x its time at one row and 0.56x at eight, and beats the dense bf16 GEMM up to 16 rows,
// where its sums rather than the weights' bytes bound it (BENCHMARKS.md). Where the CPU has AMX, calls
// of 3 rows and more run each group's products on the tile unit instead (below), up to 32 rows.
//
// The nibbles turn into bf16 without a table: 0x4300 | q is the bf16 of 128 + q (exponent 2^7, q in
// the low mantissa bits), so each 64-byte line of the packed weight gives four VDPBF16PS operands
// with a mask, an OR and a shift each. The sums of (128 + q) x are corrected once a group:
//   y[r, n] = sum_g d[n, g] * S[r, n, g] + (m[n, g] - 128 d[n, g]) * X[r, g],
//   S = sum_i (128 + q[n, g, i]) x[r, g, i],  X = sum_i x[r, g, i].
// Exact products, float32 sums (the 128 offset costs about 2^-17 of a group's sum of |x| d).
//
// Packed layout ([N / 16, K / 32, 320] uint8), per block of 16 output columns and group of 32 along K:
// four lines of 32 uint16 words, then the group's 16 d and 16 m as float16. Word j of line c belongs
// to column j / 2 and holds, in bits 4i..4i+3, q at k = 8c + 2i + (j % 2): nibble i of the four lines
// is operand 4c + i, the pair of K-neighbours (2p, 2p + 1) for each of the 16 columns.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"
#include "group_dot_rows.h"
#include "group_tiles.h"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;
constexpr int64_t kBlockBytes = 320;  // 4 lines of 64 B, then 16 float16 d and 16 float16 m
constexpr int64_t kRowBlock = 6;  // rows at most a pass over a column block's weights: 12 + 6 accumulators
// The weights stream from memory once a call, in the first row block's pass: a prefetch into L2 this
// far ahead (8 KB; the stream runs on into the next column blocks) took 30 layers' projections at one
// row from 2.06 to 1.77 ms (2 Zen 5 cores; 1, 2 and 4 KB gained less, 16 and 32 KB no more).
constexpr int64_t kPrefetchBytes = 128 * 64;

#if defined(__AVX512BF16__)
// R rows x one block of 16 columns over all of K. Each row keeps CH independent sums a group, so
// that the dot products' latency is hidden: 4 at one row, 2 beyond (1 at 8-16 rows was up to 8% slower).
template <int R>
void block_rows(const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w, uint16_t* y,
                int64_t ldy) {
  constexpr int CH = R == 1 ? 4 : 2;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  __m512 acc[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kBlockBytes;
#pragma GCC unroll 5
    for (int line = 0; line < 5; ++line)  // past the weight's end on the last groups: a prefetch never faults
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line * 64), _MM_HINT_T1);
    zenserve::GroupRowSums<R, CH> sums;
#pragma GCC unroll 4
    for (int line = 0; line < 4; ++line) {
      const __m512i words = _mm512_loadu_si512(blk + line * 64);
      __m512bh op[4];  // 0xEA: (a & b) | c
      op[0] = (__m512bh)_mm512_ternarylogic_epi32(words, low4, bf16_128, 0xEA);
      op[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), low4, bf16_128, 0xEA);
      op[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), low4, bf16_128, 0xEA);
      op[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 12), bf16_128);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int p = 4 * line + i;
        sums.add(op[i], x, ldx, g * kGroup + 2 * p, p);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    const __m512 offset_min = _mm512_fmadd_ps(d, minus128, m);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(d, sums.row(r), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset_min, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  zenserve::store_rows_bf16<R>(acc, y, ldy);
}

void block(int64_t rows, const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w,
           uint16_t* y, int64_t ldy) {
  switch (rows) {
    case 1: return block_rows<1>(x, ldx, xsum, groups, w, y, ldy);
    case 2: return block_rows<2>(x, ldx, xsum, groups, w, y, ldy);
    case 3: return block_rows<3>(x, ldx, xsum, groups, w, y, ldy);
    case 4: return block_rows<4>(x, ldx, xsum, groups, w, y, ldy);
    case 5: return block_rows<5>(x, ldx, xsum, groups, w, y, ldy);
    default: return block_rows<6>(x, ldx, xsum, groups, w, y, ldy);
  }
}

// X[r, g] = sum of row r's 32 values in group g, in float32: the minima's term.
void group_sums(const uint16_t* x, int64_t ldx, int64_t rows, int64_t groups, float* xsum) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i v = _mm512_loadu_si512(x + r * ldx + g * kGroup);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      xsum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
}
#endif

#if defined(ZENSERVE_AMX)
// On AMX (Intel Xeon since Sapphire Rapids) a group's products run on the tile unit: the four lines'
// 16 operands, 32 bits a column each, are a B tile as they stand (row p: the K pair 2p, 2p + 1 of every
// column), so a group of up to 16 rows is one TDPBF16PS instead of 16 VDPBF16PS a row. Its sums S
// (exact products, float32 sums) are stored and scaled into the rows' accumulators as above. SmolLM2's
// projections x 30 layers, weights from memory, 2 Xeon cores: 3.7 / 4.3 / 6.1 / 9.9 ms at 4 / 8 / 16 /
// 32 rows, against 5.7 / 11.1 / 19.9 / 39 on VDPBF16PS and 13 / 13 / 13.4 / 15.3 on oneDNN's AMX GEMM
// over the bf16 weights, which wins from about 48 rows (BENCHMARKS.md). At 1-2 rows VDPBF16PS is
// ahead (3.5 vs 4.2 ms at one row). The rows' accumulators held in registers, and the tile unit kept
// busy while the pair of groups before is scaled, took 16 rows from 4.8 to 3.9 ms (weights in L3).
// What is left is mostly the tile traffic (a group's weights stored and loaded as a tile, its sums
// stored back: about 2.4 ms at 16 rows) and the unpacking (0.8).
constexpr int64_t kAmxMinRows = 3;
constexpr int64_t kAmxRows = 16;  // rows a pass over a column block: A and C tiles of up to 16 rows

using zenserve::amx_permitted;

// A group's weights as a B tile: 16 rows of 64 bytes, the bf16 of 128 + q.
inline void unpack_group(const uint8_t* blk, uint16_t* tile) {
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
#pragma GCC unroll 4
  for (int line = 0; line < 4; ++line) {
    const __m512i words = _mm512_loadu_si512(blk + line * 64);
    uint16_t* row = tile + 4 * line * 32;
    _mm512_store_si512(row, _mm512_ternarylogic_epi32(words, low4, bf16_128, 0xEA));
    _mm512_store_si512(row + 32, _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), low4, bf16_128, 0xEA));
    _mm512_store_si512(row + 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), low4, bf16_128, 0xEA));
    _mm512_store_si512(row + 96, _mm512_or_si512(_mm512_srli_epi16(words, 12), bf16_128));
  }
}

// R rows (3-16) x one block of 16 columns over all of K, the tiles configured for R rows
// (zenserve::configure_group_tiles(R)); the pipeline is group_tiles.h's. Each pair of groups is unpacked as
// it goes to the tile unit, and the pair before's sums are scaled into the rows' accumulators, held in registers.
template <int R>
void block_rows_amx(const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w,
                    uint16_t* y, int64_t ldy) {
  alignas(64) uint16_t unpacked[2][16 * 32];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  auto weights = [&](int64_t g, int slot) -> const uint16_t* {
    const uint8_t* blk = w + g * kBlockBytes;
    if (slot == 0) zenserve::prefetch_weight_lines(blk, 10);  // the pair's 640 bytes, 8 KB ahead
    unpack_group(blk, unpacked[slot]);
    return unpacked[slot];
  };
  auto scale = [&](const float* s, int64_t g) {
    const uint8_t* blk = w + g * kBlockBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    const __m512 offset_min = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.f), m);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(d, _mm512_load_ps(s + r * kCols), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset_min, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  };
  zenserve::tile_group_pairs(x, ldx * static_cast<int64_t>(sizeof(uint16_t)), groups, weights, scale);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using BlockRowsAmx = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, uint16_t*, int64_t);

template <int... Rs>
constexpr std::array<BlockRowsAmx, sizeof...(Rs)> amx_kernels(std::integer_sequence<int, Rs...>) {
  return {&block_rows_amx<Rs + 1>...};
}
// Index rows - 1; 1 and 2 rows are never sent here (kAmxMinRows) but instantiate harmlessly.
constexpr auto kBlockRowsAmx = amx_kernels(std::make_integer_sequence<int, 16>{});
#endif

#if defined(__AVX512BF16__)
// One column block and group of packed as the bf16 weights w = q d + m, row p of `rows` holding the K pair
// (2p, 2p + 1) of the 16 columns ([16 pairs][16 columns][2], AMX's B-tile order). q d is exact in float32
// (an 11-bit d times a 4-bit q), so the fused multiply-add rounds once, as GGML's float32 dequantization
// (d q, then + m) does; rounded to bf16 (nearest even) these are the dense bf16 model's weights to the bit.
inline void dequantize_group(const uint8_t* blk, uint16_t* rows) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
  // An operand's 32 words are column j / 2's K neighbour j % 2: each column's d and m twice over.
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 d0 = _mm512_permutexvar_ps(first, d), d1 = _mm512_permutexvar_ps(second, d);
  const __m512 m0 = _mm512_permutexvar_ps(first, m), m1 = _mm512_permutexvar_ps(second, m);
  const __m512i low4 = _mm512_set1_epi16(0x000F);
#pragma GCC unroll 4
  for (int line = 0; line < 4; ++line) {
    const __m512i words = _mm512_loadu_si512(blk + line * 64);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i q = _mm512_and_si512(_mm512_srli_epi16(words, 4 * i), low4);
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
      uint16_t* row = rows + (4 * line + i) * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(q0, d0, m0)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(q1, d1, m1)));
    }
  }
}
#endif

}  // namespace

bool int4_tile_mm_supported() {
#if defined(__AVX512BF16__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

// Whether int4_tile_mm runs calls of kAmxMinRows rows and more on AMX's tiles here: built for a CPU
// with AMX, and the kernel lets this process use them.
bool int4_tile_mm_uses_amx() {
#if defined(__F16C__) && defined(ZENSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// q [N, K] uint8 in 0..15; d, m [N, K / 32] float32 holding float16 values exactly -> [N / 16, K / 32, 320].
at::Tensor int4_tile_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q must be [N, K] uint8");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kGroup == 0, "N must be a multiple of 16 and K of 32, got ", n, " x ", k);
  TORCH_CHECK(q.max().item<uint8_t>() <= 15, "q must hold values in 0..15");
  const int64_t blocks = n / kCols, groups = k / kGroup;
  for (const at::Tensor* s : {&d, &m}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->sizes() == at::IntArrayRef({n, groups}),
                "d and m must be [N, K / 32] float32");
    TORCH_CHECK(s->to(at::kHalf).to(at::kFloat).equal(*s), "d and m must hold float16 values exactly");
  }
  // [blocks, 16 columns, groups, 4 lines, 4 nibbles, 2 neighbours] -> words [blocks, groups, lines, 16, 2]
  const at::Tensor v = q.to(at::kInt).view({blocks, kCols, groups, 4, 4, 2}).permute({0, 2, 3, 1, 5, 4});
  const at::Tensor shifts = at::arange(0, 16, 4, q.options().dtype(at::kInt));
  const at::Tensor words = v.bitwise_left_shift(shifts).sum(-1, false, at::kInt);  // < 2^16
  // int16 with the same 16 bits (little-endian bytes), as the kernel loads them
  const at::Tensor word_bytes = words.sub(words.ge(32768).to(at::kInt).mul(65536)).to(at::kShort).contiguous()
                                    .view(at::kByte).view({blocks, groups, 256});
  auto per_block = [&](const at::Tensor& s) {
    return s.to(at::kHalf).view({blocks, kCols, groups}).permute({0, 2, 1}).contiguous().view(at::kByte)
        .view({blocks, groups, 32});
  };
  return at::cat({word_bytes, per_block(d), per_block(m)}, -1).contiguous();
}

// x [M, K] bfloat16 (rows contiguous); packed from int4_tile_pack. Returns [M, N] bfloat16.
at::Tensor int4_tile_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(int4_tile_mm_supported(), "int4_tile_mm needs a CPU with AVX512_BF16 (built with -march=native)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockBytes, "packed must come from int4_tile_pack");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(groups * kGroup == k, "x has ", k, " columns, the weight ", groups * kGroup);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  auto y = at::empty({rows, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__AVX512BF16__) && defined(__F16C__)
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  auto* y_ptr = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  std::vector<float> xsum(static_cast<size_t>(rows * groups));
  group_sums(x_ptr, ldx, rows, groups, xsum.data());
  const float* s_ptr = xsum.data();
#if defined(ZENSERVE_AMX)
  if (rows >= kAmxMinRows && amx_permitted()) {
    // A task is a column block over every row, kAmxRows at a time (the tiles configured once a task
    // per pass; for 17-32 rows a task's weights, at most about 0.6 MB on SmolLM2, are read twice).
    at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < rows; r += kAmxRows) {
        const int64_t pass = std::min(kAmxRows, rows - r);
        zenserve::configure_group_tiles(pass);
        const BlockRowsAmx kernel = kBlockRowsAmx[pass - 1];
        for (int64_t b = begin; b < end; ++b)
          kernel(x_ptr + r * ldx, ldx, s_ptr + r * groups, groups, w_ptr + b * groups * kBlockBytes,
                 y_ptr + r * n + b * kCols, n);
      }
      _tile_release();
    });
    return y;
  }
#endif
  // A task is a column block over every row: its weights (groups * 320 B, at most 15 KB on SmolLM2)
  // come from memory once and stay in L1 for the later row blocks, which split the rows evenly
  // (8 rows: 4 + 4, not 6 + 2).
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t i = 0; i < row_blocks; ++i) {
        const int64_t r = rows * i / row_blocks, r_end = rows * (i + 1) / row_blocks;
        block(r_end - r, x_ptr + r * ldx, ldx, s_ptr + r * groups, groups, w_ptr + b * groups * kBlockBytes,
              y_ptr + r * n + b * kCols, n);
      }
  });
#endif
  return y;
}

// The bf16 weights of packed written into out, for a larger call's GEMM (compact weights keep no dense copy):
// out either [N, K] bfloat16 with contiguous rows, or an opaque oneDNN tensor from
// torch.ops.mkldnn._reorder_linear_weight of an [N, K] bf16 weight, whose layout on AMX is [N / 32][K / 2][32][2]
// (K pairs of 32 columns; engine/models/onednn_linear.py checks that against oneDNN's own reorder before relying
// on it). The blocked layout takes each row of a group's 16 x 32 as one 64-byte store.
void int4_tile_dequantize(const at::Tensor& packed, const at::Tensor& out) {
  TORCH_CHECK(int4_tile_mm_supported(), "int4_tile_dequantize needs a CPU with AVX512_BF16 (built with -march=native)");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockBytes && packed.device().is_cpu(), "packed must come from int4_tile_pack");
  const int64_t blocks = packed.size(0), groups = packed.size(1), n = blocks * kCols, k = groups * kGroup;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "out must be [", n, ", ", k, "] bfloat16");
#if defined(__AVX512BF16__) && defined(__F16C__)
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  const bool blocked = out.is_mkldnn();
  uint16_t* o_ptr;
  if (blocked) {
    static const auto data_ptr =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "").typed<int64_t(const at::Tensor&)>();
    static const auto nbytes =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "").typed<int64_t(const at::Tensor&)>();
    TORCH_CHECK(n % 32 == 0 && nbytes.call(out) == n * k * 2, "a blocked out must hold [N / 32][K / 2][32][2]");
    o_ptr = reinterpret_cast<uint16_t*>(data_ptr.call(out));
  } else {
    TORCH_CHECK(out.is_contiguous() && out.device().is_cpu(), "out must be contiguous");
    o_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  }
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t rows[16 * 32];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        dequantize_group(w_ptr + (b * groups + g) * kBlockBytes, rows);
        if (blocked) {
          uint16_t* dst = o_ptr + (b / 2) * 32 * k + g * 16 * 64 + (b % 2) * 32;
#pragma GCC unroll 16
          for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 64, _mm512_load_si512(rows + p * 32));
        } else {  // column c's pair p goes to row b * 16 + c, K 2p and 2p + 1
          for (int c = 0; c < 16; ++c) {
            uint32_t* dst = reinterpret_cast<uint32_t*>(o_ptr + (b * kCols + c) * k + g * kGroup);
            for (int p = 0; p < 16; ++p) dst[p] = reinterpret_cast<const uint32_t*>(rows + p * 32)[c];
          }
        }
      }
  });
#endif
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("int4_tile_mm_supported() -> bool");
  m.def("int4_tile_dequantize(Tensor packed, Tensor(a!) out) -> ()");
  m.def("int4_tile_mm_uses_amx() -> bool");
  m.def("int4_tile_pack(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("int4_tile_mm(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) {
  m.impl("int4_tile_pack", &int4_tile_pack);
  m.impl("int4_tile_mm", &int4_tile_mm);
  m.impl("int4_tile_dequantize", &int4_tile_dequantize);
}

// A blocked out is an opaque oneDNN tensor: its dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(zenserve, MkldnnCPU, m) { m.impl("int4_tile_dequantize", &int4_tile_dequantize); }

TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) {
  m.impl("int4_tile_mm_supported", &int4_tile_mm_supported);
  m.impl("int4_tile_mm_uses_amx", &int4_tile_mm_uses_amx);
}

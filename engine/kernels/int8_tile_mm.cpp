// y = x W^T in bfloat16 for a weight kept as GGML's Q8_0 stores it (int8 q, one float scale d per group
// of 32 along K), on AMX's tiles: a bf16 model's lm_head at decode batches (SmolLM2's is 49,152 x 576:
// 57 MB in bf16, 30 MB here), where oneDNN's bf16 GEMM is bound by reading its weight.
//
// Each group's 16-column block is one B tile: row p holds the K pair (2p, 2p + 1) of the 16 columns. The
// int8 values become bf16 exactly (|q| <= 128), so a group's sums S = sum_i q x are exact products with
// float32 sums, scaled once a group: y[r, n] = sum_g d[n, g] S[r, n, g] (int8_group_mm's arithmetic).
//
// Up to 16 rows the weights stream: each pair of groups is unpacked as it is used (weights from memory,
// 49152 x 576 at 16 rows: 1.72 ms; unpacked a column block at a time first, 2.1). More rows run in passes
// of 16 over a column block unpacked once.
//
// Where the CPU has AVX512_BF16 but no AMX (AMD Zen 4 and 5), the same sums run on VDPBF16PS: each K pair's
// 32 bytes widen to one operand of 16 columns' bf16 pairs, multiplied by the row's pair broadcast. The
// widening costs about as much as the dot products it feeds, so this pays only while the weight's bytes
// bound the call: SmolLM2's lm_head from memory, 2 Zen 4 cores, 0.97 / 0.97 / 1.09 ms at 1 / 2 / 4 rows
// against zentorch's bf16 GEMM's 1.76 / 1.72 / 1.23 and int8_group_mm's 1.13 / 1.29 / 1.97, but 1.96 against
// 1.58 at 8 (BENCHMARKS.md; the engine uses it up to 6 rows there: MAX_ROWS_INT8_TILES_DOT).
//
// Packed layout ([N / 16, K / 32, 576] uint8), per block of 16 columns and group of 32 along K: 16 rows
// of 32 bytes (byte 2c + s of row p: column c's q at k = 32g + 2p + s), then the 16 columns' d as float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"
#include "byte_tables.h"
#include "group_dot_rows.h"
#include "group_tiles.h"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;
constexpr int64_t kBlockBytes = 576;
constexpr int64_t kPassRows = 16;  // rows a pass over a column block: A and C tiles of up to 16 rows

#if defined(__AVX512VBMI__) && (defined(ZENSERVE_AMX) || defined(__AVX512BF16__))
// The bf16 bits of 0..127 (int8 values widen by magnitude; the sign is OR-ed in after).
inline constexpr zenserve::ByteToBf16Table kInt8ToBf16 = zenserve::make_byte_table([](int a) {
  if (a == 0) return 0;
  int e = 0;  // a = 2^e + f, f < 2^e: a's 7-bit mantissa is f shifted to the top
  while (a >> (e + 1)) ++e;
  return ((e + 127) << 7) | (((a - (1 << e)) << (7 - e)) & 0x7F);
});
#endif

#if defined(ZENSERVE_AMX) || defined(__AVX512BF16__)
// Rows 2 pair and 2 pair + 1 of a group (64 bytes) widened to bf16: 32 values each, a VDPBF16PS operand or
// two rows of an AMX B tile. With VBMI by table (byte_tables.h): 1 row and 16 rows of SmolLM2's lm_head on
// AMX in 0.85x and 0.88x the time of the float32 round trip below.
inline void widen_pair(const uint8_t* p, __m512i& first, __m512i& second) {
#if defined(__AVX512VBMI__)
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i minus128_high = _mm512_set1_epi8(static_cast<char>(0xC3));  // bf16(-128) = 0xC300
  const __m512i codes = zenserve::load_codes(p);
  const __m512i magnitude = _mm512_abs_epi8(codes);  // -128 stays 0x80, whose low seven bits look up 0
  __m512i high = _mm512_ternarylogic_epi32(zenserve::lookup_high(kInt8ToBf16, magnitude), codes, sign, 0xF8);
  high = _mm512_mask_mov_epi8(high, _mm512_movepi8_mask(magnitude), minus128_high);
  zenserve::interleave_words(zenserve::lookup_low(kInt8ToBf16, magnitude), high, first, second);
#else
  __m512i out[2];
  for (int i = 0; i < 2; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 32));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    out[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
  first = out[0];
  second = out[1];
#endif
}
#endif

#if defined(ZENSERVE_AMX)

// A group's int8 values as a B tile of bf16: 16 rows of 32.
inline void unpack_group(const uint8_t* blk, uint16_t* tile) {
#pragma GCC unroll 8
  for (int pair = 0; pair < 8; ++pair) {
    __m512i first, second;
    widen_pair(blk + pair * 64, first, second);
    _mm512_store_si512(tile + 2 * pair * 32, first);
    _mm512_store_si512(tile + (2 * pair + 1) * 32, second);
  }
}

// A column block's groups as B tiles, into `tiles` (groups x 16 x 32 bf16): once a call, however many
// passes of rows read them.
void unpack_block(const uint8_t* w, int64_t groups, uint16_t* tiles) {
  for (int64_t g = 0; g < groups; ++g) {
    zenserve::prefetch_weight_lines(w + g * kBlockBytes, 9);
    unpack_group(w + g * kBlockBytes, tiles + g * 16 * 32);
  }
}

// R rows (1-16) x one block of 16 columns over all of K, on group_tiles.h's pipeline: each pair of groups
// unpacked as it goes to the tile unit (`tiles` null), or read from `tiles` unpacked before, while the pair
// before is scaled into the accumulators, held in registers (as int4_tile_mm).
template <int R>
void block_rows(const uint16_t* x, int64_t ldx, int64_t groups, const uint8_t* w, const uint16_t* tiles, uint16_t* y,
                int64_t ldy) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) uint16_t local[2][16 * 32];
  auto weights = [&](int64_t g, int slot) -> const uint16_t* {
    if (tiles != nullptr) return tiles + g * 16 * 32;
    if (slot == 0) zenserve::prefetch_weight_lines(w + g * kBlockBytes, 18);  // the pair's 1,152 bytes, 8 KB ahead
    unpack_group(w + g * kBlockBytes, local[slot]);
    return local[slot];
  };
  auto scale = [&](const float* s, int64_t g) {
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(w + g * kBlockBytes + 512));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(d, _mm512_load_ps(s + r * kCols), acc[r]);
  };
  zenserve::tile_group_pairs(x, ldx * static_cast<int64_t>(sizeof(uint16_t)), groups, weights, scale);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)  // round to nearest even, as torch's bf16 output
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using BlockRows = void (*)(const uint16_t*, int64_t, int64_t, const uint8_t*, const uint16_t*, uint16_t*, int64_t);

template <int... Rs>
constexpr std::array<BlockRows, sizeof...(Rs)> row_kernels(std::integer_sequence<int, Rs...>) {
  return {&block_rows<Rs + 1>...};
}
constexpr auto kBlockRows = row_kernels(std::make_integer_sequence<int, kPassRows>{});  // index: rows - 1
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kDotRowBlock = 6;  // rows at most a VDPBF16PS pass: 12 partial sums + 6 accumulators
// The weights stream from memory in a block's first pass: prefetched into L2 this far ahead (as int4_tile_mm).
constexpr int64_t kPrefetchBytes = 128 * 64;

// R rows x one block of 16 columns over all of K on VDPBF16PS. Each row keeps CH independent sums a group,
// so that the dot products' latency is hidden (as int4_tile_mm).
template <int R>
void dot_block_rows(const uint16_t* x, int64_t ldx, int64_t groups, const uint8_t* w, uint16_t* y, int64_t ldy) {
  constexpr int CH = R == 1 ? 4 : 2;
  __m512 acc[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kBlockBytes;
#pragma GCC unroll 9
    for (int line = 0; line < 9; ++line)  // past the weight's end on the last groups: a prefetch never faults
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line * 64), _MM_HINT_T1);
    zenserve::GroupRowSums<R, CH> sums;
#pragma GCC unroll 8
    for (int pair = 0; pair < 8; ++pair) {
      __m512i op[2];
      widen_pair(blk + pair * 64, op[0], op[1]);
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const int p = 2 * pair + i;
        sums.add((__m512bh)op[i], x, ldx, g * kGroup + 2 * p, p);
      }
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 512));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(d, sums.row(r), acc[r]);
  }
  zenserve::store_rows_bf16<R>(acc, y, ldy);
}

void dot_block(int64_t rows, const uint16_t* x, int64_t ldx, int64_t groups, const uint8_t* w, uint16_t* y,
               int64_t ldy) {
  switch (rows) {
    case 1: return dot_block_rows<1>(x, ldx, groups, w, y, ldy);
    case 2: return dot_block_rows<2>(x, ldx, groups, w, y, ldy);
    case 3: return dot_block_rows<3>(x, ldx, groups, w, y, ldy);
    case 4: return dot_block_rows<4>(x, ldx, groups, w, y, ldy);
    case 5: return dot_block_rows<5>(x, ldx, groups, w, y, ldy);
    default: return dot_block_rows<6>(x, ldx, groups, w, y, ldy);
  }
}
#endif

}  // namespace

// Whether int8_tile_mm runs here: on AMX's tiles where the CPU has them and the kernel lets this process use
// them, else on VDPBF16PS where the CPU has AVX512_BF16.
bool int8_tile_mm_supported() {
#if defined(ZENSERVE_AMX)
  if (zenserve::amx_permitted()) return true;
#endif
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Whether int8_tile_mm runs on AMX's tiles here (the VDPBF16PS path pays only at a few rows: see above).
bool int8_tile_mm_uses_amx() {
#if defined(ZENSERVE_AMX)
  return zenserve::amx_permitted();
#else
  return false;
#endif
}

// q [N, K] int8; d [N, K / 32] float32 -> [N / 16, K / 32, 576].
at::Tensor int8_tile_pack(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q must be [N, K] int8");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kGroup == 0, "N must be a multiple of 16 and K of 32, got ", n, " x ", k);
  const int64_t blocks = n / kCols, groups = k / kGroup;
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.sizes() == at::IntArrayRef({n, groups}), "d must be [N, K / 32] float32");
  // [blocks, 16 columns, groups, 16 pairs, 2] -> [blocks, groups, 16 pairs, 16 columns, 2]
  const at::Tensor rows = q.view({blocks, kCols, groups, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous()
                              .view(at::kByte).view({blocks, groups, 512});
  const at::Tensor scales = d.contiguous().view({blocks, kCols, groups}).permute({0, 2, 1}).contiguous()
                                .view(at::kByte).view({blocks, groups, 64});
  return at::cat({rows, scales}, -1).contiguous();
}

// x [M, K] bfloat16 (rows contiguous); packed from int8_tile_pack. Returns [M, N] bfloat16.
at::Tensor int8_tile_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(int8_tile_mm_supported(), "int8_tile_mm needs AMX or AVX512_BF16 (built with -march=native on such a CPU)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlockBytes, "packed must come from int8_tile_pack");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(groups * kGroup == k, "x has ", k, " columns, the weight ", groups * kGroup);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  auto y = at::empty({rows, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(ZENSERVE_AMX) || defined(__AVX512BF16__)
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* w_ptr = packed.data_ptr<uint8_t>();
  auto* y_ptr = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
#endif
#if defined(ZENSERVE_AMX)
  if (zenserve::amx_permitted()) {
    // A task is a column block over every row, 16 at a time: streamed up to 16 rows, beyond unpacked once
    // for every pass. The tiles are configured a pass size at a time (at most two: 16 rows, then the rest).
    const bool unpack_once = rows > kPassRows;
    at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint16_t> tiles(unpack_once ? static_cast<size_t>(groups * 16 * 32) + 32 : 0);
      uint16_t* aligned = unpack_once ? tiles.data() + (32 - reinterpret_cast<uintptr_t>(tiles.data()) / 2 % 32) % 32 : nullptr;  // 64 B
      int64_t configured = 0;
      for (int64_t b = begin; b < end; ++b) {
        const uint8_t* wb = w_ptr + b * groups * kBlockBytes;
        if (unpack_once) unpack_block(wb, groups, aligned);
        for (int64_t r = 0; r < rows; r += kPassRows) {
          const int64_t pass = std::min(kPassRows, rows - r);
          if (pass != configured) {
            zenserve::configure_group_tiles(pass);
            configured = pass;
          }
          kBlockRows[pass - 1](x_ptr + r * ldx, ldx, groups, wb, aligned, y_ptr + r * n + b * kCols, n);
        }
      }
      _tile_release();
    });
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  // A task is a column block over every row: its weights (groups * 576 B, 10 KB on SmolLM2) come from memory
  // once and stay in L1 for the later passes, which split the rows evenly (as int4_tile_mm).
  const int64_t passes = (rows + kDotRowBlock - 1) / kDotRowBlock;
  at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t r = rows * i / passes, r_end = rows * (i + 1) / passes;
        dot_block(r_end - r, x_ptr + r * ldx, ldx, groups, w_ptr + b * groups * kBlockBytes, y_ptr + r * n + b * kCols, n);
      }
  });
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("int8_tile_mm_supported() -> bool");
  m.def("int8_tile_mm_uses_amx() -> bool");
  m.def("int8_tile_pack(Tensor q, Tensor d) -> Tensor");
  m.def("int8_tile_mm(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) {
  m.impl("int8_tile_pack", &int8_tile_pack);
  m.impl("int8_tile_mm", &int8_tile_mm);
}

TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) {
  m.impl("int8_tile_mm_supported", &int8_tile_mm_supported);
  m.impl("int8_tile_mm_uses_amx", &int8_tile_mm_uses_amx);
}

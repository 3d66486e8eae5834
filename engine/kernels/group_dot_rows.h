// A group's sums on VDPBF16PS for the few-row kernels over packed 4- and 8-bit weights (int4_tile_mm's and
// int8_tile_mm's paths without AMX): R rows against one block of 16 columns, each operand holding the 16
// columns' K pair p of the group as bf16 pairs. Each row keeps CH independent sums, so that the dot products'
// latency is hidden, added once a group.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>

namespace zenserve {

template <int R, int CH>
struct GroupRowSums {
  __m512 part[R][CH];

  GroupRowSums() {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < CH; ++c) part[r][c] = _mm512_setzero_ps();
  }

  // The group's K pair p (at k = the group's first + 2p in each row of x) times its operand.
  inline void add(__m512bh op, const uint16_t* x, int64_t ldx, int64_t k, int p) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + k));
      part[r][p % CH] = _mm512_dpbf16_ps(part[r][p % CH], op, a);
    }
  }

  inline __m512 row(int r) const {
    __m512 s = part[r][0];
#pragma GCC unroll 4
    for (int c = 1; c < CH; ++c) s = _mm512_add_ps(s, part[r][c]);
    return s;
  }
};

// The rows' float32 sums rounded to bf16 (nearest even, as torch's bf16 output), 16 columns a row.
template <int R>
inline void store_rows_bf16(const __m512 (&acc)[R], uint16_t* y, int64_t ldy) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

}  // namespace zenserve
#endif

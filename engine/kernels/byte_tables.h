// One-byte codes (float8 e4m3fn, int8) widened to bf16 bit patterns by table lookup, 64 at a time, where the
// CPU has AVX512_VBMI: VPERMT2B looks up each code's high and low bf16 byte in two 128-byte tables (indexed by
// the code's low seven bits), and two byte interleaves make the words. Six to eight instructions for 64
// values, against about twelve for the arithmetic widenings (int8 through float32) or twenty (fp8's bit
// shuffling), which the kernels that widen a row or a weight tile per use feel (BENCHMARKS.md).
#pragma once

#if defined(__AVX512VBMI__)
#include <immintrin.h>

#include <cstdint>

namespace zenserve {

// The high and low bytes of the bf16 bits of codes 0..127.
struct ByteToBf16Table {
  alignas(64) uint8_t high[128] = {};
  alignas(64) uint8_t low[128] = {};
};

// A table from a constexpr function of a code (0..127) to its bf16 bits.
template <typename BitsOf>
constexpr ByteToBf16Table make_byte_table(BitsOf bits_of) {
  ByteToBf16Table table;
  for (int code = 0; code < 128; ++code) {
    const int bits = bits_of(code);
    table.high[code] = static_cast<uint8_t>(bits >> 8);
    table.low[code] = static_cast<uint8_t>(bits & 0xFF);
  }
  return table;
}

// 64 codes from p, put in the order the interleaves take them from: VPUNPCKLBW/VPUNPCKHBW work within
// 128-bit lanes, so lane L of the first result must hold codes 8L..8L+7 and of the second 32+8L..32+8L+7.
inline __m512i load_codes(const uint8_t* p) {
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
      14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
      52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  return _mm512_permutexvar_epi8(_mm512_load_si512(kOrder), _mm512_loadu_si512(p));
}

inline __m512i lookup_high(const ByteToBf16Table& table, __m512i codes) {
  return _mm512_permutex2var_epi8(_mm512_load_si512(table.high), codes, _mm512_load_si512(table.high + 64));
}

inline __m512i lookup_low(const ByteToBf16Table& table, __m512i codes) {
  return _mm512_permutex2var_epi8(_mm512_load_si512(table.low), codes, _mm512_load_si512(table.low + 64));
}

// The words of codes 0-31 (first) and 32-63 (second) from load_codes' order.
inline void interleave_words(__m512i low, __m512i high, __m512i& first, __m512i& second) {
  first = _mm512_unpacklo_epi8(low, high);
  second = _mm512_unpackhi_epi8(low, high);
}

}  // namespace zenserve
#endif

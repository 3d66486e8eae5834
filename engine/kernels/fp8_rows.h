// float8 e4m3fn cache rows (--kv-cache-dtype fp8, engine/kv_quant.py) widened exactly, shared by the
// attention kernels. A row of a 64-wide head is 64 bytes, one cache line, so decode attention reads half
// the bytes of a bf16 cache's rows.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ZENSERVE_FP8_AVX512 1
#endif

#include <cstdint>

namespace zenserve {

// Whether a [slots, KVH, row] cache holds float8 e4m3fn rows for heads of head_dim.
inline bool is_fp8_rows(const at::Tensor& cache, int64_t head_dim) {
  return cache.scalar_type() == at::kFloat8_e4m3fn && cache.size(2) == head_dim;
}

// Rounded to nearest even and saturated at +-448, as torch's cast (the Python path's write) does.
inline c10::Float8_e4m3fn to_fp8(float x) { return c10::Float8_e4m3fn(x); }

#if defined(ZENSERVE_FP8_AVX512)
// The bf16 bits of the e4m3fn subnormals, m * 2^-9 for m = 0..7 (padded to a 32-entry VPERMW table).
alignas(64) inline constexpr uint16_t kFp8SubnormalBits[32] = {
    0, 118 << 7, 119 << 7, (119 << 7) | 0x40, 120 << 7, (120 << 7) | 0x20, (120 << 7) | 0x40, (120 << 7) | 0x60};

// 32 e4m3fn values, zero-extended to 16-bit lanes, as the bf16 bits of the same values (bf16 holds every
// e4m3fn value exactly). Normal values move their exponent and mantissa into place and add the bias
// difference (127 - 7); the subnormals (exponent 0: m * 2^-9) come from a table; 0x7F is NaN.
inline __m512i fp8_words_to_bf16(__m512i words) {
  const __m512i magnitude = _mm512_and_si512(words, _mm512_set1_epi16(0x7F));
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
  bits = _mm512_mask_permutexvar_epi16(bits, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)), magnitude,
                                       _mm512_load_si512(kFp8SubnormalBits));
  bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F)),
                               _mm512_set1_epi16(0x7FC0));
  // bits | (sign << 8 & 0x8000)
  return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(words, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
}

// 32 e4m3fn bytes -> 32 bf16 bit patterns.
inline __m512i fp8x32_to_bf16(const uint8_t* p) {
  return fp8_words_to_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

#if defined(__AVX512VBMI__)
// The bf16 bits of each non-negative e4m3fn byte, split into high and low bytes: two 128-byte tables for
// VPERMT2B, which indexes with a byte's low seven bits (the sign is OR-ed in after).
struct Fp8ToBf16Tables {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
  constexpr Fp8ToBf16Tables() : high(), low() {
    for (int a = 0; a < 128; ++a) {
      const int e = a >> 3, m = a & 7;
      int bits = ((e + 120) << 7) | (m << 4);
      if (a == 0x7F) bits = 0x7FC0;  // NaN
      else if (e == 0) bits = kFp8SubnormalBits[m];
      high[a] = static_cast<uint8_t>(bits >> 8);
      low[a] = static_cast<uint8_t>(bits & 0xFF);
    }
  }
};
inline constexpr Fp8ToBf16Tables kFp8ToBf16{};

// 64 e4m3fn bytes -> 64 bf16 bit patterns in two registers (values 0-31, 32-63), with two table lookups
// and two byte interleaves: six instructions for 64 values against about twenty for fp8x32_to_bf16 twice,
// which decode attention's rows feel (BENCHMARKS.md). The bytes are first put in the order the
// interleaves take them from: lane L of the low result holds values 8L..8L+7, of the high one 32+8L..32+8L+7.
inline void fp8x64_to_bf16(const uint8_t* p, __m512i& lo, __m512i& hi) {
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
      14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
      52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i bytes = _mm512_permutexvar_epi8(_mm512_load_si512(kOrder), _mm512_loadu_si512(p));
  __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(kFp8ToBf16.high), bytes,
                                          _mm512_load_si512(kFp8ToBf16.high + 64));
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(kFp8ToBf16.low), bytes,
                                               _mm512_load_si512(kFp8ToBf16.low + 64));
  high = _mm512_ternarylogic_epi32(high, bytes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
  lo = _mm512_unpacklo_epi8(low, high);
  hi = _mm512_unpackhi_epi8(low, high);
}
#endif

// 16 e4m3fn bytes -> 16 bf16 bit patterns.
inline __m256i fp8x16_to_bf16(const uint8_t* p) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return _mm512_castsi512_si256(fp8_words_to_bf16(words));
}

// 16 e4m3fn bytes -> 16 float32.
inline __m512 fp8x16_to_float(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(fp8x16_to_bf16(p)), 16));
}
#endif

}  // namespace zenserve

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

#include "byte_tables.h"

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
// The bf16 bits of each non-negative e4m3fn byte (the sign is OR-ed in after).
inline constexpr ByteToBf16Table kFp8ToBf16 = make_byte_table([](int a) {
  const int e = a >> 3, m = a & 7;
  if (a == 0x7F) return 0x7FC0;  // NaN
  if (e == 0) return static_cast<int>(kFp8SubnormalBits[m]);
  return ((e + 120) << 7) | (m << 4);
});

// 64 e4m3fn bytes -> 64 bf16 bit patterns in two registers (values 0-31, 32-63): two table lookups, the sign,
// two byte interleaves (byte_tables.h).
inline void fp8x64_to_bf16(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i codes = load_codes(p);
  const __m512i high = _mm512_ternarylogic_epi32(lookup_high(kFp8ToBf16, codes), codes,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
  interleave_words(lookup_low(kFp8ToBf16, codes), high, lo, hi);
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

// One K or V row of the paged cache (or a query row) as float32, shared by the attention kernels:
// float types by a cast, bfloat16 by a shift, float16 by F16C's conversion, and packed int8 rows (engine/kv_quant.py: head_dim int8
// values, then the 4 bytes of their float32 scale) by a multiply.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace zenserve {

// Whether a [slots, KVH, row] cache holds packed int8 rows for heads of head_dim.
inline bool is_int8_rows(const at::Tensor& cache, int64_t head_dim) {
  return cache.scalar_type() == at::kChar && cache.size(2) == head_dim + static_cast<int64_t>(sizeof(float));
}

// Whether a [slots, KVH, row] cache holds float16 rows under a float32 query (--kv-cache-dtype float16).
inline bool is_float16_rows(const at::Tensor& cache, at::ScalarType query, int64_t head_dim) {
  return cache.scalar_type() == at::kHalf && query == at::kFloat && cache.size(2) == head_dim;
}

inline float int8_row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(float));
  return scale;
}

template <typename T>
inline void row_to_float(const T* src, int64_t n, float* dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float32: a shift the compiler vectorizes (c10's conversion is not).
template <>
inline void row_to_float<c10::BFloat16>(const c10::BFloat16* src, int64_t n, float* dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// c10's Half conversion is scalar bit manipulation; F16C widens eight values an instruction.
template <>
inline void row_to_float<c10::Half>(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void row_to_float<int8_t>(const int8_t* src, int64_t n, float* dst) {
  const float scale = int8_row_scale(src, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

}  // namespace zenserve

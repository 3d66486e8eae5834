// The rotary embedding of one head (rotate-half layout) in float32, rounded once into dst (which may be
// x itself), shared by the decode-block kernel and the prefill steps' in-place rotation.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "bf16_bits.h"

namespace zenserve {

template <typename scalar_t>
inline void rope_row(const scalar_t* x, const float* cos, const float* sin, int64_t head_dim, scalar_t* dst) {
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float lo = static_cast<float>(x[d]), hi = static_cast<float>(x[d + half]);
    dst[d] = static_cast<scalar_t>(lo * cos[d] - hi * sin[d]);
    dst[d + half] = static_cast<scalar_t>(hi * cos[d + half] + lo * sin[d + half]);
  }
}

// bfloat16 on its bits, which the compiler vectorizes (c10's conversions are not); the same rounding.
template <>
inline void rope_row<c10::BFloat16>(const c10::BFloat16* x, const float* cos, const float* sin, int64_t head_dim,
                                    c10::BFloat16* dst) {
  const int64_t half = head_dim / 2;
  const auto* in = reinterpret_cast<const uint16_t*>(x);
  auto* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float lo = bf16_bits_to_float(in[d]), hi = bf16_bits_to_float(in[d + half]);
    out[d] = float_to_bf16_bits(lo * cos[d] - hi * sin[d]);
    out[d + half] = float_to_bf16_bits(hi * cos[d + half] + lo * sin[d + half]);
  }
}

}  // namespace zenserve

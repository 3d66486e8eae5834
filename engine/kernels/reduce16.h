// Sixteen vectors reduced lane-wise at once (lane j of the result: a[j]'s 16 lanes combined by op, an
// add or a max): a transposing tree of 15 ops and 30 shuffles, where 16 separate reductions take 8
// operations each. Shared by the decode attention's scores and the prefill softmax's row maxima and sums.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace zenserve {

template <typename Op>
inline __m512 reduce16(const __m512* a, Op op) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = op(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = op(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 d0 = op(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = op(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 sum16(const __m512* a) {
  return reduce16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

inline __m512 max16(const __m512* a) {
  return reduce16(a, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
}

}  // namespace zenserve
#endif

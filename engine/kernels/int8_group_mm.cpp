// y = x W^T for a weight stored as GGML's Q8_0 keeps it: int8 values with one float scale per group
// of 32 along K. Used for the few-row calls (decode), which are bound by reading the weight: half the
// bytes of bf16, and exact to the checkpoint (bf16 rounds d * q).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <vector>

namespace {

constexpr int64_t kGroup = 32;

void generic_rows(const float* xf, int64_t rows, int64_t k, const int8_t* q, const float* scales, int64_t n_begin,
                  int64_t n_end, int64_t n_total, float* y) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) dot += xf[m * k + g * kGroup + i] * q[n * k + g * kGroup + i];
        acc += dot * scales[n * groups + g];
      }
      y[m * n_total + n] = acc;
    }
  }
}

#if defined(__AVX512F__)
template <int M>
void avx512_rows(const float* xf, int64_t k, const int8_t* q, const float* scales, int64_t n_begin, int64_t n_end,
                 int64_t n_total, float* y) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* qn = q + n * k;
    const float* sn = scales + n * groups;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i* src = reinterpret_cast<const __m128i*>(qn + g * kGroup);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
      const __m512 d = _mm512_set1_ps(sn[g]);
      for (int m = 0; m < M; ++m) {
        const float* xg = xf + m * k + g * kGroup;
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(xg), lo, _mm512_mul_ps(_mm512_loadu_ps(xg + 16), hi));
        acc[m] = _mm512_fmadd_ps(t, d, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * n_total + n] = _mm512_reduce_add_ps(acc[m]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same on AVX2 (Zen 2 and 3): eight floats a register, one horizontal sum per output.
template <int M>
void avx2_rows(const float* xf, int64_t k, const int8_t* q, const float* scales, int64_t n_begin, int64_t n_end,
               int64_t n_total, float* y) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* qn = q + n * k;
    const float* sn = scales + n * groups;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* src = qn + g * kGroup;
      __m256 w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * j))));
      const __m256 d = _mm256_set1_ps(sn[g]);
      for (int m = 0; m < M; ++m) {
        const float* xg = xf + m * k + g * kGroup;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xg), w[0]);
        for (int j = 1; j < 4; ++j) t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * j), w[j], t);
        acc[m] = _mm256_fmadd_ps(t, d, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
      y[m * n_total + n] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
  }
}
#endif

}  // namespace

// x [M, K] float32/bf16/fp16; q [N, K] int8; scales [N, K / 32] float32. Returns [M, N] in x's dtype.
at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, "x, q and scales must be 2-D");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales must be contiguous float32");
  const int64_t rows = x.size(0), k = x.size(1), n_total = q.size(0);
  TORCH_CHECK(q.size(1) == k && k % kGroup == 0, "q must be [N, K] with K a multiple of 32, K as x's");
  TORCH_CHECK(scales.size(0) == n_total && scales.size(1) == k / kGroup, "scales must be [N, K / 32]");
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu(), "CPU tensors only");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, n_total}, x.options().dtype(at::kFloat));
  const float* x_ptr = xf.data_ptr<float>();
  const int8_t* q_ptr = q.data_ptr<int8_t>();
  const float* s_ptr = scales.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  // Four rows at a time, each block widening the weights again: a float32 model's lm_head takes every row
  // count here where --compact-weights keeps no dense copy of it.
  at::parallel_for(0, n_total, 256, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    for (int64_t m = 0; m < rows; m += 4) {
      const float* xm = x_ptr + m * k;
      float* ym = y_ptr + m * n_total;
#if defined(__AVX512F__)
#define ZENSERVE_INT8_ROWS avx512_rows
#else
#define ZENSERVE_INT8_ROWS avx2_rows
#endif
      switch (std::min<int64_t>(rows - m, 4)) {
        case 1: ZENSERVE_INT8_ROWS<1>(xm, k, q_ptr, s_ptr, begin, end, n_total, ym); break;
        case 2: ZENSERVE_INT8_ROWS<2>(xm, k, q_ptr, s_ptr, begin, end, n_total, ym); break;
        case 3: ZENSERVE_INT8_ROWS<3>(xm, k, q_ptr, s_ptr, begin, end, n_total, ym); break;
        default: ZENSERVE_INT8_ROWS<4>(xm, k, q_ptr, s_ptr, begin, end, n_total, ym); break;
      }
#undef ZENSERVE_INT8_ROWS
    }
#else
    generic_rows(x_ptr, rows, k, q_ptr, s_ptr, begin, end, n_total, y_ptr);
#endif
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("int8_group_mm(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("int8_group_mm", &int8_group_mm); }

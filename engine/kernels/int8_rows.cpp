// A float32 model's int8 activations (engine/models/int8_linear.py, Int8RowsLinear), around oneDNN's
// u8 x s8 GEMM: each row of x, smoothed (x * inv_smooth), mapped onto 0..levels between its own minimum
// and maximum; and the GEMM's output put back on each row's scale, y * step + low * sums[n] (+ bias).
// One pass over a row each way where torch takes five ops and their temporaries (2 Zen 3 cores: the row
// quantization cost a third of the GEMM's time at 2,048 rows).
//
// The arithmetic is torch's fallback's, op for op: scaled = x * inv_smooth; q = round((scaled - low) *
// (levels / (high - low))), half to even, clamped; step = (high - low) / levels.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

void quantize_row(const float* x, const float* s, int64_t k, int64_t levels, uint8_t* q, float* low_out,
                  float* step_out) {
  int64_t i = 0;
  float lo = INFINITY, hi = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vlo = _mm256_set1_ps(INFINITY), vhi = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(s + i));
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
  }
  alignas(32) float lanes_lo[8], lanes_hi[8];
  _mm256_store_ps(lanes_lo, vlo);
  _mm256_store_ps(lanes_hi, vhi);
  for (int j = 0; j < 8; ++j) {
    lo = std::min(lo, lanes_lo[j]);
    hi = std::max(hi, lanes_hi[j]);
  }
#endif
  for (; i < k; ++i) {
    const float v = x[i] * s[i];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const float range = hi - lo;
  const float inv = range > 0.f ? static_cast<float>(levels) / range : 0.f;
  *low_out = lo;
  *step_out = range / static_cast<float>(levels);
  const float top = static_cast<float>(levels);
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vlow = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv), vtop = _mm256_set1_ps(top);
  const __m256 zero = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(s + i));
    __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, vlow), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, zero), vtop);
    const __m256i i32 = _mm256_cvtps_epi32(r);
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(w16, w16));
  }
#endif
  for (; i < k; ++i) {
    const float r = std::nearbyint((x[i] * s[i] - lo) * inv);
    q[i] = static_cast<uint8_t>(std::min(std::max(r, 0.f), top));
  }
}

// x [T, K] float32, inv_smooth [K] float32 -> (q [T, K] uint8, low [T], step [T]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const at::Tensor& inv_smooth,
                                                             int64_t levels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous 2-D float32");
  TORCH_CHECK(inv_smooth.dim() == 1 && inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous() &&
                  inv_smooth.size(0) == x.size(1), "inv_smooth must be contiguous float32 [K], K as x's");
  TORCH_CHECK(levels >= 1 && levels <= 255, "levels must be in 1..255");
  TORCH_CHECK(x.device().is_cpu() && inv_smooth.device().is_cpu(), "CPU tensors only");
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kByte));
  at::Tensor low = at::empty({rows}, x.options());
  at::Tensor step = at::empty({rows}, x.options());
  const float* x_ptr = x.data_ptr<float>();
  const float* s_ptr = inv_smooth.data_ptr<float>();
  uint8_t* q_ptr = q.data_ptr<uint8_t>();
  float* low_ptr = low.data_ptr<float>();
  float* step_ptr = step.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x_ptr + r * k, s_ptr, k, levels, q_ptr + r * k, low_ptr + r, step_ptr + r);
  });
  return {q, low, step};
}

// y [T, N] float32 in place: y[r, n] = y[r, n] * step[r] + low[r] * sums[n] (+ bias[n]).
void rescale_rows_(const at::Tensor& y, const at::Tensor& step, const at::Tensor& low, const at::Tensor& sums,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous(), "y must be contiguous 2-D float32");
  const int64_t rows = y.size(0), n = y.size(1);
  for (const at::Tensor* t : {&step, &low})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == rows,
                "step and low must be contiguous float32 [T]");
  TORCH_CHECK(sums.dim() == 1 && sums.scalar_type() == at::kFloat && sums.is_contiguous() && sums.size(0) == n,
              "sums must be contiguous float32 [N]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->size(0) == n,
                "bias must be contiguous float32 [N]");
  float* y_ptr = y.data_ptr<float>();
  const float* step_ptr = step.data_ptr<float>();
  const float* low_ptr = low.data_ptr<float>();
  const float* sums_ptr = sums.data_ptr<float>();
  const float* bias_ptr = has_bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* yr = y_ptr + r * n;
      const float st = step_ptr[r], lo = low_ptr[r];
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 vst = _mm256_set1_ps(st), vlo = _mm256_set1_ps(lo);
      for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(yr + i), vst, _mm256_mul_ps(vlo, _mm256_loadu_ps(sums_ptr + i)));
        if (bias_ptr != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias_ptr + i));
        _mm256_storeu_ps(yr + i, v);
      }
#endif
      for (; i < n; ++i) yr[i] = yr[i] * st + lo * sums_ptr[i] + (bias_ptr != nullptr ? bias_ptr[i] : 0.f);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("quantize_rows(Tensor x, Tensor inv_smooth, int levels) -> (Tensor, Tensor, Tensor)");
  m.def("rescale_rows_(Tensor(a!) y, Tensor step, Tensor low, Tensor sums, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("rescale_rows_", &rescale_rows_);
}

// RMSNorm over rows, and the residual add joined to it, as F.rms_norm computes it: float32 inside
// (x * rsqrt(mean(x^2) + eps) * weight) and one rounding on the way out. torch's CPU rms_norm runs
// it as ~8 ops (upcast, pow, sum, add, rsqrt, two muls, downcast), each a pass over the rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bf16_bits.h"

namespace {

using zenserve::bf16_bits_to_float;
using zenserve::float_to_bf16_bits;

inline float load(const uint16_t* p, int64_t i) { return bf16_bits_to_float(p[i]); }
inline float load(const float* p, int64_t i) { return p[i]; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16_bits(v); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }

// One row: out = in * rsqrt(mean(in^2) + eps) * weight. `in` and `out` may be the same row.
template <typename T>
inline void norm_row(const T* in, T* out, const float* weight, int64_t width, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) {
    const float v = load(in, i);
    squares += v * v;
  }
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) store(out, i, load(in, i) * scale * weight[i]);
}

// One row: residual = round(x + residual) (the sum the next sublayers read, rounded as torch's add
// rounds it), then x = norm(residual).
template <typename T>
inline void add_norm_row(T* x, T* residual, const float* weight, int64_t width, float eps) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) store(residual, i, load(x, i) + load(residual, i));
  norm_row(static_cast<const T*>(residual), x, weight, width, eps);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, D]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1),
              "weight must be contiguous float32 [D]");
}

// About 16K elements a task: a decode's row runs on the calling thread, a prefill's rows spread out.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

}  // namespace

// x [T, D] bf16 or float32, weight [D] float32 -> [T, D] in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), width = x.size(1);
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(src + r * width, dst + r * width, w, width, e);
    });
  } else {
    const float* src = x.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(src + r * width, dst + r * width, w, width, e);
    });
  }
  return out;
}

// In place: residual += x, then x = rms_norm(residual). Both [T, D], contiguous, one dtype.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous and match x");
  const int64_t rows = x.size(0), width = x.size(1);
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    auto* xs = reinterpret_cast<uint16_t*>(x.data_ptr<c10::BFloat16>());
    auto* rs = reinterpret_cast<uint16_t*>(residual.data_ptr<c10::BFloat16>());
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) add_norm_row(xs + r * width, rs + r * width, w, width, e);
    });
  } else {
    float* xs = x.data_ptr<float>();
    float* rs = residual.data_ptr<float>();
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) add_norm_row(xs + r * width, rs + r * width, w, width, e);
    });
  }
}

TORCH_LIBRARY_FRAGMENT(zenserve, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("add_rms_norm_", &add_rms_norm_);
}

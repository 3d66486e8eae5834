// The rotary embedding of a prefill step's queries and keys, in place, in one pass: x [T, N, hd] (a view
// of the fused q/k/v projection's output) rotated by each row's cos and sin (float32, rotate-half
// layout), in float32 and rounded once. torch's ops take five passes (a concatenation, a negation, two
// products, a sum) with a rounding after each, and about 12% of a prefill step of 1,500 tokens on an
// Intel Xeon (BENCHMARKS.md). It computes what the decode-block kernel's rotation computes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "rope_row.h"

namespace {

template <typename scalar_t>
void rotate(scalar_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride, int64_t head_stride,
            const float* cos, const float* sin) {
  // About 8K values a task: a short chunk stays on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(heads * head_dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* head = x + t * row_stride + h * head_stride;
        zenserve::rope_row(head, cos + t * head_dim, sin + t * head_dim, head_dim, head);
      }
  });
}

}  // namespace

// x [T, N, hd] bfloat16, float16 or float32 (hd contiguous, any row and head strides), cos and sin [T, hd]
// float32 contiguous: each row's table entries. Rotates x in place and returns it.
at::Tensor rotary_embedding_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, N, hd] with hd contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "the head size must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.sizes() == sin.sizes(),
              "cos and sin must be float32 [T, hd], one row per row of x");
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors only");
  const int64_t rows = x.size(0), heads = x.size(1), head_dim = x.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary_embedding_", [&] {
    rotate(x.data_ptr<scalar_t>(), rows, heads, head_dim, x.stride(0), x.stride(1), cos.data_ptr<float>(),
           sin.data_ptr<float>());
  });
  return x;
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) { m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)"); }

TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("rotary_embedding_", &rotary_embedding_); }

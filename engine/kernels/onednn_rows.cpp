// oneDNN's bf16 linear (torch's mkldnn::_linear_pointwise over a weight in oneDNN's blocked layout) with
// the rows shared out among the intra-op threads, each running oneDNN on its share: a oneDNN call inside
// a parallel region runs on its own thread. On 2 Xeon cores oneDNN's own threading left one core idle
// for some shapes and row counts (SmolLM2's down projection, 576 x 1536, from 256 to 1,280 rows; o, 576 x
// 576, from 384 to 768; qkv, 960 x 576, from 768 to 1,024), where splitting the rows was 1.1-4x as fast;
// elsewhere it was slower, since each thread then reads the whole weight. OneDnnLinear measures which
// row counts gain when a worker starts (engine/models/onednn_linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <vector>

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

constexpr int64_t kMinRowsAThread = 16;

at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearPointwise>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x [M, K] bf16; w from torch.ops.mkldnn._reorder_linear_weight; bias [N] bf16 or None. Returns [M, N].
at::Tensor onednn_linear_split_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t m = x.size(0);
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), m / kMinRowsAThread);
  if (parts <= 1 || at::in_parallel_region()) return linear_pointwise(x, w, bias);
  const int64_t chunk = (m + parts - 1) / parts;
  std::vector<at::Tensor> outs(parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode no_autograd;  // the pool's threads start with autograd's defaults
    for (int64_t p = begin; p < end; ++p) {
      const int64_t start = p * chunk;
      outs[p] = linear_pointwise(x.narrow(0, start, std::min(chunk, m - start)), w, bias);
    }
  });
  // Each thread copies its own share into the output (still in its cache) instead of at::cat on one thread:
  // 2 Xeon cores, alternated, 1,024 rows 1,244 vs 1,267 us (qkv), 1,982 vs 1,998 (down), 756 vs 785 (o).
  at::Tensor y = at::empty({m, outs[0].size(1)}, outs[0].options());
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode no_autograd;
    for (int64_t p = begin; p < end; ++p) y.narrow(0, p * chunk, outs[p].size(0)).copy_(outs[p]);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("onednn_linear_split_rows(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

// The blocked weight is an opaque oneDNN tensor: its dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(zenserve, MkldnnCPU, m) { m.impl("onednn_linear_split_rows", &onednn_linear_split_rows); }
TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("onednn_linear_split_rows", &onednn_linear_split_rows); }

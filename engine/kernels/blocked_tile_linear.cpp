// y = x W^T (+ b) on AMX's tiles for prefill-sized calls, reading the bf16 weight that OneDnnLinear already
// holds: torch.ops.mkldnn._reorder_linear_weight's blocked layout, [N / 32][K / 2][32][2] on AMX (checked
// per shape against a reference before use: engine/models/onednn_linear.py). In that layout the 16 K pairs
// of a 32-value group and 16 columns are one B tile with rows 128 bytes apart, so no copy is made.
//
// Each thread takes whole 32-column panels. A panel's weights (K x 64 bytes) stay in L1 or L2 while every
// 32 rows of x run 2 x 2 tiles over K, and the next panel is prefetched into L2 meanwhile. On 2 Xeon cores,
// SmolLM2's projections x 30 layers took 0.68-0.92x oneDNN's time from 64 to 512 rows, but 1.01-1.09x at
// 1,024 and 1.25x at 2,048, where oneDNN's own blocking wins (BENCHMARKS.md): OneDnnLinear calls it up to 512
// rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>

#include "amx_tiles.h"

namespace {

constexpr int64_t kPanel = 32;      // columns of a blocked panel: two B tiles of 16
constexpr int64_t kRowChunk = 256;  // rows whose x stays in L2 while every panel passes over them

#if defined(ZENSERVE_AMX)
// Tiles: 0 and 1 x's two 16-row halves (A), 2 and 3 the panel's two column halves (B), 4-7 the sums (C):
// 4, 5 for rows 0-15 and 6, 7 for rows 16-31. A row count past 16 gives the second half `rows1` rows.
void configure_tiles(int64_t rows0, int64_t rows1) {
  zenserve::TileConfig config;
  rows1 = std::max<int64_t>(rows1, 1);  // unused when 0, but configured with a valid shape
  config.set(0, rows0, 64);
  config.set(1, rows1, 64);
  config.set(2, 16, 64);
  config.set(3, 16, 64);
  config.set(4, rows0, 64);
  config.set(5, rows0, 64);
  config.set(6, rows1, 64);
  config.set(7, rows1, 64);
  _tile_loadconfig(&config);
}

// A C tile's `rows` x 16 sums, stored to `buf`, plus the bias's 16 values, into y as bf16.
inline void write_rows(const float* buf, int64_t rows, const float* bias16, uint16_t* y, int64_t ldy) {
  const __m512 b = bias16 != nullptr ? _mm512_loadu_ps(bias16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(buf + r * 16), b)));
}

// Rows [0, M) of x (row stride ldx values) times panels [begin, end) of w into y (row stride ldy).
void panels(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
            int64_t ldy, int64_t begin, int64_t end) {
  alignas(64) float buf[16 * 16];
  const int64_t groups = K / 32, panel_words = K * kPanel, row_blocks = (M + 31) / 32;
  const int64_t lines = panel_words * 2 / 64, steps = row_blocks * groups;
  int64_t rows0_set = -1, rows1_set = -1;
  for (int64_t p = begin; p < end; ++p) {
    const uint16_t* panel = w + p * panel_words;
    const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + panel_words) : nullptr;
    int64_t step = 0;
    for (int64_t r = 0; r < M; r += 32) {
      const int64_t rows0 = std::min<int64_t>(16, M - r), rows1 = std::clamp<int64_t>(M - r - 16, 0, 16);
      if (rows0 != rows0_set || rows1 != rows1_set) {  // only a chunk's last rows differ
        configure_tiles(rows0, rows1);
        rows0_set = rows0;
        rows1_set = rows1;
      }
      _tile_zero(4);
      _tile_zero(5);
      if (rows1) {
        _tile_zero(6);
        _tile_zero(7);
      }
      const uint16_t* x0 = x + r * ldx;
      const uint16_t* x1 = x0 + 16 * ldx;
      for (int64_t g = 0; g < groups; ++g, ++step) {
        const uint16_t* b = panel + g * 16 * 64;  // the group's 16 K pairs, 128 bytes each
        _tile_loadd(2, b, 128);
        _tile_loadd(3, b + 32, 128);
        _tile_loadd(0, x0 + g * 32, ldx * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (rows1) {
          _tile_loadd(1, x1 + g * 32, ldx * 2);
          _tile_dpbf16ps(6, 1, 2);
          _tile_dpbf16ps(7, 1, 3);
        }
        if (next != nullptr) {  // the next panel's lines into L2, spread over this panel's products
          for (int64_t l = step * lines / steps, hi = (step + 1) * lines / steps; l < hi; ++l)
            _mm_prefetch(next + l * 64, _MM_HINT_T1);
        }
      }
      uint16_t* y0 = y + r * ldy + p * kPanel;
      const float* b0 = bias != nullptr ? bias + p * kPanel : nullptr;
      const float* b1 = bias != nullptr ? b0 + 16 : nullptr;
      _tile_stored(4, buf, 64);
      write_rows(buf, rows0, b0, y0, ldy);
      _tile_stored(5, buf, 64);
      write_rows(buf, rows0, b1, y0 + 16, ldy);
      if (rows1) {
        _tile_stored(6, buf, 64);
        write_rows(buf, rows1, b0, y0 + 16 * ldy, ldy);
        _tile_stored(7, buf, 64);
        write_rows(buf, rows1, b1, y0 + 16 * ldy + 16, ldy);
      }
    }
  }
}
#endif

}  // namespace

bool blocked_tile_linear_supported() {
#if defined(ZENSERVE_AMX)
  return zenserve::amx_permitted();
#else
  return false;
#endif
}

// x [M, K] bf16 with contiguous rows; w from torch.ops.mkldnn._reorder_linear_weight of an [N, K] bf16 weight,
// N and K multiples of 32; bias [N] or None. Returns [M, N] bf16.
at::Tensor blocked_tile_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(blocked_tile_linear_supported(), "blocked_tile_linear needs AMX (built with -march=native on it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be [M, K] bfloat16 with contiguous rows");
  TORCH_CHECK(w.is_mkldnn() && w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be a blocked oneDNN weight");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  static const auto data_ptr =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "").typed<int64_t(const at::Tensor&)>();
  static const auto nbytes =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "").typed<int64_t(const at::Tensor&)>();
  TORCH_CHECK(w.size(1) == K && N % kPanel == 0 && K % 32 == 0 && nbytes.call(w) == N * K * 2,
              "w must hold [N / 32][K / 2][32][2] bfloat16, N and K multiples of 32, K = x's");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(ZENSERVE_AMX)
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w_ptr = reinterpret_cast<const uint16_t*>(data_ptr.call(w));
  const float* b_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* y_ptr = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    at::parallel_for(0, N / kPanel, 1, [&](int64_t begin, int64_t end) {
      panels(x_ptr + m0 * ldx, ldx, rows, w_ptr, K, b_ptr, y_ptr + m0 * N, N, begin, end);
      _tile_release();
    });
  }
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("blocked_tile_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("blocked_tile_linear_supported() -> bool");
}

// The blocked weight is an opaque oneDNN tensor: its dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(zenserve, MkldnnCPU, m) { m.impl("blocked_tile_linear", &blocked_tile_linear); }
TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("blocked_tile_linear", &blocked_tile_linear); }
TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) {
  m.impl("blocked_tile_linear_supported", &blocked_tile_linear_supported);
}

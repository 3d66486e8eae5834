// y = x W^T for a weight kept as GGML's Q4_1 stores it: 4-bit q in 0..15 with a float scale d and
// minimum m per group of 32 along K, w = q * d + m. For the few-row calls of a float32 model (decodes):
// at one to four rows a kernel that sums each group against the integers, from five the weights written
// out in float32 a panel at a time (below).
//
// torch's int4 CPU kernel serves bf16 models; with float32 activations it has no vectorized path
// (8-24x slower than with bf16 on a Zen 3). This one takes float32 or bf16 rows, sums in float32:
//   y[m, n] = sum_g d[n, g] * (sum_i q[n, g, i] * x[m, g, i]) + m[n, g] * (sum_i x[m, g, i]).
// Packed as llama.cpp packs a Q4_1 block: byte i of a group holds q_i in its low nibble and q_{i+16}
// in its high one ([N, K / 2] uint8). AVX2 and FMA (every x86-64 Zen); a plain loop elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

void generic_rows(const float* xf, int64_t rows, int64_t k, const uint8_t* q, const float* d, const float* mins,
                  int64_t n_begin, int64_t n_end, int64_t n_total, float* y) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* qg = q + n * (k / 2) + g * (kGroup / 2);
        const float* xg = xf + m * k + g * kGroup;
        float dot = 0.f, sum = 0.f;
        for (int64_t i = 0; i < kGroup / 2; ++i) {
          dot += (qg[i] & 0xF) * xg[i] + (qg[i] >> 4) * xg[i + kGroup / 2];
          sum += xg[i] + xg[i + kGroup / 2];
        }
        acc += dot * d[n * groups + g] + sum * mins[n * groups + g];
      }
      y[m * n_total + n] = acc;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Output column n of M rows: each row's accumulated scale terms plus its minima's term (the group minima
// of weight row n times x's group sums).
template <int M>
inline void store_rows(const __m256* acc, const float* mn, const float* sums, int64_t groups, int64_t n,
                       int64_t n_total, float* y) {
  for (int m = 0; m < M; ++m) {
    float min_term = 0.f;
    const float* sm = sums + m * groups;
    for (int64_t g = 0; g < groups; ++g) min_term += mn[g] * sm[g];
    y[m * n_total + n] = hsum(acc[m]) + min_term;
  }
}

// The sums of each group of 32 of each row: the minima's term, computed once a call.
void group_sums(const float* xf, int64_t rows, int64_t k, float* sums) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < k / kGroup; ++g) {
      const float* xg = xf + m * k + g * kGroup;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)));
      sums[m * (k / kGroup) + g] = hsum(s);
    }
}

// Outputs [n_begin, n_end) of M rows, a weight row at a time: `add_group(src, g, scale, acc)` adds group g's
// products (its 16 packed bytes at src, times its scale) to the M rows' accumulators; then each row's
// minima's term and the store. The row kernels below differ only in how they multiply a group.
template <int M, typename AddGroup>
inline void rows_by_group(int64_t k, const uint8_t* q, const float* d, const float* mins, const float* sums,
                          int64_t n_begin, int64_t n_end, int64_t n_total, float* y, AddGroup add_group) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* qn = q + n * (k / 2);
    const float* dn = d + n * groups;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) add_group(qn + g * (kGroup / 2), g, dn[g], acc);
    store_rows<M>(acc, mins + n * groups, sums, groups, n, n_total, y);
  }
}

template <int M>
void avx2_rows(const float* xf, int64_t k, const uint8_t* q, const float* d, const float* mins, const float* sums,
               int64_t n_begin, int64_t n_end, int64_t n_total, float* y) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  rows_by_group<M>(k, q, d, mins, sums, n_begin, n_end, n_total, y,
                   [&](const uint8_t* src, int64_t g, float d_g, __m256* acc) {
    // Each byte widened to a lane: its low nibble is q_i, its high one q_{i+16} (no mask needed).
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8)));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4));  // q_0 .. q_7
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4));  // q_8 .. q_15
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));    // q_16 .. q_23
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));    // q_24 .. q_31
    const __m256 scale = _mm256_set1_ps(d_g);
    for (int m = 0; m < M; ++m) {
      const float* xg = xf + m * k + g * kGroup;
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xg), w0);
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), w1, t);
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w2, t);
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w3, t);
      acc[m] = _mm256_fmadd_ps(t, scale, acc[m]);
    }
  });
}
#endif

// Rows [n_begin, n_end) of the weight itself, w = q * d + m, into out [n_end - n_begin, K] float32.
void dequantize_rows(const uint8_t* q, const float* d, const float* mins, int64_t k, int64_t n_begin, int64_t n_end,
                     float* out) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* qn = q + n * (k / 2);
    float* on = out + (n - n_begin) * k;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* src = qn + g * (kGroup / 2);
      const float scale = d[n * groups + g], low = mins[n * groups + g];
      float* o = on + g * kGroup;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256i low4 = _mm256_set1_epi32(0x0F);
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8)));
      const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(low);
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), vs, vm));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), vs, vm));
      _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vs, vm));
      _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vs, vm));
#else
      for (int64_t i = 0; i < kGroup / 2; ++i) {
        o[i] = (src[i] & 0xF) * scale + low;
        o[i + kGroup / 2] = (src[i] >> 4) * scale + low;
      }
#endif
    }
  }
}


#if defined(__AVX2__) && defined(__FMA__)
// From this many rows int4_group_mm writes each panel of kPanelColumns weight rows out in float32 once
// (dequantize_rows, into a buffer that stays in L1) and runs every row of x against it, rather than
// widening and converting the weights again for every four rows: the conversion is paid once a call, and
// the rest is FMAs at the cores' float32 rate. 2 Zen 1 cores, 30 layers' projections, three runs: 29-31
// against 38-39 ms at 5-6 rows, 67-71 against 88-94 at 16 (zentorch's prepacked GEMM 72-83), 114-118
// against 182-198 at 32 (GEMM 124-134). At four rows and fewer the per-row kernel is faster (25 against 32).
constexpr int64_t kPanelRows = 5;
constexpr int64_t kPanelColumns = 4;

// The four sums of a0..a3, in that order.
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// M rows of x against a panel of four weight rows (w [4, K] float32): 4M accumulators, the M rows' vectors
// and one weight vector fill the 16 registers at M = 3. Writes y[m, 0..3] for each row.
template <int M>
inline void panel_tile(const float* x, int64_t k, const float* w, float* y, int64_t n_total) {
  __m256 acc[M][kPanelColumns];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kPanelColumns; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * k + i);
    for (int j = 0; j < kPanelColumns; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * k + i);
      for (int m = 0; m < M; ++m) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) _mm_storeu_ps(y + m * n_total, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

// Panels [p_begin, p_end) of kPanelColumns outputs each, for all rows (at least 2): tiles of three rows,
// of two where three would leave one.
void panel_rows(const float* xf, int64_t rows, int64_t k, const uint8_t* q, const float* d, const float* mins,
                int64_t p_begin, int64_t p_end, int64_t n_total, float* y) {
  std::vector<float> panel(kPanelColumns * k);
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int64_t n = p * kPanelColumns;
    dequantize_rows(q, d, mins, k, n, n + kPanelColumns, panel.data());
    int64_t m = 0;
    for (; rows - m >= 3 && rows - m != 4; m += 3) panel_tile<3>(xf + m * k, k, panel.data(), y + m * n_total + n, n_total);
    for (; rows - m >= 2; m += 2) panel_tile<2>(xf + m * k, k, panel.data(), y + m * n_total + n, n_total);
  }
}
#endif

// int4_group_mm_q8's activations: each group of 32 of each row as int8, symmetric, its scale absmax / 127
// (llama.cpp's Q8_0 for activations); xq [rows, K], dx [rows, K / 32].
void quantize_groups(const float* xf, int64_t rows, int64_t k, int8_t* xq, float* dx) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < k / kGroup; ++g) {
      const float* xg = xf + m * k + g * kGroup;
      float absmax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) absmax = std::max(absmax, std::fabs(xg[i]));
      const float scale = absmax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      for (int64_t i = 0; i < kGroup; ++i) xq[m * k + g * kGroup + i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
      dx[m * (k / kGroup) + g] = scale;
    }
}

void generic_rows_q8(const int8_t* xq, const float* dx, const float* sums, int64_t rows, int64_t k, const uint8_t* q,
                     const float* d, const float* mins, int64_t n_begin, int64_t n_end, int64_t n_total, float* y) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* qg = q + n * (k / 2) + g * (kGroup / 2);
        const int8_t* xg = xq + m * k + g * kGroup;
        int32_t dot = 0;
        for (int64_t i = 0; i < kGroup / 2; ++i) dot += (qg[i] & 0xF) * xg[i] + (qg[i] >> 4) * xg[i + kGroup / 2];
        acc += static_cast<float>(dot) * (d[n * groups + g] * dx[m * groups + g]) + mins[n * groups + g] * sums[m * groups + g];
      }
      y[m * n_total + n] = acc;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// The integer dot of a group: vpmaddubsw (u8 q times s8 x, pairs summed to int16: at most 2 * 15 * 127, no
// saturation), then pairs of those to int32; one conversion to float for 32 weights.
template <int M>
void avx2_rows_q8(const int8_t* xq, const float* dx, int64_t k, const uint8_t* q, const float* d, const float* mins,
                  const float* sums, int64_t n_begin, int64_t n_end, int64_t n_total, float* y) {
  const int64_t groups = k / kGroup;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  rows_by_group<M>(k, q, d, mins, sums, n_begin, n_end, n_total, y,
                   [&](const uint8_t* src, int64_t g, float d_g, __m256* acc) {
    // q_0..q_15 (low nibbles) in the lower 16 bytes, q_16..q_31 (high ones) in the upper: x's order.
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m256i w = _mm256_and_si256(
        _mm256_insertf128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1), low4);
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + g * kGroup));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d_g * dx[m * groups + g]), acc[m]);
    }
  });
}
#endif
}  // namespace

// x [M, K] float32/bf16; packed [N, K / 2] uint8 (int4_group_pack); d, mins [N, K / 32] float32.
// Returns [M, N] in x's dtype.
at::Tensor int4_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && d.dim() == 2 && mins.dim() == 2, "x, packed, d and mins must be 2-D");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && mins.scalar_type() == at::kFloat &&
                  mins.is_contiguous(), "d and mins must be contiguous float32");
  const int64_t rows = x.size(0), k = x.size(1), n_total = packed.size(0);
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) * 2 == k, "packed must be [N, K / 2] with K a multiple of 32, K as x's");
  TORCH_CHECK(d.sizes() == mins.sizes() && d.size(0) == n_total && d.size(1) == k / kGroup, "d and mins must be [N, K / 32]");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, n_total}, x.options().dtype(at::kFloat));
  const float* x_ptr = xf.data_ptr<float>();
  const uint8_t* q_ptr = packed.data_ptr<uint8_t>();
  const float* d_ptr = d.data_ptr<float>();
  const float* m_ptr = mins.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  int64_t n_first = 0;  // outputs before it are done
#if defined(__AVX2__) && defined(__FMA__)
  if (rows >= kPanelRows) {
    const int64_t panels = n_total / kPanelColumns;
    at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
      panel_rows(x_ptr, rows, k, q_ptr, d_ptr, m_ptr, begin, end, n_total, y_ptr);
    });
    n_first = panels * kPanelColumns;
  }
#endif
  if (n_first == n_total) return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  // Fewer rows, or the last N % 4 outputs after the panels.
#if defined(__AVX2__) && defined(__FMA__)
  std::vector<float> sums(rows * (k / kGroup));
  group_sums(x_ptr, rows, k, sums.data());
#endif
  at::parallel_for(n_first, n_total, 64, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__FMA__)
    // Four rows at a time (their accumulators and a group's weights fill the 16 registers), each block
    // widening the weights again.
    const int64_t groups = k / kGroup;
    for (int64_t m = 0; m < rows; m += 4) {
      const float* xm = x_ptr + m * k;
      const float* s = sums.data() + m * groups;
      float* ym = y_ptr + m * n_total;
      switch (std::min<int64_t>(rows - m, 4)) {
        case 1: avx2_rows<1>(xm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
        case 2: avx2_rows<2>(xm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
        case 3: avx2_rows<3>(xm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
        default: avx2_rows<4>(xm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
      }
    }
#else
    generic_rows(x_ptr, rows, k, q_ptr, d_ptr, m_ptr, begin, end, n_total, y_ptr);
#endif
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// As int4_group_mm, but each group of 32 of each row of x quantized to int8 (symmetric, per group) and the
// products summed in integers, as llama.cpp's Q4_1 x Q8 dot does: not exact (x rounded to 8 bits a
// group), about 1.7x faster a decode on a Zen 1, where int4_group_mm is bound by widening and converting
// the weights. The minima's term uses x's exact group sums. Opt-in (int8 activations).
at::Tensor int4_group_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && d.dim() == 2 && mins.dim() == 2, "x, packed, d and mins must be 2-D");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && mins.scalar_type() == at::kFloat &&
                  mins.is_contiguous(), "d and mins must be contiguous float32");
  const int64_t rows = x.size(0), k = x.size(1), n_total = packed.size(0), groups = x.size(1) / kGroup;
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) * 2 == k, "packed must be [N, K / 2] with K a multiple of 32, K as x's");
  TORCH_CHECK(d.sizes() == mins.sizes() && d.size(0) == n_total && d.size(1) == groups, "d and mins must be [N, K / 32]");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({rows, n_total}, x.options().dtype(at::kFloat));
  const float* x_ptr = xf.data_ptr<float>();
  std::vector<int8_t> xq(rows * k);
  std::vector<float> dx(rows * groups), sums(rows * groups, 0.f);
  quantize_groups(x_ptr, rows, k, xq.data(), dx.data());
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < kGroup; ++i) sums[m * groups + g] += x_ptr[m * k + g * kGroup + i];
  const uint8_t* q_ptr = packed.data_ptr<uint8_t>();
  const float* d_ptr = d.data_ptr<float>();
  const float* m_ptr = mins.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  at::parallel_for(0, n_total, 64, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t m = 0; m < rows; m += 4) {
      const int8_t* xm = xq.data() + m * k;
      const float* dm = dx.data() + m * groups;
      const float* s = sums.data() + m * groups;
      float* ym = y_ptr + m * n_total;
      switch (std::min<int64_t>(rows - m, 4)) {
        case 1: avx2_rows_q8<1>(xm, dm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
        case 2: avx2_rows_q8<2>(xm, dm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
        case 3: avx2_rows_q8<3>(xm, dm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
        default: avx2_rows_q8<4>(xm, dm, k, q_ptr, d_ptr, m_ptr, s, begin, end, n_total, ym); break;
      }
    }
#else
    generic_rows_q8(xq.data(), dx.data(), sums.data(), rows, k, q_ptr, d_ptr, m_ptr, begin, end, n_total, y_ptr);
#endif
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The dense float32 weight of packed [N, K / 2] (int4_group_pack), d and mins [N, K / 32], written into out
// [N, K] float32: a larger call's GEMM runs on it, one projection at a time, instead of a dense copy of every
// weight kept for it (2 Zen 3 cores: 0.45 ms for a layer's 3.5 M weights).
void int4_group_dequantize(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& mins, const at::Tensor& out) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous 2-D uint8");
  const int64_t n_total = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(k % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && mins.scalar_type() == at::kFloat &&
                  mins.is_contiguous() && d.sizes() == mins.sizes() && d.dim() == 2 && d.size(0) == n_total &&
                  d.size(1) == k / kGroup, "d and mins must be contiguous float32 [N, K / 32]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n_total &&
                  out.size(1) == k, "out must be contiguous float32 [N, K]");
  TORCH_CHECK(packed.device().is_cpu() && d.device().is_cpu() && mins.device().is_cpu() && out.device().is_cpu(), "CPU tensors only");
  const uint8_t* q_ptr = packed.data_ptr<uint8_t>();
  const float* d_ptr = d.data_ptr<float>();
  const float* m_ptr = mins.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, n_total, 16, [&](int64_t begin, int64_t end) {
    dequantize_rows(q_ptr, d_ptr, m_ptr, k, begin, end, out_ptr + begin * k);
  });
}

// q [N, K] uint8 in 0..15 -> [N, K / 2] uint8: byte i of each group of 32 holds q_i | q_{i+16} << 4.
at::Tensor int4_group_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.size(1) % kGroup == 0,
              "q must be [N, K] uint8 with K a multiple of 32");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(q.max().item<uint8_t>() <= 15, "q must hold values in 0..15");
  auto groups = q.contiguous().view({n, k / kGroup, 2, kGroup / 2});
  auto lo = groups.select(2, 0), hi = groups.select(2, 1);
  return lo.bitwise_or(hi.bitwise_left_shift(4)).contiguous().view({n, k / 2});
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("int4_group_mm(Tensor x, Tensor packed, Tensor d, Tensor mins) -> Tensor");
  m.def("int4_group_mm_q8(Tensor x, Tensor packed, Tensor d, Tensor mins) -> Tensor");
  m.def("int4_group_pack(Tensor q) -> Tensor");
  m.def("int4_group_dequantize(Tensor packed, Tensor d, Tensor mins, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) {
  m.impl("int4_group_mm", &int4_group_mm);
  m.impl("int4_group_mm_q8", &int4_group_mm_q8);
  m.impl("int4_group_pack", &int4_group_pack);
  m.impl("int4_group_dequantize", &int4_group_dequantize);
}

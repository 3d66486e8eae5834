// Causal attention of one prefill chunk, read in place from the paged KV cache.
//
// The chunk's T queries sit at positions start .. start + T - 1 of a context of start + T positions,
// each addressed through its cache slot (as decode attention reads them): no copy of the context is
// gathered, no [T, context] mask is built, and keys past a query's position are never scored.
// Per KV head, the keys the chunk can see are first converted to float32 once, transposed into tiles
// of 16 ([tile][hd][16]), and the values to float32 rows. Each task then takes a few query positions
// of that head's group: their scores against a tile are up to 12 zmm registers filled by broadcast
// FMAs (no horizontal sums), each row gets an exact softmax over the keys it may see, and the value
// rows are accumulated four query rows at a time. Caches may hold q's dtype or packed int8 rows
// (engine/kv_quant.py). Head sizes 64 and 128 on AVX-512; the engine uses SDPA for others.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "cache_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t KT = 16;           // keys per tile: one zmm of scores
constexpr int kMaxRows = 12;         // score rows held in registers
constexpr float kMasked = -1e30f;    // finite: the kernels build with -ffast-math

using zenserve::row_to_float;

// Scores of `rows` (<= kMaxRows) query rows against key tiles [t0, t1): s[r * stride + (t - t0) * 16 + k].
template <int HD, int R>
void score_tiles(const float* q, const float* kt, int64_t t0, int64_t t1, float* s, int64_t stride) {
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const float* tile = kt + t * HD * KT;
    for (int d = 0; d < HD; ++d) {
      const __m512 keys = _mm512_loadu_ps(tile + d * KT);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * HD + d]), keys, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * stride + (t - t0) * KT, acc[r]);
  }
}

template <int HD>
using ScoreFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t);

template <int HD>
ScoreFn<HD> score_fn(int rows) {
  switch (rows) {
    case 1: return score_tiles<HD, 1>;
    case 2: return score_tiles<HD, 2>;
    case 3: return score_tiles<HD, 3>;
    case 4: return score_tiles<HD, 4>;
    case 5: return score_tiles<HD, 5>;
    case 6: return score_tiles<HD, 6>;
    case 7: return score_tiles<HD, 7>;
    case 8: return score_tiles<HD, 8>;
    case 9: return score_tiles<HD, 9>;
    case 10: return score_tiles<HD, 10>;
    case 11: return score_tiles<HD, 11>;
    default: return score_tiles<HD, 12>;
  }
}

// o[r] += sum over columns c in [c0, c1) of p[r][c] * v[c], for N (<= 4) rows.
template <int HD, int N>
void accumulate_values(const float* p, int64_t stride, const float* v, int64_t c0, int64_t c1, float* o) {
  constexpr int C = HD / 16;
  __m512 acc[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t col = c0; col < c1; ++col) {
    __m512 row[C];
    for (int c = 0; c < C; ++c) {
      row[c] = _mm512_loadu_ps(v + col * HD + c * 16);
      asm("" : "+v"(row[c]));  // keep the row in a register: folded into each FMA it is loaded N times
    }
    for (int r = 0; r < N; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * stride + col]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, row[c], acc[r][c]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * HD + c * 16, acc[r][c]);
}

template <int HD>
void accumulate_rows(const float* p, int64_t stride, const float* v, const int64_t* c0, const int64_t* c1,
                     int rows, float* o) {
  int r = 0;
  constexpr int N = HD == 64 ? 6 : 3;  // accumulators: N * HD / 16 zmm
  for (; r + N <= rows; r += N) {
    // The rows' widest column range; columns outside a row's own range hold probability 0.
    const int64_t lo = *std::min_element(c0 + r, c0 + r + N), hi = *std::max_element(c1 + r, c1 + r + N);
    accumulate_values<HD, N>(p + r * stride, stride, v, lo, hi, o + r * HD);
  }
  for (; r < rows; ++r) accumulate_values<HD, 1>(p + r * stride, stride, v, c0[r], c1[r], o + r * HD);
}

template <int HD, typename scalar_t, typename cache_t>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slots, int64_t start, int64_t window, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), KVH = k_cache.size(1), G = H / KVH;
  const int64_t context = start + T;
  // The lowest key any query of the chunk may see.
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t n_keys = context - first_key, n_tiles = (n_keys + KT - 1) / KT;
  const cache_t* k_ptr = reinterpret_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = reinterpret_cast<const cache_t*>(v_cache.data_ptr());
  const int64_t slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t q_pos_stride = q.stride(0), q_head_stride = q.stride(1);
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  // Phase 1: each head's visible keys as transposed float32 tiles, its values as float32 rows.
  std::vector<float> kt(static_cast<size_t>(KVH * n_tiles * HD * KT), 0.f);
  std::vector<float> vf(static_cast<size_t>(KVH * n_keys * HD));
  at::parallel_for(0, KVH * n_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float row[HD];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / n_tiles, t = task % n_tiles;
      float* tile = kt.data() + (h * n_tiles + t) * HD * KT;
      for (int64_t k = 0; k < KT && t * KT + k < n_keys; ++k) {
        const int64_t j = t * KT + k, slot = slot_ptr[first_key + j];
        row_to_float(k_ptr + slot * slot_stride + h * head_stride, HD, row);
        for (int d = 0; d < HD; ++d) tile[d * KT + k] = row[d];
        row_to_float(v_ptr + slot * slot_stride + h * head_stride, HD, vf.data() + (h * n_keys + j) * HD);
      }
    }
  });

  // Phase 2: tasks of (KV head, a few query positions); rows are (position, query head of the group).
  const int64_t positions_per_task = std::max<int64_t>(1, kMaxRows / G);
  const int64_t n_qtiles = (T + positions_per_task - 1) / positions_per_task;
  const ScoreFn<HD> score_block = score_fn<HD>(kMaxRows);
  at::parallel_for(0, KVH * n_qtiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, s, o;
    std::vector<int64_t> c0, c1;
    for (int64_t task = begin; task < end; ++task) {
      // Causal work grows with the position: alternate cheap and costly tiles, so that the
      // contiguous ranges parallel_for hands each thread weigh about the same.
      const int64_t h = task % KVH, j = task / KVH;
      const int64_t qt = (j % 2 == 0) ? j / 2 : n_qtiles - 1 - j / 2;
      const int64_t p0 = qt * positions_per_task, p1 = std::min(T, p0 + positions_per_task);
      const int rows = static_cast<int>((p1 - p0) * G);
      qf.assign(static_cast<size_t>(rows) * HD, 0.f);
      c0.resize(rows);
      c1.resize(rows);
      for (int64_t i = p0; i < p1; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int r = static_cast<int>((i - p0) * G + g);
          row_to_float(q_ptr + i * q_pos_stride + (h * G + g) * q_head_stride, HD, qf.data() + r * HD);
          for (int d = 0; d < HD; ++d) qf[r * HD + d] *= fscale;
          const int64_t pos = start + i;
          c0[r] = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - first_key;
          c1[r] = pos + 1 - first_key;  // columns are keys counted from first_key
        }
      }
      // Tiles from the one holding the lowest visible key to the one holding the highest.
      const int64_t t0 = *std::min_element(c0.begin(), c0.end()) / KT;
      const int64_t t1 = (*std::max_element(c1.begin(), c1.end()) + KT - 1) / KT;
      const int64_t stride = (t1 - t0) * KT;
      s.resize(static_cast<size_t>(rows) * stride);
      for (int r = 0; r < rows; r += kMaxRows) {
        const int block = std::min(kMaxRows, rows - r);
        (block == kMaxRows ? score_block : score_fn<HD>(block))(qf.data() + r * HD, kt.data() + h * n_tiles * HD * KT,
                                                               t0, t1, s.data() + r * stride, stride);
      }
      // Softmax per row over its own columns; probability 0 elsewhere. Columns are shifted by t0 tiles.
      std::vector<float> inv_sum(rows);
      for (int r = 0; r < rows; ++r) {
        float* sr = s.data() + r * stride;
        const int64_t lo = c0[r] - t0 * KT, hi = c1[r] - t0 * KT;
        float mx = kMasked;
        for (int64_t c = lo; c < hi; ++c) mx = std::max(mx, sr[c]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = lo; c < hi; ++c) {
          sr[c] = std::exp(sr[c] - mx);
          sum += sr[c];
        }
        std::fill(sr, sr + lo, 0.f);
        std::fill(sr + hi, sr + stride, 0.f);
        inv_sum[r] = 1.f / sum;
        c0[r] = lo;
        c1[r] = hi;
      }
      o.resize(static_cast<size_t>(rows) * HD);
      accumulate_rows<HD>(s.data(), stride, vf.data() + (h * n_keys + t0 * KT) * HD, c0.data(), c1.data(), rows,
                          o.data());
      for (int64_t i = p0; i < p1; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int r = static_cast<int>((i - p0) * G + g);
          scalar_t* dst = out_ptr + (i * H + h * G + g) * HD;
          for (int d = 0; d < HD; ++d) dst[d] = static_cast<scalar_t>(o[r * HD + d] * inv_sum[r]);
        }
      }
    }
  });
}

}  // namespace
#endif

// q [T, H, hd] (last dim contiguous): a chunk's queries at positions start .. start + T - 1;
// k_cache, v_cache [num_slots, KVH, hd] in q's dtype, or int8 rows [num_slots, KVH, hd + 4];
// slots [start + T] int64: the cache slot of every position of the context; window > 0 limits each
// query to its last `window` positions. Returns [T, H, hd] in q's dtype.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& slots, int64_t start, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(q.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "the caches must be contiguous and alike");
  const int64_t head_dim = q.size(2);
  const bool int8_cache = zenserve::is_int8_rows(k_cache, head_dim);
  TORCH_CHECK(int8_cache || (k_cache.scalar_type() == q.scalar_type() && k_cache.size(2) == head_dim),
              "the caches must hold q's dtype and head size, or int8 rows of head size + 4 bytes");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head sizes 64 and 128 only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q must be bfloat16 or float32");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(start >= 0 && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == start + q.size(0), "slots must be [start + T] int64");
  auto slot_values = slots.accessor<int64_t, 1>();
  for (int64_t i = 0; i < slots.size(0); ++i) {
    TORCH_CHECK(slot_values[i] >= 0 && slot_values[i] < k_cache.size(0), "slot outside the cache");
  }
  auto out = at::empty({q.size(0), q.size(1), head_dim}, q.options());
  if (q.size(0) == 0) return out;
#if defined(__AVX512F__)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    if (int8_cache) {
      if (head_dim == 64) prefill_attention<64, scalar_t, int8_t>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention<128, scalar_t, int8_t>(q, k_cache, v_cache, slots, start, window, scale, out);
    } else {
      if (head_dim == 64) prefill_attention<64, scalar_t, scalar_t>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention<128, scalar_t, scalar_t>(q, k_cache, v_cache, slots, start, window, scale, out);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "paged_prefill_attention needs AVX-512");
#endif
}

// Whether this build has the kernel (AVX-512).
bool paged_prefill_attention_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, int start, int window, "
        "float scale) -> Tensor");
  m.def("paged_prefill_attention_supported() -> bool");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }

TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) {
  m.impl("paged_prefill_attention_supported", &paged_prefill_attention_supported);
}

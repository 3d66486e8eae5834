// Single-query (decode) attention read in place from a paged KV cache.
//
// Each decode's context is addressed through its per-position cache slots, so no copy of the
// context is gathered; scores and the weighted sum accumulate in float32. One task per
// (sequence, KV head): the task converts each key and value row to float once and serves every
// query head of that KV head's group with it (GQA). bfloat16 with common head and group sizes takes
// an AVX-512 path with everything in registers (bf16 keys' scores on VDPBF16PS where the CPU has it);
// without AVX-512, float32 and bfloat16 queries take an AVX2 path; other shapes and dtypes a generic loop.
// The slots must lie inside the caches: the engine builds them from the blocks it owns.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "avx512_exp.h"
#include "cache_rows.h"
#include "fp8_rows.h"
#include "reduce16.h"
#include "rope_row.h"

namespace {

using zenserve::int8_row_scale;
using zenserve::row_to_float;

template <typename scalar_t, typename cache_t>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, const at::Tensor& context_lens, int64_t window,
                             double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t kv_slot_stride = k_cache.stride(0), kv_head_stride = k_cache.stride(1);
  const int64_t slots_stride = slots.stride(0);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const int64_t* slots_ptr = slots.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row(head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t context = lens_ptr[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      const int64_t n = context - first;
      const int64_t* seq_slots = slots_ptr + s * slots_stride + first;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + s * q_seq_stride + (h * group + g) * q_head_stride;
        float* dst = qf.data() + g * head_dim;
        row_to_float(src, head_dim, dst);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] *= fscale;
      }
      scores.resize(group * n);
      // Scores, one key row at a time for every query head of the group.
      for (int64_t t = 0; t < n; ++t) {
        row_to_float(k_ptr + seq_slots[t] * kv_slot_stride + h * kv_head_stride, head_dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          scores[g * n + t] = dot;
        }
      }
      // Softmax per query head.
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -FLT_MAX;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      // The probability-weighted sum of the value rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        row_to_float(v_ptr + seq_slots[t] * kv_slot_stride + h * kv_head_stride, head_dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_ptr + (s * num_heads + h * group + g) * head_dim;
        const float* ag = acc.data() + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(ag[d] * inv_sum[g]);
      }
    }
  });
}


// The specialized paths' outer loop: one task per (sequence, KV head), each given its query heads,
// its KV head's rows, its window of slots and its output heads. Q: the query's element type as the
// task reads it, O: the output's.
template <typename Q, typename O, typename C, typename TaskFn>
void run_decode_tasks(TaskFn task_fn, const Q* q_ptr, const C* k_ptr, const C* v_ptr, O* out_ptr, const at::Tensor& q,
                      const at::Tensor& k_cache, const at::Tensor& slots, const at::Tensor& context_lens,
                      int64_t window, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t* slots_ptr = slots.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t kv_slot_stride = k_cache.stride(0), kv_head_stride = k_cache.stride(1);
  const int64_t slots_stride = slots.stride(0);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t context = lens_ptr[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      task_fn(q_ptr + s * q_seq_stride + h * group * q_head_stride, q_head_stride, k_ptr + h * kv_head_stride,
              v_ptr + h * kv_head_stride, kv_slot_stride, slots_ptr + s * slots_stride + first, context - first,
              static_cast<float>(scale), out_ptr + (s * num_heads + h * group) * head_dim, scores);
    }
  });
}

// The G query heads' scores (sc [G, n]) turned into exp(score - max) in place, and each head's 1 / sum of
// them: the weighted sum of values is scaled once at the end rather than every weight divided.
template <int G>
inline void softmax_unnormalized(float* sc, int64_t n, float* inv_sum) {
  for (int g = 0; g < G; ++g) {
    float* sg = sc + g * n;
    float mx = -FLT_MAX;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    inv_sum[g] = 1.f / sum;
  }
}

#if defined(__AVX512F__)
// A bfloat16 query over bfloat16 or int8 cache rows, with the head size and group size known at
// compile time: the query, the key row and the output accumulators live in zmm registers. (The
// generic loop above spills them, and its FMA chains run serially: 5x slower at 16 decodes on one
// thread, 1,164 vs 223 us.)
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

struct Bf16Rows {
  using T = uint16_t;
  static constexpr bool kScaled = false;
  static __m512 load16(const T* row, int c) { return load_bf16x16(row + c * 16); }
  static float scale(const T*, int) { return 1.f; }
};

struct Int8Rows {
  using T = int8_t;
  static constexpr bool kScaled = true;
  static __m512 load16(const T* row, int c) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
  }
  static float scale(const T* row, int head_dim) { return int8_row_scale(row, head_dim); }
};

#if defined(ZENSERVE_FP8_AVX512)
// float8 e4m3fn rows, widened exactly (zenserve::fp8x16_to_float).
struct Fp8Rows {
  using T = uint8_t;
  static constexpr bool kScaled = false;
  static __m512 load16(const T* row, int c) { return zenserve::fp8x16_to_float(row + c * 16); }
  static float scale(const T*, int) { return 1.f; }
};
#endif

// Rows PF positions ahead are prefetched into L2. A sequence's blocks lie anywhere once the pool has
// been through many requests, and the hardware prefetcher loses the stream at each block's edge; L1
// (T0) prefetches stall on L1's few miss buffers. 30 layers of 16 decodes x 355 positions, bf16: T0
// 8.1 / 9.9 ms on consecutive / scattered blocks, T1 6.3 / 8.1 ms (Zen 4).
constexpr int64_t PF = 32;

inline void prefetch_row(const void* row, int64_t row_bytes) {
  _mm_prefetch(static_cast<const char*>(row), _MM_HINT_T1);
  _mm_prefetch(static_cast<const char*>(row) + row_bytes - 1, _MM_HINT_T1);
}

#if defined(__AVX512BF16__)
// Scores of bf16 key rows for positions [0, n - n % 16) into sc[g * n + t]: VDPBF16PS multiplies the
// bf16 query by the rows as stored (no conversion), 16 positions' sums are reduced together, and the
// scale applies to the sum. Returns the first position left for the row-at-a-time loop. 30 layers of
// 16 decodes x 355 positions on scattered blocks: 8.1 -> 7.3 ms; 32 x 400: 20.3 -> 17.2 ms.
template <int HD, int G>
int64_t bf16_scores_by_16(const uint16_t* q, int64_t q_head_stride, const uint16_t* k, int64_t kv_slot_stride,
                          const int64_t* seq_slots, int64_t n, float scale, float* sc) {
  constexpr int C2 = HD / 32;  // 32-value bf16 chunks per head
  __m512i qb[G][C2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C2; ++c) qb[g][c] = _mm512_loadu_si512(q + g * q_head_stride + c * 32);
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const uint16_t* rows[16];
    for (int j = 0; j < 16; ++j) {
      rows[j] = k + seq_slots[t + j] * kv_slot_stride;
      if (t + j + PF < n) prefetch_row(k + seq_slots[t + j + PF] * kv_slot_stride, HD * 2);
    }
    for (int g = 0; g < G; ++g) {
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qb[g][0], (__m512bh)_mm512_loadu_si512(rows[j]));
        for (int c = 1; c < C2; ++c)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)qb[g][c], (__m512bh)_mm512_loadu_si512(rows[j] + c * 32));
        a[j] = acc;
      }
      _mm512_storeu_ps(sc + g * n + t, _mm512_mul_ps(zenserve::sum16(a), vscale));
    }
  }
  return t;
}
#endif

template <int HD, int G, typename Rows>
void attend_task(const uint16_t* q, int64_t q_head_stride, const typename Rows::T* k, const typename Rows::T* v,
                 int64_t kv_slot_stride, const int64_t* seq_slots, int64_t n, float scale, c10::BFloat16* out,
                 std::vector<float>& scores) {
  constexpr int C = HD / 16;  // 16-float chunks per head
  constexpr int64_t kRowBytes = HD * sizeof(typename Rows::T) + (Rows::kScaled ? sizeof(float) : 0);
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      qv[g][c] = _mm512_mul_ps(load_bf16x16(q + g * q_head_stride + c * 16), _mm512_set1_ps(scale));
  scores.resize(static_cast<size_t>(G) * n);
  float* sc = scores.data();
  int64_t t = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Rows, Bf16Rows>) t = bf16_scores_by_16<HD, G>(q, q_head_stride, k, kv_slot_stride, seq_slots, n, scale, sc);
#endif
  for (; t < n; ++t) {
    const typename Rows::T* kr = k + seq_slots[t] * kv_slot_stride;
    if (t + PF < n) prefetch_row(k + seq_slots[t + PF] * kv_slot_stride, kRowBytes);
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = Rows::load16(kr, c);
    const float key_scale = Rows::scale(kr, HD);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      const float dot = _mm512_reduce_add_ps(acc);
      sc[g * n + t] = Rows::kScaled ? dot * key_scale : dot;
    }
  }
  float inv_sum[G];
  softmax_unnormalized<G>(sc, n, inv_sum);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const typename Rows::T* vr = v + seq_slots[t] * kv_slot_stride;
    if (t + PF < n) prefetch_row(v + seq_slots[t + PF] * kv_slot_stride, kRowBytes);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = Rows::load16(vr, c);
    const float value_scale = Rows::scale(vr, HD);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(Rows::kScaled ? sc[g * n + t] * value_scale : sc[g * n + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  alignas(64) float row[HD];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) _mm512_store_ps(row + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
    for (int d = 0; d < HD; ++d) out[g * HD + d] = c10::BFloat16(row[d]);  // round to nearest even
  }
}

template <typename Rows>
using AttendTask = void (*)(const uint16_t*, int64_t, const typename Rows::T*, const typename Rows::T*, int64_t,
                            const int64_t*, int64_t, float, c10::BFloat16*, std::vector<float>&);

template <int HD, typename Rows>
AttendTask<Rows> task_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_task<HD, 1, Rows>;
    case 2: return attend_task<HD, 2, Rows>;
    case 3: return attend_task<HD, 3, Rows>;
    case 4: return attend_task<HD, 4, Rows>;
    case 5: return attend_task<HD, 5, Rows>;
    case 6: return attend_task<HD, 6, Rows>;
    case 7: return attend_task<HD, 7, Rows>;
    case 8: return attend_task<HD, 8, Rows>;
    default: return nullptr;
  }
}

// The specialized task for these shapes, or nullptr (the generic loop serves them).
template <typename Rows>
AttendTask<Rows> task_for(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 64: return task_for_group<64, Rows>(group);
    case 128: return task_for_group<128, Rows>(group);
    default: return nullptr;
  }
}

#if defined(ZENSERVE_AMX)
// bf16 keys and values of 64-wide heads on AMX's tiles (Intel Xeon since Sapphire Rapids). Scores: 16
// positions' key rows are an A tile as the cache holds them (a block's 16 slots lie 384 B apart on
// SmolLM2; rows elsewhere are gathered first), the group's queries a B tile, and one TDPBF16PS a
// 32-wide half of the head gives the 16 x G scores (exact products, float32 sums, as VDPBF16PS
// gives them). Probabilities are rounded to bf16 once, as a bf16 SDPA does, and normalized by the sum
// of the rounded values. Values: two positions' rows interleaved (VPUNPCKLWD/VPUNPCKHWD) are a row of
// four B tiles, each 16 columns of the head in a fixed order, and the probabilities of 32 positions
// an A tile; the output accumulates in four C tiles over the whole context, un-permuted at the end.
constexpr int kAmxHeadDim = 64;
// Here rows are prefetched into L1, 64 positions ahead: 30 layers of 16 decodes x 441 positions on
// scattered blocks took 8.3 ms with the L2 prefetch 32 ahead above, 6.9 with this (2 Xeon cores).
constexpr int64_t kAmxPrefetch = 64;

// A head's row: two cache lines of bf16, one of float8.
template <typename T>
inline void prefetch_row_l1(const T* row) {
  _mm_prefetch(reinterpret_cast<const char*>(row), _MM_HINT_T0);
  if constexpr (sizeof(T) == 2) _mm_prefetch(reinterpret_cast<const char*>(row) + 64, _MM_HINT_T0);
}

// A 64-wide row as two 32-value halves of bf16 bits: as stored, or float8 widened exactly.
template <typename Rows>
inline void load_row_bf16(const typename Rows::T* row, __m512i& lo, __m512i& hi) {
#if defined(ZENSERVE_FP8_AVX512)
  if constexpr (std::is_same_v<Rows, Fp8Rows>) {
#if defined(__AVX512VBMI__)
    zenserve::fp8x64_to_bf16(row, lo, hi);
#else
    lo = zenserve::fp8x32_to_bf16(row);
    hi = zenserve::fp8x32_to_bf16(row + 32);
#endif
    return;
  }
#endif
  lo = _mm512_loadu_si512(row);
  hi = _mm512_loadu_si512(row + 32);
}

// Rows: Bf16Rows, or Fp8Rows, each row widened to bf16 as it is read (the scores' key rows are then always
// gathered): the tiles see the values the bf16 path sees over the widened cache, so the outputs are the same.
template <int G, typename Rows>
void attend_task_amx(const uint16_t* q, int64_t q_head_stride, const typename Rows::T* k, const typename Rows::T* v,
                     int64_t kv_slot_stride, const int64_t* seq_slots, int64_t n, float scale, c10::BFloat16* out,
                     std::vector<float>& scratch) {
  constexpr int HD = kAmxHeadDim;
  constexpr int64_t kRowBytes = HD * 2;  // a gathered bf16 row
  constexpr bool kWidened = !std::is_same_v<Rows, Bf16Rows>;
  const int64_t padded = (n + 31) / 32 * 32;
  scratch.resize(static_cast<size_t>(G * n + G * padded / 2));
  float* sc = scratch.data();
  uint16_t* probs = reinterpret_cast<uint16_t*>(sc + G * n);  // [G, padded] bf16, zero past n
  const int64_t stride = kv_slot_stride * static_cast<int64_t>(sizeof(typename Rows::T));

  // Scores. Tiles 0, 1: the two halves of 16 key rows (A); 2, 3: the queries' halves (B, 16 pairs x G);
  // 4: the 16 x G scores (C).
  zenserve::TileConfig scores_config;
  scores_config.set(0, 16, 64);
  scores_config.set(1, 16, 64);
  scores_config.set(2, 16, 4 * G);
  scores_config.set(3, 16, 4 * G);
  scores_config.set(4, 16, 4 * G);
  _tile_loadconfig(&scores_config);
  alignas(64) uint32_t queries[2][16 * G];  // [half][pair p][g]: query g's elements 32 half + 2p, + 1
  for (int half = 0; half < 2; ++half)
    for (int p = 0; p < 16; ++p)
      for (int g = 0; g < G; ++g)
        std::memcpy(&queries[half][p * G + g], q + g * q_head_stride + 32 * half + 2 * p, 4);
  _tile_loadd(2, queries[0], 4 * G);
  _tile_loadd(3, queries[1], 4 * G);
  alignas(64) uint16_t gathered[16 * HD];
  alignas(64) float block_scores[16 * G];
  for (int64_t t = 0; t < n; t += 16) {
    const int64_t rows = std::min<int64_t>(16, n - t);
    for (int64_t j = 0; j < 16 && t + j + kAmxPrefetch < n; ++j) prefetch_row_l1(k + seq_slots[t + j + kAmxPrefetch] * kv_slot_stride);
    bool consecutive = !kWidened && rows == 16;
    for (int64_t j = 1; j < rows && consecutive; ++j) consecutive = seq_slots[t + j] == seq_slots[t] + j;
    const uint16_t* base = gathered;
    int64_t base_stride = kRowBytes;
    if (consecutive) {
      base = reinterpret_cast<const uint16_t*>(k + seq_slots[t] * kv_slot_stride);
      base_stride = stride;
    } else {
      for (int64_t j = 0; j < 16; ++j) {
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        if (j < rows) load_row_bf16<Rows>(k + seq_slots[t + j] * kv_slot_stride, lo, hi);
        _mm512_store_si512(gathered + j * HD, lo);
        _mm512_store_si512(gathered + j * HD + 32, hi);
      }
    }
    _tile_loadd(0, base, base_stride);
    _tile_loadd(1, base + 32, base_stride);
    _tile_zero(4);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, block_scores, 4 * G);
    for (int64_t j = 0; j < rows; ++j)
      for (int g = 0; g < G; ++g) sc[g * n + t + j] = block_scores[j * G + g] * scale;
  }

  // The values' first rows load while the probabilities are computed.
  for (int64_t t = 0; t < std::min(n, kAmxPrefetch); ++t) prefetch_row_l1(v + seq_slots[t] * kv_slot_stride);
  // Probabilities, rounded to bf16, and the sums of the rounded values.
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    const float* sg = sc + g * n;
    uint16_t* pg = probs + g * padded;
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 live = t + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-FLT_MAX), live, sg + t));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 live = t + 16 <= n ? 0xFFFF : t < n ? static_cast<__mmask16>((1u << (n - t)) - 1) : 0;
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), m);
      // exp_ps stops at e^-87 (about 1e-38); a score that far below the best weighs nothing, as with expf.
      const __mmask16 weighs = live & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
      const __m512 e = _mm512_maskz_mov_ps(weighs, zenserve::exp_ps(x));
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + t), rounded);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
  }

  // Values. Tiles 0, 1: interleaved value rows (B); 2: 32 positions' probabilities (A, G rows);
  // 4-7: the output's four column sets (C, G x 16).
  zenserve::TileConfig values_config;
  values_config.set(0, 16, 64);
  values_config.set(1, 16, 64);
  values_config.set(2, G, 64);
  for (int t = 4; t < 8; ++t) values_config.set(t, G, 64);
  _tile_loadconfig(&values_config);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  alignas(64) uint16_t pairs[4][16 * 32];
  for (int64_t t = 0; t < padded; t += 32) {
    for (int p = 0; p < 16; ++p) {
      __m512i r[2][2];
      for (int i = 0; i < 2; ++i) {
        const int64_t pos = t + 2 * p + i;
        if (pos + kAmxPrefetch < n) prefetch_row_l1(v + seq_slots[pos + kAmxPrefetch] * kv_slot_stride);
        r[i][0] = r[i][1] = _mm512_setzero_si512();
        if (pos < n) load_row_bf16<Rows>(v + seq_slots[pos] * kv_slot_stride, r[i][0], r[i][1]);
      }
      _mm512_store_si512(pairs[0] + p * 32, _mm512_unpacklo_epi16(r[0][0], r[1][0]));
      _mm512_store_si512(pairs[1] + p * 32, _mm512_unpackhi_epi16(r[0][0], r[1][0]));
      _mm512_store_si512(pairs[2] + p * 32, _mm512_unpacklo_epi16(r[0][1], r[1][1]));
      _mm512_store_si512(pairs[3] + p * 32, _mm512_unpackhi_epi16(r[0][1], r[1][1]));
    }
    _tile_loadd(2, probs + t, padded * 2);
    _tile_loadd(0, pairs[0], 64);
    _tile_dpbf16ps(4, 2, 0);
    _tile_loadd(1, pairs[1], 64);
    _tile_dpbf16ps(5, 2, 1);
    _tile_loadd(0, pairs[2], 64);
    _tile_dpbf16ps(6, 2, 0);
    _tile_loadd(1, pairs[3], 64);
    _tile_dpbf16ps(7, 2, 1);
  }
  alignas(64) float sums[4][G * 16];
  _tile_stored(4, sums[0], 64);
  _tile_stored(5, sums[1], 64);
  _tile_stored(6, sums[2], 64);
  _tile_stored(7, sums[3], 64);
  _tile_release();
  // Column c of set s: 128-bit lane l = c / 4 of the unpack, element c % 4; lo sets take lane elements
  // 0-3, hi sets 4-7; sets 2 and 3 the head's second 32.
  for (int g = 0; g < G; ++g)
    for (int set = 0; set < 4; ++set)
      for (int c = 0; c < 16; ++c) {
        const int d = 32 * (set / 2) + 8 * (c / 4) + 4 * (set % 2) + c % 4;
        out[g * HD + d] = c10::BFloat16(sums[set][g * 16 + c] * inv_sum[g]);
      }
}

template <typename Rows>
AttendTask<Rows> amx_task_for(int64_t head_dim, int64_t group) {
  if (head_dim != kAmxHeadDim || !zenserve::amx_permitted()) return nullptr;
  switch (group) {
    case 1: return attend_task_amx<1, Rows>;
    case 2: return attend_task_amx<2, Rows>;
    case 3: return attend_task_amx<3, Rows>;
    case 4: return attend_task_amx<4, Rows>;
    case 5: return attend_task_amx<5, Rows>;
    case 6: return attend_task_amx<6, Rows>;
    case 7: return attend_task_amx<7, Rows>;
    case 8: return attend_task_amx<8, Rows>;
    default: return nullptr;
  }
}
#endif

template <typename Rows>
bool bf16_query_fast_path(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& slots, const at::Tensor& context_lens, int64_t window, double scale,
                          at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  AttendTask<Rows> task_fn = nullptr;
#if defined(ZENSERVE_AMX)
  if constexpr (!Rows::kScaled) task_fn = amx_task_for<Rows>(head_dim, group);
#endif
  if (task_fn == nullptr) task_fn = task_for<Rows>(head_dim, group);
  if (task_fn == nullptr) return false;
  using T = typename Rows::T;
  run_decode_tasks(task_fn, reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()),
                   static_cast<const T*>(k_cache.data_ptr()), static_cast<const T*>(v_cache.data_ptr()),
                   out.data_ptr<c10::BFloat16>(), q, k_cache, slots, context_lens, window, scale);
  return true;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The same on AVX2 (Zen 2 and 3) for float32 and bfloat16 queries over float32, bfloat16 or int8 rows
// (and float32 ones over float16 rows):
// eight floats a register and 16 registers, so the query stays in L1 and the values' sums run over
// slices of the head narrow enough for the group's accumulators to fit. (The generic loop above took
// 139 us a layer at batch 1 and ~250 positions on a Zen 3.)
namespace avx2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
inline float row_scale(const float*, int64_t) { return 1.f; }
inline float row_scale(const c10::BFloat16*, int64_t) { return 1.f; }
inline float row_scale(const c10::Half*, int64_t) { return 1.f; }
inline float row_scale(const int8_t* row, int64_t head_dim) { return int8_row_scale(row, head_dim); }

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline void prefetch_row(const void* row, int64_t row_bytes) {
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(static_cast<const char*>(row) + b, _MM_HINT_T1);
}

// Chunks of 8 floats a pass over the values: G accumulators each, plus the value row's, in 16 registers.
template <int C, int G>
constexpr int value_slice() {
  int slice = C;
  while (slice > 1 && (slice * (G + 1) > 16 || C % slice != 0)) slice /= 2;
  return slice;
}

constexpr int64_t PF = 32;  // positions ahead prefetched into L2 (a block's edge loses the hardware's stream)

template <int HD, int G, typename QT, typename CT>
void attend_task(const QT* q, int64_t q_head_stride, const CT* k, const CT* v, int64_t kv_slot_stride,
                 const int64_t* seq_slots, int64_t n, float scale, QT* out, std::vector<float>& scores) {
  constexpr int C = HD / 8;
  constexpr bool kScaled = std::is_same_v<CT, int8_t>;
  constexpr int64_t kRowBytes = HD * sizeof(CT) + (kScaled ? sizeof(float) : 0);
  alignas(32) float qf[G][HD];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      _mm256_store_ps(qf[g] + c * 8, _mm256_mul_ps(load8(q + g * q_head_stride + c * 8), _mm256_set1_ps(scale)));
  scores.resize(static_cast<size_t>(G) * n);
  float* sc = scores.data();
  for (int64_t t = 0; t < n; ++t) {
    const CT* kr = k + seq_slots[t] * kv_slot_stride;
    if (t + PF < n) prefetch_row(k + seq_slots[t + PF] * kv_slot_stride, kRowBytes);
    __m256 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load8(kr + c * 8);
    const float key_scale = row_scale(kr, HD);
    for (int g = 0; g < G; ++g) {
      // Two chains: half the FMA latency a row.
      __m256 a0 = _mm256_mul_ps(_mm256_load_ps(qf[g]), kv[0]);
      __m256 a1 = _mm256_mul_ps(_mm256_load_ps(qf[g] + 8), kv[1]);
      for (int c = 2; c < C; c += 2) {
        a0 = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + c * 8), kv[c], a0);
        a1 = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + c * 8 + 8), kv[c + 1], a1);
      }
      const float dot = hsum(_mm256_add_ps(a0, a1));
      sc[g * n + t] = kScaled ? dot * key_scale : dot;
    }
  }
  float inv_sum[G];
  softmax_unnormalized<G>(sc, n, inv_sum);
  if constexpr (kScaled) {  // fold each value row's scale into its weights once
    for (int64_t t = 0; t < n; ++t) {
      const float value_scale = row_scale(v + seq_slots[t] * kv_slot_stride, HD);
      for (int g = 0; g < G; ++g) sc[g * n + t] *= value_scale;
    }
  }
  constexpr int S = value_slice<C, G>();
  alignas(32) float row[HD];
  for (int c0 = 0; c0 < C; c0 += S) {
    __m256 acc[G][S];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < S; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const CT* vr = v + seq_slots[t] * kv_slot_stride + c0 * 8;
      if (c0 == 0 && t + PF < n) prefetch_row(v + seq_slots[t + PF] * kv_slot_stride, kRowBytes);
      __m256 vv[S];
      for (int c = 0; c < S; ++c) vv[c] = load8(vr + c * 8);
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_broadcast_ss(sc + g * n + t);
        for (int c = 0; c < S; ++c) acc[g][c] = _mm256_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < S; ++c) _mm256_store_ps(row + c * 8, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv_sum[g])));
      for (int d = 0; d < S * 8; ++d) out[g * HD + c0 * 8 + d] = static_cast<QT>(row[d]);  // bf16: nearest even
    }
  }
}

template <typename QT, typename CT>
using Task = void (*)(const QT*, int64_t, const CT*, const CT*, int64_t, const int64_t*, int64_t, float, QT*,
                      std::vector<float>&);

template <int HD, typename QT, typename CT>
Task<QT, CT> task_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_task<HD, 1, QT, CT>;
    case 2: return attend_task<HD, 2, QT, CT>;
    case 3: return attend_task<HD, 3, QT, CT>;
    case 4: return attend_task<HD, 4, QT, CT>;
    case 5: return attend_task<HD, 5, QT, CT>;
    case 6: return attend_task<HD, 6, QT, CT>;
    case 7: return attend_task<HD, 7, QT, CT>;
    case 8: return attend_task<HD, 8, QT, CT>;
    default: return nullptr;
  }
}

// Runs the specialized tasks where they exist for these shapes; false: the generic loop serves.
template <typename QT, typename CT>
bool fast_path(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
               const at::Tensor& context_lens, int64_t window, double scale, at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const Task<QT, CT> task_fn = head_dim == 64 ? task_for_group<64, QT, CT>(group)
                               : head_dim == 128 ? task_for_group<128, QT, CT>(group) : nullptr;
  if (task_fn == nullptr) return false;
  run_decode_tasks(task_fn, q.data_ptr<QT>(), static_cast<const CT*>(k_cache.data_ptr()),
                   static_cast<const CT*>(v_cache.data_ptr()), out.data_ptr<QT>(), q, k_cache, slots, context_lens,
                   window, scale);
  return true;
}

}  // namespace avx2
#endif

}  // namespace

// q [D, H, hd] (last dim contiguous); k_cache, v_cache [num_slots, KVH, hd] contiguous in q's dtype (or
// float16 under a float32 q, or float8 e4m3fn), or [num_slots, KVH, hd + 4] int8 rows with their scales; slots [D, >= max context] int64 (position ->
// cache slot); context_lens [D] int64 (>= 1; the query is the last position); window > 0 limits each
// query to its last `window` positions. Returns [D, H, hd] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slots, const at::Tensor& context_lens, int64_t window,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache differ in shape or dtype");
  const bool int8_cache = zenserve::is_int8_rows(k_cache, q.size(2));
  const bool float16_cache = zenserve::is_float16_rows(k_cache, q.scalar_type(), q.size(2));
  const bool fp8_cache = zenserve::is_fp8_rows(k_cache, q.size(2));
  TORCH_CHECK(int8_cache || float16_cache || fp8_cache ||
                  (q.scalar_type() == k_cache.scalar_type() && q.size(2) == k_cache.size(2)),
              "the caches must hold q's dtype and head size, float16 rows under a float32 q, float8 e4m3fn rows, "
              "or int8 rows of head size + 4 bytes");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.stride(1) == 1 &&
                  slots.size(0) == q.size(0), "slots must be [D, L] int64, rows contiguous");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 &&
                  context_lens.is_contiguous() && context_lens.size(0) == q.size(0),
              "context_lens must be [D] int64");
  TORCH_CHECK(q.device().is_cpu(), "CPU tensors only");
  auto lens = context_lens.accessor<int64_t, 1>();
  for (int64_t s = 0; s < lens.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= slots.size(1), "context length out of range");
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kBFloat16) {
    bool done = false;
    if (int8_cache) {
      done = bf16_query_fast_path<Int8Rows>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    } else if (fp8_cache) {
#if defined(ZENSERVE_FP8_AVX512)
      done = bf16_query_fast_path<Fp8Rows>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
#endif
    } else {
      done = bf16_query_fast_path<Bf16Rows>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    }
    if (done) return out;
  }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (!fp8_cache) {  // float8 rows take the generic loop here (the engine serves them on AVX-512 only)
    bool done = false;
    if (q.scalar_type() == at::kFloat) {
      if (int8_cache) {
        done = avx2::fast_path<float, int8_t>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
      } else if (float16_cache) {
#if defined(__F16C__)
        done = avx2::fast_path<float, c10::Half>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
#endif
      } else {
        done = avx2::fast_path<float, float>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
      }
    } else if (q.scalar_type() == at::kBFloat16) {
      done = int8_cache
          ? avx2::fast_path<c10::BFloat16, int8_t>(q, k_cache, v_cache, slots, context_lens, window, scale, out)
          : avx2::fast_path<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    }
    if (done) return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (int8_cache) {
      decode_attention_kernel<scalar_t, int8_t>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    } else if (fp8_cache) {
      decode_attention_kernel<scalar_t, c10::Float8_e4m3fn>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    } else if (float16_cache) {
      decode_attention_kernel<scalar_t, c10::Half>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    } else {
      decode_attention_kernel<scalar_t, scalar_t>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
    }
  });
  return out;
}

namespace {

using zenserve::rope_row;

// A K or V row into its cache row: as is, or quantized to packed int8 exactly as engine/kv_quant.py
// does (scale = max|x| * (1/127); q = round-half-even(x * (127 / max|x|))).
template <typename scalar_t>
inline void store_row(const scalar_t* x, int64_t head_dim, scalar_t* dst) {
  std::copy(x, x + head_dim, dst);
}

// float16 rows under a float32 model: rounded to nearest even, as torch's cast (the torch path's write) does.
inline void store_row(const float* x, int64_t head_dim, c10::Half* dst) {
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<c10::Half>(x[d]);
}

// float8 e4m3fn rows: rounded to nearest even and saturated, as torch's cast (the torch path's write) does.
template <typename scalar_t>
inline void store_row(const scalar_t* x, int64_t head_dim, c10::Float8_e4m3fn* dst) {
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = zenserve::to_fp8(static_cast<float>(x[d]));
}

template <typename scalar_t>
inline void store_row(const scalar_t* x, int64_t head_dim, int8_t* dst) {
  float absmax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::fabs(static_cast<float>(x[d])));
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  for (int64_t d = 0; d < head_dim; ++d)
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[d]) * inv))));
  constexpr float kInv127 = 1.f / 127.f;
  const float scale = absmax * kInv127;
  std::memcpy(dst + head_dim, &scale, sizeof(float));
}

template <typename scalar_t, typename cache_t>
void rope_and_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& write_slots, at::Tensor& q) {
  const int64_t num_seqs = qkv.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const scalar_t* qkv_ptr = qkv.data_ptr<scalar_t>();
  const int64_t row_stride = qkv.stride(0);
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  const int64_t* write_ptr = write_slots.data_ptr<int64_t>();
  scalar_t* q_ptr = q.data_ptr<scalar_t>();
  cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const int64_t slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  // Tiny (a few rows a sequence): parallel only for large batches.
  at::parallel_for(0, num_seqs, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> k_row(head_dim);
    for (int64_t s = begin; s < end; ++s) {
      const scalar_t* row = qkv_ptr + s * row_stride;
      const float* c = cos_ptr + pos_ptr[s] * head_dim;
      const float* sn = sin_ptr + pos_ptr[s] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rope_row(row + h * head_dim, c, sn, head_dim, q_ptr + (s * num_heads + h) * head_dim);
      const int64_t slot = write_ptr[s];
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        // Rounded to q's dtype first, as the prefill path's k is: both paths store the same rows.
        rope_row(row + (num_heads + h) * head_dim, c, sn, head_dim, k_row.data());
        store_row(k_row.data(), head_dim, k_ptr + slot * slot_stride + h * head_stride);
        store_row(row + (num_heads + num_kv_heads + h) * head_dim, head_dim, v_ptr + slot * slot_stride + h * head_stride);
      }
    }
  });
}

}  // namespace

// A decode-only step's attention block from the fused q/k/v projection, in one call: rotary
// embedding of q and k (float32, rounded once), k and v written to their cache slots, then
// paged_decode_attention. qkv [D, (H + 2 KVH) * hd], rows contiguous; cos, sin [max_positions, hd]
// float32 tables; positions, write_slots [D] int64. Returns [D, H * hd].
at::Tensor decode_attention_block(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                                  const at::Tensor& write_slots, const at::Tensor& slots,
                                  const at::Tensor& context_lens, int64_t num_heads, int64_t window, double scale) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "the caches must be contiguous [slots, KVH, row] and alike");
  TORCH_CHECK(num_heads > 0 && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) % (num_heads + 2 * k_cache.size(1)) == 0,
              "qkv must be [D, (H + 2 KVH) * hd] with contiguous rows");
  const int64_t num_seqs = qkv.size(0), num_kv_heads = k_cache.size(1);
  const int64_t head_dim = qkv.size(1) / (num_heads + 2 * num_kv_heads);
  TORCH_CHECK(head_dim % 2 == 0, "the head size must be even");
  const bool int8_cache = zenserve::is_int8_rows(k_cache, head_dim);
  const bool float16_cache = zenserve::is_float16_rows(k_cache, qkv.scalar_type(), head_dim);
  const bool fp8_cache = zenserve::is_fp8_rows(k_cache, head_dim);
  TORCH_CHECK(int8_cache || float16_cache || fp8_cache ||
                  (qkv.scalar_type() == k_cache.scalar_type() && k_cache.size(2) == head_dim),
              "the caches must hold qkv's dtype and head size, float16 rows under a float32 qkv, float8 e4m3fn "
              "rows, or int8 rows of head size + 4 bytes");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_dim && cos.sizes() == sin.sizes(),
              "cos and sin must be float32 [max_positions, hd] tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == num_seqs &&
                  write_slots.scalar_type() == at::kLong && write_slots.is_contiguous() &&
                  write_slots.numel() == num_seqs, "positions and write_slots must be [D] int64");
  auto pos = positions.accessor<int64_t, 1>();
  auto written = write_slots.accessor<int64_t, 1>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(pos[s] >= 0 && pos[s] < cos.size(0), "position out of the rotary table");
    TORCH_CHECK(written[s] >= 0 && written[s] < k_cache.size(0), "write slot outside the cache");
  }
  auto q = at::empty({num_seqs, num_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_attention_block", [&] {
    if (int8_cache) {
      rope_and_write<scalar_t, int8_t>(qkv, cos, sin, positions, k_cache, v_cache, write_slots, q);
    } else if (fp8_cache) {
      rope_and_write<scalar_t, c10::Float8_e4m3fn>(qkv, cos, sin, positions, k_cache, v_cache, write_slots, q);
    } else if (float16_cache) {
      if constexpr (std::is_same_v<scalar_t, float>)  // is_float16_rows: float32 qkv only
        rope_and_write<float, c10::Half>(qkv, cos, sin, positions, k_cache, v_cache, write_slots, q);
    } else {
      rope_and_write<scalar_t, scalar_t>(qkv, cos, sin, positions, k_cache, v_cache, write_slots, q);
    }
  });
  return paged_decode_attention(q, k_cache, v_cache, slots, context_lens, window, scale).view({num_seqs, num_heads * head_dim});
}

// Whether bf16 queries over a bf16 cache with 64-wide heads run on AMX's tiles here.
bool paged_decode_attention_uses_amx() {
#if defined(ZENSERVE_AMX)
  return zenserve::amx_permitted();
#else
  return false;
#endif
}

TORCH_LIBRARY(zenserve, m) {
  m.def("paged_decode_attention_uses_amx() -> bool");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor context_lens, "
        "int window, float scale) -> Tensor");
  m.def("decode_attention_block(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor write_slots, Tensor slots, Tensor context_lens, int num_heads, int window, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("decode_attention_block", &decode_attention_block);
}

TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) {
  m.impl("paged_decode_attention_uses_amx", &paged_decode_attention_uses_amx);
}

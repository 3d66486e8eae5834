// Causal attention of one prefill chunk, read in place from the paged KV cache.
//
// The chunk's T queries sit at positions start .. start + T - 1 of a context of start + T positions,
// each addressed through its cache slot (as decode attention reads them): no copy of the context is
// gathered, no [T, context] mask is built, and keys past a query's position are never scored.
// Per KV head, the keys the chunk can see are first converted to float32 once, transposed into tiles
// of 16 ([tile][hd][16]; a bf16 query over a bf16 or float8 cache on AVX512_BF16 keeps them bf16, in
// pairs along the head, for VDPBF16PS: 0.78-0.83x the time on a Zen 4), and the values to float32 rows. Each task then takes a few query positions
// of that head's group: their scores against a tile are held in registers filled by broadcast FMAs
// (no horizontal sums; 12 rows on AVX-512, 6 rows of two ymm halves on AVX2), each row gets an exact
// softmax over the keys it may see, and the value rows are accumulated a few query rows at a time.
// Caches may hold q's dtype, float8 e4m3fn rows or packed int8 rows (engine/kv_quant.py). Head sizes 64 and 128 on AVX-512
// or AVX2 with FMA; the engine uses SDPA for others.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ZENSERVE_PREFILL_KERNEL 1
#include <immintrin.h>

namespace {

constexpr int64_t KT = 16;           // keys per tile
constexpr int kMaxRows = 12;         // score rows of a task
constexpr float kMasked = -1e30f;    // finite: the kernels build with -ffast-math

using zenserve::row_to_float;

#if defined(__AVX512F__)
constexpr int kScoreRows = 12;  // score rows held in registers: one zmm of a tile's 16 keys each
constexpr int kValueRows64 = 6, kValueRows128 = 3;  // rows accumulate_values takes at once

// Scores of `rows` (<= kScoreRows) query rows against key tiles [t0, t1): s[r * stride + (t - t0) * 16 + k].
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

// o[r] += sum over columns c in [c0, c1) of p[r][c] * v[c], for N (<= kValueRows) rows.
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
#if defined(__AVX512BF16__)
// The same scores from bf16 queries and keys as stored, on VDPBF16PS: a tile holds its 16 keys' values in
// pairs along the head ([HD / 2][16] 32-bit words, word k of pair p: key k's values 2p and 2p + 1), each
// step multiplies one broadcast pair of a query row with the 16 keys' pairs. Exact products and float32 sums,
// as the float32 FMAs give them, in half the instructions; the scale applies to the sums.
template <int HD, int R>
void score_tiles_bf16(const uint32_t* q, const uint32_t* kt, int64_t t0, int64_t t1, float scale, float* s,
                      int64_t stride) {
  constexpr int P = HD / 2;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t* tile = kt + t * P * KT;
    for (int p = 0; p < P; ++p) {
      const __m512bh keys = (__m512bh)_mm512_loadu_si512(tile + p * KT);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * P + p])), keys);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * stride + (t - t0) * KT, _mm512_mul_ps(acc[r], vscale));
  }
}
#define ZENSERVE_PREFILL_BF16_SCORES 1
#endif
#else
// AVX2's 16 ymm registers: 6 rows of a tile's scores in two halves of 8 keys, the two key halves, a
// broadcast query value.
constexpr int kScoreRows = 6;
constexpr int kValueRows64 = 2, kValueRows128 = 2;

template <int HD, int R>
void score_tiles(const float* q, const float* kt, int64_t t0, int64_t t1, float* s, int64_t stride) {
  for (int64_t t = t0; t < t1; ++t) {
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    const float* tile = kt + t * HD * KT;
    for (int d = 0; d < HD; ++d) {
      const __m256 keys_lo = _mm256_loadu_ps(tile + d * KT), keys_hi = _mm256_loadu_ps(tile + d * KT + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(q + r * HD + d);
        lo[r] = _mm256_fmadd_ps(x, keys_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(x, keys_hi, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * stride + (t - t0) * KT, lo[r]);
      _mm256_storeu_ps(s + r * stride + (t - t0) * KT + 8, hi[r]);
    }
  }
}

// o[r] += sum over columns c in [c0, c1) of p[r][c] * v[c], for N (<= 2) rows, 32 of the head's values
// at a time: 2 x 4 accumulators, the value row's 4 ymm and a broadcast probability.
template <int HD, int N>
void accumulate_values(const float* p, int64_t stride, const float* v, int64_t c0, int64_t c1, float* o) {
  for (int d0 = 0; d0 < HD; d0 += 32) {
    __m256 acc[N][4];
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t col = c0; col < c1; ++col) {
      __m256 row[4];
      for (int c = 0; c < 4; ++c) row[c] = _mm256_loadu_ps(v + col * HD + d0 + c * 8);
      for (int r = 0; r < N; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * stride + col);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(w, row[c], acc[r][c]);
      }
    }
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + r * HD + d0 + c * 8, acc[r][c]);
  }
}
#endif

template <int HD>
using ScoreFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t);

template <int HD>
ScoreFn<HD> score_fn(int rows) {
  switch (std::min(rows, kScoreRows)) {
    case 1: return score_tiles<HD, 1>;
    case 2: return score_tiles<HD, 2>;
    case 3: return score_tiles<HD, 3>;
    case 4: return score_tiles<HD, 4>;
    case 5: return score_tiles<HD, 5>;
#if defined(__AVX512F__)
    case 6: return score_tiles<HD, 6>;
    case 7: return score_tiles<HD, 7>;
    case 8: return score_tiles<HD, 8>;
    case 9: return score_tiles<HD, 9>;
    case 10: return score_tiles<HD, 10>;
    case 11: return score_tiles<HD, 11>;
#endif
    default: return score_tiles<HD, kScoreRows>;
  }
}

#if defined(ZENSERVE_PREFILL_BF16_SCORES)
template <int HD>
using Bf16ScoreFn = void (*)(const uint32_t*, const uint32_t*, int64_t, int64_t, float, float*, int64_t);

template <int HD>
Bf16ScoreFn<HD> bf16_score_fn(int rows) {
  switch (std::min(rows, kScoreRows)) {
    case 1: return score_tiles_bf16<HD, 1>;
    case 2: return score_tiles_bf16<HD, 2>;
    case 3: return score_tiles_bf16<HD, 3>;
    case 4: return score_tiles_bf16<HD, 4>;
    case 5: return score_tiles_bf16<HD, 5>;
    case 6: return score_tiles_bf16<HD, 6>;
    case 7: return score_tiles_bf16<HD, 7>;
    case 8: return score_tiles_bf16<HD, 8>;
    case 9: return score_tiles_bf16<HD, 9>;
    case 10: return score_tiles_bf16<HD, 10>;
    case 11: return score_tiles_bf16<HD, 11>;
    default: return score_tiles_bf16<HD, kScoreRows>;
  }
}
#endif

template <int HD>
void accumulate_rows(const float* p, int64_t stride, const float* v, const int64_t* c0, const int64_t* c1,
                     int rows, float* o) {
  int r = 0;
  constexpr int N = HD == 64 ? kValueRows64 : kValueRows128;
  for (; r + N <= rows; r += N) {
    // The rows' widest column range; columns outside a row's own range hold probability 0.
    const int64_t lo = *std::min_element(c0 + r, c0 + r + N), hi = *std::max_element(c1 + r, c1 + r + N);
    accumulate_values<HD, N>(p + r * stride, stride, v, lo, hi, o + r * HD);
  }
  for (; r < rows; ++r) accumulate_values<HD, 1>(p + r * stride, stride, v, c0[r], c1[r], o + r * HD);
}

// A buffer of at least `size` T, kept by the calling thread from one call to the next (one per T): the keys and
// values of a context of 1,024 positions take 1.6 MB as floats, which a fresh (zeroed) allocation paged in again
// on every call, every layer. 2 Zen 1 cores, calls interleaved, two runs: 32 new positions after 1,024 cached
// 0.93-0.95x the time, one after 1,055 0.71-0.85x, a 286-token prompt 0.96-0.98x. It holds what the
// longest context needed (the AVX2 path serves up to 2,048 positions: 3 MB for SmolLM2).
template <typename T>
inline T* prefill_scratch(size_t size) {
  thread_local std::vector<T> scratch;
  if (scratch.size() < size) scratch.resize(size);
  return scratch.data();
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
  // On AVX-512 the scores come out in base-2 units (the scale times log2(e)), for exp2_softmax_ps.
#if defined(__AVX512F__)
  const float fscale = static_cast<float>(scale * M_LOG2E);
#else
  const float fscale = static_cast<float>(scale);
#endif

  // bf16 queries over a bf16 cache score on VDPBF16PS where the CPU has it (score_tiles_bf16).
#if defined(ZENSERVE_PREFILL_BF16_SCORES)
  // (float8 rows widen to bf16 exactly: the same scores as over the widened cache.)
  constexpr bool kBf16Scores = std::is_same_v<scalar_t, c10::BFloat16> &&
                               (std::is_same_v<cache_t, c10::BFloat16> || std::is_same_v<cache_t, c10::Float8_e4m3fn>);
#else
  constexpr bool kBf16Scores = false;
#endif
  // Phase 1: each head's visible keys as transposed tiles (float32, or bf16 pairs for kBf16Scores), its
  // values as float32 rows, in a scratch buffer kept by the calling thread (keys, then values).
  const size_t kt_size = static_cast<size_t>(KVH * n_tiles * HD * KT) / (kBf16Scores ? 2 : 1);  // in floats
  float* kt = prefill_scratch<float>(kt_size + static_cast<size_t>(KVH * n_keys * HD));
  uint32_t* kt_pairs = reinterpret_cast<uint32_t*>(kt);  // kBf16Scores: [KVH][n_tiles][HD / 2][16]
  float* vf = kt + kt_size;
  at::parallel_for(0, KVH * n_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float row[HD];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / n_tiles, t = task % n_tiles;
      float* tile = kt + (h * n_tiles + t) * HD * KT;
      uint32_t* pair_tile = kt_pairs + (h * n_tiles + t) * (HD / 2) * KT;
      int64_t k = 0;
      for (; k < KT && t * KT + k < n_keys; ++k) {
        const int64_t j = t * KT + k, slot = slot_ptr[first_key + j];
        const cache_t* key = k_ptr + slot * slot_stride + h * head_stride;
        if constexpr (kBf16Scores) {
          uint32_t pairs[HD / 2];
          if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
            std::memcpy(pairs, key, sizeof(pairs));
          } else {
            c10::BFloat16 widened[HD];
            row_to_float(key, HD, row);
            for (int d = 0; d < HD; ++d) widened[d] = c10::BFloat16(row[d]);
            std::memcpy(pairs, widened, sizeof(pairs));
          }
          for (int p = 0; p < HD / 2; ++p) pair_tile[p * KT + k] = pairs[p];
        } else {
          row_to_float(key, HD, row);
          for (int d = 0; d < HD; ++d) tile[d * KT + k] = row[d];
        }
        row_to_float(v_ptr + slot * slot_stride + h * head_stride, HD, vf + (h * n_keys + j) * HD);
      }
      for (; k < KT; ++k) {  // the last tile's keys past the context: scored, then masked; kept finite
        if constexpr (kBf16Scores) {
          for (int p = 0; p < HD / 2; ++p) pair_tile[p * KT + k] = 0;
        } else {
          for (int d = 0; d < HD; ++d) tile[d * KT + k] = 0.f;
        }
      }
    }
  });

  // Phase 2: tasks of (KV head, a few query positions); rows are (position, query head of the group).
  const int64_t positions_per_task = std::max<int64_t>(1, kMaxRows / G);
  const int64_t n_qtiles = (T + positions_per_task - 1) / positions_per_task;
  const ScoreFn<HD> score_block = score_fn<HD>(kScoreRows);
  at::parallel_for(0, KVH * n_qtiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, s, o;
    std::vector<uint32_t> qb;  // kBf16Scores: the rows' bf16 pairs
    std::vector<int64_t> c0, c1;
    for (int64_t task = begin; task < end; ++task) {
      // Causal work grows with the position: alternate cheap and costly tiles, so that the
      // contiguous ranges parallel_for hands each thread weigh about the same.
      const int64_t h = task % KVH, j = task / KVH;
      const int64_t qt = (j % 2 == 0) ? j / 2 : n_qtiles - 1 - j / 2;
      const int64_t p0 = qt * positions_per_task, p1 = std::min(T, p0 + positions_per_task);
      const int rows = static_cast<int>((p1 - p0) * G);
      if constexpr (kBf16Scores) qb.resize(static_cast<size_t>(rows) * HD / 2);
      else qf.assign(static_cast<size_t>(rows) * HD, 0.f);
      c0.resize(rows);
      c1.resize(rows);
      for (int64_t i = p0; i < p1; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int r = static_cast<int>((i - p0) * G + g);
          const scalar_t* query = q_ptr + i * q_pos_stride + (h * G + g) * q_head_stride;
          if constexpr (kBf16Scores) {
            std::memcpy(qb.data() + r * HD / 2, query, HD * sizeof(scalar_t));
          } else {
            row_to_float(query, HD, qf.data() + r * HD);
            for (int d = 0; d < HD; ++d) qf[r * HD + d] *= fscale;
          }
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
      for (int r = 0; r < rows; r += kScoreRows) {
        const int block = std::min(kScoreRows, rows - r);
#if defined(ZENSERVE_PREFILL_BF16_SCORES)
        if constexpr (kBf16Scores) {
          bf16_score_fn<HD>(block)(qb.data() + r * HD / 2, kt_pairs + h * n_tiles * (HD / 2) * KT, t0, t1, fscale,
                                   s.data() + r * stride, stride);
          continue;
        }
#endif
        (block == kScoreRows ? score_block : score_fn<HD>(block))(qf.data() + r * HD, kt + h * n_tiles * HD * KT,
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
#if defined(__AVX512F__)
        const __m512 shift = _mm512_set1_ps(mx);
        __m512 sums = _mm512_setzero_ps();
        for (int64_t c = lo; c < hi; c += 16) {
          const __mmask16 m = hi - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (hi - c)) - 1u);
          const __m512 e = _mm512_maskz_mov_ps(m, zenserve::exp2_softmax_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + c), shift)));
          _mm512_mask_storeu_ps(sr + c, m, e);
          sums = _mm512_add_ps(sums, e);
        }
        sum = _mm512_reduce_add_ps(sums);
#else
#pragma omp simd reduction(+ : sum)
        for (int64_t c = lo; c < hi; ++c) {
          sr[c] = std::exp(sr[c] - mx);
          sum += sr[c];
        }
#endif
        std::fill(sr, sr + lo, 0.f);
        std::fill(sr + hi, sr + stride, 0.f);
        inv_sum[r] = 1.f / sum;
        c0[r] = lo;
        c1[r] = hi;
      }
      o.resize(static_cast<size_t>(rows) * HD);
      accumulate_rows<HD>(s.data(), stride, vf + (h * n_keys + t0 * KT) * HD, c0.data(), c1.data(), rows,
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


#if defined(ZENSERVE_AMX)
// On AMX (Intel Xeons since Sapphire Rapids), for a bf16 query and cache: flash attention on the tile
// unit, which never holds more than a block of 32 keys' scores. Each KV head's visible keys and values
// are first packed as B tiles (pairs of adjacent values along the dot product's axis side by side), so
// that a task, 16 positions of one query head, runs per block of 32 keys: S = Q K^T on 2 x HD/32
// TDPBF16PS, an online softmax on the stored scores in float32 (the probabilities rounded to bf16
// once, as a bf16 SDPA does), and O += P V on HD/16 more. Compared with the float32 kernel above,
// products are of bf16 values (q and the cache are bf16 already) and sums float32.
constexpr int64_t kAmxQueries = 16;  // positions a task: the tiles' rows
constexpr int64_t kAmxKeys = 32;     // keys a block: two S tiles, the P tile's 32 values a row
constexpr int64_t kTileWords = 16 * 32;  // bf16 values in a 16 x 64-byte tile

// Tiles: 0 .. HD/32 - 1 the task's queries (A), 4 and 5 scores or output sums (C), 6 keys or values (B),
// 7 probabilities (A); with 64-wide heads 2 and 3 are B tiles too, so that a load need not wait for the
// product before it to finish with tile 6.
template <int HD>
void configure_attention_tiles(int64_t queries) {
  zenserve::TileConfig config;
  for (int t = 0; t < HD / 32; ++t) config.set(t, queries, 64);
  if constexpr (HD == 64) {  // tiles 2 and 3 free: a second and third B tile
    config.set(2, 16, 64);
    config.set(3, 16, 64);
  }
  config.set(4, queries, 64);
  config.set(5, queries, 64);
  config.set(6, 16, 64);
  config.set(7, queries, 64);
  _tile_loadconfig(&config);
}

// S[:, 0:16] and S[:, 16:32] of a key block into tiles 4 and 5, over the head's 32-value chunks.
template <int HD>
inline void score_block(const uint16_t* keys0, const uint16_t* keys1) {
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (HD == 64) {
    _tile_loadd(6, keys0, 64);
    _tile_dpbf16ps(4, 0, 6);
    _tile_loadd(2, keys1, 64);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(3, keys0 + kTileWords, 64);
    _tile_dpbf16ps(4, 1, 3);
    _tile_loadd(6, keys1 + kTileWords, 64);
    _tile_dpbf16ps(5, 1, 6);
    return;
  }
  _tile_loadd(6, keys0, 64);
  _tile_dpbf16ps(4, 0, 6);
  _tile_loadd(6, keys1, 64);
  _tile_dpbf16ps(5, 0, 6);
  _tile_loadd(6, keys0 + kTileWords, 64);
  _tile_dpbf16ps(4, 1, 6);
  _tile_loadd(6, keys1 + kTileWords, 64);
  _tile_dpbf16ps(5, 1, 6);
  if constexpr (HD == 128) {
    _tile_loadd(6, keys0 + 2 * kTileWords, 64);
    _tile_dpbf16ps(4, 2, 6);
    _tile_loadd(6, keys1 + 2 * kTileWords, 64);
    _tile_dpbf16ps(5, 2, 6);
    _tile_loadd(6, keys0 + 3 * kTileWords, 64);
    _tile_dpbf16ps(4, 3, 6);
    _tile_loadd(6, keys1 + 3 * kTileWords, 64);
    _tile_dpbf16ps(5, 3, 6);
  }
}

// r[i][j] <- r[j][i] for 16 rows of 16 32-bit values.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}
// 32 and 16 values of a cache row as bf16 bits: bf16 rows (C = uint16_t) as stored, float8 e4m3fn rows
// (C = uint8_t) widened exactly, so that both caches give the tiles the same values.
template <typename C>
inline __m512i load32_bf16(const C* p) {
  if constexpr (sizeof(C) == 1) return zenserve::fp8x32_to_bf16(p);
  else return _mm512_loadu_si512(p);
}

template <typename C>
inline __m256i load16_bf16(const C* p) {
  if constexpr (sizeof(C) == 1) return zenserve::fp8x16_to_bf16(p);
  else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <int HD, typename C>
void prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, int64_t start, int64_t window, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), KVH = k_cache.size(1), G = H / KVH;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t n_keys = start + T - first_key, n_blocks = (n_keys + kAmxKeys - 1) / kAmxKeys;
  const auto* k_ptr = reinterpret_cast<const C*>(k_cache.data_ptr());
  const auto* v_ptr = reinterpret_cast<const C*>(v_cache.data_ptr());
  const int64_t slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t q_pos_stride = q.stride(0), q_head_stride = q.stride(1);
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr());

  // Phase 1: per KV head and block of 32 keys, the keys as 2 x HD/32 B tiles (tile t, chunk c: row p holds
  // each of the tile's 16 keys' values 32c + 2p and 32c + 2p + 1) and the values as HD/16 B tiles (chunk e:
  // row p holds keys 2p and 2p + 1's values 16e .. 16e + 15, interleaved). Keys past the context are 0.
  constexpr int64_t kBlockWords = 2 * HD / 32 * kTileWords;  // = HD / 16 * kTileWords: keys and values alike
  // Every word is written below, in a buffer the calling thread keeps between calls (before, a fresh zeroed
  // vector paged in 0.8 MB at 1,024 positions every call, every layer).
  const size_t packed_words = static_cast<size_t>(KVH * n_blocks * kBlockWords);
  uint16_t* const packed_k = prefill_scratch<uint16_t>(2 * packed_words);
  uint16_t* const packed_v = packed_k + packed_words;
  // Keys: 16 rows' 64-byte chunks transposed as 32-bit pairs; values: two rows' 16-value chunks
  // interleaved. (Element by element this took most of a short chunk's time over a long cached context:
  // 32 new positions after 1,024 cached, 290 us a layer.)
  alignas(64) uint16_t interleave_index[32];
  for (int i = 0; i < 32; ++i) interleave_index[i] = static_cast<uint16_t>(i % 2 == 0 ? i / 2 : 16 + i / 2);
  const __m512i interleave = _mm512_load_si512(interleave_index);
  at::parallel_for(0, KVH * n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / n_blocks, b = task % n_blocks;
      uint16_t* kb = packed_k + task * kBlockWords;
      uint16_t* vb = packed_v + task * kBlockWords;
      const C* krows[kAmxKeys];
      const C* vrows[kAmxKeys];
      for (int64_t j = 0; j < kAmxKeys; ++j) {
        const bool present = b * kAmxKeys + j < n_keys;
        const int64_t offset = present ? slot_ptr[first_key + b * kAmxKeys + j] * slot_stride + h * head_stride : 0;
        krows[j] = present ? k_ptr + offset : nullptr;
        vrows[j] = present ? v_ptr + offset : nullptr;
      }
      for (int64_t tile = 0; tile < 2; ++tile)
        for (int64_t c = 0; c < HD / 32; ++c) {
          __m512i r[16];
          for (int key = 0; key < 16; ++key) {
            const C* row = krows[tile * 16 + key];
            r[key] = row != nullptr ? load32_bf16(row + c * 32) : _mm512_setzero_si512();
          }
          transpose16x16(r);
          for (int pair = 0; pair < 16; ++pair)
            _mm512_storeu_si512(kb + ((tile * (HD / 32) + c) * 16 + pair) * 32, r[pair]);
        }
      for (int64_t pair = 0; pair < 16; ++pair) {
        const C* even = vrows[2 * pair];
        const C* odd = vrows[2 * pair + 1];
        for (int64_t e = 0; e < HD / 16; ++e) {
          const __m256i lo = even != nullptr ? load16_bf16(even + e * 16) : _mm256_setzero_si256();
          const __m256i hi = odd != nullptr ? load16_bf16(odd + e * 16) : _mm256_setzero_si256();
          const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
          _mm512_storeu_si512(vb + (e * 16 + pair) * 32, _mm512_permutexvar_epi16(interleave, both));
        }
      }
    }
  });

  // Phase 2: tasks of (query head, 16 positions), the costly late positions alternated with cheap early ones.
  const int64_t n_qblocks = (T + kAmxQueries - 1) / kAmxQueries;
  at::parallel_for(0, H * n_qblocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float s[kAmxQueries * kAmxKeys];
    alignas(64) uint16_t p[kAmxQueries * kAmxKeys];
    alignas(64) float o_part[kAmxQueries * HD];
    alignas(64) float o[kAmxQueries * HD];
    alignas(64) float alpha[kAmxQueries];
    // Scores in base-2 units (scaled by log2(e) too), for exp2_softmax_ps.
    const __m512 masked = _mm512_set1_ps(kMasked), vscale = _mm512_set1_ps(static_cast<float>(scale * M_LOG2E));
    int64_t configured = 0;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task % H, j = task / H;
      const int64_t qb = (j % 2 == 0) ? j / 2 : n_qblocks - 1 - j / 2;
      const int64_t p0 = qb * kAmxQueries, rows = std::min(kAmxQueries, T - p0);
      const int64_t h = head / G;
      if (rows != configured) {
        configure_attention_tiles<HD>(rows);
        configured = rows;
      }
      const uint16_t* q_rows = q_ptr + p0 * q_pos_stride + head * q_head_stride;
      const int64_t q_bytes = q_pos_stride * static_cast<int64_t>(sizeof(uint16_t));
      _tile_loadd(0, q_rows, q_bytes);
      _tile_loadd(1, q_rows + 32, q_bytes);
      if constexpr (HD == 128) {
        _tile_loadd(2, q_rows + 64, q_bytes);
        _tile_loadd(3, q_rows + 96, q_bytes);
      }
      __m512 row_max = masked, row_sum = _mm512_setzero_ps();  // lane r: row r
      std::fill(o, o + rows * HD, 0.f);
      // Keys (counted from first_key) the task's rows may see: [lowest row's window start, last row's position].
      const int64_t last = start + p0 + rows - 1 - first_key;
      const int64_t lowest = (window > 0 ? std::max<int64_t>(0, start + p0 - window + 1) : 0) - first_key;
      const int64_t lowest_last = (window > 0 ? std::max<int64_t>(0, start + p0 + rows - 1 - window + 1) : 0) - first_key;
      const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      for (int64_t b = lowest / kAmxKeys; b * kAmxKeys <= last; ++b) {
        const uint16_t* kb = packed_k + (h * n_blocks + b) * kBlockWords;
        score_block<HD>(kb, kb + HD / 32 * kTileWords);
        _tile_stored(4, s, kAmxKeys * sizeof(float));
        _tile_stored(5, s + 16, kAmxKeys * sizeof(float));
        // Masks only where the block crosses a row's own position or window start.
        const int64_t key_lo = b * kAmxKeys, key_hi = key_lo + kAmxKeys - 1;
        const bool edge = key_hi > start + p0 - first_key || key_lo < lowest_last;
        __m512 block_max[kAmxQueries];
        __mmask16 seen[kAmxQueries][2];
        for (int64_t r = 0; r < kAmxQueries; ++r) {
          if (r >= rows) {
            block_max[r] = _mm512_set1_ps(kMasked);
            continue;
          }
          __m512 s0 = _mm512_mul_ps(_mm512_load_ps(s + r * kAmxKeys), vscale);
          __m512 s1 = _mm512_mul_ps(_mm512_load_ps(s + r * kAmxKeys + 16), vscale);
          if (edge) {
            const int64_t pos = start + p0 + r - first_key;  // the row's own key, counted from first_key
            const int64_t lo = window > 0 ? std::max<int64_t>(0, start + p0 + r - window + 1) - first_key : 0;
            const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(key_lo)));
            const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
            const __m512i lo_v = _mm512_set1_epi32(static_cast<int>(lo)), hi_v = _mm512_set1_epi32(static_cast<int>(pos));
            seen[r][0] = _mm512_cmpge_epi32_mask(key0, lo_v) & _mm512_cmple_epi32_mask(key0, hi_v);
            seen[r][1] = _mm512_cmpge_epi32_mask(key1, lo_v) & _mm512_cmple_epi32_mask(key1, hi_v);
            s0 = _mm512_mask_mov_ps(masked, seen[r][0], s0);
            s1 = _mm512_mask_mov_ps(masked, seen[r][1], s1);
          }
          _mm512_store_ps(s + r * kAmxKeys, s0);
          _mm512_store_ps(s + r * kAmxKeys + 16, s1);
          block_max[r] = _mm512_max_ps(s0, s1);
        }
        // Lane r: row r. A row with nothing summed yet (max still kMasked) has no sums to rescale.
        const __m512 new_max = _mm512_max_ps(row_max, zenserve::max16(block_max));
        const __mmask16 summed = _mm512_cmp_ps_mask(row_max, masked, _CMP_NEQ_OQ);
        const __m512 alpha_v = _mm512_maskz_mov_ps(summed, zenserve::exp2_softmax_ps(_mm512_sub_ps(row_max, new_max)));
        row_max = new_max;
        _mm512_store_ps(alpha, alpha_v);
        alignas(64) float new_max_row[kAmxQueries];
        _mm512_store_ps(new_max_row, new_max);
        __m512 block_sum[kAmxQueries];
        for (int64_t r = 0; r < kAmxQueries; ++r) {
          if (r >= rows) {
            block_sum[r] = _mm512_setzero_ps();
            continue;
          }
          const __m512 m_v = _mm512_set1_ps(new_max_row[r]);
          __m512 e0 = zenserve::exp2_softmax_ps(_mm512_sub_ps(_mm512_load_ps(s + r * kAmxKeys), m_v));
          __m512 e1 = zenserve::exp2_softmax_ps(_mm512_sub_ps(_mm512_load_ps(s + r * kAmxKeys + 16), m_v));
          if (edge) {
            e0 = _mm512_maskz_mov_ps(seen[r][0], e0);
            e1 = _mm512_maskz_mov_ps(seen[r][1], e1);
          }
          // The probabilities as the P tile takes them, and their sum as rounded there.
          const __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0);
          _mm512_store_si512(p + r * kAmxKeys, (__m512i)pb);
          const __m512i bits = (__m512i)pb;
          const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
          const __m512 r1 = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
          block_sum[r] = _mm512_add_ps(r0, r1);
        }
        row_sum = _mm512_fmadd_ps(row_sum, alpha_v, zenserve::sum16(block_sum));
        _tile_loadd(7, p, kAmxKeys * sizeof(uint16_t));
        const uint16_t* vb = packed_v + (h * n_blocks + b) * kBlockWords;
        for (int64_t e = 0; e < HD / 16; e += 2) {
          _tile_zero(4);
          _tile_zero(5);
          _tile_loadd(6, vb + e * kTileWords, 64);
          _tile_dpbf16ps(4, 7, 6);
          if constexpr (HD == 64) {
            _tile_loadd(3, vb + (e + 1) * kTileWords, 64);
            _tile_dpbf16ps(5, 7, 3);
          } else {
            _tile_loadd(6, vb + (e + 1) * kTileWords, 64);
            _tile_dpbf16ps(5, 7, 6);
          }
          _tile_stored(4, o_part + e * 16, HD * sizeof(float));
          _tile_stored(5, o_part + (e + 1) * 16, HD * sizeof(float));
        }
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
          for (int64_t e = 0; e < HD / 16; ++e) {
            float* dst = o + r * HD + e * 16;
            _mm512_store_ps(dst, _mm512_fmadd_ps(_mm512_load_ps(dst), a, _mm512_load_ps(o_part + r * HD + e * 16)));
          }
        }
      }
      alignas(64) float row_sum_row[kAmxQueries];
      _mm512_store_ps(row_sum_row, row_sum);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / row_sum_row[r]);
        uint16_t* dst = out_ptr + ((p0 + r) * H + head) * HD;
        for (int64_t e = 0; e < HD / 16; ++e)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e * 16),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * HD + e * 16), inv)));
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace
#endif

// q [T, H, hd] (last dim contiguous): a chunk's queries at positions start .. start + T - 1;
// k_cache, v_cache [num_slots, KVH, hd] in q's dtype (or float16 under a float32 q, or float8 e4m3fn), or int8 rows
// [num_slots, KVH, hd + 4];
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
  const bool float16_cache = zenserve::is_float16_rows(k_cache, q.scalar_type(), head_dim);
  const bool fp8_cache = zenserve::is_fp8_rows(k_cache, head_dim);
  TORCH_CHECK(int8_cache || float16_cache || fp8_cache ||
                  (k_cache.scalar_type() == q.scalar_type() && k_cache.size(2) == head_dim),
              "the caches must hold q's dtype and head size, float16 rows under a float32 q, float8 e4m3fn rows, or int8 rows of "
              "head size + 4 bytes");
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
#if defined(ZENSERVE_AMX)
  if (q.scalar_type() == at::kBFloat16 && !int8_cache && !float16_cache && zenserve::amx_permitted()) {
    if (fp8_cache) {
      if (head_dim == 64) prefill_attention_amx<64, uint8_t>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention_amx<128, uint8_t>(q, k_cache, v_cache, slots, start, window, scale, out);
    } else {
      if (head_dim == 64) prefill_attention_amx<64, uint16_t>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention_amx<128, uint16_t>(q, k_cache, v_cache, slots, start, window, scale, out);
    }
    return out;
  }
#endif
#if defined(ZENSERVE_PREFILL_KERNEL)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    if (int8_cache) {
      if (head_dim == 64) prefill_attention<64, scalar_t, int8_t>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention<128, scalar_t, int8_t>(q, k_cache, v_cache, slots, start, window, scale, out);
    } else if (fp8_cache) {
      if (head_dim == 64) prefill_attention<64, scalar_t, c10::Float8_e4m3fn>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention<128, scalar_t, c10::Float8_e4m3fn>(q, k_cache, v_cache, slots, start, window, scale, out);
    } else if (float16_cache) {
      if (head_dim == 64) prefill_attention<64, scalar_t, c10::Half>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention<128, scalar_t, c10::Half>(q, k_cache, v_cache, slots, start, window, scale, out);
    } else {
      if (head_dim == 64) prefill_attention<64, scalar_t, scalar_t>(q, k_cache, v_cache, slots, start, window, scale, out);
      else prefill_attention<128, scalar_t, scalar_t>(q, k_cache, v_cache, slots, start, window, scale, out);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "paged_prefill_attention needs AVX-512, or AVX2 with FMA");
#endif
}

// Whether this build has the kernel (AVX-512, or AVX2 with FMA).
bool paged_prefill_attention_supported() {
#if defined(ZENSERVE_PREFILL_KERNEL)
  return true;
#else
  return false;
#endif
}

// Whether bf16 queries over a bf16 cache run on AMX's tiles here (flash attention, any context length).
bool paged_prefill_attention_uses_amx() {
#if defined(ZENSERVE_AMX)
  return zenserve::amx_permitted();
#else
  return false;
#endif
}

// Whether a bf16 query over a bf16 or float8 cache scores on VDPBF16PS where AMX does not serve it
// (score_tiles_bf16).
bool paged_prefill_attention_scores_bf16() {
#if defined(ZENSERVE_PREFILL_BF16_SCORES)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, int start, int window, "
        "float scale) -> Tensor");
  m.def("paged_prefill_attention_supported() -> bool");
  m.def("paged_prefill_attention_uses_amx() -> bool");
  m.def("paged_prefill_attention_scores_bf16() -> bool");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }

TORCH_LIBRARY_IMPL(zenserve, CompositeExplicitAutograd, m) {
  m.impl("paged_prefill_attention_supported", &paged_prefill_attention_supported);
  m.impl("paged_prefill_attention_uses_amx", &paged_prefill_attention_uses_amx);
  m.impl("paged_prefill_attention_scores_bf16", &paged_prefill_attention_scores_bf16);
}

// Single-query (decode) attention read in place from a paged KV cache.
//
// Each decode's context is addressed through its per-position cache slots, so no copy of the
// context is gathered; scores and the weighted sum accumulate in float32. One task per
// (sequence, KV head): the task converts each key and value row to float once and serves every
// query head of that KV head's group with it (GQA). bfloat16 with common head and group sizes takes
// an AVX-512 path with everything in registers; other shapes and dtypes a generic loop.
// The slots must lie inside the caches: the engine builds them from the blocks it owns.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float32: a shift the compiler vectorizes (c10's conversion is not).
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename scalar_t>
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
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
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
        load_row(src, dst, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] *= fscale;
      }
      scores.resize(group * n);
      // Scores, one key row at a time for every query head of the group.
      for (int64_t t = 0; t < n; ++t) {
        load_row(k_ptr + seq_slots[t] * kv_slot_stride + h * kv_head_stride, row.data(), head_dim);
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
        load_row(v_ptr + seq_slots[t] * kv_slot_stride + h * kv_head_stride, row.data(), head_dim);
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


#if defined(__AVX512F__)
// bfloat16 with the head size and group size known at compile time: the query, the key row and the
// output accumulators live in zmm registers. (The generic loop above spills them, and its FMA chains
// run serially: 5x slower at 16 decodes on one thread, 1,164 vs 223 us.)
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <int HD, int G>
void bf16_task(const uint16_t* q, int64_t q_head_stride, const uint16_t* k, const uint16_t* v,
               int64_t kv_slot_stride, const int64_t* seq_slots, int64_t n, float scale, c10::BFloat16* out,
               std::vector<float>& scores) {
  constexpr int C = HD / 16;  // 16-float chunks per head
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      qv[g][c] = _mm512_mul_ps(load_bf16x16(q + g * q_head_stride + c * 16), _mm512_set1_ps(scale));
  scores.resize(static_cast<size_t>(G) * n);
  float* sc = scores.data();
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* kr = k + seq_slots[t] * kv_slot_stride;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load_bf16x16(kr + c * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      sc[g * n + t] = _mm512_reduce_add_ps(acc);
    }
  }
  float inv_sum[G];
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
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* vr = v + seq_slots[t] * kv_slot_stride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_bf16x16(vr + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g * n + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  alignas(64) float row[HD];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) _mm512_store_ps(row + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
    for (int d = 0; d < HD; ++d) out[g * HD + d] = c10::BFloat16(row[d]);  // round to nearest even
  }
}

using Bf16Task = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, const int64_t*,
                          int64_t, float, c10::BFloat16*, std::vector<float>&);

template <int HD>
Bf16Task bf16_task_for_group(int64_t group) {
  switch (group) {
    case 1: return bf16_task<HD, 1>;
    case 2: return bf16_task<HD, 2>;
    case 3: return bf16_task<HD, 3>;
    case 4: return bf16_task<HD, 4>;
    case 5: return bf16_task<HD, 5>;
    case 6: return bf16_task<HD, 6>;
    case 7: return bf16_task<HD, 7>;
    case 8: return bf16_task<HD, 8>;
    default: return nullptr;
  }
}

// The specialized task for these shapes, or nullptr (the generic loop serves them).
Bf16Task bf16_task_for(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 64: return bf16_task_for_group<64>(group);
    case 128: return bf16_task_for_group<128>(group);
    default: return nullptr;
  }
}

bool bf16_fast_path(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots, const at::Tensor& context_lens, int64_t window, double scale,
                    at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const Bf16Task task_fn = bf16_task_for(head_dim, group);
  if (task_fn == nullptr) return false;
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int64_t* slots_ptr = slots.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  auto* out_ptr = out.data_ptr<c10::BFloat16>();
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
  return true;
}
#endif

}  // namespace

// q [D, H, hd] (last dim contiguous); k_cache, v_cache [num_slots, KVH, hd] contiguous, q's dtype;
// slots [D, >= max context] int64 (position -> cache slot); context_lens [D] int64 (>= 1; the
// query is the last position); window > 0 limits each query to its last `window` positions.
// Returns [D, H, hd] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slots, const at::Tensor& context_lens, int64_t window,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "head sizes differ");
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
  if (q.scalar_type() == at::kBFloat16 && bf16_fast_path(q, k_cache, v_cache, slots, context_lens, window, scale, out)) {
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, k_cache, v_cache, slots, context_lens, window, scale, out);
  });
  return out;
}

namespace {

// Rotary embedding (rotate-half layout) of one head in float32, rounded once into dst.
template <typename scalar_t>
inline void rope_row(const scalar_t* x, const float* cos, const float* sin, int64_t head_dim, scalar_t* dst) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float lo = static_cast<float>(x[d]), hi = static_cast<float>(x[d + half]);
    dst[d] = static_cast<scalar_t>(lo * cos[d] - hi * sin[d]);
    dst[d + half] = static_cast<scalar_t>(hi * cos[d + half] + lo * sin[d + half]);
  }
}

template <typename scalar_t>
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
  scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int64_t slot_stride = k_cache.stride(0);
  // Tiny (a few rows a sequence): parallel only for large batches.
  at::parallel_for(0, num_seqs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const scalar_t* row = qkv_ptr + s * row_stride;
      const float* c = cos_ptr + pos_ptr[s] * head_dim;
      const float* sn = sin_ptr + pos_ptr[s] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rope_row(row + h * head_dim, c, sn, head_dim, q_ptr + (s * num_heads + h) * head_dim);
      const int64_t slot = write_ptr[s];
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rope_row(row + (num_heads + h) * head_dim, c, sn, head_dim, k_ptr + slot * slot_stride + h * head_dim);
        const scalar_t* v = row + (num_heads + num_kv_heads + h) * head_dim;
        std::copy(v, v + head_dim, v_ptr + slot * slot_stride + h * head_dim);
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
                  k_cache.sizes() == v_cache.sizes(), "the caches must be contiguous [slots, KVH, hd] and alike");
  const int64_t num_seqs = qkv.size(0), num_kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "the head size must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [D, (H + 2 KVH) * hd] with contiguous rows");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == v_cache.scalar_type(),
              "qkv and the caches must share a dtype");
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
    rope_and_write<scalar_t>(qkv, cos, sin, positions, k_cache, v_cache, write_slots, q);
  });
  return paged_decode_attention(q, k_cache, v_cache, slots, context_lens, window, scale).view({num_seqs, num_heads * head_dim});
}

TORCH_LIBRARY(zenserve, m) {
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

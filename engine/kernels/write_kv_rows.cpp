// A step's keys and values written into the paged cache: row t of k and v goes to slot slots[t]. torch's
// index_copy_ takes about 0.1 us a row (19 us for a 172-token prompt's keys, twice a layer; in-engine a 172-token
// prefill took 40.5 vs 41.2 ms on 2 Xeon cores, BENCHMARKS.md); here a row is one copy of its heads' bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

// Rows of `src` [T, KVH, D] (D contiguous, any row and head strides) into `cache` [slots, KVH, D] contiguous.
void copy_rows(const at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t begin, int64_t end) {
  const int64_t heads = src.size(1), head_bytes = src.size(2) * src.element_size();
  const int64_t row_stride = src.stride(0) * src.element_size(), head_stride = src.stride(1) * src.element_size();
  const int64_t cache_row_bytes = heads * head_bytes;
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(cache.data_ptr());
  const bool heads_adjacent = head_stride == head_bytes;
  for (int64_t t = begin; t < end; ++t) {
    char* dst = to + slots[t] * cache_row_bytes;
    const char* row = from + t * row_stride;
    if (heads_adjacent) {
      std::memcpy(dst, row, cache_row_bytes);
    } else {
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * head_bytes, row + h * head_stride, head_bytes);
    }
  }
}

}  // namespace

// k_cache, v_cache [num_slots, KVH, D] contiguous; k, v [T, KVH, D] of the caches' dtype with D contiguous;
// slots [T] int64 in [0, num_slots).
void write_kv_rows_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slots) {
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 3 && c->is_contiguous() && c->device().is_cpu(), "the caches must be contiguous [slots, KVH, D] CPU tensors");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "the key and value caches must match");
  for (const at::Tensor* s : {&k, &v}) {
    TORCH_CHECK(s->dim() == 3 && s->size(1) == k_cache.size(1) && s->size(2) == k_cache.size(2) && s->stride(2) == 1,
                "k and v must be [T, KVH, D] with D contiguous, KVH and D the cache's");
    TORCH_CHECK(s->scalar_type() == k_cache.scalar_type() && s->device().is_cpu(), "k and v must be CPU tensors of the cache's dtype");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0) &&
                  v.size(0) == k.size(0), "slots must be [T] int64, one per row of k and v");
  const int64_t rows = k.size(0), num_slots = k_cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the cache's ", num_slots);
  // About 64 KB of rows a task: a decode step's few rows stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(k_cache.stride(0) * k_cache.element_size(), 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    copy_rows(k_cache, k, slot, begin, end);
    copy_rows(v_cache, v, slot, begin, end);
  });
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("write_kv_rows_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("write_kv_rows_", &write_kv_rows_); }

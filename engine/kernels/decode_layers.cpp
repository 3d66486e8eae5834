// A decode-only step's decoder layers in one call: the same kernels, in the same order, as
// LlamaForCausalLM's Python loop runs them on a model with packed few-row weights (RMSNorm,
// fused q/k/v projection, decode_attention_block, o projection, residual add and RMSNorm, gate/up
// projection, silu_and_mul, down projection), so its outputs are the loop's bit for bit. At decode
// sizes each kernel takes a few microseconds to tens, and the Python around each call (module
// forwards, argument checks, the op dispatch) about as much: 30 layers x 8 calls a step.
// Two families of projections: a bf16 model's on the tile kernels (one packed tensor each), a float32
// model's on the group kernels (GGUF's Q4_1 and Q8_0 groups, their scales and minima beside them).
#include <torch/extension.h>

#include <tuple>

// The kernels, from this extension's other sources.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor int4_tile_mm(const at::Tensor& x, const at::Tensor& packed);
at::Tensor int8_tile_mm(const at::Tensor& x, const at::Tensor& packed);
at::Tensor int4_group_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& mins);
at::Tensor int4_group_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& mins);
at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor decode_attention_block(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                                  const at::Tensor& write_slots, const at::Tensor& slots,
                                  const at::Tensor& context_lens, int64_t num_heads, int64_t window, double scale);

namespace {

// A layer's tensors: the input and post-attention norms' weights, then three for each projection (q/k/v,
// o, gate/up, down): its packed weight and, for the group kinds, the groups' scales and minima (an empty
// tensor where the kind has none).
constexpr int64_t kTensorsPerProjection = 3;
constexpr int64_t kProjectionsPerLayer = 4;  // their kinds: q/k/v, o, gate/up, down
constexpr int64_t kTensorsPerLayer = 2 + kTensorsPerProjection * kProjectionsPerLayer;
// int4_tile_mm's and int8_tile_mm's packed layouts (bf16 rows), int4_group_mm's and int8_group_mm's
// (float32 rows), int4_group_mm's layout on int4_group_mm_q8 (float32 rows quantized a group at a time),
// and bf16_linear's bf16 pairs (bf16 rows: a bf16 model's steps of more decodes than its 4-bit copies serve).
constexpr int64_t kInt4Tiles = 0, kInt8Tiles = 1, kInt4Groups = 2, kInt8Groups = 3, kInt4GroupsQ8 = 4, kBf16Pairs = 5;

bool runs_float32(int64_t kind) { return kind == kInt4Groups || kind == kInt8Groups || kind == kInt4GroupsQ8; }

// Projection p (0..3) of a layer whose tensors start at t.
at::Tensor project(const at::Tensor& x, const at::Tensor* t, const int64_t* kinds, int64_t p) {
  const at::Tensor* w = t + 2 + kTensorsPerProjection * p;
  switch (kinds[p]) {
    case kInt4Tiles: return int4_tile_mm(x, w[0]);
    case kInt8Tiles: return int8_tile_mm(x, w[0]);
    case kInt4Groups: return int4_group_mm(x, w[0], w[1], w[2]);
    case kInt4GroupsQ8: return int4_group_mm_q8(x, w[0], w[1], w[2]);
    case kBf16Pairs: return bf16_linear(x, w[0], c10::nullopt);
    default: return int8_group_mm(x, w[0], w[1]);
  }
}

}  // namespace

// x [D, hidden], bf16 for the tile kinds, float32 for the group kinds: the embeddings, not yet in the
// residual stream (a new tensor: it becomes the stream and is updated in place). layers: 14 tensors a
// layer (above; the norm weights float32), kinds: 4 a layer, eps: 2 a layer; the rest as
// decode_attention_block takes them, one cache pair a layer.
// Returns (the last MLP's output, the residual stream), not yet added and normalized.
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& x, at::TensorList layers, at::IntArrayRef kinds,
                                                 at::ArrayRef<double> eps, at::TensorList k_caches,
                                                 at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                                                 const at::Tensor& positions, const at::Tensor& write_slots,
                                                 const at::Tensor& slots, const at::Tensor& context_lens,
                                                 int64_t num_heads, int64_t window, double scale) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(v_caches.size()) == num_layers &&
                  static_cast<int64_t>(layers.size()) == kTensorsPerLayer * num_layers &&
                  static_cast<int64_t>(kinds.size()) == kProjectionsPerLayer * num_layers &&
                  static_cast<int64_t>(eps.size()) == 2 * num_layers,
              "decode_layers needs 14 tensors, 4 kinds and 2 eps a layer, and one cache pair a layer");
  for (const int64_t kind : kinds)
    TORCH_CHECK(kind >= kInt4Tiles && kind <= kBf16Pairs, "unknown projection kind ", kind);
  const bool float32 = runs_float32(kinds[0]);
  for (const int64_t kind : kinds)
    TORCH_CHECK(runs_float32(kind) == float32, "the projections must all be tile kinds or all group kinds");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == (float32 ? at::kFloat : at::kBFloat16),
              "x must be [D, hidden], contiguous, bfloat16 for the tile kinds and float32 for the group kinds");
  at::Tensor residual = x;
  at::Tensor h;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* t = layers.data() + l * kTensorsPerLayer;
    const int64_t* kind = kinds.data() + l * kProjectionsPerLayer;
    if (l == 0) {
      h = rms_norm(residual, t[0], eps[0]);
    } else {
      add_rms_norm_(h, residual, t[0], eps[2 * l]);  // h: the previous layer's MLP output
    }
    const at::Tensor qkv = project(h, t, kind, 0);
    const at::Tensor attended = decode_attention_block(qkv, cos, sin, positions, k_caches[l], v_caches[l], write_slots,
                                                       slots, context_lens, num_heads, window, scale);
    h = project(attended, t, kind, 1);
    add_rms_norm_(h, residual, t[1], eps[2 * l + 1]);
    h = project(silu_and_mul(project(h, t, kind, 2)), t, kind, 3);
  }
  return {h, residual};
}

TORCH_LIBRARY_FRAGMENT(zenserve, m) {
  m.def("decode_layers(Tensor x, Tensor[] layers, int[] kinds, float[] eps, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor positions, Tensor write_slots, Tensor slots, "
        "Tensor context_lens, int num_heads, int window, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(zenserve, CPU, m) { m.impl("decode_layers", &decode_layers); }

"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Parameters carry Hugging Face names so every loader maps onto them; `fuse_projections()` then
packs q/k/v and gate/up into single matmuls for speed.

NOTE: on the step's path, submodules are called through `.forward()`: nn.Module.__call__'s hook
handling costs a few µs a call, ~300 calls a step, 4-5% of a batch-1 decode step (in-engine A/B,
BENCHMARKS.md). Hooks registered on these modules are therefore not run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.config import ModelArchConfig
from engine.heap import release_free_heap
from engine.kernels import int8_tile_mm_uses_amx
from engine.models.decode_layers import DecodeLayersPlan
from engine.models.packed_linear import (
    Int8GroupsDense,
    Int8GroupsEmbedding,
    Int8TilesDense,
    Int8TilesEmbedding,
    PackableWeight,
    SmallBatchLinear,
    dequantize_int4_groups_per_call,
    fuse_packable,
    project,
)
from engine.models.onednn_linear import dequantize_int4_tiles_per_call
from engine.models.rope import apply_rope, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel (it accumulates in float32 like the reference); seven ops in eager Python
        # cost more than the arithmetic at decode sizes. bf16 results may differ from HF's
        # cast-then-scale order by one ulp.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a sublayer's output joins the residual stream, which the next
        sublayer reads normalized. Workers with a fused kernel override it (they may reuse x and residual)."""
        residual = x + residual
        return self.forward(residual), residual


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        hidden, bias = arch.hidden_size, arch.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.scale = self.head_dim**-0.5
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.qkv_proj = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D] in x's dtype; float32 [T, D] rows where meta.rope_kernel rotates in place
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_slots, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        k_cache, v_cache = kv_cache
        if meta.decode_block is not None:
            # One kernel call for the rest of the block: ~40 small ops a layer at batch 1 (LlamaForCausalLM
            # passes the float32 rotary tables as cos and sin here; supports_decode_block checked the layers).
            out = meta.decode_block(
                project(self.qkv_proj, x, meta.packed_projections), cos, sin, meta.decode_positions, k_cache, v_cache, meta.slot_mapping,
                meta.decode_slots, meta.decode_context_lens, self.num_heads, meta.sliding_window, self.scale,
            )
            return project(self.o_proj, out, meta.packed_projections)
        packed = meta.packed_projections
        if self.qkv_proj is not None and not self.qk_norm:
            # q and k sit side by side in the fused output: rotate them as one [T, H + KVH, D] tensor.
            qkv = project(self.qkv_proj, x, packed)
            qk = apply_rope(qkv[:, : q_size + kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin,
                            meta.rope_kernel)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, q_size + kv_size :].view(T, self.num_kv_heads, self.head_dim)
        else:
            if self.qkv_proj is not None:
                q, k, v = project(self.qkv_proj, x, packed).split([q_size, kv_size, kv_size], dim=-1)
            else:
                q, k, v = project(self.q_proj, x, packed), project(self.k_proj, x, packed), project(self.v_proj, x, packed)
            q = q.reshape(T, self.num_heads, self.head_dim)
            k = k.reshape(T, self.num_kv_heads, self.head_dim)
            v = v.reshape(T, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin, meta.rope_kernel), apply_rope(k, cos, sin, meta.rope_kernel)
        tokens = meta.num_tokens  # T less the rows padded to a bucket (LlamaForCausalLM.pad_tokens)
        if tokens < T:
            q, k, v = q[:tokens], k[:tokens], v[:tokens]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kv_write_kernel)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale).reshape(tokens, q_size)
        if tokens < T:
            out = F.pad(out, (0, 0, 0, T - tokens))  # zero rows, for o_proj's bucketed row count
        return project(self.o_proj, out, packed)


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, packed: bool = True) -> torch.Tensor:
        """`packed`: AttentionMetadata.packed_projections."""
        if self.gate_up_proj is not None:
            return project(self.down_proj, self.silu_and_mul(project(self.gate_up_proj, x, packed)), packed)
        return project(self.down_proj, F.silu(project(self.gate_proj, x, packed)) * project(self.up_proj, x, packed), packed)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] -> silu(gate) * up. Workers with a one-pass kernel replace it per instance."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """x: the previous sublayer's output (the embeddings for the first layer, residual None), not yet
        added to the residual stream; returns this layer's MLP output and the stream, likewise."""
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.forward(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp.forward(h, meta.packed_projections), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        # Given its (uninitialized) weight: the loader builds on the meta device, where Embedding's own
        # normal_() init runs a decomposition that imports torch._dynamo and sympy (+118 MB resident).
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, max_positions: int):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        # Set by a CPU worker whose kernels run every layer: decode-only steps then take one call (and those
        # past its rows, on the dense projections, the second plan).
        self.decode_layers: DecodeLayersPlan | None = None
        self.decode_layers_dense: DecodeLayersPlan | None = None
        # Set by a worker whose GEMMs build a kernel per row count: the row count a step of T tokens runs
        # at (engine/models/token_buckets.py). The padded rows take the per-row ops only: token 0 at
        # position 0 in, never attended to, never written to the cache, dropped from the output.
        self.pad_tokens: Callable[[int], int] | None = None
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)build the rotary tables in float32 on the model's device (after a dtype cast)."""
        cos, sin = rope_cos_sin(self.arch, self.max_positions)
        device = self.model.norm.weight.device  # the embedding may be a packed table (compact weights)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def supports_decode_block(self) -> bool:
        """Whether decode-only steps may run each attention block as one kernel call (AttentionMetadata.
        decode_block): fused q/k/v projections, no q/k norms, float32 rotary tables."""
        return self.rope_cos.dtype == torch.float32 and all(
            layer.self_attn.qkv_proj is not None and not layer.self_attn.qk_norm for layer in self.model.layers
        )

    def install_small_batch_kernels(self, packable: dict[str, PackableWeight]) -> int:
        """Give each fused projection (and the lm_head) a packed copy for small batches, where every
        checkpoint tensor it was fused from has one (`packable`: HF weight name → packed form, emptied as
        they are installed). Returns the number of layers that got one."""
        installed = 0

        def install(owner: nn.Module, attr: str, names: list[str]) -> None:
            nonlocal installed
            # Popped: each recovered weight (a byte a 4-bit value) goes as soon as its packed copy is made,
            # not after the whole model's (SmolLM2-135M, compact bf16 on AMX: 967 -> 761 MiB at most here; BENCHMARKS.md).
            packed = fuse_packable([packable.pop(n, None) for n in names])
            if packed is not None:
                setattr(owner, attr, SmallBatchLinear(getattr(owner, attr), packed))
                installed += 1

        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            install(attn, "qkv_proj", [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"])
            install(attn, "o_proj", [f"{prefix}self_attn.o_proj.weight"])
            install(mlp, "gate_up_proj", [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"])
            install(mlp, "down_proj", [f"{prefix}mlp.down_proj.weight"])
            release_free_heap()  # the layer's recovered weights and packing temporaries, before the next's
        head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
        install(self, "lm_head", [head])
        return installed

    def compact_weights(self) -> int:
        """ModelConfig.compact_weights: the packed projections and Q8_0 lm_head serve every call, their dense
        copies dropped (a float32 model's on zenserve's group kernels; a bf16 model's on AMX, each larger
        call's weight written out of its int4 tiles into oneDNN's layout); a tied embedding is then looked
        up from the lm_head's Q8_0 rows. Returns how many dense weights went."""
        dropped = dequantize_int4_groups_per_call(self) + dequantize_int4_tiles_per_call(self)
        head = self.lm_head
        # Only on AMX: elsewhere the tile kernel's larger calls are slower than the dense GEMM's, and the
        # projections keep their dense copies anyway.
        if (isinstance(head, SmallBatchLinear) and head.kind == "int8_tiles" and type(head.dense) is nn.Linear
                and int8_tile_mm_uses_amx()):
            tied = head.dense.weight is self.model.embed_tokens.weight
            head.dense = Int8TilesDense(head)
            if tied:
                self.model.embed_tokens = Int8TilesEmbedding(head.packed_weight)
            return dropped + 1
        if (isinstance(head, SmallBatchLinear) and head.kind == "int8_groups"
                and head.compute_dtype == torch.float32 and type(head.dense) is nn.Linear):
            tied = head.dense.weight is self.model.embed_tokens.weight
            head.dense = Int8GroupsDense(head)
            if tied:
                self.model.embed_tokens = Int8GroupsEmbedding(head.packed_weight, head.group_scales)
            dropped += 1
        return dropped

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: used instead of embedding input_ids (images)
    ) -> torch.Tensor:  # [T, hidden]
        tokens = meta.num_tokens
        padding = 0
        if self.pad_tokens is not None and meta.decode_block is None:  # decode blocks take the decodes only
            padding = self.pad_tokens(tokens) - tokens
        if padding:
            positions = F.pad(positions, (0, padding))
            if inputs_embeds is None:
                input_ids = F.pad(input_ids, (0, padding))
        # NOTE: the residual stream may be updated in place (fused add + norm): never the caller's tensor.
        if inputs_embeds is None:
            x = self.model.embed_tokens(input_ids)
        else:  # F.pad's result is a new tensor; without padding, a copy
            x = F.pad(inputs_embeds, (0, 0, 0, padding)) if padding else inputs_embeds.clone()
        if meta.decode_block is not None:
            cos, sin = self.rope_cos, self.rope_sin  # the decode-block kernel indexes the tables itself
        elif meta.rope_kernel is not None:
            cos, sin = self.rope_cos[positions].float(), self.rope_sin[positions].float()  # [T, D]: the kernel's rows
        else:
            cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, D]
            sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        plan = self.decode_layers
        if (plan is None or x.shape[0] > plan.max_rows) and self.decode_layers_dense is not None \
                and x.shape[0] > self.decode_layers_dense.min_rows:
            plan = self.decode_layers_dense
        if meta.decode_block is not None and plan is not None and x.shape[0] <= plan.max_rows:
            x, residual = plan.run(x, kv_caches, cos, sin, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x, residual = layer.forward(x, residual, cos, sin, kv_cache, meta)
        return self.model.norm.add_forward(x, residual)[0][:tokens]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:  # [S, hidden] -> [S, V]
        """The logits in float32, or (float32=False) in the lm_head's dtype, for a caller that widens them
        only where it must (the sampler)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits


def _fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    out_features = sum(l.out_features for l in linears)
    has_bias = first.bias is not None
    # A weight held without storage (compact weights: only its packed copy serves) leaves the fused one
    # without storage too; the loader reloads densely if a packed copy is then missing. Nothing is copied:
    # torch.cat on meta tensors runs a decomposition that imports torch._dynamo and sympy (+118 MB).
    held = any(l.weight.is_meta for l in linears)
    fused = nn.Linear(first.in_features, out_features, bias=has_bias, device="meta" if held else first.weight.device,
                      dtype=first.weight.dtype)
    if held:
        return fused
    with torch.no_grad():
        fused.weight.copy_(torch.cat([l.weight for l in linears], dim=0))
        if has_bias:
            fused.bias.copy_(torch.cat([l.bias for l in linears], dim=0))
    return fused

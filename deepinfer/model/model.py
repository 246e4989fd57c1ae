"""DeepSeek-V4 forward pass over a flat batch of new tokens, every op called through an `OpTable`.

Per token: embed, copy into `hc_mult` residual streams; per layer: mHC collapse -> attention -> mHC mix, then
mHC collapse -> MoE (hash or top-k routed, plus the shared expert) -> mHC mix; finally the HyperHead collapse,
the final norm and the LM head.
"""

from __future__ import annotations

import torch

from deepinfer.config import HASH_MOE, SLIDING, ModelConfig
from deepinfer.model.attention import AttentionContext, RopeTables, attention_block
from deepinfer.model.rope import inv_freq
from deepinfer.model.state import ForwardBatch
from deepinfer.model.weights import MoE, ModelWeights
from tilekernels import OpTable


class DeepseekV4:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, ops: OpTable):
        self.cfg, self.weights, self.ops = cfg, weights, ops
        device = weights.embed.device
        main = RopeTables(inv_freq(cfg.rope_main, cfg.rope_head_dim).to(device), cfg.rope_main.attention_factor)
        comp = RopeTables(
            inv_freq(cfg.rope_compress, cfg.rope_head_dim).to(device), cfg.rope_compress.attention_factor
        )
        self._attn_ctx = [
            AttentionContext(cfg, ops, i, main if kind == SLIDING else comp, comp)
            for i, kind in enumerate(cfg.layer_types)
        ]

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the new tokens through the model, advancing each sequence's state; return fp32 logits of
        `batch.logit_rows` (every row when None), [M, vocab]."""
        cfg, ops, w = self.cfg, self.ops, self.weights
        eps = cfg.rms_norm_eps
        for seq in batch.seqs:
            first = int(batch.positions[seq.offset])
            if first != seq.state.num_tokens:
                raise AssertionError(f"positions start at {first} but the sequence holds {seq.state.num_tokens} tokens")
        x = ops.embedding(batch.input_ids, w.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(w.layers):
            hc = layer.attn_hc
            post, comb, collapsed = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
            a = attention_block(self._attn_ctx[i], layer.attn, ops.rms_norm(collapsed, layer.input_norm, eps), batch)
            streams = ops.hc_post(streams, a, post, comb)
            hc = layer.ffn_hc
            post, comb, collapsed = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
            f = self._moe(i, layer.moe, ops.rms_norm(collapsed, layer.post_attention_norm, eps), batch.input_ids)
            streams = ops.hc_post(streams, f, post, comb)
        for seq in batch.seqs:
            seq.state.num_tokens += seq.length
        if batch.logit_rows is not None:
            streams = streams[batch.logit_rows]
        hc = w.hc_head
        h = ops.rms_norm(ops.hc_head(streams, hc.fn, hc.base, hc.scale, cfg.hc_eps, eps), w.norm, eps)
        return ops.linear(h, w.lm_head).float()

    def _moe(self, layer: int, w: MoE, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        logits = ops.linear(x, w.gate)
        is_hash = cfg.mlp_layer_types[layer] == HASH_MOE
        weights, indices = ops.moe_gate(
            logits,
            cfg.num_experts_per_tok,
            cfg.scoring_func,
            cfg.routed_scaling_factor,
            bias=None if is_hash else w.bias,
            hash_ids=input_ids if is_hash else None,
            tid2eid=w.tid2eid if is_hash else None,
        )
        routed = ops.moe_experts(x, weights, indices, w.gate_up, w.down, cfg.swiglu_limit)
        shared = ops.linear(ops.swiglu(ops.linear(x, w.shared_gate_up), cfg.swiglu_limit), w.shared_down)
        return routed + shared

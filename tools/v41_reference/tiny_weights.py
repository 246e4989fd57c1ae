"""Random weights for the tiny V4.1 reference runs (run_tiny.py), and the fp32 twin of a checkpoint-dtype model.

Weights are drawn in the dtypes the reference allocates; FP8 ones get 32x32 ue8m0 block scales and FP4 experts
one ue8m0 scale per 1x32, quantized the way DeepSeek's kernels round (cpu_kernels.py)."""

import torch

from cpu_kernels import e2m1_codes, fast_round_scale, pack_fp4, to_e4m3, unpack_fp4


def stored_fp32(name: str) -> bool:
    """Tensors the released checkpoint stores in fp32 (mHC, attention sinks, router biases)."""
    return ".hc_" in name or name.endswith(("attn_sink", "gate.bias", "gate.bias_vl"))


def _fp8_blockwise(w: torch.Tensor, bs: int = 32):
    """fp32 [out, in] -> (e4m3 [out, in], e8m0 [ceil(out/bs), ceil(in/bs)]), ue8m0 block scales."""
    o, i = w.shape
    po, pi = -o % bs, -i % bs
    wp = torch.nn.functional.pad(w, (0, pi, 0, po))
    blocks = wp.unflatten(0, (-1, bs)).unflatten(2, (-1, bs))  # [O, bs, I, bs]
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    s = fast_round_scale(amax, torch.tensor(1 / 448.0))
    q = to_e4m3(blocks / s[:, None, :, None]).float().flatten(2).flatten(0, 1)[:o, :i]
    return q.to(torch.float8_e4m3fn), s.to(torch.float8_e8m0fnu)


def _fp4_rowwise(w: torch.Tensor):
    """fp32 [out, in] -> (float4_e2m1fn_x2 [out, in//2], e8m0 [out, in//32])."""
    g = w.unflatten(-1, (-1, 32))
    s = fast_round_scale(g.abs().amax(-1).clamp_min(6 * 2.0**-126), torch.tensor(1 / 6.0))
    codes = e2m1_codes((g / s.unsqueeze(-1)).clamp(-6, 6)).flatten(-2)
    return pack_fp4(codes), s.to(torch.float8_e8m0fnu)


@torch.no_grad()
def init_weights(model_mod, model: torch.nn.Module, seed: int, bf16_grid: bool = False):
    """Random weights in the dtypes the model allocates. bf16_grid=True (faithful mode) also rounds
    the tensors the model keeps in fp32 but the checkpoint stores in bf16 (ParallelHead.weight,
    ratio>1 Compressor.wkv/wgate; see their comments in model.py) to the bf16 grid."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    for mname, mod in model.named_modules():
        if isinstance(mod, model_mod.Linear):
            o, i = mod.out_features, mod.in_features
            w = randn(o, i, std=i**-0.5)
            dt = mod.weight.dtype
            if dt == torch.float8_e4m3fn:
                q, s = _fp8_blockwise(w)
                mod.weight.data.copy_(q)
                mod.scale.data.copy_(s)
            elif dt == torch.float4_e2m1fn_x2:
                q, s = _fp4_rowwise(w)
                mod.weight.data = q
                mod.weight.scale = mod.scale
                mod.scale.data.copy_(s)
            else:
                if bf16_grid and ".compressor." in mname:
                    w = w.bfloat16().float()
                mod.weight.data.copy_(w.to(dt))
        elif isinstance(mod, model_mod.RMSNorm):
            mod.weight.data.copy_((1 + randn(mod.dim, std=0.1)).to(mod.weight.dtype))
        elif isinstance(mod, model_mod.ParallelEngramEmbedding):
            rows, d = mod.weight.shape
            v = randn(rows, d).unflatten(-1, (-1, mod.block_size))
            s = fast_round_scale(v.abs().amax(-1).clamp_min(1e-4), torch.tensor(1 / 448.0))
            mod.weight.data.copy_(to_e4m3(v / s.unsqueeze(-1)).flatten(-2))
            mod.scale.data.copy_(s.to(torch.float8_e8m0fnu))
        elif isinstance(mod, model_mod.ParallelEmbedding):
            mod.weight.data.copy_(randn(*mod.weight.shape).to(mod.weight.dtype))
        elif isinstance(mod, model_mod.ParallelHead):
            w = randn(*mod.weight.shape, std=mod.dim**-0.5)
            mod.weight.data.copy_(w.bfloat16().float() if bf16_grid else w)
        elif isinstance(mod, model_mod.Gate):
            mod.weight.data.copy_(randn(*mod.weight.shape, std=mod.dim**-0.5).to(mod.weight.dtype))
            mod.bias.data.copy_(randn(*mod.bias.shape, std=0.1))
        elif isinstance(mod, model_mod.Engram):
            mod.q_weight.data.copy_(1 + randn(*mod.q_weight.shape, std=0.1))
            mod.k_weight.data.copy_(1 + randn(*mod.k_weight.shape, std=0.1))
        elif isinstance(mod, model_mod.Attention):
            mod.attn_sink.data.copy_(randn(*mod.attn_sink.shape, std=0.5))
        elif isinstance(mod, model_mod.Block):
            hc_dim = mod.hc_attn_fn.shape[1]
            for p in (mod.hc_attn_fn, mod.hc_ffn_fn):
                p.data.copy_(randn(*p.shape, std=hc_dim**-0.5))
            for p in (mod.hc_attn_base, mod.hc_ffn_base):
                p.data.copy_(randn(*p.shape, std=0.5))
            for p in (mod.hc_attn_scale, mod.hc_ffn_scale):
                p.data.copy_(0.5 + torch.rand(3, generator=g))


def fp32_twin(model_mod, fp32_args, tok, faithful):
    """The fp32-mode model (built from `fp32_args`) holding `faithful`'s weights dequantized (FP8 32x32 blocks,
    FP4 1x32), exactly."""
    twin = model_mod.Transformer(fp32_args, tokenizer=tok)
    state = faithful.state_dict()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            src = state[name]
            scale = state.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
            if scale is not None and src.dtype == torch.float8_e4m3fn and ".engram.embed." not in name:
                full = scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)[: src.shape[0], : src.shape[1]]
                src = src.float() * full
            elif src.dtype == torch.float4_e2m1fn_x2:
                src = unpack_fp4(src) * scale.float().repeat_interleave(32, 1)
            if ".engram.embed." in name:
                p.data = src.clone()  # the table stays fp8 (+ its scale) in both modes
            else:
                p.data = src.to(torch.float32 if ".engram.wkv." not in name else torch.bfloat16)
    twin.eval()
    return twin

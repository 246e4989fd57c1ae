"""Run DeepSeek's own V4.1 reference `inference/model.py` (+ `engram.py`) on the CPU with a tiny
random config that covers every layer kind, kernel.py replaced by cpu_kernels.py.

No upstream file is edited: `upstream/inference` goes on sys.path and the modules model.py imports
are supplied through sys.modules:
  kernel          -> cpu_kernels (this directory)
  image_processor -> stub with the four span-type constants (only used on the VL path)
  vision          -> stub ViT/Aligner that raise (vision_n_layers = 0 here, so never built)

Usage:
  python3.11 run_tiny.py                      # fp32 mode, prefill 40 + 16 decode, batch 2
  python3.11 run_tiny.py --mode faithful      # checkpoint dtypes: fp8 dense, fp4 experts, bf16 acts
  python3.11 run_tiny.py --save out_dir       # also write weights (.safetensors), config, logits
"""

import argparse
import json
import math
import os
import sys
import types
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
UPSTREAM = os.path.join(HERE, "upstream", "inference")


# ----------------------------------------------------------------------------- module plumbing
def import_reference():
    import cpu_kernels

    sys.modules["kernel"] = cpu_kernels
    ip = types.ModuleType("image_processor")
    # values only matter on the VL path (Transformer.merge_image_embeddings), which is off here
    ip.IMAGE, ip.IMAGE_START, ip.IMAGE_END, ip.IMAGE_NEW_LINE = 0, 1, 2, 3
    sys.modules["image_processor"] = ip
    vis = types.ModuleType("vision")

    class _NoVision:
        def __init__(self, *a, **k):
            raise RuntimeError("vision stub: set vision_n_layers = 0")

    vis.ViT = vis.Aligner = _NoVision
    sys.modules["vision"] = vis
    sys.path.insert(0, UPSTREAM)
    import engram  # noqa: F401  (upstream/inference/engram.py)
    import model  # upstream/inference/model.py

    return model, engram


# ----------------------------------------------------------------------------- stand-in tokenizer
class _Backend:
    def __init__(self, texts, raw):
        self.texts, self.raw = texts, raw

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.texts[i] for i in ids)

    def id_to_token(self, i):
        return self.raw[i]


class TinyTokenizer:
    """Duck-types the two things engram.build_compressed_token_map uses from an HF tokenizer:
    len(tokenizer) and tokenizer.backend_tokenizer.{decode, id_to_token}. Token texts are
    chosen so the upstream NFKC/NFD/strip-accents/lowercase/whitespace normalizer collapses
    many of them (case variants, accents, leading spaces, a lone space, partial-UTF-8 tokens
    keyed by their raw form), like the real 129k -> 99,092 class map does."""

    def __init__(self, vocab_size: int):
        words = ["the", "and", "code", "model", "cafe", "data", "token", "x", "value", "sparse"]
        texts, raw = [], []
        for i in range(vocab_size):
            if i == 0:
                t = "<bos>"
            elif i == 1:
                t = "<eos>"
            elif i == 2:
                t = "<pad>"
            elif i % 97 == 5:
                t = "\ufffd"  # partial UTF-8 byte token -> keyed by id_to_token
            elif i % 89 == 3:
                t = " "
            else:
                w = words[i % len(words)] + str((i // len(words)) % 17)
                v = (i // (len(words) * 17)) % 4
                t = [w, w.upper(), " " + w, w.capitalize().replace("a", "\u00e1")][v]
            texts.append(t)
            raw.append(f"<raw{i}>")
        self._n = vocab_size
        self.backend_tokenizer = _Backend(texts, raw)

    def __len__(self):
        return self._n


# ----------------------------------------------------------------------------- config
def tiny_args(model_mod, engram_mod, mode: str, tokenizer):
    """8 backbone layers, one of each kind (layer id: kind / real-model analogue):
    0 window-only (0)            1 window-only + Engram (1)
    2 ratio-2 kv+index source + Engram (2/8/14; 14 also has Engram)
    3 ratio-2 reader (3-7)
    4 ratio-1 kv+index source + candidate source (20)
    5 ratio-1 reader of 4's latents/top-k (21-23)
    6 ratio-1 extra index source, restricted to 4's candidate blocks (24/28/32/36)
    7 ratio-1 reader of 6's top-k (25-27, ...)
    Draft (DSpark) layers are skipped (dspark_block_size = 0)."""
    A = model_mod.ModelArgs
    kw = dict(
        max_batch_size=2, max_seq_len=64, temperature=0.0,
        dtype="fp8" if mode == "faithful" else "bf16",
        expert_dtype="fp4" if mode == "faithful" else None,
        vocab_size=512, dim=64, moe_inter_dim=64, n_layers=8, n_mtp_layers=0, n_heads=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
        norm_topk_prob=True, route_scale=1.5, swiglu_limit=10.0,
        q_lora_rank=32, head_dim=64, rope_head_dim=16, norm_eps=1e-20, o_groups=2, o_lora_rank=32,
        window_size=8,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
        compress_rope_theta=160000.0, original_seq_len=16, rope_theta=10000.0, rope_factor=4,
        beta_fast=32, beta_slow=1,
        index_n_heads=4, index_head_dim=32, index_topk=6,
        candidate_source_layer=4, candidate_topk_blocks=3, candidate_block_size=4,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=(1, 2), engram_max_ngram_size=4, engram_vocab_size=50, engram_n_heads=2,
        engram_head_dim=32, engram_pad_id=2,
        vision_n_layers=0,
    )
    args = A(**kw)
    # table rows = sum of the layer's bucket primes (as in the released config)
    layout = engram_mod.EngramLayout.from_args(args)
    args.engram_num_embeddings = tuple(sum(p for per in layer for p in per) for layer in layout.primes)
    _, compressed = engram_mod.build_compressed_token_map(tokenizer)
    args.engram_compressed_vocab_size = compressed
    return args


# ----------------------------------------------------------------------------- random weights
def _fp8_blockwise(w: torch.Tensor, bs: int = 32):
    """fp32 [out, in] -> (e4m3 [out, in], e8m0 [ceil(out/bs), ceil(in/bs)]), ue8m0 block scales."""
    from cpu_kernels import fast_round_scale, to_e4m3

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
    from cpu_kernels import e2m1_codes, fast_round_scale, pack_fp4

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
            from cpu_kernels import fast_round_scale, to_e4m3

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


# ----------------------------------------------------------------------------- instrumentation
def watch_index_k(model_mod, model, fix_quirk: bool = False):
    """Record, per Indexer call, which layer's k_cache `shared_attn.index_k` pointed at when it was
    read (observation only: wraps Indexer.forward, changes nothing)."""
    owner = {}
    for i, layer in enumerate(model.layers):
        ix = layer.attn.indexer
        if ix is not None and ix.owns_k:
            owner[id(ix.k_cache)] = i
    log, detail = [], []
    for i, layer in enumerate(model.layers):
        ix = layer.attn.indexer
        if ix is None:
            continue
        orig = ix.forward

        def wrapped(*a, _orig=orig, _i=i, _ix=ix, **k):
            if fix_quirk and _ix.owns_k:
                # NOT upstream behaviour (opt-in): a key owner always scores against its own keys
                model_mod.shared_attn.index_k = _ix.k_cache
            out = _orig(*a, **k)
            log.append((_i, owner.get(id(model_mod.shared_attn.index_k), "?")))
            cand = model_mod.shared_attn.candidates
            detail.append((_i, int((out[0, -1] >= 0).sum()), out.shape[-1],
                           int(cand[0, -1].sum()) if (_ix.is_candidate_source or _ix.uses_candidates) else None))
            return out

        ix.forward = wrapped
    return log, detail


def stats(t):
    t = t.float()
    return f"mean {t.mean():+.5f} std {t.std():.5f} min {t.min():+.4f} max {t.max():+.4f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fp32", "faithful"], default="fp32")
    ap.add_argument("--prefill", type=int, default=40)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fix-index-k-quirk", action="store_true",
                    help="deviation: make ratio-2 key owners read their own k_cache on every decode step")
    ap.add_argument("--save", default=None, help="directory for weights/config/logits")
    opts = ap.parse_args()

    sys.path.insert(0, HERE)
    torch.manual_seed(opts.seed)
    model_mod, engram_mod = import_reference()
    tok = TinyTokenizer(512)
    args = tiny_args(model_mod, engram_mod, opts.mode, tok)
    assert opts.prefill + opts.decode <= args.max_seq_len

    act_dtype = torch.bfloat16 if opts.mode == "faithful" else torch.float32
    torch.set_default_dtype(act_dtype)  # as generate.py does (bf16) for the real model
    model = model_mod.Transformer(args, tokenizer=tok)
    if opts.mode == "fp32":
        # dtype="bf16" builds bf16 Linear weights; promote them (and bf16 params) to fp32, except
        # Engram.wkv, whose input upstream hard-casts to bf16 (ParallelEngramEmbedding.forward)
        for name, p in model.named_parameters():
            if p.dtype == torch.bfloat16 and ".engram.wkv." not in name:
                p.data = p.data.float()
    init_weights(model_mod, model, opts.seed, bf16_grid=opts.mode == "faithful")
    model.eval()
    log, detail = watch_index_k(model_mod, model, fix_quirk=opts.fix_index_k_quirk)

    g = torch.Generator().manual_seed(opts.seed + 1)
    prompt = torch.randint(3, args.vocab_size, (opts.batch, opts.prefill), generator=g)
    print(f"mode={opts.mode} act_dtype={act_dtype} layers={args.n_layers} ratios={args.compress_ratios} "
          f"engram rows={args.engram_num_embeddings} compressed_vocab={args.engram_compressed_vocab_size}")

    # observation only: keep the final-norm output so the prefill logits of *every* position can be
    # formed with the head weight (upstream ParallelHead returns the last position only)
    normed = {}
    model.norm.register_forward_hook(lambda m, i, o: normed.__setitem__("h", o))

    all_logits = []
    with torch.inference_mode():
        ids, logits, _ = model(prompt, 0)
        prefill_all = torch.nn.functional.linear(normed["h"].float(), model.head.weight)  # [b, s, vocab]
        assert torch.allclose(prefill_all[:, -1], logits, rtol=1e-5, atol=1e-5)  # GEMM shape -> last-ulp diffs
        for li, nvalid, width, ncand in detail:
            print(f"  prefill indexer L{li}: last query keeps {nvalid} valid of top-{width}"
                  + ("" if ncand is None else f"; candidate positions visible {ncand}"))
        all_logits.append(logits)
        print(f"prefill[{opts.prefill}] logits {tuple(logits.shape)} {stats(logits)} argmax {ids.tolist()}")
        seq = [prompt, ids.unsqueeze(1)]
        tok_in = ids.unsqueeze(1)
        pos = opts.prefill
        for step in range(opts.decode):
            n0 = len(log)
            ids, logits, _ = model(tok_in, pos)
            all_logits.append(logits)
            srcs = ",".join(f"L{a}<-k{b}" for a, b in log[n0:])
            print(f"decode pos {pos:2d} {stats(logits)} argmax {ids.tolist()}  index_k: {srcs}")
            tok_in = ids.unsqueeze(1)
            seq.append(tok_in)
            pos += 1
    L = torch.stack(all_logits, 1)  # [b, 1 + decode, vocab]
    assert torch.isfinite(L).all(), "non-finite logits"
    print(f"all logits {tuple(L.shape)} finite; {stats(L)}")

    if opts.save:
        os.makedirs(opts.save, exist_ok=True)
        from safetensors.torch import save_file

        sd = {}
        for k, v in model.state_dict().items():
            if v.dtype == torch.float4_e2m1fn_x2:
                v = v.view(torch.int8)  # the checkpoint stores packed fp4 experts as int8
            sd[k] = v.contiguous()
        save_file(sd, os.path.join(opts.save, "model.safetensors"))
        cfg = asdict(args)
        with open(os.path.join(opts.save, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        torch.save({"tokens": torch.cat(seq, 1), "prompt_len": opts.prefill, "logits": L, "prefill_logits_all": prefill_all,
                    "token_map": model.engram_hash.token_map, "mode": opts.mode,
                    "fix_index_k_quirk": opts.fix_index_k_quirk}, os.path.join(opts.save, "logits.pt"))
        print("saved to", opts.save)


if __name__ == "__main__":
    main()

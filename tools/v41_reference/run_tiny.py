"""Run DeepSeek's own V4.1 reference `inference/model.py` (+ `engram.py`) on the CPU with a tiny
random config that covers every layer kind, kernel.py replaced by cpu_kernels.py.

No upstream file is edited: `upstream/inference` goes on sys.path and the modules model.py imports
are supplied through sys.modules:
  kernel          -> cpu_kernels (this directory)
  image_processor -> stub with the four span-type constants (only used on the VL path)
  vision          -> stub ViT/Aligner that raise (vision_n_layers = 0 here, so never built)

Usage:
  python3.11 run_tiny.py                      # config a, fp32 mode, prefill 40 + 16 decode, batch 2
  python3.11 run_tiny.py --config b           # the second tiny config (other wiring, hc_mult 2, odd prefill)
  python3.11 run_tiny.py --mode faithful      # checkpoint dtypes: fp8 dense, fp4 experts, bf16 acts
  python3.11 run_tiny.py --save out_dir       # also write weights (.safetensors), config, logits
  python3.11 run_tiny.py --dspark             # also run the DSpark draft blocks (forward_spec) every decode step

Weights are drawn on the bf16 grid (except the tensors the released checkpoint keeps in fp32: mHC, attention
sinks, router biases) so that the saved checkpoint stores them as bf16, as the release does, losslessly;
fp32 mode still computes in fp32. The test fixtures are made by tools/v41_reference/make_fixtures.sh.
"""

import argparse
import json
import os
import re
import sys
import types
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 256  # the tiny configs' vocabulary (and the stand-in tokenizer's size)
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
# --dspark: the draft blocks added to either tiny config (ModelArgs names; `compress_ratios` gets one 0 per draft
# layer). Noise token 250: an ordinary id of the tiny vocabulary (not bos/eos/pad). Target layers 4, 6, 7: late
# backbone layers, not contiguous, the last one included. temperature stays 0 (greedy drafts).
DSPARK = dict(n_mtp_layers=2, dspark_block_size=4, dspark_noise_token_id=250, dspark_target_layer_ids=(4, 6, 7),
              dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_n_activated_experts=2)
DRAFT_ALIAS = re.compile(r"mtp\.\d+\.(embed|head)\.weight")  # DSparkBlock.embed/head: the main model's modules


def tiny_args(model_mod, engram_mod, mode: str, tokenizer, config: str = "a", dspark: bool = False):
    """Config a: 8 backbone layers, one of each kind (layer id: kind / real-model analogue):
    0 window-only (0)            1 window-only + Engram (1)
    2 ratio-2 kv+index source + Engram (2/8/14; 14 also has Engram)
    3 ratio-2 reader (3-7)
    4 ratio-1 kv+index source + candidate source (20)
    5 ratio-1 reader of 4's latents/top-k (21-23)
    6 ratio-1 extra index source, restricted to 4's candidate blocks (24/28/32/36)
    7 ratio-1 reader of 6's top-k (25-27, ...)
    Config b: 8 layers wired differently, hc_mult 2, 3-gram Engram with 3 heads, window 6:
    0 window-only + Engram       1 ratio-2 kv+index source     2 ratio-2 reader of 1
    3 ratio-2 kv+index source (a second one)                   4 ratio-2 reader of 3 (not of 1)
    5 ratio-1 kv+index source + candidate source               6 ratio-1 extra index source + Engram
    7 ratio-1 reader of 5's latents and 6's top-k
    Both keep index_topk <= (candidate_topk_blocks - 1) * candidate_block_size + 1 (NOTES.md 3d), and use 16
    index heads: an index score is exactly 0 when every head's ReLU is (FP4-rounded q and k, few heads: often), and
    which of several tied entries torch.topk keeps is implementation-defined; with 16 heads ties do not occur.
    Draft (DSpark) layers are skipped (dspark_block_size = 0) unless dspark=True (`--dspark`): then 2 draft blocks
    (window-only, compress ratio 0) follow the 8 backbone layers, block size 4, Markov rank 16, 4 experts top-2, the
    main hidden taken from the inputs of backbone layers 4, 6 and 7 (DSPARK below)."""
    A = model_mod.ModelArgs
    kw = dict(
        max_batch_size=2, max_seq_len=64, temperature=0.0,
        dtype="fp8" if mode == "faithful" else "bf16",
        expert_dtype="fp4" if mode == "faithful" else None,
        vocab_size=VOCAB, dim=64, moe_inter_dim=32, n_layers=8, n_mtp_layers=0, n_heads=4,
        n_routed_experts=6, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
        norm_topk_prob=True, route_scale=1.5, swiglu_limit=10.0,
        q_lora_rank=32, head_dim=64, rope_head_dim=16, norm_eps=1e-20, o_groups=2, o_lora_rank=32,
        window_size=8,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
        compress_rope_theta=160000.0, original_seq_len=16, rope_theta=10000.0, rope_factor=4,
        beta_fast=32, beta_slow=1,
        index_n_heads=16, index_head_dim=32, index_topk=6,
        candidate_source_layer=4, candidate_topk_blocks=3, candidate_block_size=4,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=(1, 2), engram_max_ngram_size=4, engram_vocab_size=50, engram_n_heads=2,
        engram_head_dim=32, engram_pad_id=2,
        vision_n_layers=0,
    )
    if config == "b":
        kw.update(
            n_heads=2, n_routed_experts=4, n_activated_experts=2, window_size=6,
            compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1), kv_source_layers=(1, 3, 5),
            index_source_layers=(1, 3, 5, 6), index_n_heads=16, index_topk=5,
            candidate_source_layer=5, candidate_topk_blocks=2, candidate_block_size=4,
            hc_mult=2, hc_sinkhorn_iters=10, original_seq_len=32, rope_factor=8, compress_rope_theta=40000.0,
            engram_layer_ids=(0, 6), engram_max_ngram_size=3, engram_vocab_size=40, engram_n_heads=3,
        )
    elif config != "a":
        raise SystemExit(f"unknown --config {config!r}; accepted: a, b")
    if dspark:
        kw.update(DSPARK, compress_ratios=kw["compress_ratios"] + (0,) * DSPARK["n_mtp_layers"])
    args = A(**kw)
    # table rows = sum of the layer's bucket primes (as in the released config)
    layout = engram_mod.EngramLayout.from_args(args)
    args.engram_num_embeddings = tuple(sum(p for per in layer for p in per) for layer in layout.primes)
    _, compressed = engram_mod.build_compressed_token_map(tokenizer)
    args.engram_compressed_vocab_size = compressed
    return args


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
    ap.add_argument("--config", choices=["a", "b"], default="a")
    ap.add_argument("--prefill", type=int, default=40)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fix-index-k-quirk", action="store_true",
                    help="deviation: make ratio-2 key owners read their own k_cache on every decode step")
    ap.add_argument("--save", default=None, help="directory for weights/config/logits")
    ap.add_argument("--dspark", action="store_true",
                    help="add 2 DSpark draft blocks (DSPARK) and run forward_spec after the prefill and every decode "
                         "step; --save also writes dspark.pt")
    opts = ap.parse_args()

    sys.path.insert(0, HERE)
    from tiny_weights import fp32_twin, init_weights, stored_fp32

    torch.manual_seed(opts.seed)
    model_mod, engram_mod = import_reference()
    tok = TinyTokenizer(VOCAB)
    if opts.dspark and opts.mode != "fp32":
        raise SystemExit("--dspark is only supported in fp32 mode")
    args = tiny_args(model_mod, engram_mod, opts.mode, tok, opts.config, opts.dspark)
    # with --dspark the last decode step's draft rows sit at positions up to prefill + decode - 1 + block size
    assert opts.prefill + opts.decode + (args.dspark_block_size if opts.dspark else 0) <= args.max_seq_len

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
    with torch.no_grad():  # the bf16 grid for every tensor the release stores as bf16 (see the module docstring)
        for name, p in model.named_parameters():
            if p.dtype in (torch.float32, torch.bfloat16) and not stored_fp32(name):
                p.data = p.data.bfloat16().to(p.dtype)
    model.eval()
    log, detail = watch_index_k(model_mod, model, fix_quirk=opts.fix_index_k_quirk)

    g = torch.Generator().manual_seed(opts.seed + 1)
    prompt = torch.randint(3, args.vocab_size, (opts.batch, opts.prefill), generator=g)
    print(f"mode={opts.mode} act_dtype={act_dtype} layers={args.n_layers} ratios={args.compress_ratios} "
          f"engram rows={args.engram_num_embeddings} compressed_vocab={args.engram_compressed_vocab_size}")

    spec = {} if opts.dspark else None
    L, prefill_all, tokens = generate(model, prompt, opts.decode, log, detail, spec=spec)
    if opts.save:
        os.makedirs(opts.save, exist_ok=True)
        from safetensors.torch import save_file

        sd = {}
        for k, v in model.state_dict().items():
            if DRAFT_ALIAS.fullmatch(k):  # not a tensor of its own: the main embed/head (checked to alias)
                assert v.data_ptr() == model.state_dict()[k.split(".", 2)[2]].data_ptr(), k
                continue
            if v.dtype == torch.float4_e2m1fn_x2:
                v = v.view(torch.int8)  # the checkpoint stores packed fp4 experts as int8
            elif v.dtype in (torch.float32, torch.bfloat16) and not stored_fp32(k):
                assert torch.equal(v.bfloat16().to(v.dtype), v), k  # on the grid: lossless
                v = v.bfloat16()
            sd[k] = v.contiguous()
        save_file(sd, os.path.join(opts.save, "model.safetensors"))
        cfg = asdict(args)
        if opts.mode == "faithful":  # the release's spelling of the formats (HF config.json)
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
        with open(os.path.join(opts.save, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        out = {"tokens": tokens, "prompt_len": opts.prefill, "logits": L, "prefill_logits_all": prefill_all,
               "token_map": model.engram_hash.token_map, "mode": opts.mode,
               "fix_index_k_quirk": opts.fix_index_k_quirk}
        if opts.mode == "fp32":
            # the same model and tokens with the in-place FP8/FP4 rounding of the KV, latent and index caches off
            # (cpu_kernels' V41_CPU_NO_QAT): fp32 arithmetic only, no rounding boundary for an ulp to cross
            os.environ["V41_CPU_NO_QAT"] = "1"
            spec_nogrid = {} if opts.dspark else None
            nogrid = generate(model, prompt, opts.decode, log, detail, forced=tokens, spec=spec_nogrid)
            out["logits_nogrid"], out["prefill_logits_all_nogrid"] = nogrid[:2]
            del os.environ["V41_CPU_NO_QAT"]
            if opts.dspark:
                for k in ("draft_ids", "draft_logits", "confidence"):
                    spec[k + "_nogrid"] = spec_nogrid[k]
        if opts.mode == "faithful":
            # the same reference in fp32 mode on the dequantized weights, fed the same tokens: its distance to the
            # faithful logits is the reference's own error from bf16 activations and FP8-quantized GEMM inputs
            torch.set_default_dtype(torch.float32)
            twin = fp32_twin(model_mod, tiny_args(model_mod, engram_mod, "fp32", tok, opts.config), tok, model)
            tlog, tdetail = watch_index_k(model_mod, twin, fix_quirk=opts.fix_index_k_quirk)
            out["logits_fp32"], out["prefill_logits_all_fp32"], _ = generate(twin, prompt, opts.decode, tlog, tdetail,
                                                                             forced=tokens)
            del out["prefill_logits_all"]  # (size) the faithful run's last-position logits are in "logits"
            print(f"fp32 twin vs faithful: max |dlogit| {(out['logits_fp32'] - L).abs().max():.4f}")
        torch.save(out, os.path.join(opts.save, "logits.pt"))
        if opts.dspark:
            spec.update(prompt=prompt, prompt_len=opts.prefill, block_size=args.dspark_block_size,
                        noise_token_id=args.dspark_noise_token_id,
                        target_layer_ids=torch.tensor(args.dspark_target_layer_ids))
            torch.save(spec, os.path.join(opts.save, "dspark.pt"))
        print("saved to", opts.save)


def generate(model, prompt, decode: int, log, detail, forced=None, spec=None):
    """Prefill `prompt`, then `decode` greedy steps (or the tokens of `forced` [b, prefill + decode + 1]).
    Returns (logits [b, 1 + decode, vocab], prefill logits of every position, the tokens).
    spec: a dict to fill with the DSpark drafts (--dspark): `Transformer.forward_spec` runs after the prefill (start_pos
    0: seeds the draft blocks' windows, returns None) and after every decode step (start_pos = the step's position),
    fed the token the target goes on with (its greedy token, or `forced`'s) and the step's main hidden."""
    # observation only: keep the final-norm output so the prefill logits of *every* position can be
    # formed with the head weight (upstream ParallelHead returns the last position only)
    normed = {}
    hook = model.norm.register_forward_hook(lambda m, i, o: normed.__setitem__("h", o))
    all_logits = []
    with torch.inference_mode():
        ids, logits, main_hidden = model(prompt, 0)
        prefill_all = torch.nn.functional.linear(normed["h"].float(), model.head.weight)  # [b, s, vocab]
        assert torch.allclose(prefill_all[:, -1], logits, rtol=1e-5, atol=1e-5)  # GEMM shape -> last-ulp diffs
        for li, nvalid, width, ncand in detail:
            print(f"  prefill indexer L{li}: last query keeps {nvalid} valid of top-{width}"
                  + ("" if ncand is None else f"; candidate positions visible {ncand}"))
        all_logits.append(logits)
        print(f"prefill[{prompt.shape[1]}] logits {tuple(logits.shape)} {stats(logits)} argmax {ids.tolist()}")
        pos = prompt.shape[1]
        if forced is not None:
            ids = forced[:, pos]
        seq = [prompt, ids.unsqueeze(1)]
        if spec is not None:
            assert model.forward_spec(seq[-1][:, 0], main_hidden, 0) is None
            spec["prefill_main_hidden"] = main_hidden  # [b, prefill, dim * n_targets]
            drafts = {k: [] for k in ("positions", "input_ids", "target_next", "main_hidden", "draft_ids",
                                      "draft_logits", "confidence")}
        for step in range(decode):
            n0 = len(log)
            ids, logits, main_hidden = model(seq[-1], pos)
            all_logits.append(logits)
            srcs = ",".join(f"L{a}<-k{b}" for a, b in log[n0:])
            print(f"decode pos {pos:2d} {stats(logits)} argmax {ids.tolist()}  index_k: {srcs}")
            nxt = ids if forced is None else forced[:, pos + 1]
            if spec is not None:
                d_ids, d_logits, conf = model.forward_spec(nxt, main_hidden, pos)
                assert torch.equal(d_ids[:, 0], nxt) and torch.equal(d_ids[:, 1:], d_logits.argmax(-1))
                for k, v in zip(drafts, (torch.tensor(pos), seq[-1][:, 0], nxt, main_hidden[:, 0], d_ids, d_logits,
                                         conf)):
                    drafts[k].append(v)
                print(f"  draft at pos {pos:2d}: ids {d_ids[:, 1:].tolist()} confidence {conf.tolist()}")
            pos += 1
            seq.append(nxt.unsqueeze(1))
        if spec is not None:
            # step axis after the batch axis (positions: [decode])
            spec.update({k: torch.stack(v, 1 if v[0].dim() else 0) for k, v in drafts.items()})
            spec["draft_positions"] = spec["positions"].unsqueeze(1) + torch.arange(1, model.mtp[0].block_size + 1)
    hook.remove()
    L = torch.stack(all_logits, 1)  # [b, 1 + decode, vocab]
    assert torch.isfinite(L).all(), "non-finite logits"
    print(f"all logits {tuple(L.shape)} finite; {stats(L)}")
    return L, prefill_all, torch.cat(seq, 1)


if __name__ == "__main__":
    main()

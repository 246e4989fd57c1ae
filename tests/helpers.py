"""Shared test helpers: tiny random DeepSeek-V4 configs and HF reference models (batch 1, unpadded)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# All three layer types, both MLP types, sqrtsoftplus scoring, W=128, rates 4/128 (as V4-Flash).
TINY_A: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, index_n_heads=8, index_head_dim=16, index_topk=4, qk_rope_head_dim=8,
    compress_ratios=[0, 4, 128, 4, 128], num_hash_layers=2, rope_scaling=YARN, max_position_embeddings=4096,
)
# Sigmoid scoring, another shape: 4 groups, hc_mult 2, window 16 and HCA rate 16, more hash layers.
TINY_B: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=384, hidden_size=48, num_hidden_layers=4, num_attention_heads=8,
    head_dim=16, q_lora_rank=24, o_groups=4, o_lora_rank=8, n_routed_experts=6, num_experts_per_tok=3,
    moe_intermediate_size=24, index_n_heads=8, index_head_dim=16, index_topk=6, qk_rope_head_dim=8,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=16, hc_mult=2, num_hash_layers=1, scoring_func="sigmoid", rope_scaling=YARN,
    routed_scaling_factor=2.5, max_position_embeddings=4096,
)
# TINY_A with one MTP (nextn) draft layer, as V4-Flash lists it: its compress_ratios slot after the last layer, 0.
TINY_MTP: dict[str, Any] = dict(TINY_A, num_nextn_predict_layers=1, compress_ratios=[0, 4, 128, 4, 128, 0])
# TINY_A with DSpark block drafting: two draft blocks (their own 4 experts, top 2) reading layers 1, 3 and 4.
TINY_DSPARK: dict[str, Any] = dict(TINY_A, num_nextn_predict_layers=2, compress_ratios=[0, 4, 128, 4, 128, 0, 0],
                                   dspark_block_size=4, dspark_noise_token_id=7, dspark_target_layer_ids=[1, 3, 4],
                                   dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)


def hf_config(raw: dict[str, Any]):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"})


def hf_model(raw: dict[str, Any], seed: int = 0):
    """An HF DeepseekV4ForCausalLM with every parameter the default init leaves trivial randomized."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(raw)).eval()
    n_experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.normal_(0.0, 0.5)
            elif name.endswith((".scale", "hc_scale")) or "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, n_experts, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def canonical_state(model) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def hf_greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Prefill logits [T, V], then per decode step logits [V] and the greedy tokens, with HF's cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[None], past_key_values=cache, use_cache=True)
        prefill = out.logits[0]
        tokens, step_logits = [int(prefill[-1].argmax())], []
        for _ in range(steps - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            step_logits.append(out.logits[0, -1])
            tokens.append(int(out.logits[0, -1].argmax()))
    return prefill, step_logits, tokens


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1))


def save_model_dir(path: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """An HF-format directory (config.json + model.safetensors, HF in-memory names) without transformers."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    write_json(path / "config.json", raw)
    save_file({(k if k.startswith("lm_head") else "model." + k): v.contiguous().cpu() for k, v in tensors.items()},
              str(path / "model.safetensors"))
    return path


class Runner:
    """A model with a small paged cache, for driving prefill and decode steps by hand in tests."""

    def __init__(self, cfg, weights, ops, tokens: int = 2048, seqs: int = 4, lookahead: int = 0):
        from deepinfer.runtime.cache import CacheSpec, PagedCache
        from deepinfer.model.model import DeepseekV4

        per_seq = -(-tokens // 128)
        self.model = DeepseekV4(cfg, weights, ops)
        spec = CacheSpec(num_blocks=seqs * per_seq, max_seqs=seqs, max_blocks_per_seq=per_seq, lookahead=lookahead)
        self.cache = PagedCache(cfg, spec, weights.embed.dtype, weights.embed.device)

    def new_seq(self):
        return self.cache.admit()

    def prefill(self, seq, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, device=self.model.device)
        n = ids.shape[0]
        assert self.cache.grow(seq, seq.num_tokens + n)
        pos = torch.arange(seq.num_tokens, seq.num_tokens + n, device=ids.device)
        return self.model.prefill(self.cache, ids, pos, [(seq, 0, n)])

    def decode(self, seqs, ids) -> torch.Tensor:
        from deepinfer.model.decode import DecodeInputs

        for s in seqs:
            assert self.cache.grow(s, s.num_tokens + 1)
        dev = self.model.device
        inp = DecodeInputs(
            ids=torch.as_tensor(ids, device=dev),
            positions=torch.tensor([s.num_tokens for s in seqs], device=dev),
            slots=torch.tensor([s.slot for s in seqs], device=dev),
            blocks=self.cache.block_table(seqs),
        )
        logits = self.model.decode(self.cache, inp)
        for s in seqs:
            s.num_tokens += 1
        return logits

# Odd widths: nothing a multiple of a kernel tile (hidden 48, head_dim 24, 6 heads, window 16, HCA rate 16,
# vocab 301, 6 experts); every layer type.
ODD_A: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=301, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
    head_dim=24, q_lora_rank=20, o_groups=2, o_lora_rank=12, n_routed_experts=6, num_experts_per_tok=2,
    moe_intermediate_size=18, index_n_heads=3, index_head_dim=12, index_topk=3, qk_rope_head_dim=8,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=16, num_hash_layers=1, rope_scaling=YARN, max_position_embeddings=4096,
)
# Odd widths again, other factors: hc_mult 3, 5 heads of 20, 5 experts (3 picked), sigmoid scoring, vocab 257.
ODD_B: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=257, hidden_size=40, num_hidden_layers=3, num_attention_heads=5,
    head_dim=20, q_lora_rank=28, o_groups=5, o_lora_rank=6, n_routed_experts=5, num_experts_per_tok=3,
    moe_intermediate_size=14, index_n_heads=5, index_head_dim=10, index_topk=5, qk_rope_head_dim=6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=12, hc_mult=3, num_hash_layers=1, scoring_func="sigmoid", rope_scaling=YARN,
    routed_scaling_factor=2.5, max_position_embeddings=4096,
)


def w8a8_reference():
    """The reference op table with the FP8 GEMMs' activation rounding emulated (`linear_fp8.emulated`, fp32
    math otherwise): what the kernels compute on a checkpoint whose FP8 projections stay quantized."""
    from tilekernels import reference_table
    from tilekernels.op import OpTable
    from tilekernels.ops import DECLARED, grouped_linear, linear, linear_fp8
    from tilekernels.quant import BlockQuantized

    table = reference_table()
    impls = {name: getattr(table, name) for name in DECLARED}

    def lin(x, w):
        if not isinstance(w, BlockQuantized):
            return linear.reference(x, w)
        return linear_fp8.emulated(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)

    def grouped(x, w):
        return linear_fp8.emulated(x, w, x.shape[1]) if isinstance(w, BlockQuantized) else grouped_linear.reference(x, w)

    impls.update(linear=lin, grouped_linear=grouped)
    return OpTable(impls, DECLARED)


def within_bound(op, got: torch.Tensor, args: tuple) -> torch.Tensor:
    """An indexer-scores op module's result against its reference and its per-score error bound
    (`op.error_bound`); returns the reference."""
    want = op.reference(*args)
    assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
    err = (got - want).abs()
    bound = op.error_bound(*args)
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, at the bound's {(err / bound).max().item():.3g}x"
    return want


def meta_copy(x):
    """Meta-device copies of the tensors in `x` (nested lists / tuples kept)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(meta_copy(v) for v in x)
    return x


def kernels_of(name: str, variant, rows: int) -> list[tuple]:
    """The (op, kernel, variant) items op `name` launches on its `example(variant, rows)` inputs (its `run`
    traced on meta copies of them, as the compile plan is); [] where the trace fails (the test builds them)."""
    from tilekernels.kernels import Recorder
    from tilekernels.ops import DECLARED

    recorder = Recorder()
    try:
        DECLARED[name].run(recorder.for_op(name), *meta_copy(DECLARED[name].example(variant, rows, "cpu")))
    except Exception:  # noqa: BLE001 - nothing built ahead: the kernels are built when the test runs them
        return []
    return list(recorder.seen)


def selected(request, param: str, *more: str) -> list:
    """The values of parameter `param` (tuples with `more`) of the tests of the requesting module selected to run
    that take them."""
    values = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and spec is not None and param in spec.params:
            if all(p in spec.params for p in more):
                values.append(tuple(spec.params[p] for p in (param, *more)) if more else spec.params[param])
    return values


def prebuild_c(cache: Path, items: list[tuple]) -> None:
    """Build `items` for the c target into `cache` in two worker processes (`codegen.driver.build_all`, the
    project's parallel build; lowering and the C compiler are single-threaded, CI has two cores), so that the
    tests running them load them built. A failed build is left for the test that runs the kernel to report."""
    import os

    from codegen.driver import build_all
    from tilekernels.kernels import request

    items = list(dict.fromkeys(items))
    jobs = max(1, min(2, os.cpu_count() or 1))
    if len(items) > 1 and jobs > 1:
        build_all("c", items, request, cache, jobs=jobs)

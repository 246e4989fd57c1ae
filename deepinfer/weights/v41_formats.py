"""Which DeepSeek-V4.1 checkpoint tensors are FP8 / FP4, by upstream name, from the config's
`quantization_config` (`{quant_method fp8, weight_block_size [32, 32], scale_fmt ue8m0, expert_dtype fp4}` in the
release). The reference `inference/model.py` (dba1be0) decides it: every `Linear` built without an explicit dtype
is FP8 (`wq_a`, `wq_b`, `wkv`, `wo_b`, the indexer's `wq_b`, the shared experts, the Engram `wkv`, the draft's
`main_proj`), plus `wo_a`, which the checkpoint stores FP8 and the reference's convert.py dequantizes; routed
experts are FP4 (1x32 blocks) when `expert_dtype` is fp4, else FP8. Stored in bf16: the compressors' `wkv` /
`wgate`, the indexer's `wk` / `weights_proj`, `ffn.gate.weight`, embeddings, heads, the draft's Markov and
confidence heads; norms, mHC, sinks and router biases are fp32. The Engram tables are FP8 with 1x32 blocks in
every V4.1 checkpoint (`TABLE_FORMAT`).

- `stored_format_v41`: the checkpoint's own layout (the test fixtures write it).
- `checkpoint_format_v41`: the format a tensor keeps after `load_v41(..., keep_quantized=True)`
  (`--quantization auto`): the stored one, except where the model cannot take a block-quantized weight and the
  loader dequantizes anyway: the Engram `wkv` (its projection runs in the weight's dtype), and FP8 routed experts
  (the expert kernels take FP4 only). What the kernel plan traces and benchmarks generate.
- `loaded_format_v41`: either load's (`keep_quantized` or not): what the plan's meta weights and the memory
  check count.
- `stored_bytes`: the bytes of a weight held in one of these formats (values and scales), from its shape alone.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError
from tilekernels.quant import FP4_BLOCK, grid

Format = tuple[str, tuple[int, int], bool]  # (fp8 | fp4, scale block (rows, columns), ue8m0 scales)

TABLE_FORMAT: Format = ("fp8", (1, 32), True)  # the Engram tables: one ue8m0 scale per row and 32 columns
FP8_BLOCK_V41 = (32, 32)
_FP8 = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|"
                  r"engram\.wkv|main_proj)\.weight$")
_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")
_DENSE_ANYWAY = re.compile(r"\.engram\.wkv\.weight$")  # read by the model as a plain tensor (its dtype)


def quantization_config(cfg_raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config's `quantization_config` (top level, or inside `text_config`), checked; None when it has none."""
    qc = cfg_raw.get("quantization_config") or (cfg_raw.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, Mapping):
        raise ConfigError(f"quantization_config is {qc!r}; expected an object such as {{quant_method fp8, "
                          f"weight_block_size [32, 32], scale_fmt ue8m0, expert_dtype fp4}}")
    method = qc.get("quant_method", "fp8")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported; accepted: 'fp8' "
                          f"(DeepSeek's FP8 block-scaled checkpoints)")
    block = qc.get("weight_block_size") or list(FP8_BLOCK_V41)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size {block!r} is not a pair of positive integers "
                          f"(rows, columns), e.g. [32, 32]")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ConfigError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported; accepted: 'ue8m0' or "
                          f"none (fp32 scales)")
    experts = qc.get("expert_dtype", cfg_raw.get("expert_dtype") or "fp4")
    if experts not in ("fp4", "fp8", None):
        raise ConfigError(f"quantization_config.expert_dtype {experts!r} is not supported; accepted: 'fp4', 'fp8'")
    return {**qc, "weight_block_size": tuple(block), "expert_dtype": experts or "fp8"}


def stored_format_v41(name: str, cfg: V41Config) -> Format | None:
    """(format, block, ue8m0) of upstream tensor `name` as a V4.1 checkpoint with `cfg`'s quantization_config
    stores it; None for a plain (bf16 / fp32) tensor or when the config declares no quantization (the Engram
    tables are FP8 in any case: `TABLE_FORMAT`)."""
    if _TABLE.match(name):
        return TABLE_FORMAT
    qc = quantization_config(cfg.raw)
    if qc is None:
        return None
    ue8m0 = qc.get("scale_fmt") == "ue8m0"
    fp8 = ("fp8", qc["weight_block_size"], ue8m0)
    if _FP8.match(name):
        return fp8
    if _EXPERT.match(name):
        return ("fp4", FP4_BLOCK, True) if qc["expert_dtype"] == "fp4" else fp8
    return None


def checkpoint_format_v41(name: str, cfg: V41Config) -> Format | None:
    """(format, block, ue8m0) of upstream tensor `name` once loaded with `--quantization auto`
    (`load_v41(keep_quantized=True)`): `stored_format_v41`, but None for the tensors the loader dequantizes
    anyway (the Engram `wkv`; FP8 routed experts). Same triple as `deepinfer.weights.quant.checkpoint_format`."""
    fmt = stored_format_v41(name, cfg)
    if fmt is None or _DENSE_ANYWAY.search(name) or (_EXPERT.match(name) and fmt[0] != "fp4"):
        return None
    return fmt


def loaded_format_v41(name: str, cfg: V41Config, keep_quantized: bool) -> Format | None:
    """(format, block, ue8m0) of upstream tensor `name` as `load_v41(keep_quantized=...)` hands it over, None for
    a plain tensor: `checkpoint_format_v41` with `keep_quantized`, else only the Engram tables (`TABLE_FORMAT`)."""
    if keep_quantized:
        return checkpoint_format_v41(name, cfg)
    return TABLE_FORMAT if _TABLE.match(name) else None


def stored_bytes(shape: Sequence[int], fmt: Format) -> int:
    """Bytes of a weight of logical `shape` [..., N, K] held in `fmt` (form, block, ue8m0) as `BlockQuantized`
    holds it: values one byte each (FP8) or two a byte (FP4: [..., N, K/2]), and one scale per block of each
    [N, K] matrix, an exponent byte (ue8m0) or fp32."""
    *lead, rows, cols = shape
    form, block, ue8m0 = fmt
    values = rows * (cols // 2 if form == "fp4" else cols)
    return math.prod(lead) * (values + math.prod(grid(rows, cols, block)) * (1 if ue8m0 else 4))

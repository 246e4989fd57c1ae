"""V4.1 Engram hashing against a fixture made by DeepSeek's reference `engram.py` (dba1be0) with
tools/v41_reference/make_engram_fixture.py: the token-class map of the V4 tokenizer (99,092 classes: the
count V4.1's config declares), the released layout's primes, offsets and multipliers, and the rows of two
sequences (a prefill, then decode steps; one with an image span) equal exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.model.engram_hash import DEAD, build, is_prime

FIXTURE = Path(__file__).parent / "fixtures" / "v41" / "engram.pt"


@pytest.fixture(scope="module")
def made():
    from tokenizers import Tokenizer

    from deepinfer.serving.recipe import default_tokenizer_path

    want = torch.load(FIXTURE)
    hasher = build((1, 14), 4, 8, 16000000, 2, Tokenizer.from_file(str(default_tokenizer_path())))
    return want, hasher


def test_class_map_layout_and_multipliers_equal_the_reference(made):
    want, hasher = made
    assert want["n_classes"] == 99092 and int(hasher.classes.max()) + 1 == 99092
    assert torch.equal(hasher.classes, want["token_map"].long())
    assert torch.equal(hasher.primes, want["primes"]) and torch.equal(hasher.offsets, want["offsets"])
    assert torch.equal(hasher.multipliers, want["multipliers"])
    assert all(is_prime(int(p)) for p in hasher.primes.flatten()) and len(set(hasher.primes.flatten().tolist())) == 48


def test_rows_equal_the_reference_prefill_and_decode(made):
    want, hasher = made
    ids, image = want["ids"], want["image"]
    n = hasher.multipliers.shape[1]
    classes = hasher.classes_of(ids, image)
    history = torch.cat([torch.full((ids.shape[0], n - 1), DEAD), classes], 1)  # before the start: nothing
    rows = hasher.hashes(history)
    assert torch.equal(rows, want["rows"])
    # one decode position at a time from its last max_ngram classes gives the same rows
    for pos in (40, 47, 51):
        assert torch.equal(hasher.hashes(history[:, pos: pos + n]), want["rows"][:, pos: pos + 1])
    assert torch.equal(rows[0, 8], rows[0, 3])  # the repeated 4-gram hashes alike
    assert (rows < torch.tensor(hasher.table_rows)[:, None]).all()

"""NGRAM trie seeding (rhyme_sglang.sglang_ext.ngram_seed): windows and input checks, no engine.
The engine side is tested in tests/sglang/test_spec_lossless.py."""

from __future__ import annotations

import pytest

from rhyme_sglang.sglang_ext import ngram_seed


def test_windows_end_at_every_response_token():
    tokens = [1, 2, 3, 4, 5, 6]
    assert ngram_seed.windows(tokens, prompt_len=3, depth=3) == [[2, 3, 4], [3, 4, 5], [4, 5, 6]]
    # a short prompt: the first windows are shorter than depth
    assert ngram_seed.windows([7, 8, 9], prompt_len=1, depth=4) == [[7, 8], [7, 8, 9]]
    assert ngram_seed.windows([7, 8], prompt_len=2, depth=4) == []  # no response, nothing
    with pytest.raises(ValueError, match="depth"):
        ngram_seed.windows(tokens, 3, depth=1)


def test_payload_and_checks_name_the_bad_item():
    assert ngram_seed.as_payload([((1, 2), [3])]) == [{"prompt": [1, 2], "response": [3]}]
    for bad in ([[1, 2, 3]], ["ab"], [{"prompt": [1], "response": [2]}]):
        with pytest.raises(ValueError, match="item 0"):
            ngram_seed.as_payload(bad)
    checks = [({"prompt": [1]}, "exactly"), ({"prompt": [1], "response": [-1]}, "response"),
              ({"prompt": [True], "response": [1]}, "prompt")]
    for item, words in checks:
        with pytest.raises(ValueError, match=words):
            ngram_seed._check_sequences([{"prompt": [0], "response": [0]}, item])
    with pytest.raises(ValueError, match="list"):
        ngram_seed._check_sequences({"prompt": [1]})


def test_seed_without_an_ngram_worker_says_so():
    ngram_seed._WORKER.clear()
    with pytest.raises(ValueError, match="NGRAM"):
        ngram_seed.seed([])

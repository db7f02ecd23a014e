"""Text as integer tokens: lossless, and nothing but integers leaves the lab."""

import numpy as np
import pytest

from goblin_dask.text import PAD, Tokenizer


CORPUS = ["The patient in ward 7 reported chest pain.", "Chest pain resolved; patient discharged.", "naïve café ☕"]


def test_round_trip_is_exact_for_seen_and_unseen_text():
    tok = Tokenizer.fit(CORPUS, vocab_size=300)
    for text in CORPUS + ["entirely unseen words, with ümlauts and 日本語", "", "  spaces\tand\nnewlines  "]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert tok.decode(ids) == text


def test_seen_words_are_single_tokens_and_batches_pad():
    tok = Tokenizer.fit(CORPUS, vocab_size=1000)
    assert len(tok.encode("patient")) == 1
    batch = tok.encode_batch(["chest pain", "patient"], bos=True, eos=True)
    assert batch.shape[0] == 2 and batch[1, -1] == PAD
    assert tok.decode_batch(batch)[0] == "chest pain"


def test_save_load_and_errors(tmp_path):
    tok = Tokenizer.fit(CORPUS, vocab_size=400)
    path = tok.save(tmp_path / "vocab.json")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = Tokenizer.load(path)
    assert again.decode(tok.encode(CORPUS[0])) == CORPUS[0]
    with pytest.raises(ValueError, match="outside this vocabulary"):
        tok.decode([tok.vocab_size + 5])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.fit(CORPUS, vocab_size=10)

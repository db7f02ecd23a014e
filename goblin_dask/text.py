"""Text travels as integer tokens: the lab keeps the vocabulary, volunteers see only ids.

A small, lossless tokenizer: words (and the spaces and punctuation between them) that
were seen when the vocabulary was fitted get one id each; anything else is spelled in
UTF-8 bytes, each byte an id of its own, so ``decode(encode(s)) == s`` for every string.
The vocabulary stays at the lab (``save`` it in the node's state directory); without it
a volunteer holds numbers only (which, as docs/concepts.md says, is not encryption).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

PAD, BOS, EOS = 0, 1, 2
_BYTE0 = 3  # ids 3..258 spell single bytes
_FIRST_PIECE = _BYTE0 + 256
_PIECES = re.compile(r"\w+|\s+|[^\w\s]", re.UNICODE)


class Tokenizer:
    def __init__(self, pieces: Sequence[str] = ()):
        self.pieces: list[str] = list(pieces)
        self._ids = {p: _FIRST_PIECE + i for i, p in enumerate(self.pieces)}

    @classmethod
    def fit(cls, texts: Iterable[str], vocab_size: int = 8192, min_count: int = 1) -> "Tokenizer":
        """A vocabulary of the most frequent pieces of ``texts`` (ids beyond the 259 fixed ones)."""
        if vocab_size <= _FIRST_PIECE:
            raise ValueError(f"vocab_size must exceed {_FIRST_PIECE} (the fixed ids)")
        counts = Counter(p for t in texts for p in _PIECES.findall(t))
        common = [p for p, c in counts.most_common(vocab_size - _FIRST_PIECE) if c >= min_count]
        return cls(sorted(common, key=lambda p: (-counts[p], p)))

    @property
    def vocab_size(self) -> int:
        return _FIRST_PIECE + len(self.pieces)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        ids = [BOS] if bos else []
        for piece in _PIECES.findall(text):
            known = self._ids.get(piece)
            if known is not None:
                ids.append(known)
            else:
                ids.extend(_BYTE0 + b for b in piece.encode("utf-8"))
        if eos:
            ids.append(EOS)
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str], length: int | None = None, **kw) -> np.ndarray:
        """A (len(texts), length) int32 array, right-padded with PAD (truncated past ``length``)."""
        rows = [self.encode(t, **kw) for t in texts]
        length = length if length is not None else max((len(r) for r in rows), default=0)
        out = np.full((len(rows), length), PAD, dtype=np.int32)
        for i, r in enumerate(rows):
            out[i, : min(len(r), length)] = r[:length]
        return out

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).ravel().tolist():
            if _BYTE0 <= i < _FIRST_PIECE:
                pending.append(i - _BYTE0)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i >= _FIRST_PIECE:
                if i - _FIRST_PIECE >= len(self.pieces):
                    raise ValueError(f"token id {i} is outside this vocabulary ({self.vocab_size} ids)")
                out.append(self.pieces[i - _FIRST_PIECE])
            elif i < 0:
                raise ValueError(f"negative token id {i}")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def decode_batch(self, rows: np.ndarray) -> list[str]:
        return [self.decode(r) for r in np.asarray(rows)]

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": "goblin-tokenizer-1", "pieces": self.pieces}, f)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        data = json.loads(Path(path).read_text())
        if data.get("format") != "goblin-tokenizer-1":
            raise ValueError(f"{path} is not a goblin tokenizer vocabulary")
        return cls(data["pieces"])

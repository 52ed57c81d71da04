"""Token streams and a deterministic batch sampler for training runs.

Sources:

* ``None`` / ``"stdlib"`` — bytes of the running Python's own standard-library ``*.py`` files: a
  real corpus on every machine, with no download, identical wherever the Python version is;
* a path ending in ``.bin`` — pre-tokenised uint16 tokens (nanoGPT's format), memory-mapped;
* a path ending in ``.npy`` — a 1-D NumPy array of integer tokens of any width (``np.save``; uint32
  for vocabularies past 65,536, as LLaMA 3's, Qwen's and Gemma's), memory-mapped;
* any other path — a text file, read as bytes (vocabulary 256).

:func:`batch` draws random windows from a generator keyed by (seed, step, index) alone, so a
micro-batch is the same whichever process draws it: a rank r running ``acc`` micro-batches per
step draws indices r*acc .. r*acc+acc-1, and a single-process reference draws all of them.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_MAX_BYTES = 8 * 2**20
VAL_FRACTION = 0.05
# Third-party packages live under the stdlib directory on some installs; they differ per machine.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class TokenSource:
    tokens: np.ndarray  # 1-D: uint8 (bytes), uint16 (.bin) or a .npy's integers; files memory-mapped
    vocab_size: int
    description: str

    @property
    def train(self) -> np.ndarray:
        return train_val_split(self.tokens)[0]

    @property
    def val(self) -> np.ndarray:
        return train_val_split(self.tokens)[1]


def train_val_split(tokens: np.ndarray,
                    val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) views: the last ``val_fraction`` of the stream is held out, unshuffled."""
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


def stdlib_corpus(max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[bytes, str]:
    """The stdlib's ``*.py`` files in relative-path order, each preceded by a header line.

    Returns (corpus, description); the description carries a digest so runs on different
    machines can confirm they train on the same bytes.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _NOT_STDLIB]  # prune, don't descend
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                files.append((path.relative_to(root).as_posix(), path))
    files.sort()
    parts: list[bytes] = []
    size = 0
    for rel, path in files:
        if max_bytes is not None and size >= max_bytes:
            break
        chunk = f"\n# ==== {rel} ====\n".encode() + path.read_bytes()
        parts.append(chunk)
        size += len(chunk)
    corpus = b"".join(parts)[:max_bytes]
    digest = hashlib.sha256(corpus).hexdigest()[:12]
    version = ".".join(map(str, sys.version_info[:3]))
    return corpus, (f"python {version} stdlib *.py ({len(parts)} files, {len(corpus)} bytes, "
                    f"sha256 {digest})")


def load_tokens(source: str | os.PathLike[str] | None = None,
                max_bytes: int | None = DEFAULT_MAX_BYTES,
                vocab_size: int | None = None) -> TokenSource:
    """Load a token stream (see the module docstring for ``source``).

    ``max_bytes`` caps the byte sources (stdlib, text); ``.bin`` and ``.npy`` files are mapped
    whole. ``vocab_size`` defaults to 256 for bytes and to max token + 1 for token files; a token
    at or above a given ``vocab_size`` is an error, since it would index past the embedding.
    """
    if source is None or str(source) == "stdlib":
        corpus, description = stdlib_corpus(max_bytes)
        tokens = np.frombuffer(corpus, dtype=np.uint8)
        default_vocab = 256
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        if path.suffix == ".bin":
            nbytes = path.stat().st_size
            if nbytes % 2:
                raise ValueError(f"{path}: {nbytes} bytes is not a whole number of uint16 tokens")
            if nbytes == 0:
                raise ValueError(f"{path} is empty")
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
            description = f"{path.name} (uint16 tokens, {len(tokens)} tokens)"
            default_vocab = None
        elif path.suffix == ".npy":
            tokens = _npy_tokens(path)
            description = f"{path.name} ({tokens.dtype} tokens, {len(tokens)} tokens)"
            default_vocab = None
        else:
            with path.open("rb") as f:
                corpus = f.read() if max_bytes is None else f.read(max_bytes)
            tokens = np.frombuffer(corpus, dtype=np.uint8)
            description = f"{path.name} ({len(tokens)} bytes)"
            default_vocab = 256
    if len(tokens) == 0:
        raise ValueError(f"{description}: no tokens")
    top = int(tokens.max())
    vocab = vocab_size or default_vocab or top + 1
    if top >= vocab:
        raise ValueError(f"{description}: token {top} does not fit vocab_size={vocab}")
    return TokenSource(tokens=tokens, vocab_size=vocab, description=description)


def _npy_tokens(path: Path) -> np.ndarray:
    """A .npy file's 1-D integer array, memory-mapped; ValueError naming what it holds otherwise."""
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # not a .npy, or an array of Python objects
        raise ValueError(f"{path}: not a NumPy array of integer tokens ({e}); write one with "
                         "np.save(path, np.asarray(tokens, dtype=np.uint32))") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise ValueError(f"{path}: a {tokens.ndim}-D array of {tokens.dtype}; token files hold one 1-D array of "
                         "integers (flatten it, or cast it with .astype(np.uint32))")
    if tokens.dtype.kind == "i" and len(tokens) and int(tokens.min()) < 0:
        raise ValueError(f"{path}: token {int(tokens.min())} is negative; tokens index the embedding from 0")
    return tokens


def batch(tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int, step: int,
          index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows as int64 (inputs, targets), each (batch_size, seq_len).

    Targets are the inputs shifted left by one token. The windows depend only on
    (seed, step, index) and the stream, never on what was drawn before.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens are too few for one window of seq_len+1="
                         f"{seq_len + 1}")
    rng = np.random.default_rng([seed, step, index])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    windows = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

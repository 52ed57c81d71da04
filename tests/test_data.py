"""Token sources and the (seed, step, index)-keyed batch sampler."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tawpipe.train.data import batch, load_tokens, train_val_split

rng = np.random.default_rng()


@pytest.fixture(scope="module")
def stdlib():
    return load_tokens(None, max_bytes=300_000)


def test_stdlib_corpus_is_bytes_of_python_source(stdlib):
    assert stdlib.tokens.dtype == np.uint8
    assert len(stdlib.tokens) == 300_000
    assert stdlib.vocab_size == 256
    text = stdlib.tokens.tobytes()
    assert text.startswith(b"\n# ==== ")
    assert b"def " in text and b"import " in text
    assert "stdlib" in stdlib.description and "sha256" in stdlib.description


def test_stdlib_corpus_files_are_sorted_stdlib_modules():
    text = load_tokens(None).tokens.tobytes()  # the default 8 MB cap
    names = re.findall(rb"\n# ==== (\S+\.py) ====\n", text)
    assert len(names) > 100 and names == sorted(names)
    assert b"json/__init__.py" in names
    assert not any(b"site-packages" in n or b"dist-packages" in n for n in names)


def test_stdlib_corpus_is_deterministic(stdlib):
    again = load_tokens("stdlib", max_bytes=300_000)
    assert np.array_equal(again.tokens, stdlib.tokens)
    assert again.description == stdlib.description
    longer = load_tokens(None, max_bytes=400_000)
    assert np.array_equal(longer.tokens[:300_000], stdlib.tokens)  # a cap is a prefix


def test_train_val_split_holds_out_the_tail(stdlib):
    train, val = stdlib.train, stdlib.val
    assert len(val) == int(0.05 * len(stdlib.tokens))
    assert np.array_equal(np.concatenate([train, val]), stdlib.tokens)
    a, b = train_val_split(np.arange(100), val_fraction=0.2)
    assert np.array_equal(b, np.arange(80, 100)) and np.array_equal(a, np.arange(80))


def test_batch_windows_are_contiguous_and_shifted():
    stream = np.arange(5000, dtype=np.uint16)  # each window must count up by one
    x, y = batch(stream, seq_len=33, batch_size=6, seed=int(rng.integers(1 << 30)), step=4,
                 index=2)
    assert x.shape == y.shape == (6, 33)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(6, 32, dtype=torch.int64))
    assert int(y.max()) < len(stream)


def test_batch_real_text_targets_are_next_tokens(stdlib):
    x, y = batch(stdlib.train, 64, 4, seed=1, step=0, index=0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and int(x.min()) >= 0


def test_batch_is_keyed_by_seed_step_index_only(stdlib):
    seed = int(rng.integers(1 << 30))
    draw = lambda step, index, s=seed: batch(stdlib.train, 48, 3, seed=s, step=step, index=index)
    # Drawing in any order, from any "rank", gives the same micro-batch.
    late_first = [draw(7, i) for i in reversed(range(4))][::-1]
    in_order = [draw(7, i) for i in range(4)]
    for (xa, ya), (xb, yb) in zip(late_first, in_order):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x0 = draw(7, 0)[0]
    for other in (draw(7, 1)[0], draw(8, 0)[0], draw(7, 0, seed + 1)[0]):
        assert not torch.equal(x0, other)
    # Rank r of 2 with 2 micro-batches each draws indices 2r, 2r+1; together: the global batch.
    acc = 2
    ranks = [torch.cat([draw(7, r * acc + i)[0] for i in range(acc)]) for r in range(2)]
    assert torch.equal(torch.cat(ranks), torch.cat([draw(7, i)[0] for i in range(2 * acc)]))


def test_batch_reaches_both_ends_of_the_stream():
    stream = np.arange(12, dtype=np.uint16)
    x, _ = batch(stream, seq_len=11, batch_size=4, seed=0, step=0, index=0)  # one window only
    assert torch.equal(x, torch.arange(11).expand(4, 11))
    starts = torch.cat([batch(stream, 10, 8, seed=0, step=s, index=0)[0][:, 0] for s in range(8)])
    assert set(starts.tolist()) == {0, 1}


def test_text_file_round_trip(tmp_path: Path):
    data = rng.integers(0, 256, size=3000, dtype=np.uint8).tobytes()
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    src = load_tokens(str(path))
    assert src.tokens.tobytes() == data
    assert src.vocab_size == 256 and "corpus.txt" in src.description
    assert load_tokens(path, max_bytes=1000).tokens.tobytes() == data[:1000]


def test_bin_round_trip(tmp_path: Path):
    toks = rng.integers(0, 50_000, size=4000, dtype=np.uint16)
    path = tmp_path / "train.bin"
    toks.tofile(path)
    src = load_tokens(str(path))
    assert isinstance(src.tokens, np.memmap) and src.tokens.dtype == np.uint16
    assert np.array_equal(src.tokens, toks)
    assert src.vocab_size == int(toks.max()) + 1
    assert load_tokens(path, vocab_size=50_257).vocab_size == 50_257
    x, y = batch(src.tokens, 16, 2, seed=3, step=1, index=0)
    assert int(x.max()) <= int(toks.max()) and torch.equal(x[:, 1:], y[:, :-1])


def test_npy_round_trip_with_tokens_past_uint16(tmp_path: Path):
    """A LLaMA-3-sized vocabulary needs 32-bit tokens: a .npy of any integer width is mapped, and
    its windows are the stream's."""
    for dtype, top in ((np.uint32, 128_256), (np.int64, 151_936), (np.uint16, 50_000)):
        toks = rng.integers(0, top, size=5000).astype(dtype)
        path = tmp_path / f"train-{np.dtype(dtype).name}.npy"
        np.save(path, toks)
        src = load_tokens(str(path))
        assert isinstance(src.tokens, np.memmap) and src.tokens.dtype == dtype
        assert src.vocab_size == int(toks.max()) + 1 and np.dtype(dtype).name in src.description
        x, y = batch(src.tokens, 32, 3, seed=5, step=2, index=1)
        starts = np.random.default_rng([5, 2, 1]).integers(0, len(toks) - 32, size=3)
        want = torch.from_numpy(np.stack([toks[s:s + 33] for s in starts]).astype(np.int64))
        assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
        assert int(x.max()) > 65_535 or dtype == np.uint16


def test_npy_files_that_are_not_token_streams_are_refused(tmp_path: Path):
    for name, array, message in (
            ("two.npy", np.zeros((3, 4), dtype=np.uint32), "a 2-D array of uint32; .*flatten it"),
            ("float.npy", np.ones(8, dtype=np.float32), "a 1-D array of float32; .*astype"),
            ("negative.npy", np.array([3, -2, 5], dtype=np.int32), "token -2 is negative"),
            ("objects.npy", np.array([1, "a"], dtype=object), "not a NumPy array of integer tokens")):
        np.save(tmp_path / name, array, allow_pickle=True)
        with pytest.raises(ValueError, match=message):
            load_tokens(str(tmp_path / name))
    (tmp_path / "text.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match="not a NumPy array of integer tokens"):
        load_tokens(str(tmp_path / "text.npy"))


def test_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokens(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(str(tmp_path / "empty.txt"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_tokens(str(tmp_path / "empty.bin"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a whole number of uint16"):
        load_tokens(str(tmp_path / "odd.bin"))
    np.array([1, 700, 3], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="token 700 does not fit vocab_size=700"):
        load_tokens(str(tmp_path / "big.bin"), vocab_size=700)
    assert load_tokens(str(tmp_path / "big.bin"), vocab_size=701).vocab_size == 701
    (tmp_path / "high.txt").write_bytes(bytes([10, 200, 30]))
    with pytest.raises(ValueError, match="token 200 does not fit vocab_size=128"):
        load_tokens(str(tmp_path / "high.txt"), vocab_size=128)
    short = np.arange(8, dtype=np.uint16)
    with pytest.raises(ValueError, match="too few"):
        batch(short, seq_len=8, batch_size=1, seed=0, step=0, index=0)
    with pytest.raises(ValueError, match="positive"):
        batch(short, seq_len=0, batch_size=1, seed=0, step=0, index=0)

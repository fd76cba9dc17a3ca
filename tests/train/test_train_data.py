"""Data: stdlib corpus with a fixed split, reproducible batches, user files, clear errors."""

import zlib

import pytest
import torch

from fp8pass.train.data import VAL_EVERY, load_text_data, stdlib_files


def test_stdlib_split_is_by_file_and_fixed():
    root, files = stdlib_files()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    d = load_text_data()
    val_files = [f for f in files if zlib.crc32(f.relative_to(root).as_posix().encode()) % VAL_EVERY == 0]
    assert d.val.numel() == sum(f.stat().st_size + 1 for f in val_files)
    assert d.train.numel() + d.val.numel() == sum(f.stat().st_size + 1 for f in files)
    assert load_text_data().fingerprint == d.fingerprint


def test_batches_depend_only_on_seed_and_step(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 40)
    d = load_text_data(tmp_path)
    x, y = d.batch("train", 4, 32, seed=1, step=7)
    x2, y2 = d.batch("train", 4, 32, seed=1, step=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])                       # targets are inputs shifted by one
    assert not torch.equal(x, d.batch("train", 4, 32, seed=1, step=8)[0])
    assert not torch.equal(x, d.batch("train", 4, 32, seed=2, step=7)[0])


def test_single_file_holds_out_its_tail(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(b"x" * 1000)
    d = load_text_data(f)
    assert (d.train.numel(), d.val.numel()) == (950, 51)     # 1000 bytes + the newline that ends a file


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_text_data(tmp_path / "missing")
    (tmp_path / "img.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="no text files"):
        load_text_data(tmp_path)
    (tmp_path / "t.txt").write_bytes(b"short")
    d = load_text_data(tmp_path / "t.txt")
    with pytest.raises(ValueError, match="fewer than seq_len"):
        d.batch("val", 1, 64, 0, 0)


def test_empty_and_too_short_data_get_one_line_each(tmp_path, capsys):
    """Issue 34: an empty --data file raised numpy's "both buffer length (0) and count (-1) must not be 0",
    one shorter than the sequence length a traceback at the first step; now one line and exit code 2."""
    from fp8pass.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError) as e:
        load_text_data(empty)
    assert str(e.value) == f"--data {empty}: no text in it (0 bytes); pass a file or folder with text"
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 99)  # + the newline: 100 bytes, 95 train, 5 validation
    d = load_text_data(short)
    with pytest.raises(ValueError) as e:
        d.check_fits(64)
    assert str(e.value) == (f"--data {short}: too little text for --seq-len 64 (train 95 bytes, validation 5 bytes; "
                            f"each split needs at least 65); pass at least ~1300 bytes of text or a shorter --seq-len")
    d.check_fits(4)  # both splits hold a 5-byte window
    for path, message in ((empty, "no text in it (0 bytes)"), (short, "too little text for --seq-len 128")):
        assert main(["train", "--data", str(path), "--out", str(tmp_path / "run"), "--no-plots"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --data {path}: ") and message in err and "Traceback" not in err
        assert not (tmp_path / "run").exists()  # nothing started

import json
import stat

import numpy as np
import pytest
import torch

from vigil.errors import SpecError
from vigil.identity import first_position
from vigil.spec import DataSpec
from vigil_common.settings import Settings
from vigil_trainer.data import (
    ByteTokenizer,
    batch,
    builtin_corpus_files,
    load_tokens,
    next_position,
)


def test_builtin_corpus_is_local_text():
    files = builtin_corpus_files()
    assert len(files) > 10 and all(f.is_file() for f in files)
    assert sum(f.stat().st_size for f in files) >= 1_000_000


def test_builtin_corpus_cache_is_built_once(tmp_path):
    first = load_tokens(DataSpec(), tmp_path, vocab_size=256, roots=[tmp_path])
    assert first.tokens.dtype == np.uint16 and len(first) > 1_000_000
    mtime = first.path.stat().st_mtime_ns
    again = load_tokens(DataSpec(), tmp_path, vocab_size=256, roots=[tmp_path])
    assert again.path == first.path and again.path.stat().st_mtime_ns == mtime
    assert isinstance(again.tokens, np.memmap)


def test_text_file_round_trips_through_bytes(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("héllo world")
    cache = load_tokens(DataSpec(path=str(src)), tmp_path / "cache", vocab_size=256, roots=[tmp_path])
    assert bytes(cache.tokens[:-1].astype(np.uint8)).decode() == "héllo world"
    assert cache.tokens[-1] == ByteTokenizer.eot


def test_jsonl_text_and_chat(tmp_path):
    src = tmp_path / "d.jsonl"
    rows = [
        {"text": "one"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cache = load_tokens(
        DataSpec(path=str(src), format="jsonl"), tmp_path / "c", vocab_size=256, roots=[tmp_path]
    )
    text = bytes(cache.tokens.astype(np.uint8)).decode()
    assert text == "one\x00<|user|>\nhi\n<|assistant|>\nyo\n\x00"


def test_bad_jsonl_names_file_and_line(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(SpecError, match=r"d\.jsonl:2"):
        load_tokens(DataSpec(path=str(src), format="jsonl"), tmp_path / "c", vocab_size=256, roots=[tmp_path])


def test_directory_of_text(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("bbb")
    (tmp_path / "docs" / "a.md").write_text("aaa")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\xff")
    cache = load_tokens(
        DataSpec(path=str(tmp_path / "docs")), tmp_path / "c", vocab_size=256, roots=[tmp_path]
    )
    assert bytes(cache.tokens.astype(np.uint8)) == b"aaa\x00bbb\x00"


def test_missing_path_and_small_vocab_name_the_field(tmp_path):
    with pytest.raises(SpecError, match=r"data\.path"):
        load_tokens(
            DataSpec(path=str(tmp_path / "nothing")), tmp_path / "c", vocab_size=256, roots=[tmp_path]
        )
    with pytest.raises(SpecError, match=r"model\.vocab_size"):
        load_tokens(DataSpec(), tmp_path / "c", vocab_size=100, roots=[tmp_path])


def test_tokenizer_file_needs_a_file(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(SpecError, match=r"data\.tokenizer"):
        load_tokens(
            DataSpec(tokenizer=str(tmp_path / "none.json")), tmp_path / "c", vocab_size=256, roots=[tmp_path]
        )


def test_batches_are_a_pure_function():
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(seed=1, data_position=7, rank=0, micro=0, micro_batch=4, seq_len=16)
    x1, y1 = batch(tokens, **kw)
    x2, y2 = batch(tokens, **kw)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (4, 16) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    for other in (dict(kw, rank=1), dict(kw, data_position=8), dict(kw, seed=2), dict(kw, micro=1)):
        assert not torch.equal(batch(tokens, **other)[0], x1)


def test_skip_windows():
    assert next_position(4, []) == 5
    assert next_position(4, [(5, 8)]) == 8
    assert next_position(4, [(5, 8), (8, 9)]) == 9
    assert first_position(5, [(5, 8)]) == 8
    assert first_position(0, []) == 0
    assert first_position(3, [(5, 8)]) == 3


def test_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    text = ["the quick brown fox jumps over the lazy dog"] * 50
    tok.train_from_iterator(text, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    src = tmp_path / "a.txt"
    src.write_text("the lazy fox")
    spec = DataSpec(path=str(src), tokenizer=str(path))
    cache = load_tokens(spec, tmp_path / "c", vocab_size=512, roots=[tmp_path])
    ids = [int(t) for t in cache.tokens]
    assert ids[:-1] == tok.encode("the lazy fox").ids
    assert ids[-1] == tok.token_to_id("<|endoftext|>")
    with pytest.raises(SpecError, match=r"model\.vocab_size"):
        load_tokens(spec, tmp_path / "c", vocab_size=8, roots=[tmp_path])


# --- confinement: a spec reads only under its allowed roots ---------------------------------------------


@pytest.mark.parametrize("outside", ["/etc/passwd", "/proc/self/environ", "../outside.txt"])
def test_a_data_path_outside_the_roots_is_refused(tmp_path, outside):
    root = tmp_path / "data"
    root.mkdir()
    (tmp_path / "outside.txt").write_text("secret " * 100)
    with pytest.raises(SpecError, match="outside the allowed roots") as info:
        load_tokens(DataSpec(path=outside), tmp_path / "c", vocab_size=256, roots=[root])
    assert info.value.errors[0]["field"] == "data.path"
    assert not list((tmp_path / "c").glob("*.bin"))


@pytest.mark.parametrize("secret", ["credentials.json", "api_token", "../credentials.json"])
def test_the_default_data_root_holds_none_of_the_data_dirs_secrets(tmp_path, secret):
    """The probe trained on `data.path: credentials.json` and left the passwords in the token cache."""
    settings = Settings.load(data_dir=tmp_path)
    (tmp_path / "credentials.json").write_text('{"postgres": "secret"}' * 50)
    (tmp_path / "api_token").write_text("t" * 64)
    assert settings.allowed_data_roots == [(tmp_path / "datasets").resolve()]
    with pytest.raises(SpecError) as info:
        load_tokens(DataSpec(path=secret), tmp_path / "c", vocab_size=256, roots=settings.allowed_data_roots)
    assert info.value.errors[0]["field"] == "data.path"
    assert not list((tmp_path / "c").glob("*.bin"))


def test_symlinks_out_of_the_roots_are_refused(tmp_path):
    root, secret = tmp_path / "data", tmp_path / "secret"
    (root / "docs").mkdir(parents=True)
    secret.mkdir()
    (secret / "shadow.txt").write_text("root:x:0:0 " * 100)
    (root / "link.txt").symlink_to(secret / "shadow.txt")
    (root / "docs" / "a.txt").write_text("fine " * 100)
    (root / "docs" / "b.txt").symlink_to(secret / "shadow.txt")
    for path in (root / "link.txt", root / "docs"):
        with pytest.raises(SpecError, match="outside the allowed roots"):
            load_tokens(DataSpec(path=str(path)), tmp_path / "c", vocab_size=256, roots=[root])
    with pytest.raises(SpecError, match="outside the allowed roots") as info:
        load_tokens(DataSpec(tokenizer=str(root / "link.txt")), tmp_path / "c", vocab_size=256, roots=[root])
    assert info.value.errors[0]["field"] == "data.tokenizer"


def test_a_relative_data_path_is_taken_from_the_first_root_and_the_cache_is_private(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "corpus.txt").write_text("hello world " * 200)
    cache = load_tokens(DataSpec(path="corpus.txt"), tmp_path / "c", vocab_size=256, roots=[root])
    assert len(cache) > 0
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700
    for f in (tmp_path / "c").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_split_micro_batch_reads_the_same_rows():
    """After an out-of-memory a micro-step runs as two halves: together they are the whole batch."""
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(seed=1, data_position=7, rank=1, micro=2, micro_batch=4, seq_len=16)
    x, y = batch(tokens, **kw)
    halves = [batch(tokens, **kw, part=p, parts=2) for p in (0, 1)]
    assert all(h[0].shape == (2, 16) for h in halves)
    assert torch.equal(torch.cat([h[0] for h in halves]), x)
    assert torch.equal(torch.cat([h[1] for h in halves]), y)
    with pytest.raises(ValueError, match="part 0 of 3"):
        batch(tokens, **kw, part=0, parts=3)

"""The training recipe of the built-in model, run at a tiny size: the split of the standard
library's files, the token windows, and a few optimizer steps that must lower the loss and
leave a folder that pagedkv and transformers both load."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedkv.models import load_model
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.models.builtin.train.recipe import Recipe, learning_rate, packed_windows, train
from pagedkv.models.builtin.train.windows import document_windows, scored_tokens
from pagedkv.tokenizer import load_tokenizer
from pagedkv.tokenizer.bpe import BOS_ID, EOS_ID

from ..paging import PagedBatch

TINY = Recipe(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    context=32,
    batch_size=8,
    steps=40,
    learning_rate=1e-2,
    warmup_steps=4,
    max_train_chars=150_000,
    max_heldout_chars=10_000,
)


def _touch(root, relpath, text="x = 1\n"):
    file = root / relpath
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def test_file_selection_is_sorted_and_skips_tests_and_data(tmp_path):
    for rel in ["b.py", "a.py", "pkg/z.py", "pkg/__init__.py", "notes.txt"]:
        _touch(tmp_path, rel)
    for rel in ["test/test_a.py", "pkg/tests/t.py", "encodings/cp1252.py", "site-packages/x/y.py"]:
        _touch(tmp_path, rel)
    _touch(tmp_path, "config-3.11-x86_64-linux-gnu/python-config.py")
    assert stdlib_text.source_files(tmp_path) == ["a.py", "b.py", "pkg/__init__.py", "pkg/z.py"]


def test_split_depends_on_each_files_own_path_only(tmp_path):
    names = [f"m{i}.py" for i in range(60)]
    for rel in names:
        _touch(tmp_path / "full", rel)
    for rel in names[::3]:
        _touch(tmp_path / "partial", rel)
    train_files, heldout = stdlib_text.split_files(tmp_path / "full")
    assert sorted(train_files + heldout) == sorted(names) and not set(train_files) & set(heldout)
    assert 0 < len(heldout) < len(names) / 3  # about one in HELD_OUT_EVERY
    _, heldout_partial = stdlib_text.split_files(tmp_path / "partial")
    assert heldout_partial == [f for f in heldout if f in names[::3]]


def test_the_real_stdlib_splits_about_one_file_in_ten():
    train_files, heldout = stdlib_text.split_files()
    assert len(train_files) > 100
    assert 0.05 < len(heldout) / (len(train_files) + len(heldout)) < 0.15


def test_read_sources_stops_at_whole_files(tmp_path):
    for rel, text in [("a.py", "a" * 10), ("b.py", "b" * 10), ("c.py", "c" * 10)]:
        _touch(tmp_path, rel, text)
    assert stdlib_text.read_sources(["a.py", "b.py", "c.py"], tmp_path, max_chars=25) == ["a" * 10, "b" * 10]
    assert stdlib_text.read_sources(["a.py"], tmp_path, max_chars=3) == ["a" * 10]  # never empty


def test_windows_keep_documents_apart_and_score_all_but_the_first_token():
    docs = [[BOS_ID, 5, 6, 7, 8, EOS_ID], [BOS_ID, 9, EOS_ID], [BOS_ID, EOS_ID]]
    windows = document_windows(docs, context=4)
    # the second piece of the first document (two tokens) stays; nothing crosses documents
    assert windows == [[BOS_ID, 5, 6, 7], [8, EOS_ID], [BOS_ID, 9, EOS_ID], [BOS_ID, EOS_ID]]
    assert scored_tokens(windows) == 3 + 1 + 2 + 1
    # a last piece of one token has nothing to score: dropped
    assert document_windows([[BOS_ID, 5, 6, 7, EOS_ID]], context=4) == [[BOS_ID, 5, 6, 7]]
    packed = packed_windows(docs, context=4)
    assert packed.tolist() == [[BOS_ID, 5, 6, 7], [8, EOS_ID, BOS_ID, 9]]


def test_learning_rate_warms_up_then_decays_to_its_floor():
    rates = [learning_rate(TINY, s) for s in range(TINY.steps + 1)]
    peak = TINY.warmup_steps - 1
    assert rates[:peak] == sorted(rates[:peak]) and rates[peak] == pytest.approx(TINY.learning_rate)
    assert rates[peak:] == sorted(rates[peak:], reverse=True)
    assert rates[-1] == pytest.approx(TINY.learning_rate * TINY.final_lr_fraction)


@pytest.fixture(scope="module")
def one_thread():
    """Matrices this small gain nothing from a second thread; on a busy machine its barriers
    cost more than the work."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("tiny-model")
    torch.manual_seed(123)  # the recipe must not depend on the caller's RNG state
    return out, train(TINY, out, progress=False)


def test_a_few_steps_lower_the_loss_and_write_a_checkpoint(tiny_run):
    out, manifest = tiny_run
    losses = manifest["loss_every_10_steps"]
    assert losses[-1] < losses[0] - 0.5
    assert json.loads((out / "training.json").read_text()) == manifest
    results = manifest["results"]
    assert results["heldout_perplexity"] < TINY.vocab_size  # better than chance already
    assert manifest["text"]["heldout_files"] and all(
        stdlib_text.is_held_out(f) for f in manifest["text"]["heldout_files"]
    )


def test_the_checkpoint_loads_in_pagedkv_and_transformers_alike(tiny_run):
    out, _ = tiny_run
    ours = load_model(out, dtype=torch.float32, attention_backend="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = load_tokenizer(out).encode("def f(x):\n    return x + 1\n")
    got = PagedBatch(ours, max_len=len(ids), num_seqs=1).step([ids])[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() < 1e-4


def test_training_is_seeded(tiny_run, one_thread, tmp_path):
    """Same recipe, same machine: the same weights, bit for bit."""
    out, _ = tiny_run
    torch.manual_seed(7)
    train(TINY, tmp_path, progress=False)
    assert (tmp_path / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (tmp_path / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()

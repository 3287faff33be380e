"""The shipped models: each registered name has a complete folder that the package data ships,
nothing is shipped unregistered, a bad name is refused by name, and the documented retrain
command runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.models import builtin
from pagedkv.models.builtin import (
    BUILTIN_MODEL,
    BUILTIN_NOTE,
    CHECKPOINTS_DIR,
    SHIPPED_MODELS,
    builtin_model_path,
    shipped_model_path,
)

REPO = Path(__file__).resolve().parents[3]
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}


def test_every_registered_model_has_a_complete_folder_and_nothing_else_ships():
    folders = {p.name for p in CHECKPOINTS_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(SHIPPED_MODELS)
    for name in SHIPPED_MODELS:
        path = shipped_model_path(name)
        assert path == CHECKPOINTS_DIR / name
        assert HF_FILES <= {p.name for p in path.iterdir()}
    assert builtin_model_path() == shipped_model_path(BUILTIN_MODEL)
    assert BUILTIN_NOTE == SHIPPED_MODELS[BUILTIN_MODEL]


def test_the_package_data_glob_ships_every_file_of_every_folder():
    """pyproject ships ``checkpoints/*/*``: a folder nested inside a model's folder would be left
    out of the wheel."""
    assert '"pagedkv.models.builtin" = ["checkpoints/*/*"]' in (REPO / "pyproject.toml").read_text()
    for name in SHIPPED_MODELS:
        assert all(p.is_file() for p in (CHECKPOINTS_DIR / name).iterdir())


@pytest.mark.parametrize("name", ["nope", "../stdlib-llama", "", "checkpoints"])
def test_an_unknown_name_is_refused_with_the_shipped_names(name):
    with pytest.raises(ValueError, match=f"no shipped model named {name!r}.*{BUILTIN_MODEL}"):
        shipped_model_path(name)


def test_missing_weights_say_how_to_get_them_back(tmp_path, monkeypatch):
    (tmp_path / BUILTIN_MODEL).mkdir()
    monkeypatch.setattr(builtin, "CHECKPOINTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="reinstall pagedkv.*python -m pagedkv.models.builtin.train"):
        builtin_model_path()


def test_the_documented_retrain_command_runs():
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv.models.builtin.train", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "python -m pagedkv.models.builtin.train" in done.stdout and "--out" in done.stdout

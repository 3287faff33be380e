"""The kernels library: built once into the cache, loaded with every signature, and one clear
reason (and a working engine on torch) where it cannot be built."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from pagedkv import LLM, SamplingParams, cbuild
from pagedkv.kernels import library
from pagedkv.kernels.library import KernelLibrary
from pagedkv.kernels.signatures import SIGNATURES
from tests.checkpoints import make_checkpoint

from .no_compiler import run_without_compiler


def test_the_library_builds_into_the_cache_dir_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path))
    path = library.build()
    assert path.parent == tmp_path and path.exists()
    assert library.build() == path  # same sources, header, flags and CPU: the cached build
    assert list(tmp_path.iterdir()) == [path]  # and no object or temporary file is left behind
    built = KernelLibrary(path)
    assert all(built.entry(name) is not None for name in SIGNATURES)  # float16 too, with GCC >= 12


def test_the_header_is_part_of_the_cache_key(tmp_path, monkeypatch):
    """A library built from an edited header is another file: a stale build is never loaded."""
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "cache"))
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "one.c").write_text('#include "one.h"\nint64_t one(void) { return ONE; }\n')
    (csrc / "one.h").write_text("#include <stdint.h>\n#define ONE 1\n")
    first = cbuild.build_library("one", [csrc / "one.c"])
    (csrc / "one.h").write_text("#include <stdint.h>\n#define ONE 2\n")
    second = cbuild.build_library("one", [csrc / "one.c"])
    assert first != second
    assert [ctypes.CDLL(str(path)).one() for path in (first, second)] == [1, 2]


def test_every_file_beside_the_sources_ships_and_keys_the_build():
    """Everything in ``csrc/`` is a source (``*.c``, compiled) or a header (``*.h``, which
    :func:`pagedkv.cbuild.build_library` hashes into the library's key), the package data ships
    both, and every header a file names is there: a body or instruction-set file of another kind
    would be missing from an installed package, or leave a stale build in the cache when edited."""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    shipped = re.search(r'^"pagedkv\.kernels" = \[(.*)\]$', pyproject, re.M).group(1)
    patterns = re.findall(r'"([^"]+)"', shipped)
    files = sorted(library.CSRC.iterdir())
    assert {path.suffix for path in files} == {".c", ".h"}
    for path in files:
        assert any(path.relative_to(library.CSRC.parent).match(pattern) for pattern in patterns), path
    named = {name for path in files for name in re.findall(r'"(\w+\.h)"', path.read_text())}
    assert named and named <= {path.name for path in files}


def test_the_process_loads_one_library_with_its_signatures():
    lib = library.load()
    assert library.why_unavailable() is None and library.load() is lib
    assert lib.entry("rms_norm_f32").argtypes == SIGNATURES["rms_norm_f32"].arguments
    assert lib.entry("no_such_kernel") is None


SCRIPT = """
import torch
from pagedkv import LLM, SamplingParams
from pagedkv.kernels import library, tiled_gemm
from pagedkv.kernels.library import KernelsUnavailable

reason = "no C compiler found: install gcc or clang, or set $CC"
assert library.why_unavailable() == reason, library.why_unavailable()
try:
    library.load()
except KernelsUnavailable as exc:
    assert str(exc) == reason
else:
    raise AssertionError("the library loaded without a compiler")
assert tiled_gemm.why_unavailable(torch.float32) == reason
llm = LLM(model={model!r}, dtype="float32")
runtime = llm.engine.executor.runtime
assert runtime["linear"].startswith("oneDNN packed"), runtime
assert runtime["decode layers"] == f"step program ({{reason}})", runtime
outputs = llm.generate([[5, 6, 7], [9]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
print([o.outputs[0].token_ids for o in outputs])
"""


def test_without_a_compiler_the_engine_says_why_and_runs_on_torch(tmp_path):
    """One reason, the same from every kernel, and the same greedy tokens on torch and oneDNN."""
    model = make_checkpoint(tmp_path, "llama")
    done = run_without_compiler(SCRIPT.format(model=str(model)), tmp_path)
    assert "no C compiler found" in done.stderr  # the attention backend and the layer ops say so
    llm = LLM(model=str(model), dtype="float32")
    assert llm.engine.executor.runtime["decode layers"] == "C stack"
    outputs = llm.generate([[5, 6, 7], [9]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert done.stdout.strip() == str([o.outputs[0].token_ids for o in outputs])

"""Turning the second KV tier on: vLLM's flags, and the configurations refused at start-up.

A tier that cannot be had -- larger than the host memory available or the folder's free space,
in a folder that cannot be written, without a size -- is refused before the model is loaded,
with the figures to change; so is a combination the engine does not run.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM
from pagedkv.cli import build_parser, main
from pagedkv.cli_args import engine_options

#: The built-in model on a small pool: a refusal must come before anything is allocated anyway.
BASE = {"num_kv_blocks": 64}


def _options(*flags: str) -> dict:
    args = build_parser().parse_args(["serve", *flags])
    return {k: v for k, v in engine_options(args).items() if k.startswith(("kv_offload", "preemption"))}


def test_vllms_flags_turn_the_tier_on():
    assert _options() == {
        "kv_offload": None,
        "kv_offload_memory": None,
        "kv_offload_dir": None,
        "preemption_mode": None,
    }
    # a bare number is GiB, as in vLLM; the native backend is the default once a size is given
    host = _options("--kv-offloading-size", "8")
    assert host["kv_offload"] == "host" and host["kv_offload_memory"] == 8 * 2**30
    native = _options("--kv-offloading-backend", "native", "--kv-offloading-size", "512MiB")
    assert native["kv_offload"] == "host" and native["kv_offload_memory"] == 512 * 2**20
    disk = _options(
        "--kv-offloading-size", "2GiB", "--kv-offload-dir", "/tmp/kv", "--preemption-mode", "swap"
    )
    assert disk == {
        "kv_offload": "disk",
        "kv_offload_memory": 2 * 2**30,
        "kv_offload_dir": "/tmp/kv",
        "preemption_mode": "swap",
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_offload": "host", "kv_offload_memory": "100TiB"}, "more than the host memory available"),
        ({"kv_offload": "host"}, "needs a size: --kv-offloading-size"),
        ({"kv_offload": "ram", "kv_offload_memory": "1GiB"}, "kv_offload must be one of"),
        ({"kv_offload": "host", "kv_offload_memory": 100}, "holds no KV block"),
        ({"kv_offload": "disk", "kv_offload_memory": "1GiB"}, "needs a folder (--kv-offload-dir)"),
        (
            {"kv_offload": "host", "kv_offload_memory": "1GiB", "kv_offload_dir": "/tmp"},
            "--kv-offload-dir is the disk tier's folder",
        ),
        ({"preemption_mode": "swap"}, "needs a second KV tier"),
        ({"preemption_mode": "pause"}, "preemption_mode must be one of"),
        (
            {
                "kv_offload": "disk",
                "kv_offload_memory": "1GiB",
                "kv_offload_dir": "/tmp",
                "tensor_parallel_size": 2,
            },
            "the disk KV tier runs on one rank",
        ),
    ],
)
def test_a_tier_the_engine_cannot_have_is_refused(options, message):
    with pytest.raises(ValueError) as refused:
        LLM(**BASE, **options)
    assert message in str(refused.value)


def test_a_disk_tier_larger_than_its_folder_or_unwritable_is_refused(tmp_path):
    with pytest.raises(ValueError, match="more than the disk tier can take in"):
        LLM(**BASE, kv_offload="disk", kv_offload_memory="100TiB", kv_offload_dir=tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="is not a writable folder"):
        LLM(**BASE, kv_offload="disk", kv_offload_memory="1MiB", kv_offload_dir=blocker / "kv")


def test_the_command_line_reports_a_refusal_as_a_usage_error(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    flags = ["--kv-offloading-size", "1MiB", "--kv-offload-dir", str(blocker / "kv"), "--num-kv-blocks", "64"]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"--kv-offload-dir {blocker / 'kv'} is not a writable folder" in error

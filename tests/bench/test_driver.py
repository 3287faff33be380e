"""The bench driver: a configuration's fields are its flags and its checks, one message for both,
and building the command line loads neither torch nor matplotlib."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from pagedkv.bench.driver import Bench, EngineOptions, add_bench, check_options, config_from, option


@dataclass(frozen=True)
class ToyConfig:
    names: tuple[str, ...] = option(("a", "b"), "which", choices=("a", "b", "c"))
    sizes: tuple[int, ...] = option((1, 2), "how big", positive=True)
    rate: float = option(1.5, "how fast", positive=True)
    mode: str = option("x", "how", choices=("x", "y"))
    limit: int | None = option(None, "at most (default: none)", positive=True, type=int)
    quick: bool = option(False, "hurry")
    plotted: bool = option(True, "no figures", flag="--no-figures")
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class ToyResult:
    config: ToyConfig

    ok = True

    def to_json(self) -> dict:
        return {"names": self.config.names, "threads": self.config.engine.threads}


TOY = Bench(
    "toy", "a toy\n\nIt runs nothing.", ToyConfig, ToyResult, lambda result, console: None, None, ("threads",)
)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"names": ("a", "d")}, "names must be a non-empty subset of ('a', 'b', 'c'), got ('a', 'd')"),
        ({"names": ()}, "names must be a non-empty subset"),
        ({"sizes": (1, 0)}, "sizes must be a non-empty list of positive integers, got (1, 0)"),
        ({"sizes": (1.5,)}, "sizes must be a non-empty list of positive integers"),
        ({"rate": 0.0}, "rate must be a positive number, got 0.0"),
        ({"mode": "z"}, "mode must be one of ('x', 'y'), got 'z'"),
        ({"limit": 0}, "limit must be a positive integer, got 0"),
    ],
)
def test_a_value_its_option_does_not_allow_is_refused_by_name(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ToyConfig(**values)
    assert ToyConfig(limit=None, rate=float("inf")).rate == float("inf")  # None: no limit


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedkv bench")
    add_bench(parser.add_subparsers(dest="bench", required=True), TOY)
    return parser.parse_args(["toy", *argv])


def test_every_option_is_a_flag_and_lists_come_back_as_tuples(tmp_path, capsys):
    args = _parse(["--names", "b", "a", "b", "--sizes", "3", "4", "--quick", "--no-figures"])
    assert (args.names, args.sizes, args.quick, args.plotted, args.limit) == (
        ["b", "a", "b"],
        [3, 4],
        True,
        False,
        None,
    )
    args = _parse(["--names", "c", "--threads", "2", "--out", str(tmp_path), "--json"])
    assert args.run(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["names"] == ["c"] and document["threads"] == 2  # --threads reached the engine options
    assert json.loads((tmp_path / "toy.json").read_text()) == document
    assert 0 <= document["machine"]["other_cpu_share"] <= 1  # what else the machine did meanwhile
    args = _parse(["--out", str(tmp_path)])
    assert args.run(args) == 0
    assert "other work on this machine meanwhile" in capsys.readouterr().out  # the report's last line


def test_a_choice_list_loses_its_duplicates_and_a_bad_value_is_a_usage_error(capsys, tmp_path):
    assert config_from(ToyConfig, _parse(["--names", "b", "a", "b"])).names == ("b", "a")
    args = _parse(["--sizes", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        args.run(args)
    assert exit_info.value.code == 2
    assert "sizes must be a non-empty list of positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--mode", "z"])  # a choice is checked by argparse itself


def test_the_command_line_loads_neither_torch_nor_matplotlib():
    code = "import sys, pagedkv.cli; pagedkv.cli.build_parser(); "
    code += "print(sorted({'torch', 'matplotlib'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr

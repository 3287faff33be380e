"""Command-line pieces shared by every subcommand: registering a command and the engine's options
(argument types, registering a subcommand and reading a dataclass from the parsed options are
in :mod:`pagedkv.cli_parsing`; how a measuring command shows its report is
:mod:`pagedkv.cli_report`).

Engine options are declared once, in :data:`pagedkv.cli_options.ENGINE_OPTIONS`, with their defaults read from
:class:`~pagedkv.engine.config.EngineConfig` (the request limits' from its ``limits``, a
:class:`~pagedkv.engine.validation.RequestLimits`, the structured output settings' from its
``structured_outputs_config``); a command takes all of them or the few it lets
users change (a benchmark fixes the rest), and may give a default of its own where it must
differ (the capacity benchmark lets the KV pool, not the sequence budget, limit admission).

Nothing here imports torch or FastAPI, so building the parser (and ``pagedkv --help``) stays
fast; the engine is imported only when a command builds one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

from pagedkv.cli_options import ENGINE_GROUP, ENGINE_OPTIONS, LIMITS_GROUP, STRUCTURED_GROUP
from pagedkv.cli_parsing import (
    usage_errors,
)
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.engine.validation import RequestLimits


def add_engine_options(
    parser: argparse.ArgumentParser, only: Iterable[str] | None = None, **defaults: Any
) -> None:
    """Add the engine options named in ``only`` (default: all) to ``parser``; ``defaults``
    overrides EngineConfig's default of a field."""
    chosen = ENGINE_OPTIONS if only is None else [o for o in ENGINE_OPTIONS if o.field in set(only)]
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in chosen:
        title = (
            LIMITS_GROUP if option.is_limit else STRUCTURED_GROUP if option.is_structured else ENGINE_GROUP
        )
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        option.add_to(group, defaults.get(option.field, option.default))


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The engine's ``RequestLimits``: its defaults, with the limits given on the command line."""
    given = {o.field: getattr(args, o.field) for o in ENGINE_OPTIONS if o.is_limit and hasattr(args, o.field)}
    return RequestLimits(**given)


def structured_outputs_config(args: argparse.Namespace) -> StructuredOutputsConfig:
    """The engine's ``StructuredOutputsConfig``: its defaults, with the options given."""
    given = {
        o.field: getattr(args, o.dest) for o in ENGINE_OPTIONS if o.is_structured and hasattr(args, o.dest)
    }
    return StructuredOutputsConfig(**given)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields among the parsed options (the request limits as ``limits``, the
    structured output options as ``structured_outputs_config``)."""
    fields = {
        o.field: getattr(args, o.field)
        for o in ENGINE_OPTIONS
        if not (o.is_limit or o.is_structured) and hasattr(args, o.field)
    }
    return (
        fields
        | offload_kind(fields)
        | {
            "limits": request_limits(args),
            "structured_outputs_config": structured_outputs_config(args),
        }
    )


def offload_kind(fields: dict[str, Any]) -> dict[str, Any]:
    """vLLM's offloading flags as ``kv_offload``: a size, the (only) backend or a folder turns
    the second tier on -- on disk with a folder, else in host RAM -- and the size must be
    given (the engine says so otherwise)."""
    chosen = ("kv_offload", "kv_offload_memory", "kv_offload_dir")
    if not any(fields.get(name) is not None for name in chosen):
        return {}
    return {"kv_offload": "host" if fields.get("kv_offload_dir") is None else "disk"}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config. On a machine that holds tensor-parallel ranks but not rank 0
    (``--node-rank`` > 0, or a torchrun process whose RANK is not 0) this runs those ranks
    until rank 0 stops them and exits: such a machine serves nothing."""
    with usage_errors(args):
        config = EngineConfig(**engine_options(args))
        settings = config.resolve()
    if settings.parallel.tensor_parallel_size > 1:
        from pagedkv.engine.worker.executor.node import is_worker_node, run_worker_node

        with usage_errors(args):
            worker_node = is_worker_node(settings)
        if worker_node:
            sys.exit(run_worker_node(settings))
    return config


def build_engine(args: argparse.Namespace):
    """The engine of the parsed options, with the built-in model's note on stderr; a bad option
    exits with status 2 through ``args.parser.error``."""
    from pagedkv.engine import LLMEngine
    from pagedkv.models import BUILTIN_NOTE

    try:
        engine = LLMEngine(engine_config(args))
    except (ValueError, FileNotFoundError) as err:
        args.parser.error(str(err))
    if engine.is_builtin:
        print(f"note: {BUILTIN_NOTE}", file=sys.stderr)
    print(f"engine: {engine.describe()}", file=sys.stderr)
    print(engine.kv_sizing.describe(), file=sys.stderr)
    return engine

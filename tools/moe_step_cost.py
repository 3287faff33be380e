"""What a mixture of experts costs per decode step, against dense models of its active and total size.

    .venv/bin/python tools/moe_step_cost.py [--batch 1 8 32] [--hidden 512] [--experts 8]
        [--top-k 2] [--expert-size 1408] [--layers 4] [--context 128] [--threads 1] [--repeats 20]

Three random-weight models (``load_format="dummy"``) of one shape but their MLPs: a Mixtral of
``--experts`` experts of ``--expert-size`` rows, ``--top-k`` per token; a Llama whose MLP has
``top_k * expert_size`` rows (the "active" size: what one token computes); and a Llama of
``experts * expert_size`` rows (the "total" size: what a step reads when every expert is chosen).
For each batch size ``--batch`` sequences hold ``--context`` tokens of KV and one decode step
(one generated row each) runs ``--repeats`` times; printed: the median ``executor.execute`` time
per model and its tokens/s. The dense models run their decode steps on the C stack, the MoE on
the step program; ``active/program`` is the active-size Llama forced onto the step program, the
like-for-like runtime. Timings move with the machine's load: compare rows taken in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from pathlib import Path

import torch

from pagedkv import LLM
from pagedkv.engine.core.plan import StepPlan
from pagedkv.models.builtin.random_model import write_tokenizer
from tools.spec_verify_cost import median_seconds, verify_plan

VOCAB = 512


def write_config(folder: Path, args: argparse.Namespace, arch: str, intermediate: int) -> Path:
    """A config.json (and a tokenizer) for a model of ``arch`` with MLPs of ``intermediate`` rows."""
    folder.mkdir()
    config = {
        "architectures": [arch],
        "vocab_size": VOCAB,
        "hidden_size": args.hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256),
        "max_position_embeddings": 4096,
        "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder, VOCAB)
    return folder


def step_seconds(llm: LLM, batch: int, context: int, repeats: int, program_only: bool = False) -> float:
    """The median time of one decode step of ``batch`` sequences of ``context`` tokens."""
    engine, rng = llm.engine, random.Random(0)
    if program_only:
        model = engine.executor.runner.model
        engine.executor.execute(_plan(llm, batch, context, rng, "warm"))  # builds the program
        model.step_program = dataclasses.replace(model.step_program, stack=None)
    plan = _plan(llm, batch, context, rng, "step")
    return median_seconds(lambda: engine.executor.execute(plan), repeats)


def _plan(llm: LLM, batch: int, context: int, rng: random.Random, tag: str) -> StepPlan:
    seq_ids = [f"{tag}{batch}-{i}" for i in range(batch)]
    tokens = [[rng.randrange(4, VOCAB) for _ in range(context)] for _ in range(batch)]
    for seq_id, prompt in zip(seq_ids, tokens, strict=True):
        llm.engine.kv_manager.allocate(seq_id, prompt, reserve_tokens=context + 1)
    return verify_plan(llm, seq_ids, tokens, 0, rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="moe-step-cost-"))
    models = {
        "moe": write_config(root / "moe", args, "MixtralForCausalLM", args.expert_size),
        "active": write_config(root / "active", args, "LlamaForCausalLM", args.top_k * args.expert_size),
        "total": write_config(root / "total", args, "LlamaForCausalLM", args.experts * args.expert_size),
    }
    blocks = 4 * max(args.batch) * (args.context // 16 + 2)
    print(
        f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts of {args.expert_size} rows, "
        f"top-{args.top_k}; context {args.context}, {args.threads} thread(s); median ms per decode step"
    )
    print("batch  moe ms  active ms  active/program ms  total ms  moe tok/s  active tok/s")
    for batch in args.batch:
        times = {}
        for name, path in (*models.items(), ("active/program", models["active"])):
            llm = LLM(str(path), load_format="dummy", num_kv_blocks=blocks, enable_prefix_caching=False)
            times[name] = step_seconds(llm, batch, args.context, args.repeats, name == "active/program")
            llm.shutdown()
        print(
            f"{batch:5d}  {times['moe'] * 1e3:6.2f}  {times['active'] * 1e3:9.2f}  "
            f"{times['active/program'] * 1e3:17.2f}  {times['total'] * 1e3:8.2f}  "
            f"{batch / times['moe']:9.0f}  {batch / times['active']:12.0f}"
        )


if __name__ == "__main__":
    main()

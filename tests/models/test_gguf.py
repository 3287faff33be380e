"""GGUF files open as models: tiny Llama, Qwen2 and Qwen3 checkpoints written as GGUF (F32, F16,
Q8_0; split into parts; in a folder) give the greedy tokens of the same checkpoint -- pagedkv's
from the Hugging Face folder where the weights are the same (F32), transformers' own GGUF loader
where they were rounded on the way (F16, Q8_0)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagedkv import LLM, SamplingParams
from pagedkv.models import ModelConfig
from pagedkv.models.fingerprint import model_fingerprint
from pagedkv.models.gguf_weights import unpermute_rows
from pagedkv.tokenizer import load_tokenizer
from pagedkv.tokenizer.gguf_file import GGUFError
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.gguf_files import llama_permute, write_gguf

OPTIONS = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (9, 4)]


def greedy(model: str, **options) -> list[list[int]]:
    with LLM(model, **OPTIONS, **options) as llm:
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def transformers_greedy(gguf) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    out = []
    for ids in prompts():
        prompt = torch.tensor([ids])
        tokens = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        out.append(tokens[0, prompt.shape[1] :].tolist())
    return out


def test_the_rotary_permutation_is_undone():
    rows = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)
    permuted = torch.from_numpy(llama_permute(rows.numpy(), 4))
    assert not torch.equal(permuted, rows)
    assert torch.equal(unpermute_rows(permuted, 4), rows)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_an_f32_gguf_runs_as_its_hugging_face_folder(tmp_path, arch):
    # Mistral's window (5) is shorter than the prompts: a full-attention model gives other tokens
    folder = make_checkpoint(tmp_path, arch, **({"sliding_window": 5} if arch == "mistral" else {}))
    gguf = write_gguf(folder, tmp_path / f"{arch}.gguf")
    hf_config, gguf_config = ModelConfig.from_pretrained(folder), ModelConfig.from_pretrained(gguf)
    assert gguf_config == dataclasses.replace(hf_config, eos_token_id=1)
    assert greedy(str(gguf)) == greedy(str(folder))


def test_llama_3_rope_scaling_runs_from_its_frequency_factors(tmp_path):
    """llama.cpp writes Llama 3.1's RoPE scaling as the divisors of ``rope_freqs.weight``."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    folder = make_checkpoint(tmp_path, "llama", rope_parameters=rope)
    gguf = write_gguf(folder, tmp_path / "llama3.gguf")
    assert ModelConfig.from_pretrained(gguf).rope.type == "freq_factors"
    assert greedy(str(gguf)) == greedy(str(folder))


@pytest.mark.parametrize(
    ("arch", "qtype"), [("llama", Q.F16), ("llama", Q.Q8_0), ("qwen2", Q.Q8_0), ("qwen3", Q.F16)]
)
def test_a_rounded_gguf_gives_the_tokens_of_transformers_gguf_loader(tmp_path, arch, qtype):
    # transformers' GGUF config reads no head size for Qwen3 and takes Qwen3Config's 128
    head_dim = {"head_dim": 128} if arch == "qwen3" else {}
    folder = make_checkpoint(tmp_path, arch, tie_word_embeddings=arch == "qwen2", **head_dim)
    gguf = write_gguf(folder, tmp_path / f"{arch}-{qtype.name}.gguf", qtype)
    config = ModelConfig.from_pretrained(gguf)
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert greedy(str(gguf)) == transformers_greedy(gguf)


def test_a_split_model_opens_from_any_part_and_a_folder_from_its_file(tmp_path):
    folder = make_checkpoint(tmp_path, "llama")
    expected = greedy(str(folder))
    first = write_gguf(folder, tmp_path / "split" / "tiny.gguf", split_max_tensors=7)
    parts = sorted(first.parent.glob("*.gguf"))
    assert [p.name for p in parts][:2] == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf"]
    assert greedy(str(parts[-1])) == expected
    assert greedy(str(first.parent)) == expected  # the folder holding the parts


def test_the_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    folder = make_checkpoint(tmp_path, "qwen3")
    gguf = write_gguf(folder, tmp_path / "alone" / "qwen3.gguf")
    shutil.rmtree(folder)  # the GGUF alone
    messages = [{"role": "user", "content": "def f(x): return x"}]
    with LLM(str(gguf), **OPTIONS) as llm:
        reference = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        text = "import os\nprint(os.getcwd())  <|im_start|>"
        assert llm.tokenizer.encode(text) == reference(text)["input_ids"]
        assert llm.tokenizer.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert llm.engine.eos_token_ids == {1, 3}  # EOS and the end-of-turn id
        reply = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert reply[0].prompt.startswith("<|begin_of_text|><|im_start|>user\n")


def test_a_disk_tier_names_the_gguf_weights_its_files_hold(tmp_path):
    folder = make_checkpoint(tmp_path, "llama")
    f32 = write_gguf(folder, tmp_path / "f32" / "tiny.gguf")
    q8 = write_gguf(folder, tmp_path / "q8" / "tiny.gguf", Q.Q8_0)
    assert model_fingerprint(f32) == model_fingerprint(f32.parent) != model_fingerprint(q8)
    disk = {"kv_offload": "disk", "kv_offload_memory": "1MiB", "kv_offload_dir": str(tmp_path / "kv")}
    assert greedy(str(f32), **disk) == greedy(str(folder))


def test_the_tokenizer_option_replaces_the_files_own(tmp_path):
    folder = make_checkpoint(tmp_path, "llama")
    gguf = write_gguf(folder, tmp_path / "bert" / "tiny.gguf", **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(GGUFError, match="unsupported tokenizer 'bert'"):
        LLM(str(gguf), **OPTIONS)
    with LLM(str(gguf), tokenizer=str(folder), **OPTIONS) as llm:
        assert llm.tokenizer.encode("def f(): pass") == load_tokenizer(folder).encode("def f(): pass")


def test_two_tensor_parallel_ranks_read_their_slices_of_a_quantized_gguf(tmp_path):
    folder = make_checkpoint(tmp_path, "llama")
    gguf = write_gguf(folder, tmp_path / "q8" / "tiny.gguf", Q.Q8_0)
    assert greedy(str(gguf), tensor_parallel_size=2) == greedy(str(gguf))

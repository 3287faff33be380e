"""Byte-level BPE tokenizers for pagedkv's own models, written as Hugging Face tokenizer files.

Both kinds of model pagedkv makes itself -- the trained built-in model and the random-weight
models of tests and benchmarks -- use the same recipe: a byte-level BPE from the ``tokenizers``
library with four special tokens (ids 0..3), a post-processor that puts BOS in front of every
encoded text, and a ChatML template. Only the training text and the vocabulary size differ. BPE
training on fixed text is deterministic, so the same text always yields the same
``tokenizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order
BOS_ID, EOS_ID, IM_END_ID = 0, 1, 3

#: Every id that ends generation: EOS ends a document, ``<|im_end|>`` a chat turn.
EOS_TOKEN_IDS = [EOS_ID, IM_END_ID]

#: ChatML turns; like Llama 3's template it starts with the BOS token itself. With ``tools``
#: (transformers' convention: OpenAI's tool objects) a system turn lists them, Hermes-style: one
#: JSON signature a line within ``<tools></tools>``, calls within ``<tool_call></tool_call>`` as
#: ``{"name": ..., "arguments": {...}}`` -- the format of the ``hermes`` tool-call parser. An
#: assistant message's ``tool_calls`` render in that format; a ``tool`` message as a user turn
#: within ``<tool_response></tool_response>``. Without tools or tool messages the text is plain
#: ChatML.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, write a JSON object with the function name and arguments "
    'within <tool_call></tool_call>:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- (arguments if arguments is string else arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens trained on ``texts``.

    Every one of the 256 bytes is in the initial alphabet, so any text encodes (characters the
    training text never had fall back to one token per UTF-8 byte).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training text yields only {tok.get_vocab_size()} tokens, fewer than {vocab_size}"
        )
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    return tok


def write_tokenizer_files(folder: str | Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, chat template) into ``folder``."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

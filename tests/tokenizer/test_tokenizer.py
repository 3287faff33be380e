"""load_tokenizer against transformers' AutoTokenizer, chat templates, and streaming decode."""

from __future__ import annotations

import json

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.models import ModelConfig, builtin_model_path
from pagedkv.models.builtin.random_model import train_tokenizer
from pagedkv.tokenizer import Tokenizer, load_tokenizer
from pagedkv.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "The KV cache is cut into blocks of sixteen tokens.",
    "héllo wörld — ünïcode 🚀 汉字",
    "  leading spaces\n\nnew lines\t and tabs  ",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is paging?"},
    {"role": "assistant", "content": "Fixed-size blocks."},
    {"role": "user", "content": "Why? 🚀"},
]


#: The built-in model's vocabulary: the tokenizer these tests read is the one it ships.
VOCAB_SIZE = ModelConfig.from_pretrained(builtin_model_path()).vocab_size


@pytest.fixture(scope="module")
def folder():
    return builtin_model_path()


@pytest.fixture(scope="module")
def ours(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_encode_decode_match_transformers(ours, hf, text, special):
    ids = ours.encode(text, add_special_tokens=special)
    assert ids == hf(text, add_special_tokens=special)["input_ids"]
    assert (ids[:1] == [ours.bos_token_id]) == special
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False).removeprefix("<|begin_of_text|>") == text


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, generation_prompt):
    text = ours.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
    assert text == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
    assert text.startswith("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n") == generation_prompt
    ids = ours.encode_chat(CHAT, add_generation_prompt=generation_prompt)
    assert ids == hf.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)["input_ids"]
    assert ids.count(ours.bos_token_id) == 1  # the template's BOS only, none added on top


@pytest.mark.parametrize("final", ["Fixed-size", "  padded  ", "ends in a new line\n", "🚀 汉字"])
def test_continue_final_message_matches_transformers(ours, hf, final):
    chat = [*CHAT, {"role": "assistant", "content": final}]
    text = ours.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    options = dict(add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(chat, tokenize=False, **options)
    assert text.rstrip().endswith(final.strip()) and "<|im_end|>" not in text.rsplit("assistant", 1)[1]
    assert ours.encode_chat(chat, False, True) == hf.apply_chat_template(chat, **options)["input_ids"]
    with pytest.raises(ValueError, match="exclude each other"):
        ours.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)


def test_special_and_eos_ids(ours, hf):
    assert ours.vocab_size == VOCAB_SIZE == len(hf)
    assert ours.bos_token_id == hf.bos_token_id == 0
    assert ours.eos_token_id == hf.eos_token_id == 1
    # config.json/generation_config.json add <|im_end|>, which ends chat turns
    assert ours.eos_token_ids == {1, 3}


def _folder_with(tmp_path, config: dict, jinja: str | None = None):
    train_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_chat_template_sources_and_addedtoken_dicts(tmp_path):
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [
            {"name": "default", "template": "A{{ eos_token }}"},
            {"name": "tool_use", "template": "B"},
        ],
    }
    tok = load_tokenizer(_folder_with(tmp_path, config))
    assert tok.eos_token_ids == {3} and tok.bos_token_id is None
    assert tok.apply_chat_template([]) == "A<|im_end|>"
    # transformers 5 saves the template in chat_template.jinja; it takes precedence
    tok = load_tokenizer(_folder_with(tmp_path, config, jinja="J{{ messages | length }}"))
    assert tok.apply_chat_template(CHAT) == "J4"


def test_template_environment_is_transformers_like(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.index == 1 %}{% break %}{% endif %}"
        "{% endfor %}"
    )
    tok = Tokenizer(train_tokenizer(512), {}, template)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}, CHAT[0]]) == (
        '{"role": "user", "content": "é<b>"}'
    )
    with pytest.raises(Exception, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    with pytest.raises(Exception, match="unsafe|access"):  # the sandbox blocks attribute escapes
        Tokenizer(train_tokenizer(512), {}, "{{ messages.__class__.__mro__ }}").apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(train_tokenizer(512)).apply_chat_template(CHAT)
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template(["not a dict"])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def stream(
    tok: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True
) -> tuple[list[str], str]:
    detok = tok.detokenizer(prompt, skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    return pieces, "".join(pieces) + detok.flush()


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40), skip=st.booleans())
def test_streaming_random_ids_equals_decode(ours, ids, skip):
    """Random byte-level ids include lone and partial UTF-8 bytes and special tokens."""
    _, text = stream(ours, ids, skip=skip)
    assert text == ours.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(max_size=20), answer=st.text(max_size=30))
def test_streaming_text_after_prompt_never_splits_characters(ours, prompt, answer):
    prompt_ids = ours.encode(prompt)
    ids = ours.encode(answer, add_special_tokens=False)
    pieces, text = stream(ours, ids, prompt_ids)
    assert text == ours.decode(ids)
    # A special token's text ("<|im_start|>", which Hypothesis finds among the constants of the
    # code under test) encodes to that token, which decoding skips: only other texts come back.
    specials = [t.content for t in ours.backend.get_added_tokens_decoder().values() if t.special]
    if not any(special in answer for special in specials):
        assert text == answer
    if "\ufffd" not in answer:
        assert not any("\ufffd" in p for p in pieces)  # partial characters are held back


def test_streaming_holds_back_a_split_character(ours):
    ids = ours.encode("🚀", add_special_tokens=False)
    assert len(ids) == 4  # one token per UTF-8 byte: not in the training corpus
    pieces, text = stream(ours, ids)
    assert pieces == ["", "", "", "🚀"] and text == "🚀"


def test_streaming_memory_stays_bounded(ours):
    detok = IncrementalDetokenizer(ours.decode)
    ids = ours.encode(" paging" * 300, add_special_tokens=False)
    text = "".join(detok.push(i) for i in ids)
    assert text == " paging" * 300
    assert detok.num_held_ids <= 2


def _wordpiece() -> Tokenizer:
    """A WordPiece tokenizer: its decoder writes a space between every two tokens, special ones too."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer

    backend = BackendTokenizer(
        models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("[CLS]", special=True), AddedToken("[SEP]", special=True)])
    return Tokenizer(backend)


def _streamed(tokenizer: Tokenizer, ids: list[int], spaces: bool) -> str:
    detokenizer = tokenizer.detokenizer((), skip_special_tokens=False, spaces_between_special_tokens=spaces)
    return "".join(detokenizer.push(t) for t in ids) + detokenizer.flush()


def test_spaces_between_special_tokens_default_is_the_decode_of_tokenizers_and_transformers():
    tokenizer = _wordpiece()
    ids = [4, 1, 5, 4, 2, 3, 5, 5]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    assert _streamed(tokenizer, ids, spaces=True) == fast.decode(ids, skip_special_tokens=False)
    assert _streamed(tokenizer, ids, spaces=True) == "[CLS] hello [SEP] [CLS] worlds [SEP] [SEP]"


def test_without_spaces_between_special_tokens_an_added_token_after_another_has_no_space():
    """vLLM's detokenizer: only the space between two added tokens goes; words keep theirs."""
    tokenizer = _wordpiece()
    ids = [4, 1, 5, 4, 2, 3, 5, 5]
    assert _streamed(tokenizer, ids, spaces=False) == "[CLS] hello [SEP][CLS] worlds [SEP][SEP]"
    skipped = tokenizer.detokenizer((), skip_special_tokens=True, spaces_between_special_tokens=False)
    assert "".join(skipped.push(t) for t in ids) + skipped.flush() == tokenizer.decode(ids)


def test_byte_level_bpe_writes_no_space_between_special_tokens_either_way(folder):
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|><|im_start|>", add_special_tokens=False)
    expected = transformers.AutoTokenizer.from_pretrained(folder).decode(ids, skip_special_tokens=False)
    assert _streamed(tokenizer, ids, spaces=False) == _streamed(tokenizer, ids, spaces=True) == expected

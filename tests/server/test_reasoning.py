"""``--reasoning-parser``: the parsers on their own (tags split anywhere), then a server running
the real SmolLM2 whose greedy answer thinks inside ``<think>...</think>`` after a few-shot prompt.

The real model's answer has both tags split over several tokens (``<``, ``think``, ``>``), so the
stream exercises the held-back tags; every response is checked against ``LLM.generate``'s text.
"""

from __future__ import annotations

import openai
import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from pagedkv.server.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    reasoning_parser_class,
)
from tests.real_model import ENGINE_OPTIONS, MODEL_NAME

ANSWER = "<think>I add them: 4.</think>The answer is 4."


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


# -- the parsers -------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_the_thinking_block_is_the_reasoning(parser):
    assert parser("").split(ANSWER) == ("I add them: 4.", "The answer is 4.")
    assert parser("").split("  \n" + ANSWER) == ("I add them: 4.", "The answer is 4.")


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_every_split_of_the_tags_streams_to_the_whole_answer(parser):
    """Cut the answer in three at every pair of places: the pieces always read as the whole."""
    for prompt in ("", "<|im_start|>assistant\n<think>\n"):
        whole = parser(prompt).split(ANSWER)
        for i in range(len(ANSWER) + 1):
            for j in range(i, len(ANSWER) + 1):
                pieces = [ANSWER[:i], ANSWER[i:j], ANSWER[j:]]
                reasoning, content = _streamed(parser(prompt), pieces)
                assert (reasoning or None, content or None) == whole, pieces


def test_qwen3_without_an_opened_block_has_no_reasoning():
    text = "Plain answer with </think> in it"
    assert Qwen3ReasoningParser("<|im_start|>assistant\n").split(text) == (None, text)
    # The template closed an empty block (enable_thinking false): still content.
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert Qwen3ReasoningParser(closed).split(text) == (None, text)
    # A <think> that is not at the start is text.
    assert Qwen3ReasoningParser("").split("a <think>b</think> c") == (None, "a <think>b</think> c")


def test_qwen3_after_a_prompt_that_opened_the_block_reads_up_to_its_end():
    opened = "<|im_start|>assistant\n<think>\n"
    assert Qwen3ReasoningParser(opened).split("why\n</think>\n\nbecause") == ("why\n", "\n\nbecause")


def test_deepseek_r1_reads_up_to_the_end_tag_whatever_the_prompt():
    assert DeepSeekR1ReasoningParser("no tag here").split("why</think>because") == ("why", "because")


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_thinking_cut_before_its_end_is_all_reasoning(parser):
    assert parser("").split("<think>still thinking </thi") == ("still thinking </thi", None)
    assert _streamed(parser(""), ["<thi", "nk>still", " thinking </thi"]) == ("still thinking </thi", "")


def test_a_held_partial_tag_that_turns_out_text_is_released():
    parser = Qwen3ReasoningParser("")
    assert parser.feed("<thi") == ("", "")  # may be <think>
    assert parser.feed("s is text") == ("", "<this is text")
    parser = DeepSeekR1ReasoningParser("")
    assert parser.feed("a </th") == ("a ", "")  # may be </think>
    assert parser.feed("ere") == ("</there", "")


def test_unknown_parser_names_the_known_ones():
    assert reasoning_parser_class("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser_class("granite")


# -- through the server, on the real model -----------------------------------------------------
FEW_SHOT = [
    {"role": "system", "content": "You think inside <think></think> tags first, then answer."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>2 plus 2 makes 4.</think>The answer is 4."},
    {"role": "user", "content": "What is 3+3?"},
]
GREEDY = dict(max_tokens=60, temperature=0)


@pytest.fixture(scope="module")
def real_server(real_model):
    config = EngineConfig(model=str(real_model), **ENGINE_OPTIONS)
    app = create_app(
        config,
        served_model_name=MODEL_NAME,
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(real_server):
    with openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(real_model):
    with LLM(str(real_model), **ENGINE_OPTIONS) as llm:
        yield llm


def _greedy_answer(
    reference: LLM, messages: list[dict], continue_final_message: bool = False, **variables
) -> str:
    """``LLM.generate``'s greedy text for the conversation, rendered as the server renders it."""
    tokenizer = reference.tokenizer
    text = tokenizer.apply_chat_template(
        messages, not continue_final_message, continue_final_message, **variables
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return reference.generate([ids], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text


def _stream(client, **options) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **options):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    return reasoning, content


def test_an_answer_that_opens_its_thinking_is_split(client, reference):
    text = _greedy_answer(reference, FEW_SHOT)
    assert text.startswith("<think>") and "</think>" in text  # what this test is about
    thought, _, answer = text[len("<think>") :].partition("</think>")
    response = client.chat.completions.create(model=MODEL_NAME, messages=FEW_SHOT, **GREEDY)
    message = response.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)
    assert _stream(client, messages=FEW_SHOT, **GREEDY) == (thought, answer)


def test_a_prompt_that_opened_the_thinking_splits_at_its_end(client, reference):
    """continue_final_message with an assistant turn of "<think>": the prompt opened the block."""
    messages = [*FEW_SHOT, {"role": "assistant", "content": "<think>"}]
    text = _greedy_answer(reference, messages, continue_final_message=True)
    assert not text.startswith("<think>") and "</think>" in text
    thought, _, answer = text.partition("</think>")
    prefill = {"add_generation_prompt": False, "continue_final_message": True}
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, extra_body=prefill, **GREEDY
    )
    message = response.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)
    assert _stream(client, messages=messages, extra_body=prefill, **GREEDY) == (thought, answer)


def test_an_answer_without_thinking_is_all_content(client, reference):
    messages = [{"role": "user", "content": "Say hello."}]
    text = _greedy_answer(reference, messages)
    assert "<think>" not in text
    message = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY).choices[0].message
    assert (message.reasoning_content, message.content) == (None, text)


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_SHOT = [
    {"role": "system", "content": "You think inside <think></think> tags first, then call a tool."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": '<think>I need the weather tool.</think><tool_call>\n{"name": "weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>',
    },
    {"role": "user", "content": "Weather in Rome?"},
]


def test_tool_calls_are_read_from_the_content_after_the_thinking(client, reference):
    text = _greedy_answer(reference, TOOL_SHOT, tools=[WEATHER])
    assert text.startswith("<think>I need the weather tool.</think><tool_call>")  # what this test is about
    options = dict(model=MODEL_NAME, messages=TOOL_SHOT, tools=[WEATHER], **GREEDY)
    response = client.chat.completions.create(**options)
    message, choice = response.choices[0].message, response.choices[0]
    assert message.reasoning_content == "I need the weather tool." and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("weather", '{"city": "Rome"}')
    ]
    assert choice.finish_reason == "tool_calls"
    reasoning, calls = "", []
    for chunk in client.chat.completions.create(**options, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        assert not delta.content
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or ()]
    assert reasoning == "I need the weather tool." and calls == [("weather", '{"city": "Rome"}')]

"""``LLM.chat`` on the real SmolLM2-135M-Instruct (ChatML): it answers, keeps the order of a
batch, and renders with the template and variables it is given."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from tests.real_model import ENGINE_OPTIONS

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def llm(real_model):
    with LLM(str(real_model), **ENGINE_OPTIONS) as engine:
        yield engine


def test_chat_answers_the_question(llm):
    output = llm.chat(QUESTION, GREEDY, use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    rendered = llm.tokenizer.apply_chat_template(QUESTION, True, False)
    assert rendered.endswith("<|im_start|>assistant\n") and output.prompt == rendered
    assert output.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_a_batch_of_conversations_returns_one_output_each_in_order(llm):
    other = [{"role": "user", "content": "What is the capital of Germany?"}]
    batch = llm.chat([other, QUESTION], GREEDY, use_tqdm=False)
    alone = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (other, QUESTION)]
    assert [o.outputs[0].text for o in batch] == [o.outputs[0].text for o in alone]
    assert "Berlin" in batch[0].outputs[0].text and "Paris" in batch[1].outputs[0].text


def test_a_chat_template_override_and_its_kwargs_render_the_prompt(llm):
    template = (
        "{% for m in messages %}{{ persona }} hears: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ persona }} says:{% endif %}"
    )
    output = llm.chat(
        QUESTION,
        SamplingParams(max_tokens=2, temperature=0.0),
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"persona": "The oracle"},
    )[0]
    rendered = "The oracle hears: What is the capital of France?\nThe oracle says:"
    assert output.prompt == rendered
    assert output.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    default = llm.chat(QUESTION, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert default.prompt_token_ids != output.prompt_token_ids


def test_continue_final_message_continues_the_answer_and_excludes_a_generation_prompt(llm):
    prefilled = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    output = llm.chat(
        prefilled, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    assert output[0].prompt.endswith("The capital of France is")
    assert "Paris" in output[0].outputs[0].text
    with pytest.raises(
        ValueError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"
    ):
        llm.chat(prefilled, GREEDY, continue_final_message=True, use_tqdm=False)


def test_bad_words_keep_a_word_out_of_the_answer(llm):
    """The greedy answer says Paris; banned (as " Paris" mid-text and "Paris" at the start), it can't."""
    banned = SamplingParams(max_tokens=12, temperature=0.0, bad_words=["Paris"])
    text = llm.chat(QUESTION, banned, use_tqdm=False)[0].outputs[0].text
    assert "Paris" not in text and text

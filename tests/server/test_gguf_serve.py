"""``pagedkv serve --model x.gguf``: the real model served from its GGUF file alone answers the
official ``openai`` client on /v1/chat/completions, under the file's name."""

from __future__ import annotations

import openai

from tests.real_model import ENGINE_OPTIONS, GGUF_FILE, gguf_path
from tests.server.process import ServeProcess


def test_serve_a_gguf_file_answers_chat(tmp_path):
    (tmp_path / GGUF_FILE).symlink_to(gguf_path())
    options = [f"--{key.replace('_', '-')}={value}" for key, value in ENGINE_OPTIONS.items()]
    with ServeProcess("--model", str(tmp_path / GGUF_FILE), *options) as server:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [GGUF_FILE]
            reply = client.chat.completions.create(
                model=GGUF_FILE,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=20,
                temperature=0,
            )
    assert "Paris" in reply.choices[0].message.content
    assert server.returncode == 0

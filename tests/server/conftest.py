"""Real uvicorn servers on 127.0.0.1 (free ports) over the built-in model, and a reference LLM.

The main server is shared by the whole session (its engine loads once); every test that uses
it leaves it idle with the pool whole, which ``wait_idle`` checks.
"""

from __future__ import annotations

import openai
import pytest

from pagedkv import LLM
from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import API_KEY, ENGINE_OPTIONS, assert_pool_whole, wait_idle

#: Small enough that a test can send a body over it without a big prompt.
MAX_BODY_BYTES = 16 * 1024


@pytest.fixture(scope="session")
def server():
    app = create_app(EngineConfig(**ENGINE_OPTIONS), api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def engine(server):
    """The main server's engine, for white-box leak checks once the server is idle."""
    return server.app.state.engine.engine


@pytest.fixture(scope="session")
def reference() -> LLM:
    """``LLM.generate`` with the main server's engine options: what every response must equal."""
    return LLM(**ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def client(base_url):
    """The official ``openai`` client on the main server (a module with its own server defines
    its own ``client``)."""
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def leaves_server_idle(base_url, engine):
    """After the test, the main server runs nothing and every KV block is back in its pool; a
    module asks for it with ``pytestmark = pytest.mark.usefixtures("leaves_server_idle")``."""
    yield
    wait_idle(base_url)
    assert_pool_whole(engine)

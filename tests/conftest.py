"""Fixtures shared by every test folder: the real headless browser (see ``tests/browser.py``) and
the real pretrained model (see ``tests/real_model.py``).

Tests never reach the Hugging Face Hub: HF_HUB_OFFLINE is set before anything imports
huggingface_hub, for this process and the servers it starts; a Hub id resolves from a cache
the test builds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser import WINDOW, BrowserMissingError, console_errors, start_chromium

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def browser_session(tmp_path_factory):
    """One headless Chromium for the whole session (starting one takes seconds)."""
    try:
        driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    except BrowserMissingError as err:
        pytest.fail(str(err), pytrace=False)
    yield driver
    driver.quit()


@pytest.fixture
def browser(browser_session):
    """The session's browser on a blank page at the default window size; after the test, the
    pages it opened must not have logged a JavaScript error or an uncaught exception."""
    browser_session.set_window_size(*WINDOW)
    browser_session.get("about:blank")
    console_errors(browser_session)  # drop what earlier tests left
    yield browser_session
    errors = console_errors(browser_session)
    assert not errors, f"the page logged JavaScript errors: {errors}"


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (see ``tests/real_model.py``)."""
    from tests.real_model import real_model_dir

    return real_model_dir()

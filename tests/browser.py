"""A real headless Chromium for the tests of pages: Debian's ``chromium`` driven through Debian's
``chromedriver`` by selenium.

Why selenium rather than playwright: Debian builds ``chromedriver`` from the same source and
release as its ``chromium``, so the pair always speaks the same protocol, and selenium is a small
pure-Python client that is told exactly which driver to run (no Selenium Manager, no download).
Playwright drives the browser build it pins for each of its releases; pointed at another Chromium
it works only as long as that build's DevTools protocol happens to match.

The Makefile's ``install-test`` installs both packages when they are missing. Without them a
browser test fails (never skips) with :data:`INSTALL_HINT`. The fixtures that hand a driver to
tests live in ``tests/conftest.py``: one browser per session, checked for console errors after
each test.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = (
    "install Debian's chromium and chromium-driver: `make install-test` does it "
    "(apt-get update && apt-get install -y chromium chromium-driver, as root or through sudo)"
)
#: Flags that keep headless Chromium quiet and self-contained here: no sandbox (root in a
#: container), no GPU, no background traffic, no first-run UI.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
WINDOW = (1400, 1100)
#: Screenshots taken by the tests (gitignored); the README's come from here.
SCREENSHOTS = Path(__file__).resolve().parent.parent / "screenshots"


class BrowserMissingError(RuntimeError):
    pass


def start_chromium(user_data_dir: Path, window: tuple[int, int] = WINDOW) -> webdriver.Chrome:
    """A headless Chromium with a fresh profile in ``user_data_dir``; its console is logged so
    that :func:`console_errors` can read it."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        raise BrowserMissingError(f"{' and '.join(missing)} not found: {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.add_argument(f"--window-size={window[0]},{window[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """Console errors and uncaught exceptions since the last call (reading drains the log)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def save_screenshot(driver: webdriver.Chrome, name: str) -> Path:
    """Save the window as ``screenshots/<name>.png`` and return the path. The PNG is reduced to
    a 256-colour palette: a page of flat colours looks the same at a third of the size, small
    enough to commit a copy for the README."""
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path

"""``pagedkv simulate --html``: the replay page in a real headless Chromium, opened from disk.

Every figure the page shows is computed by its JavaScript from the packed residencies; the tests
compare it with what the simulator's Python loops recorded at the same step.
"""

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from pagedkv.sim import SimConfig, simulate
from pagedkv.sim.html_replay import write_replay
from pagedkv.sim.replay import MAX_FRAMES, REPLAY_ALLOCATORS, frame_steps
from tests.browser import save_screenshot

COUNTERS = ("running", "stored", "held", "waiting")


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """The default simulation and its replay file (the one the README shows)."""
    result = simulate(SimConfig())
    return result, write_replay(result, tmp_path_factory.mktemp("replay"))


def open_replay(driver, path, scenario):
    driver.get(path.as_uri())
    driver.find_element(By.CSS_SELECTOR, f'#scenarios button[data-scenario="{scenario}"]').click()
    WebDriverWait(driver, 10).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "article[data-memory]")) == len(REPLAY_ALLOCATORS)
    )


def counter(driver, allocator, name):
    cell = driver.find_element(By.CSS_SELECTOR, f'article[data-memory="{allocator}"] [data-counter="{name}"]')
    return int(cell.get_attribute("data-value"))


def shown_step(driver):
    return int(driver.find_element(By.ID, "step-label").get_attribute("data-step"))


def assert_counters_match_the_trace(driver, result, step):
    for allocator in REPLAY_ALLOCATORS:
        run = result.trace[allocator]
        shown = {name: counter(driver, allocator, name) for name in COUNTERS}
        assert shown == {name: getattr(run, name)[step] for name in COUNTERS}, (allocator, step)
    assert counter(driver, "paged", "blocks") * result.config.block_size == result.trace["paged"].held[step]


def test_worked_example_ends_with_the_blocks_the_allocator_took(browser, replay):
    result, path = replay
    ex = result.example
    open_replay(browser, path, "example")
    slider = browser.find_element(By.ID, "frame")
    assert int(slider.get_attribute("max")) + 1 == min(max(ex.lengths), MAX_FRAMES)
    assert shown_step(browser) == max(ex.lengths) - 1  # it opens on the last step
    paged_blocks = sum(len(ids) for ids in ex.block_ids)
    assert counter(browser, "paged", "blocks") == paged_blocks
    assert counter(browser, "paged", "held") == ex.paged_slots
    pool = browser.find_element(By.CSS_SELECTOR, 'article[data-memory="paged"] .size')
    assert int(pool.get_attribute("data-pool-blocks")) == paged_blocks
    assert counter(browser, "max", "held") == ex.naive_slots
    for allocator in REPLAY_ALLOCATORS:
        assert counter(browser, allocator, "stored") == sum(ex.lengths)
        assert counter(browser, allocator, "running") == len(ex.lengths)
    # Back to the first step: one token each, one block each.
    slider.send_keys(Keys.HOME)
    assert shown_step(browser) == 0
    assert counter(browser, "paged", "blocks") == len(ex.lengths)
    assert counter(browser, "max", "held") == ex.naive_slots  # reserved up front
    slider.send_keys(Keys.END)
    save_screenshot(browser, "replay_worked_example")


def test_slider_walks_the_trace_and_counters_follow_the_simulator(browser, replay):
    result, path = replay
    cfg = result.config
    frames = frame_steps(cfg.trace_steps)
    open_replay(browser, path, "trace")
    slider = browser.find_element(By.ID, "frame")
    assert int(slider.get_attribute("max")) + 1 == min(cfg.trace_steps, MAX_FRAMES) == len(frames)
    pool = browser.find_element(By.CSS_SELECTOR, 'article[data-memory="paged"] .size')
    assert int(pool.get_attribute("data-pool-blocks")) == cfg.kv_slots // cfg.block_size
    # It opens where the paged pool runs the most requests.
    busiest = shown_step(browser)
    assert result.trace["paged"].running[busiest] == max(result.trace["paged"].running[s] for s in frames)
    assert_counters_match_the_trace(browser, result, busiest)
    save_screenshot(browser, "replay_dynamic_trace")
    label = browser.find_element(By.ID, "step-label").text
    slider.send_keys(Keys.HOME)
    assert shown_step(browser) == 0 and browser.find_element(By.ID, "step-label").text != label
    assert_counters_match_the_trace(browser, result, 0)
    slider.send_keys(Keys.ARROW_RIGHT * 37)
    assert shown_step(browser) == frames[37]
    assert_counters_match_the_trace(browser, result, frames[37])
    assert counter(browser, "paged", "running") != result.trace["paged"].running[0]
    slider.send_keys(Keys.END)
    assert shown_step(browser) == cfg.trace_steps - 1
    assert_counters_match_the_trace(browser, result, cfg.trace_steps - 1)


def test_play_advances_and_pause_stops(browser, replay):
    _, path = replay
    open_replay(browser, path, "trace")
    browser.find_element(By.ID, "frame").send_keys(Keys.HOME)
    play = browser.find_element(By.ID, "play")
    play.click()
    WebDriverWait(browser, 10).until(lambda d: shown_step(d) > 0)
    play.click()
    assert play.get_attribute("data-playing") == "false"
    paused_at = shown_step(browser)
    # Let the page paint several animation frames: a running player would have moved on.
    browser.execute_async_script(
        "const done = arguments[0]; let n = 0;"
        "(function wait() { if (++n > 12) return done(); requestAnimationFrame(wait); })();"
    )
    assert shown_step(browser) == paused_at


def test_hovering_a_cell_names_its_owner(browser, replay):
    result, path = replay
    open_replay(browser, path, "example")
    owner_of_block_0 = next(i for i, ids in enumerate(result.example.block_ids) if 0 in ids)
    for allocator, owner in (("paged", owner_of_block_0), ("max", 0)):
        canvas = browser.find_element(By.CSS_SELECTOR, f'article[data-memory="{allocator}"] canvas.map')
        # Selenium offsets are from the element's centre: aim at its first slot.
        ActionChains(browser).move_to_element_with_offset(
            canvas, -canvas.size["width"] // 2 + 2, -canvas.size["height"] // 2 + 2
        ).perform()
        tooltip = browser.find_element(By.ID, "tooltip")
        assert tooltip.is_displayed()
        assert f"request {owner}" in tooltip.text and "tokens stored" in tooltip.text


def test_the_page_fetches_nothing(browser, replay):
    """Self-contained: the page loads no resource (script, style, font, image) from anywhere."""
    _, path = replay
    open_replay(browser, path, "trace")
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    text = path.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and " src=" not in text

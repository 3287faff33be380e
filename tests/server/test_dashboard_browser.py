"""``GET /dashboard`` in a real headless Chromium against a real server running real requests.

Nothing here waits on the engine's speed: requests are held between steps by
:class:`~tests.server.helpers.EngineGate`, and the tests wait on what the page shows (its data-
attributes) and on what the engine reports, never on a sleep.
"""

from __future__ import annotations

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.browser import console_errors, save_screenshot
from tests.server.helpers import (
    API_KEY,
    MODEL,
    EngineGate,
    complete_in_background,
    prompts,
    scrape,
    wait_idle,
)

OPTIONS = dict(num_kv_blocks=96, block_size=16, max_model_len=256, max_num_seqs=16)
#: The page's picture of the pool: per cell its state, refcount and owners.
CELLS_JS = (
    "return [...document.querySelectorAll('#grid .cell')]"
    ".map(c => [c.dataset.state, Number(c.dataset.refcount), c.dataset.owners])"
)


@pytest.fixture(scope="module")
def dashboard_server():
    with ServerThread(create_app(EngineConfig(**OPTIONS))) as running:
        yield running


def wait_for(driver, predicate, what: str, timeout: float = 60):
    return WebDriverWait(driver, timeout).until(lambda d: predicate(d), message=f"waiting for {what}")


def frames(driver) -> int:
    return int(driver.find_element(By.ID, "status").get_attribute("data-frames"))


def connection(driver) -> str:
    return driver.find_element(By.ID, "status").get_attribute("data-connection")


def boot_id(driver) -> str:
    """Which server the page's picture comes from (a restarted one has a new id)."""
    return driver.find_element(By.ID, "status").get_attribute("data-boot")


def open_dashboard(driver, base_url: str, fragment: str = "") -> None:
    driver.get(f"{base_url}/dashboard{fragment}")
    wait_for(driver, lambda d: connection(d) == "live" and frames(d) >= 1, "the first frame")


def cells(driver) -> list[list]:
    return driver.execute_script(CELLS_JS)


def arrows(driver) -> list[list[str]]:
    """The detail's logical -> physical arrows: (sample, physical block) each, read in one go."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#block-table line.arrow')]"
        ".map(a => [a.dataset.sample, a.dataset.physical])"
    )


def owned_by(driver, request_id: str) -> int:
    return sum(request_id in owners.split() for _, _, owners in cells(driver))


def next_frame(driver) -> None:
    """Wait until the page has drawn a frame newer than the one it shows now."""
    seen = frames(driver)
    wait_for(driver, lambda d: frames(d) > seen, "a new frame")


def hold_after_first_token(gate: EngineGate, engine, request_count: int = 1) -> dict[str, set[int]]:
    """Let the engine run until ``request_count`` requests hold blocks, then hold it; return
    each request's physical blocks as the engine reports them."""

    def running(_outputs) -> bool:
        return len({s.request_id for s in engine.kv_snapshot().sequences}) >= request_count

    gate.open_until(running)
    assert gate.holding.wait(60)
    held: dict[str, set[int]] = {}
    for seq in engine.kv_snapshot().sequences:
        held.setdefault(seq.request_id, set()).update(seq.block_ids)
    return held


def test_the_grid_has_one_cell_per_block_of_the_engine(browser, dashboard_server):
    open_dashboard(browser, dashboard_server.base_url)
    total = scrape(dashboard_server.base_url)["pagedkv:kv_cache_blocks_total"]
    grid = browser.find_element(By.ID, "grid")
    assert int(grid.get_attribute("data-blocks")) == total == OPTIONS["num_kv_blocks"]
    assert len(cells(browser)) == total
    assert {state for state, _, _ in cells(browser)} <= {"free", "cached"}


def test_a_requests_cells_appear_while_it_runs_and_return_when_it_ends(browser, dashboard_server):
    engine = dashboard_server.app.state.engine.engine
    base_url = dashboard_server.base_url
    open_dashboard(browser, base_url)
    with EngineGate(engine) as gate:
        gate.close()
        prompt = prompts(1, seed=3, words=20)[0]
        thread = complete_in_background(base_url, prompt=prompt, max_tokens=40, ignore_eos=True)
        held = hold_after_first_token(gate, engine)
        ((request_id, blocks),) = held.items()
        wait_for(browser, lambda d: owned_by(d, request_id) == len(blocks), "the request's cells")
        shown = {i for i, (state, _, owners) in enumerate(cells(browser)) if request_id in owners.split()}
        assert shown == blocks
        assert {cells(browser)[i][0] for i in shown} == {"used"}
        last = max(blocks, key=lambda b: engine.kv_snapshot().sequences[0].block_ids.index(b))
        cell = browser.find_element(By.CSS_SELECTOR, f'#grid .cell[data-block="{last}"]')
        ActionChains(browser).move_to_element(cell).perform()
        tooltip = browser.find_element(By.ID, "tooltip")
        seq = engine.kv_snapshot().sequences[0]
        logical = seq.block_ids.index(last)
        assert tooltip.is_displayed() and request_id in tooltip.text
        assert f"tokens {logical * 16}–{seq.num_tokens - 1}" in tooltip.text  # the last block
        browser.find_element(By.CSS_SELECTOR, f'#requests li[data-request="{request_id}"]').click()
        detail = browser.find_element(By.ID, "detail")
        assert detail.get_attribute("data-live") == "true"
        assert {int(block) for _, block in arrows(browser)} == blocks
    thread.join(120)
    wait_idle(base_url)
    wait_for(browser, lambda d: owned_by(d, request_id) == 0, "the request's cells to return")
    assert {state for state, _, _ in cells(browser)} <= {"free", "cached"}
    assert detail.get_attribute("data-live") == "false"


def test_a_forked_request_shows_the_blocks_its_samples_share(browser, dashboard_server):
    engine = dashboard_server.app.state.engine.engine
    base_url = dashboard_server.base_url
    open_dashboard(browser, base_url)
    with EngineGate(engine) as gate:
        gate.close()
        prompt = prompts(1, seed=4, words=30)[0]  # several full blocks, shared by the samples
        body = dict(prompt=prompt, max_tokens=30, n=3, temperature=1.0, ignore_eos=True)
        thread = complete_in_background(base_url, **body)

        def forked(_outputs) -> bool:
            return len(engine.kv_snapshot().sequences) == 3

        gate.open_until(forked)
        assert gate.holding.wait(60)
        refcounts = {b.block_id: b.refcount for b in engine.kv_snapshot().blocks if b.refcount > 1}
        assert refcounts, "the samples of one prompt share its blocks"

        def shared_cells(driver) -> dict[int, int]:
            return {i: ref for i, (state, ref, _) in enumerate(cells(driver)) if state == "shared"}

        wait_for(browser, lambda d: shared_cells(d) == refcounts, "the shared cells")
        request_id = engine.kv_snapshot().sequences[0].request_id
        shared = browser.find_element(By.CSS_SELECTOR, f'#grid .cell[data-block="{next(iter(refcounts))}"]')
        assert shared.text == str(refcounts[next(iter(refcounts))])
        shared.click()  # a cell picks its owner
        detail = browser.find_element(By.ID, "detail")
        wait_for(browser, lambda d: detail.get_attribute("data-request") == request_id, "the detail")
        assert int(detail.get_attribute("data-fork-shared")) == len(refcounts)
        assert {sample for sample, _ in arrows(browser)} == {"0", "1", "2"}
        # Copy-on-write splits the shared partly filled block on the next steps; the full
        # prompt blocks stay shared until the request ends.
        gate.open_until(lambda outputs: True)
        assert gate.holding.wait(60)
        after = {b.block_id: b.refcount for b in engine.kv_snapshot().blocks if b.refcount > 1}
        wait_for(browser, lambda d: shared_cells(d) == after, "the cells after copy-on-write")
    thread.join(120)
    wait_idle(base_url)
    wait_for(browser, lambda d: not shared_cells(d), "the shared cells to return")


def test_the_dashboard_under_load(browser, dashboard_server):
    """Requests with a common prefix, some forked, stepped one step per drawn frame: the page's
    counters match the engine's, and the screenshot for the README is taken here."""
    engine = dashboard_server.app.state.engine.engine
    base_url = dashboard_server.base_url
    browser.set_window_size(1400, 1000)
    open_dashboard(browser, base_url)
    system = "You are a helpful assistant who explains paged attention with care. " * 2
    threads = []
    with EngineGate(engine) as gate:
        gate.close()
        for k, prompt in enumerate(prompts(10, seed=5, words=8)):
            threads.append(
                complete_in_background(
                    base_url, prompt=system + prompt, max_tokens=60 + 8 * k, n=1 + k % 3, ignore_eos=True
                )
            )
        for _ in range(45):  # one engine step, then one frame drawn, so the charts fill in
            gate.open_until(lambda outputs: True)
            assert gate.holding.wait(60)
            next_frame(browser)
        snapshot = engine.kv_snapshot()
        busiest = max(
            {s.request_id for s in snapshot.sequences},
            key=lambda r: sum(s.request_id == r for s in snapshot.sequences),
        )
        browser.find_element(By.CSS_SELECTOR, f'#requests li[data-request="{busiest}"]').click()
        used = sum(b.refcount > 0 for b in snapshot.blocks)
        wait_for(browser, lambda d: sum(s in ("used", "shared") for s, _, _ in cells(d)) == used, "the load")
        contiguous = browser.find_element(By.ID, "contiguous")
        assert int(contiguous.get_attribute("data-live")) == len(snapshot.sequences)
        save_screenshot(browser, "dashboard_under_load")  # docs/img/dashboard.png is a copy
    for thread in threads:
        thread.join(120)
    wait_idle(base_url)


def test_the_stream_reconnects_after_a_server_restart(browser):
    first = ServerThread(create_app(EngineConfig(**OPTIONS)))
    port = first.port
    with first:
        open_dashboard(browser, first.base_url)
        boot = boot_id(browser)
    wait_for(browser, lambda d: connection(d) == "connecting", "the page to notice the server left")
    with ServerThread(create_app(EngineConfig(**OPTIONS)), port=port):
        wait_for(browser, lambda d: connection(d) == "live" and boot_id(d) != boot, "the new server")
        assert len(cells(browser)) == OPTIONS["num_kv_blocks"]
    # While the server was away the page's fetches failed; nothing else may have gone wrong.
    assert all("/dashboard/stream" in error for error in console_errors(browser))


def test_with_an_api_key_the_page_asks_for_it_and_the_stream_needs_it(browser, server):
    """The session's server (tests/server/conftest.py) requires ``API_KEY``."""
    base_url = server.base_url
    assert httpx.get(f"{base_url}/dashboard").status_code == 200  # the page holds no data
    assert httpx.get(f"{base_url}/dashboard/stream").status_code == 401
    browser.get(f"{base_url}/dashboard")
    wait_for(browser, lambda d: connection(d) == "login", "the login prompt")
    assert frames(browser) == 0 and browser.find_element(By.ID, "login").is_displayed()
    browser.find_element(By.ID, "api-key").send_keys("not-the-key")
    browser.find_element(By.ID, "login-button").click()
    error = browser.find_element(By.ID, "login-error")
    wait_for(browser, lambda d: "refused" in error.text, "the refusal")
    assert frames(browser) == 0
    browser.find_element(By.ID, "api-key").clear()
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "login-button").click()
    wait_for(browser, lambda d: connection(d) == "live" and frames(d) >= 1, "the stream")
    assert len(cells(browser)) == scrape(base_url)["pagedkv:kv_cache_blocks_total"]
    refused = console_errors(browser)  # the wrong key's 401, logged by Chromium
    assert refused and all("/dashboard/stream" in e and "401" in e for e in refused)
    # A key in the fragment (never sent to the server) logs in and leaves the address bar.
    browser.execute_script("sessionStorage.clear()")
    browser.get("about:blank")
    open_dashboard(browser, base_url, fragment=f"#key={API_KEY}")
    assert "key=" not in browser.current_url


def test_the_second_tier_shows_beside_the_pool(browser, dashboard_server):
    open_dashboard(browser, dashboard_server.base_url)
    assert not browser.find_element(By.ID, "tier").is_displayed()  # this server has no tier
    tiered = OPTIONS | dict(num_kv_blocks=24, max_model_len=512, kv_offload="host", kv_offload_memory="16MiB")
    with ServerThread(create_app(EngineConfig(**tiered))) as server:
        open_dashboard(browser, server.base_url)
        panel = browser.find_element(By.ID, "tier")
        assert panel.is_displayed() and panel.get_attribute("data-medium") == "CPU"
        for seed in (1, 2):  # two prompts the pool cannot hold together: the first one spills
            body = {"prompt": " ".join(prompts(1, seed, words=150)), "max_tokens": 2}
            assert (
                httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, **body}).status_code
                == 200
            )
        wait_idle(server.base_url)
        tier = server.app.state.engine.engine.stats().tier
        assert tier.cached_blocks > 0
        wait_for(browser, lambda d: panel.get_attribute("data-cached") == str(tier.cached_blocks), "the tier")
        assert f"CPU · {tier.capacity_blocks} blocks · {tier.cached_blocks} cached" in panel.text


def test_a_windowed_model_shows_its_kv_groups_and_the_null_block(browser, tmp_path):
    """Hybrid paging (a Gemma-2-like model, window 8): each held cell names its KV group, the
    null block has a cell of its own, and the groups panel counts what the sliding group handed
    back as its window passed -- all equal to the engine's own tables."""
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(
        tmp_path, "gemma2", sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=4
    )
    options = dict(model=str(path), num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=4)
    with ServerThread(create_app(EngineConfig(**options), served_model_name=MODEL)) as server:
        engine = server.app.state.engine.engine
        null = engine.kv_manager.null_block
        open_dashboard(browser, server.base_url)
        panel = browser.find_element(By.ID, "groups")
        assert panel.is_displayed()
        assert "null block 0" in panel.text and "group 1 (window 8)" in panel.text
        assert cells(browser)[null][0] == "null"
        with EngineGate(engine) as gate:
            gate.close()
            thread = complete_in_background(
                server.base_url, prompt=list(range(4, 44)), max_tokens=30, ignore_eos=True
            )

            def window_passed(_outputs) -> bool:
                seqs = engine.kv_snapshot().sequences
                return bool(seqs) and seqs[0].group_tables[1][:2] == (null, null) and seqs[0].num_tokens > 44

            gate.open_until(window_passed)
            assert gate.holding.wait(60)
            (seq,) = engine.kv_snapshot().sequences
            full, sliding = seq.group_tables
            expected = {b: "0" for b in full} | {b: "1" for b in sliding if b != null}
            expired = next(i for i, b in enumerate(sliding) if b != null)

            def groups_shown(driver) -> dict[int, str]:
                shown = driver.execute_script(
                    "return [...document.querySelectorAll('#grid .cell')].map(c => c.dataset.group)"
                )
                return {b: g for b, g in enumerate(shown) if g}

            wait_for(browser, lambda d: groups_shown(d) == expected, "each held block's group")
            sliding_item = browser.find_element(By.CSS_SELECTOR, '#group-list li[data-group="1"]')
            full_item = browser.find_element(By.CSS_SELECTOR, '#group-list li[data-group="0"]')
            assert int(sliding_item.get_attribute("data-expired")) == expired > 0
            assert int(sliding_item.get_attribute("data-held")) == len(sliding) - expired <= 8 // 4 + 1
            assert int(full_item.get_attribute("data-held")) == len(full)
            assert "handed back as the window passed" in sliding_item.text
            live = sliding[expired]
            cell = browser.find_element(By.CSS_SELECTOR, f'#grid .cell[data-block="{live}"]')
            assert "sliding" in cell.get_attribute("class").split()
            ActionChains(browser).move_to_element(cell).perform()
            tooltip = browser.find_element(By.ID, "tooltip")
            assert f"window 8 group, logical block {expired}" in tooltip.text
            cell.click()
            detail = browser.find_element(By.ID, "detail")
            wait_for(browser, lambda d: detail.get_attribute("data-live") == "true", "the detail")
            drawn = browser.execute_script(
                "return [...document.querySelectorAll('#block-table line.arrow')]"
                ".map(a => [Number(a.dataset.group), Number(a.dataset.physical)])"
            )
            assert sorted(map(tuple, drawn)) == sorted(
                [(0, b) for b in full] + [(1, b) for b in sliding if b != null]
            )
            assert len(browser.find_elements(By.CSS_SELECTOR, "#block-table rect.null")) == expired
            save_screenshot(browser, "dashboard_kv_groups")  # docs/img/dashboard_kv_groups.png is a copy
        thread.join(120)
        wait_idle(server.base_url)
        wait_for(browser, lambda d: not groups_shown(d), "the groups' cells to return")
        assert cells(browser)[null][0] == "null"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A server with unified LoRA paging and one adapter, ``first``, of a tiny checkpoint."""
    from tests.checkpoints import make_checkpoint
    from tests.lora_adapters import make_adapter

    tmp = tmp_path_factory.mktemp("dashboard-lora")
    base = make_checkpoint(tmp, "llama")
    first = make_adapter(tmp / "first", base, seed=1)
    config = EngineConfig(model=str(base), dtype="float32", enable_lora=True, max_lora_rank=4, **OPTIONS)
    with ServerThread(
        create_app(config, served_model_name=MODEL, lora_modules=[f"first={first}"])
    ) as running:
        yield running


def test_adapter_pages_show_beside_the_kv_blocks(browser, lora_server):
    """While a request of the adapter runs its pages are drawn as pinned adapter pages, never as a
    request's; once it ends they stay resident, drawn as idle."""
    engine = lora_server.app.state.engine.engine
    base_url = lora_server.base_url
    open_dashboard(browser, base_url)

    def adapter_cells(driver, state: str) -> set[int]:
        return {i for i, (s, _, _) in enumerate(cells(driver)) if s == state}

    with EngineGate(engine) as gate:
        gate.close()
        thread = complete_in_background(base_url, model="first", prompt=[5, 9, 14, 3], max_tokens=20)
        hold_after_first_token(gate, engine)
        (adapter,) = engine.kv_snapshot().adapters
        assert adapter.name == "first" and adapter.pins == 1
        pages = set(adapter.block_ids)
        wait_for(browser, lambda d: adapter_cells(d, "adapter") == pages, "the adapter's pages")
        shown = browser.execute_script(
            "return [...document.querySelectorAll('#grid .cell.adapter')].map(c => c.dataset.adapter)"
        )
        assert set(shown) == {"first"}
        cell = browser.find_element(By.CSS_SELECTOR, f'#grid .cell[data-block="{min(pages)}"]')
        ActionChains(browser).move_to_element(cell).perform()
        tooltip = browser.find_element(By.ID, "tooltip")
        assert "LoRA adapter first" in tooltip.text and "pinned by 1 running sequence" in tooltip.text
        assert "LoRA adapter pages" in browser.find_element(By.ID, "pool-summary").text
    thread.join(120)
    wait_idle(base_url)
    wait_for(browser, lambda d: adapter_cells(d, "adapter-idle") == pages, "the idle adapter's pages")

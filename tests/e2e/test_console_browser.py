"""The console's page in a real browser: Debian's Chromium, headless, driven through
Debian's chromedriver with Selenium, against a real fleet (tests/e2e/console_kit.py).

The grid shows both nodes, their replicas and the unhealthy GPU's reason; a drain
started from the page (its confirmation lists the move) moves the replica and the grid
follows live; the slider moved to before the drain shows the replica back on its old
node; the diff between the two points names the move; a bad point is a message on the
page. With LLMGW_SCREENSHOTS=DIR set, it saves the fleet view and the slider's past
there (README's pictures are made so).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.console_kit import call, fleet, holder, opening, start_console
from tests.harness import TestNatsServer, wait_for
from tests.kit.browser import chromium

pytestmark = pytest.mark.slow


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def _texts(driver: Any, selector: str) -> list[str]:
    """The text of every element matching `selector`, read in one script: the page
    re-renders as events arrive, so elements found one call earlier may be gone."""
    found: list[str] = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.innerText)", selector
    )
    return found


def _gpu_texts(driver: Any, node: str) -> list[str]:
    return _texts(driver, f'.node[data-node="{node}"] .gpu')


def _click(driver: Any, selector: str) -> None:
    driver.execute_script("document.querySelector(arguments[0]).click()", selector)


def _press(driver: Any, selector: str, tries: int = 20) -> None:
    """Click the element at `selector` as a user does (a real click, not a script's). The
    live grid re-renders as events arrive, so the element found may be replaced before the
    click lands: it is found again."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(tries - 1):
        try:
            driver.find_element("css selector", selector).click()
            return
        except StaleElementReferenceException:
            continue
    driver.find_element("css selector", selector).click()


def _shot(driver: Any, name: str) -> None:
    folder = os.environ.get("LLMGW_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / name))


async def _until(driver: Any, check: Any, within_s: float, what: str) -> None:
    def safe() -> bool:
        try:
            return bool(check())
        except Exception:  # an element replaced while read: the page re-rendered
            return False

    await wait_for(safe, within_s, what, every_s=0.25,
                   detail=lambda: driver.find_element("id", "message").text)  # fmt: skip


async def test_a_drain_from_the_page_the_live_grid_the_slider_and_the_diff(
    nats_server: TestNatsServer, tmp_path: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    f = fleet(nats_server, tmp_path)
    console = None
    try:
        await f.start()
        console, base = await asyncio.to_thread(start_console, nats_server, tmp_path)
        await wait_for(lambda: call(base + "/api/fleet")[0] == 200, 30, "the console caught up")
        _, view = call(base + "/api/fleet")
        (old_node,) = holder(view)
        new_node = "node-b" if old_node == "node-a" else "node-a"
        before = view["seq"]
        d = browser
        await asyncio.to_thread(d.get, opening(base))  # the page keeps the token in its tab

        def grid_shows_m1_on(node: str) -> bool:
            return any("m1" in t and "serving" in t for t in _gpu_texts(d, node))

        await _until(d, lambda: grid_shows_m1_on(old_node), 30, f"the grid shows m1 on {old_node}")
        nodes = d.execute_script(
            "return [...document.querySelectorAll('.node')].map((e) => e.dataset.node)"
        )
        assert sorted(nodes) == ["node-a", "node-b"]
        for node in ("node-a", "node-b"):
            assert any("unhealthy: uncorrected ECC errors (3)" in t for t in _gpu_texts(d, node))
        assert not grid_shows_m1_on(new_node)
        _shot(d, "console-fleet.png")
        # The page runs under its Content-Security-Policy: its own style applies (the grid
        # above is its own script's), and a script any markup slipped in would add runs not.
        assert d.execute_script("return getComputedStyle(document.body).margin") == "0px"
        injected = d.execute_script(
            "const s = document.createElement('script'); s.textContent = 'window.hit = 1';"
            "document.body.appendChild(s); return window.hit === undefined;"
        )
        assert injected is True

        # Drain from the page: the confirmation lists the move, then the grid follows.
        _press(d, f'.node[data-node="{old_node}"] button[data-action="drain"]')
        await _until(d, lambda: d.find_element(By.ID, "confirm").get_attribute("open") is not None,
                     15, "the drain's confirmation")  # fmt: skip
        assert new_node in d.find_element(By.ID, "confirm-moves").text
        d.find_element(By.ID, "confirm-ok").click()
        await _until(d, lambda: "written at seq" in d.find_element(By.ID, "message").text, 15,
                     "the drain written")  # fmt: skip
        await _until(d, lambda: grid_shows_m1_on(new_node) and not grid_shows_m1_on(old_node),
                     60, f"the live grid shows m1 moved to {new_node}")  # fmt: skip
        (drained,) = _texts(d, f'.node[data-node="{old_node}"]')
        assert "draining" in drained
        after = call(base + "/api/fleet")[1]["seq"]

        # The slider to before the drain: the replica back on its old node.
        d.execute_script(
            "const s = document.getElementById('slider'); s.value = arguments[0];"
            "s.dispatchEvent(new Event('input'));",
            str(before),
        )
        await _until(d, lambda: f"as of seq {before}" in d.find_element(By.ID, "point").text,
                     30, "the page at the point before the drain")  # fmt: skip
        assert grid_shows_m1_on(old_node)
        assert not grid_shows_m1_on(new_node)
        assert d.find_element(By.ID, "live-flag").text == "history"
        _shot(d, "console-slider.png")

        # Mark it, go to the end, compare: the diff names the move.
        d.find_element(By.ID, "mark").click()
        goto = d.find_element(By.ID, "goto")
        goto.clear()
        goto.send_keys(str(after))
        d.find_element(By.ID, "go").click()
        await _until(d, lambda: f"as of seq {after}" in d.find_element(By.ID, "point").text,
                     30, "the page at the end")  # fmt: skip
        d.find_element(By.ID, "compare").click()
        await _until(d, lambda: d.find_elements(By.ID, "diff-text"), 30, "the diff shown")
        diff = d.find_element(By.ID, "diff-text").text
        assert old_node in diff
        assert new_node in diff

        # The drained node's timeline: a strip of its steps, the drain among them.
        _click(d, f'.node[data-node="{old_node}"] a.ref')
        await _until(d, lambda: "draining" in _texts(d, "#timeline .step"), 30,
                     f"{old_node}'s timeline strip")  # fmt: skip
        steps = _texts(d, "#timeline .step")
        assert steps[0] == "registered"
        # Its count, from the answer's X-Llmgw-Timeline-Total: all of them shown here.
        heading = d.find_element(By.CSS_SELECTOR, "#timeline > div").text
        assert re.fullmatch(rf"timeline of {old_node} \(\d+ events; a step opens that point\)",
                            heading), heading  # fmt: skip

        # A point beyond the log: a message on the page, the grid unchanged.
        goto.clear()
        goto.send_keys(str(after + 100_000))
        d.find_element(By.ID, "go").click()
        said = "beyond the end of the log"
        await _until(d, lambda: said in d.find_element(By.ID, "message").text, 15,
                     "the error on the page")  # fmt: skip
        assert "Traceback" not in d.page_source
    finally:
        if console is not None:
            console.terminate()
        await f.stop()

"""A real browser for tests: Debian's Chromium, headless, driven through Debian's
chromedriver with Selenium (.ci/run installs both; elsewhere the test is skipped)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kit import tools


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium's WebDriver, quit on the way out."""
    binary = tools.required("chromium", "apt-get install chromium")
    driver_path = tools.required("chromedriver", "apt-get install chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=driver_path)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()

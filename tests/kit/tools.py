"""External tools a test needs that pip does not install (Debian packages .ci/run installs)."""

from __future__ import annotations

import os
import shutil

import pytest


def required(name: str, install: str) -> str:
    """The path of `name`; in CI a missing tool fails the test (CI installs it), elsewhere
    it skips, saying how to install it (`install`)."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: .ci/run installs it ({install})")
        pytest.skip(f"{name} is not installed ({install})")
    return found

"""Shared fixtures of the interop tests: where the built moefit tools are."""
import os
import pathlib

import pytest


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    d = os.environ.get("MOEFIT_BUILD_DIR")
    if not d:
        pytest.skip("MOEFIT_BUILD_DIR is not set (run through launch/scripts/test.sh)")
    return pathlib.Path(d)

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


@pytest.fixture(scope="session")
def tool(build_dir) -> pathlib.Path:
    """The safetensors_tool test binary (tests/checkpoint): dump, load and export
    through moefit's checkpoint library."""
    path = build_dir / "tests" / "checkpoint" / "safetensors_tool"
    if not path.is_file():
        pytest.fail(f"{path} not found: build the safetensors_tool target first")
    return path

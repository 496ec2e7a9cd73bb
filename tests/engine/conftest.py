"""Engine tests need vLLM: they run in the engine venv through ``make test-vllm``.

Under plain ``make test`` (no vLLM in .venv) the folder is skipped, visibly. ``make test-vllm`` sets
``ULTRAQUANT_ENGINE_TESTS=1``, which turns a missing vLLM or model into a failure instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRED = os.environ.get("ULTRAQUANT_ENGINE_TESTS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REQUIRED or importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="no vLLM here: the engine tests run in `make test-vllm`")
    for item in items:
        if "tests/engine/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)

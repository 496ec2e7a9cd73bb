"""Session-wide test setup.

On a machine without a GPU the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET``
is read when a ``@triton.jit`` function is defined, so it must be set before any test module imports
a kernel; setting it here, once, keeps every test in one process on the same side (mixing interpreted
and compiled kernels in one process breaks both). Codegen compiles in subprocesses that drop it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from ultraquant import config  # noqa: E402


@pytest.fixture(autouse=True)
def _config_follows_env(monkeypatch: pytest.MonkeyPatch):
    """ULTRAQUANT_* switches are parsed once (ultraquant.config); a test that changes one through
    ``monkeypatch`` gets a re-read config, and every test starts from the real environment's."""
    config.reload()
    set_, del_ = monkeypatch.setenv, monkeypatch.delenv

    def setenv(name: str, value: str, prepend: str | None = None) -> None:
        set_(name, value, prepend)
        config.reload()

    def delenv(name: str, raising: bool = True) -> None:
        del_(name, raising)
        config.reload()

    monkeypatch.setenv = setenv
    monkeypatch.delenv = delenv
    yield
    monkeypatch.undo()
    config.reload()

"""fxfuse._C loading: a failed load names the torch the extension was built against."""

import pytest
import torch

import fxfuse
from fxfuse import _extension


def test_the_build_records_the_torch_it_was_built_against():
    if not _extension.loaded():
        pytest.skip("fxfuse._C is not built")
    assert _extension.built_against() == torch.__version__


def test_a_load_failure_under_another_torch_says_which_and_how_to_fix_it(monkeypatch):
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_load_error", OSError("fxfuse/_C.so: undefined symbol: _ZN3c10..."))
    monkeypatch.setattr(_extension, "built_against", lambda: "2.99.0")
    with pytest.raises(fxfuse.errors.ExtensionNotLoadedError) as error:
        fxfuse.optimize(torch.nn.Conv2d(1, 1, 1))
    message = str(error.value)
    assert "undefined symbol" in message
    assert f"built against torch 2.99.0, but this process runs torch {torch.__version__}" in message
    assert "pip install --no-build-isolation ." in message


def test_missing_extension_is_reported_clearly(monkeypatch):
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_load_error", ImportError("libfoo.so: cannot open shared object file"))
    with pytest.raises(fxfuse.FxFuseError, match="failed to load.*libfoo.*Rebuild"):
        fxfuse.optimize(torch.nn.Conv2d(1, 1, 1))

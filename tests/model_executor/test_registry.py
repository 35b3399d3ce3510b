"""The model registry: every entry resolves to a model class, unknown architectures are refused with the list, and
a model's module is imported only when that model is asked for."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch import nn

from pagellm.model_executor.models.registry import get_model_class, resolve_architecture, supported_architectures


@pytest.mark.parametrize("architecture", supported_architectures())
def test_every_entry_is_a_model_class(architecture):
    model_class = get_model_class(architecture)
    assert issubclass(model_class, nn.Module) and hasattr(model_class, "load_weights")


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported") as info:
        resolve_architecture(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    assert all(name in str(info.value) for name in supported_architectures())


def test_models_are_imported_only_when_asked_for():
    code = ("import sys; from pagellm.model_executor.models import registry; "
            "before = sorted(m for m in sys.modules if m.startswith('pagellm.model_executor.models.') "
            "and m != 'pagellm.model_executor.models.registry'); "
            "registry.get_model_class('Qwen3ForCausalLM'); "
            "print(before, 'pagellm.model_executor.models.qwen3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"

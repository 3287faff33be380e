"""The LoRA benchmark's adapters are folders the engine accepts: every target of every layer, at
the rank and scaling asked for."""

from pagedkv.models import ModelConfig, builtin_model_path
from pagedkv.models.lora_checkpoint import TARGETS, read_adapter
from tools.lora_ab import write_adapter


def test_the_written_adapter_passes_the_engines_check(tmp_path):
    config = ModelConfig.from_pretrained(builtin_model_path())
    spec = read_adapter(write_adapter(tmp_path / "a", config, rank=8, seed=1), config, 16)
    assert (spec.rank, spec.scaling) == (8, 2.0)
    assert set(spec.tensors) == {(layer, name) for layer in range(config.num_layers) for name in TARGETS}

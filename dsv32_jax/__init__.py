"""dsv32-jax: DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention + MoE + MTP) in JAX / Flax NNX."""

from dsv32_jax.model.config import ConfigError, ModelConfig, load_preset
from dsv32_jax.checkpoint.loading import from_pretrained
from dsv32_jax.model.transformer import Transformer
from dsv32_jax.model.options import RunOptions
from dsv32_jax.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "RunOptions", "Transformer", "from_pretrained",
           "load_preset"]

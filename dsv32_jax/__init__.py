"""dsv32-jax: DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention + MoE + MTP) in JAX / Flax NNX."""

from dsv32_jax.config import ConfigError, ModelConfig, load_preset
from dsv32_jax.loading import from_pretrained
from dsv32_jax.model import Transformer
from dsv32_jax.options import RunOptions
from dsv32_jax.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "RunOptions", "Transformer", "from_pretrained",
           "load_preset"]

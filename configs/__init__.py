"""Experiment configs (`--config=configs/<name>.py`). Installed as `dsv32_jax.configs` so that a wheel install has
them too: `dsv32_jax.train.config.CONFIGS_DIR` points here."""

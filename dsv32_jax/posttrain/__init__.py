"""Post-training pieces outside the training loop: the jitted sampler (log-probs, kept sets, routing for replay),
the chat format (`chat/`), tool environments with verifiers (`envs/`) and multi-turn agent episodes (`agent/`)."""

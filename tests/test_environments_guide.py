"""docs/environments.md: the guide's runnable code blocks (marked `<!-- runnable -->`) run in order in one namespace,
so its example environment, the failures it shows and the registration it describes stay true."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "environments.md")


def runnable_blocks(path: str) -> list[str]:
    text = open(path, encoding="utf-8").read()
    return re.findall(r"<!-- runnable -->\n```python\n(.*?)```", text, re.S)


def test_the_guide_runs(monkeypatch):
    """Mutation tried: `Tool.run` without its catch-all (a crash raises) fails the third block; a guide without
    marked blocks fails the count."""
    from dsv32_jax.posttrain.envs import registry

    monkeypatch.setattr(registry, "ENVS", dict(registry.ENVS))  # the guide registers "shop"
    blocks = runnable_blocks(GUIDE)
    assert len(blocks) >= 4, "the guide lost its runnable blocks"
    namespace = {"__name__": "environments_guide"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE}:block{i}", "exec"), namespace)  # noqa: S102 (our own documentation)
    assert namespace["ShopEnv"]().tools[0].name == "price"

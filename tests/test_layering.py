"""Import layering of the model library. dsv32_jax/ is three folders over two shared modules:

    model/       config, options, rope, fp8, layers, sharding, attention, indexer, indexer_loss, mla, moe, transformer
    checkpoint/  fp8_weights -> safetensors_io -> io_utils -> hf -> validate -> orbax_io -> loading -> convert
    posttrain/   sampler, chat/, envs/, agent/
    optional.py, and the kernels (pallas_kernels/, installed as dsv32_jax.kernels)

Checked here, on every module's imports (top-level or lazy, inside functions included): no import cycles over the
modules of dsv32_jax/ and the kernels; each folder imports only the folders it builds on (model: the kernels;
checkpoint: model; posttrain: model; nothing in dsv32_jax/ imports the training package); the checkpoint stack imports
only downward; the chat modules import only earlier chat modules and no jax / numpy.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dsv32_jax")
KERNELS = os.path.join(ROOT, "pallas_kernels")
CHECKPOINT_STACK = ["fp8_weights", "safetensors_io", "io_utils", "hf", "validate", "orbax_io", "loading", "convert"]
# folder -> the dsv32_jax folders (first dotted part) its modules may import besides their own
ALLOWED = {"model": {"kernels", "optional"}, "checkpoint": {"model", "kernels", "optional"},
           "posttrain": {"model", "kernels", "optional"}, "kernels": {"model", "optional"}, "optional": set()}


def modules() -> dict[str, str]:
    """Dotted name under dsv32_jax (e.g. 'model.mla', 'posttrain.chat.codecs', 'kernels.topk') -> file path."""
    found = {}
    for base, prefix in ((PKG, ""), (KERNELS, "kernels.")):
        for dirpath, _, files in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            parts = [] if rel == "." else rel.split(os.sep)
            for f in files:
                if f.endswith(".py"):
                    name = ".".join(parts + ([] if f == "__init__.py" else [f[:-3]]))
                    if name:
                        found[prefix + name] = os.path.join(dirpath, f)
    return found


MODULES = modules()


def package_imports(name: str) -> set[str]:
    """The dsv32_jax modules (dotted, as in MODULES) that module `name` imports anywhere in its body."""
    with open(MODULES[name]) as f:
        tree = ast.parse(f.read())
    raw = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dsv32_jax":
            mod = node.module.split(".", 1)[1] if "." in node.module else ""
            for a in node.names:  # `from dsv32_jax.model import mla` imports the module model.mla
                sub = f"{mod}.{a.name}" if mod else a.name
                raw.add(sub if sub in MODULES else mod)
        elif isinstance(node, ast.Import):
            raw.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("dsv32_jax."))
    return {m for m in raw if m in MODULES and m != name}


def graph() -> dict[str, set[str]]:
    return {m: package_imports(m) for m in MODULES}


def test_modules_found():
    assert {"model.mla", "model.transformer", "checkpoint.convert", "posttrain.sampler", "posttrain.chat.codecs",
            "posttrain.envs.lookup", "posttrain.agent.episode", "kernels.sparse_mla", "optional"} <= set(MODULES)


def test_no_import_cycles():
    g, state, cycle = graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                cycle.append(path + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycle, f"import cycles: {cycle}"


def test_folders_import_only_the_folders_below():
    bad = []
    for m, deps in graph().items():
        folder = m.split(".")[0]
        if folder not in ALLOWED:  # dsv32_jax/__init__.py (the public API) and package data modules
            continue
        for d in deps:
            if d.split(".")[0] not in ALLOWED[folder] | {folder}:
                bad.append(f"{m} imports {d}")
        with open(MODULES[m]) as f:
            if any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("dsv32_jax.train")
                   for n in ast.walk(ast.parse(f.read()))):
                bad.append(f"{m} imports the training package")
    assert not bad, bad


@pytest.mark.parametrize("module", CHECKPOINT_STACK)
def test_checkpoint_stack_imports_only_downward(module):
    higher = {f"checkpoint.{m}" for m in CHECKPOINT_STACK[CHECKPOINT_STACK.index(module) + 1:]}
    found = package_imports(f"checkpoint.{module}")
    assert not found & higher, f"checkpoint/{module}.py imports {sorted(found & higher)}"


def test_fp8_constants_defined_once():
    """FP8_MAX / the 128 weight block / the scale suffix live in model/fp8.py; no other module redefines them."""
    for m, path in MODULES.items():
        if m != "model.fp8" and not m.startswith("kernels"):
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in tree.body:
                if isinstance(node, ast.Assign):
                    names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                    value = ast.unparse(node.value)
                    assert not names & {"FP8_MAX", "SCALE_SUFFIX", "WEIGHT_BLOCK"}, f"{m} redefines {names}"
                    assert value not in ("448.0", "'_scale_inv'", '"_scale_inv"', "128"), f"{m}: {ast.unparse(node)}"


def test_public_api_from_the_top_level():
    """`import dsv32_jax` gives the same public names as before the move into folders, each the real object."""
    import dsv32_jax
    from dsv32_jax.checkpoint.loading import from_pretrained
    from dsv32_jax.checkpoint.safetensors_io import CheckpointError
    from dsv32_jax.model.config import ConfigError, ModelConfig, load_preset
    from dsv32_jax.model.options import RunOptions
    from dsv32_jax.model.transformer import Transformer
    expected = {"CheckpointError": CheckpointError, "ConfigError": ConfigError, "ModelConfig": ModelConfig,
                "RunOptions": RunOptions, "Transformer": Transformer, "from_pretrained": from_pretrained,
                "load_preset": load_preset}
    assert sorted(dsv32_jax.__all__) == sorted(expected)
    for name, obj in expected.items():
        assert getattr(dsv32_jax, name) is obj, name
    assert load_preset("tiny").num_hidden_layers >= 1  # presets found from their new place


# the chat package (dsv32_jax/posttrain/chat/): each module imports only the ones before it, nothing else of dsv32_jax, and no
# jax / numpy (environments and episode runners use it on hosts without them)
CHAT_LAYERS = ["tokens", "messages", "encoding", "parsing", "codecs"]


@pytest.mark.parametrize("module", CHAT_LAYERS)
def test_chat_modules_import_only_earlier_chat_modules(module):
    with open(os.path.join(PKG, "posttrain", "chat", f"{module}.py")) as f:
        tree = ast.parse(f.read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    earlier = {f"dsv32_jax.posttrain.chat.{m}" for m in CHAT_LAYERS[:CHAT_LAYERS.index(module)]}
    ours = {m for m in imported if m.split(".")[0] == "dsv32_jax"}
    assert ours <= earlier, f"chat/{module}.py imports {sorted(ours - earlier)}"
    assert not {m.split(".")[0] for m in imported} & {"jax", "numpy", "flax"}, f"chat/{module}.py imports jax/numpy"
    files = {m[:-3] for m in os.listdir(os.path.join(PKG, "posttrain", "chat")) if m.endswith(".py")}
    assert set(CHAT_LAYERS) == files - {"__init__"}

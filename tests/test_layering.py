"""Import layering of the model library: the modules of dsv32_jax/ import each other without cycles (lazy imports
inside functions included), and the checkpoint stack imports only downward:

    fp8 -> fp8_weights -> safetensors_io -> io_utils -> hf -> validate -> orbax_io -> loading -> convert
"""

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dsv32_jax")
CHECKPOINT_STACK = ["fp8", "fp8_weights", "safetensors_io", "io_utils", "hf", "validate", "orbax_io", "loading", "convert"]


def package_imports(name: str) -> set[str]:
    """dsv32_jax modules that dsv32_jax/<name>.py imports anywhere in its body (top-level or lazily)."""
    with open(os.path.join(PKG, f"{name}.py")) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dsv32_jax":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from dsv32_jax import x, y
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "dsv32_jax" and len(parts) > 1:
                    found.add(parts[1])
    modules = {m[:-3] for m in os.listdir(PKG) if m.endswith(".py")}
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    return {m[:-3]: package_imports(m[:-3]) for m in os.listdir(PKG) if m.endswith(".py") and m != "__init__.py"}


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


@pytest.mark.parametrize("module", CHECKPOINT_STACK)
def test_checkpoint_stack_imports_only_downward(module):
    higher = set(CHECKPOINT_STACK[CHECKPOINT_STACK.index(module) + 1:])
    assert not package_imports(module) & higher, f"{module} imports {sorted(package_imports(module) & higher)}"


def test_fp8_constants_defined_once():
    """FP8_MAX / the 128 weight block / the scale suffix live in fp8.py; no other module redefines them."""
    for m in os.listdir(PKG):
        if m.endswith(".py") and m != "fp8.py":
            with open(os.path.join(PKG, m)) as f:
                tree = ast.parse(f.read())
            for node in tree.body:
                if isinstance(node, ast.Assign):
                    names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                    value = ast.unparse(node.value)
                    assert not names & {"FP8_MAX", "SCALE_SUFFIX", "WEIGHT_BLOCK"}, f"{m} redefines {names}"
                    assert value not in ("448.0", "'_scale_inv'", '"_scale_inv"', "128"), f"{m}: {ast.unparse(node)}"


# the chat package (dsv32_jax/chat/): each module imports only the ones before it, nothing else of dsv32_jax, and no
# jax / numpy (environments and episode runners use it on hosts without them)
CHAT_LAYERS = ["tokens", "messages", "encoding", "parsing", "codecs"]


@pytest.mark.parametrize("module", CHAT_LAYERS)
def test_chat_modules_import_only_earlier_chat_modules(module):
    with open(os.path.join(PKG, "chat", f"{module}.py")) as f:
        tree = ast.parse(f.read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    earlier = {f"dsv32_jax.chat.{m}" for m in CHAT_LAYERS[:CHAT_LAYERS.index(module)]}
    ours = {m for m in imported if m.split(".")[0] == "dsv32_jax"}
    assert ours <= earlier, f"chat/{module}.py imports {sorted(ours - earlier)}"
    assert not {m.split(".")[0] for m in imported} & {"jax", "numpy", "flax"}, f"chat/{module}.py imports jax/numpy"
    files = {m[:-3] for m in os.listdir(os.path.join(PKG, "chat")) if m.endswith(".py")}
    assert set(CHAT_LAYERS) == files - {"__init__"}

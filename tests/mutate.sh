#!/usr/bin/env bash
# Runs a pytest selection against a mutated copy of the package, to show that a test fails on the broken code it
# names. The working tree is copied (without the venvs, .git and runs/) to a temporary folder, the one exact
# occurrence of OLD in FILE is replaced by NEW there, and pytest runs in the copy with the editable install
# pointed at it (a sitecustomize that rewrites setuptools' editable finder); the checkout is never touched.
#   tests/mutate.sh train/grpo_loss.py 'pg = -jnp.minimum(' 'pg = -jnp.maximum(' -- tests/test_grpo_loss.py
# Exit status: pytest's (non-zero = the mutant was caught).
set -u
file=$1; old=$2; new=$3; shift 4
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
tmp=$(mktemp -d /tmp/dsv32-mutant-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
(cd "$root" && tar --exclude=./.venv --exclude=./.venv-cuda --exclude=./.venv-cuda-lent --exclude=./.venv-tpu --exclude=./.git --exclude=./runs \
  --exclude=./.gpurun -cf - .) | tar -xf - -C "$tmp/"
"$py" - "$tmp/$file" "$old" "$new" <<'PY' || exit 2
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"tests/mutate.sh: the mutation's text occurs {text.count(old)} times in {path}, expected once")
open(path, "w").write(text.replace(old, new))
PY
mkdir -p "$tmp/.mutant-site"
cat > "$tmp/.mutant-site/sitecustomize.py" <<PY
import sys
for name, module in list(sys.modules.items()):
    if name.startswith("__editable___dsv32_jax") and hasattr(module, "MAPPING"):
        for key, path in list(module.MAPPING.items()):
            module.MAPPING[key] = path.replace("$root", "$tmp")
PY
diff -u "$root/$file" "$tmp/$file"
cd "$tmp" && PYTHONPATH="$tmp/.mutant-site" "$py" -m pytest -q -p no:cacheprovider "$@"

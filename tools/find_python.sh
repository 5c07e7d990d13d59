#!/usr/bin/env bash
# Prints a Python >= 3.12 interpreter: $PYTHON if set, else python3.13 / python3.12 on PATH (if they really run),
# else pyenv's newest installed 3.12. Exits 1 with a message when none is found.
set -u
ok() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
  if ok "$PYTHON"; then echo "$PYTHON"; exit 0; fi
  echo "PYTHON=$PYTHON is not a working Python >= 3.12" >&2; exit 1
fi
for cand in python3.13 python3.12; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then command -v "$cand"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for cand in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -rV); do
    for exe in "$cand"/bin/python3.12; do
      if [ -x "$exe" ] && ok "$exe"; then echo "$exe"; exit 0; fi
    done
  done
fi
echo "no Python >= 3.12 found: install one or pass PYTHON=/path/to/python3.12" >&2
exit 1

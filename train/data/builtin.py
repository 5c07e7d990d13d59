"""The built-in demo corpus (``data.source='builtin'``): Python's own documentation, present on every CPython
install: the pydoc help topics and the docstrings of a fixed list of stdlib modules."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings


# Stdlib modules whose docstrings form part of the built-in corpus (fixed order; import-safe everywhere).
_DOC_MODULES = (
    "abc argparse ast base64 bisect calendar collections configparser contextlib copy csv dataclasses "
    "datetime decimal difflib enum fractions functools gettext heapq hmac html.parser inspect io ipaddress "
    "itertools json logging math operator os pathlib pickle pprint queue random re sched secrets shlex "
    "shutil socket statistics string struct subprocess tarfile tempfile textwrap threading time timeit "
    "tokenize typing unittest urllib.parse uuid warnings weakref zipfile zlib"
).split()


def _module_document(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001
        return ""
    parts = [f"Module {name}\n\n{inspect.cleandoc(mod.__doc__)}" if mod.__doc__ else f"Module {name}"]
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if isinstance(obj.__doc__, str):
            parts.append(f"{name}.{attr}\n{inspect.cleandoc(obj.__doc__)}")
        if inspect.isclass(obj):
            for member, value in sorted(vars(obj).items()):
                if member.startswith("_"):
                    continue
                if inspect.isroutine(value) or isinstance(value, (property, classmethod, staticmethod)):
                    doc = getattr(value, "__doc__", None)
                    if isinstance(doc, str):
                        parts.append(f"{name}.{attr}.{member}\n{inspect.cleandoc(doc)}")
    return "\n\n".join(parts) + "\n" if len(parts) > 1 or mod.__doc__ else ""


@functools.lru_cache(maxsize=1)
def builtin_documents() -> tuple[str, ...]:
    """The built-in demo corpus: pydoc help topics (sorted by topic) then stdlib module docstrings."""
    docs: list[str] = []
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415
    except ImportError:
        topics = {}
    docs.extend(topics[key] for key in sorted(topics) if topics[key].strip())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        docs.extend(doc for doc in map(_module_document, _DOC_MODULES) if doc.strip())
    if sum(map(len, docs)) < 100_000:
        raise RuntimeError("the built-in corpus needs pydoc_data or docstrings (is Python running with -OO?); "
                           "use data.source=jsonl/parquet/arrayrecord/text instead")
    return tuple(docs)

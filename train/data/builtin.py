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


# The held-out split (data.split = "heldout"): docstrings of other stdlib modules, disjoint from the above and
# from the help topics, in the same style (held-out evaluation: train/eval.py).
_HELDOUT_MODULES = (
    "array cmath codecs codeop colorsys compileall concurrent.futures contextvars dis doctest email.message "
    "email.utils filecmp fnmatch fileinput ftplib getopt glob graphlib gzip hashlib http.client http.cookies "
    "imaplib locale lzma mailbox mimetypes numbers optparse pdb pkgutil platform plistlib poplib pstats "
    "quopri reprlib rlcompleter runpy selectors shelve signal smtplib sndhdr sqlite3 stat symtable sysconfig "
    "tabnanny trace traceback types unicodedata wave xml.dom.minidom xml.etree.ElementTree zipapp zipimport"
).split()
SPLITS = ("train", "heldout")


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


@functools.lru_cache(maxsize=2)
def builtin_documents(split: str = "train") -> tuple[str, ...]:
    """The built-in demo corpus: pydoc help topics (sorted by topic) then stdlib module docstrings; split
    "heldout": the docstrings of a disjoint list of stdlib modules (no help topics)."""
    if split not in SPLITS:
        raise ValueError(f"data.split must be one of {SPLITS}, got {split!r}")
    if split == "heldout":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            docs = tuple(doc for doc in map(_module_document, _HELDOUT_MODULES) if doc.strip())
        if sum(map(len, docs)) < 50_000:
            raise RuntimeError("the built-in held-out split needs stdlib docstrings (is Python running with -OO?)")
        return docs
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

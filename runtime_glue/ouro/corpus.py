"""The text the trained toy checkpoint learns from: what every Python installation ships.

Two sources, read without importing anything they describe: the reference manual's topics
(``pydoc_data.topics``, one document per topic) and the standard library's docstrings (one
document per ``.py`` file of the stdlib directory, its module, class and function docstrings
in source order, parsed with ``ast``: no module is imported, so nothing runs).

The split is a fixed rule on each document's name, independent of the machine's file order:
a document is held out when ``zlib.crc32(name) % HELD_OUT_MODULUS == 0`` (about one in ten),
so the held-out text is never trained on and the same Python gives the same split.
"""

from __future__ import annotations

import ast
import math
import sysconfig
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

HELD_OUT_MODULUS = 10
SPLIT_RULE = f"held out: zlib.crc32(document name) % {HELD_OUT_MODULUS} == 0"
EOS_ID = 0  # <|endoftext|> between documents
SOURCES = ("topics", "stdlib")
# stdlib folders that are tests, vendored code, or a third party's packages.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3"}


@attrs.frozen
class Document:
    name: str  # "topic:<key>" or "stdlib:<relative path>"
    text: str

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.name.encode()) % HELD_OUT_MODULUS == 0


def topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"topic:{key}", topics[key].strip()) for key in sorted(topics)]


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    found = (ast.get_docstring(n, clean=True) for n in nodes)
    return [d for d in found if d]


def stdlib_documents(root: Path | None = None) -> list[Document]:
    base = Path(root or sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            strings = _docstrings(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a template or a py2 file
            continue
        if strings:
            docs.append(Document(f"stdlib:{rel.as_posix()}", "\n\n".join(strings)))
    return docs


def documents(sources: Sequence[str] = SOURCES) -> list[Document]:
    """Every document of ``sources``, in a fixed order (topics by key, stdlib files by path)."""
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown corpus source(s) {sorted(unknown)}; choose from {SOURCES}")
    docs = topic_documents() if "topics" in sources else []
    return docs + (stdlib_documents() if "stdlib" in sources else [])


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by the module's rule."""
    return [d for d in docs if not d.held_out], [d for d in docs if d.held_out]


def token_stream(
    encode_batch: Callable[[list[str]], list[list[int]]], docs: Sequence[Document]
) -> list[int]:
    """The documents' token ids, each followed by ``EOS_ID``, in order."""
    out: list[int] = []
    for ids in encode_batch([d.text for d in docs]):
        out += [*ids, EOS_ID]
    return out


def unigram_perplexity(train_ids: Sequence[int], ids: Sequence[int], vocab: int) -> dict:
    """A unigram model of the training stream (add-one smoothed over ``vocab``) on ``ids``."""
    counts = Counter(train_ids)
    total = len(train_ids) + vocab
    nll = -sum(math.log((counts[i] + 1) / total) for i in ids) / len(ids)
    return {"tokens": len(ids), "ce": nll, "perplexity": math.exp(nll)}

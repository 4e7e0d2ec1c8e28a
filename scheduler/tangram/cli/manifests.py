"""Reading custom-resource YAML from files and directories, as ``kubectl apply -f`` does.

Embedded mode (``tangram up -f FILE_OR_DIR...``) reads the same documents that a cluster
takes. Validation is pure and lives in :mod:`tangram.api.resources`; this module only reads
files, splits them into YAML documents and says where each came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from tangram.api.documents import Document, ResourceError, Resources, parse_documents
from tangram.api.field_errors import alternatives
from tangram.cli.files import StrictLoader

SUFFIXES = (".yaml", ".yml", ".json")  # as kubectl reads a folder (JSON is YAML here)


def manifest_files(path: str | Path) -> list[Path]:
    """A file as is, or a directory's ``*.yaml``, ``*.yml`` and ``*.json`` files, sorted, not
    recursive."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
    return [p]


def read_documents(path: Path, problems: list[str]) -> list[Document]:
    """The YAML documents of one file; what cannot be read goes to ``problems``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        problems.append(f"{path}: {e.strerror or e}")
        return []
    except UnicodeDecodeError as e:
        problems.append(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})")
        return []
    return split_documents(text, str(path), problems)


def split_documents(text: str, source: str, problems: list[str]) -> list[Document]:
    """The YAML documents of ``text`` (from ``source``, for messages)."""
    documents: list[Document] = []
    stream = yaml.load_all(text, Loader=StrictLoader)  # a SafeLoader
    index = 0
    while True:
        index += 1
        try:
            content = next(stream)
        except StopIteration:
            break
        except yaml.YAMLError as e:
            problems.append(f"{source}: document {index}: not valid YAML: {_one_line(e)}")
            break
        documents.append(Document(source, index, content))
    return documents


def _one_line(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.MarkedYAMLError) and mark is not None:
        context = f" ({e.context})" if e.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}{context}"
    return " ".join(str(e).split())


def load_documents(paths: Sequence[str | Path]) -> Resources:
    """Read and validate every document of ``paths`` (files or directories).

    Empty documents are skipped, documents of other API groups (a Secret next to its pool)
    are kept in ``Resources.other``. Every problem, in every file, is raised together as one
    :class:`ResourceError`; references between documents are checked by
    ``Resources.check_references()``.
    """
    problems: list[str] = []
    documents: list[Document] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            problems.append(f"{p}: no such file or directory")
            continue
        files = manifest_files(p)
        if not files:
            problems.append(f"{p}: no {alternatives([f'*{s}' for s in SUFFIXES])} files")
        for f in files:
            documents.extend(read_documents(f, problems))
    try:
        resources = parse_documents(documents)
    except ResourceError as e:
        problems.extend(e.problems)
    if problems:
        raise ResourceError(problems)
    return resources


def load_text(text: str, source: str) -> Resources:
    """Validate the documents of one YAML text (a pushed ``pool.yaml``), as
    :func:`load_documents` does for files."""
    problems: list[str] = []
    documents = split_documents(text, source, problems)
    if not problems:
        try:
            return parse_documents(documents)
        except ResourceError as e:
            problems.extend(e.problems)
    raise ResourceError(problems)

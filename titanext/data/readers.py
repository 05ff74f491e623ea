"""Reading text files piece by piece, each piece addressed by a seekable offset.

A *unit* is the smallest piece a reader yields: one jsonl line, one parquet or arrow row, or one
chunk of a .txt file (about ``TXT_CHUNK_BYTES``, cut at a line start). ``read_units(path, offset)``
resumes exactly at a unit's offset, which is what makes the streaming loader's checkpoint a
few integers instead of a buffer.

>>> import tempfile, os
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "a.jsonl")
>>> _ = open(p, "w").write('{"text": "hi"}\\n\\n{"text": "yo"}\\n')
>>> [(u.offset, u.line, u.text, u.ends_document) for u in read_units(Path(p), "text")]
[(0, 1, 'hi', True), (16, 3, 'yo', True)]
>>> [u.text for u in read_units(Path(p), "text", offset=16, line=3)]
['yo']
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titanext.errors import ConfigError

__all__ = ["TEXT_SUFFIXES", "TXT_CHUNK_BYTES", "Unit", "check_text_file", "corpus_fingerprint",
           "import_pyarrow", "list_files", "read_units"]

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")
TXT_CHUNK_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 256
_WHITESPACE = b" \t\r\n\x0b\x0c"
_KEY = "training.dataset_path"


@dataclass(frozen=True)
class Unit:
    """One piece of text and where it starts: ``offset`` is a byte offset (.txt, .jsonl) or a
    row index (.parquet, .arrow); ``line`` the 1-based jsonl line (0 elsewhere), for error
    messages."""

    offset: int
    line: int
    text: str
    ends_document: bool


def _check_not_a_dataset_dict(path: Path, key: str) -> None:
    """A ``datasets`` DatasetDict folder holds one folder per split: reading them all as one
    corpus would mix train and test, so the user picks one."""
    marker = path / "dataset_dict.json"
    if path.is_dir() and marker.is_file():
        try:
            splits = json.loads(marker.read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        names = ", ".join(str(s) for s in splits) or "one of its split folders"
        raise ConfigError(f"{key} = {str(path)!r} is a datasets DatasetDict saved with "
                          f"save_to_disk; point it at one split folder ({names})")


def import_pyarrow():
    """``pyarrow.parquet``, or a ConfigError naming the ``data`` extra that installs it."""
    try:
        import pyarrow.parquet as pq  # optional dependency (the data extra)
    except ImportError as e:
        raise ConfigError("reading .parquet files needs pyarrow, which is not installed; install "
                          "the data extra: pip install 'titanext[data]'") from e
    return pq


def list_files(dataset_path: str | None, *, key: str = _KEY,
               suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """The files under ``dataset_path`` with one of ``suffixes``, sorted by relative path (so
    every rank and every resume sees one order); a single file is a list of one."""
    what = " or ".join(suffixes)
    if not dataset_path:
        raise ConfigError(f"{key} is not set; give a {what} file or a folder of them")
    path = Path(dataset_path)
    _check_not_a_dataset_dict(path, key)
    if not path.exists():
        raise ConfigError(f"{key} = {dataset_path!r} does not exist; give a {what} file or a "
                          "folder of them")
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise ConfigError(f"{key} = {dataset_path!r} is a folder with no {what} files")
        return files
    if path.suffix not in suffixes:
        raise ConfigError(f"{key} = {dataset_path!r} has suffix {path.suffix!r}; allowed: "
                          f"{', '.join(repr(s) for s in suffixes)} or a folder")
    return [path]


def _decode(data: bytes, path: Path, where: str, base: int = 0, key: str = _KEY) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key} file {str(path)!r}{where} is not valid UTF-8 "
                          f"(byte {base + e.start}); re-encode it as UTF-8") from e


def _txt_cut(chunk: bytes) -> int:
    """Where to end a .txt chunk: just after the last newline that a non-space byte follows, so
    a BPE pre-tokenizer sees the same words either side; else at a UTF-8 character start."""
    i = len(chunk) - 1
    while True:
        i = chunk.rfind(b"\n", 0, i)
        if i < 0:
            break
        if chunk[i + 1] not in _WHITESPACE:
            return i + 1
    j = len(chunk) - 1
    while j > 0 and 0x80 <= chunk[j] < 0xC0:  # back over continuation bytes to the lead byte
        j -= 1
    width = 4 if chunk[j] >= 0xF0 else 3 if chunk[j] >= 0xE0 else 2 if chunk[j] >= 0xC0 else 1
    return j if j + width > len(chunk) and j > 0 else len(chunk)


def _txt_units(path: Path, offset: int, key: str) -> Iterator[Unit]:
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= TXT_CHUNK_BYTES:  # the common small file: one unit, dropped when blank
            text = _decode(f.read(), path, "", key=key)
            if text.strip():
                yield Unit(0, 0, text, True)
            return
        f.seek(offset)
        pending = b""
        while True:
            # Always the bytes [offset, offset + TXT_CHUNK_BYTES): a resume at `offset` cuts the
            # same chunks as the first pass did.
            data = pending + f.read(TXT_CHUNK_BYTES - len(pending))
            if not data:
                return
            last = offset + len(data) >= size
            cut = len(data) if last else _txt_cut(data)
            yield Unit(offset, 0, _decode(data[:cut], path, "", offset, key), last)
            offset, pending = offset + cut, data[cut:]
            if last:
                return


def _jsonl_units(path: Path, field: str, offset: int, line: int, key: str) -> Iterator[Unit]:
    hint = f'each line must be an object like {{"{field}": "..."}}'
    with path.open("rb") as f:
        f.seek(offset)
        lineno = max(line, 1)
        for raw in f:
            start, offset = offset, offset + len(raw)
            where = f" line {lineno}"
            lineno += 1
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not documents
            try:
                record = json.loads(raw)
            except UnicodeDecodeError:
                _decode(raw, path, where, key=key)
                raise
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key} file {str(path)!r}{where} is not valid "
                                  f"JSON ({e.msg}); {hint}") from e
            if not isinstance(record, dict) or field not in record:
                raise ConfigError(f"{key} file {str(path)!r}{where} has no "
                                  f"\"{field}\" field (training.dataset_text_field); {hint}")
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(f"{key} file {str(path)!r}{where}: "
                                  f"\"{field}\" is a {type(text).__name__}, expected a string")
            if text.strip():
                yield Unit(start, lineno - 1, text, True)


def _string_column(schema, path: Path, field: str, key: str) -> None:
    import pyarrow as pa  # optional dependency (the data extra)

    if field not in schema.names:
        raise ConfigError(f"{key} file {str(path)!r} has no column {field!r} "
                          f"(training.dataset_text_field); its columns: {', '.join(schema.names)}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"{key} file {str(path)!r}: column {field!r} has type "
                          f"{kind}, expected a string column")


def _parquet_column(path: Path, field: str, key: str):
    """The open ParquetFile after checking that ``field`` is a string column."""
    pq = import_pyarrow()
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise ConfigError(f"{key} file {str(path)!r} is not a readable parquet "
                          f"file ({e})") from e
    _string_column(pf.schema_arrow, path, field, key)
    return pf


def _parquet_units(path: Path, field: str, row: int, key: str) -> Iterator[Unit]:
    pf = _parquet_column(path, field, key)
    meta = pf.metadata
    first_group, group_start = 0, 0  # the row group holding `row`
    while (first_group < meta.num_row_groups
           and group_start + meta.row_group(first_group).num_rows <= row):
        group_start += meta.row_group(first_group).num_rows
        first_group += 1
    if first_group == meta.num_row_groups:
        return
    groups = list(range(first_group, meta.num_row_groups))
    yield from _text_rows(pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups,
                                          columns=[field]), field, group_start, row)


def _text_rows(batches, field: str, index: int, row: int) -> Iterator[Unit]:
    """The non-blank rows of ``field`` from row ``row`` on, out of record ``batches`` whose first
    row is row ``index`` of the file; whole batches before ``row`` are skipped unread."""
    for batch in batches:
        if index + batch.num_rows <= row:
            index += batch.num_rows
            continue
        for text in batch.column(batch.schema.get_field_index(field)).to_pylist():
            if index >= row and text is not None and text.strip():
                yield Unit(index, 0, text, True)
            index += 1


def _arrow_reader(path: Path, field: str, key: str):
    """An Arrow IPC reader of ``path``: the streaming format ``datasets``' ``save_to_disk``
    writes (``data-00000-of-00004.arrow``), or the file format, memory-mapped (skipping rows on
    a resume reads nothing), after checking that ``field`` is a string column."""
    import_pyarrow()
    import pyarrow as pa  # optional dependency (the data extra)

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(source)
        except Exception as e:  # noqa: BLE001 - not Arrow IPC at all
            raise ConfigError(f"{key} file {str(path)!r} is not a readable Arrow IPC (.arrow) "
                              f"file ({e})") from e
    _string_column(reader.schema, path, field, key)
    return reader


def _arrow_units(path: Path, field: str, row: int, key: str) -> Iterator[Unit]:
    reader = _arrow_reader(path, field, key)
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
        if hasattr(reader, "get_batch") else reader  # the file format / the stream format
    yield from _text_rows(batches, field, 0, row)


def read_units(path: Path, field: str = "text", offset: int = 0, line: int = 0, *,
               key: str = _KEY) -> Iterator[Unit]:
    """The non-blank units of ``path`` from ``offset`` on (``line``: the jsonl line there);
    errors name the file as ``key`` (the config key that pointed at it)."""
    if path.suffix == ".jsonl":
        return _jsonl_units(path, field, offset, line, key)
    if path.suffix == ".parquet":
        return _parquet_units(path, field, offset, key)
    if path.suffix == ".arrow":
        return _arrow_units(path, field, offset, key)
    return _txt_units(path, offset, key)


def check_text_file(path: Path, field: str = "text", *, key: str = _KEY) -> None:
    """Cheap checks before training: a parquet file's schema, a jsonl file's first record."""
    if path.suffix == ".parquet":
        _parquet_column(path, field, key)
    elif path.suffix == ".arrow":
        _arrow_reader(path, field, key)
    elif path.suffix == ".jsonl":
        next(_jsonl_units(path, field, 0, 1, key), None)


def corpus_fingerprint(files: list[Path], root: Path) -> str:
    """A short hash of the files' relative names and sizes: a moved corpus still matches, an
    edited one (almost always) does not."""
    h = hashlib.sha256()
    for f in files:
        name = f.name if f == root else f.relative_to(root).as_posix()
        h.update(f"{name}\0{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]

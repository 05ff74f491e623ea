"""Pre-tokenize a text corpus into ``.npy`` shards, in parallel over files.

``titanext-data tokenize (--config FILE | --tokenizer SPEC) SRC DST`` reads every
.txt/.jsonl/.parquet/.arrow file under SRC in the streaming loader's order, writes one shard per
file (``DST/00000.npy``, ...: each document's ids followed by EOS, uint16 or uint32 by vocab) and
``DST/tokens.json`` (tokenizer vocab, EOS, BOS, per-shard counts). ``dataset = "tokens"`` with
``dataset_path = DST`` then trains on exactly the tokens ``dataset = "text"`` would stream
(unshuffled), without tokenizing again.

>>> import tempfile, os
>>> src, dst = tempfile.mkdtemp(), tempfile.mkdtemp() + "/out"
>>> _ = open(os.path.join(src, "a.txt"), "w").write("hello")
>>> tokenize_corpus(src, dst, tokenizer_spec=("name", "byte"), workers=1, progress=False)["tokens"]
6
"""

from __future__ import annotations

import array
import io
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from titanext.data.hf_tokenizer import HFTokenizer
from titanext.data.readers import list_files, read_units
from titanext.data.tokenizer import build_tokenizer
from titanext.data.tokens import MANIFEST, token_dtype
from titanext.errors import ConfigError

__all__ = ["load_tokenizer", "tokenize_corpus"]

_FLUSH_TOKENS = 1 << 20
_HEADER_BYTES = 128  # an .npy v1.0 header for a 1-D shape is 128 bytes for any length
_worker_tokenizer: Any = None
_worker_counter: Any = None


def load_tokenizer(spec: tuple[str, ...]) -> Any:
    """The tokenizer for ``spec``: ``("name", NAME[, HF_ASSETS])`` (a ``[model] tokenizer``
    name such as ``"byte"``, with the ``hf_assets_path`` it reads) or ``("path", DIR_OR_JSON)``
    (a Hugging Face tokenizer.json or the directory holding it). A spec is plain strings, so
    that every worker process builds its own."""

    kind, *rest = spec
    if kind == "path":
        return HFTokenizer(rest[0])
    return build_tokenizer(*rest)


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (length,)})
    header = buf.getvalue()
    assert len(header) == _HEADER_BYTES, len(header)
    return header


def _init_worker(spec: tuple[str, ...], counter: Any) -> None:
    global _worker_tokenizer, _worker_counter
    _worker_tokenizer, _worker_counter = load_tokenizer(spec), counter


def _tokenize_file(job: tuple[int, str, str, str, str]) -> tuple[int, int, int]:
    """Tokenize one source file into one shard; (index, tokens, documents)."""
    index, src, dst, field, dtype_name = job
    dtype = np.dtype(dtype_name)
    tok = _worker_tokenizer
    typecode = "H" if dtype == np.uint16 else "I"
    tokens = documents = 0
    with open(dst + ".part", "wb") as out:
        out.write(_npy_header(dtype, 0))
        buf = array.array(typecode)
        for unit in read_units(Path(src), field):
            try:
                buf.extend(tok.encode(unit.text, eos=unit.ends_document))
            except OverflowError as e:  # array('H') refuses ids above 65535
                raise ConfigError(f"{src!r}: the tokenizer produced an id that {dtype} cannot "
                                  "hold") from e
            documents += unit.ends_document
            if len(buf) >= _FLUSH_TOKENS:
                tokens += len(buf)
                if _worker_counter is not None:
                    with _worker_counter.get_lock():
                        _worker_counter.value += len(buf)
                buf.tofile(out)
                buf = array.array(typecode)
        tokens += len(buf)
        if _worker_counter is not None:
            with _worker_counter.get_lock():
                _worker_counter.value += len(buf)
        buf.tofile(out)
        out.seek(0)
        out.write(_npy_header(dtype, tokens))
    os.replace(dst + ".part", dst)
    return index, tokens, documents


class _Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, else every 10 s)."""

    def __init__(self, total_files: int, counter: Any, enabled: bool):
        self.total, self.counter, self.enabled = total_files, counter, enabled
        self.done, self.start = 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if enabled:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5 if self.tty else 10.0):
            self.draw()

    def draw(self, end: bool = False) -> None:
        if not self.enabled:
            return
        tokens = self.counter.value
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = (f"tokenize [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"files  {tokens:,} tokens  {tokens / elapsed:,.0f} tokens/s")
        sys.stderr.write(("\r" + line + ("\n" if end else "")) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        self._stop.set()
        self.draw(end=True)


def tokenize_corpus(src: str, dst: str, *, tokenizer_spec: tuple[str, ...],
                    text_field: str = "text", workers: int | None = None,
                    progress: bool = True) -> dict[str, Any]:
    """Write ``dst``'s shards and manifest for the corpus at ``src``; returns the manifest."""
    files = list_files(src, key="SRC")
    out = Path(dst)
    if out.exists() and (any(out.glob("*.npy")) or (out / MANIFEST).exists()):
        raise ConfigError(f"DST = {dst!r} already holds token shards; give an empty or new folder")
    tok = load_tokenizer(tokenizer_spec)  # fail here, once, not in every worker
    dtype = token_dtype(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(src) if Path(src).is_dir() else Path(src).parent
    jobs = [(i, str(f), str(out / f"{i:05d}.npy"), text_field, dtype.name)
            for i, f in enumerate(files)]
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    # spawned workers: a fork of a process with threads (torch's, the tokenizers library's
    # pool, a test runner's) can inherit a held lock and hang for ever (seen in CI)
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    bar = _Progress(len(jobs), counter, progress)
    results: dict[int, tuple[int, int]] = {}
    start = time.perf_counter()
    try:
        if workers == 1:
            _init_worker(tokenizer_spec, counter)
            for job in jobs:
                i, n, d = _tokenize_file(job)
                results[i] = (n, d)
                bar.done += 1
        else:
            with ctx.Pool(workers, initializer=_init_worker,
                         initargs=(tokenizer_spec, counter)) as pool:
                for i, n, d in pool.imap_unordered(_tokenize_file, jobs):
                    results[i] = (n, d)
                    bar.done += 1
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    shards = [{"file": f"{i:05d}.npy", "source": files[i].relative_to(root).as_posix(),
               "tokens": results[i][0], "documents": results[i][1]} for i in range(len(files))]
    manifest = {
        "format": "titanext-tokens/1", "dtype": dtype.name, "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id, "bos_id": getattr(tok, "bos_id", None), "text_field": text_field,
        "tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards), "shards": shards,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    manifest["seconds"] = seconds
    return manifest

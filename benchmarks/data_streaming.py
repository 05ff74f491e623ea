"""Streaming data: peak memory as the corpus grows 10x, and the tokenize CLI's throughput.

    python benchmarks/data_streaming.py rss [--mb 10] [--repeats 2]
    python benchmarks/data_streaming.py tokenize [--copies 20] [--repeats 2] [--tokenizer DIR]

``rss`` writes a jsonl corpus of ``--mb`` MB and one 10x larger, then reads each to the end of
its first epoch in a fresh process (``dataset = "text"``, byte tokenizer, seq_len 2048, batch 8)
and prints the peak RSS, the peak above the process's RSS right after imports, and the loader's
tokens/s. The in-memory packing of the same corpora (what the loader did before streaming) is
measured alongside for contrast. Variants run interleaved (small, large, small, large, ...);
the table shows medians.

``tokenize`` replicates the shipped corpus ``--copies`` times into as many files and runs
``tokenize_corpus`` with 1 worker and with one per core, interleaved; it prints tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "titanext" / "assets" / "shakespeare.txt"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def write_corpus(path: Path, megabytes: float) -> int:
    """A jsonl corpus of about ``megabytes`` MB: the shipped speeches, numbered, repeated."""
    speeches = [s for s in CORPUS.read_text(encoding="utf-8").split("\n\n") if s.strip()]
    target, size, i = int(megabytes * 2**20), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while size < target:
            line = json.dumps({"text": f"[{i}] " + speeches[i % len(speeches)]}) + "\n"
            f.write(line)
            size += len(line.encode())
            i += 1
    return size


def child(mode: str, path: str) -> None:
    """Runs in a fresh process: read the whole corpus once, print a JSON line of figures."""
    from titanext.data import build_dataloader, load_documents, pack_documents
    from titanext.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    base = _rss_mb()
    start = time.perf_counter()
    tokens = 0
    if mode == "stream":
        loader = build_dataloader(dataset="text", dataset_path=path, tokenizer=tok, seq_len=2048,
                                  local_batch_size=8, dp_rank=0, dp_degree=1, shuffle=True)
        while loader.epoch == 0:
            inputs, _ = loader.next_batch()
            tokens += inputs.numel()
    else:  # the in-memory way: every document read and packed into one tensor
        tokens = len(pack_documents(load_documents("text", path), tok))
    seconds = time.perf_counter() - start
    print(json.dumps({"base": base, "peak": _peak_mb(), "tokens": tokens,
                      "tokens_per_s": tokens / seconds}))


def run_child(mode: str, path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "_child", mode, str(path)], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_rss(mb: float, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {"1x": mb, "10x": 10 * mb}
        paths = {k: Path(tmp) / f"corpus_{k}.jsonl" for k in sizes}
        real = {k: write_corpus(paths[k], v) / 2**20 for k, v in sizes.items()}
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(repeats):
            for mode in ("stream", "in-memory"):
                for k in sizes:  # interleaved: 1x, 10x, 1x, 10x, ...
                    results.setdefault((mode, k), []).append(run_child(mode, paths[k]))

    def med(mode, k, key):
        return statistics.median(r[key] for r in results[(mode, k)])

    print(f"{'loader':<10} {'corpus':>10} {'tokens':>12} {'peak RSS MB':>12} "
          f"{'above imports':>14} {'tokens/s':>12}")
    for mode in ("stream", "in-memory"):
        for k in sizes:
            peak, base = med(mode, k, "peak"), med(mode, k, "base")
            print(f"{mode:<10} {real[k]:>8.1f}MB {int(med(mode, k, 'tokens')):>12,} "
                  f"{peak:>12.1f} {peak - base:>14.1f} {med(mode, k, 'tokens_per_s'):>12,.0f}")
        ratio = med(mode, "10x", "peak") / med(mode, "1x", "peak")
        print(f"{mode:<10} peak RSS 10x / 1x = {ratio:.3f}")


def bench_tokenize(copies: int, repeats: int, tokenizer: str) -> None:
    from titanext.data.pretokenize import tokenize_corpus

    spec = ("name", "byte") if tokenizer == "byte" else ("path", tokenizer)
    cores = os.cpu_count() or 1
    rates: dict[int, list[float]] = {1: [], cores: []}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        text = CORPUS.read_text(encoding="utf-8")
        for i in range(copies):
            (src / f"part{i:03d}.txt").write_text(text, encoding="utf-8")
        run = 0
        for _ in range(repeats):
            for workers in rates:  # interleaved
                m = tokenize_corpus(str(src), str(Path(tmp) / f"out{run}"),
                                    tokenizer_spec=spec, workers=workers,
                                    progress=False)
                rates[workers].append(m["tokens"] / m["seconds"])
                run += 1
        tokens = m["tokens"]
    print(f"tokenize {copies} copies of the shipped corpus ({tokens:,} tokens, tokenizer "
          f"{tokenizer})")
    for workers, r in rates.items():
        print(f"  workers={workers}: median {statistics.median(r):,.0f} tokens/s "
              f"(runs: {', '.join(f'{x:,.0f}' for x in r)})")


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        child(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("rss", "tokenize"))
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' or a tokenizer.json / HF directory (tokenize only)")
    args = parser.parse_args()
    if args.what == "rss":
        bench_rss(args.mb, args.repeats)
    else:
        bench_tokenize(args.copies, args.repeats, args.tokenizer)


if __name__ == "__main__":
    main()

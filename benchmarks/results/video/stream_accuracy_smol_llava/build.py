"""Build this record from the streamed video-NIAH runs (see README.md).

    python benchmarks/results/video/stream_accuracy_smol_llava/build.py /work/runs

Reads the folders of ``RUNS`` under ``<runs>`` (each a ``video-niah --stream`` output folder; the ``_rh`` ones use
the retrieval-head split), writes here ``results_<run>.jsonl.gz`` (the raw records) and ``table.md``
(per run and needle depth: correct / clips, median seconds, peak RSS, K/V held). To resume a run on a fresh machine,
unpack its ``results_<run>.jsonl.gz`` into the run folder as ``results.jsonl`` and rerun its command with ``--resume``.
"""
import gzip
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {"f1000": "stream1k/f1000", "f1000_full": "stream1k/f1000_full", "f1000_rh": "stream1k/f1000_rh",
        "f4000": "stream4k/f4000", "f4000_rh": "stream4k/f4000_rh"}


def main(runs: Path) -> None:
    header = ("| run | method | frames | needle depth | correct / clips | vision enc. (s) | LM prefill (s) | peak RSS "
              "(MiB) | K/V held (MiB) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for name, rel in RUNS.items():
        path = runs / rel / "results.jsonl"
        if not path.is_file():
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        with gzip.GzipFile(HERE / f"results_{name}.jsonl.gz", "wb", mtime=0) as f:  # rebuilds leave equal files alone
            f.write(text)
        for depth in sorted({r["extra"]["depth"] for r in records}):
            rs = [r for r in records if r["extra"]["depth"] == depth and r["status"] == "ok"]
            med = lambda xs: statistics.median(xs) if xs else float("nan")
            lines.append(
                f"| {name} | `{rs[0]['method']}` | {rs[0]['extra']['frames']} | {depth} | "
                f"{sum(bool(r['extra']['correct']) for r in rs)} / {len(rs)} | "
                f"{med([r['vision_encoder_s'] for r in rs]):.0f} | {med([r['prefill_s'] for r in rs]):.0f} | "
                f"{med([r['peak_memory_bytes'] for r in rs]) / 2**20:.0f} | "
                f"{med([r['kv_cache_bytes_final'] for r in rs]) / 2**20:.0f} |")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work/runs"))

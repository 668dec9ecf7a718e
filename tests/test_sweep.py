"""The sweep harness (:mod:`mmaccel.eval.sweep`) and the commands on it: nothing finished is ever lost.

The harness parts run without a model (fast); the acceptance tests run ``mmaccel niah`` / ``compare`` on micro-lm
with 256-token prompts: a rerun into a non-empty ``--out`` is refused and leaves the file byte-identical; a bad
argument touches nothing; SIGINT and SIGKILL mid-sweep, then ``--resume``, give the uninterrupted summary; a bad
``--out`` fails before the model loads; a merge of a partial sweep says so; a torn last line is skipped with a warning
naming the file.
"""
from __future__ import annotations

import gzip
import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mmaccel.cli import main
from mmaccel.eval import niah as niah_module
from mmaccel.eval import sweep as sw
from mmaccel.eval.sweep import Cell, check_out_dir, interleave, merge_sweeps, read_records, sweep

# A haystack file: the built-in one walks the standard library's docstrings once per process (tens of seconds on a
# busy machine), which the subprocesses here would each pay.
HAYSTACK = Path(tempfile.gettempdir()) / f"mmaccel_sweep_haystack_{os.getpid()}.txt"
NIAH = ["niah", "--model", "micro-lm", "--haystack", str(HAYSTACK), "--chat-template", "off", "--methods", "full", "streaming:window=64",
        "--lengths", "256", "--depths", "0", "1", "--trials", "2", "--max-new-tokens", "4", "--warmup", "0",
        "--threads", "1", "--no-progress"]
N_CELLS = 2 * 2 * 2
# what depends on the machine's moment, not on the cells
VOLATILE = ("ttft", "tokens_per_s", "peak_memory", "decode_s", "load_avg")


@pytest.fixture(scope="module", autouse=True)
def haystack_file():
    HAYSTACK.write_text(" ".join(f"The harbour master of town {i % 37} counted {i * 7 % 101} boats before noon, and "
                                 f"the baker on street {i % 13} sold bread to {i % 29} sailors." for i in range(400)))
    yield HAYSTACK
    HAYSTACK.unlink(missing_ok=True)


def _stable(obj):
    """``obj`` without timing, load and memory fields (at any depth)."""
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if not any(t in k for t in VOLATILE)}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _cells(n_samples=3, methods=("a", "b", "c")):
    return [Cell(m, f"s{i}", {"i": i}) for m in methods for i in range(n_samples)]


def _ok(cell):
    return {"method": cell.method, "status": "ok", "value": cell.fields["i"]}


def _count(records):
    return {"n": len(records), "ok": sum(r["status"] == "ok" for r in records)}


# ------------------------------------------------------------------------------------------------ the harness
def test_cell_ids_are_stable_and_name_every_field():
    a = Cell("snapkv:budget=64", "L=256/d=0.5/t=0", {"trial": 0, "depth": 0.5, "length": 256})
    b = Cell("snapkv:budget=64", "L=256/d=0.5/t=0", {"length": 256, "depth": 0.5, "trial": 0}, group="g", payload=1)
    assert a.id == b.id == "snapkv:budget=64|L=256/d=0.5/t=0|depth=0.5|length=256|trial=0"
    assert Cell("m", "s", {"depth": 0.25}).id != Cell("m", "s", {"depth": 0.5}).id


def test_methods_are_interleaved_per_sample_and_rotated():
    order = [(c.method, c.sample) for c in interleave(_cells())]
    assert order == [("a", "s0"), ("b", "s0"), ("c", "s0"), ("b", "s1"), ("c", "s1"), ("a", "s1"),
                     ("c", "s2"), ("a", "s2"), ("b", "s2")]
    assert [c.method for c in interleave(_cells(), rotate=False)][:6] == ["a", "b", "c", "a", "b", "c"]


def test_a_failed_cell_is_a_record_and_the_sweep_goes_on(tmp_path):
    def run(cell):
        if cell.id == "b|s1|i=1":
            raise RuntimeError("out of memory")
        return _ok(cell)

    res = sweep(_cells(), run, out=tmp_path / "o", summarize=_count, progress=False)
    rows = read_records(tmp_path / "o" / "results.jsonl")
    assert len(rows) == 9 and res.summary["sweep"] == {"expected": 9, "found": 9, "failed": 1, "complete": True}
    (bad,) = [r for r in rows if r["status"] == "failed"]
    assert bad["cell_id"] == "b|s1|i=1" and bad["error"] == "RuntimeError: out of memory" and bad["method"] == "b"
    assert [r["cell_id"] for r in res.records] == [c.id for c in _cells()]  # the result is in cell order


def test_resume_runs_only_the_missing_cells_and_refuses_another_sweep(tmp_path):
    out = tmp_path / "o"
    calls = []

    def stop_after_four(cell):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(cell.id)
        return _ok(cell)

    with pytest.raises(KeyboardInterrupt):
        sweep(_cells(), stop_after_four, out=out, config={"k": 1}, progress=False)
    assert len(read_records(out / "results.jsonl")) == 4
    ran = []
    res = sweep(_cells(), lambda c: ran.append(c.id) or _ok(c), out=out, resume=True, config={"k": 1},
                summarize=_count, progress=False)
    assert (res.ran, res.skipped, len(ran)) == (5, 4, 5) and not set(ran) & set(calls)
    assert res.summary["n"] == 9 and len(read_records(out / "results.jsonl")) == 9
    with pytest.raises(ValueError, match=r"other settings \(k differ"):
        sweep(_cells(), _ok, out=out, resume=True, config={"k": 2}, progress=False)
    with pytest.raises(ValueError, match="cells not in this sweep"):
        sweep(_cells(n_samples=2), _ok, out=out, resume=True, config={"k": 1}, progress=False)


def test_overwrite_keeps_the_old_files_until_the_first_new_record(tmp_path):
    out = tmp_path / "o"
    sweep(_cells(), _ok, out=out, summarize=_count, progress=False)
    before = _snapshot(out)

    def dies(cell):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(_cells(), dies, out=out, overwrite=True, progress=False)
    assert _snapshot(out) == before
    res = sweep(_cells(n_samples=1), _ok, out=out, overwrite=True, summarize=_count, progress=False)
    assert len(read_records(out / "results.jsonl")) == 3 and res.summary["n"] == 3


def test_check_out_dir_refuses_files_unwritable_and_non_empty_folders(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--out .* is an existing file"):
        check_out_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="cannot be created: .* is a file"):
        check_out_dir(tmp_path / "file" / "sub")
    with pytest.raises(ValueError, match="is not writable"):
        check_out_dir("/proc/mmaccel-sweep-out")  # not writable even for root
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "results.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="already holds 1 file.*--resume.*--overwrite"):
        check_out_dir(tmp_path / "full")
    with pytest.raises(ValueError, match="exclude each other"):
        check_out_dir(tmp_path / "full", resume=True, overwrite=True)
    assert check_out_dir(tmp_path / "full", resume=True) == tmp_path / "full"
    assert check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_torn_last_line_is_skipped_with_a_warning_naming_the_file_and_cut_on_resume(tmp_path, caplog):
    out = tmp_path / "o"
    sweep(_cells(), _ok, out=out, progress=False)
    path = out / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]) + lines[5][:17])  # killed while writing the sixth record
    with caplog.at_level(logging.WARNING, logger="mmaccel.eval.sweep"):
        assert len(read_records(path)) == 5
    assert str(path) in caplog.text and "torn last line" in caplog.text
    res = sweep(_cells(), _ok, out=out, resume=True, summarize=_count, progress=False)
    assert res.ran == 4 and len(read_records(path)) == 9 and path.read_text().endswith("}\n")
    path.write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[2:]))
    with pytest.raises(ValueError, match=r"results.jsonl: line 3 is not JSON"):
        read_records(path)


def test_merge_of_a_partial_sweep_says_incomplete_and_reads_gz(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    cells = _cells()
    sweep(cells[:3], _ok, out=a, progress=False)
    sweep(cells, _ok, out=b, progress=False)
    # b: compressed, its last record torn, and two more records missing (a sweep stopped early)
    raw = (b / "results.jsonl").read_text().splitlines(keepends=True)
    kept = [r for r in raw if json.loads(r)["method"] != "a"]
    with gzip.open(b / "results.jsonl.gz", "wt") as f:
        f.write("".join(kept[:3]) + kept[3][:10])
    (b / "results.jsonl").unlink()
    with caplog.at_level(logging.WARNING, logger="mmaccel.eval.sweep"):
        summary, _ = merge_sweeps([a, b], tmp_path / "m", summarize=_count)
    assert str(b / "results.jsonl.gz") in caplog.text
    assert summary["sweep"] == {"expected": 9, "found": 6, "failed": 0, "complete": False}
    assert len(read_records(tmp_path / "m" / "results.jsonl")) == 6
    with pytest.raises(ValueError, match="already holds"):
        merge_sweeps([a], tmp_path / "m", summarize=_count)


def test_shared_prefill_groups_run_together_and_fall_back_to_separate_runs(monkeypatch):
    """Cells with a group run as one ``run_group`` call per sample; without the shared module, each separately."""
    groups = []

    def run_group(cells):
        groups.append([c.id for c in cells])
        return [_ok(c) for c in cells]

    cells = [Cell(m, f"s{i}", {"i": i}, group=None if m == "a" else "shared") for m in "abc" for i in range(2)]
    res = sweep(cells, _ok, run_group=run_group, progress=False)
    assert groups == [["b|s0|i=0", "c|s0|i=0"], ["b|s1|i=1", "c|s1|i=1"]]
    assert [r["cell_id"] for r in res.records] == [c.id for c in cells]

    # run_measured_group: the shared runner when mmaccel.eval.shared exists, generate_measured per method otherwise
    seen = {}
    stub = type(sys)("mmaccel.eval.shared")
    stub.generate_shared = lambda model, tok, ids, *, methods, **kw: seen.setdefault("shared", (methods, kw)) and [
        f"record of {label}" for _, label in methods]
    monkeypatch.setitem(sys.modules, "mmaccel.eval.shared", stub)
    assert sw.run_measured_group(None, None, [1, 2], [(1, "x"), (2, "y")], max_new_tokens=2) == ["record of x",
                                                                                                  "record of y"]
    assert seen["shared"] == ([(1, "x"), (2, "y")], {"max_new_tokens": 2})
    monkeypatch.setitem(sys.modules, "mmaccel.eval.shared", None)  # import fails: separate runs
    from mmaccel.eval import generation

    monkeypatch.setattr(generation, "generate_measured",
                        lambda model, tok, ids, *, method, label, **kw: f"separate {label}")
    assert sw.run_measured_group(None, None, [1], [(1, "x"), (2, "y")]) == ["separate x", "separate y"]


def test_run_niah_sends_prefill_sharing_methods_as_one_group(monkeypatch, tmp_path):
    from mmaccel.models import load

    model, tok = load("micro-lm", device="cpu")
    monkeypatch.setattr(niah_module, "shares_prefill", lambda method: method.name != "full")
    groups = []

    def fake_group(model, tokenizer, ids, methods, **kw):
        groups.append([label for _, label in methods])
        return [niah_module.generate_measured(model, tokenizer, ids, method=m, label=label, **kw)
                for m, label in methods]

    monkeypatch.setattr(niah_module, "run_measured_group", fake_group)
    methods = ["full", "streaming:window=64", "snapkv:budget=64"]
    kw = {"max_new_tokens": 2, "warmup": 0, "progress": False, "chat_template": "off", "haystack": HAYSTACK}
    shared = niah_module.run_niah(model, tok, methods, [256], [0.5], **kw)
    assert groups == [["streaming:window=64", "snapkv:budget=64"]]
    separate = niah_module.run_niah(model, tok, methods, [256], [0.5], shared_prefill=False, **kw)
    assert len(groups) == 1
    assert [r["output_ids"] for r in shared.records] == [r["output_ids"] for r in separate.records]
    monkeypatch.undo()  # the real shared prefill (mmaccel.eval.shared): the same tokens as separate runs
    real = niah_module.run_niah(model, tok, methods, [256], [0.5], **kw)
    assert [r["output_ids"] for r in real.records] == [r["output_ids"] for r in separate.records]
    assert all(r["extra"].get("shared_with") == methods for r in real.records)  # one prefill served all three


# ------------------------------------------------------------------------------------------------- acceptance
def _niah(capsys, out: Path, *extra: str) -> tuple[int, str, str]:
    rc = main([*NIAH, "--out", str(out), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _child(argv: list[str]) -> None:
    """Run ``mmaccel ARGV`` with each record taking a second after it is written: micro-lm's cells take milliseconds,
    so without it the sweep could finish before the parent's signal arrives."""
    logging.disable(logging.CRITICAL)
    # a fresh `mmaccel` process has Python's own SIGINT handler: so does this child, whatever the pytest process has
    signal.signal(signal.SIGINT, signal.default_int_handler)
    write = sw._Sink.write

    def slow_write(self, record: dict) -> None:
        write(self, record)
        time.sleep(1.0)

    sw._Sink.write = slow_write  # this forked child's copy only
    sys.exit(main(argv))


def _launch(out: Path):
    """``mmaccel niah`` in a forked child process (the imports already done here, which a fresh interpreter would
    pay again: about a minute on a busy 2-core machine); it gets real signals like any subprocess."""
    proc = multiprocessing.get_context("fork").Process(target=_child, args=([*NIAH, "--out", str(out)],))
    proc.start()
    return proc


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


@pytest.mark.timeout(600)
def test_niah_interrupted_by_sigint_or_sigkill_then_resumed_equals_an_uninterrupted_run(capsys, tmp_path):
    runs = {"int": (tmp_path / "int", signal.SIGINT), "kill": (tmp_path / "kill", signal.SIGKILL)}
    assert main(["--version"]) == 0  # every import done before the fork
    capsys.readouterr()
    procs = {name: _launch(out) for name, (out, _) in runs.items()}
    deadline = time.monotonic() + 300
    pending = dict(procs)
    sent = {}  # name -> records written when the signal went (None: the child had already ended)
    while pending and time.monotonic() < deadline:
        for name, proc in list(pending.items()):
            out, sig = runs[name]
            if _lines(out / "results.jsonl") >= 1 or not proc.is_alive():
                sent[name] = None
                if proc.is_alive():
                    os.kill(proc.pid, sig)
                    sent[name] = _lines(out / "results.jsonl")
                del pending[name]
        time.sleep(0.005)
    rc, full_out, err = _niah(capsys, tmp_path / "whole")  # the uninterrupted run
    assert rc == 0, err
    for name, proc in procs.items():
        proc.join(timeout=120)
        assert proc.exitcode != 0, f"{name}: the sweep ended with 0 (signal sent after record {sent.get(name)})"
        out = runs[name][0]
        done = _lines(out / "results.jsonl")
        assert 1 <= done < N_CELLS, f"{name}: the signal came after {done} of {N_CELLS} cells"
        assert not (out / "summary.json").exists()
        rc, resumed_out, err = _niah(capsys, out, "--resume")
        assert rc == 0, err
        rows = read_records(out / "results.jsonl")
        assert len(rows) == N_CELLS == len({r["cell_id"] for r in rows})
        whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
        again = json.loads((out / "summary.json").read_text())
        assert _stable(again) == _stable(whole)
        assert again["sweep"] == {"expected": N_CELLS, "found": N_CELLS, "failed": 0, "complete": True}
        table = [line.split("|")[1:7] for line in resumed_out.splitlines() if line.startswith("| ")]
        assert table == [line.split("|")[1:7] for line in full_out.splitlines() if line.startswith("| ")]


def test_niah_rerun_into_a_finished_out_is_refused_and_changes_no_byte(capsys, tmp_path, monkeypatch, caplog):
    out = tmp_path / "o"
    assert _niah(capsys, out)[0] == 0
    before = _snapshot(out)
    from mmaccel import cli

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(cli, "_load_model", no_load)
    monkeypatch.setattr(cli, "_load_tokenizer", no_load)
    rc, _, err = _niah(capsys, out)
    assert rc == 2 and "already holds" in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(out) == before
    # a bad argument touches nothing: the finished folder, and a new one is not created
    for bad in (["--warmup", "-1"], ["--lengths", "0"], ["--resume", "--overwrite"]):
        rc, _, err = _niah(capsys, out, *bad)
        assert rc == 2 and err.startswith("error: "), bad
        rc, _, _ = _niah(capsys, tmp_path / "new", *bad)
        assert rc == 2 and not (tmp_path / "new").exists(), bad
    assert _snapshot(out) == before
    # merging a partial copy says so, and skips its torn last line with a warning naming the file
    part = tmp_path / "part"
    part.mkdir()
    rows = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (part / "results.jsonl").write_text("".join(rows[:5]) + rows[5][:40])
    (part / "summary.json").write_bytes(before["summary.json"])
    with caplog.at_level(logging.WARNING, logger="mmaccel.eval.sweep"):
        rc, merged_out, err = _run_cli(capsys, "niah-merge", str(part), "--out", str(tmp_path / "m"))
    assert rc == 0, err
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert summary["sweep"] == {"expected": N_CELLS, "found": 5, "failed": 0, "complete": False}
    assert "INCOMPLETE: 5 of 8 cells" in merged_out
    assert "torn last line" in caplog.text and str(part / "results.jsonl") in caplog.text


def _run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("bad", ["file", "proc"])
def test_compare_with_a_bad_out_fails_before_the_model_loads(capsys, tmp_path, monkeypatch, bad):
    from mmaccel import cli

    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(cli, "_load_model", no_load)
    monkeypatch.setattr(cli, "_load_tokenizer", no_load)
    out = tmp_path / "taken.json" if bad == "file" else Path("/proc/mmaccel-compare-out")
    if bad == "file":
        out.write_text("{}")
    start = time.perf_counter()
    rc, _, err = _run_cli(capsys, "compare", "--model", "micro-lm", "--length", "256", "--out", str(out))
    assert rc == 2 and err.startswith("error: --out ") and len(err.strip().splitlines()) == 1
    assert ("existing file" if bad == "file" else "not writable") in err
    assert time.perf_counter() - start < 5
    if bad == "file":
        assert out.read_text() == "{}"


def test_compare_writes_records_as_it_goes_and_resumes(capsys, tmp_path):
    argv = ["compare", "--model", "micro-lm", "--haystack", str(HAYSTACK), "--chat-template", "off", "--length", "256",
            "--docs", "2", "--methods", "full", "streaming:window=64", "--max-new-tokens", "4", "--warmup", "0",
            "--out", str(tmp_path)]
    rc, first, err = _run_cli(capsys, *argv)
    assert rc == 0, err
    assert first.index("| method | correct |") < first.index("wrote ")  # the table before the files
    records = read_records(tmp_path / "results.jsonl")
    assert sorted(r["method"] for r in records) == ["full", "full", "streaming:window=64", "streaming:window=64"]
    def outputs(rows):
        return sorted((r["method"], r["extra"]["depth"], r["output_ids"]) for r in rows)

    data = json.loads((tmp_path / "compare.json").read_text())
    assert outputs(data["records"]) == outputs(records)
    rc, _, err = _run_cli(capsys, *argv)
    assert rc == 2 and "already holds" in err
    rc, again, err = _run_cli(capsys, *argv, "--resume")  # every method finished: nothing runs, same table
    assert rc == 0, err
    table = [line.split("|")[1:4] for line in again.splitlines() if line.startswith("| ")]
    assert table == [line.split("|")[1:4] for line in first.splitlines() if line.startswith("| ")]
    assert read_records(tmp_path / "results.jsonl") == records
    assert outputs(json.loads((tmp_path / "compare.json").read_text())["records"]) == outputs(records)



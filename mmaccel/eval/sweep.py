"""One sweep harness for every sweep (compare, niah, video-niah, vision-sweep, spec-bench, tome-sweep): cells, one
loop, records that are never lost.

A sweep is a list of :class:`Cell` (method x sample x setting), a ``run`` callable that turns one cell into one record
(a JSON-serialisable dict, usually ``RunRecord.to_dict()``) and a ``summarize`` callable that turns the records into
the summary. :func:`sweep` does everything else::

    check_out_dir(out, resume=args.resume, overwrite=args.overwrite)     # 1. before the model loads
    model, tokenizer = load(...)                                          # 2.
    cells = [Cell(label, sample=f"doc{i}", fields={"length": n, "trial": i}) for ... ]
    result = sweep(cells, run=lambda cell: my_run(cell), out=out, resume=args.resume, overwrite=args.overwrite,
                   summarize=my_summary, report=lambda s: print(my_table(s)), write_extra=my_plots)

What the harness guarantees
---------------------------
* **Stable ids.** A cell's :attr:`Cell.id` is a deterministic string of its method, sample and fields (setting), so a
  rerun with the same arguments builds the same ids. Every record gets ``record["cell_id"]``.
* **Nothing finished is lost.** Records are appended to ``results.jsonl`` (one JSON object a line), flushed and
  ``os.fsync``'ed as each cell finishes. ``summary.json``, ``sweep.json`` and plots are written atomically
  (:func:`write_atomic`, :func:`save_figure`: a temp file in the same folder, fsync, ``os.replace``).
* **``--out`` is checked first.** :func:`check_out_dir` (call it before the model loads; it writes nothing) refuses an
  ``--out`` that is a file or unwritable, and a non-empty one unless ``resume`` or ``overwrite``:

  - ``resume=True``: the finished cells are read back from ``results.jsonl`` (and the shard folders of a sharded
    run); they are skipped and the rest run. A torn last line (a process killed mid-write) is skipped with a warning
    naming the file, and cut off before the first new record is appended. A record whose ``status`` is ``"failed"``
    counts as finished (it is a result); delete its line to retry it. Resuming with another configuration (the
    ``config`` given to :func:`sweep`, kept in ``sweep.json``) or with cells that are not in this sweep is refused.
  - ``overwrite=True``: the old sweep files (:data:`SWEEP_OUTPUTS`) are deleted only when the first new record is
    ready to be written, so a run that fails before it produced anything (a bad model name, out of memory while
    loading) leaves the old results in place.
* **Methods interleaved per sample.** Cells run sample by sample; within a sample, every method, their order rotated
  by one per sample (:func:`interleave`), so load drift on a shared machine hits every method alike.
* **A failed cell is a record** (``status="failed"``, ``error="Type: message"``) and the sweep goes on.
* **A progress bar with an ETA** (tqdm, on stderr; ``progress=None`` shows it only on a terminal).
* **The table before the files**: ``report(summary)`` is called before ``summary.json`` and the plots are written.
* **Sharding.** Given an accelerate ``state`` with N > 1 processes (:func:`process_state`, under ``accelerate launch``
  or ``torchrun``), unit ``i`` of the interleaved list (a cell, or a group, below) goes to process ``i % N``
  (:func:`shard_cells`; the same split when resumed). Each process appends to ``shard-{k}-of-{N}/results.jsonl`` (:func:`shard_dir`); once all have
  finished, the main process merges them in cell order into ``results.jsonl`` and writes the summary, so the files
  equal a one-process run's except for timings. The output folder must be shared by the processes.
* **Groups.** Cells of one sample with the same :attr:`Cell.group` (not ``None``) run as one call
  ``run_group(cells) -> list of records`` (e.g. several KV methods sharing one prefill,
  :func:`run_measured_group`); without ``run_group`` they run one by one, and a group of one runs through ``run``.
* **Merging.** :func:`merge_sweeps` reads several output folders (``results.jsonl`` or ``results.jsonl.gz``), checks
  the cells found against the cells expected (their ``sweep.json``), and says ``"complete": false`` in the summary's
  ``"sweep"`` block when some are missing.

Output folder
-------------
``results.jsonl``
    One record per cell, in the order the cells finished (a merged sharded run: in cell order).
``sweep.json``
    ``{"config": {...}, "cells": [cell ids]}``: what the sweep was asked to do (the expected cells of a merge).
``summary.json``
    ``summarize(records)`` plus a ``"sweep"`` block: ``{"expected", "found", "failed", "complete"}``.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RESULTS = "results.jsonl"
SUMMARY = "summary.json"
MANIFEST = "sweep.json"
SWEEP_OUTPUTS = (RESULTS, RESULTS + ".gz", SUMMARY, MANIFEST, "compare.json", "heatmap_*.png", "shard-*-of-*")
"""Glob patterns of the files a sweep writes into its folder: what ``overwrite=True`` deletes (nothing else)."""


# ------------------------------------------------------------------------------------------------------------ cells
def _fmt(value) -> str:
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class Cell:
    """One unit of a sweep: a method on a sample under a setting.

    Attributes
    ----------
    method : str
        The method's label (e.g. ``"snapkv:budget=256"``); ``record["method"]`` of its record.
    sample : str
        Which input (e.g. ``"L=4096/d=0.5/t=0"``); cells with the same sample are interleaved together.
    fields : mapping
        The setting and the sample's identifying facts (JSON scalars or lists), part of the id; e.g.
        ``{"length": 4096, "depth": 0.5, "trial": 0}``.
    group : str or None
        Cells of one sample with the same group run as one ``run_group`` call (e.g. ``"shared-prefill"``); not part
        of the id, so a sweep resumed with grouping off skips the same cells.
    payload : Any
        Whatever the run callable needs (e.g. ``(method_object, sample)``); not part of the id, not written.
    """

    method: str
    sample: str
    fields: Mapping = field(default_factory=dict)
    group: str | None = None
    payload: Any = field(default=None, compare=False, repr=False)

    @property
    def id(self) -> str:
        """Deterministic id: ``method|sample|key=value|...`` (fields sorted by key; floats by ``repr``)."""
        parts = [self.method, self.sample] + [f"{k}={_fmt(self.fields[k])}" for k in sorted(self.fields)]
        return "|".join(parts)


def interleave(cells: Sequence[Cell], *, rotate: bool = True) -> list[Cell]:
    """Order cells sample by sample (samples in first-appearance order); within a sample, by method, the method order
    rotated by one per sample when ``rotate`` (sample ``s`` starts with method ``s % M``), so each method runs early
    and late alike. Cells of one method on one sample keep their given order.

    Parameters
    ----------
    cells : sequence of Cell

    Returns
    -------
    list of Cell
        The same cells, reordered.
    """
    methods = list(dict.fromkeys(c.method for c in cells))
    samples = list(dict.fromkeys(c.sample for c in cells))
    s_index = {s: i for i, s in enumerate(samples)}
    m_index = {m: i for i, m in enumerate(methods)}
    n = max(len(methods), 1)

    def key(item):
        pos, c = item
        s = s_index[c.sample]
        m = (m_index[c.method] - (s if rotate else 0)) % n
        return s, m, pos

    return [c for _, c in sorted(enumerate(cells), key=key)]


def _units(cells: Sequence[Cell], grouped: bool) -> list[list[Cell]]:
    """Interleaved cells cut into run units: a group's cells (same sample, same group) together, at the place of the
    group's first cell; every other cell alone."""
    units: list[list[Cell]] = []
    where: dict[tuple, list[Cell]] = {}
    for c in cells:
        if grouped and c.group is not None:
            key = (c.sample, c.group)
            if key in where:
                where[key].append(c)
                continue
            where[key] = [c]
            units.append(where[key])
        else:
            units.append([c])
    return units


# --------------------------------------------------------------------------------------------------------- out dir
def check_out_dir(out, *, resume: bool = False, overwrite: bool = False, flag: str = "--out") -> Path:
    """Check an output folder before anything is loaded or written; creates nothing and leaves nothing behind (the
    write test is a temp file, deleted at once).

    Parameters
    ----------
    out : str or os.PathLike
        The folder (it need not exist yet).
    resume, overwrite : bool
        What to do when it holds files: finish the sweep there, or replace its sweep files (see the module docstring).
    flag : str
        The option name used in the error messages.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        ``resume`` and ``overwrite`` together; ``out`` is an existing file (or a file is on its path); the folder (or
        its nearest existing parent) is not writable; the folder is not empty and neither ``resume`` nor ``overwrite``
        is set. Each message names ``flag`` and the fix.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: resume keeps the finished results, overwrite "
                         "replaces them; pass one")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is an existing file, not a folder; pass a folder path")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {str(probe)!r} is a file; pass a folder path")
    denied = not os.access(probe, os.W_OK | os.X_OK)
    if not denied:  # os.access says yes to root everywhere: try a temp file (deleted at once) where it would go
        try:
            with tempfile.TemporaryFile(dir=probe):
                pass
        except OSError:
            denied = True
    if denied:
        raise ValueError(f"{flag} {str(path)!r} is not writable ({str(probe)!r} denies writing); pass a folder you "
                         "can write to")
    if path.is_dir() and not (resume or overwrite):
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise ValueError(f"{flag} {str(path)!r} already holds {len(entries)} file(s) ({shown}); pass --resume to "
                             "finish that sweep, --overwrite to replace it, or another " + flag)
    return path


# ------------------------------------------------------------------------------------------------- atomic writing
def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_atomic(path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temp file in the same folder, flushed and fsynced, then
    ``os.replace``; a reader sees the old file or the new one, never a part. Parent folders are created.

    Returns
    -------
    pathlib.Path
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_json(path, obj, indent: int = 2) -> Path:
    """:func:`write_atomic` of ``json.dumps(obj, indent=indent)`` plus a newline."""
    return write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def save_figure(fig, path, **kwargs) -> Path:
    """Save a matplotlib figure as a PNG atomically (rendered in memory, then :func:`write_atomic`)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", **kwargs)
    return write_atomic(path, buf.getvalue())


# ------------------------------------------------------------------------------------------------------- reading
def _record_file(folder: Path) -> Path | None:
    for name in (RESULTS, RESULTS + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_records(path) -> list[dict]:
    """The records of a ``results.jsonl`` or ``results.jsonl.gz`` file.

    A torn last line (a process killed while writing it) is skipped with a warning naming the file; a bad line
    anywhere else is an error.

    Returns
    -------
    list of dict

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        A line other than the last is not JSON (the message names the file and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a folder written by a sweep's --out")
    if path.suffix == ".gz":
        raw = _gunzip_what_is_there(path)
    else:
        raw = path.read_bytes()
    lines = raw.decode("utf-8", errors="replace").split("\n")
    records = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == last:
                logger.warning("%s: skipped a torn last line (line %d, %d bytes; a run stopped while writing it)",
                               path, i + 1, len(line))
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON ({exc}); repair or delete that line") from exc
    return records


def _gunzip_what_is_there(path: Path) -> bytes:
    """The bytes of a (possibly multi-member) gzip file; a stream cut off is read as far as it goes, with a warning
    naming the file."""
    data, out = path.read_bytes(), []
    while data:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out.append(d.decompress(data))
        except zlib.error as exc:
            logger.warning("%s: a damaged compressed stream (%s); reading what came before it", path, exc)
            break
        if not d.eof:
            logger.warning("%s is truncated (the compressed stream is cut off); reading what is there", path)
            break
        data = d.unused_data
    return b"".join(out)


def _torn_tail(path: Path) -> int | None:
    """Byte offset where a torn last line starts (``None`` when the file ends with a complete line)."""
    raw = path.read_bytes()
    if not raw or raw.endswith(b"\n"):
        return None
    start = raw.rfind(b"\n") + 1
    try:
        json.loads(raw[start:])
        return None  # complete record, only the newline is missing
    except json.JSONDecodeError:
        return start


def _shard_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("shard-*-of-*") if p.is_dir())


def finished_records(out) -> dict[str, dict]:
    """The records already in a sweep folder (its ``results.jsonl`` and its shard folders'), by cell id (the first of
    duplicates wins); records without ``cell_id`` (older sweeps) are skipped."""
    out = Path(out)
    found: dict[str, dict] = {}
    for folder in [out, *_shard_folders(out)]:
        path = _record_file(folder)
        if path is None:
            continue
        for r in read_records(path):
            if "cell_id" in r:
                found.setdefault(r["cell_id"], r)
    return found


# ------------------------------------------------------------------------------------------------------ sharding
BARRIER_TIMEOUT = datetime.timedelta(days=7)
"""How long a process of a sharded sweep waits for the others (shards finish at different times; torch's default
of 30 minutes (gloo) or 10 minutes (NCCL) would end a long sweep). When one process fails, the launcher (torchrun)
stops the others, so they do not wait this long."""


def process_state(device="auto", *, timeout: datetime.timedelta = BARRIER_TIMEOUT):
    """accelerate's ``PartialState`` of this process, set up for a sweep on ``device``.

    On a machine without CUDA, ``accelerate launch --multi_gpu --num_processes N`` starts N local processes through
    torchrun, as on GPUs; they join one gloo group only when ``PartialState`` is told to use the CPU, so ``cpu`` is
    set from ``device`` (``"cpu"``, or ``"auto"`` without CUDA).
    The state is process-wide: the first call sets it up (and ``timeout``, the wait at barriers), later calls return it.

    Parameters
    ----------
    device : str or torch.device
        ``"auto"``, ``"cpu"`` or ``"cuda[:N]"``, as in :func:`mmaccel.models.load`.
    timeout : datetime.timedelta
        Longest wait at a barrier (default :data:`BARRIER_TIMEOUT`).

    Returns
    -------
    accelerate.PartialState
        ``num_processes``, ``process_index``, ``is_main_process``, ``device``, ``wait_for_everyone()``.
    """
    import torch
    from accelerate import PartialState

    cpu = str(device).startswith("cpu") or not torch.cuda.is_available()
    return PartialState(cpu=cpu, timeout=timeout)


def shard_cells(cells: Sequence, num_processes: int, process_index: int) -> list:
    """The cells (or units) one process of a sharded sweep runs: item ``i`` goes to process ``i % num_processes``.

    Every process passes the same list in the same order, so the shards are disjoint and cover every item once.

    Parameters
    ----------
    cells : sequence
        All items, in the single-process order.
    num_processes : int
        Number of processes (>= 1).
    process_index : int
        This process, in ``[0, num_processes)``.

    Returns
    -------
    list
        ``cells[process_index::num_processes]``.

    Raises
    ------
    ValueError
        If ``num_processes < 1`` or ``process_index`` is outside ``[0, num_processes)``.
    """
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(f"process_index must be in [0, num_processes) with num_processes >= 1, got process "
                         f"{process_index} of {num_processes}")
    return list(cells)[process_index::num_processes]


def shard_dir(out_dir, process_index: int, num_processes: int) -> Path:
    """The folder of one shard of a sharded sweep: ``out_dir/shard-{k}-of-{N}``."""
    return Path(out_dir) / f"shard-{process_index}-of-{num_processes}"


class _SingleProcess:
    num_processes = 1
    process_index = 0
    is_main_process = True

    def wait_for_everyone(self) -> None:
        return None


# --------------------------------------------------------------------------------------------------------- sweep
@dataclass
class SweepResult:
    """The outcome of :func:`sweep`.

    Attributes
    ----------
    records : list of dict
        Every record of the sweep (resumed ones included) in cell order; in a sharded sweep, on the non-main processes,
        only this shard's.
    summary : dict or None
        ``summarize(records)`` plus the ``"sweep"`` block (``None`` without ``summarize``, and on non-main processes).
    out_dir : pathlib.Path or None
    ran, skipped : int
        Cells run now, and cells skipped because ``results.jsonl`` already had them (resume).
    process_index, num_processes : int
    """

    records: list
    summary: dict | None = None
    out_dir: Path | None = None
    ran: int = 0
    skipped: int = 0
    process_index: int = 0
    num_processes: int = 1


def failed_record(cell: Cell, exc: BaseException) -> dict:
    """The record of a cell whose run raised: ``RunRecord`` fields with ``status="failed"`` and the error text,
    ``extra`` = the cell's fields."""
    from .generation import RunRecord

    rec = RunRecord(method=cell.method, status="failed", error=f"{type(exc).__name__}: {exc}".strip(),
                    extra=dict(cell.fields))
    return rec.to_dict()


class _Sink:
    """Appends records to one ``results.jsonl``: opened at the first record (after the overwrite clean-up and the
    torn-tail cut), each line flushed and fsynced."""

    def __init__(self, path: Path, before_first: Callable[[], None]):
        self.path, self.before_first, self.f = path, before_first, None

    def write(self, record: dict) -> None:
        if self.f is None:
            self.before_first()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                cut = _torn_tail(self.path)
                if cut is not None:
                    logger.warning("%s: cutting a torn last line (%d bytes) before appending",
                                   self.path, self.path.stat().st_size - cut)
                    with open(self.path, "r+b") as f:
                        f.truncate(cut)
                elif self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
                    with open(self.path, "ab") as f:
                        f.write(b"\n")
            self.f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across cells, closed by close()
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _remove_outputs(out: Path, keep_shards_of: int | None = None) -> None:
    """Delete the sweep files (:data:`SWEEP_OUTPUTS`) in ``out``, except the shard folders of ``keep_shards_of``
    processes (those of the running sweep)."""
    for pattern in SWEEP_OUTPUTS:
        for p in out.glob(pattern):
            if keep_shards_of is not None and p.name.endswith(f"-of-{keep_shards_of}"):
                continue
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)


def _check_manifest(out: Path, config: Mapping | None, ids: set[str], found: Mapping[str, dict]) -> None:
    """Refuse to resume a sweep with another configuration or other cells (before anything is written)."""
    manifest = out / MANIFEST
    if config is not None and manifest.is_file():
        old = json.loads(manifest.read_text(encoding="utf-8")).get("config", {})
        new = json.loads(json.dumps(dict(config)))
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if diff:
            raise ValueError(f"--resume: {out} holds a sweep with other settings ({', '.join(diff)} differ: "
                             f"{ {k: old.get(k) for k in diff} } there, { {k: new.get(k) for k in diff} } now); "
                             "pass the same arguments, or --overwrite")
    foreign = sorted(set(found) - ids)
    if foreign:
        raise ValueError(f"--resume: {out} holds {len(foreign)} record(s) of cells not in this sweep (e.g. "
                         f"{foreign[0]!r}); pass the same arguments, or --overwrite")


def sweep(
    cells: Sequence[Cell],
    run: Callable[[Cell], dict],
    *,
    out=None,
    resume: bool = False,
    overwrite: bool = False,
    summarize: Callable[[list[dict]], dict] | None = None,
    report: Callable[[dict], None] | None = None,
    write_extra: Callable[[Path, dict, list[dict]], Any] | None = None,
    run_group: Callable[[list[Cell]], list[dict]] | None = None,
    config: Mapping | None = None,
    state=None,
    progress: bool | None = True,
    desc: str = "sweep",
    rotate: bool = True,
    on_error: Callable[[Cell, BaseException], dict] = failed_record,
) -> SweepResult:
    """Run every cell once (methods interleaved per sample), append each record to ``out/results.jsonl`` as it
    finishes, then summarize and write the summary atomically. See the module docstring for the guarantees.

    Parameters
    ----------
    cells : sequence of Cell
        Every cell of the sweep (ids must be unique). The same arguments must give the same cells.
    run : callable ``(Cell) -> dict``
        Runs one cell; returns its record (JSON-serialisable; ``"method"`` and ``"status"`` expected). An exception
        becomes ``on_error(cell, exc)`` (a ``status="failed"`` record) and the sweep goes on.
    out : path, optional
        The output folder (checked with :func:`check_out_dir` here too; call that earlier, before loading a model).
        ``None``: nothing is written (and no sharding).
    resume, overwrite : bool
        What to do with a non-empty ``out`` (module docstring).
    summarize : callable ``(records) -> dict``, optional
        The summary, from every record in cell order. ``summary["sweep"]`` is added: ``{"expected", "found",
        "failed", "complete"}``.
    report : callable ``(summary) -> None``, optional
        Called (on the main process) before ``summary.json`` and the plots are written, e.g. to print the table.
    write_extra : callable ``(out, summary, records)``, optional
        Writes further files (plots: use :func:`save_figure`), after ``summary.json``.
    run_group : callable ``(list of Cell) -> list of dict``, optional
        Runs the cells of one sample that share a ``group``, returning one record per cell in the order given. An
        exception fails every cell of the group. Without it, grouped cells run one by one.
    config : mapping, optional
        The sweep's settings (JSON-serialisable), kept in ``sweep.json``; resuming with other settings is refused.
    state : accelerate.PartialState, optional
        Shard over its processes (:func:`process_state`); default one process.
    progress : bool or None
        The progress bar (tqdm, stderr, with ETA); ``None``: only on a terminal.
    desc : str
        The progress bar's label.
    rotate : bool
        Rotate the method order per sample (:func:`interleave`).
    on_error : callable ``(Cell, exception) -> dict``
        The record of a failed cell (default :func:`failed_record`).

    Returns
    -------
    SweepResult

    Raises
    ------
    ValueError
        Duplicate cell ids; a bad ``out`` (:func:`check_out_dir`); resuming a folder whose settings or cells differ;
        a sharded sweep without ``out``. All before any cell runs or any file is touched.
    RuntimeError
        In a sharded sweep, if the merged shards do not hold every cell (e.g. another sweep wrote into the folder).
    """
    cells = list(cells)
    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"cell ids must be unique; {dup!r} appears more than once (add the distinguishing field)")
    state = state or _SingleProcess()
    n_proc, rank = state.num_processes, state.process_index
    if n_proc > 1 and out is None:
        raise ValueError(f"a sweep sharded over {n_proc} processes needs out (a folder every process can see), "
                         "where the shards are merged")
    out = check_out_dir(out, resume=resume, overwrite=overwrite) if out is not None else None
    found = finished_records(out) if out is not None and resume and out.is_dir() else {}
    if out is not None and resume:
        _check_manifest(out, config, set(ids), found)
    state.wait_for_everyone()  # every process has read the finished set before anyone appends

    # Shard the whole interleaved list, then drop the finished cells: a cell goes to the same process whether or not
    # the sweep is resumed.
    units = _units(interleave(cells, rotate=rotate), grouped=run_group is not None)
    mine = [u for u in ([c for c in unit if c.id not in found] for unit in shard_cells(units, n_proc, rank)) if u]
    run_dir = None if out is None else (shard_dir(out, rank, n_proc) if n_proc > 1 else out)

    def clear_old():
        """With ``overwrite``: this process's old shard records; on the main process the old top-level files and
        shard folders of another process count (the current count's belong to the running processes)."""
        if not overwrite:
            return
        if n_proc > 1:
            (run_dir / RESULTS).unlink(missing_ok=True)
        if state.is_main_process:
            _remove_outputs(out, keep_shards_of=n_proc if n_proc > 1 else None)

    def before_first():
        clear_old()
        if state.is_main_process:
            write_json(out / MANIFEST, {"config": dict(config or {}), "cells": ids})

    sink = _Sink(run_dir / RESULTS, before_first) if run_dir is not None else None
    new: dict[str, dict] = {}
    from tqdm.auto import tqdm

    label = desc if n_proc == 1 else f"{desc} {rank + 1}/{n_proc}"
    bar = tqdm(total=sum(len(u) for u in mine), desc=label, unit="cell", disable=None if progress is None else
               not progress, dynamic_ncols=True)
    try:
        for unit in mine:
            bar.set_postfix_str(f"{unit[0].sample} {'+'.join(c.method for c in unit)}"[:60])
            if len(unit) == 1:  # a group of one is a plain cell
                try:
                    recs = [run(unit[0])]
                except Exception as exc:  # noqa: BLE001 - a failed cell is a record
                    logger.warning("cell %s failed: %s", unit[0].id, exc)
                    recs = [on_error(unit[0], exc)]
            else:
                try:
                    recs = list(run_group(unit))
                    if len(recs) != len(unit):
                        raise RuntimeError(f"run_group returned {len(recs)} records for {len(unit)} cells")
                except Exception as exc:  # noqa: BLE001
                    logger.warning("group %s on %s failed: %s", unit[0].group, unit[0].sample, exc)
                    recs = [on_error(c, exc) for c in unit]
            for c, rec in zip(unit, recs):
                rec = dict(rec)
                rec["cell_id"] = c.id
                if sink is not None:
                    sink.write(rec)
                new[c.id] = rec
                bar.update(1)
    finally:
        bar.close()
        if sink is not None:
            sink.close()

    if sink is not None and sink.f is None:  # this process ran nothing: the old files go now
        before_first()
    skipped = len(found)
    if n_proc > 1:
        state.wait_for_everyone()
        if not state.is_main_process:
            mine_ids = [c.id for u in mine for c in u]
            return SweepResult(records=[new[i] for i in mine_ids], out_dir=run_dir, ran=len(new), skipped=skipped,
                               process_index=rank, num_processes=n_proc)
        everything = dict(found)
        for k in range(n_proc):
            path = shard_dir(out, k, n_proc) / RESULTS
            if path.is_file():
                for r in read_records(path):
                    everything.setdefault(r.get("cell_id"), r)
        missing = [i for i in ids if i not in everything]
        if missing:
            raise RuntimeError(f"the shards in {out} hold no record of {len(missing)} of {len(ids)} cells (e.g. "
                               f"{missing[0]!r}); was another sweep writing into the same folder?")
    else:
        everything = {**found, **new}
    records = [everything[i] for i in ids if i in everything]
    summary = None
    if summarize is not None:
        summary = summarize(records)
        summary["sweep"] = sweep_block(len(ids), records)
        if report is not None:
            report(summary)
    if out is not None and state.is_main_process:
        if n_proc > 1:
            write_atomic(out / RESULTS, "".join(json.dumps(r) + "\n" for r in records))
        if summary is not None:
            write_json(out / SUMMARY, summary)
        if write_extra is not None:
            write_extra(out, summary, records)
    return SweepResult(records=records, summary=summary, out_dir=out, ran=len(new), skipped=skipped,
                       process_index=rank, num_processes=n_proc)


def sweep_block(expected: int, records: Sequence[dict]) -> dict:
    """The ``summary["sweep"]`` block: ``{"expected", "found", "failed", "complete"}`` (cell counts)."""
    found = len(records)
    failed = sum(r.get("status") == "failed" for r in records)
    return {"expected": expected, "found": found, "failed": failed, "complete": found >= expected}


# --------------------------------------------------------------------------------------------------------- merge
@dataclass
class Merged:
    """Records of several sweep folders (:func:`read_sweeps`).

    Attributes
    ----------
    records : list of dict
    configs : list of dict
        Each folder's ``summary.json`` ``config`` (folders without one are left out).
    expected : list of str
        The cell ids the folders' ``sweep.json`` expect (empty when no folder has one).
    missing : list of str
        Expected cell ids with no record.
    """

    records: list
    configs: list
    expected: list
    missing: list

    @property
    def complete(self) -> bool:
        return not self.missing


def read_sweeps(in_dirs: Sequence, key: Callable[[dict], Any] | None = None) -> Merged:
    """Read the records (``results.jsonl`` or ``results.jsonl.gz``; a torn last line skipped with a warning naming the
    file) and the expected cells of several sweep folders, in the order given.

    Parameters
    ----------
    in_dirs : sequence of path
    key : callable ``(record) -> hashable``, optional
        What identifies a cell in records without ``cell_id`` (older sweeps); default ``record["cell_id"]``.

    Returns
    -------
    Merged

    Raises
    ------
    FileNotFoundError
        If a folder has no ``results.jsonl`` (nor ``.gz``).
    ValueError
        If the same cell appears in two folders (or twice in one).
    """
    records, configs, expected = [], [], []
    for d in in_dirs:
        d = Path(d)
        path = _record_file(d)
        if path is None:
            raise FileNotFoundError(f"{d / RESULTS} does not exist; pass folders written by a sweep's --out")
        records += read_records(path)
        if (d / SUMMARY).is_file():
            configs.append(json.loads((d / SUMMARY).read_text(encoding="utf-8")).get("config", {}))
        if (d / MANIFEST).is_file():
            expected += json.loads((d / MANIFEST).read_text(encoding="utf-8")).get("cells", [])
    ident = key or (lambda r: r.get("cell_id"))
    keys = [ident(r) for r in records]
    seen: set = set()
    for k in keys:
        if k is not None and k in seen:
            raise ValueError(f"the sweeps overlap: cell {k!r} appears twice")
        seen.add(k)
    expected = list(dict.fromkeys(expected))
    have = {r.get("cell_id") for r in records}
    missing = [i for i in expected if i not in have]
    return Merged(records=records, configs=configs, expected=expected, missing=missing)


def merge_sweeps(in_dirs: Sequence, out, *, summarize: Callable[[list[dict]], dict],
                 expected: int | None = None, key: Callable[[dict], Any] | None = None,
                 report: Callable[[dict], None] | None = None,
                 write_extra: Callable[[Path, dict, list[dict]], Any] | None = None,
                 overwrite: bool = False) -> tuple[dict, list[dict]]:
    """Merge several sweep folders into ``out``: ``results.jsonl``, ``summary.json`` (with the ``"sweep"`` block
    saying whether every expected cell was found) and ``write_extra``'s files, all written atomically.

    Parameters
    ----------
    in_dirs : sequence of path
    out : path
        The output folder; it may not be one of ``in_dirs`` (their records would be replaced).
    summarize : callable ``(records) -> dict``
    expected : int, optional
        How many cells the merged sweep should hold; default the number of cell ids in the folders' ``sweep.json``
        (or the records found, when no folder has one).
    key, report, write_extra
        As in :func:`read_sweeps` and :func:`sweep`.
    overwrite : bool
        Replace the sweep files of a non-empty ``out`` (otherwise it is refused).

    Returns
    -------
    (summary, records)

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`read_sweeps`; ``out`` is one of ``in_dirs``, a file, unwritable, or not empty without
        ``overwrite`` (all before anything is written).
    """
    out = Path(out)
    if any(Path(d).resolve() == out.resolve() for d in in_dirs):
        raise ValueError(f"--out {str(out)!r} is one of the folders merged; pass another folder")
    check_out_dir(out, overwrite=overwrite)
    merged = read_sweeps(in_dirs, key=key)
    n_expected = expected if expected is not None else (len(merged.expected) or len(merged.records))
    summary = summarize(merged.records)
    summary["sweep"] = sweep_block(n_expected, merged.records)
    if not summary["sweep"]["complete"]:
        logger.warning("the merged sweep is incomplete: %d of %d cells found", len(merged.records), n_expected)
    if report is not None:
        report(summary)
    if overwrite and out.is_dir():
        _remove_outputs(out)
    write_atomic(out / RESULTS, "".join(json.dumps(r) + "\n" for r in merged.records))
    write_json(out / SUMMARY, summary)
    if write_extra is not None:
        write_extra(out, summary, merged.records)
    return summary, merged.records


# ------------------------------------------------------------------------------------------------ shared prefill
def shares_prefill(method) -> bool:
    """Whether ``method`` only compresses after a full-attention prefill, so one prefill per sample can serve it
    (``mmaccel.longctx.shared_prefill.shares_prefill``); ``False`` while that module is not installed."""
    try:
        from ..longctx.shared_prefill import shares_prefill as _shares
    except ImportError:
        return False
    return bool(_shares(method))


def run_measured_group(model, tokenizer, input_ids, methods: Sequence[tuple[Any, str]], **kwargs) -> list:
    """Run several KV methods on one prompt with one shared prefill (``mmaccel.eval.shared.generate_shared``), or,
    while that module is not installed, each separately (:func:`~mmaccel.eval.generation.generate_measured`).

    Parameters
    ----------
    input_ids : prompt
        As :func:`~mmaccel.eval.generation.generate_measured`.
    methods : sequence of (method object, label)
    **kwargs
        ``max_new_tokens``, ``repeats``, ``warmup``, ``warmup_ids``, ``temperature``.

    Returns
    -------
    list of RunRecord
        One per method, in the order given.
    """
    try:
        from .shared import generate_shared
    except ImportError:
        generate_shared = None
    if generate_shared is not None:
        return list(generate_shared(model, tokenizer, input_ids, methods=list(methods), **kwargs))
    from .generation import generate_measured

    return [generate_measured(model, tokenizer, input_ids, method=m, label=label, **kwargs) for m, label in methods]

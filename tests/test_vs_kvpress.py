"""benchmarks/vs_kvpress.py, the parts that need no kvpress environment: kept-count matching, cases, the merged table.

The worker itself runs only in its own virtual environment (kvpress 0.5.5 needs transformers < 5.3), which CI does
not build; what it shares with the driver (the meter file, the K/V byte count) is checked here against mmaccel.
"""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, DynamicCache

from mmaccel.data.haystack import HaystackTokens
from mmaccel.longctx import build_method, kv_cache_bytes
from mmaccel.models import zoo_path
from mmaccel.pipeline import resolve_methods

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_kvpress.py"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROSE = " ".join(
    f"The {w} ferry waits by the bank while the miller counts sacks of grain and the river runs past the wheel."
    for w in ("old", "red", "slow", "quiet", "small", "late", "first", "last")
)


def _load_script():
    spec = importlib.util.spec_from_file_location("vs_kvpress", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vk = _load_script()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(zoo_path("micro-lm"))


# ------------------------------------------------------------------------------------------ worker isolation
@pytest.mark.parametrize("cpu_meter", ["rss", "allocator"])
def test_worker_side_loads_the_meter_without_importing_mmaccel(cpu_meter):
    """The worker runs under another transformers: importing the script and mmaccel's meter file by path must not
    pull in the mmaccel package (nor torch, until the meter needs it)."""
    meter = ROOT / "mmaccel" / "eval" / "memory.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('vk', {str(SCRIPT)!r})\n"
        "vk = importlib.util.module_from_spec(spec); spec.loader.exec_module(vk)\n"
        "before = sorted(m for m in sys.modules if m.split('.')[0] in ('mmaccel', 'torch', 'transformers'))\n"
        f"PeakMemory = vk._load_meter({str(meter)!r})\n"
        "import torch\n"
        f"with PeakMemory(torch.device('cpu'), cpu_meter={cpu_meter!r}) as mem:\n"
        "    x = torch.ones(4 << 20)  # 16 MiB\n"
        "print(before, mem.method, mem.peak, any(m.split('.')[0] == 'mmaccel' for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}).stdout.split()
    assert out[0] == "[]"
    if cpu_meter == "rss":
        assert out[1] == "rss_delta_sampled"
        assert int(out[2]) >= 12 << 20
    else:
        assert out[1] == "cpu_allocator_profiled"
        assert int(out[2]) == 16 << 20
    assert out[3] == "False"


def test_worker_kv_bytes_match_mmaccels_count():
    cache = DynamicCache()
    for layer in range(3):
        cache.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), layer)
    cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    assert vk._held_kv(cache) == (kv_cache_bytes(cache), [11, 10, 10])


def test_kv_bytes_per_token_of_micro_lm():
    config = AutoConfig.from_pretrained(zoo_path("micro-lm"))  # 4 layers, 2 KV heads, head_dim 32
    assert vk.kv_bytes_per_token(config, torch.float32) == 2 * 4 * 2 * 32 * 4
    assert vk.kv_bytes_per_token(config, torch.bfloat16) == 2 * 4 * 2 * 32 * 2


# --------------------------------------------------------------------------------------- kept-count matching
@pytest.mark.parametrize("ratio", [0.1, 0.125, 0.2, 0.25, 0.3, 1 / 3, 0.5])
def test_compression_ratio_keeps_what_mmaccels_ratio_keeps(ratio):
    """kvpress 0.5.5 keeps ``max(1, int(n * (1 - compression_ratio)))`` (kvpress.utils.compute_n_kept)."""
    method = build_method(f"snapkv:ratio={ratio}")
    for n in [*range(64, 700, 7), 2048, 4096, 8192, 32768]:
        keep = method.context_budget(n)
        assert keep == math.ceil(ratio * n)
        cr = vk.kvpress_compression_ratio(n, keep)
        assert 0.0 <= cr < 1.0
        assert max(1, int(n * (1 - cr))) == keep
        for closing in (11, 34):  # context mode: the closing tokens are held besides the context's kept ones
            if keep > closing:
                cr = vk.kvpress_compression_ratio(n - closing, keep - closing)
                assert max(1, int((n - closing) * (1 - cr))) + closing == keep


def test_compression_ratio_is_one_minus_ratio_when_it_divides():
    assert vk.kvpress_compression_ratio(2048, 256) == 0.875
    assert vk.kvpress_compression_ratio(4096, 1024) == 0.75
    assert vk.kvpress_compression_ratio(100, 100) == 0.0
    assert vk.kvpress_compression_ratio(100, 250) == 0.0
    with pytest.raises(ValueError, match="keep"):
        vk.kvpress_compression_ratio(100, 0)


def test_parse_press_spec():
    assert vk.parse_press_spec("snapkv:window_size=32:kernel_size=7") == (["snapkv"], {"window_size": 32,
                                                                                      "kernel_size": 7})
    assert vk.parse_press_spec("adakv/expected_attention:use_covariance=false") == (
        ["adakv", "expected_attention"], {"use_covariance": False})
    assert vk.parse_press_spec("full") == (["full"], {})
    with pytest.raises(ValueError, match="field=value"):
        vk.parse_press_spec("snapkv:32")


def test_mmaccel_specs_expand_ratios_and_build():
    specs = vk.mmaccel_specs(["full", "chunked_ffn:chunk=512", "snapkv", "adakv:method=snapkv,ratio={r}"],
                             [0.125, 0.25])
    assert specs == [
        ("full", "full", None),
        ("chunked_ffn:chunk=512", "chunked_ffn:chunk=512", None),
        ("snapkv", "snapkv:ratio=0.125", 0.125),
        ("snapkv", "snapkv:ratio=0.25", 0.25),
        ("adakv:method=snapkv", "adakv:method=snapkv,ratio=0.125", 0.125),
        ("adakv:method=snapkv", "adakv:method=snapkv,ratio=0.25", 0.25),
    ]
    resolve_methods([spec for _, spec, _ in vk.mmaccel_specs(vk.DEFAULT_MMACCEL_METHODS, [0.125, 0.25])])


def test_default_kvpress_presses_have_mmaccel_counterparts_with_the_same_settings():
    """kvpress 0.5.5's fields, as the worker records them, map to mmaccel methods with the same hyper-parameters."""
    labels = {label for label, _, _ in vk.mmaccel_specs(vk.DEFAULT_MMACCEL_METHODS, [0.25])}
    for cls, fields, expect in [
        ("SnapKVPress", {"window_size": 32, "kernel_size": 7}, {"window": 32, "kernel_size": 7, "pooling": "avg"}),
        ("SnapKVPress", {"window_size": 64, "kernel_size": 5}, {"window": 64, "kernel_size": 5, "pooling": "avg"}),
        ("StreamingLLMPress", {"n_sink": 4}, {"sink": 4}),
    ]:
        mate = vk.counterpart({"mode": "whole", "method": "x", "press_class": cls, "press_fields": fields})
        assert mate in labels
        method = build_method(f"{mate}:ratio=0.25")
        assert {k: getattr(method, k) for k in expect} == expect
    assert vk.counterpart({"mode": "whole", "method": "full", "press_class": None}) == "full"
    snap = {"press_class": "SnapKVPress", "press_fields": {"window_size": 32, "kernel_size": 7}, "method": "x"}
    assert vk.counterpart({**snap, "mode": "context"}) is None
    assert vk.counterpart({"mode": "whole", "method": "x", "press_class": "ExpectedAttentionPress"}) is None


# ------------------------------------------------------------------------------------------------------- cases
@pytest.mark.parametrize("chat", [False, True])
def test_build_cases(tokenizer, chat):
    if chat:
        tokenizer = AutoTokenizer.from_pretrained(zoo_path("micro-lm"))
        tokenizer.chat_template = CHATML
    hay = HaystackTokens(tokenizer, PROSE)
    built = vk.build_cases(tokenizer, [300, 400], 2, [0.125, 0.25], seed=3, chat_template="auto", haystack=hay)
    json.dumps(built)
    assert built["chat_template"] is chat
    cases = built["cases"]
    assert [c["id"] for c in cases] == ["L300-0", "L300-1", "L400-0", "L400-1"]
    assert [c["depth"] for c in cases] == [0.25, 0.75, 0.25, 0.75]
    assert built["warmup_case"]["length"] == 300
    for c in [*cases, built["warmup_case"]]:
        ids = c["input_ids"]
        assert len(ids) == c["length"]
        assert c["keep"] == {"0.125": math.ceil(0.125 * len(ids)), "0.25": math.ceil(0.25 * len(ids))}
        closing = tokenizer.decode(ids[-c["n_closing"]:])
        before = tokenizer.decode(ids[: -c["n_closing"]])
        assert closing.strip().startswith("<|im_end|>") == chat
        assert closing.endswith(f"The secret number of the {c['key']} is")
        assert before.rstrip().endswith(f"What is the secret number of the {c['key']}?")
        assert c["answer"] in tokenizer.decode(ids[c["needle_position"]:c["needle_position"] + 30])


# ------------------------------------------------------------------------------------------------ merged table
def _rec(side, mode, method, ratio, case, text, *, status="ok", kv=None, **extra):
    return {"side": side, "mode": mode, "method": method, "ratio": ratio, "case": case, "status": status,
            "error": None if status == "ok" else "RuntimeError: boom", "output_text": text, "kv_cache_bytes": kv,
            "peak_memory_bytes": 3 << 20, "prefill_s": 0.5, "decode_s": 1.0, **extra}


def test_merged_table_from_fake_records(tmp_path):
    cases = [{"id": "a", "length": 1000, "depth": 0.25, "answer": "12345"},
             {"id": "b", "length": 1000, "depth": 0.75, "answer": "67890"}]
    full_kv = 1000 * 100
    snap = {"press_class": "SnapKVPress", "press_fields": {"window_size": 32, "kernel_size": 7}}
    records = [
        _rec("mmaccel", "whole", "full", None, "a", " 12345", kv=full_kv),
        _rec("mmaccel", "whole", "full", None, "b", " 67890", kv=full_kv),
        _rec("kvpress", "whole", "full", None, "a", " 12345", kv=full_kv, press_class=None),
        _rec("kvpress", "whole", "full", None, "b", " 67890", kv=full_kv, press_class=None),
        _rec("mmaccel", "whole", "snapkv", 0.25, "a", " 12345", kv=full_kv // 4),
        _rec("mmaccel", "whole", "snapkv", 0.25, "b", " 11111", kv=full_kv // 4),
        _rec("kvpress", "whole", "snapkv:window_size=32:kernel_size=7", 0.25, "a", " 12345", kv=full_kv // 4, **snap),
        _rec("kvpress", "whole", "snapkv:window_size=32:kernel_size=7", 0.25, "b", " 67890", kv=full_kv // 4, **snap),
        _rec("kvpress", "context", "snapkv:window_size=32:kernel_size=7", 0.25, "a", " 12345", kv=full_kv // 4,
             **snap),
        _rec("kvpress", "context", "snapkv:window_size=32:kernel_size=7", 0.25, "b", "", status="failed", **snap),
    ]
    records = vk.score_records(records, cases, bytes_per_token=100)
    assert [r["correct"] for r in records] == [True, True, True, True, True, False, True, True, True, False]
    assert records[4]["kept_fraction"] == 0.25 and records[-1]["kept_fraction"] is None

    rows = vk.summarize(records)
    keys = [(r["side"], r["mode"], r["method"], r["ratio"]) for r in rows]
    assert keys == [
        ("mmaccel", "whole", "full", None),
        ("kvpress", "whole", "full", None),
        ("mmaccel", "whole", "snapkv", 0.25),
        ("kvpress", "whole", "snapkv:window_size=32:kernel_size=7", 0.25),
        ("kvpress", "context", "snapkv:window_size=32:kernel_size=7", 0.25),
    ]
    by = dict(zip(keys, rows))
    kv_snap = by[("kvpress", "whole", "snapkv:window_size=32:kernel_size=7", 0.25)]
    assert (kv_snap["correct"], kv_snap["n"], kv_snap["failed"]) == (2, 2, 0)
    assert kv_snap["same_output"] == [1, 2] and kv_snap["counterpart"] == "snapkv"
    assert by[("kvpress", "whole", "full", None)]["same_output"] == [2, 2]
    ctx = by[("kvpress", "context", "snapkv:window_size=32:kernel_size=7", 0.25)]
    assert (ctx["correct"], ctx["n"], ctx["failed"], ctx["same_output"]) == (1, 1, 1, None)
    assert ctx["errors"] == ["RuntimeError: boom"]
    assert by[("mmaccel", "whole", "snapkv", 0.25)]["kept_fraction"] == 0.25

    config = {"model": "m", "n_cases": 1, "lengths": [1000], "dtype": "float32", "threads": 1, "max_new_tokens": 8,
              "chat_template": False, "kvpress_versions": {"kvpress": "0.5.5"}}
    summary = vk.write_outputs(tmp_path, records, config)
    table = (tmp_path / "table.md").read_text()
    assert "| kvpress | whole prompt | `snapkv:window_size=32:kernel_size=7` | 0.25 | 2/2 | 0.250 |" in table
    context_row = "| kvpress | context; closing tokens appended | `snapkv:window_size=32:kernel_size=7` | 0.25 | 1/1 |"
    assert context_row in table
    assert table.rstrip().endswith("| 0.50 | - | 1 |")
    assert "mmaccel vs kvpress 0.5.5" in table
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == summary["rows"]
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == len(records)


def test_unwrapped_names_the_method_a_chunked_ffn_row_wraps():
    assert vk.unwrapped("chunked_ffn:chunk=512:method=snapkv") == "snapkv"
    assert vk.unwrapped("chunked_ffn:chunk=64:method=snapkv,window=64,kernel_size=5") == (
        "snapkv:window=64:kernel_size=5")
    assert vk.unwrapped("chunked:chunk=512:method=snapkv") is None
    assert vk.unwrapped("snapkv") is None


def test_merge_takes_only_a_run_on_the_same_prompts_and_meter(tmp_path):
    job = {"cases": [{"input_ids": [1, 2, 3]}], "memory_meter": "allocator"}
    with pytest.raises(ValueError, match="no cases.json and records.jsonl"):
        vk.merge_records(tmp_path, job)
    (tmp_path / "records.jsonl").write_text(json.dumps({"side": "mmaccel", "case": "a"}) + "\n")
    (tmp_path / "cases.json").write_text(json.dumps({**job, "cases": [{"input_ids": [1, 2, 4]}]}))
    with pytest.raises(ValueError, match="prompts differ"):
        vk.merge_records(tmp_path, job)
    (tmp_path / "cases.json").write_text(json.dumps({**job, "memory_meter": "rss"}))
    with pytest.raises(ValueError, match="--memory-meter rss"):
        vk.merge_records(tmp_path, job)
    (tmp_path / "cases.json").write_text(json.dumps(job))
    assert vk.merge_records(tmp_path, job) == [{"side": "mmaccel", "case": "a"}]


def test_a_chunked_ffn_row_is_compared_with_the_method_it_wraps():
    cases = [{"id": "a", "length": 1000, "depth": 0.25, "answer": "12345"},
             {"id": "b", "length": 1000, "depth": 0.75, "answer": "67890"}]
    records = [_rec("mmaccel", "whole", "snapkv", 0.25, "a", " 12345"),
               _rec("mmaccel", "whole", "snapkv", 0.25, "b", " 11111"),
               _rec("mmaccel", "whole", "chunked_ffn:chunk=512:method=snapkv", 0.25, "a", " 12345"),
               _rec("mmaccel", "whole", "chunked_ffn:chunk=512:method=snapkv", 0.25, "b", " 67890")]
    rows = {r["method"]: r for r in vk.summarize(vk.score_records(records, cases, bytes_per_token=100))}
    assert rows["chunked_ffn:chunk=512:method=snapkv"]["same_output"] == [1, 2]
    assert rows["chunked_ffn:chunk=512:method=snapkv"]["counterpart"] == "snapkv"
    assert rows["snapkv"]["same_output"] is None

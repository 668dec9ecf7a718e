"""The kernel benchmark CLI entry runs at tiny sizes and writes ratios to dense SDPA."""
import json

from mmaccel.kernels.bench import main


def test_bench_cpu_tiny(tmp_path, capsys):
    out = tmp_path / "kb.json"
    rc = main(["--cpu", "--lengths", "256", "512", "--cache-lengths", "512", "--budgets", "64", "--heads", "2",
               "--kv-heads", "1", "--head-dim", "16", "--window", "64", "--sink", "4", "--chunk", "64",
               "--repeats", "1", "--warmup", "0", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    methods = {(r["op"], r["method"]) for r in data["records"]}
    assert ("prefill", "sdpa dense") in methods and ("prefill", "streaming(4,64)") in methods
    assert ("decode", "tokens 64") in methods and ("column_scores", "column_scores(W=64)") in methods
    assert all(r["speedup"] > 0 and r["ms"] > 0 for r in data["records"])
    assert "streaming(4,64) [auto]" in data["scaling"]
    assert "x sdpa" in capsys.readouterr().out

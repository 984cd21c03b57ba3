"""`recguide bench --quick` end to end on the bundled model: outputs, fields, losslessness."""

import json
import os

import pytest

from recguide_hf.cli import BUNDLED_MODEL, main


@pytest.mark.slow
@pytest.mark.skipif(not (BUNDLED_MODEL / "model.safetensors").exists(), reason="bundled weights missing")
def test_bench_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    for name in ("bench.json", "bench.md", "frontier.png", "tpf_tau.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["method"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in ("ar", "linear-8", "linear-16", "linear-32", "recguide") for c in (1, 4)} | {
        ("hf-lookup", 1)}
    assert all(r["equal_to_ar"] for r in rows.values())  # greedy output equals plain HF greedy, every method
    for m in ("linear-16", "recguide"):
        r = rows[(m, 1)]
        assert r["tpf"] > 0 and r["tau"] >= 1 and sum(r["block_mix"].values()) == pytest.approx(1)
    env = result["environment"]
    assert env["git_commit"] and env["torch"] and "bench" in env["command"]
    assert os.path.getsize(tmp_path / "frontier.png") > 1000

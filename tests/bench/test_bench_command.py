"""``python -m bench``: its machinery on a tiny size, so that the command and the benches' figures
cannot rot unnoticed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def _load():
    spec = importlib.util.spec_from_file_location("bench_command", ROOT / "bench" / "__main__.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "bench", "--size", "tiny", "--out", str(tmp_path / "results"),
                          "--dir", str(tmp_path), *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_the_command_runs_the_full_sizes_unless_told_otherwise():
    assert bench.parse_args([]).size == "full"
    assert bench.parse_args(["--quick"]).size == "quick"
    assert bench.parse_args(["--size", "tiny"]).size == "tiny"
    assert bench.parse_args([]).timeout == 5400.0 and bench.parse_args(["--quick"]).timeout == 900.0


def test_every_bench_script_is_run_by_the_command():
    scripts = {p.stem for p in (ROOT / "bench").glob("bench_*.py")}
    # bench_s3_clients compared S3 client libraries once, to choose one; it measures no deltackpt code.
    assert scripts - {"bench_s3_clients"} == {b.name for b in bench.BENCHES}
    for b in bench.BENCHES:
        assert set(b.sizes) == set(bench.SIZES), b.name
        text = (ROOT / "bench" / f"{b.name}.py").read_text()
        assert "write_figures(" in text, f"{b.name} writes no figures"


def test_tiny_run_writes_figures_summary_and_plot(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    earlier = {"bench": "bench_codecs", "status": "ok", "command": "python -m bench --only bench_codecs",
               "date": "2026-01-02T03:04:05+00:00", "versions": {"deltackpt_commit": "0123456789abcdef"},
               "runs": [{"command": "python bench/bench_codecs.py", "status": "ok", "series": {},
                         "rows": [{"name": "zstd encode", "unit": "GB/s", "median": 1.5, "runs": [1.5]}]}]}
    (results / "bench_codecs.json").write_text(json.dumps(earlier))
    _run(tmp_path, "--only", "bench_kernels,bench_save")
    for name in ("bench_kernels", "bench_save"):
        doc = json.loads((results / f"{name}.json").read_text())
        assert doc["status"] == "ok", doc
        assert doc["versions"]["torch"] and doc["machine"]["cpus"] and doc["date"] and doc["command"]
        assert len(doc["runs"]) == len(next(b for b in bench.BENCHES if b.name == name).sizes["tiny"])
        for run in doc["runs"]:
            assert run["rows"], run
            for row in run["rows"]:
                assert row["median"] == sorted(row["runs"])[len(row["runs"]) // 2], row
    save = json.loads((results / "bench_save.json").read_text())
    names = {r["name"] for r in save["runs"][0]["rows"]}
    assert {"deltackpt base save", "torch.save + fsync", "disk write + fsync (64 MiB pieces)"} <= names
    base = next(r for r in save["runs"][0]["rows"] if r["name"] == "deltackpt base save")
    assert len(base["runs"]) >= 3 and base["peer"] == "torch.save + fsync"
    assert base["ratio"] == pytest.approx(base["median"] / base["peer_median"])
    text = (results / "summary.md").read_text()
    assert "## Key figures" in text and "| bench_save | deltackpt base save" in text
    # The summary covers what an earlier run left of the benches this one did not run, with its command.
    assert "| bench_codecs | zstd encode | 1.5 GB/s" in text
    assert "`python -m bench --only bench_codecs` (bench_codecs)" in text
    assert "0123456789 (bench_codecs)" in text
    assert (results / "base_vs_size.png").read_bytes().startswith(PNG)
    assert not (results / "delta_vs_fraction.png").exists()  # bench_tracking did not run


def test_a_failing_bench_is_reported_and_fails_the_command(tmp_path, monkeypatch):
    broken = bench.Bench("bench_kernels", {size: (("--size-mib", "-1"),) for size in bench.SIZES}, takes_dir=False)
    doc = bench.run_bench(broken, "tiny", str(tmp_path), timeout=300)
    assert doc["status"] == "failed" and doc["runs"][0]["status"].startswith("failed")
    assert doc["runs"][0]["output_tail"]
    assert "failed" in bench.summary([doc])


def test_a_bench_whose_modules_are_missing_is_skipped(tmp_path):
    b = bench.Bench("bench_torchrec", {s: ((),) for s in bench.SIZES}, needs=("no_such_module_here", "bin:no-such-bin"))
    doc = bench.run_bench(b, "tiny", str(tmp_path), timeout=10)
    assert doc["status"] == "skipped" and "no_such_module_here" in doc["error"] and "bin:no-such-bin" in doc["error"]


def test_plots_from_the_series_of_tracking_chains_and_save(tmp_path):
    def doc(name, *series):
        return {"bench": name, "runs": [{"status": "ok", "rows": [], "series": s} for s in series]}

    docs = {
        "bench_tracking": doc("bench_tracking", {
            "fraction": [0.001, 0.01, 0.5], "state_bytes": 10**7, "marks_s": [0.01, 0.02, 0.3],
            "hashes_s": [0.05, 0.05, 0.2], "torch_save_s": [0.1, 0.1, 0.1], "marks_bytes": [1e4, 1e5, 5e6],
            "hashes_bytes": [1e4, 1e5, 5e6], "changed_row_bytes": [9e3, 9e4, 4.5e6]}),
        "bench_chains": doc("bench_chains", {"chain_length": [0, 4, 64], "restore_s": [1, 1.1, 2],
                                             "restore_compacted_s": [1, 1, 1]}),
        "bench_save": doc("bench_save", *({"state_bytes": n, "disk_write_s": n / 2e9, "base_save_s": n / 1.5e9,
                                           "torch_save_s": n / 1e9} for n in (10**8, 10**9))),
    }
    paths = bench.plots(docs, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["base_vs_size.png", "delta_vs_fraction.png",
                                                          "restore_vs_chain.png"]
    assert all(Path(p).read_bytes().startswith(PNG) for p in paths)


def test_unknown_bench_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "bench_nothing"])
    assert "bench_nothing" in capsys.readouterr().err


def unmatched_key_prefixes(results: Path) -> list[tuple[str, str]]:
    """The key-figure prefixes that name no row of their bench's last run in ``results``."""
    out = []
    for name, prefixes in bench.KEY:
        path = results / f"{name}.json"
        runs = [r for r in json.loads(path.read_text())["runs"] if r["status"] == "ok"] if path.exists() else []
        if runs:
            out += [(name, p) for p in prefixes if not any(r["name"].startswith(p) for r in runs[-1]["rows"])]
    return out


def test_every_key_figure_names_a_row_of_the_stored_results():
    assert unmatched_key_prefixes(ROOT / "bench" / "results") == []


@pytest.mark.slow
def test_every_bench_runs_at_the_tiny_size(tmp_path):
    _run(tmp_path)
    for b in bench.BENCHES:
        doc = json.loads((tmp_path / "results" / f"{b.name}.json").read_text())
        assert doc["status"] in ("ok", "skipped"), doc
    assert unmatched_key_prefixes(tmp_path / "results") == []


def test_an_executable_beside_this_python_is_found(tmp_path, monkeypatch):
    """pip puts ``weed`` beside the virtual environment's python, on no PATH until it is activated."""
    (tmp_path / "python").touch()
    (tmp_path / "some-tool").touch()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    b = bench.Bench("bench_torchrec", {s: ((),) for s in bench.SIZES}, needs=("bin:some-tool", "bin:no-such-bin"))
    assert bench.missing(b) == ["bin:no-such-bin"]

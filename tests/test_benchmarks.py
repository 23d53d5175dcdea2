"""The benchmarks run end to end on tiny models (peers.py --smoke, kv_cache.py).

Only that it runs and prints its tables is checked, never the timings. The Marian
rows are expected only where `transformers` is installed (CI does not install it:
the script must then skip Marian in one line and measure the other two).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_peers_smoke_run_prints_every_table() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
    assert "## smoke: vocabulary 200, d_model 32" in out
    assert "parameters: aiayn " in out
    for title in ("training step", "memory of one training step"):
        assert f"### smoke: {title}" in out
    assert out.count("| model | median | min | max | CPU-time median") >= 1
    assert "| model | median MiB |" in out
    for model in ("aiayn", "torch.nn"):
        assert out.count(f"| {model} | ") >= 2, out  # a training row and a memory row
    if HAVE_TRANSFORMERS:
        assert "### smoke: greedy decoding" in out
        assert "### smoke: beam 4 decoding" in out
        assert out.count("| Marian | ") == 4, out  # training, memory, greedy, beam
        assert out.count("| aiayn | ") == 4, out
    else:
        assert "Marian skipped: transformers is not installed" in out
        assert "| Marian |" not in out


def test_kv_cache_layouts_decode_the_same_tokens() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kv_cache.py"), "--size", "smoke",
         "--reps", "1", "--gen-len", "6", "--batch", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for search in ("greedy", "beam 4"):
        assert f"### {search}: generated tokens/s, the same tokens: True" in done.stdout
    assert done.stdout.count("| buffer | ") == 2


def test_attention_cost_runs_and_writes_every_repetition(tmp_path) -> None:
    out = tmp_path / "cost.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention_cost.py"), "--smoke",
         "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for section in ("### length:", "### lstm:", "### backends:", "### query:"):
        assert section in done.stdout
    assert "the backends that run on cpu: MATH, FLASH_ATTENTION" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"length", "lstm", "backends", "query"}
    assert set(results["query"]) == {"32", "128"}  # sequences
    tables = [results["length"], results["lstm"], results["backends"],
              *results["query"].values()]
    for result in tables:
        for per_length in result["seconds"].values():
            assert len(per_length) == len(result["lengths"])
            assert all(len(reps) == 2 and min(reps) > 0 for reps in per_length)


def load_script(name: str):
    """A benchmark script as a module (benchmarks/ is no package)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_flops_formula_counts_the_forward_and_backward_products() -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    train_mfu = load_script("train_mfu")
    peers = train_mfu.peers
    size = peers.Size("test", 50, 16, 2, 2, 24, 3, 10, 1, 3, (3, 6))
    batch = peers.train_batches(size, 1)[0]
    assert batch.src.size(1) != batch.tgt_in.size(1)  # S and T are not mixed up
    model = peers.build_model("aiayn", size, 0.0).train()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(batch.src, batch.tgt_in)  # the math backend: counted products
        F.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten()).backward()
    assert train_mfu.train_flops(size, batch) == counter.get_total_flops()


def test_train_mfu_smoke_run_prints_throughput_and_mfu(tmp_path) -> None:
    out = tmp_path / "mfu.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_mfu.py"), "--smoke",
         "--peak-tflops", "0.5", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "peak: 0.5 TFLOP/s" in done.stdout
    result = json.loads(out.read_text())
    names = {"aiayn", "torch.nn"} | ({"Marian"} if HAVE_TRANSFORMERS else set())
    assert set(result["extra"]) == names
    for name, extra in result["extra"].items():
        assert 0 < extra["mfu"] < 1 and f"| {name} | " in done.stdout
        seconds = result["seconds"][name]["wall"]
        achieved = result["flops"] / statistics.median(seconds)
        assert abs(extra["tflops"] * 1e12 - achieved) < 1e-6 * achieved

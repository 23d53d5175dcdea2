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

from conftest import HANG_S

ROOT = Path(__file__).resolve().parent.parent
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def run_script(
    name: str, *args: str, timeout: int = HANG_S, returncode: int = 0
) -> str:
    """The stdout of benchmarks/NAME.py ARGS run on one thread, exiting returncode."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == returncode, done.stdout + done.stderr
    return done.stdout


def test_peers_smoke_run_prints_every_table() -> None:
    out = run_script("peers", "--smoke", timeout=HANG_S)
    assert "## smoke: vocabulary 200, d_model 32" in out
    assert "parameters: aiayn " in out
    for title in ("training step", "memory of one training step"):
        assert f"### smoke: {title}" in out
    assert out.count("| model | median | min | max | CPU-time median") >= 1
    assert "| model | median MiB |" in out
    assert "| saved for backward, MiB |" in out
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
    out = run_script(
        "kv_cache", "--size", "smoke", "--reps", "1", "--gen-len", "6", "--batch", "3"
    )
    for search in ("greedy", "beam 4"):
        assert f"### {search}: generated tokens/s, the same tokens: True" in out
    assert out.count("| buffer | ") == 2


def test_attention_cost_runs_and_writes_every_repetition(tmp_path) -> None:
    path = tmp_path / "cost.json"
    out = run_script("attention_cost", "--smoke", "--json", str(path))
    for section in ("### length:", "### lstm:", "### backends:", "### query:"):
        assert section in out
    assert "the backends that run on cpu: MATH, FLASH_ATTENTION" in out
    results = json.loads(path.read_text())["results"]
    assert set(results) == {"length", "lstm", "backends", "query"}
    assert set(results["query"]) == {"32", "128"}  # sequences
    tables = [
        results["length"],
        results["lstm"],
        results["backends"],
        *results["query"].values(),
    ]
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
    path = tmp_path / "mfu.json"
    out = run_script(
        "train_mfu", "--smoke", "--peak-tflops", "0.5", "--json", str(path)
    )
    assert "peak: 0.5 TFLOP/s" in out
    result = json.loads(path.read_text())
    names = {"aiayn", "torch.nn"} | ({"Marian"} if HAVE_TRANSFORMERS else set())
    assert set(result["extra"]) == names
    for name, extra in result["extra"].items():
        assert 0 < extra["mfu"] < 1 and f"| {name} | " in out
        seconds = result["seconds"][name]["wall"]
        achieved = result["flops"] / statistics.median(seconds)
        assert abs(extra["tflops"] * 1e12 - achieved) < 1e-6 * achieved


def test_linear_timer_sees_every_linear_layer_of_a_search() -> None:
    import torch
    import torch.nn.functional as F

    from aiayn.decoding import greedy_search

    linear_share = load_script("linear_share")
    peers = linear_share.peers
    size = peers.SIZES["smoke"]  # one encoder and one decoder layer
    model = peers.build_model("aiayn", size, 0.0).eval()
    src = peers.decode_source(size, 3)
    m = 4
    with torch.inference_mode(), linear_share.LinearTimer() as timer:
        greedy_search(model, src, max_len=m, min_len=m)
    assert F.linear is linear_share._linear  # restored on leaving
    # encoder: in_proj, out_proj and the two of the FFN; cross-attention keys and
    # values once; every step: in_proj, out_proj, cross query and output, the FFN's
    # two, and the output layer
    assert timer.calls == 4 + 1 + m * 7
    assert timer.seconds > 0


def test_linear_share_smoke_run_or_a_clear_message() -> None:
    if not HAVE_TRANSFORMERS:
        out = run_script("linear_share", "--smoke", returncode=2)
        assert "pip install -r benchmarks/requirements.txt" in out
        return
    out = run_script("linear_share", "--smoke")
    for search in ("greedy", "beam 4"):
        assert f"### smoke: {search} search of 4 sentences" in out
        assert f"{search}: aiayn/Marian now " in out
    assert out.count("| aiayn | ") == 2 and out.count("| Marian | ") == 2
    out = run_script("linear_share", "--smoke", "--train")
    assert "### smoke: training step, a batch of 4 pairs" in out
    assert "| mm + addmm calls |" in out and "training step: aiayn/Marian now " in out


def test_profiled_step_counts_the_products_of_both_passes() -> None:
    linear_share = load_script("linear_share")
    peers = linear_share.peers
    size = peers.SIZES["smoke"]
    model = peers.build_model("aiayn", size, 0.0).train()
    optimizer = peers.new_optimizer(model)
    batch = peers.train_batches(size, 1)[0]
    sample = linear_share.profiled_step(
        lambda: peers.train_step("aiayn", model, optimizer, batch)
    )
    # 12 products forward: the encoder layer's in_proj, out_proj and FFN (4), the
    # decoder layer's in_proj, out_proj, cross query, cross keys and values, cross
    # output and FFN (7), the output layer (1). Backward, two each: the weight's
    # gradient and the input's (every input needs one: the embeddings are trained).
    assert sample["calls"] == 3 * 12
    assert 0 < sample["linear"] < sample["total"]


GPU_CHECK_PARTS = "env sync amp sdpa copy resume cache compile mfu peers m30k".split()


def test_gpu_check_small_run_on_a_cpu_lists_every_part(tmp_path) -> None:
    out = run_script("gpu_check", "--small", "--device", "cpu", "--out", str(tmp_path))
    summary = (tmp_path / "summary.txt").read_text()
    assert summary in out  # the same table on stdout
    table = summary.split("\ncheck ", 1)[1].splitlines()[1:]
    rows = [line.split(maxsplit=2) for line in table]
    checks, statuses = [row[0] for row in rows], {row[1] for row in rows}
    for part in GPU_CHECK_PARTS:
        assert any(c == part or c.startswith(f"{part}.") for c in checks), part
    assert statuses <= {"PASS", "WARN", "INFO", "SKIPPED"}, summary  # no FAIL, ERROR
    assert "resume.bitwise" in checks and "compile.aot_eager" in checks
    files = list(tmp_path.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in files), files


def test_decode_throughput_runs_with_outputs_shorter_than_the_source() -> None:
    """The positional table must hold the source too, not only the generated lengths."""
    args = "--vocab 64 --batch-size 2 --src-len 12 --lengths 4 --reps 1 --device cpu"
    out = run_script("decode_throughput", *args.split())
    assert "speedup of the cache" in out


def test_attention_cost_runs_in_half_precision_where_the_fused_kernels_live() -> None:
    args = "--smoke --only backends --dtype bfloat16"
    out = run_script("attention_cost", *args.split())
    assert out.startswith("attention cost: cpu (")
    assert ", bfloat16, " in out.splitlines()[0]

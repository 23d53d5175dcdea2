"""Tests of the shipped models (chapter 16).

save_pretrained, pretrained() and its download.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aiayn.multi30k as data
from aiayn import Transformer
from aiayn.decoding import translate
from aiayn.model import read_checkpoint, sha256_file
from aiayn.multi30k import (
    CACHE_ENV,
    PRETRAINED_ENV,
    TINY_RECIPE,
    SubwordTokenizer,
    pretrained,
    pretrained_file,
    save_pretrained,
    save_translation_model,
)
from conftest import HANG_S

NAME = "tiny-test"  # registered by the fixture; never in the repository's results/


@pytest.fixture
def shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Transformer, Path]:
    """A tiny model saved in a mirror, MIRROR/NAME/model.pt, registered under NAME."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(PRETRAINED_ENV, raising=False)
    texts = [
        "ein kleiner hund läuft",
        "a small dog runs",
        "zwei katzen",
        "two cats",
    ] * 10
    tokenizer = SubwordTokenizer.train(texts, vocab_size=80)
    torch.manual_seed(0)
    model = Transformer(TINY_RECIPE.model_config(tokenizer.vocab_size)).eval()
    path = save_pretrained(model, tokenizer, tmp_path / "mirror" / NAME)
    monkeypatch.setitem(data.PRETRAINED, NAME, {"model.pt": sha256_file(path)})
    return model, tmp_path / "mirror"


def test_save_pretrained_halves_the_weights_and_loads_back_in_float32(
    shipped, tmp_path
):
    model, mirror = shipped
    saved = read_checkpoint(mirror / NAME / "model.pt")
    assert {v.dtype for v in saved["state_dict"].values()} == {torch.float16}
    assert (mirror / NAME / "tokenizer.json").is_file()
    full = save_translation_model(
        model,
        data.SubwordTokenizer.load(mirror / NAME / "tokenizer.json"),
        tmp_path / "full.pt",
    )
    assert (mirror / NAME / "model.pt").stat().st_size < 0.6 * full.stat().st_size
    loaded, tokenizer = pretrained(NAME, base_url=mirror.as_uri())
    assert next(loaded.parameters()).dtype == torch.float32 and not loaded.training
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items()
    ):
        assert torch.equal(a.half().float(), b), name
    # the shared embedding matrix is stored once, as in the float32 model
    matrices = {v.data_ptr() for v in model.state_dict().values()}
    assert len({v.data_ptr() for v in saved["state_dict"].values()}) == len(matrices)
    mirrored = data.SubwordTokenizer.load(mirror / NAME / "tokenizer.json")
    assert tokenizer.encode("zwei katzen") == mirrored.encode("zwei katzen")


def test_a_download_goes_to_the_cache_once_and_is_verified(
    shipped, tmp_path, monkeypatch
):
    _, mirror = shipped
    # the environment names the mirror
    monkeypatch.setenv(PRETRAINED_ENV, mirror.as_uri())
    path = pretrained_file(NAME)
    assert path == tmp_path / "cache" / "pretrained" / NAME / "model.pt"
    # no partial file left
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]

    def no_network(url, path, timeout=60.0):
        raise AssertionError(f"fetched {url} again")

    monkeypatch.setattr(data, "fetch", no_network)
    assert pretrained_file(NAME) == path  # a verified copy is not fetched again
    path.write_bytes(path.read_bytes()[:-10])  # a damaged copy is fetched again...
    with pytest.raises(AssertionError, match="fetched"):
        pretrained_file(NAME)


def test_wrong_bytes_unknown_names_and_no_network_are_clear_errors(
    shipped, tmp_path, monkeypatch
):
    _, mirror = shipped
    other = tmp_path / "other" / NAME
    other.mkdir(parents=True)
    (other / "model.pt").write_bytes(b"not the model")
    with pytest.raises(
        ValueError,
        match=r"sent a file with sha256 .* expected .* set AIAYN_PRETRAINED_URL",
    ):
        pretrained_file(NAME, base_url=other.parent.as_uri())
    assert list((tmp_path / "cache" / "pretrained" / NAME).iterdir()) == []
    with pytest.raises(
        ValueError,
        match=r"no shipped model is called 'multi30k-fr-en'; the models are \[",
    ):
        pretrained("multi30k-fr-en")
    with pytest.raises(
        ValueError, match=r"cannot download file://.*/nowhere/tiny-test/model.pt"
    ):
        pretrained_file(NAME, base_url=(tmp_path / "nowhere").as_uri())


ROOT = Path(__file__).resolve().parents[1]
SHIPPED_NAMES = ["multi30k-de-en", "multi30k-en-de"]


def test_every_shipped_model_is_in_the_checkout() -> None:
    assert sorted(data.PRETRAINED) == sorted(SHIPPED_NAMES)
    assert sorted(data.PRETRAINED_SCOPE) == sorted(SHIPPED_NAMES)


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_the_shipped_model_is_found_in_the_checkout_and_matches_its_record(
    name, monkeypatch, tmp_path
):
    shipped = ROOT / "results" / name
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    record = json.loads((shipped / "scores.json").read_text())
    for file, digest in data.PRETRAINED[name].items():
        # no download: the digest matches
        assert pretrained_file(name, file) == shipped / file
        assert sha256_file(shipped / file) == digest
    assert data.PRETRAINED[name]["model.pt"] == record["model_sha256"]
    assert (shipped / "model.pt").stat().st_size < 16 * 2**20
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_the_records_are_listed_in_the_checksum_file_that_the_package_pins(name):
    """The package pins the model, the tokenizer and SHA256SUMS; it pins the rest."""
    sys.path.insert(0, str(ROOT / "scripts" / "release"))
    import checksums

    folder = ROOT / "results" / name
    sums = checksums.read(folder / checksums.NAME)
    assert sums == checksums.listed(folder), (
        f"run python scripts/release/checksums.py results/{name}"
    )
    pinned = data.PRETRAINED[name]
    assert set(pinned) == {"model.pt", "tokenizer.json", checksums.NAME}
    assert pinned[checksums.NAME] == sha256_file(folder / checksums.NAME)
    assert all(sums[file] == pinned[file] for file in ("model.pt", "tokenizer.json"))
    assert any(file.startswith("runs/") for file in sums)  # the run records


def test_a_record_is_verified_through_the_checksum_file(shipped, tmp_path):
    """A file the package does not pin is fetched and checked against SHA256SUMS."""
    _, mirror = shipped
    folder = mirror / NAME
    (folder / "runs").mkdir()
    (folder / "runs" / "a.log").write_text("step 1 | loss 9.0\n")
    sums = "".join(
        f"{sha256_file(folder / f)}  {f}\n" for f in ("model.pt", "runs/a.log")
    )
    (folder / "SHA256SUMS").write_text(sums)
    data.PRETRAINED[NAME]["SHA256SUMS"] = sha256_file(folder / "SHA256SUMS")
    path = pretrained_file(NAME, "runs/a.log", base_url=mirror.as_uri())
    assert path.read_text() == "step 1 | loss 9.0\n"
    path.unlink()
    (folder / "runs" / "a.log").write_text("step 1 | loss 1.0\n")  # not the record
    with pytest.raises(ValueError, match="sha256"):
        pretrained_file(NAME, "runs/a.log", base_url=mirror.as_uri())
    with pytest.raises(ValueError, match="has no file 'runs/b.log'"):
        pretrained_file(NAME, "runs/b.log", base_url=mirror.as_uri())


def test_translate_pretrained_runs_and_names_unknown_models(tmp_path):
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run(
        [
            sys.executable,
            *"-m aiayn translate --pretrained multi30k-de-en".split(),
            "Zwei Hunde spielen im Schnee.",
            "Ein Mann fährt Fahrrad.",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    dogs, man = done.stdout.splitlines()
    assert (
        "dogs" in dogs and "snow" in dogs and "man" in man.lower() and "bicycle" in man
    )
    done = subprocess.run(
        [
            sys.executable,
            *"-m aiayn translate --pretrained multi30k-fr-en Bonjour".split(),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: no shipped model is called 'multi30k-fr-en' "
        "(did you mean multi30k-de-en?); the shipped models are multi30k-de-en, "
        "multi30k-en-de. A Hugging Face model is named by its folder, "
        "or online by owner/model."
    )


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_the_model_card_states_the_recorded_scores_and_reproducible_examples(name):
    shipped = ROOT / "results" / name
    card = (shipped / "README.md").read_text(encoding="utf-8")
    record = json.loads((shipped / "scores.json").read_text())
    for split, methods in record["scores"].items():
        for method, score in methods.items():
            how = "greedy" if method == "greedy" else "beam 4, alpha 0.6"
            bleu, lowercase = score["bleu"], score["lowercase_bleu"]
            row = f"| {split} | {{}} | {how} | {bleu:.2f} | {lowercase:.2f} |"
            assert any(row.format(n) in card for n in ("1,014", "1,000")), row
        assert methods["greedy"]["signature"] in card
    assert f"| Parameters | {record['parameters']:,} |" in card
    # The examples: each German line, then "  -> " and what beam search writes today.
    block = card.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    sources, expected = (
        block[0::2],
        [line.removeprefix("  -> ") for line in block[1::2]],
    )
    assert len(sources) == len(expected) == 7 and all(
        line.startswith("  -> ") for line in block[1::2]
    )
    assert "chapter 19" in card  # where a general-domain model comes from
    model, tokenizer = pretrained(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the card was written
    try:
        assert translate(model, tokenizer, sources) == expected
    finally:
        torch.set_num_threads(threads)


def test_bleu_scores_the_shipped_model_by_name(tmp_path):
    from conftest import local_multi30k

    env = {
        **os.environ,
        CACHE_ENV: str(tmp_path / "cache"),
        "AIAYN_MULTI30K_DIR": str(local_multi30k()),
    }
    done = subprocess.run(
        [
            sys.executable,
            *"-m aiayn bleu --pretrained multi30k-de-en --limit 5".split(),
            *"--greedy --device cpu".split(),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("test2016 de-en, 5 sentences, greedy: BLEU ")
    assert "signature: nrefs:1|case:mixed|eff:no|tok:13a" in done.stdout


def test_many_workers_fetching_into_one_empty_cache_all_succeed(tmp_path, monkeypatch):
    """Workers that call pretrained() together share no partial file.

    Job arrays and torchrun start such workers.
    """
    import threading

    mirror = tmp_path / "mirror"
    (mirror / NAME).mkdir(parents=True)
    # long enough to overlap
    (mirror / NAME / "big.bin").write_bytes(os.urandom(16 * 2**20))
    monkeypatch.setitem(
        data.PRETRAINED, NAME, {"big.bin": sha256_file(mirror / NAME / "big.bin")}
    )
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    start, results = threading.Barrier(8), []

    def worker() -> None:
        start.wait()
        try:
            results.append(pretrained_file(NAME, "big.bin", base_url=mirror.as_uri()))
        except Exception as err:  # noqa: BLE001 - collected, asserted below
            results.append(err)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_S)
    cached = tmp_path / "cache" / "pretrained" / NAME
    assert results == [cached / "big.bin"] * 8
    # nothing partial left
    assert sorted(p.name for p in cached.iterdir()) == ["big.bin"]


def test_an_unwritable_cache_and_a_damaged_copy_are_named(
    shipped, tmp_path, monkeypatch
):
    _, mirror = shipped
    (tmp_path / "a_file").write_text("")
    # a cache under a file
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a_file" / "cache"))
    with pytest.raises(
        ValueError,
        match=r"cannot write to the cache, .*a_file/cache/pretrained/tiny-test "
        r"\(.*\); set AIAYN_CACHE_DIR to a writable directory",
    ):
        pretrained_file(NAME, base_url=mirror.as_uri())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = pretrained_file(NAME, base_url=mirror.as_uri())
    path.write_bytes(path.read_bytes()[:-10])  # damaged, and no way to fetch it again
    with pytest.raises(
        ValueError,
        match=r"the cached copy .*model.pt is damaged .* a fresh copy cannot "
        r"be fetched: cannot download",
    ):
        pretrained_file(NAME, base_url=(tmp_path / "nowhere").as_uri())
    with pytest.raises(
        ValueError, match=r"is not a URL: give it a scheme, https:// or file://"
    ):
        pretrained_file(NAME, base_url=str(tmp_path / "nowhere"))


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_translate_pretrained_says_what_the_model_can_translate(name):
    text = "Ein Hund." if name == "multi30k-de-en" else "A dog."
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "translate",
            "--pretrained",
            name,
            "--greedy",
            text,
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    # said once
    assert done.stderr.strip() == f"note: {name} {data.PRETRAINED_SCOPE[name]}."
    scope = data.PRETRAINED_SCOPE[name]
    assert "image" in scope and "nonsense" in scope and "chapter 19" in scope


def test_bleu_of_a_shipped_model_reads_its_own_direction(tmp_path):
    """multi30k-en-de is scored on English sources against German references."""
    from conftest import local_multi30k

    env = {
        **os.environ,
        CACHE_ENV: str(tmp_path / "cache"),
        "AIAYN_MULTI30K_DIR": str(local_multi30k()),
    }
    done = subprocess.run(
        [
            sys.executable,
            *"-m aiayn bleu --pretrained multi30k-en-de --limit 50".split(),
            *"--greedy --device cpu".split(),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    score = float(done.stdout.split("BLEU ")[1].split()[0])
    assert score > 20, done.stdout  # the wrong direction scores near 0


# --- addresses that never change, and what is left in the cache -----------------------


def git(*args: str) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, check=True, timeout=HANG_S
    ).stdout


def history() -> None:
    """Skip where the checkout has no history to read (an archive, a shallow clone)."""
    try:
        shallow = git("rev-parse", "--is-shallow-repository").strip() == b"true"
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    if shallow:
        pytest.skip("a shallow clone: the commits of the shipped models are not here")


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_each_shipped_model_is_downloaded_from_the_commit_that_holds_its_files(name):
    """At 22e25ab the address was the main branch: replacing a model broke installs."""
    history()
    commit = data.PRETRAINED_COMMIT[name]
    url = data.pretrained_url(name, "model.pt")
    repository = "https://raw.githubusercontent.com/literate-transformer/aiayn"
    assert url == f"{repository}/{commit}/results/{name}/model.pt"
    # published history: it stays
    assert git("merge-base", "--is-ancestor", commit, "HEAD") == b""
    for file, digest in data.PRETRAINED[name].items():
        blob = git("show", f"{commit}:results/{name}/{file}")
        assert hashlib.sha256(blob).hexdigest() == digest, file


def test_an_older_install_still_downloads_its_own_model(tmp_path, monkeypatch):
    """The first multi30k-de-en, replaced since: installs pinned to it get its bytes."""
    history()
    # the commit that shipped the first model
    first = "f6ca601164a9e7196f58d3be9361aec9a475bc37"
    old = git("show", f"{first}:results/multi30k-de-en/model.pt")
    # raw.githubusercontent.com: every commit's files at their path
    mirror = tmp_path / "raw"
    for commit, blob in (
        (first, old),
        ("main", (ROOT / "results/multi30k-de-en/model.pt").read_bytes()),
    ):
        (mirror / commit / "results" / "multi30k-de-en").mkdir(parents=True)
        (mirror / commit / "results" / "multi30k-de-en" / "model.pt").write_bytes(blob)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(PRETRAINED_ENV, raising=False)
    monkeypatch.setattr(data, "PRETRAINED_REPOSITORY", mirror.as_uri())
    monkeypatch.setitem(
        data.PRETRAINED, "multi30k-de-en", {"model.pt": hashlib.sha256(old).hexdigest()}
    )
    monkeypatch.setitem(data.PRETRAINED_COMMIT, "multi30k-de-en", first)
    # not the checkout's: its digest is the new model's
    path = pretrained_file("multi30k-de-en")
    assert path == tmp_path / "cache" / "pretrained" / "multi30k-de-en" / "model.pt"
    assert path.read_bytes() == old
    path.unlink()
    (mirror / first / "results/multi30k-de-en/model.pt").write_bytes(b"other bytes")
    with pytest.raises(
        ValueError,
        match=rf"expected .*This version of the package ships the file at "
        rf".*/{first}/results/multi30k-de-en/model.pt; download it into",
    ):
        pretrained_file("multi30k-de-en")


def test_a_damaged_copy_in_a_cache_that_cannot_be_written_is_named(
    shipped, tmp_path, monkeypatch
):
    """At 22e25ab a read-only cache with a damaged copy said only "read-only"."""
    _, mirror = shipped
    path = pretrained_file(NAME, base_url=mirror.as_uri())
    path.write_bytes(b"damaged")

    def read_only(directory):
        raise ValueError(
            f"cannot write to the cache, {directory} (Read-only file system)"
        )

    monkeypatch.setattr(data, "_check_writable", read_only)
    with pytest.raises(
        ValueError,
        match=r"the cached copy .*model.pt is damaged .*Read-only file system",
    ):
        pretrained_file(NAME, base_url=mirror.as_uri())


def test_a_good_download_removes_what_killed_downloads_left(shipped, tmp_path):
    """At 22e25ab a killed download's partial file stayed in the cache for good."""
    _, mirror = shipped
    folder = tmp_path / "cache" / "pretrained" / NAME
    folder.mkdir(parents=True)
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=HANG_S,
    )
    dead = int(ended.stdout)  # a process that has ended
    killed = folder / f"model.pt.{dead}.{'a' * 32}.download.{'b' * 32}.partial"
    running = folder / f"model.pt.{os.getpid()}.{'c' * 32}.download.{'d' * 32}.partial"
    killed.write_bytes(b"half")
    running.write_bytes(b"half, and still being written")
    pretrained_file(NAME, base_url=mirror.as_uri())
    # another thread of a live process may own it
    assert not killed.exists() and running.exists()

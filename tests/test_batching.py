"""Tests of aiayn.batching (chapter 11).

The tokenizer, padding, teacher forcing and the token-bucket sampler.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from aiayn.batching import (
    TOKENIZER_CLASSES,
    Batch,
    Collator,
    SymbolTokenizer,
    TokenBatchSampler,
    example_size,
    make_batch,
    pad_sequences,
    tokenizer_from_dict,
)
from aiayn.masks import padding_mask, target_mask
from conftest import HANG_S  # noqa: E402

PAD, BOS, EOS = 0, 1, 2


def random_pairs(
    n: int, seed: int = 0, max_len: int = 30
) -> list[tuple[list[int], list[int]]]:
    """n (source, target) id pairs of random lengths 1..max_len, ids 4..13."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        ls, lt = torch.randint(1, max_len + 1, (2,), generator=g).tolist()
        pairs.append(
            (
                torch.randint(4, 14, (ls,), generator=g).tolist(),
                torch.randint(4, 14, (lt,), generator=g).tolist(),
            )
        )
    return pairs


def lengths_of(pairs):
    return [(len(x), len(y)) for x, y in pairs]


# --- tokenizer ------------------------------------------------------------------------


def test_symbol_tokenizer_ids_and_round_trip():
    tok = SymbolTokenizer(list("abc"))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == len(tok) == 7
    assert tok.encode("a b c a") == [4, 5, 6, 4]
    # unknown symbol -> unk, any whitespace splits
    assert tok.encode("a z  b") == [4, 3, 5]
    assert tok.decode(tok.encode("c b a")) == "c b a"
    assert tok.decode([1, 4, 0, 5, 2, 6]) == "a b"  # skips bos and pad, stops at eos
    assert tok.decode(torch.tensor([1, 6, 3, 2])) == "c <unk>"
    assert tok.encode("") == []


def test_symbol_tokenizer_dict_registry_and_checkpoint():
    tok = SymbolTokenizer(["x1", "x2", "y"], unk="?")
    d = tok.to_dict()
    assert d["kind"] == "symbols"
    buffer = io.BytesIO()
    torch.save({"tokenizer": d}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["tokenizer"]
    for other in (SymbolTokenizer.from_dict(d), tokenizer_from_dict(loaded)):
        assert isinstance(other, SymbolTokenizer)
        assert other.itos == tok.itos and other.unk == "?"
        assert other.encode("x2 y q") == tok.encode("x2 y q") == [5, 6, 3]


def test_the_tokenizer_table_names_every_kind_of_the_package():
    assert TOKENIZER_CLASSES == {
        "symbols": "aiayn.batching:SymbolTokenizer",
        "subword": "aiayn.multi30k:SubwordTokenizer",
    }
    from aiayn.multi30k import SubwordTokenizer

    for kind, where in TOKENIZER_CLASSES.items():
        module, name = where.split(":")
        cls = getattr(__import__(module, fromlist=[name]), name)
        assert cls.kind == kind and callable(cls.from_dict)
    subword = SubwordTokenizer.train(
        ["ein hund", "a dog", "zwei hunde", "two dogs"], vocab_size=40
    )
    again = tokenizer_from_dict(subword.to_dict())
    assert isinstance(again, SubwordTokenizer) and again.encode(
        "a dog"
    ) == subword.encode("a dog")


def test_a_subword_tokenizer_rebuilds_in_a_process_that_imported_only_batching():
    from aiayn.multi30k import SubwordTokenizer

    subword = SubwordTokenizer.train(["ein hund", "a dog"], vocab_size=30)
    code = (
        "import sys\n"
        "from aiayn.batching import tokenizer_from_dict\n"
        "assert 'aiayn.multi30k' not in sys.modules\n"
        f"tok = tokenizer_from_dict({subword.to_dict()!r})\n"
        "print(type(tok).__module__, type(tok).__name__,\n"
        f"      tok.encode('a dog') == {subword.encode('a dog')})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["aiayn.multi30k", "SubwordTokenizer", "True"]


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError) as info:
        tokenizer_from_dict({"kind": "chars", "alphabet": "xyz"})
    message = str(info.value)
    assert (
        "unknown tokenizer kind 'chars'" in message
        and "['subword', 'symbols']" in message
    )
    assert "its own from_dict" in message
    for bad in ({"symbols": ["a"]}, ["kind"], {"kind": ["symbols"]}):
        with pytest.raises(ValueError, match="'kind'|unknown tokenizer kind"):
            tokenizer_from_dict(bad)


@pytest.mark.parametrize(
    "symbols, match",
    [
        ("abc", "list"),
        (["a", "a"], "differ"),
        (["a", "<pad>"], "differ"),
        (["a b"], "whitespace"),
        ([""], "non-empty"),
        ([1], "string"),
    ],
)
def test_symbol_tokenizer_rejects_bad_symbols(symbols, match):
    with pytest.raises(ValueError, match=match):
        SymbolTokenizer(symbols)


def test_decode_rejects_bad_ids():
    tok = SymbolTokenizer(list("ab"))
    with pytest.raises(ValueError, match="not an id"):
        tok.decode([1, 99])
    with pytest.raises(ValueError, match="one sequence"):
        tok.decode(torch.zeros(2, 3, dtype=torch.long))


# --- padding --------------------------------------------------------------------------


def test_pad_sequences():
    out = pad_sequences([[5, 6, 7], torch.tensor([8]), [], (9, 10)], pad_id=0)
    assert out.dtype == torch.long
    assert out.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0], [9, 10, 0]]
    assert pad_sequences([[4, 4]], pad_id=3).tolist() == [[4, 4]]


@pytest.mark.parametrize(
    "seqs, pad_id, match",
    [
        ([], 0, "no sequences"),
        ([[1.5, 2.0]], 0, "int token ids"),
        ([[[1, 2]]], 0, "1-D"),
        ([[1, -2]], 0, "negative"),
        ([[1, 2]], -1, "pad_id"),
        ([[1, 2]], True, "pad_id"),
    ],
)
def test_pad_sequences_errors(seqs, pad_id, match):
    with pytest.raises(ValueError, match=match):
        pad_sequences(seqs, pad_id)


# --- teacher forcing ------------------------------------------------------------------


def test_make_batch_shifts_exactly():
    pairs = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13, 14]), ([4, 4], [])]
    batch = make_batch(pairs, PAD, BOS, EOS)
    assert batch.src.tolist() == [[5, 6, 7], [10, 0, 0], [4, 4, 0]]
    assert batch.tgt_in.tolist() == [
        [1, 8, 9, 0, 0],
        [1, 11, 12, 13, 14],
        [1, 0, 0, 0, 0],
    ]
    assert batch.tgt_out.tolist() == [
        [8, 9, 2, 0, 0],
        [11, 12, 13, 14, 2],
        [2, 0, 0, 0, 0],
    ]
    assert all(t.dtype == torch.long for t in (batch.src, batch.tgt_in, batch.tgt_out))
    assert batch.size == 3
    assert batch.n_src_tokens == 3 + 1 + 2
    assert batch.n_tgt_tokens == 3 + 5 + 1  # labels, end tokens included
    assert torch.equal(batch.src_mask(), padding_mask(batch.src, PAD))
    assert torch.equal(batch.tgt_mask(), target_mask(batch.tgt_in, PAD))


def test_make_batch_random_pairs_and_other_ids():
    pairs = random_pairs(40, seed=3)
    batch = make_batch(
        [(torch.tensor(x), y) for x, y in pairs], pad_id=13 + 1, bos_id=15, eos_id=16
    )
    for b, (x, y) in enumerate(pairs):
        assert batch.src[b].tolist() == x + [14] * (batch.src.size(1) - len(x))
        pads_in = batch.tgt_in.size(1) - len(y) - 1
        pads_out = batch.tgt_out.size(1) - len(y) - 1
        assert batch.tgt_in[b].tolist() == [15, *y] + [14] * pads_in
        assert batch.tgt_out[b].tolist() == [*y, 16] + [14] * pads_out
    assert batch.tgt_in.size(1) == max(len(y) for _, y in pairs) + 1
    assert batch.n_tgt_tokens == sum(len(y) + 1 for _, y in pairs)


@pytest.mark.parametrize(
    "pairs, match",
    [
        ([], "no pairs"),
        ([([], [5])], "source 0 is empty"),
        ([([5], [6]), ([5, 0], [6])], "pair 1 contains pad_id"),
        ([([5], [6, 0])], "pair 0 contains pad_id"),
        ([([5], [1, 6, 2])], "already contains bos_id"),
        ([([5], [6]), ([7],)], "pair 1 must be a"),
        (["ab"], "pair 0 must be a"),
        ([([5.0], [6])], "int token ids"),
    ],
)
def test_make_batch_errors(pairs, match):
    with pytest.raises(ValueError, match=match):
        make_batch(pairs, PAD, BOS, EOS)


def test_make_batch_rejects_bad_special_ids():
    with pytest.raises(ValueError, match="must differ"):
        make_batch([([5], [6])], pad_id=1, bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match="eos_id"):
        make_batch([([5], [6])], pad_id=0, bos_id=1, eos_id=-2)
    with pytest.raises(ValueError, match="must differ"):
        Collator(pad_id=2, bos_id=1, eos_id=2)


def test_batch_to_and_validation():
    batch = make_batch([([5, 6], [7]), ([8], [9, 10])], PAD, BOS, EOS)
    moved = batch.to("cpu", non_blocking=True)
    assert isinstance(moved, Batch) and moved.pad_id == batch.pad_id
    assert torch.equal(moved.tgt_out, batch.tgt_out)
    meta = batch.to("meta")
    assert meta.src.device.type == "meta" and meta.tgt_in.shape == batch.tgt_in.shape
    with pytest.raises(ValueError, match="long tensor"):
        Batch(batch.src.float(), batch.tgt_in, batch.tgt_out)
    with pytest.raises(ValueError, match="one shape"):
        Batch(batch.src, batch.tgt_in, batch.tgt_out[:, :-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning memory needs a GPU")
def test_batch_pin_memory_in_a_loader():
    pairs = random_pairs(20)
    loader = DataLoader(pairs, batch_size=5, collate_fn=Collator(), pin_memory=True)
    batch = next(iter(loader))
    assert (
        isinstance(batch, Batch) and batch.src.is_pinned() and batch.tgt_out.is_pinned()
    )
    assert batch.to("cuda", non_blocking=True).src.device.type == "cuda"


def test_collator_in_a_dataloader_and_pickles():
    pairs = random_pairs(23)
    collate = Collator.from_tokenizer(SymbolTokenizer(list("abcdefghij")))
    assert collate == Collator(0, 1, 2)
    assert pickle.loads(pickle.dumps(collate)) == collate
    loader = DataLoader(
        pairs, batch_size=5, shuffle=False, num_workers=0, collate_fn=collate
    )
    batches = list(loader)
    assert [b.size for b in batches] == [5, 5, 5, 5, 3]
    first = make_batch(pairs[:5], PAD, BOS, EOS)
    assert torch.equal(batches[0].src, first.src) and torch.equal(
        batches[0].tgt_out, first.tgt_out
    )


# --- token-bucket sampler -------------------------------------------------------------


def test_example_size():
    assert example_size(7) == 7
    assert example_size((10, 3)) == 10
    assert example_size((3, 10)) == 11  # the target needs m + 1 positions
    assert example_size((4, 0)) == 4
    # integer scalars of other types
    assert example_size([torch.tensor(3), torch.tensor(4)]) == 5
    assert example_size(torch.tensor(6)) == 6
    for bad in (0, -1, (0, 3), (3, -1), 2.5, True, (1, 2, 3)):
        with pytest.raises(ValueError):
            example_size(bad)


@pytest.mark.parametrize("bucket_size", [None, 1, 50, 1000])
def test_sampler_serves_every_index_once_within_the_budget(bucket_size):
    pairs = random_pairs(300, seed=1)
    lengths = lengths_of(pairs)
    sampler = TokenBatchSampler(
        lengths, max_tokens=100, seed=5, bucket_size=bucket_size
    )
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(pairs)))
        for b in batches:
            assert len(b) * max(example_size(lengths[i]) for i in b) <= 100
            batch = make_batch([pairs[i] for i in b], PAD, BOS, EOS)
            assert batch.src.numel() <= 100 and batch.tgt_in.numel() <= 100


def test_sampler_with_plain_lengths_and_tensor_lengths():
    lengths = [
        int(n)
        for n in torch.randint(
            1, 50, (200,), generator=torch.Generator().manual_seed(0)
        )
    ]
    for given in (lengths, torch.tensor(lengths)):
        sampler = TokenBatchSampler(given, max_tokens=64, seed=1)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(200))
        assert all(len(b) * max(lengths[i] for i in b) <= 64 for b in batches)
    pair_tensor = torch.tensor([[3, 4], [5, 1]])
    assert sorted(
        i for b in TokenBatchSampler(pair_tensor, max_tokens=10) for i in b
    ) == [0, 1]


def test_sampler_is_deterministic_and_changes_with_epoch_and_seed():
    lengths = lengths_of(random_pairs(200, seed=2))
    a = TokenBatchSampler(lengths, max_tokens=90, seed=7)
    b = TokenBatchSampler(lengths, max_tokens=90, seed=7)
    assert list(a) == list(b) == list(a)
    epoch0 = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != epoch0
    a.set_epoch(0)
    assert list(a) == epoch0
    assert list(TokenBatchSampler(lengths, max_tokens=90, seed=8)) != epoch0
    assert a.all_batches(1) == list(b)


def test_sampler_groups_similar_lengths():
    lengths = lengths_of(random_pairs(2000, seed=4))

    def padding(batches):
        real = sum(lengths[i][0] + lengths[i][1] + 1 for b in batches for i in b)
        positions = sum(
            len(b) * (max(lengths[i][0] for i in b) + max(lengths[i][1] + 1 for i in b))
            for b in batches
        )
        return 1 - real / positions

    bucketed = list(TokenBatchSampler(lengths, max_tokens=400, seed=0))
    random_batches = list(
        TokenBatchSampler(lengths, max_tokens=400, seed=0, bucket_size=1)
    )
    assert padding(bucketed) < 0.5 * padding(random_batches)
    assert len(bucketed) < len(random_batches)


def test_sampler_without_shuffle_is_fixed_and_sorted():
    lengths = [5, 1, 4, 2, 3, 6]
    sampler = TokenBatchSampler(lengths, max_tokens=6, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(3)
    assert list(sampler) == first
    assert [i for b in first for i in b] == [1, 3, 4, 2, 0, 5]  # sorted by length
    assert first == [[1, 3], [4], [2], [0], [5]]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_sampler_ddp_shards(world, drop_last):
    lengths = lengths_of(random_pairs(500, seed=6))
    shards = [
        TokenBatchSampler(
            lengths,
            max_tokens=120,
            seed=3,
            num_replicas=world,
            rank=r,
            drop_last=drop_last,
        )
        for r in range(world)
    ]
    for epoch in (0, 1):
        for s in shards:
            s.set_epoch(epoch)
        served = [list(s) for s in shards]
        total = len(shards[0].all_batches())
        counts = {len(b) for b in served}
        # every rank steps together
        assert len(counts) == 1 and {len(s) for s in shards} == counts
        per_rank = counts.pop()
        if drop_last:
            assert per_rank == total // world
            flat = [i for rank in served for b in rank for i in b]
            assert len(flat) == len(set(flat))  # disjoint
        else:
            assert per_rank == -(-total // world)
            repeated = world * per_rank - total
            assert repeated < world
            batch_ids = Counter(tuple(b) for rank in served for b in rank)
            assert sum(c - 1 for c in batch_ids.values()) == repeated
            assert set().union(*(set(b) for b in batch_ids)) == set(range(500))
        for r in range(world):  # each rank's batches are its slice of the common list
            full = shards[r].all_batches()
            if not drop_last:
                full = full + full[: world * per_rank - total]
            assert served[r] == full[: world * per_rank][r::world]


def test_sampler_drop_last_needs_enough_batches():
    sampler = TokenBatchSampler(
        [3, 3], max_tokens=100, num_replicas=4, rank=0, drop_last=True
    )
    with pytest.raises(ValueError, match="only 1 batches for 4 replicas"):
        len(sampler)
    padded = TokenBatchSampler([3, 3], max_tokens=100, num_replicas=4, rank=3)
    # rank 3 gets the one batch again
    assert list(padded) == [[0, 1]] and len(padded) == 1


def test_sampler_in_a_dataloader():
    pairs = random_pairs(150, seed=9)
    sampler = TokenBatchSampler(lengths_of(pairs), max_tokens=128, seed=0)
    loader = DataLoader(
        pairs, batch_sampler=sampler, collate_fn=Collator(PAD, BOS, EOS), num_workers=0
    )
    assert len(loader) == len(sampler)
    served = 0
    for indices, batch in zip(sampler, loader):
        assert isinstance(batch, Batch) and batch.size == len(indices)
        assert batch.src.numel() <= 128 and batch.tgt_out.numel() <= 128
        expected = make_batch([pairs[i] for i in indices], PAD, BOS, EOS)
        assert torch.equal(batch.tgt_in, expected.tgt_in)
        served += batch.size
    assert served == len(pairs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[], max_tokens=10), "no lengths"),
        (dict(lengths=[3, 4], max_tokens=0), "max_tokens"),
        (dict(lengths=[3, 40], max_tokens=30), "example 1"),
        (dict(lengths=[(3, 29)], max_tokens=29), "needs 30 positions"),
        (dict(lengths=[3, (3, 4)], max_tokens=30), "all ints or all"),
        (dict(lengths=[3, 0], max_tokens=30), "length"),
        (dict(lengths=[3], max_tokens=30, num_replicas=2, rank=2), "rank"),
        (dict(lengths=[3], max_tokens=30, num_replicas=0), "num_replicas"),
        (dict(lengths=[3], max_tokens=30, bucket_size=0), "bucket_size"),
        (dict(lengths=[3], max_tokens=30, seed=1.5), "seed"),
    ],
)
def test_sampler_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBatchSampler(**kwargs)


def test_set_epoch_rejects_bad_epochs():
    sampler = TokenBatchSampler([3, 4], max_tokens=10)
    for bad in (-1, 1.0, "1"):
        with pytest.raises(ValueError, match="epoch"):
            sampler.set_epoch(bad)


def test_a_batch_padded_to_a_multiple_of_8_gives_the_same_loss_and_logits() -> None:
    """What the trainer does before a compiled step on a GPU changes no result."""
    from aiayn import Transformer, TransformerConfig
    from aiayn.optim import LabelSmoothingLoss

    torch.manual_seed(0)
    # lengths 5, 3
    batch = make_batch([([5, 6, 7], [8, 9]), ([5, 6, 7, 9, 4], [8])], PAD, BOS, EOS)
    padded = batch.padded_to(8)
    assert padded.src.shape == (
        2,
        8,
    ) and padded.tgt_in.shape == padded.tgt_out.shape == (2, 8)
    assert (
        padded.n_src_tokens == batch.n_src_tokens
        and padded.n_tgt_tokens == batch.n_tgt_tokens
    )
    # a multiple of 1: nothing to add
    assert torch.equal(batch.padded_to(1).src, batch.src)
    model = Transformer(TransformerConfig.tiny(12, max_len=16)).eval()
    loss = LabelSmoothingLoss(0.1, ignore_index=0, reduction="sum")
    with torch.no_grad():
        a, b = model(batch.src, batch.tgt_in), model(padded.src, padded.tgt_in)
        assert torch.allclose(a, b[:, : a.size(1)], atol=1e-5)
        assert torch.allclose(
            loss(a, batch.tgt_out), loss(b, padded.tgt_out), atol=1e-4
        )


# --- what the documents say (chapter 11) ----------------------------------------------


def bracketed_labels(pairs) -> torch.Tensor:
    """<s> y </s> of each target, right-padded, as the documents slice it: [b, m+2]."""
    return pad_sequences([[BOS, *y, EOS] for _, y in pairs], PAD)


def test_slicing_a_bracketed_target_gives_the_labels_and_scored_logits_of_make_batch():
    """tgt[:, :-1] and tgt[:, 1:] differ from make_batch only where nothing scores."""
    from aiayn import Transformer, TransformerConfig

    pairs = [([5, 6, 7, 8], [9, 10, 11, 12, 13]), ([5, 6], [9, 10])]
    batch = make_batch(pairs, PAD, BOS, EOS)
    full = bracketed_labels(pairs)
    tgt_input, tgt_output = full[:, :-1], full[:, 1:]  # [batch, m + 1] each
    assert torch.equal(tgt_output, batch.tgt_out)
    differ = tgt_input != batch.tgt_in
    # the short target's end token, left in the input, where the label is padding
    assert differ.nonzero().tolist() == [[1, 3]] and tgt_input[1, 3] == EOS
    assert (batch.tgt_out[differ] == PAD).all()
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(14)).eval()
    with torch.no_grad():
        sliced = model(batch.src, tgt_input)  # [batch, m + 1, V]
        built = model(batch.src, batch.tgt_in)
    scored = batch.tgt_out != PAD
    assert torch.allclose(sliced[scored], built[scored], atol=1e-5)
    assert not torch.allclose(sliced[~scored], built[~scored], atol=1e-5)


def test_sliced_labels_of_a_batch_cannot_view_flat_but_those_of_make_batch_can():
    """The erratum: .view(-1) of tgt[:, 1:] raises for two sentences, not for one."""
    pairs = [([5, 6, 7], [8, 9, 10]), ([5], [8])]
    full = bracketed_labels(pairs)
    sliced, one = full[:, 1:], full[:1, 1:]  # of the batch, of one sentence
    assert not sliced.is_contiguous() and one.is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        sliced.view(-1)
    assert one.view(-1).tolist() == [8, 9, 10, EOS]
    tgt_out = make_batch(pairs, PAD, BOS, EOS).tgt_out
    assert tgt_out.is_contiguous() and torch.equal(tgt_out.view(-1), sliced.reshape(-1))

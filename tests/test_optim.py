"""Tests of aiayn.optim (chapter 12).

Label smoothing, the learning-rate schedule and Adam.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.optim import (
    LabelSmoothingLoss,
    make_optimizer,
    make_scheduler,
    rate,
    smoothed_targets,
    smoothing_entropy,
)


def batch(
    vocab_size: int = 13, pad_id: int = 0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [3, 7, V] and targets [3, 7] with padding at the ends of two rows."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(3, 7, vocab_size, generator=gen)
    target = torch.randint(1, vocab_size, (3, 7), generator=gen)
    target[0, 5:] = pad_id
    target[2, 2:] = pad_id
    return logits, target


# --- the loss against hand computations and PyTorch -----------------------------------


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.35])
def test_loss_equals_hand_computed_smoothed_cross_entropy(eps: float) -> None:
    V = 13
    logits, target = batch(V)
    per_position = []
    for z_row, t_row in zip(logits.tolist(), target.tolist()):
        for z, t in zip(z_row, t_row):
            if t == 0:
                continue
            log_z = math.log(sum(math.exp(v) for v in z))
            log_p = [v - log_z for v in z]
            q = [eps / V + (1 - eps if v == t else 0.0) for v in range(V)]
            per_position.append(-sum(qv * lp for qv, lp in zip(q, log_p)))
    expected = sum(per_position) / len(per_position)
    got = LabelSmoothingLoss(eps, ignore_index=0)(logits, target).item()
    assert got == pytest.approx(expected, rel=1e-6)
    total = LabelSmoothingLoss(eps, ignore_index=0, reduction="sum")(
        logits, target
    ).item()
    assert total == pytest.approx(sum(per_position), rel=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("ignore_index", [0, 4, -100])
def test_equals_torch_cross_entropy_with_label_smoothing(
    eps: float, ignore_index: int
) -> None:
    V = 13
    logits, target = batch(V, pad_id=ignore_index)
    for reduction in ("mean", "sum", "none"):
        ours = LabelSmoothingLoss(eps, ignore_index=ignore_index, reduction=reduction)(
            logits, target
        )
        theirs = F.cross_entropy(
            logits.reshape(-1, V),
            target.reshape(-1),
            label_smoothing=eps,
            ignore_index=ignore_index,
            reduction=reduction,
        )
        assert torch.allclose(ours.reshape(theirs.shape), theirs, atol=1e-5), reduction


def test_kl_divergence_is_cross_entropy_minus_the_exact_entropy_constant() -> None:
    V, eps = 13, 0.1
    logits, target = batch(V)
    keep = target != 0
    q = smoothed_targets(target, V, eps, ignore_index=0)
    log_p = torch.log_softmax(logits, -1)
    kl = F.kl_div(log_p[keep], q[keep], reduction="none").sum(-1)
    ce = LabelSmoothingLoss(eps, ignore_index=0, reduction="none")(logits, target)[keep]
    on, off = 1 - eps + eps / V, eps / V
    h = -on * math.log(on) - (V - 1) * off * math.log(off)
    assert smoothing_entropy(V, eps) == pytest.approx(h, rel=1e-12)
    assert torch.allclose(ce - kl, torch.full_like(kl, h), atol=1e-5)
    # ... and the constant is also the smallest value of the loss, reached at p = q'.
    at_optimum = LabelSmoothingLoss(eps, ignore_index=None)(
        torch.log(q[keep]), target[keep]
    )
    assert at_optimum.item() == pytest.approx(h, rel=1e-5)
    assert smoothing_entropy(V, 0.0) == 0.0


def test_kl_divergence_has_the_gradients_of_the_cross_entropy() -> None:
    """KL(q' || p) and H(q', p) differ by a constant, so their gradients agree."""
    V, eps = 13, 0.1
    logits, target = batch(V)
    keep = target != 0
    q = smoothed_targets(target, V, eps, ignore_index=0)
    z = logits.clone().requires_grad_(True)
    (grad_ce,) = torch.autograd.grad(LabelSmoothingLoss(eps, 0)(z, target), z)
    kl = F.kl_div(torch.log_softmax(z, -1)[keep], q[keep], reduction="batchmean")
    (grad_kl,) = torch.autograd.grad(kl, z)
    assert torch.allclose(grad_ce, grad_kl, atol=1e-7)


def test_tensor2tensor_convention_is_pytorchs_loss_at_a_larger_eps() -> None:
    """eps / (V - 1) on the others is the all-V convention at eps' = eps V / (V - 1)."""
    V, eps = 11, 0.1
    logits, target = batch(V)
    keep = target != 0
    q = torch.full((*target.shape, V), eps / (V - 1))
    q.scatter_(-1, target.unsqueeze(-1), 1 - eps)
    t2t = -(q * torch.log_softmax(logits, -1)).sum(-1)[keep].mean()
    at_prime = LabelSmoothingLoss(eps * V / (V - 1), ignore_index=0)(logits, target)
    assert torch.allclose(t2t, at_prime, atol=1e-6)
    assert not torch.allclose(t2t, LabelSmoothingLoss(eps, 0)(logits, target))


def test_decomposition_nll_plus_uniform_cross_entropy() -> None:
    V, eps = 13, 0.2
    logits, target = batch(V)
    log_p = torch.log_softmax(logits, -1)
    nll = F.nll_loss(
        log_p.reshape(-1, V), target.reshape(-1), ignore_index=0, reduction="none"
    )
    uniform = -log_p.mean(-1).reshape(-1)
    expected = torch.where(
        target.reshape(-1) != 0, (1 - eps) * nll + eps * uniform, 0.0
    )
    got = LabelSmoothingLoss(eps, ignore_index=0, reduction="none")(
        logits, target
    ).reshape(-1)
    assert torch.allclose(got, expected, atol=1e-6)


# --- padding and reductions -----------------------------------------------------------


def test_ignored_positions_contribute_nothing_whatever_their_logits() -> None:
    V = 13
    logits, target = batch(V)
    pad = target == 0
    changed = logits.clone()
    changed[pad] = torch.randn(int(pad.sum()), V) * 1e4
    for reduction in ("mean", "sum", "none"):
        loss_fn = LabelSmoothingLoss(0.1, ignore_index=0, reduction=reduction)
        assert torch.equal(loss_fn(logits, target), loss_fn(changed, target))
    per_position = LabelSmoothingLoss(0.1, ignore_index=0, reduction="none")(
        logits, target
    )
    assert per_position.shape == target.shape
    assert bool((per_position[pad] == 0).all()) and bool((per_position[~pad] > 0).all())
    mean = LabelSmoothingLoss(0.1, ignore_index=0)(logits, target)
    assert mean.item() == pytest.approx(
        per_position.sum().item() / int((~pad).sum()), rel=1e-6
    )
    z = logits.clone().requires_grad_(True)
    LabelSmoothingLoss(0.1, ignore_index=0)(z, target).backward()
    assert bool((z.grad[pad] == 0).all()) and bool((z.grad[~pad] != 0).any())


def test_all_ignored_batch_gives_zero_not_nan() -> None:
    z = torch.randn(2, 5, 9, requires_grad=True)
    target = torch.zeros(2, 5, dtype=torch.long)
    for reduction in ("mean", "sum"):
        loss = LabelSmoothingLoss(0.1, ignore_index=0, reduction=reduction)(z, target)
        assert loss.item() == 0.0
    loss = LabelSmoothingLoss(0.1, ignore_index=0)(z, target)
    loss.backward()
    assert torch.equal(z.grad, torch.zeros_like(z))
    none = LabelSmoothingLoss(0.1, ignore_index=0, reduction="none")(z, target)
    assert torch.equal(none, torch.zeros(2, 5))
    empty = LabelSmoothingLoss(0.1)(torch.randn(0, 9), torch.zeros(0, dtype=torch.long))
    assert empty.item() == 0.0


def test_more_padding_leaves_the_mean_and_torch_gives_nan_on_padding_only() -> None:
    """Appended padding changes nothing; where all is padding, torch gives nan."""
    V = 13
    logits, target = batch(V)
    loss_fn = LabelSmoothingLoss(0.1, ignore_index=0)
    longer_logits = torch.cat([logits, 50 * torch.randn(3, 4, V)], dim=1)  # [3, 11, V]
    longer_target = torch.cat([target, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    assert torch.allclose(
        loss_fn(longer_logits, longer_target), loss_fn(logits, target)
    )
    all_pad = torch.zeros(8, dtype=torch.long)
    theirs = F.cross_entropy(
        torch.randn(8, V), all_pad, ignore_index=0, label_smoothing=0.1
    )
    assert torch.isnan(theirs) and loss_fn(torch.randn(8, V), all_pad).item() == 0.0


def test_ignore_index_none_and_out_of_range_ignore_index() -> None:
    V = 7
    logits, target = batch(V)
    every = LabelSmoothingLoss(0.1, ignore_index=None)(logits, target)
    theirs = F.cross_entropy(
        logits.reshape(-1, V), target.reshape(-1), label_smoothing=0.1
    )
    assert torch.allclose(every, theirs, atol=1e-6)
    padded = target.masked_fill(target == 0, -100)
    assert torch.allclose(
        LabelSmoothingLoss(0.1, ignore_index=-100)(logits, padded),
        LabelSmoothingLoss(0.1, ignore_index=0)(logits, target),
    )


def test_accepts_any_leading_shape_and_int32_targets() -> None:
    V = 11
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, V, generator=gen)
    target = torch.randint(1, V, (2, 3, 4), generator=gen)
    loss_fn = LabelSmoothingLoss(0.1)
    flat = loss_fn(logits.reshape(-1, V), target.reshape(-1))
    assert torch.allclose(loss_fn(logits, target), flat)
    assert torch.allclose(loss_fn(logits, target.int()), flat)
    assert torch.allclose(
        loss_fn(logits[0, 0, 0], target[0, 0, 0]),
        loss_fn(logits[:1, 0, 0], target[:1, 0, 0]),
    )


# --- numerical safety -----------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, big",
    [(torch.float32, 1e30), (torch.bfloat16, 1e30), (torch.float16, 65504.0)],
)
def test_finite_loss_and_gradients_with_extreme_logits(
    dtype: torch.dtype, big: float
) -> None:
    V = 13
    _, target = batch(V)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 7, V, generator=gen).sign() * big
    z[0, 0, target[0, 0]] = -big  # certain of a wrong token
    z = z.to(dtype).requires_grad_(True)
    for reduction in ("mean", "sum", "none"):
        loss = LabelSmoothingLoss(0.1, reduction=reduction)(z, target)
        assert loss.dtype == torch.float32
        assert bool(torch.isfinite(loss).all())
    loss = LabelSmoothingLoss(0.1)(z, target)
    loss.backward()
    assert z.grad.dtype == dtype and bool(torch.isfinite(z.grad).all())
    assert loss.item() > 0


def test_minimum_over_free_logits_is_the_smoothed_target() -> None:
    """LBFGS on the loss lands on p* = q', at the gap delta* and the loss H(q')."""
    V, eps, y = 1000, 0.1, 7
    z = torch.zeros(1, V, dtype=torch.float64, requires_grad=True)
    loss_fn = LabelSmoothingLoss(eps, ignore_index=None)
    optimizer = torch.optim.LBFGS([z], max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(z, torch.tensor([y]))
        loss.backward()
        return loss

    optimizer.step(closure)
    p = torch.softmax(z.detach(), -1)[0]
    gap = (z[0, y] - torch.cat([z[0, :y], z[0, y + 1 :]]).max()).item()
    assert p[y].item() == pytest.approx(1 - eps + eps / V, rel=1e-5)
    assert p[0].item() == pytest.approx(eps / V, rel=1e-3)
    assert gap == pytest.approx(math.log(1 + (1 - eps) * V / eps), abs=1e-3)
    h = smoothing_entropy(V, eps)
    assert loss_fn(z, torch.tensor([y])).item() == pytest.approx(h, rel=1e-6)


def test_the_chapters_round_numbers_for_the_papers_vocabulary() -> None:
    """For V = 37000: delta* 12.7, H(q') 1.38 nats, perplexity 1.11 at the optimum."""
    V, eps = 37000, 0.1
    assert round(math.log(1 + (1 - eps) * V / eps), 1) == 12.7
    assert round(smoothing_entropy(V, eps), 2) == 1.38
    assert round(1 / (1 - eps + eps / V), 2) == 1.11  # 1 exactly without smoothing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_match_float32(dtype: torch.dtype) -> None:
    logits, target = batch(13)
    logits = logits.to(dtype)
    ours = LabelSmoothingLoss(0.1)(logits, target)
    reference = LabelSmoothingLoss(0.1)(logits.float(), target)
    assert torch.equal(ours, reference)


def test_no_nan_where_probabilities_underflow_even_with_a_minus_inf_logit() -> None:
    # A -inf logit (a token masked out of the vocabulary) makes the smoothed loss
    # +inf, as the smoothed target gives that token mass; without smoothing the loss
    # is finite.
    z = torch.tensor([[0.0, 200.0, -float("inf"), 1.0]])
    y = torch.tensor([1])
    assert LabelSmoothingLoss(0.0, ignore_index=None)(z, y).item() == pytest.approx(
        0.0, abs=1e-6
    )
    assert LabelSmoothingLoss(0.1, ignore_index=None)(z, y).item() == math.inf
    assert not torch.isnan(
        LabelSmoothingLoss(0.1, ignore_index=0)(z, torch.tensor([0]))
    )


def test_gradient_is_softmax_minus_smoothed_target() -> None:
    V, eps = 13, 0.1
    logits, target = batch(V)
    z = logits.clone().requires_grad_(True)
    LabelSmoothingLoss(eps, reduction="sum")(z, target).backward()
    keep = (target != 0).unsqueeze(-1)
    expected = (torch.softmax(logits, -1) - smoothed_targets(target, V, eps)) * keep
    assert torch.allclose(z.grad, expected, atol=1e-6)


# --- smoothed_targets -----------------------------------------------------------------


def test_smoothed_targets_values_and_sums() -> None:
    V, eps = 13, 0.1
    _, target = batch(V)
    q = smoothed_targets(target, V, eps, ignore_index=0)
    assert q.shape == (3, 7, V) and q.dtype == torch.float32
    keep = target != 0
    assert torch.allclose(q.sum(-1)[keep], torch.ones(int(keep.sum())))
    assert bool((q[~keep] == 0).all())
    true = q.gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep]
    assert torch.allclose(true, torch.full_like(true, 1 - eps + eps / V))
    assert int((q[keep] == torch.tensor(eps / V)).sum(-1).min()) == V - 1
    assert torch.equal(
        smoothed_targets(torch.tensor([2]), 5, 0.0, None),
        F.one_hot(torch.tensor([2]), 5).float(),
    )
    example = smoothed_targets(torch.tensor(2), 5, 0.1, ignore_index=None)
    assert torch.allclose(
        example, torch.full((5,), 0.02).index_fill(0, torch.tensor([2]), 0.92)
    )


def test_doc004_example_is_the_first_convention_not_its_code() -> None:
    """0.92 / 0.02 for token 2 of 5 is eps over all V; the code builds eps / (V - 2)."""
    example = torch.tensor([0.02, 0.02, 0.92, 0.02, 0.02])
    ours = smoothed_targets(torch.tensor(2), 5, 0.1, ignore_index=None)
    assert torch.allclose(ours, example)
    code = torch.full((5,), 0.1 / 3).index_fill(0, torch.tensor([2]), 0.9)
    code[0] = 0.0  # the padding token
    assert not torch.allclose(code, example, atol=1e-2)


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [-0.1, 1.0, 1.5])
def test_smoothing_outside_unit_interval_raises(smoothing: float) -> None:
    with pytest.raises(ValueError, match="smoothing must lie in"):
        LabelSmoothingLoss(smoothing)
    with pytest.raises(ValueError, match="smoothing must lie in"):
        smoothed_targets(torch.tensor([1]), 5, smoothing)


def test_bad_inputs_raise_clear_value_errors() -> None:
    logits, target = batch(13)
    loss_fn = LabelSmoothingLoss(0.1)
    with pytest.raises(ValueError, match="reduction"):
        LabelSmoothingLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="leading dimensions"):
        loss_fn(logits, target[:, :-1])
    with pytest.raises(ValueError, match="leading dimensions"):
        loss_fn(logits.reshape(-1, 13), target)
    with pytest.raises(ValueError, match="integer token ids"):
        loss_fn(logits, target.float())
    with pytest.raises(ValueError, match="integer token ids"):
        loss_fn(logits, target > 3)
    with pytest.raises(ValueError, match="floating-point"):
        loss_fn(target, target)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        loss_fn(logits[..., :10], target.clamp(max=12).masked_fill(target == 1, 12))
    with pytest.raises(ValueError, match="ids from -1"):
        loss_fn(logits, target.masked_fill(target == 0, -1))
    with pytest.raises(ValueError, match="vocab_size"):
        smoothed_targets(target, 0)


# --- rate -----------------------------------------------------------------------------


def test_rate_matches_equation_3() -> None:
    for d_model, warmup in [
        (512, 4000),
        (512, 8000),
        (256, 4000),
        (1024, 4000),
        (64, 10),
    ]:
        for step in [1, 2, 7, warmup - 1, warmup, warmup + 1, 3 * warmup, 100_000]:
            expected = (1 / math.sqrt(d_model)) * min(
                1 / math.sqrt(step), step / warmup**1.5
            )
            assert rate(step, d_model, warmup) == pytest.approx(expected, rel=1e-12)
            assert rate(step, d_model, warmup, factor=2.5) == pytest.approx(
                2.5 * expected, rel=1e-12
            )
    assert rate(0, 512) == 0.0


def test_rate_peaks_at_warmup_with_the_expected_value() -> None:
    assert rate(4000, 512, 4000) == pytest.approx(6.987712429686844e-4, rel=1e-12)
    assert f"{rate(4000, 512, 4000):.1e}" == "7.0e-04"
    for d_model, warmup in [(512, 4000), (512, 8000), (256, 4000), (1024, 4000)]:
        values = [rate(s, d_model, warmup) for s in range(1, 3 * warmup)]
        assert values.index(max(values)) + 1 == warmup
        assert max(values) == pytest.approx((d_model * warmup) ** -0.5, rel=1e-12)
        # linear warmup: rate(s) / s is constant before the peak
        assert rate(warmup // 2, d_model, warmup) == pytest.approx(
            rate(warmup, d_model, warmup) / 2
        )
    assert rate(100_000, 512) == pytest.approx(1.3975e-4, rel=1e-4)


def test_schedules_with_different_warmups_coincide_after_both_warmups() -> None:
    """After the warmup the rate does not depend on warmup_steps."""
    assert all(rate(s, 512, 4000) == rate(s, 512, 8000) for s in range(8000, 20_000))
    assert rate(7999, 512, 4000) != rate(7999, 512, 8000)


def test_rate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="step"):
        rate(-1, 512)
    with pytest.raises(ValueError, match="d_model"):
        rate(1, 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        rate(1, 512, warmup_steps=0)
    with pytest.raises(ValueError, match="factor"):
        rate(1, 512, factor=0.0)


# --- make_scheduler -------------------------------------------------------------------


@pytest.mark.parametrize("d_model, warmup, factor", [(512, 40, 1.0), (64, 7, 2.0)])
def test_scheduler_gives_the_kth_update_rate_k(
    d_model: int, warmup: int, factor: float
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, d_model, warmup, factor)
    for k in range(1, 3 * warmup + 5):
        lr = optimizer.param_groups[0]["lr"]
        assert lr == pytest.approx(rate(k, d_model, warmup, factor), rel=1e-12), k
        assert scheduler.get_last_lr()[0] == lr
        optimizer.zero_grad()
        model(torch.randn(2, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()


def test_scheduler_applies_to_every_param_group() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    optimizer = make_optimizer([{"params": [a]}, {"params": [b], "weight_decay": 0.01}])
    make_scheduler(optimizer, 512, 100)
    assert [g["lr"] for g in optimizer.param_groups] == [rate(1, 512, 100)] * 2


def test_scheduler_requires_lr_one() -> None:
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError, match="lr=1.0"):
        make_scheduler(optimizer, 512)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_scheduler(
            make_optimizer([nn.Parameter(torch.zeros(2))]), 512, warmup_steps=0
        )


def test_scheduler_and_optimizer_resume_from_state_dicts() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, 64, 10)
    for _ in range(6):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        buffer,
    )
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    # A new run: optimizer with lr 1.0, a scheduler, then the saved states.
    optimizer2 = make_optimizer(model)
    scheduler2 = make_scheduler(optimizer2, 64, 10)
    optimizer2.load_state_dict(state["optimizer"])
    scheduler2.load_state_dict(state["scheduler"])
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(rate(7, 64, 10), rel=1e-12)
    optimizer2.step()
    scheduler2.step()
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(rate(8, 64, 10), rel=1e-12)
    # Creating the scheduler after loading the optimizer's state works too
    # (initial_lr is kept).
    optimizer3 = make_optimizer(model)
    optimizer3.load_state_dict(state["optimizer"])
    scheduler3 = make_scheduler(optimizer3, 64, 10)
    scheduler3.load_state_dict(state["scheduler"])
    assert scheduler3.last_epoch == 6


# --- make_optimizer -------------------------------------------------------------------


def test_make_optimizer_has_the_papers_settings() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    optimizer = make_optimizer(model)
    assert isinstance(optimizer, torch.optim.Adam)
    group = optimizer.param_groups[0]
    assert group["lr"] == 1.0 and group["betas"] == (0.9, 0.98)
    assert group["eps"] == 1e-9 and group["weight_decay"] == 0.0
    assert len(group["params"]) == 4
    custom = make_optimizer(
        model.parameters(), lr=3e-4, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.1
    )
    group = custom.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-4,
        (0.9, 0.999),
        1e-8,
        0.1,
    )


def test_make_optimizer_skips_frozen_and_counts_shared_parameters_once() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model = nn.ModuleDict({"embed": embed, "head": head, "frozen": frozen})
    params = make_optimizer(model).param_groups[0]["params"]
    assert len(params) == 1 and params[0] is embed.weight


def test_three_steps_of_the_recipe_on_the_tiny_model() -> None:
    """Chapter 9's tiny model: its shared embedding once, and a falling loss."""
    from aiayn.model import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(vocab_size=100))
    d_model, pad = model.config.d_model, model.config.pad_id
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, d_model=d_model, warmup_steps=4000)
    group = optimizer.param_groups[0]
    assert sum(p.numel() for p in group["params"]) == model.num_parameters()
    assert len(group["params"]) == len(list(model.parameters()))
    assert group["lr"] == rate(1, d_model)
    src = torch.randint(3, 100, (4, 9))
    tgt = torch.randint(3, 100, (4, 8))
    tgt[:2, 6:] = pad  # two shorter target sentences
    criterion = LabelSmoothingLoss(0.1, ignore_index=pad)
    losses = []
    for _ in range(3):
        loss = criterion(model(src, tgt[:, :-1]), tgt[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert group["lr"] == pytest.approx(rate(4, d_model), rel=1e-12)


def test_make_optimizer_update_is_adam() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    g = torch.randn(5)
    optimizer = make_optimizer([w], lr=1e-2)
    w0 = w.detach().clone()
    w.grad = g.clone()
    optimizer.step()
    # First step: bias-corrected m = g, v = g^2, so the update is lr * g / (|g| + eps).
    assert torch.allclose(w.detach(), w0 - 1e-2 * g / (g.abs() + 1e-9), atol=1e-7)


def test_make_optimizer_rejects_bad_arguments() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="lr"):
        make_optimizer(p, lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        make_optimizer(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        make_optimizer(p, eps=-1.0)
    with pytest.raises(ValueError, match="no parameters"):
        make_optimizer(nn.ReLU())


def test_eps_underflows_in_float16_but_not_in_float32_or_bfloat16() -> None:
    assert torch.tensor(1e-9, dtype=torch.float16).item() == 0.0
    assert torch.tensor(1e-9, dtype=torch.bfloat16).item() > 0.0
    assert torch.tensor(1e-9, dtype=torch.float32).item() > 0.0


def test_target_ids_are_checked_on_the_cpu_and_not_read_elsewhere() -> None:
    """The loss reads its target ids on the CPU only (a meta tensor has no values)."""
    loss = LabelSmoothingLoss(0.1, ignore_index=0)
    with pytest.raises(ValueError, match="target ids must lie in"):
        loss(torch.randn(2, 3, 8), torch.tensor([[1, 2, 8], [3, 0, 0]]))
    logits = torch.empty(2, 3, 8, device="meta")
    target = torch.full((2, 3), 99, device="meta")  # out of range, were it read
    assert loss(logits, target).device.type == "meta"
    with pytest.raises(ValueError, match="integer token ids"):
        loss(logits, target.float())

"""gpu_check's sdpa part: the attention kernels, their accuracy, new shapes' cost."""

from __future__ import annotations

import contextlib
import re
import statistics
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .common import Context, random_pairs, report, synchronize, timed

if TYPE_CHECKING:  # torch is imported inside the parts, never by the driver
    import torch

SDPA_KERNELS = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
LAYER = "LAYER"  # the kernels MultiHeadAttention lets run, its FUSED_KERNELS


def layer_kernels(kernel: str | None) -> contextlib.AbstractContextManager:
    """Let the book's layer run one kernel; None or LAYER: the layer's own choice.

    Chapter 3's layer leaves cuDNN's kernel out unless a choice around it (this
    sdpa_kernel) names that kernel alone.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel in (None, LAYER):
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, kernel)])


def book_masks(device: torch.device, batch: int, length: int) -> dict:
    """Chapter 2's padding and target masks for tokens with 7 pads at the end."""
    import torch

    from aiayn.masks import padding_mask, target_mask

    tokens = torch.randint(4, 100, (batch, length), device=device)
    tokens[:, length - 7 :] = 0  # padding at the end
    return {
        "pad[B,1,1,L]": padding_mask(tokens, 0),
        "tgt[B,1,L,L]": target_mask(tokens, 0),
    }


def backend_runs(backend: str, dtype: Any, mask: Any, device: Any) -> bool:
    """Whether one attention kernel runs forward and backward with this mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = mask.size(0), 8, mask.size(-1), 64
    q, k, v = (
        torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    try:
        with warnings.catch_warnings(), sdpa_kernel([getattr(SDPBackend, backend)]):
            warnings.simplefilter("ignore")  # each refusal warns why
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.float().sum().backward()
        synchronize(device)
    except RuntimeError:
        return False
    return True


def check_backends(ctx: Context, masks: dict) -> None:
    """The kernels that run with the book's boolean masks, in each precision."""
    import torch
    from torch.nn.attention import SDPBackend

    kernels = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
    kernels = tuple(k for k in kernels if hasattr(SDPBackend, k))
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, mask in masks.items():
            device = mask.device
            runs = [k for k in kernels if backend_runs(k, dtype, mask, device)]
            cells = "+".join(k.split("_")[0].lower() for k in runs) or "none"
            rows.append(f"{str(dtype).replace('torch.', '')} {name}: runs on {cells}")
    print("\n".join(rows))
    report("sdpa.backends", "INFO", "; ".join(rows))


def check_default_kernel(ctx: Context, masks: dict) -> None:
    """The kernels the default choice runs in bf16 with a [B,1,L,L] mask (CUDA)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from aiayn.multi_head import MultiHeadAttention

    if not ctx.cuda:
        report("sdpa.default", "SKIPPED", "kernel names come from the CUDA profiler")
        return
    device = torch.device(ctx.device)
    mask = masks["tgt[B,1,L,L]"]
    mha = MultiHeadAttention(512, 8).to(device)
    x = torch.randn(mask.size(0), mask.size(-1), 512, device=device, requires_grad=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = mha(x, mask=mask)
        y.float().sum().backward()
        synchronize(device)
    keys = ("fmha", "flash", "attention", "cudnn", "softmax", "efficient")
    names = sorted(
        {e.key for e in prof.key_averages() if any(s in e.key.lower() for s in keys)}
    )
    report("sdpa.default", "INFO", "kernels: " + ", ".join(n[:60] for n in names[:5]))


def check_accuracy(ctx: Context, masks: dict) -> None:
    """The default kernel against the math kernel in float64, for both masks."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    errors = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, mask in masks.items():
            b, n = mask.size(0), mask.size(-1)
            q, k, v = (torch.randn(b, 8, n, 64, device=mask.device) for _ in range(3))
            with sdpa_kernel([SDPBackend.MATH]):
                ref = F.scaled_dot_product_attention(
                    q.double(), k.double(), v.double(), attn_mask=mask
                )
            out = F.scaled_dot_product_attention(
                q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask
            )
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            label = f"{str(dtype).replace('torch.', '')} {name.split('[')[0]}"
            errors.append((label, rel))
    tol = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-3}  # float32 may use tf32
    bad = [e for e in errors if not e[1] < tol[e[0].split()[0]]]
    report(
        "sdpa.accuracy",
        "PASS" if not bad else "FAIL",
        "default kernel vs float64 math, relative error: "
        + ", ".join(f"{n} {e:.1e}" for n, e in errors),
    )


def masked_row(mha: Any, mask: Any, dtype: Any, kernel: str | None) -> tuple | None:
    """(row 2 of batch 0 is the bias and grads are finite, note); None: no kernel."""
    import torch

    device = mask.device
    x = torch.randn(2, 5, 64, device=device, requires_grad=True)
    autocast = torch.autocast(
        device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    )
    try:
        with layer_kernels(kernel), autocast:
            out, _ = mha(x, mask=mask)
        out.float().sum().backward()
    except RuntimeError as err:
        if "No viable backend" in str(err) or "No available kernel" in str(err):
            return None  # the kernel does not exist on this device
        return False, str(err)[:40]
    finite = bool(torch.isfinite(out).all() and torch.isfinite(x.grad).all())
    is_bias = torch.allclose(out[0, 2].float(), mha.out_proj.bias.float(), atol=1e-2)
    return finite and is_bias, finite


def check_fully_masked_row(ctx: Context) -> None:
    """A query with nothing to attend to: output = out_proj's bias, finite grads."""
    import torch

    from aiayn.multi_head import MultiHeadAttention

    device = torch.device(ctx.device)
    mha = MultiHeadAttention(64, 4).to(device)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool, device=device)
    mask[0, :, 2, :] = False
    results, absent = [], []
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    for label, dtype in dtypes.items():
        for kernel in (LAYER, *SDPA_KERNELS):
            name = f"{label}/{kernel.split('_')[0].lower()}"
            result = masked_row(mha, mask, dtype, kernel)
            if result is None:
                absent.append(name)
            else:
                results.append((name, *result))
    bad = [r for r in results if not r[1]]
    # the layer's own kernels must hold; cuDNN's, which it leaves out, may not
    layer_bad = [r for r in bad if r[0].endswith("/layer")]
    report(
        "sdpa.fully_masked_row",
        "FAIL" if layer_bad else "WARN" if bad else "PASS",
        f"output = bias, finite grads in {len(results) - len(bad)}/{len(results)}"
        + (f"; not in: {[(r[0], r[2]) for r in bad]}" if bad else "")
        + (f"; no such kernel on {device.type}: {', '.join(absent)}" if absent else ""),
    )


def first_calls(fn: Callable[[], Any], device: Any) -> tuple[float, float]:
    """Seconds of fn's first call, and the median of three repeats."""
    first = timed(fn, device)
    return first, statistics.median(timed(fn, device) for _ in range(3))


def kernel_call(kernel: str, b: int, n: int, dtype: Any, device: Any) -> Callable:
    """One attention call, forward and backward, on new [b, 8, n, 64] inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = book_masks(device, b, n)["tgt[B,1,L,L]"]
    q, k, v = (
        torch.randn(b, 8, n, 64, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(b, 8, n, 64, device=device, dtype=dtype)

    from aiayn.multi_head import fused_kernels

    def chosen() -> contextlib.AbstractContextManager:
        """The one kernel, or those that the layer lets run."""
        if kernel == LAYER:
            return fused_kernels()
        return sdpa_kernel([getattr(SDPBackend, kernel)])

    def call() -> None:
        """Forward and backward on the one kernel (or those the layer lets run)."""
        with chosen():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(grad)

    return call


def kernel_error(err: RuntimeError, caught: list) -> str:
    """Why a kernel did not run, from the error and the warnings that came with it."""
    reasons = []
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally.*", "", str(w.message)).strip()
        if text and not text.endswith(":") and text not in reasons:
            reasons.append(text[:80])
    if "No viable backend" in str(err) or "No available kernel" in str(err):
        return "not available" + (f": {'; '.join(reasons[:2])}" if reasons else " here")
    return f"does not run: {str(err).splitlines()[0][:80]}"


def attempt(make_call: Callable, kernel: str, b: int, n: int, device: Any) -> Any:
    """First-call and repeat seconds of a kernel on a new shape, or why it fails."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return first_calls(make_call(kernel, b, n), device)
        except RuntimeError as err:
            return kernel_error(err, caught)


def new_shape_costs(
    make_call: Callable[[str, int, int], Callable], shapes: list, device: Any
) -> dict[str, tuple[list[float], list[float]] | str]:
    """For each kernel: first-call and repeat seconds over new shapes, or why not.

    Each kernel first runs on a shape of its own (its one-time setup); then
    kernel j gets batch b + j, so that every shape is new to every kernel, and
    the order of the kernels rotates from one shape to the next.
    """
    from torch.nn.attention import SDPBackend

    kernels = [k for k in SDPA_KERNELS if hasattr(SDPBackend, k)] + [LAYER]
    found: dict[str, Any] = {}
    for j, kernel in enumerate(kernels):
        warm = attempt(make_call, kernel, 2 + j, 8, device)
        found[kernel] = warm if isinstance(warm, str) else ([], [])
    for i, (b, n) in enumerate(shapes):
        for j in range(len(kernels)):
            kernel = kernels[(i + j) % len(kernels)]
            if isinstance(found[kernel], str):
                continue
            costs = attempt(make_call, kernel, b + kernels.index(kernel), n, device)
            if isinstance(costs, str):
                found[kernel] = costs
                continue
            found[kernel][0].append(costs[0])
            found[kernel][1].append(costs[1])
    return found


def fmt_costs(found: dict) -> str:
    """Median first-call and repeat milliseconds of each kernel."""
    parts = []
    for kernel, costs in found.items():
        name = kernel.split("_")[0].lower()
        if isinstance(costs, str):
            parts.append(f"{name} {costs}")
            continue
        first, again = statistics.median(costs[0]), statistics.median(costs[1])
        parts.append(
            f"{name} first {first * 1e3:.1f} ms vs repeat {again * 1e3:.1f} ms "
            f"({(first - again) * 1e3:+.1f}, max first {max(costs[0]) * 1e3:.0f})"
        )
    return "; ".join(parts)


def check_first_call(ctx: Context) -> None:
    """What the first call on a new (batch, length) costs each attention kernel."""
    import torch

    device = torch.device(ctx.device)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    shapes = [(12, 24), (20, 31), (28, 18), (36, 45), (44, 27), (52, 38), (60, 21)]
    shapes += [(68, 52), (76, 33), (84, 15)]
    shapes = shapes[:4] if ctx.small else shapes

    def make_call(kernel: str, b: int, n: int) -> Callable:
        """One attention call on new inputs of shape [b, 8, n, 64]."""
        return kernel_call(kernel, b, n, dtype, device)

    found = new_shape_costs(make_call, shapes, device)
    dtype_name = str(dtype).replace("torch.", "")
    report(
        "sdpa.first_call",
        "INFO",
        f"{dtype_name} [B,8,L,64], [B,1,L,L] mask, forward + backward, "
        f"{len(shapes)} new shapes each, medians: {fmt_costs(found)}",
    )


def check_first_step(ctx: Context) -> None:
    """What a tiny model's forward and backward on a new shape costs, by kernel."""
    import torch
    import torch.nn.functional as F

    from aiayn import Transformer, TransformerConfig
    from aiayn.batching import make_batch
    from aiayn.train import autocast

    device = torch.device(ctx.device)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.tiny(50, max_len=128)).to(device).train()
    c = model.config
    shapes = [(70, 23), (90, 17), (40, 41), (120, 12), (55, 30), (35, 50), (80, 26)]
    shapes = shapes[:3] if ctx.small else shapes

    def make_call(kernel: str, b: int, n: int) -> Callable:
        """A forward and backward pass on a new batch of b pairs of n tokens."""
        pairs = random_pairs(b, n, n - 1, 50, seed=b * 1000 + n, full=True)
        batch = make_batch(pairs, c.pad_id, c.bos_id, c.eos_id).to(device)

        def step() -> None:
            """The pass, every attention call on one kernel (or the layer's own)."""
            with layer_kernels(kernel):
                with autocast("auto", device):
                    logits = model(batch.src, batch.tgt_in)  # [b, n, V]
                loss = F.cross_entropy(
                    logits.float().flatten(0, 1), batch.tgt_out.flatten()
                )
                loss.backward()

        return step

    found = new_shape_costs(make_call, shapes, device)
    report(
        "sdpa.first_step",
        "INFO",
        f"tiny Transformer, forward + backward under amp auto, {len(shapes)} new "
        f"(batch, length) each, medians: {fmt_costs(found)}",
    )


def part_sdpa(ctx: Context) -> None:
    """Attention kernels: which run, how exact, masked rows, new shapes' cost."""
    import torch

    masks = book_masks(torch.device(ctx.device), 8, 40)
    check_backends(ctx, masks)
    check_default_kernel(ctx, masks)
    check_accuracy(ctx, masks)
    check_fully_masked_row(ctx)
    check_first_call(ctx)
    check_first_step(ctx)

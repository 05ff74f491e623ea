"""Float8 training, measured side by side: accuracy everywhere, speed on a GPU with float8.

    python benchmarks/float8.py [--markdown] [--iters 20] [--no-step]

1. Accuracy (any machine): SQNR in dB of a float8 linear's output, weight gradient and input
   gradient against float32, for every recipe, on plain Gaussian inputs, on inputs with outlier
   channels (two input features x1000, as in LLM activations) and with outlier tokens (two
   rows x1000).
2. Speed (CUDA with float8 tensor cores only; on CPU float8 is emulated, so timing it says
   nothing): forward+backward time of one linear in bf16 and in each recipe at
   M,K,N = 4096,8192,16384 and 1024,2048,1024 (torch.compile'd, as torchao measures), of one
   1B-flavor transformer block, and the training tokens/s of the whole 1B-flavor model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import platform

import torch
from torch import nn

from titanext._text import format_table
from titanext.plugins.float8 import FLOAT8_RECIPES, apply_float8, has_float8_hardware

logging.getLogger("titanext").setLevel(logging.ERROR)  # no per-conversion log lines in tables


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    err = (ref.float() - actual.float()).norm()
    return float("inf") if err == 0 else (20 * torch.log10(ref.float().norm() / err)).item()


def _inputs(kind: str, m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k)
    if kind == "outlier channels":
        x[:, [3, 77]] *= 1000.0
    elif kind == "outlier tokens":
        x[[5, 200]] *= 1000.0
    return x


def accuracy_table(m: int = 512, k: int = 1024, n: int = 512) -> list[dict]:
    rows = []
    for kind in ("gaussian", "outlier channels", "outlier tokens"):
        for recipe in FLOAT8_RECIPES:
            torch.manual_seed(0)
            ref = nn.Sequential(nn.Linear(k, n, bias=False))
            f8 = nn.Sequential(nn.Linear(k, n, bias=False))
            f8.load_state_dict(ref.state_dict())
            apply_float8(f8, recipe=recipe, emulate=True, device="cpu")
            x = _inputs(kind, m, k)
            x_ref, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_ref, y_f8 = ref(x_ref), f8(x_f8)
            grad = torch.randn_like(y_ref)
            y_ref.backward(grad)
            y_f8.backward(grad)
            rows.append({"inputs": kind, "recipe": recipe, "output dB": round(sqnr(y_ref, y_f8), 1),
                         "weight grad dB": round(sqnr(ref[0].weight.grad, f8[0].weight.grad), 1),
                         "input grad dB": round(sqnr(x_ref.grad, x_f8.grad), 1)})
    return rows


# -- speed (CUDA) ---------------------------------------------------------------------------------

def _time_ms(fn, iters: int) -> float:
    for _ in range(3):  # warm-up (and compile)
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _try(fn):
    """A measurement, or the error it raised (a recipe failing must not hide the others)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- reported in the table
        print(f"  ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        return None


def _convert(module: nn.Module, recipe: str | None) -> nn.Module:
    if recipe is not None:
        apply_float8(module, recipe=recipe, emulate=False, device="cuda")
    return module


def linear_table(iters: int) -> list[dict]:
    rows = []
    for m, k, n in ((4096, 8192, 16384), (1024, 2048, 1024)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        times = {}
        for recipe in (None, *FLOAT8_RECIPES):
            def measure(recipe=recipe, k=k, n=n, x=x):
                lin = _convert(nn.Sequential(nn.Linear(k, n, bias=False)), recipe).cuda().bfloat16()
                return _time_ms(torch.compile(lambda: lin(x).sum().backward()), iters)

            times[recipe or "bf16"] = _try(measure)
        row = {"M,K,N": f"{m},{k},{n}", "bf16 ms": round(times["bf16"], 3)}
        for recipe in FLOAT8_RECIPES:
            t = times[recipe]
            row[f"{recipe} speedup"] = "error" if t is None else round(times["bf16"] / t, 2)
        rows.append(row)
    return rows


def _one_b_args():
    from titanext.models import get_model_args

    return get_model_args("llama3", "1B")


def block_table(iters: int, batch: int = 2, seq: int = 2048) -> list[dict]:
    from titanext.models.llama import TransformerBlock, rope_cos_sin

    args = _one_b_args()
    hd = args.head_dim
    even = torch.arange(0, hd, 2, device="cuda", dtype=torch.float32)
    inv_freq = 1.0 / (args.rope_theta ** (even / hd))
    cos, sin = rope_cos_sin(torch.arange(seq, device="cuda"), inv_freq)
    x = torch.randn(batch, seq, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows, base = [], None
    for recipe in (None, *FLOAT8_RECIPES):
        def measure(recipe=recipe):
            block = _convert(TransformerBlock(0, args), recipe).cuda().bfloat16()
            block.compile()
            return _time_ms(lambda: block(x, cos, sin).sum().backward(), iters)

        ms = _try(measure)
        base = base or ms
        rows.append({"1B block": recipe or "bf16",
                     "fwd+bwd ms": "error" if ms is None else round(ms, 2),
                     "speedup": "error" if ms is None or base is None else round(base / ms, 2)})
    return rows


def training_table(iters: int, batch: int = 2, seq: int = 2048) -> list[dict]:
    from titanext.models import build_model
    from titanext.plugins.compile import apply_compile

    args = _one_b_args()
    rows, base = [], None
    for recipe in (None, "tensorwise", "rowwise"):
        torch.manual_seed(0)
        model = build_model("llama3", args, device="meta")
        if recipe is not None:
            apply_float8(model, recipe=recipe, filter_fqns=["output"], emulate=False, device="cuda")
        apply_compile(model)
        model.to_empty(device="cuda")
        model.init_weights(seed=0)
        model.bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), device="cuda")

        def step(model=model, opt=opt, tokens=tokens):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = _time_ms(step, iters)
        tps = batch * seq / (ms / 1000)
        base = base or tps
        rows.append({"1B training step": recipe or "bf16", "tokens/s": round(tps),
                     "speedup": round(tps / base, 2),
                     "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)})
        del model, opt
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-step", action="store_true", help="skip the 1B training step")
    a = parser.parse_args()
    cpu = platform.processor() or platform.machine()
    machine = (torch.cuda.get_device_name() if torch.cuda.is_available()
               else f"{cpu} CPU, {torch.get_num_threads()} threads")
    print(f"# float8 benchmark on {machine}, torch {torch.__version__}\n")
    with contextlib.redirect_stderr(io.StringIO()):  # torchao's import chatter
        rows = accuracy_table()
    print("## Accuracy: SQNR against float32 (higher is better; torchao asks >= 18 / 17 dB)\n")
    print(format_table(rows, markdown=a.markdown), "\n")
    if not has_float8_hardware():
        print("Speed: needs a CUDA GPU with float8 tensor cores (compute capability 8.9+, e.g. "
              "H100). Here float8 is emulated in high precision, so timings would only measure "
              "the emulation; skipped.")
        return
    print("## Linear forward+backward (torch.compile), speedup over bf16\n")
    print(format_table(linear_table(a.iters), markdown=a.markdown), "\n")
    print("## One 1B-flavor transformer block, batch 2 x 2048 tokens\n")
    print(format_table(block_table(a.iters), markdown=a.markdown), "\n")
    if not a.no_step:
        print("## 1B-flavor training step (AdamW, bf16 params), batch 2 x 2048 tokens\n")
        print(format_table(training_table(max(a.iters // 2, 5)), markdown=a.markdown))


if __name__ == "__main__":
    main()

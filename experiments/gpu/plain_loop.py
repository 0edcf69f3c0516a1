"""The peer of ``nxdt train`` on one GPU: the same hub Llama in a plain PyTorch loop (issue 37).

Same model class and shapes (the same config overrides, composed the same way), the same formats (fp32 weights, bf16
autocast for ``mixed_precision``), the same attention kernels (``nxdt.parallel.devices.attention_kernels``), torch's
fused AdamW on CUDA, gradient clipping to 1.0 (nxdt's default ``trainer.gradient_clip_val``), synthetic tokens. No
framework: forward, backward, clip, step, zero. ``tests/gpu/check.sh`` runs it beside ``nxdt train`` at ~1B
parameters and seq 2048 and reports both tokens/s and MFU; on a CPU it runs a tiny model (``--tiny``), which
``tests/test_devices.py`` checks so this script cannot rot between device runs.

    python experiments/gpu/plain_loop.py --tiny --device cpu --steps 3
    python experiments/gpu/plain_loop.py --device cuda --steps 30 --warmup 5 --json out.json   # the ~1B model
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from nxdt.config import compose_config
from nxdt.models.llama import LlamaForCausalLM
from nxdt.parallel.devices import adamw_options, attention_kernels, policy_for
from nxdt.planner.estimate import flops_per_token

# Llama 3.2 1B's shapes (1.24 B parameters with the tied 128k-token head), seq 2048: what check.sh trains both ways
LLAMA_1B = [
    "model=llama_tiny",
    "model.vocab_size=128256",
    "model.hidden_size=2048",
    "model.num_layers=16",
    "model.num_attention_heads=32",
    "model.num_kv_heads=8",
    "model.ffn_hidden_size=8192",
    "model.max_position_embeddings=2048",
    "model.tie_word_embeddings=true",
    "model.rope_theta=500000.0",
    "data.seq_length=2048",
    "data.micro_batch_size=4",
]
TINY = ["model=llama_tiny", "data.seq_length=64", "data.micro_batch_size=2"]
PROFILE_STEPS = (8, 10)  # 1-based, inclusive: the steps --profile covers
H200_BF16_PEAK = 790e12  # measured here: an 8192³ bf16 matmul, random data (/work/.library/device/KINDS.md)


def train(
    overrides: list[str],
    *,
    device: str,
    steps: int,
    warmup: int,
    precision: str = "mixed_precision",
    seed: int = 0,
    read_before_step: bool = False,
    copy_batch: str = "none",
    profile: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps; tokens/s and MFU over the steps after ``warmup`` (timed with a device sync).

    Two of a framework's habits, to price them on a GPU (both off: the plain loop): ``read_before_step`` reads the
    loss and the gradient norm on the host before the optimizer step (what a NaN check costs: the host waits for the
    backward); ``copy_batch`` copies the batch to the device every step from ``pageable`` or ``pinned`` host memory
    (``none``: it stays on the device). ``profile``: a path prefix; steps 8-10 (1-based, the window check.sh gives
    ``nxdt train``'s ``exp_manager.profile_steps``) are profiled into ``<profile>.json`` (Chrome trace) and
    ``<profile>.txt`` (nxdt's report: GPU busy share, ops by self time)."""
    cfg = compose_config(overrides, check=False)
    m, d = cfg.model, cfg.data
    policy = policy_for("cuda" if device.startswith("cuda") else "cpu", 0, 1, 1, precision)
    dev = torch.device(device)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM(m)
    model.to(policy.param_dtype)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=m.optim.lr,
        betas=tuple(m.optim.betas),
        eps=m.optim.eps,
        weight_decay=m.optim.weight_decay,
        **adamw_options(dev.type),
    )
    gen = torch.Generator().manual_seed(seed)
    host_tokens = torch.randint(0, m.vocab_size, (d.micro_batch_size, d.seq_length + 1), generator=gen)
    if copy_batch == "pinned" and dev.type == "cuda":
        host_tokens = host_tokens.pin_memory()
    tokens = host_tokens.to(dev)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    autocast = policy.autocast_dtype

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    losses, started = [], None
    prof, prof_started = None, 0.0
    for step in range(steps):
        if step == warmup:
            sync()
            started = time.perf_counter()
        if profile and step == PROFILE_STEPS[0] - 1:
            from torch.profiler import ProfilerActivity, profile as profiler

            sync()
            prof = profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else []))
            prof.__enter__()
            prof_started = time.perf_counter()
        if copy_batch != "none":
            tokens = host_tokens.to(dev, non_blocking=True)
            ids, labels = tokens[:, :-1], tokens[:, 1:]
        with (
            attention_kernels(dev.type, policy.half),
            torch.autocast(dev.type, dtype=autocast or torch.float32, enabled=autocast is not None),
        ):
            logits = model(ids)
            loss = model.loss_fn(logits, labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if read_before_step and not (math.isfinite(float(loss.detach())) and math.isfinite(float(norm))):
            raise FloatingPointError(f"step {step}: loss {float(loss)}, gradient norm {float(norm)}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if prof is not None and step == PROFILE_STEPS[1] - 1:
            _write_profile(prof, prof_started, dev, profile, sync)
            prof = None
    sync()
    timed = steps - warmup
    seconds = time.perf_counter() - started if started is not None else float("nan")
    tokens_per_s = timed * d.micro_batch_size * d.seq_length / seconds if timed > 0 else float("nan")
    flops = flops_per_token(m, d.seq_length)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_s": tokens_per_s,
        "step_time_s": seconds / timed if timed > 0 else float("nan"),
        "flops_per_token": flops,
        "mfu_h200": tokens_per_s * flops / H200_BF16_PEAK,
        "losses": [float(v) for v in losses],
        "device": str(dev),
        "sdpa_backends": list(policy.sdpa_backends),
        "adamw": adamw_options(dev.type),
        "read_before_step": read_before_step,
        "copy_batch": copy_batch,
    }


def _write_profile(prof: Any, started: float, dev: torch.device, prefix: str, sync: Any) -> None:
    from pathlib import Path

    from nxdt.lightning.profiling import summary

    sync()
    wall = time.perf_counter() - started
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(f"{prefix}.json")
    span = f"plain loop, steps {PROFILE_STEPS[0]}-{PROFILE_STEPS[1]}"
    Path(f"{prefix}.txt").write_text(summary(prof, wall, dev, span))


def compare(metrics_csv: str, plain_json: str, warmup: int) -> dict[str, Any]:
    """nxdt's tokens/s from its metrics.csv (wall time from step ``warmup`` to the last: every overhead of its loop
    counted, as the plain loop's timer counts its own) against the plain loop's result; MFU against 790 TFLOP/s."""
    import csv

    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("wall_time")]
    with open(plain_json) as f:
        plain = json.load(f)
    cfg = compose_config(LLAMA_1B, check=False)
    tokens_per_step = cfg.data.micro_batch_size * cfg.data.seq_length  # one micro-batch per step, one rank
    by_step = {int(r["step"]): float(r["wall_time"]) for r in rows}
    last = max(by_step)
    nxdt_tps = (last - warmup) * tokens_per_step / (by_step[last] - by_step[warmup])
    flops = flops_per_token(cfg.model, cfg.data.seq_length)
    return {
        "nxdt_tokens_per_s": nxdt_tps,
        "plain_tokens_per_s": plain["tokens_per_s"],
        "ratio_nxdt_over_plain": nxdt_tps / plain["tokens_per_s"],
        "nxdt_mfu_h200": nxdt_tps * flops / H200_BF16_PEAK,
        "plain_mfu_h200": plain["mfu_h200"],
        "parameters": plain["parameters"],
        "nxdt_losses_first_last": [float(rows[0]["loss"]), float(rows[-1]["loss"])],
        "plain_losses_first_last": [plain["losses"][0], plain["losses"][-1]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--print-overrides", action="store_true", help="print the ~1B model's nxdt overrides and exit")
    p.add_argument("--compare", nargs=2, metavar=("METRICS_CSV", "PLAIN_JSON"), help="nxdt's run against the plain loop's")
    p.add_argument("--tiny", action="store_true", help="llama_tiny at seq 64 (a CPU check) instead of the ~1B model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--precision", default="mixed_precision")
    p.add_argument("--read-before-step", action="store_true", help="read loss and gradient norm on the host before each step")
    p.add_argument("--copy-batch", choices=("none", "pageable", "pinned"), default="none", help="copy the batch in every step")
    p.add_argument("--json", help="write the result here too")
    p.add_argument("--profile", metavar="PREFIX", help="profile steps 8-10 into PREFIX.json and PREFIX.txt")
    args = p.parse_args(argv)
    if args.print_overrides:
        print(" ".join(LLAMA_1B))
        return 0
    if args.compare:
        summary = compare(*args.compare, warmup=args.warmup)
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        return 0
    out = train(
        TINY if args.tiny else LLAMA_1B,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        precision=args.precision,
        read_before_step=args.read_before_step,
        copy_batch=args.copy_batch,
        profile=args.profile,
    )
    line = {k: v for k, v in out.items() if k != "losses"}
    print(json.dumps(line))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does `nxdt train +recipe=grpo` raise the shipped arithmetic task's reward accuracy on prompts it never trained on?

A freshly initialised byte-level llama_tiny never writes an exact sum (README.md, the 40-step run: exact_answer 0 at
both ends), and GRPO can only reinforce answers it samples, so the start is a short SFT on the training prompts:

1. **SFT** (`+recipe=sft`, DP2): the shipped training prompts (nxdt/data/samples/arithmetic.jsonl, 256 records) as
   chat records `[user: "12+13=", assistant: "25"]` (byte-level: the plain template, `user: 12+13=\\nassistant: 25\\n`
   + EOS), a few hundred steps: the model learns the format and some sums, not all.
2. **GRPO** (`+recipe=grpo`, DP2) from the SFT checkpoint (`model.weight_init_only=true`) on the same training
   prompts as conversational records (`{"prompt": [{"role": "user", "content": "12+13="}], "answer": "25"}`: rendered
   with the generation prompt `assistant: `, completions reach the reward as `[{"role": "assistant", ...}]`), the one
   reward `nxdt.data.arithmetic:exact_answer`.
3. **Held out**: sums a+b (0 <= a, b < 20, the task's range) whose prompt is not among the training prompts, 100 of
   them (seeded). Before (the SFT checkpoint) and after GRPO: exact_answer's mean on greedy answers, and on 8 sampled
   answers per prompt at temperature 1 (what GRPO samples). The training prompts are scored the same way.

    python experiments/grpo-learning/run.py [--sft-steps 200] [--sft-lr 3e-3] [--grpo-steps 40] [--grpo-lr 2e-4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nxdt.data import SAMPLE_ARITHMETIC
from nxdt.data.arithmetic import exact_answer
from nxdt.data.instructions import byte_chat_tokenizer, read_jsonl, render_generation_prompt, write_jsonl
from nxdt.launch.model_source import load_model
from nxdt.models.generate import generate

HERE = Path(__file__).resolve().parent
TOP = 20  # the shipped task's range: make_arithmetic_records(top=20)
HELD_OUT = 100
SAMPLES = 8  # sampled answers per prompt (temperature 1)
MAX_NEW_TOKENS = 6  # "38\n" + EOS is 4


def user(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def held_out_records(train_prompts: set[str]) -> list[dict[str, str]]:
    unseen = [f"{a}+{b}=" for a in range(TOP) for b in range(TOP) if f"{a}+{b}=" not in train_prompts]
    chosen = random.Random(1).sample(unseen, HELD_OUT)
    return [{"prompt": p, "answer": str(sum(int(x) for x in p[:-1].split("+")))} for p in chosen]


def nxdt_train(*overrides: str) -> dict:
    cmd = [sys.executable, "-m", "nxdt.cli", "train", *overrides]
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        raise SystemExit(f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = [line for line in result.stdout.splitlines() if line.startswith("nxdt: loss") or line.startswith("nxdt: finished")]
    return {"command": " ".join(cmd[2:]), "wall_s": round(time.time() - start, 1), "summary": summary}


@torch.no_grad()
def evaluate(checkpoint: Path, records: list[dict[str, str]]) -> dict:
    """exact_answer's mean over greedy answers and over SAMPLES sampled answers (temperature 1) per prompt."""
    model = load_model(str(checkpoint)).model
    tok = byte_chat_tokenizer()
    prompts = [tok.encode(render_generation_prompt(tok, user(r["prompt"]))) for r in records]
    answers = [r["answer"] for r in records]

    def scored(rows: list[list[int]], answer: list[str]) -> list[float]:
        texts = [[{"role": "assistant", "content": tok.decode([t for t in c if t != tok.eos_id])}] for c in rows]
        return exact_answer([user(r["prompt"]) for r in records] * (len(rows) // len(records)), texts, answer=answer)

    greedy = generate(model, prompts, MAX_NEW_TOKENS, eos_id=tok.eos_id)
    sampled = generate(
        model,
        prompts * SAMPLES,
        MAX_NEW_TOKENS,
        eos_id=tok.eos_id,
        do_sample=True,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    greedy_rewards, sampled_rewards = scored(greedy, answers), scored(sampled, answers * SAMPLES)
    return {
        "greedy_accuracy": sum(greedy_rewards) / len(greedy_rewards),
        "sampled_accuracy": sum(sampled_rewards) / len(sampled_rewards),
        "n": len(records),
        "examples": [
            {"prompt": r["prompt"], "answer": r["answer"], "greedy": tok.decode([t for t in g if t != tok.eos_id])}
            for r, g in list(zip(records, greedy))[:8]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--grpo-batch", type=int, default=32, help="completions per GRPO step (data.global_batch_size)")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-learning-"))
    work.mkdir(parents=True, exist_ok=True)

    train = read_jsonl(SAMPLE_ARITHMETIC)
    held_out = held_out_records({r["prompt"] for r in train})
    seen = sorted({r["prompt"]: r for r in train}.values(), key=lambda r: r["prompt"])[:HELD_OUT]  # unique training prompts
    write_jsonl(
        work / "sft.jsonl", [{"messages": [*user(r["prompt"]), {"role": "assistant", "content": r["answer"]}]} for r in train]
    )
    write_jsonl(work / "prompts.jsonl", [{"prompt": user(r["prompt"]), "answer": r["answer"]} for r in train])
    common = ["instance=cpu", "trainer.devices=2", "exp_manager.create_tensorboard_logger=false"]

    sft_dir = work / f"sft-{args.sft_steps}-lr{args.sft_lr}"
    grpo_dir = work / f"grpo-{args.grpo_steps}-lr{args.grpo_lr}-g{args.num_generations}-b{args.grpo_batch}"
    sft_checkpoint = sft_dir / "checkpoints" / f"step-{args.sft_steps}"
    sft = (
        {"reused": str(sft_dir)}
        if sft_checkpoint.is_dir()
        else nxdt_train(
            "+recipe=sft",
            *common,
            f"data.train_dir={work / 'sft.jsonl'}",
            "trainer.log_every_n_steps=10",
            f"model.optim.lr={args.sft_lr}",
            f"trainer.max_steps={args.sft_steps}",
            f"exp_manager.checkpoint_every_n_steps={args.sft_steps}",
            f"exp_manager.explicit_log_dir={sft_dir}",
        )
    )
    before = {"held_out": evaluate(sft_checkpoint, held_out), "training": evaluate(sft_checkpoint, seen)}
    print("after SFT:", json.dumps({k: {m: v[m] for m in ("greedy_accuracy", "sampled_accuracy")} for k, v in before.items()}))

    grpo = nxdt_train(
        "+recipe=grpo",
        *common,
        f"data.train_dir={work / 'prompts.jsonl'}",
        "trainer.log_every_n_steps=1",
        "model_alignment_strategy.grpo.reward_funcs=[nxdt.data.arithmetic:exact_answer]",
        "model_alignment_strategy.grpo.reward_weights=null",
        f"model_alignment_strategy.grpo.num_generations={args.num_generations}",
        f"data.global_batch_size={args.grpo_batch}",
        "model_alignment_strategy.grpo.max_prompt_length=32",
        f"model_alignment_strategy.grpo.max_completion_length={MAX_NEW_TOKENS}",
        "data.seq_length=48",
        f"model.optim.lr={args.grpo_lr}",
        f"model.optim.sched.min_lr={args.grpo_lr / 10}",
        "model.weight_init_only=true",
        f"exp_manager.resume_from_checkpoint={sft_checkpoint}",
        f"trainer.max_steps={args.grpo_steps}",
        f"exp_manager.checkpoint_every_n_steps={args.grpo_steps}",
        f"exp_manager.explicit_log_dir={grpo_dir}",
    )
    grpo_checkpoint = grpo_dir / "checkpoints" / f"step-{args.grpo_steps}"
    after = {"held_out": evaluate(grpo_checkpoint, held_out), "training": evaluate(grpo_checkpoint, seen)}
    print("after GRPO:", json.dumps({k: {m: v[m] for m in ("greedy_accuracy", "sampled_accuracy")} for k, v in after.items()}))
    rows = list(csv_rows(grpo_dir / "metrics.csv"))
    result = {
        "sft": {**sft, "steps": args.sft_steps, "lr": args.sft_lr},
        "grpo": {**grpo, "steps": args.grpo_steps, "lr": args.grpo_lr, "num_generations": args.num_generations},
        "after_sft": before,
        "after_grpo": after,
        "grpo_training_reward": [(int(r["step"]), float(r["reward"])) for r in rows],
        "held_out_size": len(held_out),
        "samples_per_prompt": SAMPLES,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path) as fh:
        return list(csv.DictReader(fh))


if __name__ == "__main__":
    main()

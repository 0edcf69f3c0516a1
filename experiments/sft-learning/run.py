"""Does `nxdt train +recipe=sft` *learn* the task, not just lower the loss? Exact-match accuracy of greedy answers on
held-out prompts that training never saw.

Two training sets, same recipe, same steps (DP2 on this host's 2 cores, llama_tiny, byte-level):

* ``shipped``: the shipped instruction set (nxdt/data/samples/instructions.jsonl = make_instruction_samples(200, 0));
* ``generated``: more records from the same generator (another seed), every held-out prompt removed — what more data
  of the same kind does.

Held out: records of the same generator with another seed, every prompt that occurs in either training set removed.
Each held-out record is rendered exactly as training renders it (``tokenize_record``: the tokens before the first
trained token are the prompt; the trained tokens are the response and EOS), the final checkpoint's model decodes the
prompt greedily (``nxdt.models.generate.greedy_generate``), and an answer is correct iff its tokens equal the
response followed by EOS. Baseline: a freshly initialised model of the same config (the same init scheme, seed 1234;
not necessarily bit-identical to the run's initial weights). Also reported: the same on training prompts
(memorisation vs generalisation).

    python experiments/sft-learning/run.py [--steps 1500] [--runs shipped generated] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from nxdt.data import SAMPLE_INSTRUCTIONS
from nxdt.data.instructions import TASKS, byte_chat_tokenizer, make_instruction_samples, read_jsonl, tokenize_record, write_jsonl
from nxdt.lightning.reshard import read_full_state
from nxdt.models.generate import greedy_generate
from nxdt.models.llama import LlamaForCausalLM

HELD_OUT_SEED, GENERATED_SEED = 1, 2
HELD_OUT_PER_TASK = 50
GENERATED_RECORDS = 3000
MAX_NEW_TOKENS = 16  # longest response: 6 letters or 2 digits, + EOS


def prompt_key(record: dict) -> tuple[str, str]:
    return record["instruction"], record["input"]


def held_out_records(exclude: set[tuple[str, str]]) -> list[dict]:
    """HELD_OUT_PER_TASK records per task from the generator (seed HELD_OUT_SEED), none of whose prompts is in
    ``exclude``, prompts unique."""
    chosen: dict[str, list[dict]] = {t: [] for t in TASKS}
    seen = set(exclude)
    for i, record in enumerate(make_instruction_samples(3000, seed=HELD_OUT_SEED)):
        task = TASKS[i % len(TASKS)]
        if prompt_key(record) in seen or len(chosen[task]) >= HELD_OUT_PER_TASK:
            continue
        seen.add(prompt_key(record))
        chosen[task].append({**record, "task": task})
    assert all(len(v) == HELD_OUT_PER_TASK for v in chosen.values()), "generator ran out of unseen prompts"
    return [r for task in TASKS for r in chosen[task]]


def train(run_dir: Path, train_file: Path | None, steps: int, lr: float) -> dict:
    """One `nxdt train +recipe=sft` run on DP2 with a checkpoint at the last step; its wall time and losses."""
    cmd = [
        sys.executable,
        "-m",
        "nxdt.cli",
        "train",
        "+recipe=sft",
        "instance=cpu",
        "trainer.devices=2",
        f"trainer.max_steps={steps}",
        f"model.optim.lr={lr}",
        "model.optim.sched.warmup_steps=20",
        "trainer.log_every_n_steps=10",
        f"exp_manager.checkpoint_every_n_steps={steps}",
        "exp_manager.create_tensorboard_logger=false",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]
    if train_file is not None:
        cmd.append(f"data.train_dir={train_file}")
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        raise SystemExit(f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = [line for line in result.stdout.splitlines() if line.startswith("nxdt: loss")]
    return {"command": " ".join(cmd[2:]), "wall_s": round(time.time() - start, 1), "summary": summary[-1] if summary else None}


def load_model(run_dir: Path, step: int | None) -> LlamaForCausalLM:
    """The run's model (its config.yaml), with the weights of checkpoints/step-<step> (None: fresh init, seed 1234)."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(cfg.model)
    if step is not None:
        state = read_full_state(run_dir / "checkpoints" / f"step-{step}", optimizer=False).model
        model.load_state_dict({name.removeprefix("model."): t for name, t in state.items()}, strict=True)
    return model.eval()


def evaluate(model: LlamaForCausalLM, records: list[dict]) -> dict:
    """Exact-match accuracy (overall and per task) of greedy answers, and a few examples."""
    tok = byte_chat_tokenizer()
    prompts, answers = [], []
    for record in records:
        tokens, trained = tokenize_record({k: record[k] for k in ("instruction", "input", "output")}, tok)
        cut = trained.index(True)
        prompts.append(tokens[:cut])
        answers.append(tokens[cut:])  # the response and EOS, as trained
    outputs = greedy_generate(model, prompts, MAX_NEW_TOKENS, eos_id=tok.eos_id)
    correct = [o == a for o, a in zip(outputs, answers)]
    per_task = {
        t: sum(c for c, r in zip(correct, records) if r["task"] == t) / sum(r["task"] == t for r in records) for t in TASKS
    }
    examples = [
        {
            "prompt": tok.decode(p),
            "expected": record["output"],
            "got": tok.decode([t for t in o if t != tok.eos_id]),
            "ended_with_eos": bool(o) and o[-1] == tok.eos_id,
            "correct": c,
        }
        for p, o, record, c in list(zip(prompts, outputs, records, correct))[:: HELD_OUT_PER_TASK // 3]
    ]
    return {
        "accuracy": sum(correct) / len(correct),
        "correct": sum(correct),
        "n": len(correct),
        "per_task": per_task,
        "examples": examples,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    parser.add_argument("--runs", nargs="+", choices=("shipped", "generated"), default=["shipped", "generated"])
    args = parser.parse_args()
    torch.set_num_threads(1)

    shipped = read_jsonl(SAMPLE_INSTRUCTIONS)
    assert shipped == make_instruction_samples(), "the shipped set is make_instruction_samples() — regenerate it"
    generated_pool = make_instruction_samples(GENERATED_RECORDS * 2, seed=GENERATED_SEED)
    held = held_out_records({prompt_key(r) for r in shipped} | {prompt_key(r) for r in generated_pool})
    generated = generated_pool[:GENERATED_RECORDS]  # every held-out prompt is already excluded (pool ⊇ this)
    train_sample = [{**r, "task": TASKS[i % len(TASKS)]} for i, r in enumerate(shipped)][:150]

    results = {
        "host": os.uname().nodename,
        "cores": os.cpu_count(),
        "steps": args.steps,
        "lr": args.lr,
        "held_out": {"seed": HELD_OUT_SEED, "records": len(held), "per_task": HELD_OUT_PER_TASK},
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="sft-learning-") as tmp:
        root = Path(tmp)
        generated_file = root / "generated.jsonl"
        write_jsonl(generated_file, generated)
        for name, train_file, records in (("shipped", None, len(shipped)), ("generated", generated_file, len(generated))):
            if name not in args.runs:
                continue
            run_dir = root / name
            info = train(run_dir, train_file, args.steps, args.lr)
            trained = load_model(run_dir, args.steps)
            info.update(
                train_records=records,
                held_out=evaluate(trained, held),
                train_prompts=evaluate(
                    trained,
                    train_sample
                    if name == "shipped"
                    else [{**r, "task": TASKS[i % len(TASKS)]} for i, r in enumerate(generated[:150])],
                ),
            )
            if "untrained_baseline" not in results:
                results["untrained_baseline"] = evaluate(load_model(run_dir, None), held)
            results["runs"][name] = info
            print(
                name,
                json.dumps({k: v for k, v in info.items() if k in ("wall_s", "summary")}),
                "held-out",
                info["held_out"]["accuracy"],
                info["held_out"]["per_task"],
                "train",
                info["train_prompts"]["accuracy"],
                flush=True,
            )
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print("untrained", results["untrained_baseline"]["accuracy"])


if __name__ == "__main__":
    main()

"""Does `nxdt train +recipe=dpo` *learn* the preference, not just lower its loss? Reward accuracy on held-out pairs.

1. SFT: `nxdt train +recipe=sft` on the shipped instruction set (DP2, llama_tiny, byte-level), a checkpoint at the end —
   the reference (and starting) model, as in the usual SFT → DPO pipeline.
2. DPO: `nxdt train +recipe=dpo` on preference pairs from the generator (``make_preference_samples``, seed TRAIN_SEED),
   started from that checkpoint (`exp_manager.resume_from_checkpoint=... model.weight_init_only=true`), DP2.
3. Held out: pairs of the same generator with another seed (HELD_OUT_SEED), every prompt that occurs in the DPO training
   set removed, 50 per task. For each, the implicit DPO reward β·(log π(y|x) − log π_ref(y|x)) of the chosen and of the
   rejected answer, with π the DPO run's final weights and π_ref the SFT checkpoint (the run's own reference).
   Reward accuracy = share of pairs whose chosen reward is strictly higher.

Baseline at initialisation: π = π_ref, every reward is 0 — no pair is ranked (accuracy 0 by the strict rule; chance is
50 %). A stronger baseline is reported too: how often the reference model itself already gives the chosen answer the
higher log-likelihood (log π_ref(y_c|x) > log π_ref(y_r|x)), and the same for the DPO policy.

    python experiments/dpo-learning/run.py [--sft-steps 400] [--dpo-steps 200] [--out results.json]
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

from nxdt.data.instructions import TASKS, byte_chat_tokenizer, write_jsonl
from nxdt.data.preferences import PreferenceDataset, make_preference_samples, pair_rows, split_chosen_rejected
from nxdt.lightning.reshard import read_full_state
from nxdt.models.llama import LlamaForCausalLM

TRAIN_SEED, HELD_OUT_SEED = 2, 3
TRAIN_PAIRS, HELD_OUT_PER_TASK = 1200, 50
SEQ_LENGTH = 64  # the dpo recipe's


def run(cmd: list[str]) -> dict:
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "nxdt.cli", "train", *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if result.returncode != 0:
        raise SystemExit(f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = [line for line in result.stdout.splitlines() if line.startswith("nxdt: loss")]
    return {
        "command": "nxdt train " + " ".join(cmd),
        "wall_s": round(time.time() - start, 1),
        "summary": summary[-1] if summary else None,
    }


def common(run_dir: Path, steps: int) -> list[str]:
    return [
        "instance=cpu",
        "trainer.devices=2",
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=10",
        f"exp_manager.checkpoint_every_n_steps={steps}",
        "exp_manager.create_tensorboard_logger=false",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]


def load_model(run_dir: Path, step: int) -> LlamaForCausalLM:
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = LlamaForCausalLM(cfg.model)
    state = read_full_state(run_dir / "checkpoints" / f"step-{step}", optimizer=False).model
    model.load_state_dict({name.removeprefix("model."): t for name, t in state.items()}, strict=True)
    return model.eval()


@torch.no_grad()
def sequence_log_probs(model: LlamaForCausalLM, dataset: PreferenceDataset) -> torch.Tensor:
    """[pairs, 2]: log π(chosen|x), log π(rejected|x) — summed response-token log-probabilities, as DPO scores them."""
    out = []
    for start in range(0, len(dataset), 16):
        mb = pair_rows(torch.utils.data.default_collate([dataset[i] for i in range(start, min(start + 16, len(dataset)))]))
        logits = model(mb["input_ids"], mb["position_ids"], mb["segment_ids"])
        sums = model.token_log_probs(logits, mb["labels"]).sum(-1).double()
        out.append(torch.stack(split_chosen_rejected(sums), dim=1))
    return torch.cat(out)


def held_out_pairs(exclude: set[str]) -> list[dict]:
    chosen: dict[str, list[dict]] = {t: [] for t in TASKS}
    seen = set(exclude)
    for i, record in enumerate(make_preference_samples(3000, seed=HELD_OUT_SEED)):
        task = TASKS[i % len(TASKS)]
        if record["prompt"] in seen or len(chosen[task]) >= HELD_OUT_PER_TASK:
            continue
        seen.add(record["prompt"])
        chosen[task].append({**record, "task": task})
    assert all(len(v) == HELD_OUT_PER_TASK for v in chosen.values()), "generator ran out of unseen prompts"
    return [r for task in TASKS for r in chosen[task]]


def accuracy(better: torch.Tensor, records: list[dict]) -> dict:
    return {
        "all": float(better.float().mean()),
        **{t: float(better[[r["task"] == t for r in records]].float().mean()) for t in TASKS},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--dpo-steps", type=int, default=200)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--dpo-lr", type=float, default=1e-4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    train_pairs = make_preference_samples(TRAIN_PAIRS, seed=TRAIN_SEED)
    held = held_out_pairs({r["prompt"] for r in train_pairs})
    results: dict = {
        "host": os.uname().nodename,
        "cores": os.cpu_count(),
        "beta": args.beta,
        "train_pairs": len(train_pairs),
        "held_out_pairs": len(held),
    }
    with tempfile.TemporaryDirectory(prefix="dpo-learning-") as tmp:
        root = Path(tmp)
        sft_dir, dpo_dir, train_file = root / "sft", root / "dpo", root / "train.jsonl"
        write_jsonl(train_file, train_pairs)
        results["sft"] = run(
            ["+recipe=sft", *common(sft_dir, args.sft_steps), "model.optim.lr=3e-3", "model.optim.sched.warmup_steps=20"]
        )
        checkpoint = sft_dir / "checkpoints" / f"step-{args.sft_steps}"
        results["dpo"] = run(
            [
                "+recipe=dpo",
                *common(dpo_dir, args.dpo_steps),
                f"data.train_dir={train_file}",
                f"model_alignment_strategy.dpo.kl_beta={args.beta}",
                f"model.optim.lr={args.dpo_lr}",
                f"exp_manager.resume_from_checkpoint={checkpoint}",
                "model.weight_init_only=true",
            ]
        )
        metrics = (dpo_dir / "metrics.csv").read_text().splitlines()
        results["dpo"]["metrics_first_last"] = [metrics[0], metrics[1], metrics[-1]]
        dataset = PreferenceDataset.from_records(
            held, byte_chat_tokenizer(), SEQ_LENGTH, max_prompt_length=48, truncation_mode="keep_start"
        )
        assert dataset.stats.pairs == len(held) and dataset.stats.response_truncated == 0
        ref = sequence_log_probs(load_model(sft_dir, args.sft_steps), dataset)
        policy = sequence_log_probs(load_model(dpo_dir, args.dpo_steps), dataset)
    rewards = args.beta * (policy - ref)
    results["held_out"] = {
        "reward_accuracy": accuracy(rewards[:, 0] > rewards[:, 1], held),
        "reward_margin_mean": float((rewards[:, 0] - rewards[:, 1]).mean()),
        "reward_accuracy_at_init": 0.0,  # π = π_ref: every reward is 0, no pair ranked
        "reference_likelihood_prefers_chosen": accuracy(ref[:, 0] > ref[:, 1], held),
        "policy_likelihood_prefers_chosen": accuracy(policy[:, 0] > policy[:, 1], held),
    }
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["held_out"], indent=2))


if __name__ == "__main__":
    main()

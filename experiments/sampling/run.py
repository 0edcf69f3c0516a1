"""Decoding speed with and without the KV cache (``nxdt.models.generate.generate``, ``use_cache`` on/off) on
conf/model/llama_tiny.yaml's shape (randomly initialised: speed does not depend on the weights), one process, fp32.

Each configuration decodes a batch of ``--batch`` prompts of ``--prompt`` tokens for exactly ``--new`` tokens (no
EOS, greedy), after one warm-up call; tokens/s = batch·new / wall seconds (best of ``--repeats``). Threads: torch's
default unless ``--threads``. Also checks the two paths produce the same tokens.

    python experiments/sampling/run.py [--batch 8] [--prompt 32] [--new 128] [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from nxdt.models.generate import generate
from nxdt.models.llama import LlamaForCausalLM

CONF = Path(__file__).resolve().parents[2] / "conf" / "model" / "llama_tiny.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = OmegaConf.load(CONF)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    prompts = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    results = []
    for new in args.new:
        row: dict = {"batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": new}
        tokens = {}
        for use_cache in (True, False):
            generate(model, prompts, 2, use_cache=use_cache)  # warm-up
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                tokens[use_cache] = generate(model, prompts, new, use_cache=use_cache)
                best = min(best, time.perf_counter() - start)
            row["tokens_per_s_cache" if use_cache else "tokens_per_s_no_cache"] = round(args.batch * new / best, 1)
        row["same_tokens"] = tokens[True] == tokens[False]
        row["speedup"] = round(row["tokens_per_s_cache"] / row["tokens_per_s_no_cache"], 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "model": "llama_tiny (0.8 M params, fp32)"}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

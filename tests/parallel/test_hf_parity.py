"""Our Llama reproduces Hugging Face ``transformers``' ``LlamaForCausalLM`` logits with the same weights,
unsharded and at tensor-parallel size 2 (with and without sequence parallelism).

HF's model is built in-process from a tiny ``LlamaConfig`` (no download) with grouped-query attention;
its weights map to ours by name (HF prefixes everything but ``lm_head`` with ``model.``). transformers is
a test-only dependency (the ``test`` extra): the test is skipped without it. The spawned ranks never
import transformers: the parent passes them the mapped weights and compares the logits they return.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.models.llama import LlamaForCausalLM
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, gather_from_tensor_parallel_region
from nxdt.config.hf_model import tensor_parallel_plan_of
from hf_reference import TINY_LLAMA, llama_config

transformers = pytest.importorskip("transformers")

TINY = TINY_LLAMA


def hf_model() -> "transformers.LlamaForCausalLM":
    config = llama_config(transformers, TINY)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF starts norms at 1 and weights at std 0.02: widen both so a mix-up shows
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model


def to_ours(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(k[len("model.") :] if k.startswith("model.") else k): v.detach().clone() for k, v in hf_state.items()}


def ours(state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(SimpleNamespace(**TINY))
    model.load_state_dict(state, strict=True)  # every key maps, none left over
    return model.eval()


def input_ids() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))


def _tp_logits(world, state: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[bool, Any]:
    comm = world.new_communicator(list(range(world.world_size)), "tp")
    out = {}
    for sequence_parallel in (False, True):
        model = apply_tensor_parallel(
            m := ours(state), comm, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(m)
        )
        with torch.no_grad():
            out[sequence_parallel] = gather_from_tensor_parallel_region(model(ids), comm).numpy()
    return out  # numpy: a returned tensor would travel as a shared-memory handle the exiting rank closes


@pytest.mark.timeout(120)
def test_logits_match_transformers_unsharded_and_tp2():
    hf = hf_model()
    ids = input_ids()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    state = to_ours(hf.state_dict())
    assert set(state) == set(ours(state).state_dict())

    with torch.no_grad():
        torch.testing.assert_close(ours(state)(ids), expected, rtol=1e-5, atol=1e-5)

    for rank, by_sp in enumerate(run_local(_tp_logits, 2, state, ids, timeout_s=110)):
        for sequence_parallel, logits in by_sp.items():
            torch.testing.assert_close(
                torch.from_numpy(logits),
                expected,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m: f"rank {rank}, TP2, sequence_parallel={sequence_parallel}: {m}",
            )

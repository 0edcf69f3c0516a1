"""Our Mixtral reproduces Hugging Face ``transformers``' ``MixtralForCausalLM`` logits with the same weights,
unsharded and at tensor-parallel size 2 (experts cut column/row inside one token region per block, with and
without sequence parallelism); the TP2 run also checks the loss with the aux term and every gradient
against the unsharded model.

HF's model is built in-process from a tiny ``MixtralConfig`` (no download). transformers ≥ 5 keeps each
layer's experts fused (``mlp.experts.gate_up_proj[E] = cat(w1, w3)``, ``down_proj[E] = w2``) and names the
block ``mlp``; :func:`to_ours` maps both layouts. The spawned ranks never import transformers.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.models.mixtral import MixtralForCausalLM
from nxdt.parallel.tensor_parallel import (
    apply_tensor_parallel,
    gather_from_tensor_parallel_region,
    gather_full_grads,
    sync_replicated_grads,
)
from nxdt.config.hf_model import tensor_parallel_plan_of

transformers = pytest.importorskip("transformers")

MOE = dict(num_experts=4, top_k=2, router_aux_loss_coef=0.05)
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    max_position_embeddings=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_word_embeddings=False,
    init_method_std=0.02,
    activations_checkpoint_granularity=None,
)


def cfg() -> SimpleNamespace:
    return SimpleNamespace(**TINY, moe=SimpleNamespace(**MOE))


def hf_model() -> "transformers.MixtralForCausalLM":
    c = cfg()
    if "rope_parameters" in inspect.signature(transformers.MixtralConfig.__init__).parameters:
        rope = {"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
    else:
        rope = {"rope_theta": c.rope_theta}
    config = transformers.MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_kv_heads,
        num_local_experts=MOE["num_experts"],
        num_experts_per_tok=MOE["top_k"],
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=False,
        router_aux_loss_coef=MOE["router_aux_loss_coef"],
        **rope,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # widen HF's init so a mix-up of weights or routing shows
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model


def to_ours(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names (fused experts of transformers ≥ 5, or per-expert w1/w2/w3) → ours."""
    out = {}
    for key, value in hf_state.items():
        key = key[len("model.") :] if key.startswith("model.") else key
        key = key.replace(".mlp.", ".block_sparse_moe.")
        value = value.detach().clone()
        if key.endswith("experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")]
            for e, fused in enumerate(value):
                w1, w3 = fused.chunk(2, dim=0)
                out[f"{prefix}{e}.w1.weight"], out[f"{prefix}{e}.w3.weight"] = w1.clone(), w3.clone()
        elif key.endswith("experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e, w2 in enumerate(value):
                out[f"{prefix}{e}.w2.weight"] = w2.clone()
        else:
            out[key] = value
    return out


def ours(state: dict[str, torch.Tensor]) -> MixtralForCausalLM:
    model = MixtralForCausalLM(cfg())
    model.load_state_dict(state, strict=True)  # every key maps, none left over
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, TINY["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], ids[:, 1:]


def _tp_run(world, state: dict[str, torch.Tensor]) -> dict:
    comm = world.new_communicator(list(range(world.world_size)), "tp")
    ids, labels = batch()
    reference = ours(state)
    ref_loss = reference.loss_fn(reference(ids), labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    out = {}
    for sequence_parallel in (False, True):
        model = apply_tensor_parallel(
            m := ours(state), comm, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(m)
        )
        logits = model(ids)
        loss = model.loss_fn(logits, labels)
        loss.backward()
        sync_replicated_grads(model, comm)
        grads = gather_full_grads(model, comm)
        out[sequence_parallel] = {
            "logits": gather_from_tensor_parallel_region(logits.detach(), comm).numpy(),
            "loss": (loss.item(), ref_loss.item()),
            "grad_err": max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref_grads.items()),
            "same_names": set(grads) == set(ref_grads),
        }
    return out  # numpy: a returned tensor would travel as a shared-memory handle the exiting rank closes


@pytest.mark.timeout(120)
def test_mixtral_matches_transformers_unsharded_and_tp2():
    hf = hf_model()
    ids, _ = batch()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    state = to_ours(hf.state_dict())
    assert set(state) == set(ours(state).state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ours(state)(ids), expected, rtol=1e-5, atol=1e-5)

    for rank, by_sp in enumerate(run_local(_tp_run, 2, state, timeout_s=110)):
        for sequence_parallel, r in by_sp.items():
            where = f"rank {rank}, TP2, sequence_parallel={sequence_parallel}"
            torch.testing.assert_close(
                torch.from_numpy(r["logits"]), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}"
            )
            loss, ref = r["loss"]
            assert loss == pytest.approx(ref, rel=1e-5), where  # cross-entropy + aux over every token
            assert r["same_names"], where
            assert r["grad_err"] < 1e-4, f"{where}: largest relative gradient error {r['grad_err']:.2e}"

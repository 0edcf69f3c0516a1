"""Qwen2/2.5, Qwen3, Mistral and Qwen3-MoE: nxdt's first-step loss on a batch equals transformers' on the same weights,
unsharded, at TP2 with and without sequence parallelism and at PP2 (1F1B); under TP the gradients of the replicated
tensors a family adds (Qwen3's per-head q/k norms, whose gradient each rank holds for its own heads only) equal
transformers'; Qwen3-MoE's at EP2 too. Qwen3-MoE's loss includes the load-balancing term (``output_router_logits``, coefficient 0.05, as nxdt
adds it) at PP2 too, where each stage adds its layers' share of it (nxdt.parallel.pipeline; loss and gradients against
the unsharded model in test_moe_pipeline.py). Its router keeps the
top-k softmax weights as they are (``norm_topk_prob: false``, Qwen3MoeConfig's default; Mixtral's renormalisation is
tested in test_mixtral_parity.py).

Each tiny model is made with transformers (non-default rope_theta and epsilon, random biases and norm weights, Qwen2
tied and untied, Qwen3 with head_dim 16 ≠ hidden/heads = 8, Mistral with a sliding window as long as its positions)
and saved; the ranks read it the way a run does: the model fields from config.json (``ModelSpec.model_fields``), the
weights through the family's state-dict adapter (``load_hf_weights``). The spawned ranks never import transformers.

Tolerance: both sides compute in fp32 from the same weights and differ only in operation order (sdpa vs eager
softmax; under TP the row-parallel sums and the vocab-parallel log-sum-exp, under PP nothing): a few ulps per
operation through two layers, ~1e-6 relative on a loss of ~4.6, so rtol 1e-5 keeps a tenfold margin on any CPU.
Gradients of the q/k norm weights sum ~24 tokens × 4 heads of products: atol 1e-6 on values of ~1e-2.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.config.hf_model import family_of
from nxdt.lightning.hf import load_hf_weights
from nxdt.parallel.expert_parallel import apply_expert_parallel, moe_blocks
from nxdt.parallel.pipeline import PipelineExecutor, build_chunks, chunk_parameters, one_f_one_b
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, sync_replicated_grads
from nxdt.config.hf_model import tensor_parallel_plan_of

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
RTOL = 1e-5  # module docstring
CONFIGS = {
    "qwen2-tied": lambda: transformers.Qwen2Config(
        **SHAPE, intermediate_size=48, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=3e-6, tie_word_embeddings=True
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE, intermediate_size=48, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=3e-6, tie_word_embeddings=False
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **SHAPE, intermediate_size=48, num_key_value_heads=2, head_dim=16, rope_theta=5e5, rms_norm_eps=2e-6
    ),
    "mistral": lambda: transformers.MistralConfig(
        **SHAPE, intermediate_size=48, num_key_value_heads=2, sliding_window=64, rope_theta=1e6, rms_norm_eps=1e-5
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        moe_intermediate_size=24,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        rope_theta=5e5,
        rms_norm_eps=2e-6,
    ),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # nxdt's labels arrive shifted
    return ids, labels


def _ours(directory: str):
    """The model a run builds from ``model.hf_checkpoint=directory`` alone."""
    fields = family_of(json.loads((Path(directory) / "config.json").read_text())).model_fields(
        json.loads((Path(directory) / "config.json").read_text())
    )
    module, _, name = fields["architecture"].rpartition(".")
    moe = SimpleNamespace(**{k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith("moe.")})
    cfg = SimpleNamespace(**{k: v for k, v in fields.items() if "." not in k}, moe=moe)
    model = getattr(importlib.import_module(module), name)(cfg)
    load_hf_weights(model, directory, fields["architecture"])
    return model


def _ranks(world, directories: dict[str, str]) -> dict:
    comm = world.new_communicator(list(range(world.world_size)), "g")
    ids, labels = _batch()
    out: dict = {}
    for family, directory in directories.items():
        for sp in (False, True):
            model = apply_tensor_parallel(m := _ours(directory), comm, sequence_parallel=sp, plan=tensor_parallel_plan_of(m))
            loss = model.loss_fn(model(ids), labels)
            loss.backward()
            sync_replicated_grads(model, comm)
            norms = {
                n: p.grad.numpy().copy() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))
            }
            out[family, f"tp2{'+sp' if sp else ''}"] = (loss.item(), norms)
        model = _ours(directory)
        if not model.tied:  # PP needs an untied head (the embedding and head live on two stages)
            chunks = build_chunks(model, comm.rank, comm.size)
            loss = PipelineExecutor(chunks, comm, model.loss_fn).run(one_f_one_b(comm.size, comm.rank, 1), [(ids, labels)])
            assert all(p.grad is not None for p in chunk_parameters(chunks).values())
            out[family, "pp2"] = (loss, {})  # the model's loss_fn: a MoE family's with every layer's aux term
        if moe_blocks(model):  # EP2: each rank holds half the experts; both ranks route the same batch here
            model = apply_expert_parallel(_ours(directory), comm)
            loss = model.loss_fn(model(ids), labels)
            loss.backward()  # the dense q/k norms' gradients: this rank's batch (the same on both), no TP sum
            norms = {
                n: p.grad.numpy().copy() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))
            }
            out[family, "ep2"] = (loss.item(), norms)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[str, float, dict]]:
    """family → (directory, transformers' loss on the batch, its q/k norm gradients by nxdt name)."""
    out = {}
    ids, _ = _batch()
    for family, make in CONFIGS.items():
        config = make()
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():  # norms at 1 and biases at 0 would hide a mix-up
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
        directory = tmp_path_factory.mktemp(family)
        model.save_pretrained(directory)
        result = model(input_ids=ids, labels=ids)  # transformers shifts the labels itself
        loss = result.loss
        loss.backward()
        norms = {
            n[len("model.") :]: p.grad.clone()
            for n, p in model.named_parameters()
            if n.endswith(("q_norm.weight", "k_norm.weight"))
        }
        out[family] = (str(directory), loss.item(), norms)
    return out


@pytest.mark.parametrize("family", list(CONFIGS))
def test_unsharded_loss_equals_transformers(saved, family):
    directory, expected, _ = saved[family]
    ids, labels = _batch()
    model = _ours(directory)
    assert type(model).__name__ == type(transformers.AutoConfig.from_pretrained(directory)).__name__.replace(
        "Config", "ForCausalLM"
    )
    assert model.loss_fn(model(ids), labels).item() == pytest.approx(expected, rel=RTOL)


def test_tp2_sp_and_pp2_loss_and_qk_norm_gradients_equal_transformers(saved):
    """One pair of ranks runs every family at TP2, TP2+SP and PP2 (1F1B), and the MoE family at EP2 (its experts split
    over the two ranks, the tokens exchanged all-to-all: with the same batch on both, transformers' loss on each)."""
    directories = {family: directory for family, (directory, *_) in saved.items()}
    ranks = run_local(_ranks, 2, directories, timeout_s=170)
    moe = {family: family_of({"model_type": family.removesuffix("-tied")}).block.moe for family in CONFIGS}
    layouts = {
        family: ["tp2", "tp2+sp"] + ([] if family.endswith("tied") else ["pp2"]) + (["ep2"] if moe[family] else [])
        for family in CONFIGS
    }
    for rank, out in enumerate(ranks):
        assert sorted(out) == sorted((f, layout) for f, names in layouts.items() for layout in names)
        for (family, layout), (loss, norms) in out.items():
            _, expected, hf_norms = saved[family]
            assert loss == pytest.approx(expected, rel=RTOL), f"rank {rank} {family} {layout}"
            assert set(norms) == set(hf_norms if layout != "pp2" else {}), (family, layout)
            for name, grad in norms.items():  # summed over the heads of both ranks: transformers' gradient
                torch.testing.assert_close(
                    torch.from_numpy(grad), hf_norms[name], rtol=0, atol=1e-6, msg=f"{family} {layout} {name}"
                )


@pytest.mark.parametrize("family", list(CONFIGS))
def test_lora_adapters_load_with_peft_and_give_nxdt_logits(saved, family, tmp_path):
    """Adapters on every target (Qwen2's biased q/k/v, Qwen3's normed ones; Qwen3-MoE's attention), exported as a PEFT adapter directory:
    the peft library puts them on transformers' model of the family and computes nxdt's logits (atol 1e-5: fp32,
    operation order only, as above; the adapter moves the logits by > 1e-2, so this is no base-vs-base comparison)."""
    peft = pytest.importorskip("peft")
    from nxdt.lightning.peft_export import export_peft_adapter
    from nxdt.models.lora import LoRALinear, apply_lora

    directory = saved[family][0]
    ids, _ = _batch()
    # a MoE family's experts (w1/w2/w3) have no LoRA MLP names (its spec's block.lora_mlp): attention only there
    mlp = ("gate_up_proj", "down_proj") if family_of({"model_type": family.removesuffix("-tied")}).block.lora_mlp else ()
    model = apply_lora(_ours(directory), rank=4, alpha=16, target_modules=("qkv_proj", "o_proj", *mlp))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(0.1 * torch.randn(m.lora_B.weight.shape, generator=g))
    model.eval()
    out = export_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=directory)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
        expected = model(ids)
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    assert (expected - base_logits).abs().max() > 1e-2

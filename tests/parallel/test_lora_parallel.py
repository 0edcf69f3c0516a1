"""LoRA on every layout against the single-process LoRA model of the same seed.

Tensor parallelism (``LoRAParallelLinear``): column-parallel bases split ``lora_B`` by output rows (A
replicated, its partial gradient summed over TP), row-parallel bases split ``lora_A`` by input columns (B
replicated; the adapter's partial output joins the base's before the one reduction). Checked per rank: the
layout, logits, loss, every adapter gradient gathered to full shape, the frozen weights' lack of gradients,
and the losses of several SGD steps; cases TP2, TP2 + SP, TP2 with the single KV head replicated.

Tolerances: the forward differs from the reference only in fp32 summation order (a TP sum of two partial
matmuls instead of one), ~1e-7 relative per value on these O(1) activations; gradients likewise (atol 1e-7 on
gradients of size ~1e-3..1e-1). SGD (lr 0.5) keeps later steps exactly as close: its update is linear in the
gradient, so a 1e-7 relative gradient difference moves the weights by ~1e-7 relative — unlike Adam, whose
normalisation turns the rounding noise of near-zero gradients into updates of size ~lr, host-dependently
(AMD and Intel round inside matmuls differently). rtol 1e-4 on the losses leaves three orders of margin.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.lora import LoRALinear, apply_lora, has_lora, merge_lora
from nxdt.parallel.data_parallel import ModelParallel, data_parallel_runtime
from nxdt.parallel.tensor_parallel import (
    ColumnParallelLinear,
    LoRAParallelLinear,
    RowParallelLinear,
    apply_tensor_parallel,
    gather_from_tensor_parallel_region,
    gather_full_grads,
    gather_full_state_dict,
    sync_replicated_grads,
)
from nxdt.config.hf_model import tensor_parallel_plan_of

BATCH, SEQ = 2, 8
ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def config(**overrides) -> SimpleNamespace:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )
    return SimpleNamespace(**{**base, **overrides})


def batch(step: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def lora_llama(cfg: SimpleNamespace, targets=ALL) -> LlamaForCausalLM:
    """A Llama with LoRA on ``targets``; B randomised (a fresh B = 0 would leave A's gradient zero and hide a
    wrong A split)."""
    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(cfg), rank=4, alpha=8, target_modules=targets)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(0.1 * torch.randn(m.lora_B.weight.shape, generator=g))
    return model


def close(actual, expected, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _tp_case(comm, overrides: dict, sequence_parallel: bool, steps: int = 4) -> list[float]:
    cfg = config(**overrides)
    ref = lora_llama(cfg)
    model = apply_tensor_parallel(
        m := lora_llama(cfg), comm, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(m)
    )
    tag = f"tp{comm.size} sp={sequence_parallel} {overrides}"
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    r, h = 4, cfg.hidden_size
    assert isinstance(attn.q_proj, LoRAParallelLinear) and attn.q_proj.mode == "column"
    assert isinstance(attn.q_proj.base_layer, ColumnParallelLinear) and isinstance(attn.o_proj.base_layer, RowParallelLinear)
    assert attn.q_proj.lora_A.weight.shape == (r, h) and attn.q_proj.lora_B.weight.shape == (h // comm.size, r)
    assert attn.o_proj.lora_A.weight.shape == (r, h // comm.size) and attn.o_proj.lora_B.weight.shape == (h, r)
    assert mlp.down_proj.lora_A.weight.shape == (r, cfg.ffn_hidden_size // comm.size)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in ref.named_parameters() if p.requires_grad}, tag  # the base stays frozen
    assert all(".lora_" in n for n in trainable), tag
    full = gather_full_state_dict(model, comm)
    assert full.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(full[name], value), (tag, name)

    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for step in range(steps):
        ids, labels = batch(step, cfg.vocab_size)
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss = ref.loss_fn(ref(ids), labels)
        ref_loss.backward()
        loss = model.loss_fn(model(ids), labels)
        loss.backward()
        synced = sync_replicated_grads(model, comm)
        assert synced > 0, tag  # LoRA's replicated halves always hold partial gradients
        close(loss, ref_loss, f"{tag} loss step {step}", rtol=1e-4 if step else 1e-5)
        if step == 0:
            grads = gather_full_grads(model, comm)
            assert grads.keys() == trainable, (tag, sorted(set(grads) ^ trainable))
            for name, p in ref.named_parameters():
                if p.requires_grad:
                    assert p.grad.abs().max() > 0, (tag, name)  # every adapter gradient is exercised
                    close(grads[name], p.grad, f"{tag} grad {name}", atol=1e-7)
        losses.append(loss.item())
        opt_ref.step()
        opt.step()
    full = gather_full_state_dict(model, comm)
    for name, value in ref.state_dict().items():
        close(full[name], value, f"{tag} {name} after {steps} SGD steps", rtol=1e-4, atol=1e-6)
    # merging on the shards (each rank folds its rows / columns of B·A into its base shard) = merging the whole
    ids, _ = batch(steps, cfg.vocab_size)
    merge_lora(ref)
    merge_lora(model)
    assert not has_lora(model) and isinstance(model.layers[0].self_attn.o_proj, RowParallelLinear)
    full = gather_full_state_dict(model, comm)
    assert full.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        close(full[name], value, f"{tag} merged {name}", rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        close(gather_from_tensor_parallel_region(model(ids), comm), ref(ids), f"{tag} merged logits", rtol=1e-4, atol=1e-5)
    return losses


TP_CASES = [({}, False), ({}, True), ({"num_kv_heads": 1}, True)]  # KV heads sharded; + SP; the one KV head replicated


def _two_rank_world(world, tp_cases, dp_cases) -> dict:
    """Every 2-rank check in one launch (process start-up dominates on 2 cores)."""
    _frozen_first_unit(world)
    comm = world.new_communicator(list(range(world.world_size)), "tp")
    return {"tp": [_tp_case(comm, *case) for case in tp_cases], "dp": [_dp_case(world, *case) for case in dp_cases]}


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    dp_cases = [(kind, {}) for kind in DP_KINDS] + [("fsdp", {"activations_checkpoint_granularity": "full"})]
    return run_local(_two_rank_world, 2, TP_CASES, dp_cases, timeout_s=110)


@pytest.mark.timeout(120)
def test_tp2_lora_matches_single_process(two_rank_results):
    """Asserted in the workers (_tp_case); here: every rank computed the same losses."""
    assert len(two_rank_results[0]["tp"]) == len(TP_CASES)
    assert two_rank_results[0]["tp"] == two_rank_results[1]["tp"]


# ---------------------------------------------------------------------------------------------- data parallelism
class Holder(torch.nn.Module):
    """What a strategy hands the runtimes: a module whose ``model`` is the hub model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def state_elements(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state tensors this rank holds (ZeRO-1 keeps them in its inner optimizer)."""
    inner = getattr(optimizer, "inner", optimizer)
    return sum(v.numel() for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())


DP_KINDS = {
    "replicated": {},
    "zero1": {"zero1": True},
    "fsdp": {"fsdp": {"param_persistence_threshold": 0}},  # every flat sharded, adapters included
    "fsdp-persistent": {"fsdp": {"prefetch": "token_threaded"}},
}  # default threshold: the small adapter flats stay whole on every rank
MICRO = 2  # micro-batches per rank and step (the FSDP units are freed and re-gathered in each)


def _dp_case(world, kind: str, overrides: dict, steps: int = 3) -> dict:
    """One DP2 LoRA run through a data-parallel runtime against the single-process LoRA model on the whole batch.
    SGD with momentum: linear in the gradients (see the module docstring) and it has state to count."""
    rank, size = world.rank, world.world_size
    cfg = config(**overrides)
    ref, model = lora_llama(cfg), lora_llama(cfg)
    base_before = {n: t.clone() for n, t in ref.state_dict().items() if ".lora_" not in n}
    adapters = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    holder = Holder(model)
    rt = data_parallel_runtime(**DP_KINDS[kind])
    rt.bind(ModelParallel(dp=world.world, dp_size=size))
    rt.broadcast_parameters(holder)
    opt = rt.shard_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9), holder)
    rt.shard_model(holder, [opt])
    tag = f"{kind} {overrides}"
    losses, ref_losses = [], []
    for step in range(steps):
        ids, labels = batch(step, cfg.vocab_size)
        ids, labels = torch.cat([ids, ids.flip(0)]), torch.cat([labels, labels.flip(1)])  # 4 rows: 2 per rank
        opt_ref.zero_grad()
        ref_loss = ref.loss_fn(ref(ids), labels)
        ref_loss.backward()
        opt_ref.step()
        opt.zero_grad()
        mine = slice(rank * 2, rank * 2 + 2)
        local = torch.zeros(())
        for m in range(MICRO):  # each rank's mean over its rows, one micro-batch at a time
            rows = slice(mine.start + m, mine.start + m + 1)
            loss = model.loss_fn(model(ids[rows]), labels[rows]) / MICRO
            loss.backward()
            local += loss.detach()
        rt.finish_gradients(holder)
        opt.step()
        world.world.all_reduce(local, op="avg")
        losses.append(local.item())
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0, msg=lambda m: f"{tag}: {m}")
    state = rt.model_state_dict(holder)  # FSDP: gathered over DP
    state = {k[len("model.") :]: v for k, v in state.items()}
    for name, value in ref.state_dict().items():
        if name in base_before:  # the base weights did not move, exactly
            assert torch.equal(state[name], base_before[name]), (tag, name)
        else:
            close(state[name], value, f"{tag} adapter {name} after {steps} steps", rtol=1e-4, atol=1e-6)
    out = {
        "losses": losses,
        "state": state_elements(opt),
        "adapters": adapters,
        "frozen": frozen,
        "trainable_module_params": sum(p.numel() for p in holder.parameters() if p.requires_grad),
    }
    if kind.startswith("fsdp"):
        flats = rt.fsdp.flats()
        out["frozen_shards"] = sum(f.shard.numel() for f in flats if not f.trainable)
        out["frozen_replicated"] = sum(f.numel for f in flats if not f.trainable and f.replicated)
        out["frozen_grads"] = [f.unit for f in flats if not f.trainable and f.shard.grad is not None]
        out["module_weights"] = sorted(n for n, _ in holder.named_parameters() if "fsdp_shard_" not in n)
    if kind == "replicated":
        # the flat gradient bucket: trainable parameters only, then one has-a-gradient flag per parameter
        out["all_reduced"] = rt._grad_buffer.numel() - sum(1 for p in holder.parameters() if p.requires_grad)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index, kind", list(enumerate([*DP_KINDS, "fsdp+recompute"])))
def test_dp2_lora_matches_single_process(two_rank_results, index, kind):
    """Losses equal the single-process run's (asserted in the workers), base weights unchanged, and the optimizer
    holds state for the adapters only: all of them per replica (replicated; FSDP with the adapters' small flats
    kept whole), half of them per rank (ZeRO-1; FSDP with every flat sharded)."""
    r0, r1 = two_rank_results[0]["dp"][index], two_rank_results[1]["dp"][index]
    assert r0["losses"] == r1["losses"]
    adapters, frozen = r0["adapters"], r0["frozen"]
    assert 0 < adapters < frozen
    states = r0["state"] + r1["state"]
    if kind in ("replicated", "fsdp-persistent"):
        assert r0["state"] == r1["state"] == adapters  # momentum buffers: one element per adapter element
    else:
        assert max(r0["state"], r1["state"]) <= -(-adapters // 2) + 1024 and adapters <= states <= adapters + 2 * 1024
    if kind == "replicated":
        assert r0["all_reduced"] == adapters
    if kind.startswith("fsdp"):
        # the frozen base weights are sharded too: each rank holds about half of them, none receives a gradient
        for r in (r0, r1):
            assert r["frozen_replicated"] < frozen / 20, r["frozen_replicated"]
            assert r["frozen_shards"] <= (frozen - r["frozen_replicated"]) / 2 + r["frozen_replicated"] + 64
            assert r["frozen_grads"] == [] and r["module_weights"] == []


def _frozen_first_unit(world) -> None:
    """A unit whose frozen weight is needed in backward *after* its trainable flat's gradient is complete
    (frozen linear → trainable linear; the frozen weight gives the unit's input gradient last): FSDP must keep the
    unit gathered until that input gradient exists. Each unit's result equals the unsharded model's."""
    from nxdt.parallel.fsdp import apply_fsdp

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(3)]
        for b in blocks:
            b[0].requires_grad_(False)
        return torch.nn.Sequential(*blocks)

    ref, model = build(), build()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    x_ref, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).square().sum().backward()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    fsdp = apply_fsdp(model, world.world, [opt], units=[[b] for b in model], param_persistence_threshold=0)
    freed_too_early = []  # (values read from freed storage may still look right: check the storage itself)

    def watch(unit):
        def check(grad):  # runs just before the frozen linear's backward reads its weight
            if any(f.full.untyped_storage().nbytes() == 0 for f in unit.flats if not f.trainable):
                freed_too_early.append(unit.index)

        return lambda module, args, out: (out.register_hook(check), None)[1]

    for unit, block in zip(fsdp.units, model):
        block[0].register_forward_hook(watch(unit))
    model(x_mine).square().sum().backward()
    fsdp.finish_gradients()
    assert freed_too_early == []
    close(x_mine.grad, x_ref.grad, "input gradient through the frozen weights", atol=1e-7)
    assert all(f.full.untyped_storage().nbytes() == 0 for f in fsdp.flats()), "every unit resharded after the step"


def test_fsdp_keeps_frozen_weights_until_the_units_backward_ends(two_rank_results):
    """Asserted in the workers (_frozen_first_unit, first thing in the 2-rank launch)."""
    assert two_rank_results[0]["tp"] is not None


def _tp_fsdp_world(world) -> list[float]:
    """TP2 (+SP) × FSDP DP2 on 4 ranks: LoRA's partial gradients are summed over TP on FSDP's shards, the frozen
    base is sharded over DP; losses and the gathered adapters equal the single-process run's."""
    from nxdt.parallel.tensor_parallel import gather_shards, norm_weights, partial_grad_names, shard_layout

    rank = world.rank
    tp_ranks, dp_ranks = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
    tp = world.new_communicator(tp_ranks, f"tp{rank // 2}")
    dp = world.new_communicator(dp_ranks, f"dp{rank % 2}")
    cfg = config()
    ref = lora_llama(cfg)
    model = apply_tensor_parallel(m := lora_llama(cfg), tp, sequence_parallel=True, plan=tensor_parallel_plan_of(m))
    layout = shard_layout(model)
    holder = Holder(model)
    rt = data_parallel_runtime(fsdp={"param_persistence_threshold": 0})
    rt.bind(
        ModelParallel(
            dp=dp,
            dp_size=2,
            tp=tp,
            sequence_parallel=True,
            norm_weights=norm_weights(model, 2),
            tp_layout=layout,
            tp_partial_grads=partial_grad_names(model),
        )
    )
    rt.broadcast_parameters(holder)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    rt.shard_model(holder, [opt])
    losses = []
    for step in range(3):
        ids, labels = batch(step, cfg.vocab_size)
        opt_ref.zero_grad()
        ref_loss = ref.loss_fn(ref(ids), labels)
        ref_loss.backward()
        opt_ref.step()
        opt.zero_grad()
        mine = slice(dp.rank, dp.rank + 1)  # each DP rank one of the 2 rows
        loss = model.loss_fn(model(ids[mine]), labels[mine])
        loss.backward()
        rt.finish_gradients(holder)
        opt.step()
        mean = loss.detach().clone()
        dp.all_reduce(mean, op="avg")
        close(mean, ref_loss, f"tp2+sp x fsdp2 loss step {step}", rtol=1e-4 if step else 1e-5)
        losses.append(mean.item())
    state = {k[len("model.") :]: v for k, v in rt.model_state_dict(holder).items()}
    for name, value in ref.state_dict().items():
        full = gather_shards(state[name], tp, *layout[name]) if name in layout else state[name]
        close(full, value, f"tp2+sp x fsdp2 {name} after 3 steps", rtol=1e-4, atol=1e-6)
    return losses


@pytest.mark.timeout(120)
def test_tp2_x_fsdp2_lora_matches_single_process():
    results = run_local(_tp_fsdp_world, 4, timeout_s=110)
    assert len({tuple(r) for r in results}) == 1

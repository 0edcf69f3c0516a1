"""Long context, items 2 and 3: Llama 3.1 RoPE scaling and the one core-attention seam.

RoPE scaling: ``rope_scaling`` with ``rope_type: llama3`` (from a Hugging Face config.json, or
``model.rope_scaling.*``) gives the inverse frequencies of transformers' ``llama3`` rope type, and our Llama
the logits of ``transformers.LlamaForCausalLM`` built from the same config.json and weights — at positions
past ``original_max_position_embeddings``, with frequencies in all three bands (kept, blended, divided).
Other rope types are refused by name before launch.

Core attention: ``sdpa`` and ``blockwise`` equal ``naive`` (outputs and input gradients, fp32) for
multi-head, grouped-query and multi-query heads and sequence lengths that are not multiples of the block;
neither creates an S×S tensor (checked op by op); every hub model takes ``model.core_attention``; tensor
and sequence parallelism give the unsharded logits with each; the planner counts the S×S scores only for
``naive``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nxdt.cli import main
from nxdt.comm.spawn import run_local
from nxdt.config import ConfigError, compose_config, compose_nxdt_config
from nxdt.config.hf_model import HFConfigError, model_fields
from nxdt.config.nxdt_compat import translate
from nxdt.models.attention import IMPLEMENTATIONS, core_attention
from nxdt.models.gpt import GPTForCausalLM
from nxdt.models.llama import LlamaForCausalLM, rope_inv_freq, rope_tables
from nxdt.models.mixtral import MixtralForCausalLM
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, gather_from_tensor_parallel_region
from nxdt.planner.estimate import memory_per_rank
from nxdt.config.hf_model import tensor_parallel_plan_of

pytestmark = pytest.mark.timeout(120)

CONFIGS = Path(__file__).parent / "nxdt_configs"
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SEQ = 64  # twice original_max_position_embeddings: positions 32..63 are where the scaling matters


def config_json(rope_scaling=LLAMA3, **extra) -> dict:
    """A Llama 3.1-style config.json (transformers 4 layout: rope_theta and rope_scaling at the top), tiny.

    head_dim 16 with rope_theta 1e4 has wavelengths 2π·1e4^(i/8) = 6.3, 19.9, 62.8, 199, ...; with
    original_max_position_embeddings 32 the bands are < 32/4 = 8 (kept), 8..32 (blended), > 32 (divided)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "rope_scaling": rope_scaling,
        **extra,
    }


def ours_config(hf_json: dict, **overrides) -> SimpleNamespace:
    """Our model config from config.json, through the same mapping `model.model_config` uses."""
    fields, _ = model_fields(hf_json)
    nested: dict = {}
    for key, value in fields.items():
        parent, _, leaf = key.rpartition(".")
        (nested.setdefault(parent, {}) if parent else nested)[leaf] = value
    return SimpleNamespace(**{**nested, **overrides})


def tokens(b: int, s: int, vocab: int = 64, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- RoPE scaling


def test_llama3_inverse_frequencies_equal_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for hf_json in (
        config_json(),  # the tiny test config
        {
            **json.loads((CONFIGS / "llama3_8B_config.json").read_text()),  # Llama 3.1 8B's published values
            "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192},
            "max_position_embeddings": 131072,
        },
    ):
        cfg = ours_config(hf_json)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig.from_dict(hf_json), "cpu")
        ours = rope_inv_freq(head_dim, cfg.rope_theta, cfg.rope_scaling)
        assert attention_factor == 1.0
        # transformers computes in fp32 (its theta ** (2i/d) is a few ulps off), we in fp64: equal to fp32 rounding
        torch.testing.assert_close(ours.float(), theirs, rtol=4 * torch.finfo(torch.float32).eps, atol=0)

        plain = rope_inv_freq(head_dim, cfg.rope_theta)
        wavelength = 2 * math.pi / plain
        context = hf_json["rope_scaling"]["original_max_position_embeddings"]
        kept, divided = wavelength < context / 4, wavelength > context
        blended = ~kept & ~divided
        assert kept.any() and blended.any() and divided.any()  # every branch of the scaling is exercised
        assert torch.equal(ours[kept], plain[kept])
        torch.testing.assert_close(ours[divided], plain[divided] / 8, rtol=1e-15, atol=0)
        assert ((ours[blended] < plain[blended]) & (ours[blended] > plain[blended] / 8)).all()


def test_scaled_and_unscaled_rope_differ_so_parity_is_not_vacuous():
    cos, sin = rope_tables(16, SEQ, 10000.0, LLAMA3)
    cos0, sin0 = rope_tables(16, SEQ, 10000.0)
    assert torch.equal(cos[0], cos0[0])  # position 0 is never rotated
    assert (cos - cos0).abs().max() > 0.5 and (sin - sin0).abs().max() > 0.5
    assert torch.equal(rope_tables(16, SEQ, 10000.0, {"rope_type": "default"})[0], cos0)  # "default" = plain RoPE
    torch.manual_seed(0)
    scaled = LlamaForCausalLM(ours_config(config_json()))
    torch.manual_seed(0)
    plain = LlamaForCausalLM(ours_config(config_json(rope_scaling=None)))
    ids = tokens(1, SEQ)
    with torch.no_grad():
        assert (scaled(ids) - plain(ids)).abs().max() > 1e-3  # same weights, the scaling alone changes the logits


def hf_llama(hf_json: dict):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig.from_dict(hf_json)
    config._attn_implementation = "eager"  # the textbook softmax(QKᵀ)V
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # widen norms and weights from HF's init so a mix-up shows (as test_hf_parity.py)
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model


def to_ours(hf_state: dict) -> dict:
    return {(k[len("model.") :] if k.startswith("model.") else k): v.detach().clone() for k, v in hf_state.items()}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_llama3_rope_logits_equal_transformers_past_the_original_context(impl):
    hf_json = config_json()
    hf = hf_llama(hf_json)
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    ids = tokens(2, SEQ)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    model = LlamaForCausalLM(ours_config(hf_json, core_attention=impl))
    model.load_state_dict(to_ours(hf.state_dict()), strict=True)
    torch.testing.assert_close(
        model.rope_cos[:SEQ], hf.model.rotary_emb(torch.zeros(1), torch.arange(SEQ)[None])[0][0], rtol=0, atol=5e-6
    )  # HF's fp32 angles vs our fp64 ones, rounded to fp32
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), expected, rtol=1e-5, atol=1e-5)


def test_transformers5_rope_parameters_map_like_rope_scaling():
    old = config_json()
    new = {k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**LLAMA3, "rope_theta": 10000.0}  # what transformers 5's save_pretrained writes
    assert model_fields(new) == model_fields(old)
    fields, notes = model_fields(old)
    assert notes == [] and fields["rope_scaling.rope_type"] == "llama3"
    assert fields["rope_scaling.original_max_position_embeddings"] == 32
    legacy = config_json(rope_scaling={**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"})
    assert model_fields(legacy) == model_fields(old)  # older files spell it "type"
    for plain in (None, {"rope_type": "default"}):
        assert not any(k.startswith("rope_scaling") for k in model_fields(config_json(rope_scaling=plain))[0])


def test_an_nxdt_config_reads_rope_scaling_from_config_json(tmp_path):
    hf_json = json.loads((CONFIGS / "llama3_8B_config.json").read_text())
    hf_json["rope_scaling"] = {**LLAMA3, "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    cfg, _ = compose_nxdt_config(
        CONFIGS, "hf_llama3_8B_config", ["instance=trn1.32xlarge", f"model.model_config={tmp_path}"], paths=False
    )
    rope = cfg.model.rope_scaling
    assert (rope.rope_type, rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (
        "llama3",
        8.0,
        1.0,
        4.0,
        8192,
    )
    assert cfg.model.core_attention == "sdpa"  # the file's fusions.flash_attention: True
    cfg, _ = compose_nxdt_config(CONFIGS, "hf_llama3_8B_config", ["instance=trn1.32xlarge"], paths=False)
    assert cfg.model.rope_scaling.rope_type is None  # "rope_scaling": null


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope", "su"])
def test_unknown_rope_types_are_refused_by_name(kind):
    with pytest.raises(HFConfigError, match=f"rope_scaling.rope_type='{kind}' is not implemented"):
        model_fields(config_json(rope_scaling={"rope_type": kind, "factor": 2.0}))
    with pytest.raises(ValueError, match=f"rope_type='{kind}' is not implemented"):
        LlamaForCausalLM(ours_config(config_json(), rope_scaling={"rope_type": kind, "factor": 2.0}))


def test_bad_rope_and_attention_inputs_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = config_json(rope_scaling={"type": "dynamic", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    incomplete = config_json(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    (tmp_path / "incomplete").mkdir()
    (tmp_path / "incomplete" / "config.json").write_text(json.dumps(incomplete))
    nxdt = ["train", "--config-path", str(CONFIGS), "--config-name", "hf_llama3_8B_config", "instance=cpu"]
    cases = [
        (["train", "model.rope_scaling.rope_type=yarn"], "model.rope_scaling.rope_type='yarn': is not implemented"),
        (
            ["train", "model.rope_scaling.rope_type=llama3", "model.rope_scaling.high_freq_factor=0.5"],
            "model.rope_scaling.high_freq_factor",
        ),
        (
            ["train", "model.rope_scaling.rope_type=llama3", "model.rope_scaling.original_max_position_embeddings=0"],
            "model.rope_scaling.original_max_position_embeddings",
        ),
        (["train", "model.core_attention=flash"], "model.core_attention='flash': must be one of sdpa, blockwise, naive"),
        (["plan", "model.core_attention=flash"], "model.core_attention"),
        ([*nxdt, f"model.model_config={tmp_path / 'config.json'}"], "rope_scaling.rope_type='dynamic' is not implemented"),
        ([*nxdt, f"model.model_config={tmp_path / 'incomplete'}"], "rope_type llama3 needs low_freq_factor, high_freq_factor"),
    ]
    failures = []
    for argv, needle in cases:
        code = main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        if code != 2 or len(lines) != 1 or needle not in lines[0] or "Traceback" in err:
            failures.append(f"{argv}: exit {code}, stderr {lines}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------------------- NxDT's flash_attention


def test_nxdt_flash_attention_selects_core_attention():
    hf = json.loads((CONFIGS / "llama3_8B_config.json").read_text())
    base = {"model_source": "hf", "trainer": {"devices": 32}, "model": {"model_config": "c.json"}}

    def core(**model):
        config = translate({**base, "model": {**base["model"], **model}}, hf).config
        return config["model"].get("core_attention", "sdpa (schema default)")

    assert core() == "sdpa (schema default)"
    assert core(fusions={"flash_attention": True}) == "sdpa (schema default)"
    assert core(fusions={"flash_attention": False}) == "naive"
    assert core(fusions={"flash_attention": True}, core_attention="blockwise") == "blockwise"  # nxdt's own key picks the kind
    for flash, ours in ((False, "blockwise"), (True, "naive")):
        with pytest.raises(ConfigError, match="model.core_attention.*contradicts the NxDT key model.fusions.flash_attention"):
            core(fusions={"flash_attention": flash}, core_attention=ours)


# ---------------------------------------------------------------------------------------------- core attention

# (query heads, KV heads, sequence, block): MHA, GQA, MQA; sequences not a multiple of the block, one shorter than it
SHAPES = [(4, 4, 64, 16), (4, 2, 50, 16), (8, 2, 77, 32), (4, 1, 33, 128), (6, 3, 40, 7)]


def attention_and_grads(impl: str, q, k, v, grad, causal: bool, block: int):
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = core_attention(*inputs, causal=causal, impl=impl, block_size=block)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad)]


@pytest.mark.parametrize("impl", ["sdpa", "blockwise"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,seq,block", SHAPES)
def test_each_impl_equals_naive_attention_outputs_and_input_grads(impl, causal, heads, kv_heads, seq, block):
    g = torch.Generator().manual_seed(seq * heads + kv_heads)
    q, grad = (torch.randn(2, heads, seq, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq, 16, generator=g) for _ in range(2))
    ref = attention_and_grads("naive", q, k, v, grad, causal, block)
    got = attention_and_grads(impl, q, k, v, grad, causal, block)
    # Tolerance: every output row is a convex combination of V rows and every gradient a sum of at most S
    # products of such terms; fp32 evaluation in another order (tiles, online rescaling by exp(m_old - m_new),
    # the flash kernel's own tiling) changes only rounding, a few units of fp32 epsilon relative to the
    # tensor's magnitude (measured: <= 4 ε·max|x| over these shapes, ~1e-6 absolute). 16 ε·max|x| bounds it
    # while a wrong mask, scale or group mapping (errors of order max|x|) fails by orders of magnitude.
    eps = torch.finfo(torch.float32).eps
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape, name
        err, bound = (a - b).abs().max().item(), 16 * eps * b.abs().max().item()
        assert err <= bound, f"{impl} {name}: max error {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_under_bf16_autocast_each_impl_stays_within_bf16_rounding(impl):
    """mixed_precision: q/k/v arrive in bf16 under autocast; blockwise keeps its fp32 tiles there (autocast off
    inside, forward and backward), sdpa uses the bf16 flash kernel, naive autocast's bf16 matmuls."""
    g = torch.Generator().manual_seed(7)
    q, grad = (torch.randn(2, 4, 100, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 100, 16, generator=g) for _ in range(2))
    ref = attention_and_grads("naive", q, k, v, grad, True, 32)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", torch.bfloat16):
        out = core_attention(*(t.to(torch.bfloat16) for t in inputs), impl=impl, block_size=32)
    assert out.dtype == torch.bfloat16
    got = [out.float(), *torch.autograd.grad(out.float(), inputs, grad)]
    eps = torch.finfo(torch.bfloat16).eps  # 2^-7: the inputs alone are rounded by up to eps/2
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, ref):
        err, bound = (a - b).abs().max().item(), 4 * eps * b.abs().max().item()
        assert err <= bound, f"{impl} {name}: max error {err:.2e} > {bound:.2e}"


def test_naive_is_the_textbook_formula():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8) + torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)
    torch.testing.assert_close(core_attention(q, k, v, impl="naive"), scores.softmax(-1) @ v, rtol=1e-14, atol=1e-14)


class _LargestTensor(TorchDispatchMode):
    """Records every aten op and the largest tensor any op produced (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        self.largest = max([self.largest, *(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_and_blockwise_never_create_the_s_by_s_scores(dtype):
    b, heads, kv_heads, seq, d, block = 1, 4, 2, 256, 16, 32
    q = torch.randn(b, heads, seq, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, seq, d, dtype=dtype, requires_grad=True) for _ in range(2))
    largest = {}
    for impl in IMPLEMENTATIONS:
        with _LargestTensor() as mode:
            core_attention(q, k, v, impl=impl, block_size=block).float().sum().backward()
        largest[impl] = mode.largest
        if impl == "sdpa":  # torch's fused CPU flash kernel, not the math fallback that would materialise S×S
            assert {
                "aten._scaled_dot_product_flash_attention_for_cpu.default",
                "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
            } <= mode.ops
    assert largest["naive"] >= b * heads * seq * seq  # the reference does hold the scores
    # the others: nothing larger than q itself (the score tiles are heads·block² = 4096 elements)
    assert largest["sdpa"] <= b * heads * seq * d and largest["blockwise"] <= b * heads * seq * d


@pytest.mark.parametrize("impl", ["sdpa", "blockwise"])
@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt"])
def test_every_hub_model_takes_core_attention(arch, impl):
    common = dict(
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
        init_method_std=0.1,
        activations_checkpoint_granularity=None,
        moe=SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.02),
    )
    cls = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM, "gpt": GPTForCausalLM}[arch]

    def loss_and_grads(core):
        torch.manual_seed(0)
        model = cls(SimpleNamespace(**common, core_attention=core))
        loss = model.loss_fn(model(tokens(2, 40)), tokens(2, 40, seed=4))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads("naive")
    loss, grads = loss_and_grads(impl)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="model.core_attention='flash'"):
        cls(SimpleNamespace(**common, core_attention="flash"))


def test_selective_checkpointing_recomputes_each_impl_exactly():
    base = ours_config(config_json(), hidden_size=32, num_attention_heads=4)
    for impl in IMPLEMENTATIONS:
        runs = []
        for granularity in (None, "selective"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(
                SimpleNamespace(**{**vars(base), "core_attention": impl, "activations_checkpoint_granularity": granularity})
            )
            model.loss_fn(model(tokens(1, 40)), tokens(1, 40, seed=5)).backward()
            runs.append([p.grad for p in model.parameters()])
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=impl)


def _tp_logits(world, state, ids, cfg_dict):
    comm = world.new_communicator(list(range(world.world_size)), "tp")
    out = {}
    for impl in IMPLEMENTATIONS:
        for sequence_parallel in (False, True):
            model = LlamaForCausalLM(SimpleNamespace(**cfg_dict, core_attention=impl))
            model.load_state_dict(state)
            model = apply_tensor_parallel(model, comm, sequence_parallel=sequence_parallel, plan=tensor_parallel_plan_of(model))
            with torch.no_grad():
                out[f"{impl} sp={sequence_parallel}"] = gather_from_tensor_parallel_region(model(ids), comm).numpy()
    return out


@pytest.mark.timeout(150)
def test_tensor_and_sequence_parallel_attention_on_local_heads_with_each_impl():
    hf_json = config_json()
    cfg = vars(ours_config(hf_json))
    torch.manual_seed(0)
    model = LlamaForCausalLM(SimpleNamespace(**cfg, core_attention="naive"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tokens(2, SEQ)
    with torch.no_grad():
        expected = model(ids)
    # TP2: each rank runs 2 query heads and 1 KV head (4 and 2 in all); scaled RoPE on every rank
    for rank, by_case in enumerate(run_local(_tp_logits, 2, state, ids, cfg, timeout_s=140)):
        for case, logits in by_case.items():
            torch.testing.assert_close(
                torch.from_numpy(logits),
                expected,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, where=f"rank {rank}, TP2, {case}": f"{where}: {m}",
            )


# ---------------------------------------------------------------------------------------------- planner


def test_planner_counts_the_s_by_s_scores_only_for_naive():
    overrides = [
        "instance=trn1.32xlarge",
        "model=llama3_8b",
        "distributed_strategy.tensor_model_parallel_size=8",
        "data.micro_batch_size=1",
        "data.global_batch_size=32",
        "data.seq_length=8192",
    ]
    activations = {}
    for impl in IMPLEMENTATIONS:
        for granularity in ("null", "selective", "full"):
            cfg = compose_config(
                [*overrides, f"model.core_attention={impl}", f"model.activations_checkpoint_granularity={granularity}"]
            )
            degrees = {"tp": 8, "pp": 1, "cp": 1, "ep": 1, "dp": 4}
            activations[impl, granularity] = memory_per_rank(cfg, degrees)["activations"]
    s, b, a, layers, tp, h, g = 8192, 1, 32, 32, 8, 4096, 1024
    e = 2 if cfg.precision.type != "fp32" else 4  # the activations' bytes
    # naive attention (no dropout) keeps per layer the fp32 probabilities 4·a·s²·b and the boolean mask s²·b, split by TP,
    # and the peak layer's backward holds two fp32 S×S gradients 8·a·s²·b/TP once (tests/test_memory_model.py pins the
    # formula on hand-computed figures; experiments/attention-memory measures it)
    kept, transient = s * s * b * (4 * a + 1) / tp, 8 * a * s * s * b / tp
    # per token its matmuls keep fp32 copies of q and of k, v broadcast to every head (3·h·4) where sdpa keeps q, k, v
    # (h + 2·g)·e, and o_proj's copy of its output h·e without sdpa's fp32 logsumexp (4·a)
    per_token = (3 * h * 4 - (h + 2 * g) * e - 4 * a) * s * b / tp
    assert activations["naive", "null"] - activations["sdpa", "null"] == pytest.approx(
        kept * layers + per_token * layers + transient
    )
    # the layer being recomputed
    assert activations["naive", "full"] - activations["sdpa", "full"] == pytest.approx(kept + per_token + transient)
    # selective recompute keeps no S×S tensor between passes, but recomputing naive attention in backward still
    # materialises the peak layer's S×S gradients
    assert activations["naive", "selective"] - activations["sdpa", "selective"] == pytest.approx(transient)
    # blockwise returns [b, a, s, d]: o_proj's transpose copies it (h·e per token, / TP) where sdpa's output is a view;
    # selective recomputes both kernels and keeps o_proj's input alone
    copy = h * e * s * b / tp
    assert activations["blockwise", "null"] - activations["sdpa", "null"] == copy * layers
    assert activations["blockwise", "full"] - activations["sdpa", "full"] == copy
    assert activations["blockwise", "selective"] == activations["sdpa", "selective"]

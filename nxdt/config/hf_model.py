"""One :class:`ModelSpec` per model family (pure data and arithmetic: dicts in, dicts out; no torch): llama, mistral,
qwen2, qwen3, mixtral, qwen3_moe, gpt2 — everything nxdt knows about a family outside its hub class, in one object
(torchtitan's per-model ``TrainSpec`` with its ``StateDictAdapter``: ``torchtitan/protocols/train_spec.py``,
``torchtitan/protocols/state_dict_adapter.py``, ``torchtitan/models/llama3/__init__.py``).

A spec says which Hugging Face ``model_type`` the family is and which hub class implements it (``architecture``), and:

* the config.json mapping both ways: how every field that changes the computation maps to an nxdt model field
  (:meth:`ModelSpec.model_fields`, transformers' defaults for the family, refusals by name), the family's own
  config.json for ``nxdt checkpoint export-hf`` (:meth:`ModelSpec.hf_config`), and which nxdt fields change the
  computation (:attr:`ModelSpec.compute_keys`: the ones an import compares, the ones an override may not contradict);
* the state-dict adapter as data (:attr:`ModelSpec.weights`: names, fused and transposed projections;
  ``nxdt.lightning.hf.StateDictAdapter`` applies the rules with torch, which this layer does not import);
* what the planner's FLOPs count and memory model need to know of the block (:attr:`ModelSpec.block`:
  ``nxdt.planner.estimate`` asks :func:`spec_of` for it, never a module name);
* how the hub model is cut (:attr:`ModelSpec.parallel`, a :class:`ParallelPlan`, as torchtitan's TrainSpec carries
  its ``parallelize_fn``): the TP/SP plan as data (:meth:`ModelSpec.tensor_parallel_plan`) and, for a MoE family
  (``block.moe``), the pattern of the expert blocks EP slices; ``nxdt.lightning.strategy`` finds the spec by the
  model's exact class (:func:`spec_of_class`) and hands both to ``nxdt.parallel``. The hub class keeps the torch half:
  its modules and forward, the PP stage split every family shares (``layers`` with ``embed`` / ``run_layer`` /
  ``head``), FSDP units. ``tests/test_model_specs.py`` checks every registered spec against its hub class.

Adding a family = one spec in :data:`FAMILIES`, one hub class (model file), tests.

Fields a family does not implement are refused by name rather than ignored (RoPE scaling: ``llama3`` is
implemented, every other ``rope_type`` is refused). A field config.json leaves out takes the default of
transformers' own config class for that family (``LlamaConfig``: rms_norm_eps 1e-6; ``MixtralConfig``: rope_theta
1e6; ``GPT2Config``: tied embeddings; ``Qwen3Config``: head_dim 128; ``MistralConfig``: sliding_window 4096), which is
what ``from_pretrained`` builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class HFConfigError(ValueError):
    """``str()`` names the config.json field and what to do."""


# rope_scaling types the hub implements (null and "default" are plain RoPE); transformers also has linear,
# dynamic, yarn, longrope, proportional: each changes the math, so each is refused by name
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_KEYS = ("rope_scaling.rope_type", *(f"rope_scaling.{k}" for k in LLAMA3_KEYS))
# nxdt model fields that change training but not the function the weights compute: an override of one of them
# never contradicts a config.json (init only matters without loaded weights; recompute and the attention kernel are
# exact; the aux-loss weight is part of the objective, which HF's forward leaves out unless output_router_logits)
TRAINING_ONLY = (
    "init_method_std",
    "activations_checkpoint_granularity",
    "core_attention",
    "moe.router_aux_loss_coef",
)


def rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_scaling.*`` (and ``rope_theta`` when it sits inside) from config.json: Llama 3.1's ``rope_scaling``
    (transformers 4 files) or ``rope_parameters`` (transformers 5 files, which carry rope_theta inside)."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(key)
    if rope is not None and not isinstance(rope, Mapping):
        raise HFConfigError(f"{key}={rope!r}: expected an object with rope_type and its parameters")
    rope = rope or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise HFConfigError(f"partial_rotary_factor={partial}: the model hub rotates the whole head")
    out: dict[str, Any] = {}
    if hf.get("rope_theta") is None and rope.get("rope_theta") is not None:
        out["rope_theta"] = rope["rope_theta"]
    kind = rope.get("rope_type", rope.get("type"))  # "type": older config.json files
    if kind not in (None, *ROPE_TYPES):
        raise HFConfigError(f"{key}.rope_type={kind!r} is not implemented; nxdt implements llama3 (Llama 3.1) and default")
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if rope.get(k) is None]
        if missing:
            raise HFConfigError(f"{key}: rope_type llama3 needs {', '.join(missing)}")
        out["rope_scaling.rope_type"] = "llama3"
        out.update({f"rope_scaling.{k}": rope[k] for k in LLAMA3_KEYS})
    return out


def _rope_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``rope_theta`` + ``rope_scaling`` (transformers 4's spelling, which transformers 5 reads too)."""
    kind = model.get("rope_scaling.rope_type")
    scaling = None
    if kind == "llama3":
        scaling = {"rope_type": "llama3", **{k: model[f"rope_scaling.{k}"] for k in LLAMA3_KEYS}}
    elif kind not in (None, "default"):
        raise HFConfigError(f"model.rope_scaling.rope_type={kind!r} has no Hugging Face counterpart nxdt writes")
    return {"rope_theta": float(model["rope_theta"]), "rope_scaling": scaling}


@dataclass(frozen=True)
class WeightRule:
    """Our tensor(s) ↔ one Hugging Face tensor, as name patterns: ``{i}`` a layer index, ``{e}`` an expert index,
    ``{p}`` weight or bias, ``{name}`` any name. Several of ours are fused into the HF tensor along the output
    dimension (GPT-2's q | k | v in ``c_attn``), in this order; ``transpose``: the HF weight is ours transposed (GPT-2's
    ``Conv1D`` is [in, out], the transpose of ``nn.Linear``'s). ``nxdt.lightning.hf.StateDictAdapter`` applies them."""

    ours: tuple[str, ...]
    hf: str
    transpose: bool = False


@dataclass(frozen=True)
class Block:
    """What the planner's FLOPs count and memory model (``nxdt.planner.estimate``) need to know of a family's decoder
    block beyond the config's sizes: ``mlp_matrices`` weight matrices of hidden × ffn per MLP or expert (SwiGLU's
    gate, up, down: 3; GELU's up, down: 2), ``norm`` ``rmsnorm`` (fp32 statistics) or ``layernorm``, ``moe``: the
    feed-forward is a sparse mixture of ``model.moe.num_experts`` experts (a dense family ignores ``model.moe``),
    ``lora_mlp``: the MLP has LoRA's ``gate_up_proj`` / ``down_proj`` targets (``nxdt.models.lora.NXDT_TARGETS``),
    ``learned_positions``: a max_position_embeddings × hidden table of positions (GPT-2's ``wpe``; else RoPE)."""

    mlp_matrices: int
    norm: str
    moe: bool
    lora_mlp: bool
    learned_positions: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    """How a family's hub model is cut, as data (``nxdt.parallel`` applies it; this layer imports no torch):
    ``tensor_parallel``: (module name pattern, style) pairs for ``nxdt.parallel.tensor_parallel.apply_tensor_parallel``
    (TP and SP; the styles are that module's ``STYLES``), ``{head_dim}`` and ``{vocab}`` (the vocabulary padding
    block, ``model.make_vocab_size_divisible_by``) filled from the model config by
    :meth:`ModelSpec.tensor_parallel_plan`; ``experts``: the pattern of the MoE blocks expert parallelism slices (None:
    a dense family; ``nxdt.parallel.expert_parallel.apply_expert_parallel``'s ``blocks``). Pipeline stages are cut
    from the hub model's ``layers``, which it runs one by one (``embed`` / ``run_layer`` / ``head``:
    ``nxdt.parallel.pipeline.build_chunks``), the same for every family."""

    tensor_parallel: tuple[tuple[str, str], ...]
    experts: str | None = None


# Llama's attention and head (Megatron's layout): q/k/v column-parallel in whole heads, entered once per block
# (``input_region``), KV heads replicated when fewer than the ranks, o row-parallel; embedding and head split along
# the padded vocabulary (a tied table stays one shard)
_ATTENTION_TP = (
    ("embed_tokens", "vocab_embedding:{vocab}"),
    ("layers.*.self_attn", "input_region"),
    ("layers.*.self_attn.q_proj", "colwise:{head_dim}"),
    ("layers.*.self_attn.k_proj", "colwise_kv:{head_dim}"),
    ("layers.*.self_attn.v_proj", "colwise_kv:{head_dim}"),
    ("layers.*.self_attn.o_proj", "rowwise:{head_dim}"),
    ("lm_head", "vocab_head:{vocab}"),
)
# Qwen3's per-head q/k norms: replicated, each rank's gradient covers its own heads only
_QK_NORM_TP = (("layers.*.self_attn.q_norm", "head_norm"), ("layers.*.self_attn.k_norm", "head_norm"))
_SWIGLU_TP = (
    ("layers.*.mlp", "input_region"),
    ("layers.*.mlp.gate_proj", "colwise"),
    ("layers.*.mlp.up_proj", "colwise"),
    ("layers.*.mlp.down_proj", "rowwise"),
)


def _moe_plan(block: str, *attention: tuple[str, str]) -> ParallelPlan:
    """A sparse MoE feed-forward at ``block``: its experts as column (w1, w3) → row (w2) pairs inside one token region
    per block (one reduction per block, not per expert), the router replicated; EP slices the same blocks."""
    experts = (
        (block, "token_region"),
        (f"{block}.experts.*.w1", "colwise_in_region"),
        (f"{block}.experts.*.w3", "colwise_in_region"),
        (f"{block}.experts.*.w2", "rowwise_partial"),
    )
    return ParallelPlan(tensor_parallel=(*attention, *experts), experts=block)


_LLAMA_PLAN = ParallelPlan(tensor_parallel=(*_ATTENTION_TP, *_SWIGLU_TP))
# Megatron's GPT: q/k/v column-parallel (biases split) and o row-parallel (bias added after the reduction), fc_in
# column- and fc_out row-parallel, the learned positions replicated (cut to the sequence shard under SP)
_GPT_PLAN = ParallelPlan(
    tensor_parallel=(
        ("embed_tokens", "vocab_embedding:{vocab}"),
        ("embed_positions", "sequence_embedding"),
        ("layers.*.self_attn", "input_region"),
        ("layers.*.self_attn.q_proj", "colwise:{head_dim}"),
        ("layers.*.self_attn.k_proj", "colwise:{head_dim}"),
        ("layers.*.self_attn.v_proj", "colwise:{head_dim}"),
        ("layers.*.self_attn.o_proj", "rowwise:{head_dim}"),
        ("layers.*.mlp", "input_region"),
        ("layers.*.mlp.fc_in", "colwise"),
        ("layers.*.mlp.fc_out", "rowwise"),
        ("lm_head", "vocab_head:{vocab}"),
    )
)


def _get(node: Any, name: str) -> Any:
    """``name`` of a model config node: typed, namespace or mapping (flat dotted keys too)."""
    return node.get(name) if isinstance(node, Mapping) else getattr(node, name, None)


SWIGLU = Block(mlp_matrices=3, norm="rmsnorm", moe=False, lora_mlp=True)
SWIGLU_MOE = Block(mlp_matrices=3, norm="rmsnorm", moe=True, lora_mlp=False)  # experts are w1/w2/w3: no LoRA target


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model family (module docstring). ``fields``: config.json field → nxdt field, with transformers' default
    for the family when the field is absent (None: no default, the field must be there)."""

    model_type: str
    hf_architecture: str  # transformers class, config.json's "architectures"
    architecture: str  # nxdt hub class (model.architecture): the torch modules, their forward, FSDP units
    fields: dict[str, tuple[str, Any]]
    compute_keys: tuple[str, ...]
    # (hf) -> extra nxdt fields / refusal, and (model) -> the family-specific config.json fields
    check: Callable[[Mapping[str, Any]], dict[str, Any]]
    extra_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    block: Block
    parallel: ParallelPlan = _LLAMA_PLAN  # how the hub model is cut: TP/SP, EP, PP
    fixed: dict[str, Any] = field(default_factory=dict)  # nxdt fields the family fixes (e.g. Mixtral's softmax router)
    # the state-dict adapter: the first rule whose pattern matches a name maps it; checkpoint names that are not
    # weights (``skip``: suffixes of buffers some checkpoints carry) are ignored; ``hf_prefix``: the prefix HF's own
    # saves put on every name but the head, which older checkpoints of the family leave out
    weights: tuple[WeightRule, ...] = (WeightRule(("lm_head.{p}",), "lm_head.{p}"), WeightRule(("{name}",), "model.{name}"))
    skip: tuple[str, ...] = ()
    hf_prefix: str | None = None

    def model_fields(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """Flat ``{nxdt model field (dotted below model.): value}`` from a parsed config.json of this family."""
        derived = self.check(hf)  # refusals, and fields derived from others (GPT-2's n_inner null = 4 × n_embd)
        out: dict[str, Any] = {"architecture": self.architecture, **self.fixed}
        for src, (dst, default) in self.fields.items():
            value = hf.get(src)
            out[dst] = derived.get(dst, default) if value is None else value
            if out[dst] is None:
                raise HFConfigError(f"{src} is missing; a {self.model_type} config.json needs it")
        return {**out, **derived}

    def hf_config(self, model: Mapping[str, Any], dtype: str = "float32") -> dict[str, Any]:
        """This family's config.json for a flat nxdt model config (``model_meta``'s form); refuses by name a
        setting the HF family cannot express."""
        for key, value in self.fixed.items():
            if model.get(key, value) != value:
                raise HFConfigError(
                    f"model.{key}={model[key]!r}: Hugging Face's {self.hf_architecture} has {value!r}; no HF family "
                    "computes this model, so it cannot be exported"
                )
        out: dict[str, Any] = {"architectures": [self.hf_architecture], "model_type": self.model_type}
        for src, (dst, _) in self.fields.items():
            out[src] = model.get(dst)
        out.update(self.extra_config(model))
        out["torch_dtype"] = dtype
        return dict(sorted(out.items()))

    def tensor_parallel_plan(self, model: Any) -> dict[str, str]:
        """The TP/SP plan of a hub model with this model config (``{module name pattern: style}``, what
        ``nxdt.parallel.tensor_parallel.apply_tensor_parallel`` takes as ``plan``)."""
        heads, hidden = _get(model, "num_attention_heads"), _get(model, "hidden_size")
        values = {
            "head_dim": _get(model, "head_dim") or hidden // heads,
            "vocab": int(_get(model, "make_vocab_size_divisible_by") or 1),
        }
        return {pattern: style.format(**values) for pattern, style in self.parallel.tensor_parallel}

    def hf_key(self, key: str) -> str:
        """The config.json field an nxdt model field comes from (``rope_scaling.factor`` keeps its name)."""
        return next((src for src, (dst, _) in self.fields.items() if dst == key), key)

    def mismatches(self, hf: Mapping[str, Any], model: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """``[(nxdt field, model's value, config.json's value)]`` for the architecture and every computation field
        that differs."""
        theirs = normalized(self.model_fields(hf))
        ours = normalized(model)
        keys = ("architecture", *self.compute_keys)
        return [(k, model.get(k), theirs.get(k)) for k in keys if ours.get(k) != theirs.get(k)]


def settings_from(
    hf: Mapping[str, Any], current: Mapping[str, Any], explicit: set[str]
) -> tuple[dict[str, Any], tuple[str, Any, Any, str] | None]:
    """What a run takes from a config.json: ``(updates, contradiction)``. ``current``: the composed model config
    (flat); ``explicit``: the model fields the user set by name. Every field of config.json not set explicitly is
    taken from it; an explicit one that changes the computation must agree with it, else ``contradiction`` is
    ``(field, the user's value, config.json's, config.json's field)``. Training-only fields (:data:`TRAINING_ONLY`) and a RoPE model's
    max_position_embeddings may be overridden."""
    family = family_of(hf)
    fields = family.model_fields(hf)
    if "rope_scaling.rope_type" in family.compute_keys:  # plain RoPE in config.json: the composed config's scaling off
        fields.setdefault("rope_scaling.rope_type", None)
    # a field is given when it, or a node above it, was set (model.rope_scaling={rope_type: llama3, ...})
    updates = {k: v for k, v in fields.items() if not any(k == e or k.startswith(f"{e}.") for e in explicit)}
    bad = family.mismatches(hf, {**current, **updates})
    if not bad:
        return updates, None
    name, ours, theirs = bad[0]
    if name == "architecture":  # named as config.json names it
        return updates, (name, ours, family.model_type, "model_type")
    return updates, (name, ours, theirs, family.hf_key(name))


def model_meta(model: Any) -> dict[str, Any]:
    """The flat model config (:data:`META_KEYS`) of a typed ``model`` node, as a checkpoint's meta.json records it for
    ``export-hf``."""
    out = {}
    for key in META_KEYS:
        node = model
        for part in key.split("."):
            node = getattr(node, part, None)
        out[key] = node
    return out


def normalized(model: Mapping[str, Any]) -> dict[str, Any]:
    """A flat model config with its equivalent spellings made equal: num_kv_heads null = the query heads, head_dim
    null = hidden_size / num_attention_heads; plain RoPE
    (rope_type null or default) carries no scaling parameters."""
    out = dict(model)
    if out.get("num_kv_heads") is None:
        out["num_kv_heads"] = out.get("num_attention_heads")
    if out.get("head_dim") is None and out.get("hidden_size") and out.get("num_attention_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out.get("rope_scaling.rope_type") in (None, "default"):
        for key in ROPE_KEYS:
            out[key] = None
    return out


def _llama_check(hf: Mapping[str, Any], model_type: str, derive_head_dim: bool = True) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act={act!r}: the model hub's {model_type} uses SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFConfigError(f"{flag}=true: the model hub's {model_type} has no such biases")
    out = rope_fields(hf)
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if derive_head_dim and hf.get("head_dim") is None and hidden and heads:
        out["head_dim"] = hidden // heads  # LlamaConfig / MistralConfig / Qwen2's attention: null = the quotient
    if hf.get("num_key_value_heads") is None:
        out["num_kv_heads"] = hf.get("num_attention_heads")
    return out


def _qwen_check(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    # Qwen's layers switch to sliding-window attention from max_window_layers on only with use_sliding_window
    if hf.get("use_sliding_window"):
        raise HFConfigError(
            "use_sliding_window=true: sliding-window attention is not implemented; set use_sliding_window to false "
            f"(the released {model_type} checkpoints have it off)"
        )
    # Qwen3Config's head_dim default is 128, not the quotient; Qwen2 computes the quotient
    return _llama_check(hf, model_type, derive_head_dim=model_type == "qwen2")


def _mistral_check(hf: Mapping[str, Any]) -> dict[str, Any]:
    out = _llama_check(hf, "mistral")
    # an explicit null is no window; a field left out is MistralConfig's default, 4096
    out["sliding_window"] = hf["sliding_window"] if "sliding_window" in hf else 4096
    return out


def _router_aux(hf: Mapping[str, Any]) -> dict[str, Any]:
    """transformers adds ``router_aux_loss_coef ·`` the load-balancing loss to a MoE model's loss only with
    ``output_router_logits`` (false by default, and in Mixtral's and Qwen3-MoE's released files): without it the
    weight is 0, so a Hugging Face directory trains as transformers (and TRL) train it; ``model.moe.router_aux_loss_coef``
    turns it on (a training-only field, taken over config.json)."""
    return {} if hf.get("output_router_logits") else {"moe.router_aux_loss_coef": 0.0}


def _mixtral_check(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("sliding_window") not in (None, 0):
        raise HFConfigError(f"sliding_window={hf['sliding_window']}: sliding-window attention is not implemented; set it to null")
    if hf.get("router_jitter_noise") not in (None, 0, 0.0):
        raise HFConfigError(f"router_jitter_noise={hf['router_jitter_noise']}: the model hub's router adds no noise; set 0")
    return {**_llama_check(hf, "mixtral"), **_router_aux(hf)}


def _head_dim(model: Mapping[str, Any]) -> int:
    return model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]


def _llama_config(model: Mapping[str, Any]) -> dict[str, Any]:
    heads = model["num_attention_heads"]
    return {
        "num_key_value_heads": model.get("num_kv_heads") or heads,
        "head_dim": _head_dim(model),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        **_rope_config(model),
    }


def _mixtral_config(model: Mapping[str, Any]) -> dict[str, Any]:
    out = _llama_config(model)
    for key in ("mlp_bias", "pretraining_tp", "attention_bias"):
        del out[key]
    # nxdt's MoE routes every token to its top-k experts without noise, over all positions; a model trained with the
    # load-balancing loss says so (transformers adds it only with output_router_logits, and reads it back that way)
    aux = bool(model.get("moe.router_aux_loss_coef"))
    return {**out, "output_router_logits": aux, "router_jitter_noise": 0.0, "sliding_window": None}


def _mistral_config(model: Mapping[str, Any]) -> dict[str, Any]:
    out = _llama_config(model)
    for key in ("mlp_bias", "pretraining_tp", "attention_bias"):
        del out[key]
    return {**out, "sliding_window": model.get("sliding_window")}


def _qwen_config(model: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    out = _llama_config(model)
    for key in ("mlp_bias", "pretraining_tp", "attention_bias"):
        del out[key]
    sliding = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": model["num_layers"]}
    return {**out, **sliding, **({"attention_bias": False} if model_type == "qwen3" else {})}


def _gpt2_check(hf: Mapping[str, Any]) -> dict[str, Any]:
    # gelu_new and gelu_pytorch_tanh are both GPT-2's tanh approximation (the hub's F.gelu(approximate="tanh"))
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFConfigError(f"activation_function={act!r}: the model hub's GPT uses GPT-2's tanh GELU (gelu_new)")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise HFConfigError(f"{key}={hf[key]}: the model hub's GPT computes attention as GPT-2 does ({key}={want})")
    out: dict[str, Any] = {}
    if hf.get("n_inner") is None:
        out["ffn_hidden_size"] = 4 * hf.get("n_embd", 768)  # GPT2Config: n_inner null = 4 × n_embd
    return out


def _gpt2_config(model: Mapping[str, Any]) -> dict[str, Any]:
    # nxdt's GPT has no dropout: a model trained further in transformers computes the same function
    return {
        "activation_function": "gelu_pytorch_tanh",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "use_cache": True,
    }


def _qwen3_moe_check(hf: Mapping[str, Any]) -> dict[str, Any]:
    # every layer sparse: dense layers in between would be a second feed-forward the hub class does not build
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise HFConfigError(f"decoder_sparse_step={step}: nxdt's Qwen3-MoE has a sparse MoE block in every layer; it needs 1")
    if hf.get("mlp_only_layers"):
        raise HFConfigError(
            f"mlp_only_layers={hf['mlp_only_layers']}: dense layers between the sparse ones are not implemented; it must be []"
        )
    out = _llama_check(hf, "qwen3_moe")  # head_dim null = the quotient (Qwen3MoeAttention's getattr)
    if hf.get("use_sliding_window"):
        raise HFConfigError("use_sliding_window=true: sliding-window attention is not implemented; set it to false")
    # transformers 5 writes num_local_experts (its attribute; Qwen's own files say num_experts)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    out["moe.num_experts"] = 128 if experts is None else experts  # Qwen3MoeConfig's default
    return {**out, **_router_aux(hf)}


def _qwen3_moe_config(model: Mapping[str, Any]) -> dict[str, Any]:
    out = _mixtral_config(model)
    del out["router_jitter_noise"]
    # intermediate_size is the width of dense layers, which this model has none of (decoder_sparse_step 1)
    return {
        **out,
        "num_experts": model["moe.num_experts"],
        "intermediate_size": model["ffn_hidden_size"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "max_window_layers": model["num_layers"],
        "attention_bias": False,
    }


_LLAMA_SHAPE = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size")
_LLAMA_FIELDS: dict[str, tuple[str, Any]] = {
    "vocab_size": ("vocab_size", None),
    "hidden_size": ("hidden_size", None),
    "num_hidden_layers": ("num_layers", None),
    "num_attention_heads": ("num_attention_heads", None),
    "num_key_value_heads": ("num_kv_heads", None),
    "intermediate_size": ("ffn_hidden_size", None),
    "max_position_embeddings": ("max_position_embeddings", 2048),
    "head_dim": ("head_dim", None),
    "rope_theta": ("rope_theta", 10000.0),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "tie_word_embeddings": ("tie_word_embeddings", False),
    "initializer_range": ("init_method_std", 0.02),
}
# Qwen2Config / Qwen3Config: 32k positions (Qwen3: head_dim 128 when config.json leaves it out)
_QWEN_FIELDS = {**_LLAMA_FIELDS, "max_position_embeddings": ("max_position_embeddings", 32768)}
# max_position_embeddings is no computation field of a RoPE model (the tables are cut at the sequence; Llama 3.1's
# scaling reads original_max_position_embeddings): NxDT raises it to the sequence length, and so may an override
_LLAMA_COMPUTE = (*_LLAMA_SHAPE, "head_dim", "rope_theta", *ROPE_KEYS, "norm_eps", "tie_word_embeddings")
_MOE_COMPUTE = ("moe.num_experts", "moe.top_k", "moe.router_activation", "moe.normalize_top_k_affinities")
# Qwen3-MoE's experts: ours w1 (gate) / w3 (up) / w2 (down) as Mixtral's, Hugging Face's gate_proj / up_proj / down_proj
_QWEN3_MOE_EXPERTS = tuple(
    WeightRule((f"layers.{{i}}.mlp.experts.{{e}}.{ours}.weight",), f"model.layers.{{i}}.mlp.experts.{{e}}.{hf}.weight")
    for ours, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
)

FAMILIES: dict[str, ModelSpec] = {
    "llama": ModelSpec(
        model_type="llama",
        hf_architecture="LlamaForCausalLM",
        architecture="nxdt.models.llama.LlamaForCausalLM",
        fields=_LLAMA_FIELDS,
        compute_keys=_LLAMA_COMPUTE,
        check=lambda hf: _llama_check(hf, "llama"),
        extra_config=_llama_config,
        block=SWIGLU,
    ),
    "mixtral": ModelSpec(
        model_type="mixtral",
        hf_architecture="MixtralForCausalLM",
        architecture="nxdt.models.mixtral.MixtralForCausalLM",
        fields={
            **_LLAMA_FIELDS,
            "max_position_embeddings": ("max_position_embeddings", 4096 * 32),
            "rope_theta": ("rope_theta", 1e6),
            "rms_norm_eps": ("norm_eps", 1e-5),
            "num_local_experts": ("moe.num_experts", 8),
            "num_experts_per_tok": ("moe.top_k", 2),
            "router_aux_loss_coef": ("moe.router_aux_loss_coef", 0.001),
        },
        compute_keys=(*_LLAMA_COMPUTE, *_MOE_COMPUTE),
        check=_mixtral_check,
        extra_config=_mixtral_config,
        block=SWIGLU_MOE,
        parallel=_moe_plan("layers.*.block_sparse_moe", *_ATTENTION_TP),
        fixed={"moe.router_activation": "softmax", "moe.normalize_top_k_affinities": True},
    ),
    # Qwen3-MoE: Qwen3's attention, Mixtral's sparse block in every layer; softmax top-k, renormalised only with
    # norm_topk_prob (Qwen3MoeTopKRouter)
    "qwen3_moe": ModelSpec(
        model_type="qwen3_moe",
        hf_architecture="Qwen3MoeForCausalLM",
        architecture="nxdt.models.qwen3_moe.Qwen3MoeForCausalLM",
        fields={  # intermediate_size is the width of dense layers (none here): experts are moe_intermediate_size wide
            **{k: v for k, v in _QWEN_FIELDS.items() if k != "intermediate_size"},
            "moe_intermediate_size": ("ffn_hidden_size", 768),
            "num_experts_per_tok": ("moe.top_k", 8),
            "norm_topk_prob": ("moe.normalize_top_k_affinities", False),
            "router_aux_loss_coef": ("moe.router_aux_loss_coef", 0.001),
        },
        compute_keys=(*_LLAMA_COMPUTE, *_MOE_COMPUTE),
        check=_qwen3_moe_check,
        extra_config=_qwen3_moe_config,
        block=SWIGLU_MOE,
        parallel=_moe_plan("layers.*.mlp", *_ATTENTION_TP, *_QK_NORM_TP),
        fixed={"moe.router_activation": "softmax"},
        weights=(*_QWEN3_MOE_EXPERTS, WeightRule(("lm_head.{p}",), "lm_head.{p}"), WeightRule(("{name}",), "model.{name}")),
    ),
    # Mistral 7B: Llama's computation, and a sliding window (honoured up to it: model.sliding_window)
    "mistral": ModelSpec(
        model_type="mistral",
        hf_architecture="MistralForCausalLM",
        architecture="nxdt.models.llama.MistralForCausalLM",
        fields={**_LLAMA_FIELDS, "max_position_embeddings": ("max_position_embeddings", 4096 * 32)},
        compute_keys=(*_LLAMA_COMPUTE, "sliding_window"),
        check=_mistral_check,
        extra_config=_mistral_config,
        block=SWIGLU,
    ),
    # Qwen2 / Qwen2.5: q, k, v biases (the hub class's attention options); tied heads in the small sizes
    "qwen2": ModelSpec(
        model_type="qwen2",
        hf_architecture="Qwen2ForCausalLM",
        architecture="nxdt.models.llama.Qwen2ForCausalLM",
        fields=_QWEN_FIELDS,
        compute_keys=_LLAMA_COMPUTE,
        check=lambda hf: _qwen_check(hf, "qwen2"),
        extra_config=lambda model: _qwen_config(model, "qwen2"),
        block=SWIGLU,
    ),
    # Qwen3: per-head q/k RMSNorm, an explicit head_dim
    "qwen3": ModelSpec(
        model_type="qwen3",
        hf_architecture="Qwen3ForCausalLM",
        architecture="nxdt.models.llama.Qwen3ForCausalLM",
        fields={**_QWEN_FIELDS, "head_dim": ("head_dim", 128)},
        compute_keys=_LLAMA_COMPUTE,
        check=lambda hf: _qwen_check(hf, "qwen3"),
        extra_config=lambda model: _qwen_config(model, "qwen3"),
        block=SWIGLU,
        parallel=ParallelPlan(tensor_parallel=(*_ATTENTION_TP, *_QK_NORM_TP, *_SWIGLU_TP)),
    ),
    # nxdt's GPT is GPT-2 exactly: learned positions, pre-LayerNorm, tanh GELU, biases but none on the head
    "gpt2": ModelSpec(
        model_type="gpt2",
        hf_architecture="GPT2LMHeadModel",
        architecture="nxdt.models.gpt.GPTForCausalLM",
        fields={
            "vocab_size": ("vocab_size", 50257),
            "n_embd": ("hidden_size", 768),
            "n_layer": ("num_layers", 12),
            "n_head": ("num_attention_heads", 12),
            "n_inner": ("ffn_hidden_size", None),
            "n_positions": ("max_position_embeddings", 1024),
            "layer_norm_epsilon": ("norm_eps", 1e-5),
            "tie_word_embeddings": ("tie_word_embeddings", True),
            "initializer_range": ("init_method_std", 0.02),
        },
        # learned positions: the table's size is a shape
        compute_keys=("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size")
        + ("max_position_embeddings", "norm_eps", "tie_word_embeddings"),
        check=_gpt2_check,
        extra_config=_gpt2_config,
        # fc_in / fc_out: no LoRA MLP names
        block=Block(mlp_matrices=2, norm="layernorm", moe=False, lora_mlp=False, learned_positions=True),
        parallel=_GPT_PLAN,
        weights=(
            WeightRule(("embed_tokens.weight",), "transformer.wte.weight"),
            WeightRule(("embed_positions.weight",), "transformer.wpe.weight"),
            WeightRule(("layers.{i}.input_layernorm.{p}",), "transformer.h.{i}.ln_1.{p}"),
            WeightRule(tuple(f"layers.{{i}}.self_attn.{x}_proj.{{p}}" for x in "qkv"), "transformer.h.{i}.attn.c_attn.{p}", True),
            WeightRule(("layers.{i}.self_attn.o_proj.{p}",), "transformer.h.{i}.attn.c_proj.{p}", True),
            WeightRule(("layers.{i}.post_attention_layernorm.{p}",), "transformer.h.{i}.ln_2.{p}"),
            WeightRule(("layers.{i}.mlp.fc_in.{p}",), "transformer.h.{i}.mlp.c_fc.{p}", True),
            WeightRule(("layers.{i}.mlp.fc_out.{p}",), "transformer.h.{i}.mlp.c_proj.{p}", True),
            WeightRule(("norm.{p}",), "transformer.ln_f.{p}"),
            WeightRule(("lm_head.weight",), "lm_head.weight"),
        ),
        skip=(".attn.bias", ".attn.masked_bias"),  # the causal mask, saved as a buffer by older transformers
        hf_prefix="transformer.",
    ),
}


def family_of(hf: Mapping[str, Any]) -> ModelSpec:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise HFConfigError(f"model_type={model_type!r} is not in the model hub; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_of_architecture(architecture: str) -> ModelSpec:
    """The spec of an nxdt hub class (its exact import path; refused by name when no family has it)."""
    for family in FAMILIES.values():
        if family.architecture == architecture:
            return family
    known = ", ".join(family.architecture for family in FAMILIES.values())
    raise HFConfigError(f"model.architecture={architecture!r} is no model family's hub class; use one of {known}")


# model.architecture's schema default (nxdt.config.schema.ModelConfig): the spec of a model node that names none
DEFAULT_ARCHITECTURE = FAMILIES["llama"].architecture


def spec_of(model: Any) -> ModelSpec:
    """The spec of a model config node (typed, namespace or mapping) by its ``architecture``, the exact hub class path
    (a node without one is the schema's default, Llama)."""
    architecture = model.get("architecture") if isinstance(model, Mapping) else getattr(model, "architecture", None)
    return family_of_architecture(architecture or DEFAULT_ARCHITECTURE)


def spec_of_class(cls: type) -> ModelSpec | None:
    """The spec of a hub class by its exact import path; None for any other class (a subclass may change the modules
    a plan names: it declares its own ``tensor_parallel_plan()``)."""
    path = f"{cls.__module__}.{cls.__qualname__}"
    return next((family for family in FAMILIES.values() if family.architecture == path), None)


def tensor_parallel_plan_of(model: Any) -> dict[str, str]:
    """The TP/SP plan of a built hub model (its class's family, its ``cfg``)."""
    spec = spec_of_class(type(model))
    if spec is None:
        raise HFConfigError(f"{type(model).__qualname__} is no model family's hub class; pass its own tensor-parallel plan")
    return spec.tensor_parallel_plan(model.cfg)


def model_fields(hf: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(flat ``{nxdt model field: value}``, notes) from a parsed ``config.json``."""
    return family_of(hf).model_fields(hf), []


# the nxdt model fields an export needs (model_meta records them in every checkpoint's meta.json)
META_KEYS = (
    "architecture",
    *_LLAMA_SHAPE,
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    *ROPE_KEYS,
    "norm_eps",
    "tie_word_embeddings",
    "sliding_window",
    "init_method_std",
    "moe.num_experts",
    "moe.top_k",
    "moe.router_aux_loss_coef",
    "moe.router_activation",
    "moe.normalize_top_k_affinities",
)

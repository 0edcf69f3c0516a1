"""Mixtral: a Llama decoder whose MLP is a sparse mixture of SwiGLU experts with top-k routing.

Attention, RMSNorm and RoPE are Llama's (imported from ``nxdt.models.llama``). The MLP of every layer is
``block_sparse_moe`` with Hugging Face's (original checkpoint) names, so Mixtral weights map by name::

    layers.N.block_sparse_moe.gate.weight            router, [num_experts, hidden]
    layers.N.block_sparse_moe.experts.E.w1.weight    gate projection of expert E  (HF w1)
    layers.N.block_sparse_moe.experts.E.w3.weight    up projection                (HF w3)
    layers.N.block_sparse_moe.experts.E.w2.weight    down projection              (HF w2)

(``transformers`` ≥ 5 keeps the experts fused in memory, ``mlp.experts.gate_up_proj[E] = cat(w1, w3)``,
``mlp.experts.down_proj[E] = w2``, and converts from these names when loading a checkpoint.)

Routing, per token x (as HF)::

    p = softmax(gate(x))                      # in fp32, over all experts
    w, idx = topk(p, k);  w = w / sum(w)       # k = moe.top_k, renormalised over the chosen experts
    y = Σ_j w_j · expert_idx_j(x),   expert(x) = w2(silu(w1 x) · w3 x)

``moe.normalize_top_k_affinities: false`` (Qwen3-MoE's ``norm_topk_prob: false``, ``models/qwen3_moe.py``) keeps
the chosen ``w`` as the softmax gave them.

``moe.router_activation: sigmoid`` (NxD's RouterTopK with ``act_fn="sigmoid"``, the default of NxDT's Megatron
MoE) takes ``p = sigmoid(gate(x))`` per expert instead; the top-k choice is the same (both are monotonic in the
logits) and the chosen affinities are renormalised alike. The auxiliary loss below uses the softmax either way,
as NxD's ``load_balancing_loss_func`` does.

Load-balancing auxiliary loss (HF's ``load_balancing_loss_func``, the Switch-Transformer loss): with the
router logits of *all* layers stacked as rows (T = tokens × layers rows, E experts)::

    f_e = (number of top-k slots of rows routed to e) / T      # Σ_e f_e = k
    P_e = mean over rows of softmax(logits)_e
    aux = E · Σ_e f_e · P_e                                     # = k when perfectly balanced

The rows are every token of the micro-batch, padding included, as NxD's ``load_balancing_loss_func`` takes them;
transformers' leaves out the positions its ``attention_mask`` masks (the same where nothing is padded: pretraining,
packed records). ``aux_loss(padding_masked=True)`` is transformers' (what TRL's DPO and GRPO add): each block keeps,
with its router logits, which rows are real tokens (``segment_ids != 0`` of the forward; under sequence parallelism
gathered as the logits are), and only those rows count. NxD's scales by E/k where this (and transformers') scales by E: an NxDT config's weight is divided
by k when it is translated (``nxdt.config.nxdt_compat``), so the loss is NxDT's.

**Where the aux loss goes:** ``loss_fn(logits, labels)`` called on the model returns
``cross_entropy + moe.router_aux_loss_coef · aux``, where ``aux`` comes from the router logits recorded by
this model's most recent forward (the training step calls ``model.loss_fn(model(ids), labels)``, so they
belong to the same micro-batch). ``aux_loss()`` returns the bare aux term (for logging).
``MixtralForCausalLM.loss_fn(logits, labels)`` on the class is the plain cross-entropy.

Under pipeline parallelism no stage holds every layer's router logits, and the loss is not a sum over layers (f and P
both run over all rows). It is one over *stages* once the counts are known: with C_e = Σ over all layers of the slots
routed to e and S_e = Σ over a stage's rows of softmax(logits)_e, ``aux = E/T² · Σ_e C_e · Σ_stages S_e``, and C
carries no gradient. The hub model hands the pipeline :class:`LoadBalancing` (``model.load_balancing()``): each
chunk's statistics ride forward with its activations, the last chunk stages the whole term (its own S
differentiable, the earlier stages' as numbers) for ``loss_fn`` to add, and the totals ride back with the gradients
so each earlier chunk backpropagates its own share ``coef · E/T² · Σ_e C_e S_e``
(``nxdt.parallel.pipeline.PipelineExecutor``): loss and gradients equal the unsharded model's, with any objective
(one that does not call ``loss_fn`` has no aux term at any stage, as unsharded; DPO's, ORPO's and GRPO's own
padding-masked term is not built under PP, and refused there). Under context parallelism each rank routes part of every
sequence: ``LoadBalancing.sequence_group`` adds the statistics up over the CP ranks, so the term is the whole
sequence's on each of them.

Config: the ``model`` schema's keys (as Llama; ``ffn_hidden_size`` is one expert's inner width) plus a
``moe`` sub-config: ``num_experts`` (8), ``top_k`` (2), ``router_aux_loss_coef`` (0.02; HF's MixtralConfig
defaults to 0.001, Mistral's released config.json uses 0.02). Missing keys fall back to those defaults.

Expert parallelism (``nxdt.parallel.expert_parallel.apply_expert_parallel``) keeps a slice of
``experts`` on each rank and replaces the block's ``dispatcher``; the model code itself is unchanged.

Example::

    cfg = SimpleNamespace(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                          ffn_hidden_size=48, max_position_embeddings=64,
                          moe=SimpleNamespace(num_experts=4, top_k=2, router_aux_loss_coef=0.02))
    model = MixtralForCausalLM(cfg)
    loss = model.loss_fn(model(ids), labels)      # cross-entropy + 0.02 · aux
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from nxdt.models.attention import KVCache, SequenceLayout, layout_fields
from nxdt.models.llama import DecoderLayer, LlamaForCausalLM, _instance_or_static, _opt, check_config, next_token_loss

MOE_DEFAULTS = {
    "num_experts": 8,
    "top_k": 2,
    "router_aux_loss_coef": 0.02,
    "router_activation": "softmax",
    "normalize_top_k_affinities": True,
}
ROUTER_ACTIVATIONS = {"softmax": lambda logits: torch.softmax(logits, dim=-1), "sigmoid": torch.sigmoid}


def moe_option(cfg: Any, name: str) -> Any:
    """``cfg.moe.<name>`` (a dataclass, namespace or dict), else the default in MOE_DEFAULTS."""
    moe = _opt(cfg, "moe", None)
    if isinstance(moe, dict):
        value = moe.get(name)
    else:
        value = getattr(moe, name, None)
    return MOE_DEFAULTS[name] if value is None else value


class Expert(nn.Module):
    """One SwiGLU expert with Mixtral's names: w2(silu(w1 x) · w3 x)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route(
    router_logits: torch.Tensor, top_k: int, activation: str = "softmax", normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] → (weights [T, k], expert ids [T, k]); the activation (softmax or sigmoid) in fp32, the
    chosen weights renormalised to sum 1 when ``normalize`` (Mixtral always; Qwen3-MoE's ``norm_topk_prob``)."""
    probs = ROUTER_ACTIVATIONS[activation](router_logits.float())
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if normalize else weights), experts


class _SumOverGroup(torch.autograd.Function):
    """Sum over a group of ranks (duck-typed: ``group.all_reduce(tensor, op="sum")``) whose backward sums the upstream
    gradients over the group too: each rank's loss term, whatever its weight, reaches every rank's statistics."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = values.detach().clone()
        group.all_reduce(total, op="sum")
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        ctx.group.all_reduce(total, op="sum")
        return total, None


class LoadBalancing:
    """HF's load-balancing loss (module docstring) over rows that may sit on several pipeline stages. A group of
    rows (one chunk's layers) is summarised by ``statistics``: a float64 vector [counts C (E), probability sums S (E),
    rows T] (no gradient; vectors of several groups add up) and S again with its gradient. ``loss(s, totals)`` is
    ``E/T² · Σ_e C_e · s_e`` with C and T of ``totals``: the term of the rows ``s`` sums; the terms of all groups add
    up to HF's loss over all their rows. ``coef``: the model's ``router_aux_loss_coef``.

    A pipeline's last chunk ``stage``s the whole term before its loss is computed; the model's ``aux_loss`` takes it
    from there (``taken`` then says the objective included it, as the unsharded model's ``loss_fn`` does, and an
    objective that leaves it out, DPO's, leaves it out at every stage).

    ``sequence_group``: the ranks holding the other tokens of the same sequences (context parallelism; set by
    ``nxdt.parallel.context_parallel.apply_context_parallel``). The statistics add up over it — the counts and rows as
    numbers, S through a sum whose backward sums the gradients too — so every CP rank computes the whole sequence's
    term, and the DP×CP gradient average of the ranks' (token-share weighted) losses is its gradient."""

    def __init__(self, num_experts: int, top_k: int, coef: float = 1.0) -> None:
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.width = 2 * num_experts + 1  # the statistics vector: C, S, T
        self._staged = _Transient()
        self.taken = False
        self.sequence_group: Any = None
        # a pipeline's statistics over real tokens only (set when the objective's term is transformers' with an
        # attention mask: TRL's DPO and ORPO); the unsharded model's aux_loss(padding_masked=) says it per call
        self.padding_masked = False

    def statistics(
        self, router_logits: list[torch.Tensor], masks: list[torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the float64 statistics vector, S [E] fp32 with gradient) of these router logits (each [rows, E]);
        ``masks``: per logits tensor, which rows count (bool [rows]; None: all)."""
        rows_of = [r.reshape(-1, self.num_experts) for r in router_logits]
        if masks is not None:
            rows_of = [r if m is None else r[m] for r, m in zip(rows_of, masks)]
        probs = torch.softmax(torch.cat(rows_of).float(), dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        # integer counts are not differentiable (as in HF): only S carries gradient, into the router
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).to(torch.float64)
        sums = probs.sum(dim=0)
        rows = torch.tensor([probs.shape[0]], dtype=torch.float64, device=counts.device)
        group = self.sequence_group
        if group is not None and group.size > 1:  # the whole sequences' statistics on every CP rank
            sums = _SumOverGroup.apply(sums, group)
            numbers = torch.cat([counts, rows])
            group.all_reduce(numbers, op="sum")
            counts, rows = numbers[:-1], numbers[-1:]
        return torch.cat([counts, sums.detach().double(), rows]), sums

    def loss(self, sums: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        """``E/T² · Σ_e C_e · sums_e`` (C, T from ``totals``; ``sums``: a tensor with gradient, or totals' S)."""
        e = self.num_experts
        rows = totals[2 * e].to(torch.float32)
        fraction = totals[:e].to(torch.float32) / rows
        return e * torch.sum(fraction * sums.to(torch.float32) / rows)

    def take(self, layers: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The statistics of the MoE blocks in ``layers`` (modules) from their last forward, which they then forget
        (the model's ``loss_fn`` must not count them a second time); None when none of them recorded logits."""
        blocks = [m for layer in layers for m in layer.modules() if isinstance(m, SparseMoeBlock)]
        ran = [b for b in blocks if b.router_logits is not None]
        logits = [b.router_logits for b in ran]
        masks = [b.router_mask for b in ran] if self.padding_masked else None
        for block in blocks:
            block.router_logits = None
        return self.statistics(logits, masks) if logits else None

    def stage(self, value: torch.Tensor | None) -> None:
        """The whole aux term of the micro-batch whose loss is computed next (None: clear it)."""
        self._staged.value, self.taken = value, False

    @property
    def staged(self) -> bool:
        return self._staged.value is not None

    def take_staged(self) -> torch.Tensor | None:
        value, self._staged.value = self._staged.value, None
        self.taken = self.taken or value is not None
        return value


def load_balancing_loss(
    router_logits: list[torch.Tensor] | torch.Tensor,
    num_experts: int,
    top_k: int,
    masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """HF's Switch-Transformer auxiliary loss over the rows of all layers' router logits (module docstring); ``masks``:
    per layer, the rows that count (transformers' ``attention_mask``; None: every row)."""
    balance = LoadBalancing(num_experts, top_k)
    totals, sums = balance.statistics(list(router_logits) if isinstance(router_logits, (list, tuple)) else [router_logits], masks)
    return balance.loss(sums, totals)


class _Transient:
    """Holds the last forward's router logits. Copies and pickles empty: a tensor inside an autograd graph
    cannot be deep-copied, and a copied model must not carry another model's activations."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> "_Transient":
        return _Transient()

    def __reduce__(self) -> tuple:
        return (_Transient, ())


def local_dispatch(block: "SparseMoeBlock", rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """All experts live here: ``rows`` [N, hidden] are sorted by global expert id, ``counts`` [E] per expert."""
    return block.run_experts(rows, counts.tolist(), block.expert_ids)


class SparseMoeBlock(nn.Module):
    """Router + experts (top-k). ``experts`` is a ModuleDict keyed by the *global*
    expert id, so names stay ``experts.<E>.w1`` when expert parallelism keeps only some of them.

    ``dispatcher(block, rows, counts) -> outputs``: runs the experts on rows sorted by expert id
    (``counts[e]`` rows for global expert e) and returns their outputs in the same order; the default runs
    them here, expert parallelism swaps in an all-to-all exchange."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_experts = int(moe_option(cfg, "num_experts"))
        self.top_k = int(moe_option(cfg, "top_k"))
        self.router_activation = str(moe_option(cfg, "router_activation"))
        self.normalize = bool(moe_option(cfg, "normalize_top_k_affinities"))
        self.gate = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(cfg.hidden_size, cfg.ffn_hidden_size) for e in range(self.num_experts)})
        self.dispatcher: Callable[["SparseMoeBlock", torch.Tensor, torch.Tensor], torch.Tensor] = local_dispatch
        # set by tensor parallelism (nxdt.parallel.tensor_parallel.TokenRegion): where the block's token rows
        # enter and leave the sharded experts; None runs everything here
        self.tensor_parallel_region: Any = None
        self._last_router_logits = _Transient()
        self.tokens = _Transient()  # the forward's real tokens, bool [B, S] (set by the model; None: all are)
        self._last_router_mask = _Transient()
        # rows each held expert ran on in forwards with gradients since a data-parallel runtime last took them
        # (nxdt.parallel.expert_parallel.take_touched_experts): the empty-rows run below counts none
        self.rows_seen: dict[int, int] = {}

    @property
    def router_logits(self) -> torch.Tensor | None:
        """[tokens, experts] of the last forward (for the aux loss); None before any forward."""
        return self._last_router_logits.value

    @router_logits.setter
    def router_logits(self, value: torch.Tensor | None) -> None:
        self._last_router_logits.value = value

    @property
    def router_mask(self) -> torch.Tensor | None:
        """Which rows of ``router_logits`` are real tokens (bool [tokens]); None: all of them (nothing was said)."""
        return self._last_router_mask.value

    def _real_rows(self, x_shape: torch.Size, region: Any) -> torch.Tensor | None:
        """The forward's token mask in the order of this block's router-logit rows: [B, S] row-major, or under
        sequence parallelism each rank's sequence shard in turn (as ``region.replicated`` gathers the logits)."""
        mask = self.tokens.value
        if mask is None:
            return None
        local = x_shape[-2]
        sharded = region is not None and region.sequence_parallel
        if tuple(mask.shape) != (x_shape[0], local * (region.comm.size if sharded else 1)):
            raise ValueError(f"SparseMoeBlock: a token mask of shape {tuple(mask.shape)} for an input of {tuple(x_shape)}")
        if not sharded:
            return mask.reshape(-1)
        mine = mask[:, region.comm.rank * local : (region.comm.rank + 1) * local]
        return region.gather_ids(mine.reshape(-1).to(torch.int64).contiguous()) != 0

    @property
    def expert_ids(self) -> list[int]:
        """Global ids of the experts held by this module, ascending."""
        return sorted(int(k) for k in self.experts.keys())

    def run_experts(self, rows: torch.Tensor, counts: list[int], expert_ids: list[int]) -> torch.Tensor:
        """rows grouped by expert (``counts[i]`` rows for ``expert_ids[i]``) → expert outputs, same order."""
        if torch.is_grad_enabled():  # not sampling, scoring or validation: which experts this step trains
            for e, n in zip(expert_ids, counts):
                self.rows_seen[e] = self.rows_seen.get(e, 0) + n
        outs = [self.experts[str(e)](chunk) for e, chunk in zip(expert_ids, rows.split(counts)) if chunk.shape[0]]
        if not outs:  # nothing came: an expert still runs on the empty rows, so the output has the dtype experts
            # produce (bf16 under autocast; the peers' all-to-all checks it) and rows stay in the graph
            return self.experts[str(expert_ids[0])](rows[:0])
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        region = self.tensor_parallel_region
        self.router_logits = region.replicated(logits) if region is not None else logits
        self._last_router_mask.value = self._real_rows(shape, region)
        weights, experts = route(logits, self.top_k, self.router_activation, self.normalize)
        if region is not None:  # the router stays outside: experts see every token, their outputs are partial sums
            flat, weights, experts = region.enter(flat), region.enter(weights), region.gather_ids(experts)
        # one row per (token, slot), sorted by expert id (stable: tokens keep their order within an expert)
        slot_expert = experts.reshape(-1)
        order = torch.argsort(slot_expert, stable=True)
        token_of_row = order // self.top_k
        counts = torch.bincount(slot_expert, minlength=self.num_experts)
        out_rows = self.dispatcher(self, flat[token_of_row], counts)
        out_rows = out_rows * weights.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of_row, out_rows.to(flat.dtype))
        if region is not None:
            out = region.exit(out)
        return out.reshape(shape)


class MixtralDecoderLayer(DecoderLayer):
    """Llama's pre-norm block with the sparse MoE block as its feed-forward: x + attn(norm(x)), then + moe(norm(x))."""

    ffn_name = "block_sparse_moe"

    def make_ffn(self, cfg: Any) -> nn.Module:
        return SparseMoeBlock(cfg)


def check_moe_config(cfg: Any) -> None:
    check_config(cfg)
    experts, top_k = moe_option(cfg, "num_experts"), moe_option(cfg, "top_k")
    if experts < 1:
        raise ValueError(f"model.moe.num_experts={experts} must be at least 1")
    if not 1 <= top_k <= experts:
        raise ValueError(f"model.moe.top_k={top_k} must be between 1 and model.moe.num_experts={experts}")
    if moe_option(cfg, "router_activation") not in ROUTER_ACTIVATIONS:
        raise ValueError(f"model.moe.router_activation={moe_option(cfg, 'router_activation')!r}: use softmax or sigmoid")
    if moe_option(cfg, "router_aux_loss_coef") < 0:
        raise ValueError(f"model.moe.router_aux_loss_coef={moe_option(cfg, 'router_aux_loss_coef')} must be >= 0")


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama with a sparse MoE block in every layer; the forward pieces (embed, run_layer, head) are Llama's."""

    layer_class = MixtralDecoderLayer
    check_config = staticmethod(check_moe_config)
    residual_outputs = ("o_proj.weight", "w2.weight")  # every expert of the full model is drawn, so EP can slice it

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.num_experts = int(moe_option(cfg, "num_experts"))
        self.top_k = int(moe_option(cfg, "top_k"))
        self.router_aux_loss_coef = float(moe_option(cfg, "router_aux_loss_coef"))
        self.balance = LoadBalancing(self.num_experts, self.top_k, self.router_aux_loss_coef)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] → logits [B, S, vocab] (router logits kept on each block for the aux loss, with which rows
        are real tokens: ``segment_ids != 0``, :meth:`run_layer`)."""
        for block in self.moe_blocks():
            block.router_logits = None  # a layer that does not run (another pipeline stage) adds nothing
        return super().forward(input_ids, position_ids, segment_ids, kv_cache)

    def run_layer(self, layer: nn.Module, x: torch.Tensor, layout: SequenceLayout | None = None) -> torch.Tensor:
        """Llama's, with the layer's MoE block told which rows are real tokens (``segment_ids != 0``) for a
        padding-masked term while it runs — here, not in :meth:`forward`, because a pipeline chunk runs layers
        without the model's forward (none to tell without a load-balancing weight)."""
        segments = layout_fields(layout)[1]
        if self.router_aux_loss_coef == 0 or segments is None:
            return super().run_layer(layer, x, layout)
        blocks = [m for m in layer.modules() if isinstance(m, SparseMoeBlock)]
        for block in blocks:
            block.tokens.value = segments != 0
        try:
            return super().run_layer(layer, x, layout)
        finally:  # an activation-checkpoint recompute runs after this: its statistics were taken already
            for block in blocks:
                block.tokens.value = None

    def router_logits(self) -> list[torch.Tensor]:
        """Router logits [tokens, experts] of every layer that ran in the last forward, in layer order."""
        return [b.router_logits for b in self.moe_blocks() if b.router_logits is not None]

    def load_balancing(self) -> LoadBalancing | None:
        """What a pipeline needs to add the aux loss across stages (module docstring); None when its weight is 0."""
        return self.balance if self.router_aux_loss_coef != 0 else None

    def aux_loss(self, padding_masked: bool = False) -> torch.Tensor:
        """HF's load-balancing loss over the last forward's router logits (0 if none were recorded); in a pipeline's
        last chunk the whole term over every stage's layers, which the pipeline staged. ``padding_masked``: over the
        real tokens only (transformers' with an ``attention_mask``; module docstring)."""
        staged = self.balance.take_staged()
        if staged is not None:
            return staged
        blocks = [b for b in self.moe_blocks() if b.router_logits is not None]
        if not blocks:
            return torch.zeros(())
        masks = [b.router_mask for b in blocks] if padding_masked else None
        totals, sums = self.balance.statistics([b.router_logits for b in blocks], masks)  # over its sequence group
        return self.balance.loss(sums, totals)

    @_instance_or_static
    def loss_fn(self: "MixtralForCausalLM | None", logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (fp32, mean over tokens, -100 ignored); on an instance plus
        ``router_aux_loss_coef · aux_loss()`` of the forward that produced ``logits``."""
        ce = next_token_loss(self.lm_head if self is not None else None, logits, labels)
        if self is None or self.router_aux_loss_coef == 0 or not (self.router_logits() or self.balance.staged):
            return ce
        return ce + self.router_aux_loss_coef * self.aux_loss()

    def _expert_numel(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.ffn_hidden_size

    def num_parameters(self, exclude_embeddings: bool = False, active_only: bool = False) -> int:
        """Distinct parameters of the full model (a tied embedding counts once). Every layer counts all
        ``num_experts`` experts even when expert parallelism holds only a slice here; ``active_only``
        counts ``top_k`` experts per layer instead (the weights one token uses). ``exclude_embeddings``
        drops the input embedding table unless it is tied."""
        expert_params = {id(p) for b in self.moe_blocks() for p in b.experts.parameters()}
        total = sum(p.numel() for p in self.parameters() if id(p) not in expert_params)
        total += self.cfg.num_layers * (self.top_k if active_only else self.num_experts) * self._expert_numel()
        if exclude_embeddings and not self.tied:
            total -= self.embed_tokens.weight.numel()
        return total

"""Layer specs for the ViT encoder: ``te`` (megatron-core's Transformer Engine modules) and
``torch`` (plain PyTorch through megatron-core's own parallel linears; runs on CPU).

Both specs give every layer the same parameter names and shapes: the layer norms live inside
the QKV and FC1 linears (``layer_norm_weight`` / ``layer_norm_bias``), as TE fuses them, so a
state dict moves between the two unchanged (TE adds only ``_extra_state`` entries).

With ``fused_norm`` the layer is ``ResidualNormLayer``: each residual add runs inside the
LayerNorm that reads it (vitgraph.models.fused_norm); the linears keep the norms' parameters
under the same names and leave the normalising to the layer.

Stochastic depth (``drop_path_rate``, DeiT): a layer of global number ``i`` of ``L`` drops
each sample's attention and MLP branches with probability ``rate * (i - 1) / (L - 1)``
(timm's ``linspace(0, rate, L)``), survivors scaled by ``1 / (1 - p)``; ``DropPathLayer``
(megatron's layer whose bias-dropout-adds apply the mask) or ``ResidualNormLayer``. No
parameters change.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import get_pg_rank

from vitgraph.models import packed as pk
from vitgraph.models.fused_act import bias_act
from vitgraph.models.fused_norm import add, add_layer_norm, layer_norm

SPECS = ("te", "torch")
CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


def resolve_spec(name: str) -> str:
    if name == "auto":
        if not torch.cuda.is_available():
            return "torch"
        if te_available():
            return "te"
        _say_no_te()
        return "torch"
    return name


@functools.cache
def _say_no_te() -> None:
    """The one line that stands for megatron-core's TE / Apex warnings (filtered in
    vitgraph/__init__.py): on a GPU the torch spec is the slower one."""
    logging.getLogger("vitgraph").warning(
        "model.spec=auto: Transformer Engine is not installed, so the torch spec runs (slower "
        "on a GPU; pip install -e .[te], or the Docker image)")


def _add_norm_params(linear, input_size: int, config) -> None:
    """The LayerNorm parameters before ``linear``, under TE's names (``normalize``: whether the
    linear applies the norm itself; ResidualNormLayer turns it off and normalises for it)."""
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    linear.eps = config.layernorm_epsilon
    linear.normalize = True
    linear.layer_norm_weight = torch.nn.Parameter(
        torch.ones(input_size, dtype=config.params_dtype, device=device))
    linear.layer_norm_bias = torch.nn.Parameter(
        torch.zeros(input_size, dtype=config.params_dtype, device=device))
    for p in (linear.layer_norm_weight, linear.layer_norm_bias):
        # replicated across tensor-parallel ranks, like TE's; under sequence parallelism each
        # rank's gradient is partial and megatron sums those carrying this flag
        setattr(p, "sequence_parallel", config.sequence_parallel)


def _norm(linear, x: torch.Tensor) -> torch.Tensor:
    if not linear.normalize:
        return x
    return F.layer_norm(x, (x.shape[-1],), linear.layer_norm_weight, linear.layer_norm_bias,
                        linear.eps)


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """LayerNorm followed by megatron's ColumnParallelLinear, with TE's parameter names."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        _add_norm_params(self, input_size, config)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        return super().forward(_norm(self, input_), weight=weight,
                               runtime_gather_output=runtime_gather_output)


@functools.cache
def _te_column_parallel_with_norm_params():
    """megatron's TE column-parallel linear holding the LayerNorm parameters before it, named
    as in TE's LayerNormLinear, for ResidualNormLayer (bf16: TE's LayerNormLinear runs its norm
    as a separate kernel there too; FP8 keeps LayerNormLinear, whose norm writes FP8)."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    class TENormColumnParallelLinear(TEColumnParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            _add_norm_params(self, input_size, config)

        def forward(self, x):
            return super().forward(_norm(self, x))

    return TENormColumnParallelLinear


def drop_path_rates(rate: float, num_layers: int) -> list[float]:
    """DeiT / timm's stochastic depth: layer i (0-based, global) of ``num_layers`` drops with
    probability ``rate * i / (num_layers - 1)``; the first never does, the last ``rate``."""
    if num_layers <= 1:
        return [0.0] * num_layers
    return [rate * i / (num_layers - 1) for i in range(num_layers)]


def _mask_rng(config, device: torch.device):
    """Where the drop-path draws come from: a stream that is the same on every tensor-parallel
    rank, so that a sample is dropped or kept on all the ranks holding its tokens. That is
    torch's default generator (seeded alike on the tp ranks: vitgraph.parallel.setup), except
    on CUDA under sequence parallelism, where megatron's TransformerBlock has forked its
    model-parallel stream (distinct per tp rank) into it: there megatron's tracker's
    data-parallel stream, the same on the tp ranks and graph-safe as the tracker is. Under
    CUDA graphs both are registered with each graph (vitgraph.graphs.backend)."""
    if device.type != "cuda" or not config.sequence_parallel:
        return contextlib.nullcontext()
    return tensor_parallel.get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name())


class _DropPath:
    """Stochastic depth for a TransformerLayer: ``drop_path`` is the layer's rate, by its
    global ``layer_number`` (megatron adds the pipeline / virtual-stage offset)."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, drop_path_rate: float = 0.0):
        super().__init__(config, submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        self.drop_path = (drop_path_rates(drop_path_rate, self.config.num_layers)
                          [self.layer_number - 1] if drop_path_rate else 0.0)

    def _draw_keep(self, hidden: torch.Tensor, packed_seq_params=None):
        """None (eval, or a rate of 0), else the factors of the attention and the MLP branch,
        ``keep[0]`` and ``keep[1]``: 0 or 1 / (1 - p) per sample, broadcasting over the
        branch's output. A sample is a batch column of [s, b, h]; in a packed sequence
        ([t, 1, h], ``thd``) an image: one draw per segment of ``cu_seqlens``, spread over
        its tokens (under sequence parallelism this rank's t tokens start at rank x t)."""
        if not (self.training and self.drop_path):
            return None
        survive = 1.0 - self.drop_path
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        kw = dict(device=hidden.device, dtype=hidden.dtype)
        if thd:
            cu = packed_seq_params.cu_seqlens_q
            segments = cu.numel() - 1
        with _mask_rng(self.config, hidden.device):
            shape = (2, segments) if thd else (2, 1, hidden.shape[1], 1)
            keep = torch.empty(shape, **kw).bernoulli_(survive)
        keep.div_(survive)
        if not thd:
            return keep
        t = hidden.shape[0]
        start = get_pg_rank(self.tp_group) * t if self.config.sequence_parallel else 0
        pos = torch.arange(start, start + t, device=cu.device, dtype=cu.dtype)
        seg = torch.searchsorted(cu[1:].contiguous(), pos, right=True).clamp_(max=segments - 1)
        return keep[:, seg].view(2, t, 1, 1)


class DropPathLayer(_DropPath, TransformerLayer):
    """megatron's TransformerLayer with stochastic depth (``drop_path_rate``: the rate of the
    model's last layer; see ``drop_path_rates``). The masks are drawn once per forward, then
    each bias-dropout-add computes ``residual + keep * dropout(x + bias)``; in eval mode, or
    in a layer of rate 0 (the first), it is megatron's own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._keep = None
        if self.drop_path:
            self.self_attn_bda = functools.partial(self._bda, 0)
            self.mlp_bda = functools.partial(self._bda, 1)

    def _bda(self, branch: int, training: bool, fused: bool):
        plain = get_bias_dropout_add(training, fused)

        def bias_dropout_drop_path_add(x_with_bias, residual, prob):
            keep = self._keep
            if keep is None:
                return plain(x_with_bias, residual, prob)
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = F.dropout(x, p=prob, training=training)
            return residual.to(x.dtype) + x * keep[branch]

        return bias_dropout_drop_path_add

    def forward(self, *args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self._keep = self._draw_keep(hidden, kwargs.get("packed_seq_params"))
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._keep = None


# the attention arguments megatron's TransformerBlock passes a layer that ResidualNormLayer
# hands on (the rest are for cross attention, which it does not do); the inference context
# holds a KV cache (CaptionModel.generate)
_ATTENTION_KWARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "attention_bias",
                     "packed_seq_params", "sequence_len_offset", "inference_context")


class ResidualNormLayer(_DropPath, TransformerLayer):
    """megatron's pre-norm TransformerLayer with every residual add inside the LayerNorm that
    reads it: ``s = residual + x (+ bias)`` and ``LN(s)`` as one kernel each way
    (vitgraph.models.fused_norm), which also sums the bias gradient of the projection before.

    The MLP's add belongs to the next layer's first norm, so between layers the residual
    stream travels unsummed: a layer returns ``(s, (mlp_output, fc2_bias, keep))`` as
    megatron's ``(hidden_states, context)`` pair, which TransformerBlock hands to the next layer
    (a ViT has no cross-attention context), and the next layer's kernel adds both and sums
    fc2's bias gradient too. The last layer of a block (of a pipeline stage) returns the sum
    and ``None``, so what leaves a block is what megatron's layer returns. Hidden dropout, when
    set, drops ``x + bias`` before the add, as megatron's bias-dropout-add; stochastic depth
    (``drop_path_rate``, as DropPathLayer) then scales it by the sample's keep factor, inside
    the add's kernel (``keep``: None at a rate of 0 or in eval).
    """

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, drop_path_rate: float = 0.0):
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection,
                         vp_stage, drop_path_rate)
        self.norms = (self.self_attention.linear_qkv, self.mlp.linear_fc1)
        for linear in self.norms:
            linear.normalize = False
        # layer_number is this layer's place in its block (1-based); the block builds this many
        built = get_num_layers_to_build(config, vp_stage=vp_stage,
                                        pp_rank=get_pg_rank(self.pg_collection.pp))
        self.closes_stream = layer_number == built

    def _dropped(self, x: torch.Tensor, bias, keep=None):
        """The branch ``(x, bias)`` after hidden dropout, and its stochastic-depth factor
        (``keep``) for the add that takes it: the factor is applied there, inside the fused
        kernels, unless dropout ran first (then here)."""
        if self.hidden_dropout and self.training:
            x, bias = F.dropout(x if bias is None else x + bias, self.hidden_dropout), None
            if keep is not None:
                x, keep = x * keep, None
        return x, bias, keep

    def forward(self, hidden_states, attention_mask=None, context=None, **kwargs):
        attn_norm, mlp_norm = self.norms
        eps = self.config.layernorm_epsilon
        keep = self._draw_keep(hidden_states, kwargs.get("packed_seq_params"))
        if context is None:  # the block's first layer: the stream arrives summed
            residual = hidden_states
            normed = layer_norm(residual, attn_norm.layer_norm_weight, attn_norm.layer_norm_bias,
                                eps)
        else:
            out, bias, scale = context
            residual, normed = add_layer_norm(out, hidden_states, bias,
                                              attn_norm.layer_norm_weight,
                                              attn_norm.layer_norm_bias, eps, keep=scale)
        out, bias = self.self_attention(
            normed, attention_mask=attention_mask,
            **{k: kwargs[k] for k in _ATTENTION_KWARGS if k in kwargs})
        out, bias, scale = self._dropped(out, bias, None if keep is None else keep[0])
        residual, normed = add_layer_norm(out, residual, bias, mlp_norm.layer_norm_weight,
                                          mlp_norm.layer_norm_bias, eps, keep=scale)
        # train.recompute=selective with mlp: megatron's TransformerLayer checkpoints its MLP
        # in the forward this class replaces, so it is done here the same way
        mlp = self.mlp(normed) if not self.recompute_mlp else \
            tensor_parallel.checkpoint(self.mlp, False, normed)
        out, bias, scale = self._dropped(*mlp, None if keep is None else keep[1])
        if self.closes_stream:
            return add(out, residual, bias, keep=scale), None
        # the bias as a tensor of this layer's making: a layer's CUDA graph outputs its own
        # buffers, not a parameter; the factor travels with the branch to the next layer's add
        return residual, (out, None if bias is None else bias.clone(), scale)


class SDPAttention(MegatronModule):
    """Core attention through ``F.scaled_dot_product_attention``: bidirectional for a ViT,
    causal for a text tower (``AttnMaskType.causal``).

    megatron-core 0.16.1's local ViT spec masks causally, which is wrong for a ViT; this is the
    drop-in core attention for the ``torch`` spec: [s, b, heads, d] in, [s, b, heads * d] out.
    With a padding mask ([b, 1, 1, s], True = masked key, megatron's convention) padded keys
    are left out; with a causal mask type a query sees only itself and earlier positions (the
    type megatron passes at the call decides: no_mask at a KV cache's decode steps; fewer
    queries than keys are the last positions).
    With ``packed_seq_params`` in the ``thd`` format (packed images, vitgraph.models.vit)
    the query arrives squeezed, [t, heads, d], and attends only within its own segment of
    ``cu_seqlens_q`` (and, causal, to the tokens before it there: a packed language model):
    in slots (``PackedSelfAttention``) without a mask, else by a block-diagonal mask (the
    reference for TE's thd attention).
    """

    def takes_slots(self, head_dim: int) -> bool:
        return True

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        assert attn_mask_type in MASKS.values(), attn_mask_type
        self.causal = attn_mask_type in CAUSAL
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        slots = getattr(packed_seq_params, "slots", None)
        # the mask type megatron passes: at a KV cache's decode steps it is no_mask
        causal = self.causal if attn_mask_type is None else attn_mask_type in CAUSAL
        if slots is not None:  # rows in slot order (PackedSelfAttention)
            out = pk.slot_attention(query, key, value, slots,
                                    self.dropout if self.training else 0.0, self.softmax_scale,
                                    causal)
            return out.reshape(out.shape[0], -1)
        if thd:  # [t, h, d]: one sequence of segments
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        keep = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        if thd:
            cu = packed_seq_params.cu_seqlens_q
            if packed_seq_params.cu_seqlens_kv is not cu:  # no host read to compare them
                raise NotImplementedError("packed self-attention takes one cu_seqlens tensor")
            blocks = pk.block_diagonal(cu, q.shape[2])
            keep = blocks if keep is None else keep & blocks
        s_q, s_k = q.shape[2], k.shape[2]
        if causal and (keep is not None or s_q != s_k):
            # SDPA takes a mask or is_causal, and its is_causal aligns the queries with the
            # first keys; a KV cache's queries are the last ones
            tri = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
            keep, causal = tri if keep is None else keep & tri, False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        s, b = query.shape[0], query.shape[1]
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        return out[:, 0] if thd else out


class _QuietUnknownMLP(logging.Filter):
    """megatron-core 0.16.1's TransformerLayer warns once per layer that it does not know an
    MLP spec whose module is not ``MLP`` itself (and names the spec's type, not the module's).
    ``BiasActMLP`` is an ``MLP``, which takes its tensor-parallel group from megatron's state
    when none is passed: the warning says nothing here, 24 times for a ViT-L."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietUnknownMLP())


class BiasActMLP(MLP):
    """megatron's MLP with fc1's bias and the activation as one kernel each way
    (``vitgraph.models.fused_act``): fc1 returns its bias, as megatron builds it."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or self.config.gated_linear_unit:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        out, fc2_bias = self.linear_fc2(bias_act(intermediate, bias, self.activation_func))
        # megatron's row-parallel linear returns its bias parameter itself; out of a
        # checkpoint (train.recompute_modules: mlp) autograd would make the parameter an output
        # of the checkpoint node, and each recompute's backward would re-enter it without end
        return out, None if fc2_bias is None else fc2_bias.view_as(fc2_bias)


def _layer_spec(qkv, core_attention, proj, fc1, fc2, mask: AttnMaskType,
                layer=TransformerLayer) -> ModuleSpec:
    return ModuleSpec(
        module=layer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,  # fused into linear_qkv
            self_attention=ModuleSpec(
                module=PackedSelfAttention,
                params={"attn_mask_type": mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=qkv, core_attention=core_attention, linear_proj=proj),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,  # fused into linear_fc1
            mlp=ModuleSpec(module=BiasActMLP,
                           submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _split_qkv_without_copy() -> None:
    """megatron-core 0.16.1 imports TE's split-without-copy of the fused QKV output under a
    name TE 2.20 no longer has and falls back to ``torch.split``, whose backward concatenates
    dq, dk and dv: a copy of three activations per layer, 16 ms of a ViT-L step at mb 256 on an
    H200. TE keeps the function in ``transformer_engine.pytorch.utils``: give it to megatron.
    Its backward returns TE attention's packed gradient as it is."""
    import megatron.core.transformer.attention as attention
    if getattr(attention, "SplitAlongDim", None) is not None:
        return
    try:
        from transformer_engine.pytorch.utils import SplitAlongDim
    except ImportError:
        return
    attention.SplitAlongDim = SplitAlongDim.apply


@functools.cache
def _te_row_parallel_with_bias_in_gemm():
    """megatron's TE row-parallel linear adding its bias inside the GEMM (its gradient comes
    from the backward GEMMs) instead of returning it for a bias-dropout-add, which with that
    fusion off (see vitgraph.models.build) is a separate broadcast add over the
    activations. For linear_proj and linear_fc2; fc1's bias goes with the activation."""
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    class TERowParallelLinearBias(TERowParallelLinear):
        def __init__(self, *args, skip_bias_add: bool = False, **kwargs):
            super().__init__(*args, skip_bias_add=False, **kwargs)
            if self.tp_size == 1:
                # TE adds a row-parallel bias after the tensor-parallel reduction, outside
                # the GEMM; with no reduction the GEMM can add it
                self.gemm_bias_unfused_add = False

    return TERowParallelLinearBias


# head dims at which TE's thd (ragged) attention runs at the speed of its padded layout: at
# 72, 80 and 88 cuDNN 9.19's ragged backward spends 2.5 ms in its dO.O kernel (compute_dot_do_o)
# where 64 and 128 fuse it (fwd + bwd over 16,384 tokens, 16 heads: 3.4 ms at 72, 0.9 at 64,
# 1.2 at 128; slots of 257 at 72: 0.7 ms; H200, TE 2.20.2)
THD_HEAD_DIMS = (64, 128)


@functools.cache
def _te_slot_attention():
    """megatron's TE core attention that takes a pack at head dims outside THD_HEAD_DIMS in
    the slot layout (``PackedSelfAttention``): TE's padded (bshd) attention over the slots
    with the images' lengths, the tokens taken back. Padding runs are not computed (their
    tokens get zeros)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TESlotAttention(TEDotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs):
            super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
            self.masks_causally = attn_mask_type in CAUSAL

        def takes_slots(self, head_dim: int) -> bool:
            # a causal (language model) pack stays thd: megatron makes its mask padding_causal
            return head_dim not in THD_HEAD_DIMS and not self.masks_causally

        def forward(self, query, key, value, attention_mask, attn_mask_type,
                    attention_bias=None, packed_seq_params=None, num_splits=None):
            slots = getattr(packed_seq_params, "slots", None)
            if slots is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias, packed_seq_params, num_splits)
            S, L = slots.rows, slots.max_len
            cu = packed_seq_params.cu_seqlens_q[:S + 1]
            q, k, v = (t.view(S, L, *t.shape[1:]) for t in (query, key, value))
            out = super(TEDotProductAttention, self).forward(
                q, k, v, None, qkv_format="bshd", attn_mask_type="padding", cu_seqlens_q=cu,
                cu_seqlens_kv=cu, max_seqlen_q=L, max_seqlen_kv=L)
            return slots.scatter(out.view(S * L, -1))  # [T, h d], as TE's thd output

    return TESlotAttention


class PackedSelfAttention(SelfAttention):
    """megatron's self-attention that hands a pack (thd) to a core attention that asks for it
    (``takes_slots(head_dim)``) in the slot layout (vitgraph.models.packed.Slots): the QKV
    projection's rows gathered once into slot order, so query, key and value (and their
    gradient, one buffer) stay views of one tensor, and the output taken back to the tokens
    by the core attention. One gather each way instead of one per tensor (each with a copy
    of the strided view) and a concatenation of dq, dk, dv in the backward. Fixed shapes, no
    host read: one CUDA graph serves every pack."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = None
        self.linear_qkv.register_forward_hook(self._qkv_in_slot_order)

    def _qkv_in_slot_order(self, module, args, out):
        if self._slots is None:
            return out
        mixed, bias = out
        return self._slots.gather(mixed), bias

    # tensors from tensors, no host state: a graph's capture records it whole (the graph
    # manager's warning about hooks that run at capture only leaves it out)
    _qkv_in_slot_order.graph_safe = True

    def forward(self, hidden_states, *args, packed_seq_params=None, **kwargs):
        p = packed_seq_params
        takes = getattr(self.core_attention, "takes_slots", None)
        if (p is None or p.qkv_format != "thd" or takes is None
                or not takes(self.hidden_size_per_attention_head)):
            return super().forward(hidden_states, *args, packed_seq_params=p, **kwargs)
        if p.cu_seqlens_kv is not p.cu_seqlens_q:  # no host read to compare them
            raise NotImplementedError("packed self-attention takes one cu_seqlens tensor")
        tokens = hidden_states.shape[0]
        if self.config.sequence_parallel:  # the QKV projection gathers the sequence
            tokens *= self.config.tensor_model_parallel_size
        p = copy.copy(p)
        p.slots = pk.segment_slots(p.cu_seqlens_q, tokens, int(p.max_seqlen_q),
                                   getattr(p, "image_segments", None))
        self._slots = p.slots
        try:
            return super().forward(hidden_states, *args, packed_seq_params=p, **kwargs)
        finally:
            self._slots = None


# (padding_mask, causal) -> megatron's mask type
MASKS = {(False, False): AttnMaskType.no_mask, (True, False): AttnMaskType.padding,
         (False, True): AttnMaskType.causal, (True, True): AttnMaskType.padding_causal}


def get_layer_spec(name: str, padding_mask: bool = False, causal: bool = False,
                   fused_norm: bool = False, drop_path_rate: float = 0.0) -> ModuleSpec:
    """The layer spec; ``padding_mask``: attention takes a key-padding mask (token padding,
    see vitgraph.models.vit); ``causal``: each token attends only to itself and earlier ones
    (a CLIP text tower); neither: no mask at all (a ViT). ``fused_norm``: ResidualNormLayer
    (not for FP8, whose TE norms write FP8 for the GEMM after them). ``drop_path_rate``:
    stochastic depth, the last layer's rate (0: the spec as without it)."""
    spec = _base_layer_spec(name, padding_mask, causal, fused_norm)
    if drop_path_rate:
        if spec.module is TransformerLayer:
            spec.module = DropPathLayer
        spec.params = {**spec.params, "drop_path_rate": float(drop_path_rate)}
    return spec


def _base_layer_spec(name: str, padding_mask: bool, causal: bool,
                     fused_norm: bool) -> ModuleSpec:
    mask = MASKS[(bool(padding_mask), bool(causal))]
    if name == "te":
        # megatron-core's TE ViT spec: no mask, layer norms fused into the linears; the
        # biases of the projection and fc2 added inside their GEMMs
        from megatron.core.models.vision.vit_layer_specs import (
            get_vit_layer_with_transformer_engine_spec)
        _split_qkv_without_copy()
        spec = copy.deepcopy(get_vit_layer_with_transformer_engine_spec())
        spec.submodules.self_attention.module = PackedSelfAttention
        spec.submodules.self_attention.params["attn_mask_type"] = mask
        row = _te_row_parallel_with_bias_in_gemm()
        attention = spec.submodules.self_attention.submodules
        attention.linear_proj = row
        attention.core_attention = _te_slot_attention()
        spec.submodules.mlp.module = BiasActMLP  # fc1 (TE's, LN fused) returns its bias
        spec.submodules.mlp.submodules.linear_fc2 = row
        if fused_norm:
            # the projection and fc2 return their biases to the fused adds, whose kernels sum
            # their gradients (megatron's MLP and attention build them with skip_bias_add)
            from megatron.core.extensions.transformer_engine import TERowParallelLinear
            spec.module = ResidualNormLayer
            attention.linear_qkv = _te_column_parallel_with_norm_params()
            attention.linear_proj = TERowParallelLinear
            spec.submodules.mlp.submodules.linear_fc1 = _te_column_parallel_with_norm_params()
            spec.submodules.mlp.submodules.linear_fc2 = TERowParallelLinear
        return spec
    if name == "torch":
        return _layer_spec(LayerNormColumnParallelLinear, SDPAttention, RowParallelLinear,
                           LayerNormColumnParallelLinear, RowParallelLinear, mask,
                           layer=ResidualNormLayer if fused_norm else TransformerLayer)
    raise ValueError(f"unknown layer spec {name!r}; known: {', '.join(SPECS)}")


class TorchLayerNorm(torch.nn.LayerNorm):
    """A transformer block's final LayerNorm in the torch spec: megatron's ``WrappedTorchNorm``
    (torch's LayerNorm, the same parameters), which refuses sequence parallel, made to run
    under it: the parameters are replicated, each rank's gradient partial, and the
    ``sequence_parallel`` flag has them summed over tp (as megatron's TE and Apex norms)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        for p in (self.weight, self.bias):
            setattr(p, "sequence_parallel", config.sequence_parallel)


def block_spec(name: str, config, causal: bool = False) -> TransformerBlockSubmodules:
    """A whole TransformerBlock's spec (a GPTModel's decoder): this pipeline stage's layers
    (megatron's split of ``config.num_layers``) of ``get_layer_spec(name, causal=causal)``
    and the final norm: TE's for te, ``TorchLayerNorm`` for torch."""
    if name == "te":
        from megatron.core.extensions.transformer_engine import TENorm
        norm = TENorm
    else:
        norm = TorchLayerNorm
    return TransformerBlockSubmodules(
        layer_specs=[get_layer_spec(name, causal=causal)] * get_num_layers_to_build(config),
        layer_norm=norm)

"""Layer specs for the ViT encoder: ``te`` (megatron-core's Transformer Engine modules) and
``torch`` (plain PyTorch through megatron-core's own parallel linears; runs on CPU).

Both specs give every layer the same parameter names and shapes: the layer norms live inside
the QKV and FC1 linears (``layer_norm_weight`` / ``layer_norm_bias``), as TE fuses them, so a
state dict moves between the two unchanged (TE adds only ``_extra_state`` entries).
"""
from __future__ import annotations

import copy
import functools
import logging

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from vitgraph.models.fused_act import bias_act

SPECS = ("te", "torch")


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


def resolve_spec(name: str) -> str:
    if name == "auto":
        return "te" if torch.cuda.is_available() and te_available() else "torch"
    return name


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """LayerNorm followed by megatron's ColumnParallelLinear, with TE's parameter names."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype, device=device))
        self.layer_norm_bias = torch.nn.Parameter(
            torch.zeros(input_size, dtype=config.params_dtype, device=device))
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            # replicated across tensor-parallel ranks, like TE's; grads are identical there
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        x = F.layer_norm(input_, (input_.shape[-1],), self.layer_norm_weight,
                         self.layer_norm_bias, self.eps)
        return super().forward(x, weight=weight, runtime_gather_output=runtime_gather_output)


class SDPAttention(MegatronModule):
    """Core attention through ``F.scaled_dot_product_attention``: bidirectional for a ViT,
    causal for a text tower (``AttnMaskType.causal``).

    megatron-core 0.16.1's local ViT spec masks causally, which is wrong for a ViT; this is the
    drop-in core attention for the ``torch`` spec: [s, b, heads, d] in, [s, b, heads * d] out.
    With a padding mask ([b, 1, 1, s], True = masked key, megatron's convention) padded keys
    are left out; with a causal mask type a query sees only itself and earlier positions.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        assert attn_mask_type in MASKS.values(), attn_mask_type
        self.causal = attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        keep = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        causal = self.causal
        if causal and keep is not None:  # SDPA takes one or the other: merge them
            s_q, s_k = q.shape[2], k.shape[2]
            keep = keep & torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            causal = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


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
        return self.linear_fc2(bias_act(intermediate, bias, self.activation_func))


def _layer_spec(qkv, core_attention, proj, fc1, fc2, mask: AttnMaskType) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,  # fused into linear_qkv
            self_attention=ModuleSpec(
                module=SelfAttention,
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
    fusion off (see vitgraph.parallel.setup) is a separate broadcast add over the
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


# (padding_mask, causal) -> megatron's mask type
MASKS = {(False, False): AttnMaskType.no_mask, (True, False): AttnMaskType.padding,
         (False, True): AttnMaskType.causal, (True, True): AttnMaskType.padding_causal}


def get_layer_spec(name: str, padding_mask: bool = False, causal: bool = False) -> ModuleSpec:
    """The layer spec; ``padding_mask``: attention takes a key-padding mask (token padding,
    see vitgraph.models.vit); ``causal``: each token attends only to itself and earlier ones
    (a CLIP text tower); neither: no mask at all (a ViT)."""
    mask = MASKS[(bool(padding_mask), bool(causal))]
    if name == "te":
        # megatron-core's TE ViT spec: no mask, layer norms fused into the linears; the
        # biases of the projection and fc2 added inside their GEMMs
        from megatron.core.models.vision.vit_layer_specs import (
            get_vit_layer_with_transformer_engine_spec)
        _split_qkv_without_copy()
        spec = copy.deepcopy(get_vit_layer_with_transformer_engine_spec())
        spec.submodules.self_attention.params["attn_mask_type"] = mask
        row = _te_row_parallel_with_bias_in_gemm()
        spec.submodules.self_attention.submodules.linear_proj = row
        spec.submodules.mlp.module = BiasActMLP  # fc1 (TE's, LN fused) returns its bias
        spec.submodules.mlp.submodules.linear_fc2 = row
        return spec
    if name == "torch":
        return _layer_spec(LayerNormColumnParallelLinear, SDPAttention, RowParallelLinear,
                           LayerNormColumnParallelLinear, RowParallelLinear, mask)
    raise ValueError(f"unknown layer spec {name!r}; known: {', '.join(SPECS)}")

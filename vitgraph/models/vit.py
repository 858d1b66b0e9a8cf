"""The ViT encoder on megatron-core: patch embedding, class / register tokens, learned position
embeddings, a ``TransformerBlock`` of the chosen layer spec, final norm, classification head.

Pipeline-stage aware: ``pre_process`` stages own the embedding, ``post_process`` stages the norm
and head, every stage (or virtual stage, ``vp_stage``) its share of the layers. The model knows
nothing of data parallelism or graphs; those are applied from outside (vitgraph.parallel.setup).

Token padding (``pad_to``): sequence parallel splits the tokens over the tensor-parallel ranks
and FP8 GEMMs need the token count to be a multiple of 16, so the sequence can be padded with
zero tokens at its end. Padded tokens are masked out as attention keys (a padding mask, True =
masked, as megatron and TE take it), so real tokens never see them; they pass through the
per-token MLPs and norms harmlessly and are dropped before the final norm. The class token and
the mean pool therefore see exactly what an unpadded model computes.

The same class is the image tower of CLIP (vitgraph.models.clip): ``ln_pre`` adds a LayerNorm
after the embedding (OpenAI CLIP / open_clip), ``head="proj"`` replaces the classifier by a
bias-free projection to the embedding width (``proj``), and ``patch_bias=False`` drops the patch
embedding's bias as OpenAI CLIP does; ``head="map"`` pools the patch tokens by attention to a
learned query (SigLIP's multihead attention pooling, ``attn_pool``) and returns the width
itself; ``head="none"`` stops at the final norm (a VLM's tower reads ``forward_features``'
tokens, vitgraph.models.caption). CLIP's ``ln_post`` is ``final_norm``: it normalises every
token before pooling, which for the class token is the same as normalising the pooled token.
The defaults build the classifier unchanged.

DeiT's distillation token (``distill_token``): a second prefix token after the class token
(then the registers) with its own classifier, ``head_dist``; the output is then both heads'
logits, [b, 2, classes] (class head first), which the classification task splits or averages.

Native resolution (``pack``, a vitgraph.data.packing.PackSpec): the input is one pack,
``(x, coords, seg, cu_seqlens)`` (x [T, 3 p^2] normalised patch rows, the rest as the pack
layout), and the output one row per image slot, [M, classes | embed_dim | d]. The same
parameters as the fixed path: patch rows through the convolution's weight as a linear, the
learned position grid resampled per token (vitgraph.models.packed), prefix tokens from the
class token / register parameters and their position entries. The hidden states [T, 1, d]
go through the TransformerBlock as one ``thd`` sequence (megatron's PackedSeqParams: TE's
attention keeps the images apart by ``cu_seqlens``, the torch spec's SDPAttention by a
block-diagonal mask); a padded spec (``pack.padded``, data.packing.layout=padded) instead runs
M slots of max_len tokens as a dense [max_len, M, d] batch with a key-padding mask
(``packed_attention`` "padded", else "thd"). Every stage takes the
pack's fields, a later pipeline stage [T (/ tp with sequence parallel), 1, d] from the one
before it; pooling is per slot by ``seg``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from vitgraph.models import packed as pk
from vitgraph.models.fused_norm import LayerNorm
from vitgraph.models.registry import ViTArch


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ViT inside megatron's DDP / Float16Module wrappers."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def sequence_length(arch, class_token: bool = True, num_registers: int = 0,
                    distill_token: bool = False) -> int:
    """Tokens a ViT of ``arch`` runs on per image (class and distillation tokens, registers,
    patches), before any padding."""
    return int(class_token) + int(distill_token) + num_registers + arch.num_patches()


class ViT(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec, arch: ViTArch,
                 num_classes: int, *, num_registers: int = 0, class_token: bool = True,
                 pool: str = "cls", pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, pad_to=None, ln_pre: bool = False,
                 head: str = "classifier", embed_dim: int | None = None,
                 patch_bias: bool = True, pack=None, pos_interp: str = "bicubic",
                 distill_token: bool = False):
        super().__init__(config=config)
        _check_head(head, pool, embed_dim, class_token, distill_token)
        # read by megatron's Float16Module to find the first / last virtual stage: without it
        # the first chunk's input stayed fp32 under interleaving and its bf16 conv failed
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        # micro-batch -> multiple to pad the token count to (None: never pad); see the docstring
        self.pad_to = pad_to
        self.seq_len = sequence_length(arch, class_token, num_registers, distill_token)
        self.arch = arch
        self.pre_process, self.post_process = pre_process, post_process
        self.num_prefix = int(class_token) + int(distill_token) + num_registers
        self.class_token, self.num_registers = class_token, num_registers
        self.distill_token = distill_token
        # what pool() reads: map (attention pooling; pool=map puts a classifier on it) |
        # distill (the class and distillation tokens) | cls (the class token) | mean (patches)
        self.global_pool = ("map" if head == "map" or pool == "map" else
                            "distill" if distill_token else
                            "cls" if pool == "cls" and class_token else "mean")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = dict(device=device, dtype=config.params_dtype)
        # the optional parts, None where this configuration or pipeline stage has none
        self.patch_embed = self.cls_token = self.dist_token = self.registers = None
        self.pos_embed = self.ln_pre = self.final_norm = None
        self.attn_pool = self.proj = self.head = self.head_dist = None
        if pre_process:
            self._make_embedding(patch_bias, ln_pre, kw)
        self.decoder = TransformerBlock(config, layer_spec, post_layer_norm=False,
                                        pre_process=pre_process, post_process=post_process,
                                        vp_stage=vp_stage)
        if post_process:
            self._make_head(head, num_classes, embed_dim, kw)
        self.pack = None
        if pack is not None:
            self.use_pack(pack, pos_interp)

    def _make_embedding(self, patch_bias: bool, ln_pre: bool, kw: dict) -> None:
        """The first stage's parts: patch embedding, prefix tokens, positions, ln_pre."""
        arch, d = self.arch, self.arch.hidden_size
        self.patch_embed = torch.nn.Conv2d(3, d, arch.patch_size, arch.patch_size,
                                           bias=patch_bias, **kw)
        if self.class_token:
            self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, d, **kw))
        if self.distill_token:
            self.dist_token = torch.nn.Parameter(torch.zeros(1, 1, d, **kw))
        if self.num_registers:
            self.registers = torch.nn.Parameter(torch.zeros(1, self.num_registers, d, **kw))
        self.pos_embed = torch.nn.Parameter(torch.empty(
            1, self.num_prefix + arch.num_patches(), d, **kw))
        torch.nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for p in self._prefix_params():
            torch.nn.init.trunc_normal_(p, std=0.02)
        if ln_pre:
            self.ln_pre = LayerNorm(d, eps=self.config.layernorm_epsilon, **kw)

    def _make_head(self, head: str, num_classes: int, embed_dim: int | None, kw: dict) -> None:
        """The last stage's parts: final norm, attention pooling, projection or classifier."""
        d = self.arch.hidden_size
        # vitgraph.models.fused_norm's kernels: torch's LayerNorm backward spends 245 us in its
        # weight-gradient kernel alone here (ViT-L, mb 256, an H200)
        self.final_norm = LayerNorm(d, eps=self.config.layernorm_epsilon, **kw)
        if self.global_pool == "map":
            self.attn_pool = AttentionPool(d, self.arch.num_heads, self.arch.ffn_hidden_size,
                                           self.config, **kw)
        if head == "proj":
            self.proj = torch.nn.Linear(d, embed_dim, bias=False, **kw)
            torch.nn.init.normal_(self.proj.weight, std=d ** -0.5)
        elif head == "classifier":
            self.head = torch.nn.Linear(d, num_classes, **kw)
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)
            if self.distill_token:
                self.head_dist = torch.nn.Linear(d, num_classes, **kw)
                torch.nn.init.zeros_(self.head_dist.weight)
                torch.nn.init.zeros_(self.head_dist.bias)

    def use_pack(self, pack, pos_interp: str = "bicubic") -> None:
        """Take packs of ``pack`` (a PackSpec) from now on (see the module docstring); the
        layers' mask type must suit it: none for a pack (thd), padding for padded slots."""
        if self.distill_token:
            raise ValueError("packs carry one class token an image: no distillation token")
        if pack.num_prefix != self.num_prefix or pack.patch_size != self.arch.patch_size:
            raise ValueError(f"a pack of {pack.num_prefix} prefix tokens and patch "
                             f"{pack.patch_size} for a ViT of {self.num_prefix} and "
                             f"{self.arch.patch_size}")
        if pos_interp not in pk.POS_INTERP:
            raise ValueError(f"pos_interp {pos_interp!r}: {' | '.join(pk.POS_INTERP)}")
        attention = "padded" if pack.padded else "thd"
        sp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        split = pack.max_len if pack.padded else pack.tokens
        if split % sp:
            raise ValueError(f"sequence parallel splits {split} tokens over {sp} ranks")
        self.pack, self.packed_attention, self.pos_interp = pack, attention, pos_interp
        self.pack_len = pack.tokens
        self.pad_to = None  # a pack is its own fixed length

    def _prefix_params(self):
        return [p for p in (self.cls_token, self.dist_token, self.registers) if p is not None]

    def set_input_tensor(self, input_tensor):
        """Pipeline stages after the first take their input from the previous stage."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def _pos_embed(self, grid: int) -> torch.Tensor:
        pos = self.pos_embed
        trained = int(math.isqrt(pos.shape[1] - self.num_prefix))
        if grid == trained:
            return pos
        # another image size: resize the patch grid of the position embeddings (bicubic, as timm)
        prefix, patches = pos[:, : self.num_prefix], pos[:, self.num_prefix:]
        patches = patches.reshape(1, trained, trained, -1).permute(0, 3, 1, 2)
        patches = F.interpolate(patches.float(), size=(grid, grid), mode="bicubic",
                                align_corners=False).to(pos.dtype)
        return torch.cat([prefix, patches.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """[b, 3, H, W] -> [s, b, d] tokens (sequence first, as megatron-core wants).

        The patch embedding is a convolution whose stride is its kernel: it runs as one GEMM
        over the patches, which come out sequence first. cuDNN ran the convolution in 2.2 ms
        plus 1.5 ms of layout changes for a 0.2 ms GEMM (ViT-L, mb 256, H200)."""
        b, c, h, w = images.shape
        p = self.arch.patch_size
        gh, gw = h // p, w // p
        patches = images[:, :, :gh * p, :gw * p].reshape(b, c, gh, p, gw, p)
        patches = patches.permute(2, 4, 0, 1, 3, 5).reshape(gh * gw, b, c * p * p)
        conv = self.patch_embed
        x = F.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)  # [n, b, d]
        prefix = [t.transpose(0, 1).expand(-1, b, -1) for t in self._prefix_params()]
        x = torch.cat([*prefix, x]) + self._pos_embed(gw).transpose(0, 1)
        if self.ln_pre is not None:
            x = self.ln_pre(x)
        return x.contiguous()

    def padded_len(self, micro_batch: int, seq_len: int | None = None) -> int:
        if self.pack is not None:  # one pack a microbatch, whatever it holds
            return self.pack_len
        return self._fixed_len(micro_batch, seq_len or self.seq_len)

    def _fixed_len(self, micro_batch: int, s: int) -> int:
        """Tokens of fixed-size images after padding (a model that takes packs too pads
        none: ``use_pack``)."""
        if self.pad_to is None:
            return s
        m = self.pad_to(micro_batch)
        return -(-s // m) * m

    def _padding_mask(self, b: int, s: int, device) -> torch.Tensor | None:
        if self.pad_to is None:
            return None
        padded = self._fixed_len(b, s)
        mask = torch.arange(padded, device=device) >= s  # True: a padded key, masked out
        return mask.view(1, 1, 1, padded).expand(b, 1, 1, padded)

    def forward(self, images: torch.Tensor | None = None, coords=None, seg=None,
                cu_seqlens=None) -> torch.Tensor:
        """Images [b, 3, H, W] -> [b, classes | embed_dim | d], or a pack (``images`` its patch
        rows, or the four fields as one tuple) -> [M, ...], one row per image slot; a stage
        before the last returns its hidden states."""
        if self.pack is not None and isinstance(images, (tuple, list)):
            images, coords, seg, cu_seqlens = images  # CLIP hands the pack on as one argument
        hidden = self.forward_features(images, coords, seg, cu_seqlens)
        if not self.post_process:
            return hidden
        return self.forward_head(self.pool(hidden, coords, seg, cu_seqlens))

    def forward_features(self, images: torch.Tensor | None, coords=None, seg=None,
                         cu_seqlens=None) -> torch.Tensor:
        """The encoder. On the last stage the tokens after the final norm, [s, b, d] (padding
        dropped), or [T, d] for a pack; on another stage its output for the next. A model
        that takes packs (``use_pack``) still takes fixed-size images: a pack comes with its
        ``coords``."""
        if coords is not None:
            return self._features_packed(images, coords, seg, cu_seqlens)
        sp = self.config.sequence_parallel
        if self.pre_process:
            hidden = self.embed(images)
            s, b = hidden.shape[0], hidden.shape[1]
            padded = self._fixed_len(b, s)
            if padded > s:
                hidden = F.pad(hidden, (0, 0, 0, 0, 0, padded - s))
            if sp:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
            device = hidden.device
        else:  # a later stage: the previous one's output, set through set_input_tensor
            hidden = None
            received = self.decoder.input_tensor
            b, device = received.shape[1], received.device
            s = self.seq_len
        mask = self._padding_mask(b, s, device)
        hidden = self.decoder(hidden_states=hidden, attention_mask=mask)
        if not self.post_process:
            return hidden
        if sp:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False)
        return self.final_norm(hidden[:s])  # padding dropped; another image size keeps its own

    def pool(self, hidden: torch.Tensor, coords=None, seg=None, cu_seqlens=None) -> torch.Tensor:
        """forward_features' tokens -> image features: [b, d] ([2, b, d] for ``distill``: the
        class and distillation tokens), or [M, d] per image slot of a pack."""
        if coords is not None:
            M = self.pack.max_images
            if self.global_pool == "map":
                return pk.pool_attention(self.attn_pool, hidden, seg, coords, M)
            if self.global_pool == "cls":
                return pk.pool_cls(hidden, cu_seqlens, M)
            return pk.pool_mean(hidden, seg, coords, M)
        if self.global_pool == "map":
            return self.attn_pool(hidden[self.num_prefix:].transpose(0, 1))
        if self.global_pool == "cls":
            return hidden[0]
        if self.global_pool == "distill":
            return hidden[:2]
        return hidden[self.num_prefix:].mean(dim=0)

    def forward_head(self, feats: torch.Tensor) -> torch.Tensor:
        """Image features -> the output: logits, the projection, or the features themselves
        (head="map")."""
        if self.head_dist is not None:  # [b, 2, classes]: the class head's, the distillation head's
            return torch.stack([self.head(feats[0]), self.head_dist(feats[1])], dim=1)
        if self.proj is not None:
            return self.proj(feats)
        return self.head(feats) if self.head is not None else feats

    def embed_packed(self, x: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """[T, 3 p^2] patch rows -> [T, d] tokens (vitgraph.models.packed.embed_tokens)."""
        conv, pos, P = self.patch_embed, self.pos_embed, self.num_prefix
        g = int(math.isqrt(pos.shape[1] - P))
        prefix = None
        if P:
            prefix = torch.cat([t[0] for t in self._prefix_params()]) + pos[0, :P]
        out = pk.embed_tokens(x, coords, conv.weight.reshape(conv.out_channels, -1), conv.bias,
                              pos[0, P:].view(g, g, -1), prefix, self.pos_interp)
        if self.ln_pre is not None:
            out = self.ln_pre(out)
        return out

    def _features_packed(self, x, coords, seg, cu_seqlens) -> torch.Tensor:
        sp = self.config.sequence_parallel
        spec, T, M = self.pack, self.pack_len, self.pack.max_images
        padded = self.packed_attention == "padded"
        L = spec.max_len
        hidden = None
        if self.pre_process:
            hidden = self.embed_packed(x, coords)
            hidden = hidden.view(M, L, -1).transpose(0, 1) if padded else hidden[:, None]
            hidden = hidden.contiguous()
            if sp:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        if padded:
            mask, params = pk.key_padding_mask(seg, M, L), None
        else:  # max_seqlen: a Python int of the spec, the same for every pack
            mask, params = None, PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                max_seqlen_q=L, max_seqlen_kv=L)
            # the torch spec's segment attention computes the image segments only (the first
            # M; the padding runs after them are never read). Layer graphs rebuild the
            # dataclass from its fields and drop this: then every segment is computed
            params.image_segments = M
        hidden = self.decoder(hidden_states=hidden, attention_mask=mask,
                              packed_seq_params=params)
        if not self.post_process:
            return hidden
        if sp:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False)
        hidden = hidden.transpose(0, 1).reshape(T, -1) if padded else hidden[:, 0]
        return self.final_norm(hidden)


def _check_head(head: str, pool: str, embed_dim: int | None, class_token: bool,
                distill_token: bool) -> None:
    if head not in ("classifier", "proj", "map", "none"):
        raise ValueError(f"head={head!r}: classifier | proj | map | none")
    if head == "proj" and not embed_dim:
        raise ValueError("head='proj' needs embed_dim (the joint embedding width)")
    if distill_token and (not class_token or pool != "cls" or head != "classifier"):
        raise ValueError("distill_token needs class_token, pool='cls' and the classifier head")


class AttentionPool(torch.nn.Module):
    """Multihead attention pooling (SigLIP's MAP head): one learned query attends over the
    tokens, then a pre-norm MLP with a residual; [b, n, d] -> [b, d]. Replicated over
    tensor-parallel ranks (small next to the encoder)."""

    def __init__(self, d: int, heads: int, ffn: int, config: TransformerConfig, device, dtype):
        super().__init__()
        self.heads = heads
        self.act = config.activation_func
        kw = dict(device=device, dtype=dtype)
        self.latent = torch.nn.Parameter(torch.zeros(1, 1, d, **kw))
        torch.nn.init.trunc_normal_(self.latent, std=d ** -0.5)
        self.q = torch.nn.Linear(d, d, **kw)
        self.kv = torch.nn.Linear(d, 2 * d, **kw)   # [k; v], heads contiguous in each
        self.proj = torch.nn.Linear(d, d, **kw)
        self.norm = torch.nn.LayerNorm(d, eps=config.layernorm_epsilon, **kw)
        self.fc1 = torch.nn.Linear(d, ffn, **kw)
        self.fc2 = torch.nn.Linear(ffn, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads
        q = self.q(self.latent).expand(b, -1, -1).reshape(b, 1, h, d // h).transpose(1, 2)
        k, v = self.kv(x).reshape(b, n, 2, h, d // h).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # [b, h, 1, d/h]
        out = self.proj(out.transpose(1, 2).reshape(b, d))
        return out + self.fc2(self.act(self.fc1(self.norm(out))))


def vit_flops_per_image(a: ViTArch, num_prefix: int, num_classes: int,
                        image_size: int | None = None) -> float:
    """Training FLOPs per image, T * (6N + 12 L d T) (docs/design.md), for the whole model."""
    t = num_prefix + a.num_patches(image_size)
    n = vit_param_count(a, num_prefix, num_classes)
    return t * (6 * n + 12 * a.num_layers * a.hidden_size * t)


def vit_flops_per_token(a: ViTArch, num_prefix: int, num_classes: int) -> tuple[float, float]:
    """Training FLOPs of a packed token, as (per token, per token and attended token): an
    image of n tokens (prefix included) costs n (6N + 12 L d n), the fixed path's formula, so
    a pack costs the sum over its images (Task.pack_flops)."""
    n = vit_param_count(a, num_prefix, num_classes)
    return 6.0 * n, 12.0 * a.num_layers * a.hidden_size


def vit_param_count(a: ViTArch, num_prefix: int, num_classes: int) -> int:
    d, f = a.hidden_size, a.ffn_hidden_size
    layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # qkv, proj, fc1, fc2, 2 layer norms
    embed = 3 * a.patch_size ** 2 * d + d + (num_prefix + a.num_patches()) * d + num_prefix * d
    head = 2 * d + d * num_classes + num_classes
    return a.num_layers * layer + embed + head

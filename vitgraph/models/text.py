"""The text tower of CLIP / SigLIP on megatron-core: token embedding + learned positions, a
``TransformerBlock`` (causal for CLIP, bidirectional for SigLIP, chosen in the layer spec),
final LayerNorm, pooling at the end of text, projection to the joint embedding width.

Pooling: ``eot`` takes the token whose id is largest in each row, the end-of-text token
(OpenAI CLIP's convention, kept by vitgraph.text.tokenizer); ``last`` takes the last position
(SigLIP). With a causal mask the end-of-text token never sees the padding after it, so no
padding mask is needed.

Not yet: pipeline stages (the tower is always one stage), sequence parallel, and a
vocabulary-parallel embedding (the embedding and projection are replicated over tp ranks;
the layers are tensor-parallel as in the ViT).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from vitgraph.models.registry import TextArch


class TextTransformer(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec, arch: TextArch,
                 embed_dim: int):
        super().__init__(config=config)
        if config.sequence_parallel:
            raise NotImplementedError("the text tower does not support sequence parallel yet")
        if arch.pool not in ("eot", "last"):
            raise ValueError(f"text pool={arch.pool!r}: eot | last")
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.arch = arch
        self.context_length = arch.context_length
        d = arch.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        self.token_embed = torch.nn.Embedding(arch.vocab_size, d, device=device, dtype=dtype)
        torch.nn.init.normal_(self.token_embed.weight, std=0.02)
        self.pos_embed = torch.nn.Parameter(
            torch.empty(arch.context_length, d, device=device, dtype=dtype))
        torch.nn.init.normal_(self.pos_embed, std=0.01)
        self.decoder = TransformerBlock(config, layer_spec, post_layer_norm=False,
                                        pre_process=True, post_process=True)
        self.final_norm = torch.nn.LayerNorm(d, eps=config.layernorm_epsilon, device=device,
                                             dtype=dtype)
        self.proj = torch.nn.Linear(d, embed_dim, bias=arch.proj_bias, device=device, dtype=dtype)
        torch.nn.init.normal_(self.proj.weight, std=d ** -0.5)
        if arch.proj_bias:
            torch.nn.init.zeros_(self.proj.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [b, s] token ids (s <= context_length) -> [b, embed_dim] (not normalised)."""
        b, s = tokens.shape
        if s > self.context_length:
            raise ValueError(f"{s} tokens: longer than the text tower's context length "
                             f"{self.context_length}")
        x = self.token_embed(tokens) + self.pos_embed[:s]
        x = x.transpose(0, 1).contiguous()  # [s, b, d]: sequence first, as megatron-core wants
        x = self.decoder(hidden_states=x, attention_mask=None)
        x = self.final_norm(x)
        if self.arch.pool == "eot":
            feats = x[tokens.argmax(dim=-1), torch.arange(b, device=x.device)]
        else:
            feats = x[-1]
        return self.proj(feats)

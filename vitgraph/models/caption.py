"""A captioning VLM, LLaVA-style: vitgraph's ViT as the vision tower, megatron-core's
``MultimodalProjector`` from the tower's width to the language model's, and megatron-core's
``GPTModel`` (causal, learned positions) as the language model. Each sample's sequence is its
image tokens (every token the tower outputs, class token included), then its text tokens
([BOS, caption..., EOS, padding]); the logits are those of the text positions.

Why not megatron-core's ``LLaVAModel``: it builds its own vision encoder (``CLIPViTModel``,
RADIO or a Hugging Face model) from a vision TransformerConfig, so it cannot take a vitgraph
tower (registry, init, packing), and ``CLIPViTModel`` calls ``.cuda()``; its
``_preprocess_data`` places images by searching the token ids on the host. Here every sample
has one image in front of its text: the sequence is a concatenation.

The language model runs as ``GPTModel.forward`` does (embedding, decoder, final norm, output
layer) except that the output layer sees only the text positions: with CLIP's BPE (49,408
ids), 65 image tokens and 10 text positions, projecting every position onto the vocabulary
costs 7.5x the output layer's work for logits nobody reads. ``tests/test_caption.py`` checks
the logits against ``GPTModel.forward``'s.

Greedy captions (``generate``) keep the keys and values of the positions so far in
megatron-core's KV cache (``StaticInferenceContext``): one position per token after the
image and BOS, not the whole prefix again.

Not yet: packed (native-resolution) images and the LM sequence in thd, tp / pp.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from vitgraph.models.clip import tower_config
from vitgraph.models.init import init_weights
from vitgraph.models.specs import get_layer_spec
from vitgraph.models.vit import ViT

# model.freeze-style patterns of the parts (lm.freeze_tower, lm.freeze_lm)
TOWER = "visual.*"
LANGUAGE_MODEL = "language_model.*"


class CaptionModel(MegatronModule):
    def __init__(self, visual: ViT, projector: MultimodalProjector, language_model: GPTModel):
        super().__init__(config=language_model.config)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = self.post_process = True  # one pipeline stage
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        self.visual, self.projector, self.language_model = visual, projector, language_model
        self.image_len = visual.seq_len  # image tokens in front of every text

    def set_input_tensor(self, input_tensor) -> None:
        """megatron's schedules call it on every stage; the model runs on one stage."""
        if input_tensor is not None and any(t is not None for t in input_tensor):
            raise RuntimeError("the caption model runs on one pipeline stage (parallel.pp=1)")

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """[b, 3, H, W] -> [n, b, lm width]: the tower's tokens through the projector."""
        return self.projector(self.visual.forward_features(images))

    def embed(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
              start: int = 0) -> torch.Tensor:
        """The language model's input [n + L, b, h]: image tokens (n may be 0), then the
        text's word embeddings; learned positions from ``start`` on (GPTModel's embedding)."""
        emb = self.language_model.embedding
        words = emb.word_embeddings(tokens).transpose(0, 1)  # [L, b, h]
        x = torch.cat([image_tokens.to(words.dtype), words])
        pos = torch.arange(start, start + x.shape[0], device=x.device)
        x = x + emb.position_embeddings(pos)[:, None]
        return emb.embedding_dropout(x)

    def text_logits(self, image_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[b, L, vocab]: the text positions' logits."""
        lm = self.language_model
        hidden = lm.decoder(hidden_states=self.embed(image_tokens, tokens), attention_mask=None)
        logits, _ = lm.output_layer(hidden[image_tokens.shape[0]:])
        return logits.transpose(0, 1)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Images [b, 3, H, W] and text ids [b, L] -> logits [b, L, vocab]; position i's
        logits predict text token i + 1."""
        return self.text_logits(self.image_tokens(images), tokens)

    def next_logits(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
                    cache: StaticInferenceContext) -> torch.Tensor:
        """[b, vocab]: the logits after the last of ``tokens``. The positions before them are
        in ``cache`` (megatron-core's KV cache), which takes these positions' keys and
        values."""
        lm = self.language_model
        x = self.embed(image_tokens, tokens, start=cache.sequence_len_offset)
        hidden = lm.decoder(hidden_states=x, attention_mask=None, inference_context=cache)
        cache.sequence_len_offset += x.shape[0]
        logits, _ = lm.output_layer(hidden[-1:])
        return logits[0]

    @torch.no_grad()
    def generate(self, images: torch.Tensor, bos: int, eos: int, length: int,
                 pad: int = 0) -> torch.Tensor:
        """Greedy captions, int64 [b, length]: BOS, then the argmax token until EOS or the
        budget; padding after EOS. With megatron-core's KV cache: the image tokens and BOS in
        one pass, then one position per token. In eval mode: megatron drops the causal mask
        of a one-token step only outside training."""
        was_training = self.training
        self.eval()
        try:
            return self._greedy(images, bos, eos, length, pad)
        finally:
            self.train(was_training)

    def _greedy(self, images, bos: int, eos: int, length: int, pad: int) -> torch.Tensor:
        image = self.image_tokens(images)
        b = images.shape[0]
        out = torch.full((b, length), pad, dtype=torch.long, device=images.device)
        out[:, 0] = bos
        done = torch.zeros(b, dtype=torch.bool, device=images.device)
        cache = StaticInferenceContext(b, image.shape[0] + length)
        logits = self.next_logits(image, out[:, :1], cache)
        cache.enable_decode_mode()
        for i in range(1, length):
            nxt = logits.argmax(-1)
            out[:, i] = torch.where(done, pad, nxt)
            done |= nxt == eos
            if i == length - 1 or bool(done.all()):
                break
            logits = self.next_logits(image[:0], out[:, i:i + 1], cache)
        return out


def build_caption(tower_arch, base: TransformerConfig, spec: str, lm, vocab_size: int, *,
                  seed: int = 0, class_token: bool = True, num_registers: int = 0,
                  fused_norm: bool = False, drop_path_rate: float = 0.0) -> CaptionModel:
    """One caption model on one stage. ``base``: the tower's TransformerConfig (precision,
    layout); ``lm``: the language model's sizes (the plan's ``Caption``: num_layers,
    hidden_size, num_heads, ffn_hidden_size, init_std, projector, text_length). The tower's
    weights are vitgraph's (layout-independent, under ``visual.``); the projector's and the
    language model's are megatron-core's own initialisation from the seeded torch RNG."""
    if base.pipeline_model_parallel_size > 1 or base.tensor_model_parallel_size > 1:
        raise NotImplementedError("the caption model runs at tp=1, pp=1 for now")
    visual = ViT(base, get_layer_spec(spec, fused_norm=fused_norm,
                                      drop_path_rate=drop_path_rate),
                 tower_arch, 0, num_registers=num_registers, class_token=class_token,
                 head="none")
    init_weights(visual, seed, prefix="visual.")
    ffn = lm.ffn_hidden_size or 4 * lm.hidden_size
    lcfg = dataclasses.replace(
        tower_config(base, hidden_size=lm.hidden_size, num_layers=lm.num_layers,
                     num_heads=lm.num_heads, ffn_hidden_size=ffn, activation="gelu",
                     eps=base.layernorm_epsilon),
        init_method_std=lm.init_std, init_method=None, output_layer_init_method=None)
    pcfg = tower_config(lcfg, hidden_size=lm.hidden_size, num_layers=1, num_heads=1,
                        ffn_hidden_size=lm.hidden_size, activation="gelu",
                        eps=base.layernorm_epsilon)
    # megatron-core draws these weights from torch's RNG: seeded here, the caller's untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        projector = MultimodalProjector(
            pcfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            lm.projector, tower_arch.hidden_size)
        language_model = GPTModel(lcfg, get_layer_spec(spec, causal=True), vocab_size,
                                  visual.seq_len + lm.text_length, parallel_output=False,
                                  position_embedding_type="learned_absolute")
    return CaptionModel(visual, projector, language_model)

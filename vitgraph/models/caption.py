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

At native resolution (``pack``: the image pack's ``PackSpec``) the tower runs packed (its
images back to back, ``cu_seqlens`` attention) and so does the language model: each sample's
image tokens, then its text up to its EOS, all samples of a microbatch back to back in one
thd sequence of ``TextPackSpec.tokens`` positions, one attention segment per sample (causal
within it), positions from 0 in each, the rest padding the loss never reads (``text_layout``).
Greedy captions run the tower packed, then the language model with its KV cache on the
images of each token count together.

Not yet: tp / pp.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.packed_seq_params import PackedSeqParams
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
# the language model's pack length is a multiple of this (FP8 GEMMs need 16 tokens)
TEXT_PACK_MULTIPLE = 16


@dataclass(frozen=True)
class TextPackSpec:
    """The language model's pack at native resolution, derived from the image pack's spec:
    up to ``samples`` samples (the image pack's max_images), each its image's tokens and its
    text (BOS, caption, EOS: at most ``text_length``), in ``tokens`` positions: the image
    pack's tokens + samples x text_length (a pack always fits), rounded up to a multiple of
    TEXT_PACK_MULTIPLE. ``max_len``: the longest sample, an image of max_patches with its
    prefix tokens and a whole text: attention's max_seqlen, and the learned position table's
    length (positions restart at 0 in each sample, its text's right after its image's)."""
    tokens: int
    samples: int
    text_length: int
    max_len: int

    @classmethod
    def of(cls, pack, text_length: int) -> "TextPackSpec":
        tokens = pack.tokens + pack.max_images * text_length
        tokens = -(-tokens // TEXT_PACK_MULTIPLE) * TEXT_PACK_MULTIPLE
        return cls(tokens, pack.max_images, text_length, pack.max_len + text_length)

    @property
    def num_segments(self) -> int:
        """The samples, then the padding in runs of at most max_len (as an image pack's)."""
        return self.samples + -(-self.tokens // self.max_len)


def text_layout(seg, tokens, eos: int, spec: TextPackSpec) -> tuple[torch.Tensor, ...]:
    """The language model's pack for an image pack whose tokens' slots are ``seg`` [T] (the
    image pack's field: slot i's tokens contiguous, ``samples`` for padding) and whose
    samples' text ids are ``tokens`` [samples, text_length], on the host (the loader's CPU
    tensors; fixed shapes out, so one graph serves every pack):

    * ``src`` int64 [tokens]: at each position, its row of [image pack rows (T), text
      embeddings (samples x text_length, row-major), a zero row]; padding takes the zero row;
    * ``positions`` int64 [tokens]: from 0 in each sample (image, then text), 0 for padding;
    * ``cu_seqlens`` int32 [num_segments + 1]: each slot's sample (empty slots: empty
      segments), then the padding in runs of at most max_len, then empty segments;
    * ``text_rows`` int64 [samples, text_length]: the position of each text token; a place
      past the sample's EOS (or of an empty slot) points at the last position (its logits
      are never read: ``caption.text_targets`` ignores them).

    A sample's text runs to its first EOS (the whole text_length where there is none)."""
    seg = torch.as_tensor(seg).numpy().astype(np.int64)
    tok = torch.as_tensor(tokens).numpy()
    M, Lt, T = spec.samples, spec.text_length, seg.shape[0]
    if tok.shape != (M, Lt):
        raise ValueError(f"text ids {tok.shape} for a pack of {M} samples of {Lt}")
    n_img = np.bincount(seg, minlength=M + 1)[:M]
    first = np.full(M + 1, T, dtype=np.int64)
    np.minimum.at(first, seg, np.arange(T, dtype=np.int64))
    ends = tok == eos
    n_txt = np.where(n_img > 0, np.where(ends.any(1), ends.argmax(1) + 1, Lt), 0)
    n = n_img + n_txt
    if n.sum() > spec.tokens:
        raise ValueError(f"{int(n.sum())} tokens for a language-model pack of {spec.tokens}")
    start = np.cumsum(n) - n

    def runs(counts):  # (sample, place within its run) of every element of the runs
        k = np.repeat(np.arange(M), counts)
        return k, np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)

    src = np.full(spec.tokens, T + M * Lt, dtype=np.int64)
    pos = np.zeros(spec.tokens, dtype=np.int64)
    i, k = runs(n_img)
    at = start[i] + k
    src[at], pos[at] = first[:M][i] + k, k
    i, j = runs(n_txt)
    at = start[i] + n_img[i] + j
    src[at], pos[at] = T + i * Lt + j, n_img[i] + j
    rows = np.full((M, Lt), spec.tokens - 1, dtype=np.int64)
    rows[i, j] = at
    bounds, used = [0, *np.cumsum(n).tolist()], int(n.sum())
    while used < spec.tokens:
        used = min(used + spec.max_len, spec.tokens)
        bounds.append(used)
    bounds += [spec.tokens] * (spec.num_segments + 1 - len(bounds))
    return (torch.from_numpy(src), torch.from_numpy(pos),
            torch.tensor(bounds, dtype=torch.int32), torch.from_numpy(rows))


class CaptionModel(MegatronModule):
    def __init__(self, visual: ViT, projector: MultimodalProjector, language_model: GPTModel,
                 text_pack: TextPackSpec | None = None):
        super().__init__(config=language_model.config)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = self.post_process = True  # one pipeline stage
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        self.visual, self.projector, self.language_model = visual, projector, language_model
        self.image_len = visual.seq_len  # image tokens in front of every text (fixed size)
        self.text_pack = text_pack  # native resolution: the language model's pack

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

    def forward(self, images, tokens: torch.Tensor, layout=None) -> torch.Tensor:
        """Images [b, 3, H, W] and text ids [b, L] -> logits [b, L, vocab]; position i's
        logits predict text token i + 1. At native resolution ``images`` is an image pack
        (x, coords, seg, cu_seqlens), ``tokens`` [M, L] its slots' text ids and ``layout``
        the language model's pack (``text_layout``): logits [M, L, vocab]."""
        if layout is not None:
            return self.packed_text_logits(self.packed_image_tokens(images), tokens, layout)
        return self.text_logits(self.image_tokens(images), tokens)

    def packed_image_tokens(self, pack) -> torch.Tensor:
        """An image pack (x, coords, seg, cu_seqlens) -> [T, lm width]: the tower's tokens
        through the projector (padding rows too: no sample reads them)."""
        return self.projector(self.visual.forward_features(*pack)[:, None])[:, 0]

    def packed_text_logits(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
                           layout) -> torch.Tensor:
        """[M, L, vocab]: the text positions' logits of the language model's pack (see
        ``text_layout``) over ``image_tokens`` [T, h] and the slots' ids ``tokens`` [M, L]."""
        src, positions, cu_seqlens, text_rows = layout
        lm, spec = self.language_model, self.text_pack
        emb = lm.embedding
        words = emb.word_embeddings(tokens)  # [M, L, h]
        m, length, h = words.shape
        rows = torch.cat([image_tokens.to(words.dtype), words.reshape(m * length, h),
                          words.new_zeros(1, h)])
        x = rows[src] + emb.position_embeddings(positions)
        x = emb.embedding_dropout(x[:, None])  # [tokens, 1, h]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                                 cu_seqlens_kv=cu_seqlens, max_seqlen_q=spec.max_len,
                                 max_seqlen_kv=spec.max_len)
        # the torch spec's slot attention computes the samples' segments only (the padding
        # runs after them are never read); layer graphs drop it and compute them all
        params.image_segments = spec.samples
        hidden = lm.decoder(hidden_states=x, attention_mask=None, packed_seq_params=params)
        text = hidden[:, 0][text_rows.reshape(-1)].view(m, length, h)
        logits, _ = lm.output_layer(text.transpose(0, 1).contiguous())
        return logits.transpose(0, 1)

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
    def generate(self, images, bos: int, eos: int, length: int, pad: int = 0) -> torch.Tensor:
        """Greedy captions, int64 [b, length]: BOS, then the argmax token until EOS or the
        budget; padding after EOS. With megatron-core's KV cache: the image tokens and BOS in
        one pass, then one position per token. In eval mode: megatron drops the causal mask
        of a one-token step only outside training. ``images`` may be an image pack (x,
        coords, seg, cu_seqlens): [M, length], one row per slot (an empty slot's: padding)."""
        if isinstance(images, (tuple, list)):
            return self.generate_packs([images], bos, eos, length, pad)[0]
        with self._eval_mode():
            return self._greedy(self.image_tokens(images), bos, eos, length, pad)

    @torch.no_grad()
    def generate_packs(self, packs: list, bos: int, eos: int, length: int,
                       pad: int = 0) -> list[torch.Tensor]:
        """``generate`` for each of ``packs`` (image packs): the tower on each pack, then the
        language model (KV cache) on all the images of one token count together, each
        sample's positions from 0 as in training. A pack's images mostly differ in size: one
        pack's samples alone would decode a few at a time."""
        with self._eval_mode():
            tokens, where = [], {}  # each pack's [T, h]; token count -> [(pack, slot)]
            for k, pack in enumerate(packs):
                tokens.append(self.packed_image_tokens(pack))
                seg = pack[2]
                M, T = self.visual.pack.max_images, seg.shape[0]
                count = torch.bincount(seg, minlength=M + 1)[:M].tolist()
                first = torch.full((M + 1,), T, dtype=torch.long, device=seg.device)
                first = first.scatter_reduce(0, seg, torch.arange(T, device=seg.device),
                                             "amin").tolist()
                for slot, n in enumerate(count):
                    if n:
                        where.setdefault(n, []).append((k, slot, first[slot]))
            out = [torch.full((self.visual.pack.max_images, length), pad, dtype=torch.long,
                              device=t.device) for t in tokens]
            for n, places in sorted(where.items()):
                image = torch.stack([tokens[k][at:at + n] for k, _, at in places], 1)
                ids = self._greedy(image, bos, eos, length, pad)  # image: [n, b, h]
                for (k, slot, _), row in zip(places, ids):
                    out[k][slot] = row
            return out

    @contextlib.contextmanager
    def _eval_mode(self):
        was_training = self.training
        self.eval()
        try:
            yield
        finally:
            self.train(was_training)

    def _greedy(self, image: torch.Tensor, bos: int, eos: int, length: int,
                pad: int) -> torch.Tensor:
        """Greedy captions after ``image`` [n, b, h] (projected image tokens)."""
        b, device = image.shape[1], image.device
        out = torch.full((b, length), pad, dtype=torch.long, device=device)
        out[:, 0] = bos
        done = torch.zeros(b, dtype=torch.bool, device=device)
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
                  fused_norm: bool = False, drop_path_rate: float = 0.0, pack=None,
                  pos_interp: str = "bicubic") -> CaptionModel:
    """One caption model on one stage. ``base``: the tower's TransformerConfig (precision,
    layout); ``lm``: the language model's sizes (the plan's ``Caption``: num_layers,
    hidden_size, num_heads, ffn_hidden_size, init_std, projector, text_length). The tower's
    weights are vitgraph's (layout-independent, under ``visual.``); the projector's and the
    language model's are megatron-core's own initialisation from the seeded torch RNG.
    ``pack`` (the image pack's PackSpec): native resolution, the tower takes packs (padded
    slots with a key mask) with positions resampled by ``pos_interp``, the language model
    packs of ``TextPackSpec.of(pack, lm.text_length)``; its position table covers the
    longest image (max_patches and the prefix tokens) and a whole text."""
    if base.pipeline_model_parallel_size > 1 or base.tensor_model_parallel_size > 1:
        raise NotImplementedError("the caption model runs at tp=1, pp=1 for now")
    padding = pack is not None and pack.padded
    visual = ViT(base, get_layer_spec(spec, padding_mask=padding, fused_norm=fused_norm,
                                      drop_path_rate=drop_path_rate),
                 tower_arch, 0, num_registers=num_registers, class_token=class_token,
                 head="none", pack=pack, pos_interp=pos_interp)
    text_pack = TextPackSpec.of(pack, lm.text_length) if pack is not None else None
    positions = text_pack.max_len if text_pack else visual.seq_len + lm.text_length
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
                                  positions, parallel_output=False,
                                  position_embedding_type="learned_absolute")
    return CaptionModel(visual, projector, language_model, text_pack)

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

Tensor parallel (+ sequence parallel): the tower is vitgraph's ViT at tp (its tokens are
split along the sequence inside it and gathered before its final norm); the projector runs on
those replicated tokens, its linears column / row parallel without a sequence split (the image
length, 65 for a pico tower, need not divide by tp); the language model's input, image tokens
then text, is padded at its end to a multiple of the split (causal: no real position sees the
padding) and scattered along the sequence; the vocabulary is split over the ranks
(megatron's ``VocabParallelEmbedding``, output layer and ``vocab_parallel_cross_entropy``),
padded to a multiple of 8 and of tp with the padded ids' logits at -inf (every layout, tp=1
too, computes the function of the unpadded vocabulary, and the padded size is the same at tp
1, 2, 4, 8). The output layer reads only the text positions: the
decoder's output is gathered, its text rows taken, and the output layer runs on them as
without sequence parallel (its input-gradient all-reduce instead of a reduce-scatter). Under
sequence parallel a one-token decode step cannot be split: greedy captions run the whole
sequence again for each token there (tp without sequence parallel keeps the KV cache).

Pipeline parallel: the first stage holds the tower, the projector, the language model's
embedding and its first layers (megatron's even split of ``lm.num_layers``), the last stage
its last layers, final norm, output layer and the loss. Stages exchange the language model's
hidden states [S (/ tp), b, h] of the padded fixed length ``seq_len``. Greedy captions need
the whole model on one stage: not under pp (vitgraph.tasks.caption leaves them out).

At native resolution (``pack``: the image pack's ``PackSpec``) the tower runs packed (its
images back to back, ``cu_seqlens`` attention) and so does the language model: each sample's
image tokens, then its text up to its EOS, all samples of a microbatch back to back in one
thd sequence of ``TextPackSpec.tokens`` positions, one attention segment per sample (causal
within it), positions from 0 in each, the rest padding the loss never reads (``text_layout``).
Greedy captions run the tower packed, then the language model with its KV cache on the
images of each token count together; where images of many token counts would make many such
groups (mixed sizes), the language model's pack runs whole for each token instead (one pass
a pack, a decode pass costs a whole group's launches: ``generate_packs``).

Native resolution runs at tp=1, pp=1 (config validation says so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
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
from vitgraph.models.specs import block_spec, get_layer_spec
from vitgraph.models.vit import ViT, sequence_length

# APEX's fused weight-gradient kernel, which megatron-core's ColumnParallelLinear needs for
# gradient_accumulation_fusion (TE's layers have their own)
APEX_WGRAD = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None

# model.freeze-style patterns of the parts (lm.freeze_tower, lm.freeze_lm)
TOWER = "visual.*"
LANGUAGE_MODEL = "language_model.*"
# the language model's pack length is a multiple of this (FP8 GEMMs need 16 tokens)
TEXT_PACK_MULTIPLE = 16
# greedy captions of image packs: more token-count groups than this per pack decode by the
# pack's whole forward for each token rather than a KV-cached pass per group
GROUPS_PER_PACK = 2


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
    seg = torch.as_tensor(seg).cpu().numpy().astype(np.int64)  # (CUDA fields: a device wait)
    tok = torch.as_tensor(tokens).cpu().numpy()
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


# the language model's vocabulary is padded to a multiple of this (and of tp): the same
# padded size at tp 1, 2, 4 and 8, so a checkpoint moves between them
VOCAB_MULTIPLE = 8


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The language model's vocabulary (``vocab_size`` ids and padding) split over ``tp``."""
    m = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-vocab_size // m) * m


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the vocabulary of logits split over the tensor-parallel ranks
    [..., V / tp] (the first of equal maxima, as torch's over the whole)."""
    tp = ps.get_tensor_model_parallel_world_size()
    value, index = logits.max(-1)
    if tp == 1:
        return index
    index = index + ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    gather = tensor_parallel.gather_from_tensor_model_parallel_region
    values, indices = gather(value[..., None].contiguous()), gather(index[..., None].contiguous())
    return indices.gather(-1, values.argmax(-1, keepdim=True))[..., 0]


class CaptionModel(MegatronModule):
    """The caption model on one pipeline stage: ``visual`` and ``projector`` on the first
    (None elsewhere), the language model's part of the stage. ``image_len``: the tower's
    tokens an image; ``text_length``: text positions; ``vocab_size``: the tokenizer's (the
    language model's may be padded); ``pad_to``: micro-batch -> the multiple the language
    model's sequence is padded to (None: never); ``text_pack``: native resolution, the
    language model's pack."""

    def __init__(self, visual: ViT | None, projector: MultimodalProjector | None,
                 language_model: GPTModel, *, image_len: int, text_length: int,
                 vocab_size: int, pad_to=None,
                 text_pack: TextPackSpec | None = None):
        super().__init__(config=language_model.config)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.share_embeddings_and_output_weights = False  # read by finalize_model_grads
        self.visual, self.projector, self.language_model = visual, projector, language_model
        self.image_len, self.text_length = image_len, text_length  # image tokens before the text
        self.vocab_size, self.pad_to = vocab_size, pad_to
        self.text_pack = text_pack  # native resolution: the language model's pack
        self.sequence_parallel = language_model.config.sequence_parallel
        out = language_model.output_layer if self.post_process else None
        if out is not None and out.sequence_parallel:
            # the output layer reads the gathered text rows (``text_logits``): a replicated
            # input, whose gradient it all-reduces over tp, as without sequence parallel
            out.sequence_parallel, out.allreduce_dgrad = False, True
        self.register_buffer("vocab_padding", self._vocab_padding(), persistent=False)

    def _vocab_padding(self) -> torch.Tensor | None:
        """True at this rank's padded vocabulary ids (None: it has none)."""
        if not self.post_process:
            return None
        weight = self.language_model.output_layer.weight
        start = ps.get_tensor_model_parallel_rank() * weight.shape[0]
        if start + weight.shape[0] <= self.vocab_size:
            return None
        return torch.arange(start, start + weight.shape[0], device=weight.device) >= self.vocab_size

    def set_input_tensor(self, input_tensor) -> None:
        """A later pipeline stage's input: the stage before's language-model hidden states."""
        self.language_model.set_input_tensor(input_tensor)

    def seq_len(self, micro_batch: int) -> int:
        """The language model's sequence (image tokens, text, padding): what stages exchange
        (split over tp under sequence parallel)."""
        return self._padded_len(self.image_len + self.text_length, micro_batch)

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """[b, 3, H, W] -> [n, b, lm width]: the tower's tokens through the projector."""
        return self.projector(self.visual.forward_features(images.to(self._tower_dtype)))

    @property
    def _tower_dtype(self) -> torch.dtype:
        """The images' dtype for the tower: megatron's Float16Module casts a training step's
        inputs, but the eval's greedy captions call this model without it."""
        return self.visual.patch_embed.weight.dtype

    def embed(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
              start: int = 0) -> torch.Tensor:
        """[n + L, b, h]: image tokens (n may be 0), then the text's word embeddings; learned
        positions from ``start`` on (GPTModel's embedding, before its dropout)."""
        emb = self.language_model.embedding
        words = emb.word_embeddings(tokens).transpose(0, 1)  # [L, b, h]
        x = torch.cat([image_tokens.to(words.dtype), words])
        pos = torch.arange(start, start + x.shape[0], device=x.device)
        return x + emb.position_embeddings(pos)[:, None]

    def lm_input(self, image_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's input: ``embed``'s sequence padded at its end to ``seq_len``, split
        along the sequence under sequence parallel, through the embedding dropout (as
        GPTModel's embedding does it)."""
        x = self.embed(image_tokens, tokens)
        padded = self._padded_len(x.shape[0], x.shape[1])
        if padded > x.shape[0]:
            x = F.pad(x, (0, 0, 0, 0, 0, padded - x.shape[0]))
        dropout = self.language_model.embedding.embedding_dropout
        if not self.sequence_parallel:
            return dropout(x)
        x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return dropout(x)

    def _padded_len(self, s: int, micro_batch: int) -> int:
        m = self.pad_to(micro_batch) if self.pad_to is not None else 1
        return -(-s // m) * m

    def text_logits(self, hidden: torch.Tensor, text_len: int) -> torch.Tensor:
        """The decoder's output (split along the sequence under sequence parallel) -> the
        text positions' logits [b, L, vocab (/ tp)]."""
        if self.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False)
        return self._logits(hidden[self.image_len:self.image_len + text_len]).transpose(0, 1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's logits [s, b, vocab (/ tp)], the padded ids' at -inf."""
        logits, _ = self.language_model.output_layer(hidden)
        if self.vocab_padding is not None:
            logits = logits.masked_fill(self.vocab_padding, float("-inf"))
        return logits

    def forward(self, images, tokens: torch.Tensor, layout=None) -> torch.Tensor:
        """Images [b, 3, H, W] and text ids [b, L] -> logits [b, L, vocab (/ tp)]; position
        i's logits predict text token i + 1. A stage before the last returns its hidden
        states; a stage after the first takes the images as None. At native resolution
        ``images`` is an image pack (x, coords, seg, cu_seqlens), ``tokens`` [M, L] its slots'
        text ids and ``layout`` the language model's pack (``text_layout``): logits
        [M, L, vocab]."""
        if layout is not None:
            return self.packed_text_logits(self.packed_image_tokens(images), tokens, layout)
        hidden = None
        if self.pre_process:
            hidden = self.lm_input(self.image_tokens(images), tokens)
        hidden = self.language_model.decoder(hidden_states=hidden, attention_mask=None)
        if not self.post_process:
            return hidden
        return self.text_logits(hidden, tokens.shape[1])

    def packed_image_tokens(self, pack) -> torch.Tensor:
        """An image pack (x, coords, seg, cu_seqlens) -> [T, lm width]: the tower's tokens
        through the projector (padding rows too: no sample reads them)."""
        x, *rest = pack
        return self.projector(self.visual.forward_features(x.to(self._tower_dtype),
                                                           *rest)[:, None])[:, 0]

    def packed_text_logits(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
                           layout) -> torch.Tensor:
        """[M, L, vocab]: the text positions' logits of the language model's pack (see
        ``text_layout``) over ``image_tokens`` [T, h] and the slots' ids ``tokens`` [M, L]."""
        m, length = tokens.shape
        hidden = self._packed_hidden(image_tokens, tokens, layout)
        text = hidden[layout[3].reshape(-1)].view(m, length, hidden.shape[-1])
        return self._logits(text.transpose(0, 1).contiguous()).transpose(0, 1)

    def _packed_hidden(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
                       layout) -> torch.Tensor:
        """The decoder's output [tokens, h] on the language model's pack."""
        src, positions, cu_seqlens, _ = layout
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
        return lm.decoder(hidden_states=x, attention_mask=None, packed_seq_params=params)[:, 0]

    def next_logits(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
                    cache: StaticInferenceContext) -> torch.Tensor:
        """[b, vocab (/ tp)]: the logits after the last of ``tokens``. The positions before
        them are in ``cache`` (megatron-core's KV cache), which takes these positions' keys
        and values."""
        lm = self.language_model
        x = self.embed(image_tokens, tokens, start=cache.sequence_len_offset)
        hidden = lm.decoder(hidden_states=x, attention_mask=None, inference_context=cache)
        cache.sequence_len_offset += x.shape[0]
        return self._logits(hidden[-1:])[0]

    @torch.no_grad()
    def generate(self, images, bos: int, eos: int, length: int, pad: int = 0) -> torch.Tensor:
        """Greedy captions, int64 [b, length]: BOS, then the argmax token until EOS or the
        budget; padding after EOS. With megatron-core's KV cache: the image tokens and BOS in
        one pass, then one position per token (under sequence parallel the whole sequence
        again for each token). In eval mode: megatron drops the causal mask of a one-token
        step only outside training. The whole model on one stage; under tp every rank of the
        group calls it with the same images. ``images`` may be an image pack (x, coords, seg,
        cu_seqlens): [M, length], one row per slot (an empty slot's: padding)."""
        if not (self.pre_process and self.post_process):
            raise RuntimeError("greedy captions need the whole caption model on one stage "
                               "(parallel.pp=1)")
        if isinstance(images, (tuple, list)):
            return self.generate_packs([images], bos, eos, length, pad)[0]
        with self._eval_mode():
            return self._greedy(self.image_tokens(images), bos, eos, length, pad)

    @torch.no_grad()
    def generate_packs(self, packs: list, bos: int, eos: int, length: int, pad: int = 0,
                       whole_packs: bool | None = None) -> list[torch.Tensor]:
        """``generate`` for each of ``packs`` (image packs): the tower on each pack, then the
        language model (KV cache) on all the images of one token count together, each
        sample's positions from 0 as in training. A pack's images mostly differ in size: one
        pack's samples alone would decode a few at a time. ``whole_packs`` (None: where the
        images make more than GROUPS_PER_PACK token-count groups a pack): instead the
        language model's pack runs whole for each token (``_greedy_pack``), as many passes a
        token as packs, not as groups; the same ids."""
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
            if whole_packs is None:
                whole_packs = (len(where) > GROUPS_PER_PACK * len(packs)
                               and length <= self.text_pack.text_length)
            if whole_packs:
                return [self._greedy_pack(t, p[2], bos, eos, length, pad)
                        for t, p in zip(tokens, packs)]
            out = [torch.full((self.visual.pack.max_images, length), pad, dtype=torch.long,
                              device=t.device) for t in tokens]
            for n, places in sorted(where.items()):
                image = torch.stack([tokens[k][at:at + n] for k, _, at in places], 1)
                ids = self._greedy(image, bos, eos, length, pad)  # image: [n, b, h]
                for (k, slot, _), row in zip(places, ids):
                    out[k][slot] = row
            return out

    def _greedy_pack(self, image_tokens: torch.Tensor, seg: torch.Tensor, bos: int, eos: int,
                     length: int, pad: int) -> torch.Tensor:
        """Greedy captions [M, length] of one image pack's slots (``image_tokens`` [T, h],
        the pack's ``seg``): the language model's pack laid out with a whole text of
        ``length`` a sample, run whole for each token; causal attention keeps the ids not
        yet chosen out of the positions read."""
        spec, device = self.text_pack, image_tokens.device
        M, text_length = spec.samples, spec.text_length
        if length > text_length:
            raise ValueError(f"greedy captions of {length} ids from a pack laid out for "
                             f"texts of {text_length} (lm.text_length)")
        # no EOS among the ids: every sample keeps its whole text in the layout
        layout = [t.to(device) for t in text_layout(
            seg, torch.full((M, text_length), bos, dtype=torch.long), eos, spec)]
        live = torch.bincount(seg, minlength=M + 1)[:M] > 0
        out = torch.full((M, text_length), pad, dtype=torch.long, device=device)
        out[:, 0] = bos

        def logits_at(i):
            hidden = self._packed_hidden(image_tokens, out, layout)
            return self._logits(hidden[layout[3][:, i - 1]][None])[0]
        out = greedy_ids(logits_at, out, ~live, eos, pad, length)
        out[~live] = pad
        return out[:, :length]

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
        if self.sequence_parallel:
            def logits_at(i):  # the whole sequence: a one-token step cannot be split
                hidden = self.language_model.decoder(hidden_states=self.lm_input(image, out),
                                                     attention_mask=None)
                return self.text_logits(hidden, length)[:, i - 1]
        else:
            cache = StaticInferenceContext(b, image.shape[0] + length)
            first = self.next_logits(image, out[:, :1], cache)
            cache.enable_decode_mode()

            def logits_at(i):
                return first if i == 1 else self.next_logits(image[:0], out[:, i - 1:i], cache)
        return greedy_ids(logits_at, out, done, eos, pad, length)


def greedy_ids(logits_at, out: torch.Tensor, done: torch.Tensor, eos: int, pad: int,
               length: int) -> torch.Tensor:
    """``out`` [b, >= length] with positions 1..length-1 filled by the argmax of
    ``logits_at(i)`` ([b, vocab (/ tp)], the logits after the ids before i), padding after a
    row's EOS and for rows ``done`` from the start; stops once every row is done."""
    for i in range(1, length):
        nxt = vocab_parallel_argmax(logits_at(i))
        out[:, i] = torch.where(done, pad, nxt)
        done |= nxt == eos
        if bool(done.all()):
            break
    return out


def build_caption(tower_arch, base: TransformerConfig, spec: str, lm, vocab_size: int, *,
                  seed: int = 0, class_token: bool = True, num_registers: int = 0,
                  fused_norm: bool = False, drop_path_rate: float = 0.0, tp_rank: int = 0,
                  first_stage: bool = True, last_stage: bool = True,
                  pad_to=None, pack=None, pos_interp: str = "bicubic") -> CaptionModel:
    """This rank's caption model. ``base``: the tower's TransformerConfig (precision, the
    parallel layout); ``lm``: the language model's sizes (the plan's ``Caption``: num_layers,
    hidden_size, num_heads, ffn_hidden_size, init_std, projector, text_length);
    ``first_stage`` / ``last_stage``: this rank's place in the pipeline (the tower and the
    projector on the first); ``pad_to``: micro-batch -> the multiple both models pad their
    token sequences to (sequence parallel, FP8; None: none): the tower with a key-padding
    mask, the language model at its causal end. Every weight is drawn layout-independently
    (vitgraph.models.init) under ``visual.``, ``projector.`` and ``language_model.``.
    ``pack`` (the image pack's PackSpec): native resolution (tp=1, pp=1), the tower takes
    packs (padded slots with a key mask) with positions resampled by ``pos_interp``, the
    language model packs of ``TextPackSpec.of(pack, lm.text_length)``; its position table
    covers the longest image (max_patches and the prefix tokens) and a whole text."""
    tp = base.tensor_model_parallel_size
    vocab = padded_vocab(vocab_size, tp)
    # the tower and the projector sit whole on the first pipeline stage
    one_stage = dataclasses.replace(base, pipeline_model_parallel_size=1,
                                    virtual_pipeline_model_parallel_size=None)
    visual = projector = None
    text_pack = TextPackSpec.of(pack, lm.text_length) if pack is not None else None
    ffn = lm.ffn_hidden_size or 4 * lm.hidden_size
    lcfg = dataclasses.replace(
        tower_config(base, hidden_size=lm.hidden_size, num_layers=lm.num_layers,
                     num_heads=lm.num_heads, ffn_hidden_size=ffn, activation="gelu",
                     eps=base.layernorm_epsilon),
        init_method_std=lm.init_std, init_method=None, output_layer_init_method=None,
        # megatron-core's own linears (the GPT's output layer, the projector) refuse fused
        # weight-gradient accumulation without APEX's kernel
        gradient_accumulation_fusion=base.gradient_accumulation_fusion and APEX_WGRAD)
    if first_stage:
        padding = pad_to is not None or (pack is not None and pack.padded)
        visual = ViT(one_stage, get_layer_spec(spec, padding_mask=padding, fused_norm=fused_norm,
                                               drop_path_rate=drop_path_rate),
                     tower_arch, 0, num_registers=num_registers, class_token=class_token,
                     head="none", pad_to=pad_to, pack=pack, pos_interp=pos_interp)
        init_weights(visual, seed, tp_rank, tp, prefix="visual.")
        # its input is the tower's gathered tokens: tensor-parallel linears, no sequence
        # split (the image's token count need not divide by tp)
        pcfg = dataclasses.replace(
            tower_config(one_stage, hidden_size=lm.hidden_size, num_layers=1,
                         num_heads=lm.num_heads,  # unused; TransformerConfig checks it
                         ffn_hidden_size=lm.hidden_size, activation="gelu",
                         eps=base.layernorm_epsilon),
            init_method_std=lm.init_std, sequence_parallel=False,
            gradient_accumulation_fusion=lcfg.gradient_accumulation_fusion)
        # (megatron-core's own initialisation draws from torch's RNG, which stage builds what
        # depends on the layout: the caller's is left untouched; init_weights draws again)
        with torch.random.fork_rng(devices=[]):
            projector = MultimodalProjector(
                pcfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                    linear_fc2=RowParallelLinear),
                lm.projector, tower_arch.hidden_size)
        init_weights(projector, seed, tp_rank, tp, prefix="projector.")
    image_len = sequence_length(tower_arch, class_token, num_registers)
    positions = text_pack.max_len if text_pack else image_len + lm.text_length
    with torch.random.fork_rng(devices=[]):
        language_model = GPTModel(lcfg, block_spec(spec, lcfg, causal=True), vocab,
                                  positions, pre_process=first_stage,
                                  post_process=last_stage, parallel_output=True,
                                  position_embedding_type="learned_absolute")
    init_weights(language_model, seed, tp_rank, tp, prefix="language_model.",
                 rows={"embedding.word_embeddings.weight": vocab_size,
                       "output_layer.weight": vocab_size})
    return CaptionModel(visual, projector, language_model, image_len=image_len,
                        text_length=lm.text_length, vocab_size=vocab_size, pad_to=pad_to,
                        text_pack=text_pack)

"""``VisionTower``: a vitgraph image tower as a plain ``torch.nn.Module``, for someone else's
training step (a VLM's, a probe's): images in, token embeddings out, gradients back to its
parameters from the caller's loss; its layers optionally CUDA-graphed (vitgraph.graphs).

    tower = VisionTower.from_name("vit_so400m_patch14_378", graphs=True)
    tokens = tower(images)              # [B, 3, H, W] -> [B, N, D] after the final norm
    packed = tower([img_a, img_b])      # native resolution (packing=...): PackedTokens

What it is made of, all vitgraph's: the registry's geometry (vitgraph.models.registry
``TowerArch``: a ViT's, an image-text pair's image tower's, or a Hugging Face config's), the
``ViT`` on megatron-core's TransformerBlock with the te spec on a GPU with Transformer Engine
and the torch spec otherwise (vitgraph.models.specs.resolve_spec), weights drawn as a caption
model's tower (vitgraph.models.init), the native-resolution pack of vitgraph.data.packing
through the packed forward the classifier trains on (vitgraph.models.packed), weights in
through vitgraph.convert, and per-layer graphs through ``GraphManager`` (on CPU its rerun
backend: the bookkeeping, not the speed).

Graphs and steps: the graph manager counts training steps for its warm-up
(``graphs.warmup_steps`` eager steps, then capture, then replay). Here a step begins at a
training forward (grad on, ``train()`` mode) when no graphed backward is pending, so the
plain loop (forward, backward, optimizer step) needs no call; several forwards before their
backwards (gradient accumulation) take a graph copy each (``graphs.max_slots``). Eval mode and
``torch.no_grad()`` run eagerly. Replace parameters (not copy into them) and call
``graphs.reset()``.

TE's fused weight-gradient accumulation (``gradient_accumulation_fusion``) writes megatron
DDP's ``main_grad``, which a plain torch optimizer does not have: it is off unless asked for.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vitgraph.config import run_model_config
from vitgraph.convert import init_from, load_file, read_checkpoint_weights
from vitgraph.convert.checkpoints import checkpoint_dir
from vitgraph.convert.clip_hf import hf_vision_arch
from vitgraph.data.packing import PackSpec, assemble, native_grid, patchify
from vitgraph.graphs import GraphManager, GraphsConfig
from vitgraph.models.build import build_tower
from vitgraph.models.registry import TowerArch, tower_arch, tower_of
from vitgraph.models.specs import resolve_spec
from vitgraph.parallel.setup import init_for_module


HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class Pack(NamedTuple):
    """Images back to back along the sequence (vitgraph.data.packing's layout) on the
    tower's device: ``x`` [T, 3 p^2] patch rows, ``coords`` [T, 4], ``seg`` [T],
    ``cu_seqlens`` [S + 1]; ``offsets`` / ``lengths`` [n]: where each image's tokens start
    (its class token and registers first) and how many it has."""
    x: torch.Tensor
    coords: torch.Tensor
    seg: torch.Tensor
    cu_seqlens: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor


class PackedTokens(NamedTuple):
    """A pack's tokens after the final norm: ``rows`` [T, D] (padding rows too: fixed
    shapes), image i's at ``rows[offsets[i]:offsets[i] + lengths[i]]``."""
    rows: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor

    def per_image(self) -> list[torch.Tensor]:
        """Each image's [n_i, D] (reads the offsets on the host)."""
        return [self.rows[o:o + n] for o, n in zip(self.offsets.tolist(), self.lengths.tolist())]


class VisionTower(torch.nn.Module):
    """An image tower (see the module docstring); build it with ``from_name``, ``from_arch``,
    ``from_hf`` or ``from_run``. ``visual``: the ViT (its state dict names are a caption
    model's); ``arch``: its TowerArch; ``graphs``: the GraphManager, or None."""

    def __init__(self, visual: torch.nn.Module, arch: TowerArch, graphs=None,
                 prefix_tokens: bool = True):
        super().__init__()
        self.visual, self.arch, self.graphs = visual, arch, graphs
        self.prefix_tokens = prefix_tokens

    # -------------------------------------------------------------------- building

    @classmethod
    def from_name(cls, name: str, *, image_size: int | None = None, weights=None,
                  weights_format: str = "auto", **kw) -> "VisionTower":
        """The tower of a registry name (``vitgraph models``: a ViT's, or an image-text
        pair's image tower), at ``image_size`` if given, with ``weights`` (see ``load``);
        ``kw``: ``from_arch``'s."""
        tower = cls.from_arch(tower_arch(name, image_size), **kw)
        if weights is not None:
            tower.load(weights, weights_format)
        return tower

    @classmethod
    def from_arch(cls, arch: TowerArch, *, spec: str = "auto", device=None,
                  dtype: torch.dtype = torch.float32, packing: dict | None = None,
                  graphs=False, seed: int = 0, prefix_tokens: bool = True,
                  gradient_accumulation_fusion: bool = False) -> "VisionTower":
        """A tower of ``arch`` on ``device`` (default: the current GPU, else the CPU).

        ``spec``: auto (te on a GPU with Transformer Engine, else torch) | te | torch;
        ``dtype``: the parameters' (floating inputs are cast to it); ``packing``: dict(tokens,
        max_patches, max_images=32, min_patches=1) to take native-resolution images, packed
        in ``tokens`` tokens, each image at most ``max_patches`` patches; ``graphs``: False |
        True | a dict of GraphsConfig keys (vitgraph.graphs.config; scope layer); ``seed``:
        the weights' (and, with graphs on a GPU, megatron's RNG tracker's);
        ``prefix_tokens``: outputs keep the class token and registers."""
        device = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        cuda = device.type == "cuda"
        spec = "torch" if spec == "auto" and not cuda else resolve_spec(spec)
        cfg = _graphs_config(graphs)
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            init_for_module(cuda, seed=seed, graphs=cfg is not None, te=spec == "te")
            vit = build_tower(arch, spec=spec, cuda=cuda, dtype=dtype, seed=seed,
                              pack=_pack_spec(arch, packing),
                              gradient_accumulation_fusion=gradient_accumulation_fusion)
        manager = None
        if cfg is not None:
            manager = GraphManager.for_model([vit], cfg, pipeline_size=1)
        return cls(vit, arch, manager, prefix_tokens)

    @classmethod
    def from_hf(cls, model, **kw) -> "VisionTower":
        """A Hugging Face CLIP / SigLIP / SigLIP 2 vision model (or the vision half of a
        ``CLIPModel`` / ``SiglipModel``): a transformers model, or a folder with its
        config.json and weights; its geometry from the config, its weights loaded; ``kw``:
        ``from_arch``'s."""
        if isinstance(model, (str, Path)):
            folder = Path(model)
            config = json.loads((folder / "config.json").read_text())
            found = [folder / f for f in HF_WEIGHTS if (folder / f).is_file()]
            if not found:
                raise FileNotFoundError(f"{folder}: none of {', '.join(HF_WEIGHTS)}")
            sd = load_file(found[0])
        else:
            config, sd = model.config.to_dict(), model.state_dict()
        arch, _ = hf_vision_arch(config)
        tower = cls.from_arch(arch, **kw)
        tower.load(sd, "hf_vision")
        return tower

    @classmethod
    def from_run(cls, run_dir, checkpoint=None, ema: bool = False, **kw) -> "VisionTower":
        """The image tower of a vitgraph run (a caption model's ``visual``, a pair's image
        tower or a classifier's encoder) with its newest (or ``checkpoint``'s) weights."""
        model_cfg, _ = run_model_config(run_dir)
        tower = cls.from_arch(tower_of(model_cfg), **kw)
        sd, _ = read_checkpoint_weights(checkpoint_dir(run_dir, checkpoint), ema=ema)
        tower.load(sd, "vitgraph")
        return tower

    def load(self, weights, fmt: str = "auto") -> dict:
        """Weights into the tower: a file (.safetensors / .pth / .bin), a vitgraph run folder
        (its newest checkpoint), a state dict or a module (timm, open_clip's visual, Hugging
        Face's vision model ...); ``fmt`` as model.init_format (auto: from the names). A head
        the tower has no place for is left out (logged). Returns vitgraph.convert's report."""
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        elif isinstance(weights, (str, Path)) and Path(weights).is_dir():
            weights, _ = read_checkpoint_weights(checkpoint_dir(weights))
        report = init_from(self.visual, weights, fmt)
        if self.graphs is not None:
            self.graphs.reset()
        return report

    # -------------------------------------------------------------------- running

    @property
    def width(self) -> int:
        return self.arch.vision.hidden_size

    @property
    def num_prefix(self) -> int:
        """Class token and registers in front of each image's patch tokens."""
        return self.arch.num_prefix

    @property
    def device(self) -> torch.device:
        return self.visual.pos_embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.pos_embed.dtype

    def forward(self, images, prefix_tokens: bool | None = None):
        """Images [B, 3, H, W] -> tokens [B, N, D] after the final norm; a list of [3, h, w]
        images or a ``Pack`` -> ``PackedTokens`` (the tower built with ``packing``).
        ``prefix_tokens``: keep the class token and registers (default: the tower's
        setting)."""
        keep = self.prefix_tokens if prefix_tokens is None else prefix_tokens
        if not isinstance(images, torch.Tensor):
            return self._packed(images if isinstance(images, Pack) else self.pack(images), keep)
        self._begin_step()
        tokens = self.visual.forward_features(images.to(self.dtype)).transpose(0, 1)
        return tokens if keep else tokens[:, self.num_prefix:]

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """SigLIP's attention pooling (a tower with ``arch.pool`` map) of ``forward``'s tokens
        [B, N, D] (prefix tokens kept) -> [B, D]: a Hugging Face SigLIP's pooler_output."""
        if self.visual.attn_pool is None:
            raise ValueError("this tower has no attention pooling (TowerArch.pool='none')")
        return self.visual.attn_pool(tokens[:, self.num_prefix:])

    def pack(self, images) -> Pack:
        """[3, h, w] images (normalised as the fixed path's) -> one ``Pack``: each image at
        its own size in whole patches (resized, bicubic, where it is not, or where it has
        more than ``max_patches`` or fewer than ``min_patches``: vitgraph.data.packing's
        native_grid). ValueError where they do not fit in one pack."""
        spec = self.visual.pack
        if spec is None:
            raise ValueError("native-resolution images need a tower built with packing=dict("
                             "tokens=..., max_patches=...)")
        p, rows, grids = spec.patch_size, [], []
        for img in images:
            h, w = img.shape[-2:]
            grid = native_grid(h, w, p, spec.max_patches, spec.min_patches)
            if (grid[0] * p, grid[1] * p) != (h, w):
                img = F.interpolate(img[None].float(), size=(grid[0] * p, grid[1] * p),
                                    mode="bicubic", align_corners=False, antialias=True)[0]
            rows.append(patchify(img.to(self.dtype).permute(1, 2, 0), p).cpu())
            grids.append(grid)
        x, coords, seg, cu, _ = assemble(rows, grids, [], spec)
        lengths = torch.tensor([spec.num_prefix + gh * gw for gh, gw in grids])
        fields = (x, coords, seg, cu, cu[:len(grids)].long(), lengths)
        return Pack(*(t.to(self.device, non_blocking=True) for t in fields))

    def _packed(self, pack: Pack, keep: bool) -> PackedTokens:
        self._begin_step()
        rows = self.visual.forward_features(pack.x.to(self.dtype), pack.coords, pack.seg,
                                            pack.cu_seqlens)
        if keep:
            return PackedTokens(rows, pack.offsets, pack.lengths)
        return PackedTokens(rows, pack.offsets + self.num_prefix, pack.lengths - self.num_prefix)

    def _begin_step(self) -> None:
        """A training forward with no graphed backward pending begins a step (module
        docstring)."""
        g = self.graphs
        if g is not None and self.training and torch.is_grad_enabled() and not g.in_flight():
            g.step_begin()


def _graphs_config(graphs) -> GraphsConfig | None:
    """``from_arch``'s ``graphs`` as a GraphsConfig, None for eager."""
    if graphs is None or graphs is False:
        return None
    if graphs is True:
        cfg = GraphsConfig(enabled=True)
    elif isinstance(graphs, GraphsConfig):
        cfg = graphs
    else:
        cfg = GraphsConfig.from_dict({"enabled": True, **graphs})
    if cfg.scope != "layer":
        raise ValueError("VisionTower graphs its layers (scope layer): a whole step is the "
                         "caller's to capture")
    return cfg if cfg.enabled is not False else None


def _pack_spec(arch: TowerArch, packing: dict | None) -> PackSpec | None:
    if packing is None:
        return None
    known = {"tokens", "max_patches", "max_images", "min_patches"}
    if set(packing) - known or not {"tokens", "max_patches"} <= set(packing):
        raise ValueError(f"packing={packing!r}: tokens and max_patches, optionally "
                         f"max_images (32) and min_patches (1)")
    return PackSpec(tokens=packing["tokens"], max_images=packing.get("max_images", 32),
                    max_patches=packing["max_patches"], num_prefix=arch.num_prefix,
                    patch_size=arch.vision.patch_size,
                    min_patches=packing.get("min_patches", 1))

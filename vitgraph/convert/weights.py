"""Weight files in and out: read ``.safetensors`` / ``.pth`` / ``.bin``, write safetensors, and
move a full (tp=1) vitgraph state dict into and out of a built model (any pipeline stage)."""
from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from vitgraph.convert.clip_hf import hf_vision_to_vitgraph, vision_part
from vitgraph.convert.naflex import naflex_to_vitgraph
from vitgraph.convert.names import ConvertError, detect_format, name_in_file, to_vitgraph
from vitgraph.convert.openclip import INTO_CLASSIFIER
from vitgraph.models.init import global_names as _global_names
from vitgraph.models.vit import unwrap
from vitgraph.output import written_whole

log = logging.getLogger("vitgraph")

_CONTAINERS = ("state_dict", "model", "module", "model_state_dict")


def load_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} from a ``.safetensors``, or a ``.pth`` / ``.pt`` / ``.bin`` torch
    file (read with ``weights_only=True``; a {"state_dict": ...} or {"model": ...} wrapper is
    opened)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConvertError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file as st_load
        return st_load(str(path), device="cpu")
    if path.suffix not in (".pth", ".pt", ".bin", ".ckpt"):
        raise ConvertError(f"{path}: expected .safetensors, .pth, .pt or .bin")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConvertError(f"{path}: not a plain tensor file ({type(e).__name__}: "
                           f"{str(e).splitlines()[0]})") from None
    while isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        inner = next((obj[k] for k in _CONTAINERS if isinstance(obj.get(k), dict)), None)
        if inner is None:
            break
        obj = inner
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    sd = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if sd and all(k.startswith("module.") for k in sd):  # saved from a DDP wrapper
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def save_safetensors(sd: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict | None = None) -> Path:
    """Write ``sd`` whole or not at all (vitgraph.output.written_whole) as safetensors;
    metadata values become strings. OSError when it cannot be written (safetensors' own error
    turned into one)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with written_whole(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=meta)
        except SafetensorError as e:  # "... I/O error: No space left on device (os error 28) ..."
            io = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
            raise (OSError(int(io[2]), io[1], str(path)) if io else OSError(f"{path}: {e}")
                   ) from None
    return path


# ---------------------------------------------------------------- model <-> full state dict


def _check_tp(vit) -> None:
    tp = vit.config.tensor_model_parallel_size
    if tp != 1:
        raise ConvertError(f"weights in/out work on tensor-parallel size 1 (this model has "
                           f"tp={tp}); gather or shard outside vitgraph.convert")


def export_state_dict(model_chunks, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This rank's model chunks as one {name: CPU tensor} with vitgraph's full-model names
    (global layer numbers, no TE ``_extra_state``). With pipeline stages each rank returns its
    share; the union over stages is the full model."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    out = {}
    for chunk in model_chunks:
        vit = unwrap(chunk)
        _check_tp(vit)
        names = _global_names(vit)
        for name, t in vit.state_dict().items():
            if name in names:
                t = t.detach().to("cpu")
                out[names[name]] = (t.to(dtype) if dtype is not None else t).contiguous()
    return out


def expected_names(arch, num_prefix: int, class_token: bool, num_registers: int,
                   pool: str = "cls", distill_token: bool = False) -> set[str]:
    """Every parameter name of the full model (``pool`` map: attention pooling before the
    head; ``distill_token``: DeiT's token and its head)."""
    names = {"patch_embed.weight", "patch_embed.bias", "pos_embed", "final_norm.weight",
             "final_norm.bias", "head.weight", "head.bias"}
    if distill_token:
        names |= {"dist_token", "head_dist.weight", "head_dist.bias"}
    if pool == "map":
        names |= {"attn_pool.latent", *(f"attn_pool.{m}.{k}" for m in
                                         ("q", "kv", "proj", "norm", "fc1", "fc2")
                                         for k in ("weight", "bias"))}
    if class_token:
        names.add("cls_token")
    if num_registers:
        names.add("registers")
    for i in range(arch.num_layers):
        for sub in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            names |= {f"decoder.layers.{i}.{sub}.{k}" for k in
                      ("layer_norm_weight", "layer_norm_bias", "weight", "bias")}
        for sub in ("self_attention.linear_proj", "mlp.linear_fc2"):
            names |= {f"decoder.layers.{i}.{sub}.{k}" for k in ("weight", "bias")}
    return names


def resize_pos_embed(pos: torch.Tensor, num_prefix: int, grid: int,
                     mode: str = "bicubic") -> torch.Tensor:
    """[1, prefix + g*g, d] -> [1, prefix + grid*grid, d], the patch grid resized (bicubic, or
    the model's ``pos_interp``: a native-resolution model resamples the grid with it)."""
    n = pos.shape[1] - num_prefix
    old = math.isqrt(n)
    if old * old != n:
        raise ConvertError(f"pos_embed: {n} patch positions are not a square grid "
                           f"(with {num_prefix} class/register tokens)")
    if old == grid:
        return pos
    prefix, patches = pos[:, :num_prefix], pos[:, num_prefix:]
    patches = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    patches = F.interpolate(patches, size=(grid, grid), mode=mode, align_corners=False)
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos.dtype)
    return torch.cat([prefix, patches], dim=1)


def _is_pair(m) -> bool:
    """A CLIP / SigLIP model (vitgraph.models.clip.CLIP): an image and a text tower."""
    return hasattr(m, "visual") and hasattr(m, "text")


def _is_tower(vit) -> bool:
    """A ViT built as CLIP's image tower (ln_pre, a projection or attention pooling)."""
    return any(part is not None for part in (vit.ln_pre, vit.proj, vit.attn_pool))


def heads_of(model) -> tuple[int, int | None]:
    """(image encoder's attention heads, text tower's or None) of a built model."""
    m = unwrap(model)
    if _is_pair(m):
        return m.visual.arch.num_heads, m.text.arch.num_heads
    return m.arch.num_heads, None


@torch.no_grad()
def load_into_model(model, sd: dict[str, torch.Tensor], source: str = "weights",
                    name_of=lambda name: name) -> dict:
    """Copy a full vitgraph state dict into ``model``: one classifier chunk (any pipeline
    stage), a CLIP / SigLIP pair, or a pair's image tower alone (``visual.*`` names).

    A head of another class count (or none in ``sd``) keeps the model's fresh init; position
    embeddings of another grid are resized; a pair whose weights have no text tower keeps its
    text tower (and logit scale / bias) as initialised; any other missing, unexpected or
    mis-shaped key is a ``ConvertError`` naming it (``name_of``: our name -> the file's, for
    those messages). Returns {"head_reinitialised": bool,
    "pos_embed_resized": (old, new) or None, "kept": [names left at their initial values]}.
    """
    vit = unwrap(model)
    _check_tp(vit)
    pair = _is_pair(vit)
    if not pair and _is_tower(vit) and any(k.startswith("visual.") for k in sd):
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    names = _global_names(vit)
    _check_unexpected(vit, sd, names, pair, source, name_of)
    no_text = pair and not any(k.startswith("text.") for k in sd)
    report = {"head_reinitialised": False, "pos_embed_resized": None, "kept": []}
    own = vit.state_dict()
    for local, name in names.items():
        target = own[local]
        if name not in sd:
            if name.startswith(("head.", "head_dist.")):
                report["head_reinitialised"] = True
                continue
            if pair and (name in ("logit_scale", "logit_bias")
                         or no_text and name.startswith("text.")):
                report["kept"].append(name)
                continue
            raise ConvertError(f"{source}: missing key {name_of(name)!r}")
        value = sd[name]
        if name.startswith(("head.", "head_dist.")) and value.shape != target.shape:
            report["head_reinitialised"] = True
            continue
        if name in ("pos_embed", "visual.pos_embed") and value.shape != target.shape:
            enc = vit.visual if pair else vit
            prefix = enc.num_prefix
            grid = math.isqrt(target.shape[1] - prefix)
            if value.shape[2] == target.shape[2]:
                report["pos_embed_resized"] = (tuple(value.shape), tuple(target.shape))
                value = resize_pos_embed(value, prefix, grid, getattr(enc, "pos_interp", None)
                                         or "bicubic")
        if value.shape != target.shape:
            raise ConvertError(f"{source}: {name_of(name)!r} has shape {tuple(value.shape)}, "
                               f"the model wants {tuple(target.shape)}")
        target.copy_(value.to(target.dtype))
    _log_report(report, vit, sd, pair, no_text)
    return report


def _check_unexpected(vit, sd: dict, names: dict, pair: bool, source: str, name_of) -> None:
    """A ConvertError naming the first key of ``sd`` that no part of the model has."""
    if pair or (vit.pre_process and vit.post_process):
        known = set(names.values())  # the whole model is here
    else:  # a pipeline stage: unexpected means unknown to every stage
        known = expected_names(vit.arch, vit.num_prefix, vit.class_token, vit.num_registers,
                               vit.global_pool, vit.distill_token)
    unexpected = sorted(set(sd) - known)
    if unexpected:
        raise ConvertError(f"{source}: unexpected key {name_of(unexpected[0])!r}"
                           + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                           + " for this model (check model.name, model.num_registers, "
                             "model.class_token, model.distill_token)")


def _log_report(report: dict, vit, sd: dict, pair: bool, no_text: bool) -> None:
    """One log line for each thing load_into_model did not copy as it came."""
    if report["head_reinitialised"] and getattr(vit, "post_process", False):
        have = sd.get("head.weight")
        log.info("init: head re-initialised (%s; the model has %d classes)",
                 f"the weights have {have.shape[0]} classes" if have is not None else
                 "the weights have no head", vit.head.weight.shape[0])
    if report["pos_embed_resized"] and (pair or vit.pre_process):
        log.info("init: position embeddings resized %s -> %s", *report["pos_embed_resized"])
    if report["kept"]:
        log.info("init: %d tensors not in the weights kept as initialised (%s)",
                 len(report["kept"]), "the text tower and the logit scale" if no_text
                 else ", ".join(report["kept"]))


def _size_of(sd: dict, prefix: str) -> dict | None:
    """Depth, width, patch and MLP sizes of the encoder in a full state dict (our names)."""
    patch = sd.get(prefix + "patch_embed.weight")
    if patch is None:
        return None
    layers = {int(m.group(1)) for k in sd
              if (m := re.match(re.escape(prefix) + r"decoder\.layers\.(\d+)\.", k))}
    fc1 = sd.get(prefix + "decoder.layers.0.mlp.linear_fc1.weight")
    return {"num_layers": len(layers), "hidden_size": patch.shape[0],
            "patch_size": patch.shape[-1],
            "ffn_hidden_size": fc1.shape[0] if fc1 is not None else None}


def _check_size(sd: dict, target, path) -> None:
    """Weights of another encoder size: one error that says both sizes and what to set."""
    vit, prefix = (target.visual, "visual.") if _is_pair(target) else (target, "")
    if _is_tower(vit) and not _is_pair(target) and any(k.startswith("visual.") for k in sd):
        prefix = "visual."
    have = _size_of(sd, prefix)
    if have is None:
        return
    a = vit.arch
    want = {"num_layers": a.num_layers, "hidden_size": a.hidden_size,
            "patch_size": a.patch_size, "ffn_hidden_size": a.ffn_hidden_size}
    differ = [k for k in want if have[k] is not None and have[k] != want[k]]
    if not differ:
        return

    def size(s):
        return (f"{s['num_layers']}-layer, {s['hidden_size']}-wide ViT (patch {s['patch_size']}, "
                f"MLP {s['ffn_hidden_size']})")
    keys = " / ".join(["model.name", *(f"model.{k}" for k in differ)])
    raise ConvertError(f"{path} holds a {size(have)}; this config builds a {size(want)}: "
                       f"set {keys} to the file's size")


def init_from(model, source, fmt: str = "auto", name: str | None = None) -> dict:
    """``model.init_from``: read ``source`` (a weights file, or a state dict already read,
    ``name``: the file it was read from, for the log and the errors), convert from ``fmt``
    (auto-detected), load. Into an image tower without a classifier head
    (a caption model's ``visual``, vitgraph.tower.VisionTower) the weights of a pair or a
    caption model give their ``visual.*`` tensors, and a classifier head, attention pooling or
    projection that the tower has no place for is left out; both are logged."""
    target = unwrap(model)
    path = name or ("the state dict" if isinstance(source, dict) else str(source))
    raw = dict(source) if isinstance(source, dict) else load_file(source)
    if fmt == "auto":
        fmt = detect_format(raw)
    if fmt == "open_clip" and not _is_pair(target):
        if not _is_tower(target):
            raise ConvertError(f"{path}: {INTO_CLASSIFIER}")
        if any(k.startswith("visual.") for k in raw):  # into the image tower: visual.* only
            unused = sum(not k.startswith("visual.") for k in raw)
            raw = {k: v for k, v in raw.items() if k.startswith("visual.")}
            if unused:
                log.info("init: image tower only: %d tensors of the text tower and logit scale "
                         "not used", unused)
    if fmt == "hf_vision":
        raw, unused = vision_part(raw)
        if unused:
            log.info("init: vision model only: %d tensors of the text model and logit scale "
                     "not used", len(unused))
    heads, text_heads = heads_of(target)
    if fmt == "timm_naflex":  # a SigLIP tower's names go where the target has its tower
        sd = naflex_to_vitgraph(raw, heads, tower=_is_pair(target))
    elif fmt == "hf_vision":
        sd = hf_vision_to_vitgraph(raw, heads, tower=_is_pair(target))
    else:
        sd = to_vitgraph(raw, fmt, heads, text_heads)
    if not _is_pair(target) and target.head is None and target.post_process:
        sd = _into_tower(sd, target)
    _check_size(sd, target, path)
    report = load_into_model(model, sd, source=path,
                             name_of=lambda name: name_in_file(fmt, name))
    log.info("init: weights from %s (%s)", path, fmt)
    return report


def _into_tower(sd: dict, vit) -> dict:
    """``sd`` as an image tower without a classifier head takes it (``init_from``)."""
    if any(k.startswith("visual.") for k in sd):  # a pair's or a caption model's tower
        unused = sum(not k.startswith("visual.") for k in sd)
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
        if unused:
            log.info("init: the image tower only: %d tensors of the rest of the model not used",
                     unused)
    lacking = tuple(prefix for prefix, part in (("head.", None), ("head_dist.", None),
                                                ("attn_pool.", vit.attn_pool),
                                                ("proj.", vit.proj)) if part is None)
    dropped = sorted(k for k in sd if k.startswith(lacking))
    if dropped:
        log.info("init: %d tensors of a head the tower has no place for not used (%s)",
                 len(dropped), ", ".join(dropped[:3]) + (" ..." if len(dropped) > 3 else ""))
    return {k: v for k, v in sd.items() if not k.startswith(lacking)}

"""timm NaFlexVit weights in and out (vitgraph.convert.naflex), CPU, fp32, tiny widths.

The same function: vitgraph's packed forward (one pack of images of different grids) equals
timm's NaFlexVit forward (the images padded to the batch's longest, patch_valid masks,
``pos_embed_use_grid_sample=True``) with the weights moved timm -> vitgraph, and vitgraph ->
timm; timm -> vitgraph -> timm gives back the same tensors. The SigLIP 2 NaFlex entry points
convert; the LayerScale variants are refused with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitgraph.convert import ConvertError, detect_format, from_vitgraph, to_vitgraph
from vitgraph.convert.naflex import naflex_model_args, naflex_to_vitgraph, vitgraph_to_naflex
from vitgraph.convert.weights import export_state_dict, load_into_model
from vitgraph.data.packing import PackSpec, assemble
from vitgraph.models.registry import ViTArch

from conftest import ROOT, normalise_patches, world_of_one

timm = pytest.importorskip("timm")
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg  # noqa: E402

dist1 = world_of_one("torch")

P, D, HEADS, FFN = 4, 32, 4, 64
GRIDS = [(3, 5), (4, 4), (2, 7), (6, 2)]
# name -> (class token, registers, our pool / head, activation, position interpolation)
KINDS = {
    "siglip": (False, 0, "map", "gelu_tanh", "bilinear"),  # naflexvit_*_siglip's layout
    "cls": (True, 2, "cls", "gelu", "bicubic"),
    "mean": (True, 1, "mean", "gelu", "bilinear"),
    "map": (True, 1, "map", "gelu", "bicubic"),  # a classifier on attention pooling
}


def arch(grid=4):
    return ViTArch(hidden_size=D, num_layers=2, num_heads=HEADS, ffn_hidden_size=FFN,
                   patch_size=P, image_size=grid * P)


def timm_model(kind, grid=4, num_classes=0, seed=0):
    cls, regs, pool, act, interp = KINDS[kind]
    args = naflex_model_args(arch(grid), class_token=cls, num_registers=regs, pool=pool,
                             activation=act, pos_interp=interp, num_classes=num_classes)
    num_classes = args.pop("num_classes")
    torch.manual_seed(seed)
    m = NaFlexVit(NaFlexVitCfg(**args), num_classes=num_classes).eval()
    with torch.no_grad():  # away from the init's ones, zeros and 1e-6 tokens
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def our_model(d, kind, num_classes=0, seed=1):
    from vitgraph.models.build import transformer_config
    from vitgraph.models.clip import tower_config
    from vitgraph.models.specs import get_layer_spec
    from vitgraph.models.vit import ViT
    from vitgraph.plan import resolve
    from vitgraph.config import load_config
    cls, regs, pool, act, interp = KINDS[kind]
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    config = tower_config(transformer_config(resolve(cfg, d.world), cfg.model, d), hidden_size=D,
                          num_layers=2, num_heads=HEADS, ffn_hidden_size=FFN, activation=act,
                          eps=1e-6)
    spec = PackSpec(tokens=128, max_images=5, max_patches=24, num_prefix=int(cls) + regs,
                    patch_size=P)
    torch.manual_seed(seed)
    tower = kind == "siglip"  # an image tower: attention pooling, no head
    m = ViT(config, get_layer_spec("torch"), arch(), num_classes, num_registers=regs,
            class_token=cls, pool="mean" if tower else pool,
            head="map" if tower else "classifier",
            patch_bias=True, pack=spec, pos_interp=interp)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m.eval(), spec


def images(grids, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (gh * gw, 3 * P * P), generator=g, dtype=torch.uint8)
            for gh, gw in grids]


def ours_forward(model, spec, rows, grids):
    patches, coords, seg, cu, _ = assemble(rows, grids, [0] * len(grids), spec)
    with torch.no_grad():
        return model(normalise_patches(patches, "cpu"), coords, seg, cu)[:len(grids)]


def timm_forward(model, rows, grids):
    """timm's NaFlex batch: (row, col, channel) patch rows padded to the longest image,
    (y, x) coordinates, validity masks."""
    n = max(gh * gw for gh, gw in grids)
    x = torch.zeros(len(grids), n, 3 * P * P)
    coord = torch.zeros(len(grids), n, 2, dtype=torch.long)
    valid = torch.zeros(len(grids), n, dtype=torch.bool)
    for i, (r, (gh, gw)) in enumerate(zip(rows, grids)):
        k = gh * gw
        x[i, :k] = normalise_patches(r, "cpu").view(k, 3, P, P).permute(0, 2, 3, 1).reshape(k, -1)
        idx = torch.arange(k)
        coord[i, :k, 0], coord[i, :k, 1] = idx // gw, idx % gw
        valid[i, :k] = True
    with torch.no_grad():
        return model(x, patch_coord=coord, patch_valid=valid)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_timm_weights_in_give_timm_s_forward_and_come_out_the_same(dist1, kind):
    classes = 0 if kind == "siglip" else 6
    theirs = timm_model(kind, num_classes=classes)
    sd = theirs.state_dict()
    assert detect_format(sd) == "timm_naflex"
    ours, spec = our_model(dist1, kind, num_classes=classes)
    report = load_into_model(ours, to_vitgraph(sd, "timm_naflex", HEADS))
    assert report["pos_embed_resized"] is None and not report["head_reinitialised"]
    rows = images(GRIDS)
    torch.testing.assert_close(ours_forward(ours, spec, rows, GRIDS),
                               timm_forward(theirs, rows, GRIDS), atol=2e-5, rtol=1e-5)
    back = from_vitgraph(export_state_dict(ours), "timm_naflex", HEADS)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("kind", ["cls", "siglip"])
def test_our_weights_out_give_our_forward_in_timm(dist1, kind):
    """Our prefix tokens' position entries (timm has none) are added into the tokens."""
    classes = 0 if kind == "siglip" else 6
    ours, spec = our_model(dist1, kind, num_classes=classes)
    if kind == "cls":
        assert ours.pos_embed[0, :ours.num_prefix].abs().sum() > 0
    theirs = timm_model(kind, num_classes=classes, seed=5)
    theirs.load_state_dict(vitgraph_to_naflex(export_state_dict(ours), HEADS), strict=True)
    grids = [(5, 3), (1, 6), (4, 4)]
    rows = images(grids, seed=3)
    torch.testing.assert_close(timm_forward(theirs, rows, grids),
                               ours_forward(ours, spec, rows, grids), atol=2e-5, rtol=1e-5)


def test_another_grid_is_resampled_with_the_model_s_interpolation(dist1):
    theirs = timm_model("siglip", grid=6)
    ours, _ = our_model(dist1, "siglip")
    report = load_into_model(ours, naflex_to_vitgraph(theirs.state_dict(), HEADS))
    assert report["pos_embed_resized"] == ((1, 36, D), (1, 16, D))
    want = F.interpolate(theirs.embeds.pos_embed.detach().permute(0, 3, 1, 2), size=(4, 4),
                         mode="bilinear", align_corners=False)
    torch.testing.assert_close(ours.pos_embed.detach()[0].view(4, 4, D), want[0].permute(1, 2, 0))


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_siglip",
                                  "naflexvit_so400m_patch16_siglip"])
def test_siglip_naflex_entry_points_are_image_towers(name):
    m = timm.create_model(name, embed_dim=32, depth=2, num_heads=4, num_classes=0)
    sd = m.state_dict()
    ours = naflex_to_vitgraph(sd, 4)
    assert all(k.startswith("visual.") for k in ours)
    assert ours["visual.pos_embed"].shape == (1, 16 * 16, 32)  # no prefix tokens, 16 x 16 grid
    assert ours["visual.patch_embed.weight"].shape == (32, 3, 16, 16)
    assert "visual.attn_pool.fc1.weight" in ours and "visual.head.weight" not in ours
    back = vitgraph_to_naflex(ours, 4)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name,why", [
    ("naflexvit_base_patch16_gap", "LayerScale"),
    ("naflexvit_base_patch16_map", "LayerScale"),
    ("naflexvit_so150m2_patch16_reg1_gap", "LayerScale"),
    ("naflexvit_base_patch16_parfac_gap", "factorized position embeddings"),
])
def test_variants_without_a_counterpart_are_refused_with_the_reason(name, why):
    m = timm.create_model(name, embed_dim=32, depth=1, num_heads=4, num_classes=3)
    with pytest.raises(ConvertError, match=why):
        naflex_to_vitgraph(m.state_dict(), 4)


def test_gap_variants_name_both_layer_scale_and_fc_norm():
    m = timm.create_model("naflexvit_base_patch16_gap", embed_dim=32, depth=1, num_heads=4)
    with pytest.raises(ConvertError, match=r"ls1\.gamma.*LayerScale.*fc_norm.*after the pooling"):
        naflex_to_vitgraph(m.state_dict(), 4)


def test_non_square_grid_and_rope_are_refused():
    sd = timm_model("siglip").state_dict()
    sd["embeds.pos_embed"] = torch.zeros(1, 4, 6, D)
    with pytest.raises(ConvertError, match="square"):
        naflex_to_vitgraph(sd, HEADS)
    del sd["embeds.pos_embed"]
    with pytest.raises(ConvertError, match="learned position grid"):
        naflex_to_vitgraph(sd, HEADS)


def test_naflex_config_rebuilds_the_same_timm_model():
    from vitgraph.convert.export_files import timm_naflex_config
    side = timm_naflex_config(arch(), class_token=False, num_registers=0, pool="map",
                              activation="gelu_tanh", pos_interp="bilinear", num_classes=0,
                              classes=None)
    m = timm.create_model(side["architecture"], num_classes=0, **side["model_args"])
    ref = timm_model("siglip")
    assert {k: v.shape for k, v in m.state_dict().items()} == \
        {k: v.shape for k, v in ref.state_dict().items()}
    assert m.embeds.pos_embed_use_grid_sample and m.embeds.pos_embed_interp_mode == "bilinear"
    assert type(m.blocks[0].mlp.act).__name__ == "GELUTanh"
    # the so400m width: timm's MLP is int(dim * mlp_ratio) wide
    so400m = ViTArch(1152, 27, 16, 4304, 16, 256)
    args = naflex_model_args(so400m, class_token=False, num_registers=0, pool="map",
                             activation="gelu_tanh", pos_interp="bilinear", num_classes=0)
    assert int(1152 * args["mlp_ratio"]) == 4304


@pytest.mark.parametrize("name,over", [("vit_pico_patch4_32", {"num_registers": 2}),
                                       ("vit_pico_patch4_32", {"class_token": False}),
                                       ("vit_pico_patch4_32", {"pool": "map"}),
                                       ("siglip_tiny_patch4_32", {})])
def test_a_run_s_naflex_config_builds_the_model_its_export_fills(name, over):
    """What `vitgraph export --format timm` of a native run writes beside its weights."""
    from vitgraph.config import ModelConfig
    from vitgraph.convert.export_files import timm_naflex_config_for
    from vitgraph.convert.naflex import export_format
    from vitgraph.convert.weights import expected_names
    from vitgraph.models.registry import CLIP_MODELS, resolve_arch
    assert export_format("timm", True) == "timm_naflex" and export_format("timm", False) == "timm"
    assert export_format("hf", True) == "hf"
    cfg = ModelConfig(name=name, **over)
    side = timm_naflex_config_for(cfg, 7, ["c%d" % i for i in range(7)])
    pair = name in CLIP_MODELS
    m = timm.create_model(side["architecture"], num_classes=side["num_classes"],
                          **side["model_args"])
    arch = resolve_arch(cfg)
    ours = naflex_to_vitgraph(m.state_dict(), arch.num_heads, tower=pair)
    if pair:  # the SigLIP tower: attention pooling, no class token, bilinear
        assert side["model_args"]["pos_embed_interp_mode"] == "bilinear"
        assert "visual.attn_pool.latent" in ours and "visual.cls_token" not in ours
        assert ours["visual.pos_embed"].shape == (1, (arch.image_size // arch.patch_size) ** 2,
                                                  arch.hidden_size)
        return
    assert side["label_names"][0] == "c0" and side["num_classes"] == 7
    want = expected_names(arch, int(cfg.class_token) + cfg.num_registers, cfg.class_token,
                          cfg.num_registers, cfg.pool)
    assert set(ours) == want
    prefix = int(cfg.class_token) + cfg.num_registers
    assert ours["pos_embed"].shape == (1, prefix + arch.num_patches(), arch.hidden_size)
    pool = {"cls": "token", "map": "map"}.get(cfg.pool) if cfg.class_token else "avg"
    assert side["model_args"]["global_pool"] == pool

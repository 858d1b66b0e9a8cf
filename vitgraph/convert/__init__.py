"""Weights in and out: timm, Hugging Face and open_clip names <-> vitgraph's (megatron-core's).

- ``to_vitgraph`` / ``from_vitgraph``: rename and re-lay a full (tp=1) state dict: timm and
  Hugging Face ViT classifiers (names.py), open_clip CLIP image towers and pairs
  (openclip.py), Hugging Face CLIP / SigLIP pairs and their vision models alone (clip_hf.py,
  ``hf_vision``: CLIPVisionModel, SiglipVisionModel, Siglip2VisionModel); each describes its
  names as tables that one walker applies (tables.py);
- ``load_file`` / ``save_safetensors``: weight files;
- ``init_from`` / ``load_into_model``: weights into a built model, a classifier chunk, a CLIP
  pair or its image tower (head re-init, position embedding resize, an error naming any
  missing or unexpected key);
- ``export_state_dict``: a model's weights out, with full-model names;
- ``read_checkpoint_weights``: the model weights of a training checkpoint's step directory.
"""
from vitgraph.convert.names import (FORMATS, ConvertError, detect_format, from_vitgraph,
                                    to_vitgraph)
from vitgraph.convert.run_weights import read_checkpoint_weights, read_dist_weights
from vitgraph.convert.weights import (export_state_dict, heads_of, init_from, load_file,
                                      load_into_model, save_safetensors, unwrap)

__all__ = ["FORMATS", "ConvertError", "detect_format", "export_state_dict",
           "from_vitgraph", "heads_of", "init_from", "load_file", "load_into_model",
           "read_checkpoint_weights", "read_dist_weights", "save_safetensors", "to_vitgraph",
           "unwrap"]

"""Tiny image segmentation checkpoints built locally, for the tests and the benchmarks.

The vision counterpart of :mod:`AutoXLA.tiny`: random weights, real ``save_pretrained`` output
(several safetensors shards and an index), so they load through exactly the path a hub checkpoint
takes. Every model is small enough for a CPU forward well under a second, but keeps its
architecture's quirks: SAM's fused qkv and decomposed relative position tables (first dimension
``2 * size - 1``, odd, so they never divide a mesh axis and must be replicated), windowed attention
whose windows do not tile the feature map (padding), the two-way mask decoder with its output
upscaling (``upscale_conv1/2``) and ``iou_prediction_head``, Hiera's query pooling, deformable
attention, Swin/ConvNeXt backbones, BatchNorm buffers. Head counts are multiples of 2 (they split
over a model axis of 2) but not of 8 (they do not split over 8 devices), a few are odd, and query,
label and channel counts are chosen so that some do not divide 8.

No network: backbones are given as explicit transformers configs (never a timm name or a hub
checkpoint), so building a model never downloads anything.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..modeling.pipeline import pick_auto_class
from ..modeling.segmentation import auto_classes
from .tiny import config_from_table

# The SAM family's prompt encoder and two-way mask decoder: 2 heads (attention_downsample_rate 2:
# 16 internal channels), an iou_prediction_head of hidden size 20, 3 multimask outputs + 1.
_SAM_DECODER = dict(hidden_size=32, mlp_dim=64, num_hidden_layers=2, num_attention_heads=2,
                    iou_head_depth=3, iou_head_hidden_dim=20)


def _sam_prompts(image_size: int, patch_size: int) -> dict:
    return dict(hidden_size=32, image_size=image_size, patch_size=patch_size,
                mask_input_channels=8)


# family -> (config class name, its keywords). Sub-configs are plain dicts; backbones carry their
# ``model_type`` so transformers builds its own (random, local) backbone from them.
FAMILIES = {
    # ViT encoder with fused qkv (36 -> 108), 6 heads of 6, decomposed relative positions: the
    # windowed layer's tables are (2*3-1, 6) = (5, 6), the global layer's (2*8-1, 6) = (15, 6).
    # Window 3 does not tile the 8x8 patch grid, so windowed attention pads. Two-way mask decoder
    # with 2 heads (attention_downsample_rate 2: 16 internal channels), iou_prediction_head of
    # hidden size 20, output upscaling 32 -> 8 -> 4 channels (transformers names it upscale_conv1,
    # upscale_layer_norm, upscale_conv2), 3 multimask outputs + 1.
    "sam": ("SamConfig", dict(
        vision_config=dict(hidden_size=36, output_channels=32, num_hidden_layers=2,
                           num_attention_heads=6, image_size=64, patch_size=8, window_size=3,
                           global_attn_indexes=[1], num_pos_feats=16, mlp_dim=72),
        prompt_encoder_config=_sam_prompts(image_size=64, patch_size=8),
        mask_decoder_config=_SAM_DECODER,
    )),
    # Hiera backbone (4 stages, query pooling between them, one global block, windows of 8/4/4/2,
    # stage widths 16/24/40/64 with 1/2/2/4 heads), FPN to 32 channels, SAM2 mask decoder with the
    # high-resolution skip convolutions (conv_s0/conv_s1) and object-score head, 2 heads.
    "sam2": ("Sam2Config", dict(
        vision_config=dict(
            backbone_config=dict(model_type="sam2_hiera_det_model", hidden_size=16,
                                 num_attention_heads=1, image_size=[128, 128],
                                 blocks_per_stage=[1, 1, 2, 1],
                                 embed_dim_per_stage=[16, 24, 40, 64],
                                 num_attention_heads_per_stage=[1, 2, 2, 4],
                                 window_size_per_stage=[8, 4, 4, 2], global_attention_blocks=[3],
                                 window_positional_embedding_background_size=[7, 7]),
            backbone_channel_list=[64, 40, 24, 16],
            backbone_feature_sizes=[[32, 32], [16, 16], [8, 8]], fpn_hidden_size=32),
        prompt_encoder_config=_sam_prompts(image_size=128, patch_size=16),
        mask_decoder_config=_SAM_DECODER,
    )),
    # SAM 3's point-prompted (interactive) model: the SAM 3 ViT (2-D rope, windowed + global
    # attention, patch 14, so the 8x8 grid of a 112 image) behind a 4-scale FPN (x4, x2, x1, x0.5;
    # the tracker uses the first three, so ``neck.fpn_layers.3`` is saved and loaded but never
    # changes an output) and the SAM2-style mask decoder. transformers' ``Sam3Model``
    # (``Sam3Config``) is the text-prompted detector: it needs a CLIP text tower and token ids, has
    # no iou head, and is in none of the segmentation auto mappings, so it is not the family here.
    "sam3": ("Sam3TrackerConfig", dict(
        vision_config=dict(
            model_type="sam3_vision_model",
            backbone_config=dict(model_type="sam3_vit_model", hidden_size=40, intermediate_size=72,
                                 num_hidden_layers=2, num_attention_heads=2, image_size=112,
                                 patch_size=14, window_size=4, global_attn_indexes=[1],
                                 pretrain_image_size=56),
            fpn_hidden_size=32, scale_factors=[4.0, 2.0, 1.0, 0.5],
            backbone_feature_sizes=[[32, 32], [16, 16], [8, 8]]),
        prompt_encoder_config=_sam_prompts(image_size=112, patch_size=14),
        mask_decoder_config=_SAM_DECODER,
    )),
    # Swin backbone (stages 12/24/48/96 with 1/2/3/6 heads, window 4 so the relative position
    # bias tables are (49, heads)), multi-scale deformable-attention pixel decoder (1 layer,
    # 2 heads, 3 levels, 4 points), masked-attention transformer decoder (decoder_layers - 1 = 2
    # layers, 2 heads), 10 queries and 5 labels (+1 "no object" = 6 class logits).
    "mask2former": ("Mask2FormerConfig", dict(
        backbone_config=dict(model_type="swin", image_size=64, patch_size=4, embed_dim=12,
                             depths=[1, 1, 1, 1], num_heads=[1, 2, 3, 6], window_size=4,
                             mlp_ratio=2.0, drop_path_rate=0.0,
                             out_features=["stage1", "stage2", "stage3", "stage4"]),
        feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=64,
        encoder_layers=1, decoder_layers=3, num_attention_heads=2, dim_feedforward=64,
        num_queries=10, num_labels=5,
    )),
    # Mix Transformer encoder: overlapping patch embeddings, efficient attention with spatial
    # reduction (sr 8/4/2/1), stages 16/32/48/60 with heads 1/2/3/6, Mix-FFN depthwise conv;
    # all-MLP decoder of 36 channels with a BatchNorm (running stats are buffers), 5 labels.
    "segformer": ("SegformerConfig", dict(
        num_encoder_blocks=4, depths=[1, 1, 1, 1], sr_ratios=[8, 4, 2, 1],
        hidden_sizes=[16, 32, 48, 60], num_attention_heads=[1, 2, 3, 6], mlp_ratios=[2, 2, 2, 2],
        decoder_hidden_size=36, drop_path_rate=0.0, num_labels=5,
    )),
    # ConvNeXt backbone (stages 16/20/36/60: three do not divide 8) under UperNet's PSP + FPN
    # head (pool scales 1/2/3/6, the 6 larger than the 2x2 last feature map) and the auxiliary FCN
    # head, BatchNorms throughout. layer_scale_init_value=1 so the ConvNeXt blocks are not
    # identities (the 1e-6 default would hide a wrong shard of their weights).
    "upernet": ("UperNetConfig", dict(
        backbone_config=dict(model_type="convnext", hidden_sizes=[16, 20, 36, 60],
                             depths=[1, 1, 1, 1], layer_scale_init_value=1.0, drop_path_rate=0.0,
                             out_features=["stage1", "stage2", "stage3", "stage4"]),
        hidden_size=32, pool_scales=[1, 2, 3, 6], use_auxiliary_head=True, auxiliary_channels=16,
        num_labels=5,
    )),
}

# family -> (model class name, pixel size of the square input image).
_MODEL = {
    "sam": ("SamModel", 64),
    "sam2": ("Sam2Model", 128),
    "sam3": ("Sam3TrackerModel", 112),
    "mask2former": ("Mask2FormerForUniversalSegmentation", 64),
    "segformer": ("SegformerForSemanticSegmentation", 64),
    "upernet": ("UperNetForSemanticSegmentation", 64),
}

# family -> packages (transformers' ``is_<name>_available``) its model needs beyond torch.
# Mask2Former builds its Hungarian-matching loss (scipy.optimize) in ``__init__``, even for
# inference, so without scipy the model cannot be constructed at all.
_REQUIRES = {"mask2former": ("scipy",)}

# Families prompted with points, as (point_batch_size, points_per_prompt).
_POINT_PROMPTS = {"sam": (2, 3), "sam2": (2, 3), "sam3": (2, 3)}

def available_families() -> list[str]:
    import transformers
    from transformers import utils

    return [f for f, (cls, _) in FAMILIES.items()
            if hasattr(transformers, cls) and hasattr(transformers, _MODEL[f][0])
            and all(getattr(utils, f"is_{r}_available")() for r in _REQUIRES.get(f, ()))]


def missing_families() -> dict[str, str]:
    """family -> why it is not in ``available_families()`` (empty when all are)."""
    import transformers
    from transformers import utils

    why = {}
    for f, (cls, _) in FAMILIES.items():
        absent = [n for n in (cls, _MODEL[f][0]) if not hasattr(transformers, n)]
        if absent:
            why[f] = f"transformers {transformers.__version__} has no {', '.join(absent)}"
            continue
        lacking = [r for r in _REQUIRES.get(f, ()) if not getattr(utils, f"is_{r}_available")()]
        if lacking:
            why[f] = f"{_MODEL[f][0]} needs {', '.join(lacking)}, not installed"
    return why


def tiny_config(family: str, **overrides):
    return config_from_table(FAMILIES, family, overrides)


def model_class(family: str):
    """The transformers class a family's checkpoint is (and loads back as)."""
    import transformers

    if family not in _MODEL:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    return getattr(transformers, _MODEL[family][0])


def image_size(family: str) -> int:
    """Side of the square ``pixel_values`` the family's model takes."""
    return _MODEL[family][1]


def _fan_in(module: torch.nn.Module, weight: torch.Tensor) -> float:
    if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
        # (in, out / groups, *kernel): each output sees in * kernel / stride inputs.
        return weight.shape[0] * math.prod(module.kernel_size) / math.prod(module.stride)
    return weight[0].numel()  # Linear (out, in), Conv (out, in / groups, *kernel)


def widen_(model: torch.nn.Module) -> torch.nn.Module:
    """Widens the random init in place so that every weight shows in the outputs.

    transformers' init is tiny for these models (std 0.02, zeros for SAM's relative position
    tables and Hiera's window position embeddings): their outputs come out near 1e-5 and nearly
    equal across inputs. The causal-LM fixtures redraw at a flat std 0.2, which here would
    compound through the convolutions (fan-in up to ~1,700: UperNet's 3x3 over 188 channels).
    So, in place, with the global torch RNG:

    * linear and convolution weights are redrawn as N(0, 1 / fan_in), which keeps activations
      O(1) through any depth;
    * every other parameter of 2 or more dims (embeddings, position tables, rel_pos, query and
      level embeddings, Swin's bias tables) is redrawn as N(0, 0.2^2), as in ``tiny.py``, unless
      it is already wider (SAM's random Fourier features, std hidden_size / 2, stay);
    * BatchNorm running statistics are redrawn per channel (mean N(0, 0.1^2), var U(0.5, 1.5)),
      so that a wrong shard of those buffers would show too.

    Biases and norm weights stay as initialised (zeros and ones), as in ``tiny.py``.
    """
    with torch.no_grad():
        done = set()
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
                m.weight.normal_(0.0, 1.0 / math.sqrt(_fan_in(m, m.weight)))
                done.add(m.weight)
            elif isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
        for p in model.parameters():
            if p.dim() >= 2 and p not in done and (p.numel() < 2 or p.float().std() < 0.2):
                p.normal_(0.0, 0.2)
    return model


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """The family's tiny model with widened random weights, as ``save_tiny_segmentation`` saves it.

    Deterministic in ``seed``: built through the auto class the segmentation loader picks, so
    this is also the object a reloaded checkpoint must equal.
    """
    config = tiny_config(family, **overrides)

    auto = pick_auto_class(auto_classes(), config)
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=dtype)
    expected = model_class(family)
    if type(model) is not expected:
        raise RuntimeError(f"{auto.__name__} built {type(model).__name__}, not {expected.__name__}")
    return widen_(model)


def save_tiny_segmentation(family: str, directory: str | os.PathLike, *, seed: int = 0,
                           dtype: torch.dtype = torch.float32, max_shard_size: str | int = "64KB",
                           **overrides) -> Path:
    """Builds the family's tiny model with random weights and saves it (sharded) to ``directory``.

    The 64KB default gives 6 (SAM) to 13 (Mask2Former) safetensors shards plus
    ``model.safetensors.index.json``. Keys are written as transformers 5 writes them, which is
    the hub layout, not always ``state_dict()``'s: the SAM 3 tracker's are all under
    ``tracker_model.detector_model.`` (facebook/sam3's layout), SegFormer's encoder and decode head
    and Mask2Former's Swin keep their legacy names; ``from_pretrained`` maps them back. No image
    processor config is written: every segmentation image processor of transformers 5.24 needs
    torchvision or PIL, which the project does not install.
    """
    model = tiny_model(family, seed=seed, dtype=dtype, **overrides)
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def tiny_inputs(family: str, batch: int = 2, seed: int = 0, size: int | None = None) -> dict:
    """Random model inputs for ``family``, deterministic in ``seed``.

    ``pixel_values``: (batch, 3, S, S) float32, N(0, 1) (what a normalising image processor
    gives), S = ``size`` or ``image_size(family)`` (the tiny model's). SAM families also get ``input_points`` (batch, 2, 3, 2):
    2 prompts of 3 (x, y) points each, in pixels of the S x S input, and ``input_labels``
    (batch, 2, 3) int64 in {0, 1} (background / foreground).
    """
    if family not in _MODEL:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    size = size or image_size(family)
    g = torch.Generator().manual_seed(seed)
    inputs = {"pixel_values": torch.randn(batch, 3, size, size, generator=g)}
    if family in _POINT_PROMPTS:
        prompts, points = _POINT_PROMPTS[family]
        inputs["input_points"] = torch.rand(batch, prompts, points, 2, generator=g) * size
        inputs["input_labels"] = torch.randint(0, 2, (batch, prompts, points), generator=g)
    return inputs


def comparable_outputs(family: str, output) -> dict[str, torch.Tensor]:
    """The output tensors a test compares for ``family``."""
    if family in _POINT_PROMPTS:
        names = ("pred_masks", "iou_scores")
    elif family == "mask2former":
        names = ("class_queries_logits", "masks_queries_logits")
    elif family in ("segformer", "upernet"):
        names = ("logits",)
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    return {n: output[n] for n in names}


# SAM 3's text-prompted detector (transformers' Sam3Model, what facebook/sam3's Sam3Config builds):
# kept out of FAMILIES because it takes other inputs (token ids, box prompts) and gives other
# outputs (boxes and logits per query, a semantic map) than the families above, so it has its own
# helpers and tests (tests/segmentation/test_sam3_model.py). The parts: the tracker family's ViT
# and 4-scale FPN (the detector uses the first three scales); a CLIP text tower (2 layers, 2 heads
# of 12, vocabulary 96, at most 12 tokens: its position table (12, 24) does not divide 8); a
# geometry encoder for boxes (ROI-align pooling 3x3, 1 layer with self- and cross-attention);
# a DETR-style encoder (1 layer) and decoder (2 layers, 6 queries: not a multiple of 8, with box,
# presence and reference-point MLP heads); the mask decoder (3-stage pixel decoder, mask embedder
# MLP, prompt cross-attention) and the dot-product scoring of queries against the prompt. Every
# attention has 2 heads of 16 over width 32.
_SAM3_WIDTH = 32
SAM3_DETECTOR = ("Sam3Config", dict(
    vision_config=FAMILIES["sam3"][1]["vision_config"],
    text_config=dict(model_type="clip_text_model", vocab_size=96, hidden_size=24,
                     intermediate_size=48, projection_dim=16, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=12, pad_token_id=0,
                     bos_token_id=94, eos_token_id=95),
    geometry_encoder_config=dict(hidden_size=_SAM3_WIDTH, num_layers=1, num_attention_heads=2,
                                 intermediate_size=64, roi_size=3),
    detr_encoder_config=dict(hidden_size=_SAM3_WIDTH, num_layers=1, num_attention_heads=2,
                             intermediate_size=64),
    detr_decoder_config=dict(hidden_size=_SAM3_WIDTH, num_layers=2, num_queries=6,
                             num_attention_heads=2, intermediate_size=64),
    mask_decoder_config=dict(hidden_size=_SAM3_WIDTH, num_upsampling_stages=3,
                             num_attention_heads=2),
))
SAM3_DETECTOR_IMAGE_SIZE = 112
# What Sam3Model returns that a test compares: masks and boxes per query (boxes as x0, y0, x1, y1
# in [0, 1]), the query-vs-prompt logits, the image-level presence logit, the semantic map.
SAM3_DETECTOR_OUTPUTS = ("pred_masks", "pred_boxes", "pred_logits", "presence_logits",
                         "semantic_seg")


def sam3_detector_config(**overrides):
    return config_from_table({"sam3_detector": SAM3_DETECTOR}, "sam3_detector", overrides)


def sam3_detector_model(*, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """The tiny Sam3Model with widened random weights, built through the auto class the
    segmentation loader picks (its AutoModel fallback), deterministic in ``seed``."""
    import transformers

    config = sam3_detector_config(**overrides)
    auto = pick_auto_class(auto_classes(), config)
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=dtype)
    if type(model) is not transformers.Sam3Model:
        raise RuntimeError(f"{auto.__name__} built {type(model).__name__}, not Sam3Model")
    return widen_(model).eval()


def save_tiny_sam3_detector(directory: str | os.PathLike, *, seed: int = 0,
                            dtype: torch.dtype = torch.float32,
                            max_shard_size: str | int = "64KB", **overrides) -> Path:
    """Saves the tiny Sam3Model (several safetensors shards and an index) to ``directory``."""
    directory = Path(directory)
    sam3_detector_model(seed=seed, dtype=dtype, **overrides).save_pretrained(
        directory, max_shard_size=max_shard_size)
    return directory


def sam3_detector_inputs(batch: int = 2, seed: int = 0, boxes: bool = False) -> dict:
    """Inputs as Sam3Model takes them (what Sam3Processor would give), deterministic in ``seed``.

    ``pixel_values`` (batch, 3, 112, 112) N(0, 1); ``input_ids`` (batch, 7) int64: the BOS id,
    5 random word ids, the EOS id, and the second prompt is 4 words shorter, padded (id 0) and
    masked out in ``attention_mask`` (batch, 7). With ``boxes``, ``input_boxes`` (batch, 3, 4):
    boxes as (cx, cy, w, h) in [0, 1] of the image, and ``input_boxes_labels`` (batch, 3) in {0, 1}
    (negative / positive box); the second image's last box is padding (label -10).
    """
    config = SAM3_DETECTOR[1]["text_config"]
    g = torch.Generator().manual_seed(seed)
    length = 7
    ids = torch.randint(1, config["bos_token_id"], (batch, length), generator=g)
    ids[:, 0] = config["bos_token_id"]
    ids[:, -1] = config["eos_token_id"]
    mask = torch.ones(batch, length, dtype=torch.int64)
    if batch > 1:
        ids[1, 2] = config["eos_token_id"]
        ids[1, 3:] = config["pad_token_id"]
        mask[1, 3:] = 0
    size = SAM3_DETECTOR_IMAGE_SIZE
    inputs = {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
              "input_ids": ids, "attention_mask": mask}
    if boxes:
        centres = 0.25 + 0.5 * torch.rand(batch, 3, 2, generator=g)
        sides = 0.1 + 0.4 * torch.rand(batch, 3, 2, generator=g)
        inputs["input_boxes"] = torch.cat([centres, sides], dim=-1)
        labels = torch.randint(0, 2, (batch, 3), generator=g)
        if batch > 1:
            labels[1, -1] = -10
        inputs["input_boxes_labels"] = labels
    return inputs


def sam3_detector_outputs(output) -> dict[str, torch.Tensor]:
    """The output tensors of a Sam3Model call that a test compares."""
    return {n: output[n] for n in SAM3_DETECTOR_OUTPUTS}

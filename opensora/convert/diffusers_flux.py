"""Key layout and config of diffusers' ``FluxTransformer2DModel`` <-> our MMDiT.

The two compute the same function for one frame (T = 1): diffusers takes tokens already packed as
``(c, ph, pw)`` 2x2 patches (the Flux pipeline's packing, our patchify order for pt = 1), multiplies the
timestep/guidance by 1000 inside (as our ``timestep_embedding`` does), uses text ids 0 and image ids
(0, h, w) = our video ids at t = 0, the same interleaved-pair RoPE with theta 10000, LayerNorm/RMSNorm eps 1e-6
and tanh-GELU. tests/test_convert.py checks the outputs numerically in both directions.

=====================================================  ===========================================================
ours                                                   diffusers FluxTransformer2DModel
=====================================================  ===========================================================
img_in / txt_in                                        x_embedder / context_embedder
time_in.{in,out}_layer                                 time_text_embed.timestep_embedder.linear_{1,2}
vector_in.{in,out}_layer                               time_text_embed.text_embedder.linear_{1,2}
guidance_in.{in,out}_layer                             time_text_embed.guidance_embedder.linear_{1,2}
double_blocks.N.img_mod.lin / txt_mod.lin              transformer_blocks.N.norm1.linear / norm1_context.linear
double_blocks.N.img_attn.qkv  (rows q|k|v)             transformer_blocks.N.attn.to_q, to_k, to_v
double_blocks.N.txt_attn.qkv  (rows q|k|v)             transformer_blocks.N.attn.add_q_proj, add_k_proj, add_v_proj
double_blocks.N.img_attn.norm.{query,key}_scale        transformer_blocks.N.attn.norm_{q,k}.weight
double_blocks.N.txt_attn.norm.{query,key}_scale        transformer_blocks.N.attn.norm_added_{q,k}.weight
double_blocks.N.img_attn.proj / txt_attn.proj          transformer_blocks.N.attn.to_out.0 / attn.to_add_out
double_blocks.N.img_mlp.{0,2} / txt_mlp.{0,2}          transformer_blocks.N.ff.net.{0.proj,2} / ff_context.net.{0.proj,2}
single_blocks.N.modulation.lin                         single_transformer_blocks.N.norm.linear
single_blocks.N.linear1 (rows q|k|v|mlp_in)            single_transformer_blocks.N.attn.to_q, to_k, to_v, proj_mlp
single_blocks.N.norm.{query,key}_scale                 single_transformer_blocks.N.attn.norm_{q,k}.weight
single_blocks.N.linear2 (cols attn|mlp)                single_transformer_blocks.N.proj_out (same column order)
final_layer.adaLN_modulation (rows shift|scale)        norm_out.linear (rows scale|shift: halves swapped)
final_layer.linear                                     proj_out
cond_in                                                (none: a zero weight's bias folds into x_embedder's bias)
=====================================================  ===========================================================
"""

import json
import warnings
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

import torch

from .keymap import Rule, StateDict, export_state, hidden_size_of, import_state
from .weights import load_sharded_safetensors

LAYOUT = "diffusers-flux"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
FLUX_ROPE_THETA = 10000.0  # FluxPosEmbed hard-codes it
FLUX_MLP_RATIO = 4.0  # FeedForward's default mult


def _rules() -> List[Rule]:
    embed = "time_text_embed."
    rules = [
        Rule("img_in", "x_embedder"),
        Rule("txt_in", "context_embedder"),
        Rule("time_in.in_layer", embed + "timestep_embedder.linear_1"),
        Rule("time_in.out_layer", embed + "timestep_embedder.linear_2"),
        Rule("vector_in.in_layer", embed + "text_embedder.linear_1"),
        Rule("vector_in.out_layer", embed + "text_embedder.linear_2"),
        Rule("guidance_in.in_layer", embed + "guidance_embedder.linear_1"),
        Rule("guidance_in.out_layer", embed + "guidance_embedder.linear_2"),
        Rule("final_layer.adaLN_modulation", "norm_out.linear", swap_halves=True),
        Rule("final_layer.linear", "proj_out"),
    ]
    ours, theirs = "double_blocks.{i}.", "transformer_blocks.{i}."
    rules += [
        Rule(ours + "img_mod.lin", theirs + "norm1.linear"),
        Rule(ours + "txt_mod.lin", theirs + "norm1_context.linear"),
        Rule(ours + "img_attn.qkv", tuple(theirs + f"attn.to_{p}" for p in "qkv"), split=(1, 1, 1)),
        Rule(ours + "txt_attn.qkv", tuple(theirs + f"attn.add_{p}_proj" for p in "qkv"), split=(1, 1, 1)),
        Rule(ours + "img_attn.norm.query_scale", theirs + "attn.norm_q.weight"),
        Rule(ours + "img_attn.norm.key_scale", theirs + "attn.norm_k.weight"),
        Rule(ours + "txt_attn.norm.query_scale", theirs + "attn.norm_added_q.weight"),
        Rule(ours + "txt_attn.norm.key_scale", theirs + "attn.norm_added_k.weight"),
        Rule(ours + "img_attn.proj", theirs + "attn.to_out.0"),
        Rule(ours + "txt_attn.proj", theirs + "attn.to_add_out"),
        Rule(ours + "img_mlp.0", theirs + "ff.net.0.proj"),
        Rule(ours + "img_mlp.2", theirs + "ff.net.2"),
        Rule(ours + "txt_mlp.0", theirs + "ff_context.net.0.proj"),
        Rule(ours + "txt_mlp.2", theirs + "ff_context.net.2"),
    ]
    ours, theirs = "single_blocks.{i}.", "single_transformer_blocks.{i}."
    rules += [
        Rule(ours + "modulation.lin", theirs + "norm.linear"),
        Rule(
            ours + "linear1",
            tuple(theirs + p for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
            split=(1, 1, 1, None),
        ),
        Rule(ours + "norm.query_scale", theirs + "attn.norm_q.weight"),
        Rule(ours + "norm.key_scale", theirs + "attn.norm_k.weight"),
        Rule(ours + "linear2", theirs + "proj_out"),
    ]
    return rules


def to_diffusers_flux(state: StateDict, drop_zero_cond: bool = True) -> StateDict:
    """Our MMDiT state dict -> ``FluxTransformer2DModel`` keys.

    diffusers' Flux has no condition input. Ours adds ``cond_in(cond) = W cond + b`` to ``img_in``'s output on every
    call that passes a condition (the sampler always does, with zeros for text-to-video). With ``W`` all zero (a
    model never trained on I2V/V2V, or a fresh one) that term is the constant ``b``: it is folded into ``img_in``'s
    bias, which is exact. A nonzero ``W`` raises, since no Flux weights compute it.
    """
    state = dict(state)
    cond = {k: state.pop(k) for k in [k for k in state if k.startswith("cond_in.")]}
    weight, bias = cond.get("cond_in.weight"), cond.get("cond_in.bias")
    if cond:
        if not drop_zero_cond or weight is None or bool(weight.any()):
            raise ValueError(
                "this MMDiT has a trained condition input (cond_in's weight is not zero), which "
                "FluxTransformer2DModel cannot hold; export it in our or the Open-Sora 2.0 layout instead"
            )
        if bias is not None and bool(bias.any()):
            folded = state["img_in.bias"].double() + bias.double()
            state["img_in.bias"] = folded.to(state["img_in.bias"].dtype)
            warnings.warn("folded cond_in's bias into img_in's bias (its weight is zero) for the diffusers Flux layout")
        else:
            warnings.warn("dropping the all-zero cond_in (unused condition input) for the diffusers Flux layout")
    return export_state(state, _rules(), hidden_size_of(state, "img_in.weight"), LAYOUT)


def from_diffusers_flux(state: StateDict) -> StateDict:
    """``FluxTransformer2DModel`` state dict -> our MMDiT keys (no ``cond_in``: build the model without one, or
    load with ``strict=False`` and keep its zero-initialised condition input)."""
    return import_state(state, _rules(), LAYOUT)


def diffusers_flux_config(arch: Mapping) -> dict:
    """``FluxTransformer2DModel`` constructor kwargs for our MMDiT ``arch`` (``model.arch``); refuses shapes Flux
    cannot express."""
    pt, ph, pw = arch["patch_size"]
    problems = []
    if pt != 1 or ph != pw:
        problems.append(f"patch_size {tuple(arch['patch_size'])} (Flux packs square patches of one frame)")
    if not arch.get("qk_norm", True) or not arch.get("qkv_bias", True):
        problems.append("qk_norm/qkv_bias off (Flux always has both)")
    if float(arch.get("mlp_ratio", FLUX_MLP_RATIO)) != FLUX_MLP_RATIO:
        problems.append(f"mlp_ratio {arch['mlp_ratio']} (Flux's FeedForward uses 4)")
    if float(arch.get("theta", FLUX_ROPE_THETA)) != FLUX_ROPE_THETA:
        problems.append(f"RoPE theta {arch['theta']} (Flux uses 10000)")
    if len(arch["axes_dims"]) != 3:
        problems.append(f"axes_dims {tuple(arch['axes_dims'])} (Flux has 3 RoPE axes)")
    if problems:
        raise ValueError("cannot express this MMDiT as FluxTransformer2DModel: " + "; ".join(problems))
    patch = ph * pw
    out_channels = arch.get("out_channels") or arch["in_channels"]
    return dict(
        patch_size=1,
        in_channels=arch["in_channels"] * patch,
        out_channels=out_channels * patch,
        num_layers=arch["depth_double"],
        num_single_layers=arch["depth_single"],
        attention_head_dim=arch["hidden_size"] // arch["num_heads"],
        num_attention_heads=arch["num_heads"],
        joint_attention_dim=arch["text_dim"],
        pooled_projection_dim=arch["pooled_dim"],
        guidance_embeds=bool(arch.get("guidance_embed", False)),
        axes_dims_rope=list(arch["axes_dims"]),
    )


def mmdit_kwargs_from_diffusers_config(config: Mapping, patch: Tuple[int, int] = (2, 2)) -> dict:
    """Our ``MMDiT`` kwargs (with ``type``) for a ``FluxTransformer2DModel`` config; ``patch`` is the pipeline's
    token packing (2x2 for Flux), which our model does itself."""
    if config.get("patch_size", 1) != 1:
        raise ValueError(f"FluxTransformer2DModel patch_size {config['patch_size']} != 1 is not supported")
    ph, pw = patch
    in_features = config.get("in_channels", 64)
    out_features = config.get("out_channels") or in_features
    if in_features % (ph * pw) or out_features % (ph * pw):
        raise ValueError(f"in/out channels {in_features}/{out_features} are not multiples of the {ph}x{pw} packing")
    heads, head_dim = config.get("num_attention_heads", 24), config.get("attention_head_dim", 128)
    kwargs = dict(
        type="MMDiT",
        in_channels=in_features // (ph * pw),
        out_channels=out_features // (ph * pw),
        cond_channels=None,
        patch_size=(1, ph, pw),
        hidden_size=heads * head_dim,
        num_heads=heads,
        depth_double=config.get("num_layers", 19),
        depth_single=config.get("num_single_layers", 38),
        mlp_ratio=FLUX_MLP_RATIO,
        text_dim=config.get("joint_attention_dim", 4096),
        pooled_dim=config.get("pooled_projection_dim", 768),
        guidance_embed=bool(config.get("guidance_embeds", False)),
        axes_dims=tuple(config.get("axes_dims_rope", (16, 56, 56))),
        theta=FLUX_ROPE_THETA,
    )
    if kwargs["out_channels"] == kwargs["in_channels"]:
        kwargs["out_channels"] = None
    return kwargs


def find_diffusers_model_dir(path) -> Path:
    """The directory holding config.json + weights: ``path`` itself or a pipeline's ``transformer/``."""
    path = Path(path)
    for candidate in (path, path / "transformer"):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(f"{path} is not a diffusers model directory (no config.json, nor transformer/config.json)")


def load_diffusers_flux_dir(path) -> Tuple[StateDict, dict]:
    """(state dict, config dict) of a saved ``FluxTransformer2DModel`` (``save_pretrained`` output or pipeline)."""
    model_dir = find_diffusers_model_dir(path)
    config = json.loads((model_dir / "config.json").read_text())
    name = config.get("_class_name")
    if name not in (None, "FluxTransformer2DModel"):
        raise ValueError(f"{model_dir} holds a {name}, not a FluxTransformer2DModel")
    return load_sharded_safetensors(model_dir), config


def save_diffusers_flux_dir(state: StateDict, config: Mapping, directory, metadata: Optional[dict] = None) -> Path:
    """Write ``config.json`` + ``diffusion_pytorch_model.safetensors`` that ``FluxTransformer2DModel.from_pretrained``
    reads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    full_config = {"_class_name": "FluxTransformer2DModel", **dict(config)}
    (directory / "config.json").write_text(json.dumps(full_config, indent=2) + "\n")
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, str(directory / DIFFUSERS_WEIGHTS), metadata={"format": "pt", **(metadata or {})})
    return directory


def is_diffusers_flux_state(state: Mapping[str, torch.Tensor]) -> bool:
    return "x_embedder.weight" in state and "context_embedder.weight" in state

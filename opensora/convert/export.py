"""Export a role's weights to one safetensors file, import foreign layouts, and summarise weights.

Exported files carry string metadata: ``config`` (the training config text, or a ``model = dict(...)`` line for
imports), ``step``, ``source`` (``ema``/``model``/``file``/``diffusers``/``opensora2``), ``role``, ``dtype`` and
``layout`` (``opensora`` = ours, ``opensora2`` = Open-Sora 2.0's MMDiTModel, ``diffusers-flux``).
``load_role_weights`` reads such a file back (the config from the ``config`` key).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import load_file, save_file

from opensora import dtypes
from opensora.dtypes import SHORT_NAMES

from . import diffusers_flux, opensora2
from .weights import LoadedWeights, load_role_weights, read_metadata

OUR_LAYOUT = "opensora"
LAYOUTS = (OUR_LAYOUT, opensora2.LAYOUT, diffusers_flux.LAYOUT)
def resolve_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """``None`` keeps the source dtypes; otherwise a dtype name (see ``opensora.dtypes``)."""
    return None if name is None else dtypes.resolve_dtype(name)


def cast_state_dict(state: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (integer buffers are left alone); contiguous CPU copies."""
    out = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[key] = tensor.contiguous()
    return out


def dtype_label(state: Dict[str, torch.Tensor]) -> str:
    """``bf16`` / ``fp32`` / ... for a uniform state dict, ``mixed`` otherwise."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        only = dtypes.pop()
        return SHORT_NAMES.get(only, str(only).replace("torch.", ""))
    return "mixed" if dtypes else "none"


def mmdit_arch_from_config_text(config_text: str) -> dict:
    """Full ``MMDiT.arch`` of the ``model`` entry of a config text (the model is built on the meta device)."""
    from mmengine.config import Config

    from opensora.models.mmdit import MMDiT

    cfg = Config.fromstring(config_text, ".py")
    if "model" not in cfg:
        raise KeyError("the embedded config has no 'model' entry")
    kwargs = dict(cfg["model"])
    if kwargs.pop("type", "MMDiT") != "MMDiT":
        raise ValueError(f"config model type is {cfg['model']['type']}, not MMDiT")
    with torch.device("meta"):
        return dict(MMDiT(**kwargs).arch)


def model_config_text(kwargs: dict) -> str:
    """A minimal config text (``model = dict(...)``) for weights imported without a training config."""
    return f"model = {kwargs!r}\n"


@dataclass
class ExportResult:
    path: Path
    layout: str
    num_tensors: int
    metadata: Dict[str, str]


def _metadata(loaded: LoadedWeights, role: str, dtype_name: str, layout: str) -> Dict[str, str]:
    meta = {"format": "pt", "role": role, "dtype": dtype_name, "layout": layout}
    meta["source"] = loaded.metadata.get("source", loaded.source) if loaded.source == "file" else loaded.source
    if loaded.step is not None:
        meta["step"] = str(loaded.step)
    if loaded.config_text is not None:
        meta["config"] = loaded.config_text
    return meta


def export_weights(
    src,
    dst,
    role: str = "model",
    ema: bool = True,
    dtype: Optional[str] = None,
    to: str = OUR_LAYOUT,
    opensora2_fused_qkv: bool = False,
) -> ExportResult:
    """Write ``role``'s weights (EMA unless ``ema=False``) of checkpoint ``src`` (or an exported file) to ``dst``.

    ``to``: ``opensora`` (our keys), ``opensora2`` or ``diffusers-flux`` (alias ``diffusers``). For diffusers, a
    ``dst`` without the ``.safetensors`` suffix becomes a ``from_pretrained``-able directory (config.json built from
    the embedded training config). ``dtype``: ``fp32``/``bf16``/``fp16`` or ``None`` to keep the stored dtype.
    """
    to = diffusers_flux.LAYOUT if to == "diffusers" else to
    if to not in LAYOUTS:
        raise ValueError(f"unknown target layout '{to}'; choose one of {LAYOUTS} (or 'diffusers')")
    loaded = load_role_weights(src, role=role, ema=ema)
    if loaded.metadata.get("layout", OUR_LAYOUT) != OUR_LAYOUT:
        raise ValueError(f"{src} is in the {loaded.metadata['layout']} layout; import it first (--from)")
    state = cast_state_dict(loaded.state_dict, resolve_dtype(dtype))
    dtype_name = dtype or dtype_label(state)
    metadata = _metadata(loaded, role, dtype_name, to)
    dst = Path(dst)

    if to == opensora2.LAYOUT:
        state = opensora2.to_opensora2(state, fused_qkv=opensora2_fused_qkv)
    elif to == diffusers_flux.LAYOUT:
        state = diffusers_flux.to_diffusers_flux(state)
        if dst.suffix != ".safetensors":
            if loaded.config_text is None:
                raise ValueError(f"{src} carries no config: cannot write a diffusers config.json (give a .safetensors dst)")
            config = diffusers_flux.diffusers_flux_config(mmdit_arch_from_config_text(loaded.config_text))
            diffusers_flux.save_diffusers_flux_dir(state, config, dst, metadata)
            return ExportResult(dst, to, len(state), metadata)

    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst), metadata=metadata)
    return ExportResult(dst, to, len(state), metadata)


def _guess_axes_dims(head_dim: int) -> tuple:
    """Flux's split of a head over (t, h, w) RoPE axes: 1/8 to t, the rest halved (128 -> 16, 56, 56)."""
    t = (head_dim // 8) // 2 * 2
    hw = (head_dim - t) // 2 // 2 * 2
    return (head_dim - 2 * hw, hw, hw)


def infer_opensora2_kwargs(state: Dict[str, torch.Tensor], patch: int = 2) -> dict:
    """Our MMDiT kwargs read off an Open-Sora 2.0 state dict's shapes (already converted to our keys).

    What shapes cannot tell: the patch size (Open-Sora 2.0 packs 2x2) and the RoPE split (Flux's, guessed).
    """
    hidden, in_features = state["img_in.weight"].shape
    head_dim = state["double_blocks.0.img_attn.norm.query_scale"].shape[0]
    volume = patch * patch
    kwargs = dict(
        type="MMDiT",
        in_channels=in_features // volume,
        out_channels=state["final_layer.linear.weight"].shape[0] // volume,
        cond_channels=state["cond_in.weight"].shape[1] // volume if "cond_in.weight" in state else None,
        patch_size=(1, patch, patch),
        hidden_size=hidden,
        num_heads=hidden // head_dim,
        depth_double=1 + max(int(k.split(".")[1]) for k in state if k.startswith("double_blocks.")),
        depth_single=1 + max(int(k.split(".")[1]) for k in state if k.startswith("single_blocks.")),
        mlp_ratio=state["double_blocks.0.img_mlp.0.weight"].shape[0] / hidden,
        text_dim=state["txt_in.weight"].shape[1],
        pooled_dim=state["vector_in.in_layer.weight"].shape[1],
        qkv_bias="double_blocks.0.img_attn.qkv.bias" in state,
        guidance_embed="guidance_in.in_layer.weight" in state,
        axes_dims=_guess_axes_dims(head_dim),
    )
    if kwargs["out_channels"] == kwargs["in_channels"]:
        kwargs["out_channels"] = None
    return kwargs


def import_weights(src, dst, from_: str, dtype: Optional[str] = None, opensora2_patch: int = 2) -> ExportResult:
    """Convert foreign weights to one our-layout safetensors file with a ``model = dict(...)`` config.

    ``from_="diffusers"``: a ``FluxTransformer2DModel`` directory (or a pipeline directory with ``transformer/``),
    whose config.json gives the architecture; a bare diffusers-layout ``.safetensors`` file converts too but gets no
    config. ``from_="opensora"``/``"opensora2"``: an Open-Sora 2.0 MMDiT ``.safetensors`` file; the architecture is
    read off the shapes (2x2 packing assumed, RoPE split guessed as Flux's).
    """
    src, dst = Path(src), Path(dst)
    kwargs, source_meta = None, {}
    if from_ in ("diffusers", diffusers_flux.LAYOUT):
        layout = diffusers_flux.LAYOUT
        if src.is_dir():
            foreign, config = diffusers_flux.load_diffusers_flux_dir(src)
            kwargs = diffusers_flux.mmdit_kwargs_from_diffusers_config(config)
        else:
            foreign, source_meta = load_file(str(src)), read_metadata(src)
        state = diffusers_flux.from_diffusers_flux(foreign)
    elif from_ in ("opensora", opensora2.LAYOUT):
        layout = opensora2.LAYOUT
        if src.is_dir():
            raise ValueError(f"--from opensora expects an Open-Sora 2.0 .safetensors file, got directory {src}")
        state = opensora2.from_opensora2(load_file(str(src)))
        kwargs = infer_opensora2_kwargs(state, opensora2_patch)
        source_meta = read_metadata(src)  # a file we exported ourselves keeps its exact config and step
    else:
        raise ValueError(f"unknown source layout '{from_}'; choose diffusers or opensora")
    state = cast_state_dict(state, resolve_dtype(dtype))
    metadata = {"format": "pt", "role": "model", "dtype": dtype or dtype_label(state), "layout": OUR_LAYOUT,
                "source": layout}
    if "config" in source_meta:
        metadata["config"] = source_meta["config"]
    elif kwargs is not None:
        metadata["config"] = model_config_text(kwargs)
    if "step" in source_meta:
        metadata["step"] = source_meta["step"]
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst), metadata=metadata)
    return ExportResult(dst, OUR_LAYOUT, len(state), metadata)


def inspect_weights(src, role: str = "model", ema: bool = True) -> dict:
    """Summary of a checkpoint role or a safetensors file: parameter count, dtypes, step, layout, metadata keys."""
    src = Path(src)
    loaded = load_role_weights(src, role=role, ema=ema)
    dtypes: Dict[str, int] = {}
    for tensor in loaded.state_dict.values():
        name = SHORT_NAMES.get(tensor.dtype, str(tensor.dtype).replace("torch.", ""))
        dtypes[name] = dtypes.get(name, 0) + tensor.numel()
    summary = dict(
        path=str(loaded.path),
        source=loaded.metadata.get("source", loaded.source) if loaded.source == "file" else loaded.source,
        role=loaded.metadata.get("role", role),
        step=loaded.step,
        layout=loaded.metadata.get("layout", OUR_LAYOUT),
        num_tensors=len(loaded.state_dict),
        num_params=sum(t.numel() for t in loaded.state_dict.values()),
        dtypes=dtypes,
        has_config=loaded.config_text is not None,
        metadata_keys=sorted(loaded.metadata),
    )
    if src.is_dir():
        summary["roles"] = sorted(p.name for p in src.iterdir() if (p / "model").is_dir())
        summary["has_ema"] = (src / role / "ema.safetensors").is_file()
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"path:       {summary['path']}"]
    if "roles" in summary:
        lines.append(f"roles:      {', '.join(summary['roles'])} (EMA for '{summary['role']}': "
                     f"{'yes' if summary['has_ema'] else 'no'})")
    lines += [
        f"role:       {summary['role']}  source: {summary['source']}  layout: {summary['layout']}",
        f"step:       {summary['step'] if summary['step'] is not None else 'unknown'}",
        f"parameters: {summary['num_params']:,} in {summary['num_tensors']} tensors "
        f"({summary['num_params'] / 1e6:.2f}M)",
        "dtypes:     " + ", ".join(f"{k}: {v:,}" for k, v in sorted(summary["dtypes"].items())),
        f"config:     {'embedded' if summary['has_config'] else 'none'}",
    ]
    return "\n".join(lines)

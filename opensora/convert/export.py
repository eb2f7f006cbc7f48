"""Export a role's weights to one safetensors file, import foreign layouts, and summarise weights.

Exported files carry string metadata: ``arch`` (the network's keyword arguments as JSON, see ``arch.py``),
``config`` (the training config text, for the record: never executed), ``step``, ``source``
(``ema``/``model``/``file``/``diffusers``/``opensora2``), ``role``, ``dtype``, ``layout`` (``opensora`` = ours,
``opensora2`` = Open-Sora 2.0's MMDiTModel, ``diffusers-flux``) and, for ``opensora2``, ``rope_pairing``.
``load_role_weights`` reads such a file back. Reading a checkpoint never executes anything: the architecture comes
from ``arch`` only, or from a config file the user names (``config_path``), which runs as the user's own config.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import load_file, save_file

from opensora import dtypes
from opensora.checkpoint_layout import is_role_dir
from opensora.cli_errors import UserInputError
from opensora.dtypes import SHORT_NAMES

from . import diffusers_flux, opensora2
from .arch import ARCH_KEY, arch_from_config_file, arch_from_json, arch_to_json, no_arch_error
from .weights import LORA_KEY, LoadedWeights, load_role_weights, read_metadata

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


def resolve_arch(loaded: LoadedWeights, src, config_path=None, role: str = "model") -> dict:
    """The network's keyword arguments: from the user's ``config_path`` when given, else the checkpoint's JSON
    ``arch`` record; never from config text inside the checkpoint (that would run code from a downloaded file)."""
    if config_path is not None:
        return arch_from_config_file(config_path, role)
    if loaded.arch is None:
        raise no_arch_error(str(src), loaded.config_text is not None)
    return dict(loaded.arch)


@dataclass
class ExportResult:
    path: Path
    layout: str
    num_tensors: int
    metadata: Dict[str, str]


def _metadata(loaded: LoadedWeights, role: str, dtype_name: str, layout: str, arch: Optional[dict]) -> Dict[str, str]:
    meta = {"format": "pt", "role": role, "dtype": dtype_name, "layout": layout}
    if arch is not None:
        meta[ARCH_KEY] = arch_to_json(arch)
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
    rope_pairing: str = opensora2.HALF_SPLIT,
    config_path=None,
    lora: str = "merge",
    base=None,
) -> ExportResult:
    """Write ``role``'s weights (EMA unless ``ema=False``) of checkpoint ``src`` (or an exported file) to ``dst``.

    ``to``: ``opensora`` (our keys), ``opensora2`` or ``diffusers-flux`` (alias ``diffusers``). For diffusers, a
    ``dst`` without the ``.safetensors`` suffix becomes a ``from_pretrained``-able directory (config.json built from
    the architecture). ``dtype``: ``fp32``/``bf16``/``fp16`` or ``None`` to keep the stored dtype.
    ``rope_pairing`` (``opensora2`` only): ``half-split`` for Open-Sora 2.0's shipped ``use_liger_rope=True``
    (default), ``adjacent`` for ``use_liger_rope=False``. ``config_path``: take the architecture from this config
    file (the user's own) instead of the checkpoint's ``arch`` record.
    A LoRA role is merged into its base weights (``lora="merge"``; base from its ``init_from`` record or ``base``)
    or exported as the adapter alone (``lora="only"``: our layout, metadata ``lora`` = its lora.json record, which
    ``load_role_weights`` and the sampler merge again on load).
    """
    to = diffusers_flux.LAYOUT if to == "diffusers" else to
    if to not in LAYOUTS:
        raise ValueError(f"unknown target layout '{to}'; choose one of {LAYOUTS} (or 'diffusers')")
    if lora == "only" and to != OUR_LAYOUT:
        raise UserInputError(
            f"--lora-only writes the adapter in our layout; --to {to} needs merged weights (--merge-lora)"
        )
    loaded = load_role_weights(src, role=role, ema=ema, lora=lora, base=base)
    if loaded.metadata.get("layout", OUR_LAYOUT) != OUR_LAYOUT:
        raise ValueError(f"{src} is in the {loaded.metadata['layout']} layout; import it first (--from)")
    state = cast_state_dict(loaded.state_dict, resolve_dtype(dtype))
    dtype_name = dtype or dtype_label(state)
    arch = resolve_arch(loaded, src, config_path, role) if config_path is not None or loaded.arch else None
    metadata = _metadata(loaded, role, dtype_name, to, arch)
    for key in (LORA_KEY, "merged_lora"):  # the adapter's record: what it is, or what was merged in
        if key in loaded.metadata:
            metadata[key] = loaded.metadata[key]
    dst = Path(dst)

    if to == opensora2.LAYOUT:
        head_dim = arch["hidden_size"] // arch["num_heads"] if arch else opensora2.head_dim_of(state)
        state = opensora2.convert_rope_pairing(state, head_dim, rope_pairing)
        state = opensora2.to_opensora2(state, fused_qkv=opensora2_fused_qkv)
        metadata["rope_pairing"] = rope_pairing
    elif to == diffusers_flux.LAYOUT:
        state = diffusers_flux.to_diffusers_flux(state)
        if dst.suffix != ".safetensors":
            config = diffusers_flux.diffusers_flux_config(resolve_arch(loaded, src, config_path, role))
            diffusers_flux.save_diffusers_flux_dir(state, config, dst, metadata)
            return ExportResult(dst, to, len(state), metadata)

    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst), metadata=metadata)
    return ExportResult(dst, to, len(state), metadata)


def parse_axes_dims(value) -> Optional[tuple]:
    """``--axes-dims 16,56,56`` (or a sequence) -> a tuple of ints; None stays None."""
    if value is None:
        return None
    parts = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise UserInputError(f"--axes-dims takes integers like 16,56,56, got {value!r}") from None


def _axes_dims_for(head_dim: int, axes_dims: Optional[tuple]) -> tuple:
    """The RoPE split of a head over (t, h, w): shapes cannot tell it, so it is given, never guessed."""
    if axes_dims is None:
        raise UserInputError(
            f"the RoPE axis split of a foreign checkpoint cannot be read off its shapes (head size {head_dim}): pass "
            f"--axes-dims T,H,W summing to {head_dim} (Open-Sora 2.0's released model: --axes-dims 16,56,56)"
        )
    if len(axes_dims) != 3 or sum(axes_dims) != head_dim or any(d <= 0 or d % 2 for d in axes_dims):
        raise UserInputError(
            f"--axes-dims {','.join(map(str, axes_dims))}: need 3 positive even numbers summing to "
            f"the head size {head_dim}"
        )
    return tuple(axes_dims)


def infer_opensora2_kwargs(state: Dict[str, torch.Tensor], patch: int = 2, axes_dims: Optional[tuple] = None) -> dict:
    """Our MMDiT kwargs read off an Open-Sora 2.0 state dict's shapes (already converted to our keys).

    What shapes cannot tell: the patch size (Open-Sora 2.0 packs 2x2) and the RoPE split (``axes_dims``: required).
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
        axes_dims=_axes_dims_for(head_dim, axes_dims),
    )
    if kwargs["out_channels"] == kwargs["in_channels"]:
        kwargs["out_channels"] = None
    return kwargs


def import_weights(
    src,
    dst,
    from_: str,
    dtype: Optional[str] = None,
    opensora2_patch: int = 2,
    axes_dims=None,
    rope_pairing: Optional[str] = None,
) -> ExportResult:
    """Convert foreign weights to one our-layout safetensors file with a ``model = dict(...)`` config.

    ``from_="diffusers"``: a ``FluxTransformer2DModel`` directory (or a pipeline directory with ``transformer/``),
    whose config.json gives the architecture; a bare diffusers-layout ``.safetensors`` file converts too but gets no
    config. ``from_="opensora"``/``"opensora2"``: an Open-Sora 2.0 MMDiT ``.safetensors`` file; the architecture is
    read off the shapes (2x2 packing assumed) with the RoPE split from ``axes_dims`` (a file we exported carries
    both in its metadata). ``rope_pairing``: the file's RoPE channel pairing (default: its ``rope_pairing``
    metadata, else ``half-split``, what Open-Sora 2.0 ships); q/k are reordered back to ours.
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
        source_meta = read_metadata(src)  # a file we exported ourselves keeps its architecture, config and step
        state = opensora2.from_opensora2(load_file(str(src)))
        head_dim = opensora2.head_dim_of(state)
        pairing = rope_pairing or source_meta.get("rope_pairing", opensora2.HALF_SPLIT)
        state = opensora2.convert_rope_pairing(state, head_dim, pairing, inverse=True)
        if ARCH_KEY in source_meta:
            kwargs = arch_from_json(source_meta[ARCH_KEY], str(src))
        else:
            kwargs = infer_opensora2_kwargs(state, opensora2_patch, parse_axes_dims(axes_dims))
    else:
        raise ValueError(f"unknown source layout '{from_}'; choose diffusers or opensora")
    state = cast_state_dict(state, resolve_dtype(dtype))
    metadata = {
        "format": "pt",
        "role": "model",
        "dtype": dtype or dtype_label(state),
        "layout": OUR_LAYOUT,
        "source": layout,
    }
    if kwargs is not None:
        metadata[ARCH_KEY] = arch_to_json({k: v for k, v in kwargs.items() if k != "type"})
    if "config" in source_meta:  # text for the record, never executed
        metadata["config"] = source_meta["config"]
    if "step" in source_meta:
        metadata["step"] = source_meta["step"]
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst), metadata=metadata)
    return ExportResult(dst, OUR_LAYOUT, len(state), metadata)


def inspect_weights(src, role: str = "model", ema: bool = True) -> dict:
    """Summary of a checkpoint role or a safetensors file: parameter count, dtypes, step, layout, metadata keys
    (a LoRA adapter is summarised as stored: its own matrices, not merged)."""
    src = Path(src)
    loaded = load_role_weights(src, role=role, ema=ema, lora="stored")
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
        has_arch=loaded.arch is not None,
        metadata_keys=sorted(loaded.metadata),
    )
    if src.is_dir():
        summary["roles"] = sorted(p.name for p in src.iterdir() if is_role_dir(p))
        summary["has_ema"] = (src / role / "ema.safetensors").is_file()
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"path:       {summary['path']}"]
    if "roles" in summary:
        lines.append(
            f"roles:      {', '.join(summary['roles'])} (EMA for '{summary['role']}': "
            f"{'yes' if summary['has_ema'] else 'no'})"
        )
    lines += [
        f"role:       {summary['role']}  source: {summary['source']}  layout: {summary['layout']}",
        f"step:       {summary['step'] if summary['step'] is not None else 'unknown'}",
        f"parameters: {summary['num_params']:,} in {summary['num_tensors']} tensors "
        f"({summary['num_params'] / 1e6:.2f}M)",
        "dtypes:     " + ", ".join(f"{k}: {v:,}" for k, v in sorted(summary["dtypes"].items())),
        f"arch:       {'recorded (JSON)' if summary.get('has_arch') else 'none'}; "
        f"config text: {'embedded (never executed)' if summary['has_config'] else 'none'}",
    ]
    return "\n".join(lines)

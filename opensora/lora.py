"""LoRA adapters on a role's network: settings, injection (peft), the adapter's state, merging, and the base hash.

A trainable role may carry ``lora = dict(rank=8, alpha=8, target_modules=["qkv", "proj"], dropout=0.0)``
(``opensora.role_config``). Training then wraps the named ``nn.Linear`` layers with peft LoRA layers
(``peft.inject_adapter_in_model``: the network keeps its class, its keyword ``forward`` and its ``arch``), freezes
every base weight and gives the optimizer (and the EMA) only the adapter's ``lora_A`` / ``lora_B`` matrices.
A target name matches a Linear layer whose dotted name ends with it (peft's rule): ``"qkv"`` hits every block's
``...attn.qkv``; ``"double_blocks.0.img_attn.qkv"`` only that one.

Forward of a wrapped layer (peft's ``Linear``): ``y = W x + b + (alpha / rank) * B (A dropout(x))``. Merging is the
closed form ``W' = W + (alpha / rank) * B @ A`` (``merge_adapter``), computed here in fp32 without peft, so the
converter and the sampler need neither peft nor the trainer.

Why not ``booster.enable_lora``: ColossalAI 0.5.0 wraps the model in a ``PeftModel`` (renaming every key to
``base_model.model.*``) and only LowLevelZero / TorchDDP support it. Injecting the adapter before boosting and handing
the optimizer only the adapter's parameters works with every plugin (frozen parameters are no optimizer's business
under DDP and ZeRO alike; LowLevelZero casts the frozen base to its precision like the rest of the module).

The base weights a role's adapter sits on are named by the role's ``init_from`` and pinned by ``base_fingerprint``
(sha256 over the sorted keys and the fp32 value of every tensor, so a bf16 file and its fp32 copy agree); both go into
the checkpoint's ``lora.json`` so a resume or an export can check it sits on the same base.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from opensora.cli_errors import UserInputError

LORA_DEFAULTS = dict(rank=8, alpha=None, target_modules=None, dropout=0.0)  # alpha None: alpha = rank
LORA_KEYS = tuple(LORA_DEFAULTS)
ADAPTER_NAME = "default"  # peft's adapter name; it appears in the parameter names (``lora_A.default.weight``)
_MARKERS = (f".lora_A.{ADAPTER_NAME}.weight", f".lora_B.{ADAPTER_NAME}.weight")


def lora_settings(lora: Mapping, where: str = "lora") -> Dict[str, Any]:
    """Checked settings with defaults filled in; a one-line ``UserInputError`` for anything that would not train."""
    unknown = [key for key in lora if key not in LORA_KEYS]
    if unknown:
        raise UserInputError(f"unknown key(s) {unknown} in '{where}' (LoRA keys: {list(LORA_KEYS)})")
    out = {**LORA_DEFAULTS, **dict(lora)}
    rank = out["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UserInputError(f"'{where}.rank' must be a positive integer, got {rank!r}")
    out["alpha"] = float(rank if out["alpha"] is None else out["alpha"])
    if out["alpha"] <= 0:
        raise UserInputError(f"'{where}.alpha' must be > 0, got {out['alpha']!r}")
    targets = out["target_modules"]
    if isinstance(targets, str):  # "qkv,proj" from the command line (--lora.target-modules qkv,proj)
        targets = [name.strip() for name in targets.split(",") if name.strip()]
    if not targets:
        raise UserInputError(
            f"'{where}.target_modules' is empty: name the Linear layers to adapt, e.g. ['qkv', 'proj']"
        )
    out["target_modules"] = [str(t) for t in targets]
    out["dropout"] = float(out["dropout"])
    if not 0.0 <= out["dropout"] < 1.0:
        raise UserInputError(f"'{where}.dropout' must be in [0, 1), got {out['dropout']!r}")
    return out


def linear_names(model: nn.Module) -> list:
    """Dotted names of every ``nn.Linear`` in ``model``."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def check_target_modules(model: nn.Module, targets: Iterable[str], where: str = "lora") -> None:
    """Every target must match at least one Linear layer; the error lists the names that exist."""
    names = linear_names(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    missing = [t for t in targets if not any(_matches(n, t) for n in names)]
    if missing:
        raise UserInputError(
            f"'{where}.target_modules' {missing} match no Linear layer of this network; "
            f"Linear names that exist: {leaves}"
        )
    others = [
        n
        for n, m in model.named_modules()
        if n and not isinstance(m, nn.Linear) and any(_matches(n, t) for t in targets)
    ]
    if others:  # peft would wrap them too, and only Linear layers are supported here
        raise UserInputError(
            f"'{where}.target_modules' also match non-Linear modules {others[:3]}; name Linear "
            f"layers only (with a longer dotted suffix if needed): {leaves}"
        )


def add_lora(model: nn.Module, settings: Mapping, where: str = "lora") -> nn.Module:
    """Inject LoRA layers (peft) into ``model`` in place; only the adapter stays trainable. Returns ``model``."""
    from peft import LoraConfig, inject_adapter_in_model

    check_target_modules(model, settings["target_modules"], where)
    config = LoraConfig(
        r=settings["rank"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=list(settings["target_modules"]),
        bias="none",
    )
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    return model


def is_adapter_key(name: str) -> bool:
    return name.endswith(_MARKERS)


def adapter_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter's matrices (``...lora_A.default.weight`` / ``...lora_B.default.weight``), detached CPU copies."""
    return {name: param.detach().cpu().contiguous() for name, param in model.named_parameters() if is_adapter_key(name)}


def load_adapter_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], where: str = "adapter") -> None:
    """Copy saved adapter matrices into ``model``'s LoRA layers (strict: same names and shapes)."""
    params = {name: param for name, param in model.named_parameters() if is_adapter_key(name)}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise UserInputError(
            f"{where} does not fit this LoRA network: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} (rank or target_modules changed?)"
        )
    with torch.no_grad():
        for name, param in params.items():
            if tuple(state[name].shape) != tuple(param.shape):
                raise UserInputError(
                    f"{where}: {name} has shape {list(state[name].shape)}, the network "
                    f"{list(param.shape)} (rank changed?)"
                )
            param.copy_(state[name])


def base_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over sorted keys, shapes and fp32 values (integer tensors as they are) of the base weights."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.float()
        digest.update(f"{key}:{list(tensor.shape)}:{tensor.dtype}\n".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def merge_adapter(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], settings: Mapping
) -> Dict[str, torch.Tensor]:
    """``W' = W + (alpha / rank) * B @ A`` for every adapted Linear (fp32 math, base dtype kept); a new dict."""
    scaling = float(settings["alpha"]) / int(settings["rank"])
    merged = dict(base)
    suffix_a = _MARKERS[0]
    for key_a in (k for k in adapter if k.endswith(suffix_a)):
        prefix = key_a[: -len(suffix_a)]
        key_b, weight_key = prefix + _MARKERS[1], prefix + ".weight"
        if key_b not in adapter or weight_key not in base:
            raise UserInputError(
                f"adapter layer '{prefix}' has no {'lora_B' if key_b not in adapter else 'base weight'}"
                ": the adapter does not belong to these base weights"
            )
        weight = base[weight_key]
        delta = adapter[key_b].float() @ adapter[key_a].float()
        merged[weight_key] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged


# ---- lora.json: the adapter's settings and the base it sits on -----------------------------------------------
def lora_record(settings: Mapping, init_from: Any, base_sha256: str) -> Dict[str, Any]:
    """What ``lora.json`` holds: settings, ``init_from`` (JSON form) and the base fingerprint."""
    spec = dict(init_from) if isinstance(init_from, Mapping) else {"path": init_from}
    spec["path"] = str(spec["path"])
    return {
        "format": "opensora-lora",
        "version": 1,
        **{k: settings[k] for k in LORA_KEYS},
        "init_from": spec,
        "base_sha256": base_sha256,
    }


def record_to_json(record: Mapping) -> str:
    return json.dumps(dict(record), indent=2, sort_keys=True)


def record_from_json(text: str, where: str) -> Dict[str, Any]:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserInputError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(record, dict) or record.get("format") != "opensora-lora":
        raise UserInputError(f"{where} is not an opensora LoRA record")
    return record


def check_same_base(record: Mapping, base_sha256: str, where: str, base_name: Optional[str] = None) -> None:
    if record.get("base_sha256") != base_sha256:
        raise UserInputError(
            f"{where}: the base weights {base_name or record['init_from']['path']} are not the ones "
            f"this adapter was trained on (sha256 {base_sha256[:12]}... != recorded "
            f"{str(record.get('base_sha256'))[:12]}...); give the original base (--base PATH)"
        )

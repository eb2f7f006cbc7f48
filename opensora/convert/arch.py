"""A model's architecture as plain data: the JSON of its constructor keyword arguments (``MMDiT.arch``).

Checkpoints and exported files carry it (``{role}/arch.json`` in a training checkpoint, the ``arch`` metadata key of a
safetensors file) so that reading them never needs the training config, which is Python and would run whatever code
it holds. ``arch_from_json`` parses only JSON and accepts only plain values; nothing is imported or executed.
"""

import json
from typing import Mapping, Optional

from opensora.cli_errors import UserInputError

ARCH_FILE = "arch.json"
ARCH_KEY = "arch"  # safetensors metadata key
_PLAIN = (str, int, float, bool, type(None))
RETIRED = ("fused_kernels",)  # execution switches older records carry; the model no longer takes them


def _plain(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    raise TypeError(f"architecture values must be plain data, got {type(value).__name__}: {value!r}")


def arch_to_json(arch: Mapping, model_type: str = "MMDiT") -> str:
    """``arch`` (keyword arguments) as JSON, with ``type`` naming the model class."""
    return json.dumps({"type": model_type, **_plain(dict(arch))}, sort_keys=True)


def arch_from_json(text: str, where: str) -> dict:
    """The keyword arguments in ``text`` (JSON object of plain values), ``type`` removed; refuses anything else."""
    try:
        arch = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserInputError(f"{where}: the architecture record is not valid JSON ({error})") from None
    if not isinstance(arch, dict):
        raise UserInputError(f"{where}: the architecture record must be a JSON object of keyword arguments")
    arch = {k: tuple(v) if isinstance(v, list) else v for k, v in arch.items()}  # JSON lists were tuples
    model_type = arch.pop("type", "MMDiT")
    for key in RETIRED:
        arch.pop(key, None)
    if model_type != "MMDiT":
        raise UserInputError(f"{where}: the architecture is a {model_type!r}, not an MMDiT")
    return arch


def no_arch_error(where: str, has_config_text: bool) -> UserInputError:
    """The refusal for a checkpoint without a plain-data architecture (older files carry only config text)."""
    detail = (
        "it carries only config text, which is Python code and is never run when reading a checkpoint"
        if has_config_text
        else "it carries no architecture"
    )
    return UserInputError(
        f"{where}: {detail}; pass --config CONFIG.py (your own copy of the training config, run as "
        "your config) to take the architecture from it"
    )


def arch_from_config_file(path, role: str = "model") -> dict:
    """The full ``MMDiT.arch`` of ``role``'s network in the config file the user names (built on the meta device)."""
    import torch

    from opensora.config import load_config
    from opensora.models.mmdit import MMDiT

    cfg = load_config(path)
    models = cfg.get("models")
    spec: Optional[Mapping] = models[role]["model"] if models and role in models else cfg.get("model")
    if spec is None:
        raise UserInputError(f"config {path} has no 'model' entry (nor models.{role}.model)")
    kwargs = dict(spec)
    if kwargs.pop("type", "MMDiT") != "MMDiT":
        raise UserInputError(f"config {path}: the model type is {spec['type']}, not MMDiT")
    with torch.device("meta"):
        return dict(MMDiT(**kwargs).arch)

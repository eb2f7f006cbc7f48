"""What made a cache's features, and whether a config's VAE / text encoder would make the same ones.

Two records per component:

* ``spec_record``: the config entry as written (normalised), the dtype it runs in, the library versions and, for
  ``from_pretrained`` paths, each file's size and modification time. Cheap: nothing is built. Equal records mean
  the same component, so training from the cache need not build it.
* ``module_record``: the built module's classes, library configs (``diffusers`` / ``transformers`` ``config``),
  the encode settings that change the features (latent scale/shift, posterior sampling, token lengths), its dtype
  and a SHA-256 of its weights. Training builds the component and compares these only when the spec records
  differ (e.g. the same weights under another path), and stops with ``CacheMismatchError`` naming what differs.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from opensora.cli_errors import UserInputError

# attributes of our wrappers that change the stored features
_ENCODE_SETTINGS = (
    "scaling_factor",
    "shift_factor",
    "sample_posterior",
    "latent_channels",
    "spatial_compression",
    "temporal_compression",
    "max_length",
    "clip_max_length",
    "patch_size",  # PatchVAE: no library config, its packing is these
    "temporal_patch_size",
)
# library config keys that say nothing about the computation
_VOLATILE_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "architectures")


class CacheMismatchError(UserInputError):
    """The cache was made by other encoders (or for buckets) than the training config asks for."""


def plain_data(value):
    """``value`` as JSON-comparable data (tuples -> lists, dtypes and other objects -> strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _library_versions() -> dict:
    versions = {"torch": torch.__version__.split("+")[0]}
    for name in ("diffusers", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def _files_of(path: str) -> Optional[dict]:
    """Size and mtime of every file under a ``from_pretrained`` path (its weights may be replaced in place)."""
    root = Path(path)
    if not root.exists():
        return None
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root) if p != root else p.name): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def spec_record(spec: Mapping, dtype) -> dict:
    spec = plain_data(dict(spec))
    files = {key: _files_of(value) for key, value in spec.items() if key == "from_pretrained" and value}
    for name, sub in spec.items():  # TextConditioner: t5=dict(from_pretrained=...), clip=dict(...)
        if isinstance(sub, dict) and sub.get("from_pretrained"):
            files[name] = _files_of(sub["from_pretrained"])
    return dict(spec=spec, dtype=str(dtype), files=files, versions=_library_versions())


def weights_sha256(module: nn.Module) -> str:
    """SHA-256 over every state-dict entry's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.contiguous().view(-1)
        step = max(1, (64 << 20) // max(1, flat.element_size()))  # 64 MiB at a time to the host
        for start in range(0, flat.numel(), step):
            digest.update(flat[start : start + step].cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _library_models(module: nn.Module) -> dict:
    """``{child path: {cls, config}}`` of the outermost diffusers / transformers models inside our wrapper."""
    found = {}
    for name, child in module.named_modules():
        config = getattr(child, "config", None)
        if not (isinstance(config, Mapping) or hasattr(config, "to_dict")):
            continue
        if any(name.startswith(f"{outer}.") for outer in found if outer != "."):
            continue  # a sub-model (T5's stack) of one already recorded
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        as_dict = {k: v for k, v in as_dict.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
        found[name or "."] = dict(
            cls=f"{type(child).__module__}.{type(child).__qualname__}", config=plain_data(as_dict)
        )
    return found


def module_dtype(module: nn.Module) -> str:
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_floating_point():
            return str(tensor.dtype)
    return "none"


def module_record(module: nn.Module, dtype=None) -> dict:
    """``dtype``: the one the features come out in, for a parameter-free module (``PatchVAE``)."""
    settings = {name: plain_data(getattr(module, name)) for name in _ENCODE_SETTINGS if hasattr(module, name)}
    own = module_dtype(module)
    return dict(
        cls=f"{type(module).__module__}.{type(module).__qualname__}",
        models=_library_models(module),
        settings=settings,
        dtype=own if own != "none" or dtype is None else str(dtype),
        weights_sha256=weights_sha256(module),
    )


def first_difference(cached, current, where: str = "") -> Optional[str]:
    if isinstance(cached, dict) and isinstance(current, dict):
        for key in sorted(set(cached) | set(current)):
            diff = first_difference(cached.get(key), current.get(key), f"{where}.{key}" if where else key)
            if diff:
                return diff
        return None
    if cached != current:
        show = lambda v: (v[:12] + "...") if isinstance(v, str) and len(v) > 40 else v  # noqa: E731
        return f"{where}: cache {show(cached)!r}, config {show(current)!r}"
    return None


def module_difference(cached: Mapping, current: Mapping) -> Optional[str]:
    """The first field in which two ``module_record``s differ, as ``"field: cache X, config Y"``; None if equal."""
    return first_difference(plain_data(dict(cached)), plain_data(dict(current)))


def file_fingerprint(path: str) -> dict:
    """Size, mtime and SHA-256 of a file (the dataset table the cache was made from)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    stat = os.stat(path)
    return dict(path=str(Path(path).resolve()), size=stat.st_size, sha256=digest.hexdigest())

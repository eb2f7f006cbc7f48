"""Read a finished latent cache: its index, its provenance checks, and the stored tensors of one clip."""

import os
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from opensora.cli_errors import UserInputError

from .fingerprint import CacheMismatchError, module_difference, module_record, spec_record
from .store import FORMAT_VERSION, NULL_TEXT_FILE, read_index

_OPEN_SHARDS_PER_PROCESS = 64


class FeatureCache:
    """A finished cache directory: ``rows`` (the index as a DataFrame) and ``provenance`` (what made it)."""

    def __init__(self, root):
        self.root = Path(root)
        if not self.root.is_dir():
            raise UserInputError(
                f"latent cache {self.root} does not exist: make it with scripts/diffusion/precompute.py"
            )
        try:
            self.rows, self.provenance = read_index(self.root)
        except FileNotFoundError as error:
            raise UserInputError(str(error)) from None
        except Exception as error:  # a foreign or damaged parquet file
            raise UserInputError(
                f"{self.root}/index.parquet cannot be read as a latent cache index ({error})"
            ) from None
        version = self.provenance.get("format")
        if version != FORMAT_VERSION:
            raise UserInputError(f"latent cache {self.root} has format {version}; this version reads {FORMAT_VERSION}")
        self._handles: Dict[str, object] = {}
        self._handles_pid = os.getpid()

    # -- what made it

    def check_component(
        self, name: str, spec, dtype, build: Callable[[], torch.nn.Module]
    ) -> Optional[torch.nn.Module]:
        """Refuse (``CacheMismatchError``) a config whose ``name`` component would make other features.

        Equal config entries (and files, library versions) pass without building anything. Otherwise the component
        is built and its classes, configs, encode settings, dtype and weights compared; it is returned so the caller
        can keep it."""
        if not spec:
            return None  # nothing configured: nothing to compare (validation then cannot sample)
        made = self.provenance["components"][name]
        if spec_record(spec, dtype) == made["spec"]:
            return None
        module = build()
        difference = module_difference(made["module"], module_record(module, dtype))
        if difference:
            raise CacheMismatchError(
                f"latent cache {self.root} was made by another {name}: {difference}; rerun precompute.py with this "
                f"config into a new directory, or train with the config the cache was made with"
            )
        return module

    def null_text(self) -> Dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.root / NULL_TEXT_FILE))

    # -- stored tensors

    def tensor(self, shard: str, key: str) -> torch.Tensor:
        """One stored tensor (a memory map of the shard; one handle per shard per process)."""
        from safetensors import safe_open

        if self._handles_pid != os.getpid():  # a DataLoader worker: the parent's handles are not shared
            self._handles, self._handles_pid = {}, os.getpid()
        handle = self._handles.get(shard)
        if handle is None:
            if len(self._handles) >= _OPEN_SHARDS_PER_PROCESS:
                self._handles.pop(next(iter(self._handles)))
            handle = self._handles[shard] = safe_open(str(self.root / shard), framework="pt")
        return handle.get_tensor(key)

    def __getstate__(self):  # DataLoader workers (spawn) reopen shards themselves
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

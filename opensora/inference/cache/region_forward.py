"""``RegionForward``: the MMDiT's own forward at a Jano step level, through its own pieces (``patch_inputs`` /
``embed_patches``, ``run_block_range`` with the blocks' ``kv_hook``, ``final_tokens``); below level 3 it embeds a
token subset only and the hooks add the cached keys/values of the other tokens. The model has no branch for it."""

from __future__ import annotations

from typing import Optional

import torch

from opensora.models.mmdit.patches import unpatchify

from .plan import FULL, MEDIUM, REFRESH, RegionPlan


def _gather_tokens(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, N, F] rows picked by ``index`` [R, K] -> [R, K, F]."""
    return torch.gather(tokens, 1, index[..., None].expand(-1, -1, tokens.shape[-1]))


def _gather_heads(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, H, L, D] positions ``index`` [R, K] (of dim 2) -> [R, H, K, D]."""
    r, h, _, d = t.shape
    return torch.gather(t, 2, index[:, None, :, None].expand(r, h, index.shape[1], d))


def _block_state(state: dict) -> dict:
    """The part of a region forward's state that ``MMDiT.run_block_range`` carries: ``img`` / ``txt`` in the double
    blocks, ``tokens`` (text rows first) with ``num_text`` after them."""
    if "tokens" in state:
        return dict(tokens=state["tokens"], num_text=state["n_txt"])
    return dict(img=state["img"], txt=state["txt"])


class RegionForward:
    """The MMDiT's forward at a step level, computing only a token subset below level 3 (see the module docstring).

    Levels 0 and 3 compute every token in the model's own order; level 3 also stores the medium/static keys,
    values and outputs. Levels 1/2 compute ``plan.order[:, :K]`` and fill in the rest from ``store``.
    """

    def __init__(self, model):
        if getattr(model, "sp", None) is not None:
            raise ValueError("region caching cannot be combined with sequence parallelism")
        if getattr(model, "compile_blocks", False):
            raise ValueError(
                "region caching runs Python cache hooks inside every block; build the model with "
                "compile_blocks=False (or call model.set_compile_blocks(False))"
            )
        self.model = model
        self.num_layers = len(model.double_blocks) + len(model.single_blocks)

    def __call__(
        self,
        level,
        x,
        timestep,
        text_emb,
        text_mask=None,
        pooled=None,
        cond=None,
        guidance=None,
        text_mask_has_padding=None,
        plan: Optional[RegionPlan] = None,
        store=None,
        store_medium: bool = True,
    ) -> torch.Tensor:
        """``store_medium=False``: a level-2 step does not store its medium entries (the caller knows no step reads
        them before they are overwritten, so they need not cross the bus)."""
        state = self.prepare(
            level, x, timestep, text_emb, text_mask, pooled, cond, guidance, text_mask_has_padding, plan, store
        )
        hooks = self.hooks(level, plan, store, state["n_txt"], store_medium)
        self.run_layers(state, 0, self.num_layers, hooks)
        return self.finish(state, level, plan, store, store_medium)

    def prepare(
        self, level, x, timestep, text_emb, text_mask, pooled, cond, guidance, text_mask_has_padding, plan, store
    ) -> dict:
        """The work before the first block: checks, embeddings, RoPE rows and (below level 3) the token subset.
        Returns the forward's state (``run_layers`` and ``finish`` carry it on; ``region_graphs`` cuts it there)."""
        m = self.model
        full = level in (FULL, REFRESH)
        if not full or level == REFRESH:
            if plan is None or store is None:
                raise ValueError(f"step level {level} needs a region plan and a cache store")
        patches, cond_patches, grid = m.patch_inputs(x, cond)
        text_emb, text_mask, lengths = m.prepare_text(text_emb, text_mask, text_mask_has_padding)
        txt = m.txt_in(text_emb)
        vec = m.conditioning_vector(timestep, pooled, guidance)
        n, n_txt = patches.shape[1], txt.shape[1]
        rope = m.rope(grid, n_txt, x.device)
        # forward's padding mask; below level 3 the queries are a subset of the keys (the hooks add the cached ones)
        mask = m.padding_mask(text_mask, lengths, n_txt, n, text_mask_has_padding, own_keys=full)
        if not full:  # the computed tokens only: their patches and RoPE rows, per row in the plan's order
            index = plan.order[:, : plan.computed(level)]
            patches = _gather_tokens(patches, index)
            cond_patches = None if cond_patches is None else _gather_tokens(cond_patches, index)
            rope = tuple(
                torch.cat((table[:n_txt].expand(x.shape[0], -1, -1), table[n_txt:][index]), 1)[:, None]
                for table in rope
            )
        img = m.embed_patches(patches, cond_patches)
        return dict(img=img, txt=txt, vec=vec, rope=rope, mask=mask, grid=grid, n_txt=n_txt)

    def hooks(self, level, plan, store, n_txt: int, store_medium: bool = True) -> list:
        """The ``kv_hook`` of every layer (double blocks first) at ``level``."""
        if level == FULL:
            return [None] * self.num_layers
        return [self._kv_hook(level, plan, store, layer, n_txt, store_medium) for layer in range(self.num_layers)]

    def run_layers(self, state: dict, lo: int, hi: int, hooks) -> None:
        """Layers ``lo`` to ``hi - 1`` (double blocks, then single blocks) on ``state``, in place: the model's
        ``run_block_range`` with ``hooks[i]`` as block i's ``kv_hook``."""
        blocks = self.model.run_block_range(
            _block_state(state), lo, hi, state["vec"], state["rope"], state["mask"], hooks[lo:hi]
        )
        for name in ("img", "txt", "tokens"):
            state.pop(name, None)
        state.update((name, blocks[name]) for name in ("img", "txt", "tokens") if name in blocks)

    def finish(self, state: dict, level, plan, store, store_medium: bool = True) -> torch.Tensor:
        """The final layer on ``state`` (after every block), the cached outputs, and the video layout."""
        m = self.model
        out = m.final_tokens(_block_state(state), state["vec"])
        if level != FULL:
            out = self._outputs(level, plan, store, out, store_medium)
            store.flush()  # a store that batches its copies issues this step's last ones now
        return unpatchify(out, state["grid"], m.patch_size)

    @staticmethod
    def _kv_hook(level, plan: RegionPlan, store, layer: int, n_txt: int, store_medium: bool = True):
        k1, k2, n = plan.k_active, plan.k_medium, plan.num_tokens
        m_key, s_key = f"m_kv_{layer}", f"s_kv_{layer}"

        def hook(k, v, mask):
            if level == REFRESH:
                if k1 < k2:
                    pos = n_txt + plan.order[:, k1:k2]
                    store.store_async(torch.stack((_gather_heads(k, pos), _gather_heads(v, pos))), m_key)
                if k2 < n:
                    pos = n_txt + plan.order[:, k2:]
                    store.store_async(torch.stack((_gather_heads(k, pos), _gather_heads(v, pos))), s_key)
                return k, v, mask
            if level == MEDIUM and k1 < k2 and store_medium:  # the medium tokens were computed: refresh their cache
                store.store_async(
                    torch.stack((k[:, :, n_txt + k1 : n_txt + k2], v[:, :, n_txt + k1 : n_txt + k2])), m_key
                )
            keys = plan.reads(level, f"kv_{layer}")
            cached = [store.fetch(key) for key in keys]
            k = torch.cat([k] + [entry[0] for entry in cached], dim=2)
            v = torch.cat([v] + [entry[1] for entry in cached], dim=2)
            for key in keys:
                store.release(key)
            return k, v, mask

        return hook

    @staticmethod
    def _outputs(level, plan: RegionPlan, store, out: torch.Tensor, store_medium: bool = True) -> torch.Tensor:
        """Store (level 3) or complete (levels 1/2) the final-layer outputs; returns [R, N, F] in token order."""
        k1, k2, n = plan.k_active, plan.k_medium, plan.num_tokens
        if level == REFRESH:
            if k1 < k2:
                store.store_async(_gather_tokens(out, plan.order[:, k1:k2]), "m_x")
            if k2 < n:
                store.store_async(_gather_tokens(out, plan.order[:, k2:]), "s_x")
            return out
        if level == MEDIUM and k1 < k2 and store_medium:
            store.store_async(out[:, k1:k2].contiguous(), "m_x")
        keys = plan.reads(level, "x")
        permuted = torch.cat([out] + [store.fetch(key) for key in keys], dim=1)
        for key in keys:
            store.release(key)
        return torch.empty_like(permuted).scatter_(1, plan.order[..., None].expand_as(permuted), permuted)

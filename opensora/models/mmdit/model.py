"""MMDiT: Flux-style video transformer (double-stream then single-stream blocks) for flow matching.

Data path: x [B,C,T,H,W] -> patchify -> img tokens (+ zero-initialised projection of the condition input)
-> text tokens first, video tokens after -> double blocks (two streams, joint attention) -> single blocks
(one stream) -> final adaLN layer on video tokens -> unpatchify -> [B,C_out,T,H,W].
"""

from functools import partial
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from opensora.parallel.sequence_parallel import SequenceGroup, SequenceParallelModel, gather_tokens
from opensora.registry import MODELS

from ..arch import records_arch
from .attention import COMPILED_ATTENTION, COMPILED_ATTENTION_MODES, check_backend
from .bias_channel_attention import BiasChannelRows
from .causal import KVCache, TextKVCache, block_causal_video_mask, joint_attention_mask, per_chunk_timestep_forward
from .causal_stream import CausalStreaming
from .device_capability import device_major
from .flex_attention import FlexRows
from .fp8 import check_recipe, convert_block_linears
from .graph_checkpoint import checkpointed_in_graph
from .layers import DoubleStreamBlock, FinalLayer, MLPEmbedder, SingleStreamBlock, timestep_embedding
from .packed_attention import PackedRows
from .patches import patchify, unpatchify
from .rope import rope_cos_sin, video_position_ids
from .text_padding import padded_text_keys, trim_text, trim_text_to_bound
from .zero_key_attention import ZeroKeyRows

TIMESTEP_FEATURES = 256
PADDED_TEXT_ATTENTION = ("dense", "packed", "rows", "flex", "bias-channel", "zero-keys")
# one object for the batch; own keys only
ROW_MASKS = {"packed": PackedRows, "flex": FlexRows, "bias-channel": BiasChannelRows, "zero-keys": ZeroKeyRows}
# Training text is trimmed to multiples of this: one compiled shape for prompts up to 128 T5 tokens (20-120 are
# typical), at most 4 up to 512. Measured on an H200 (1B, batch 4, full checkpointing, compiled): a trimmed length
# that changed every step (multiples of 32) made the blocks' shapes symbolic and the padded step 1.41x the unpadded.
TRAIN_TEXT_LENGTH_MULTIPLE = 128


def call_with_thread_count(threads: int, block, *args):
    """``block(*args)`` with the calling thread's intra-op thread count set to ``threads`` first, if it differs.

    Dynamo guards each compiled graph on the thread count of the thread that calls it, and a checkpointed block's
    recompute runs on the autograd engine's device thread, whose count is fixed when that thread starts from the
    process-wide value the last ``torch.set_num_threads`` left: 1 once a DataLoader's pin-memory thread has started
    (``torch.utils.data._utils.pin_memory``). Without this every compiled block recompiles in the backward and a
    run soon hits Dynamo's recompile limit."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return block(*args)


def init_cuda_before_checkpointed_compile() -> None:
    """Initialise CUDA, if this host has it and nothing has yet, before a compiled block runs under
    ``torch.utils.checkpoint`` (the ``checkpoint_in_graph=False`` path).

    Dynamo reads the CUDA RNG state whenever CUDA is available (convert_frame's ``preserve_global_state``), which
    initialises CUDA lazily; non-reentrant checkpointing refuses a forward that initialises it ("PyTorch's device
    state was initialized in the forward pass of a Checkpoint"). On CPU tensors the checkpoint's device module is
    CUDA's, so a CPU run on a host with a GPU would fail at its first compile. That compile initialises CUDA anyway,
    so doing it first costs nothing more; on a host without CUDA this does nothing. The in-graph path needs none of
    this: Dynamo traces its checkpoint, and the eager check never runs."""
    if not torch.cuda.is_initialized() and torch.cuda.is_available():
        torch.cuda.init()


def compile_block_options(overrides: Optional[dict] = None) -> dict:
    """Inductor options for compiled blocks: Inductor's mix-order reductions off, then ``overrides``.

    Why off: on torch 2.10-2.11, Inductor fuses the backward's sums over tokens (the grads of the adaLN shift /
    scale / gate, [B, 1, C] broadcasts) with the norm's sums over channels into one "mix-order" kernel, and when its
    output is a slice of a larger buffer (``Modulation``'s ``chunk`` of one linear's output: the grads are a ``cat``
    of the slices) the final write rebinds instead of writing through the view, so those grads stay uninitialised
    memory (pytorch/pytorch#193061; workaround TORCHINDUCTOR_MIX_ORDER_REDUCTION=0). Measured on an H100 with torch
    2.11 (benchmarks/compile_parity.py, one modulated block at the 1B shape, batch 1): the modulation weights' grads
    had relative error ~1 at unit output grads and ~4e4 at the loss's scale, and the 1B model trained to non-finite
    grads. Kept off on every version: the pass is a speed feature, and a silent wrong gradient is not worth it."""
    import torch._inductor.config as inductor_config

    from opensora.cli_errors import UserInputError

    known = inductor_config.get_config_copy()
    unknown = sorted(set(overrides or {}) - set(known))
    if unknown:  # a name from the user's config: one line, exit 2 from the scripts
        raise UserInputError(
            f"inductor_options: {', '.join(map(repr, unknown))} not an Inductor setting of torch {torch.__version__} "
            "(names as in torch._inductor.config, nested ones dotted: 'triton.cudagraphs')"
        )
    options = {}
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        options["triton.mix_order_reduction"] = False
    options.update(overrides or {})
    return options


@MODELS.register_module()
class MMDiT(nn.Module, SequenceParallelModel, CausalStreaming):
    @records_arch  # self.arch: every argument below, to rebuild the model or count its FLOPs (flops.py)
    def __init__(
        self,
        in_channels: int,
        out_channels: Optional[int] = None,
        cond_channels: Optional[int] = None,
        patch_size: Sequence[int] = (1, 2, 2),
        hidden_size: int = 3072,
        num_heads: int = 24,
        depth_double: int = 19,
        depth_single: int = 38,
        mlp_ratio: float = 4.0,
        text_dim: int = 4096,
        pooled_dim: int = 768,
        qk_norm: bool = True,
        qkv_bias: bool = True,
        guidance_embed: bool = False,
        axes_dims: Sequence[int] = (16, 56, 56),
        theta: float = 10000.0,
        attn_backend: str = "auto",
        grad_ckpt_double: int = 0,
        grad_ckpt_single: int = 0,
        compile_blocks: bool = False,
        causal_chunk_frames: int = 0,
        fp8_linears: Optional[str] = None,
        padded_text_attention: str = "zero-keys",
        text_length_multiple: int = TRAIN_TEXT_LENGTH_MULTIPLE,
        checkpoint_in_graph: bool = True,
        inductor_options: Optional[dict] = None,
    ):
        """``causal_chunk_frames``: 0 = bidirectional attention; K > 0 = block-causal over chunks of K latent frames
        (causal.py), which also enables ``forward_chunk`` (streaming with a ``KVCache``, causal_stream.py).
        ``fp8_linears`` ("tensorwise" / "rowwise"): train the block linears in FP8 through torchao (fp8.py); a
        training option, left out of ``arch``. ``padded_text_attention``: how a training batch's rows with padded
        text attend after the trim: "zero-keys" (the default: padded keys zeroed, the unmasked head-128 kernel, its
        output and log-sum-exp corrected for the zero keys, zero_key_attention.py), "dense" (a boolean key mask over
        the trimmed text), "packed" (one variable-length flash call for the batch, packed_attention.py), "rows" (one
        SDPA call per row, ``attention.KeyRanges``), "flex" (FlexAttention with a per-batch block mask,
        flex_attention.py; fast only compiled) or "bias-channel" (the mask as an extra q/k channel pair,
        bias_channel_attention.py). Causal models and sequence parallelism keep the dense mask. All give the same
        result. Measured on an H200 (1B, batch 4 at 256px, full checkpointing, compiled, prompts of 20-120 tokens,
        inputs ready on the GPU): zero-keys 172.1 ms (attention kernels 25.9 ms a step, as unpadded), dense 175.5
        (attention 43.0), the unpadded step 163.2; earlier calls, with inputs drawn on the host: packed 1.14-1.18x,
        rows 2.4x, flex 1.013x and bias-channel 1.016x the dense step
        (benchmarks/reports/padded_text_h200_2026-11.md). Not architecture (left out of ``arch``), nor is
        ``text_length_multiple`` (trimmed lengths are its multiples: a larger one gives fewer shapes to compile, a
        smaller one fewer padded tokens). ``checkpoint_in_graph`` (default True): with compiled blocks, compile each
        checkpointed block call as one graph, its recompute inside the compiled backward (graph_checkpoint.py;
        on an H200 the padded 1B step took 159.9-160.4 ms against 162.7-173.3, steadier, peak memory within 0.5%);
        False keeps ``torch.utils.checkpoint`` around the compiled block. A training option, left out of ``arch``.
        ``inductor_options``: Inductor settings for the compiled blocks on top of ``compile_block_options``' defaults,
        e.g. ``dict(coordinate_descent_tuning=True)``: on an H200 the padded 1B step took 154.2 ms against 160.1 (1.544x
        diffusers' Flux step against 1.487x), for 207 s of tuning at the first step instead of 7 s (Inductor caches
        the tuned configs locally; what a restart then pays was not measured). ``max_autotune_gemm``
        had not finished compiling after 540 s (benchmarks/reports/padded_text_h200_2026-11.md). Not architecture."""
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        head_dim = hidden_size // num_heads
        if sum(axes_dims) != head_dim:
            raise ValueError(f"sum(axes_dims)={sum(axes_dims)} must equal head_dim={head_dim} ({tuple(axes_dims)})")
        if len(patch_size) != 3:
            raise ValueError(f"patch_size must be (pt, ph, pw), got {patch_size}")
        if not 0 <= grad_ckpt_double <= depth_double or not 0 <= grad_ckpt_single <= depth_single:
            raise ValueError(
                f"grad_ckpt_double={grad_ckpt_double} / grad_ckpt_single={grad_ckpt_single} must lie in "
                f"[0, depth_double={depth_double}] / [0, depth_single={depth_single}]"
            )
        check_backend(attn_backend)
        if causal_chunk_frames < 0 or causal_chunk_frames % patch_size[0]:
            raise ValueError(
                f"causal_chunk_frames={causal_chunk_frames} must be 0 or a positive multiple of the "
                f"temporal patch size {patch_size[0]}"
            )
        if causal_chunk_frames and attn_backend == "flash":
            raise ValueError(
                "a causal MMDiT attends with a mask, which the flash kernel does not take; use "
                "attn_backend 'auto', 'cudnn', 'efficient' or 'math'"
            )
        out_channels = in_channels if out_channels is None else out_channels
        self.arch["out_channels"] = out_channels
        self.causal_chunk_frames = int(causal_chunk_frames)
        self.in_channels, self.out_channels, self.cond_channels = in_channels, out_channels, cond_channels
        self.patch_size = tuple(patch_size)
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.axes_dims, self.theta = tuple(axes_dims), theta
        self.grad_ckpt_double, self.grad_ckpt_single = grad_ckpt_double, grad_ckpt_single
        patch_volume = self.patch_size[0] * self.patch_size[1] * self.patch_size[2]

        self.img_in = nn.Linear(in_channels * patch_volume, hidden_size)
        self.cond_in = None
        if cond_channels is not None:
            # Zero-initialised: a fresh (or converted text-to-video) model ignores the condition input.
            self.cond_in = nn.Linear(cond_channels * patch_volume, hidden_size)
            nn.init.zeros_(self.cond_in.weight)
            nn.init.zeros_(self.cond_in.bias)
        self.txt_in = nn.Linear(text_dim, hidden_size)
        self.time_in = MLPEmbedder(TIMESTEP_FEATURES, hidden_size)
        self.vector_in = MLPEmbedder(pooled_dim, hidden_size)
        self.guidance_in = MLPEmbedder(TIMESTEP_FEATURES, hidden_size) if guidance_embed else None

        block_args = dict(
            hidden_size=hidden_size,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            attn_backend=attn_backend,
        )
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(**block_args) for _ in range(depth_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(**block_args) for _ in range(depth_single))
        self.final_layer = FinalLayer(hidden_size, out_channels * patch_volume)
        self.compile_blocks, self.compile_options = False, {}
        self.inductor_options = dict(inductor_options or {})
        self.set_compile_blocks(compile_blocks)
        self.sp = None
        if padded_text_attention not in PADDED_TEXT_ATTENTION:
            raise ValueError(
                f"padded_text_attention={padded_text_attention!r}: choose one of {', '.join(PADDED_TEXT_ATTENTION)}"
            )
        self.padded_text_attention = self.arch.pop("padded_text_attention")
        self.text_length_multiple = int(self.arch.pop("text_length_multiple"))
        self.arch.pop("fp8_linears")  # not architecture: a rebuild from ``arch`` (sampling, export) needs no torchao
        self.arch.pop("checkpoint_in_graph")  # a training option (graph_checkpoint.py)
        self.arch.pop("inductor_options")  # how to compile, not what to compute
        self.checkpoint_in_graph = bool(checkpoint_in_graph)
        if check_recipe(fp8_linears) is not None:
            convert_block_linears(self, fp8_linears)

    def set_sequence_parallel(self, sp: Optional[SequenceGroup]) -> None:
        """Split every sample's tokens over the ranks of ``sp`` (opensora.parallel.sequence_parallel); ``None`` turns
        it off. All ranks of the group must get the same inputs; each returns the whole output."""
        if sp is not None and sp.size == 1:
            sp = None
        if sp is not None and self.compile_blocks:
            raise ValueError(
                "sequence parallelism with compile_blocks=True is not supported (the all-to-all would "
                "split every compiled block); turn one off"
            )
        if sp is not None and self.arch["num_heads"] % sp.size:
            raise ValueError(
                f"sequence parallelism over {sp.size} ranks needs num_heads ({self.arch['num_heads']}) divisible by it"
            )
        self.sp = sp
        for block in [*self.double_blocks, *self.single_blocks]:
            block.sp = sp

    def set_attn_backend(self, backend: str) -> None:
        check_backend(backend)
        self.arch["attn_backend"] = backend
        for block in [*self.double_blocks, *self.single_blocks]:
            block.attn_backend = backend

    def set_grad_ckpt(self, double: int, single: int) -> None:
        """Checkpoint the first ``double`` double blocks and first ``single`` single blocks (0 = none)."""
        if not 0 <= double <= len(self.double_blocks) or not 0 <= single <= len(self.single_blocks):
            raise ValueError(f"grad ckpt counts ({double}, {single}) exceed the block counts")
        self.grad_ckpt_double, self.grad_ckpt_single = double, single
        self.arch.update(grad_ckpt_double=double, grad_ckpt_single=single)

    def set_compile_blocks(
        self, enabled: bool, inductor_options: Optional[dict] = None, attention: Optional[str] = None
    ) -> None:
        """Compile each block with torch.compile (regional compilation), or go back to eager.

        Blocks of one kind share code, so Dynamo compiles one double and one single block graph and reuses
        them; this fuses the small ops (norms, RoPE, modulation, gating) around the matmuls. ``attention``
        ("traced", the default, or "op"; process-wide, see attention.py's ``COMPILED_ATTENTION``): SDPA traced into
        the graph, or the opaque ``opensora::attention`` op whose backward recomputes the forward; either way each
        block is one graph with no graph break, at any batch size. ``nn.Module.compile`` compiles in place, so
        parameter names and state dicts are unchanged. Off by default: compiling costs tens of seconds and gains
        little on CPU. ``inductor_options`` (e.g. ``{"split_reductions": False}``) go to
        ``torch.compile(options=...)`` on top of ``compile_block_options``' defaults, to try Inductor settings;
        ``None`` keeps the model's own (its ``inductor_options`` argument).
        """
        if enabled and getattr(self, "sp", None) is not None:
            raise ValueError("compile_blocks=True with sequence parallelism is not supported; turn one off")
        if attention is not None:  # how attention enters the compiled graphs (attention.py's COMPILED_ATTENTION)
            if attention not in COMPILED_ATTENTION_MODES:
                raise ValueError(f"attention must be one of {COMPILED_ATTENTION_MODES}, got {attention!r}")
            COMPILED_ATTENTION["mode"] = attention
        options = compile_block_options(self.inductor_options if inductor_options is None else inductor_options)
        self.compile_options = options  # also for the checkpointed calls compiled as one graph (graph_checkpoint.py)
        for block in [*self.double_blocks, *self.single_blocks]:
            if enabled:
                block.compile(options=options) if options else block.compile()
            else:
                block._compiled_call_impl = None  # what nn.Module.compile sets; None restores eager calls
        self.compile_blocks = bool(enabled)
        self.arch["compile_blocks"] = self.compile_blocks

    def conditioning_vector(self, timestep, pooled, guidance):
        dtype = self.time_in.in_layer.weight.dtype
        vec = self.time_in(timestep_embedding(timestep, TIMESTEP_FEATURES).to(dtype))
        vec = vec + self.vector_in(pooled.to(dtype))
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this MMDiT was built with guidance_embed=True: pass guidance [B]")
            vec = vec + self.guidance_in(timestep_embedding(guidance, TIMESTEP_FEATURES).to(dtype))
        return vec

    @staticmethod
    def key_mask(
        text_mask: Optional[torch.Tensor], num_video_tokens: int, has_padding: Optional[bool] = None
    ) -> Optional[torch.Tensor]:
        """Boolean key mask [B, 1, 1, L+N] hiding padded text tokens; ``None`` when every token is valid.

        ``has_padding=None`` inspects the mask, which is a host sync when it lives on the GPU; callers that know
        (False: no padding, so no mask and the mask-free kernels; True: build the mask) skip that sync.
        """
        if text_mask is None or has_padding is False:
            return None
        text_mask = text_mask.bool()
        if has_padding is None and bool(text_mask.all()):
            return None
        video = text_mask.new_ones(text_mask.shape[0], num_video_tokens)
        return torch.cat((text_mask, video), dim=1)[:, None, None, :]

    def prepare_text(
        self, text_emb, text_mask, text_mask_has_padding: Optional[bool] = None, text_length_bound: Optional[int] = None
    ):
        """The text a bidirectional pass attends to: ``(text_emb, text_mask, lengths)``. In training, cut after the
        batch's longest valid prompt (``text_padding.trim_text``: exact; ``lengths`` None when nothing was read), or
        after ``text_length_bound`` (a host int >= every row's valid length: no host read, ``trim_text_to_bound``);
        an eval pass (sampling, frozen teachers, CUDA-graph captures) keeps the padded text and its dense mask, which
        needs no host read. ``forward`` and every caller that runs the blocks itself (pipeline stages, the region
        cache) start from it, so they all take the same path."""
        if not self.training:
            return text_emb, text_mask, None
        if self.cuts_text_to_bound(text_mask, text_mask_has_padding, text_length_bound):
            return (*trim_text_to_bound(text_emb, text_mask, text_length_bound, self.text_length_multiple), None)
        return trim_text(text_emb, text_mask, text_mask_has_padding, self.text_length_multiple)

    def cuts_text_to_bound(self, text_mask, text_mask_has_padding, text_length_bound) -> bool:
        """Whether ``prepare_text`` cuts the text at ``text_length_bound``: a training pass with a mask that may
        pad."""
        return (
            self.training
            and text_length_bound is not None
            and text_mask is not None
            and text_mask_has_padding is not False
        )

    def padding_mask(
        self, text_mask, lengths, num_text: int, num_video: int, has_padding=None, own_keys=True, rows_from_mask=False
    ):
        """How a bidirectional pass hides padded text keys (after ``prepare_text``): rows with padding left (training
        without sequence parallelism) attend as ``padded_text_attention`` says: the dense ``key_mask``,
        ``PackedRows`` (one variable-length call), ``FlexRows`` (a FlexAttention block mask) or ``KeyRanges`` (one
        mask-free SDPA call per row; also what "packed" falls back to for ``own_keys=False``, where "flex" keeps the
        dense mask); otherwise the dense ``key_mask`` or None.
        ``own_keys=False`` for a pass whose queries are not its keys (a cache adds the keys of
        tokens it did not recompute): every query of a row then attends over that row's ranges.
        ``rows_from_mask``: the text was cut to a host-known bound (no lengths read): "zero-keys" builds its rows from
        the device mask, the other paths take the dense key mask."""
        how = self.padded_text_attention
        if rows_from_mask and how == "zero-keys" and own_keys and self.sp is None and text_mask is not None:
            return ZeroKeyRows.from_key_mask(self.key_mask(text_mask, num_video, has_padding=True), num_text)
        if lengths is not None and self.sp is None and how != "dense":
            if own_keys and how in ROW_MASKS and min(lengths) < num_text:
                return ROW_MASKS[how](lengths, num_text, num_video, text_mask.device)
            if how != "flex":  # flex's other cases: the dense key mask below
                return padded_text_keys(lengths, num_text, num_video, queries_at_keys=own_keys)
        return self.key_mask(text_mask, num_video, has_padding if lengths is None else min(lengths) < num_text)

    def rope(self, grid, num_text_tokens: int, device, time_offset: int = 0, text_time: int = 0):
        """RoPE tables of [text, video]; ``time_offset`` (in time patches) shifts the video's time ids, ``text_time``
        is the text's time id (0; a rolled window with ``rope_anchor="window"`` moves it to the window's start)."""
        video_ids = video_position_ids(*grid, device=device)
        if time_offset:
            video_ids[:, 0] += time_offset
        text_ids = video_ids.new_zeros(num_text_tokens, 3)
        if text_time:
            text_ids[:, 0] = text_time
        ids = torch.cat((text_ids, video_ids))
        return rope_cos_sin(ids, self.axes_dims, self.theta)

    def run_block(self, block, checkpointed: bool, *args):
        recompute = checkpointed and self.training and torch.is_grad_enabled()
        if recompute and self.compile_blocks and self.checkpoint_in_graph:  # the recompute inside the compiled graph
            kind = "double" if isinstance(block, DoubleStreamBlock) else "single"
            return checkpointed_in_graph(kind, self.compile_options)(block, *args)
        if self.compile_blocks:  # a recompute in the backward runs under the forward's thread count
            block = partial(call_with_thread_count, torch.get_num_threads(), block)
        if recompute:
            if self.compile_blocks:
                init_cuda_before_checkpointed_compile()
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(
        self,
        x: torch.Tensor,
        *,
        timestep: torch.Tensor,
        text_emb: torch.Tensor,
        text_mask: Optional[torch.Tensor] = None,
        pooled: Optional[torch.Tensor] = None,
        cond: Optional[torch.Tensor] = None,
        guidance: Optional[torch.Tensor] = None,
        text_mask_has_padding: Optional[bool] = None,
        text_length_bound: Optional[int] = None,
        kv_cache: Optional[KVCache] = None,
        start_frame: int = 0,
        store_kv: bool = False,
        text_cache: Optional[TextKVCache] = None,
        text_key=None,
    ) -> torch.Tensor:
        """Velocity prediction for ``x``; everything but ``x`` is passed by keyword.

        Args:
            x: noisy latents ``[B, in_channels, T, H, W]``.
            timestep: flow-matching time ``[B]`` in [0, 1], 1 is noise.
            text_emb: text token features ``[B, L, text_dim]``.
            text_mask: ``[B, L]``, true for real text tokens (None: all real).
            pooled: pooled text vector ``[B, pooled_dim]`` (required).
            cond: condition input ``[B, cond_channels, T, H, W]`` (mask channel + masked latents), for a model
                built with ``cond_channels``.
            guidance: distilled guidance scale ``[B]``, for a model built with ``guidance_embed``.
            text_mask_has_padding: lets a caller that knows whether ``text_mask`` has padded tokens skip
                inspecting it (a GPU->host sync per step), see ``key_mask``.
            text_length_bound: a host int >= every row's valid text length (e.g. from the loader's host mask): a
                training pass cuts the text there instead of reading the lengths back from the device
                (``prepare_text``).
            kv_cache, start_frame, store_kv: a causal model (``causal_chunk_frames > 0``, causal.py) given a
                ``kv_cache`` runs ``forward_chunk`` (through ``forward``, so a training wrapper's hooks run);
                ``text_cache``/``text_key`` go with it (the causal text cache, see ``forward_chunk``).

        A causal model runs the full block-causal forward; with ``timestep`` ``[B, num_chunks]`` each chunk is at
        its own time (``per_chunk_timestep_forward``).
        """
        if kv_cache is not None:
            return self.forward_chunk(
                x,
                timestep=timestep,
                text_emb=text_emb,
                text_mask=text_mask,
                pooled=pooled,
                cond=cond,
                guidance=guidance,
                cache=kv_cache,
                start_frame=start_frame,
                store_kv=store_kv,
                text_cache=text_cache,
                text_key=text_key,
                text_mask_has_padding=text_mask_has_padding,
            )
        bounded = self.cuts_text_to_bound(text_mask, text_mask_has_padding, text_length_bound)
        text_emb, text_mask, text_lengths = self.prepare_text(
            text_emb, text_mask, text_mask_has_padding, text_length_bound
        )
        if self.causal_chunk_frames and timestep.dim() == 2:
            return per_chunk_timestep_forward(self, x, timestep, text_emb, text_mask, pooled, cond, guidance)
        img, txt, vec, grid = self.embed(x, timestep, text_emb, pooled, cond, guidance)
        rope = self.rope(grid, txt.shape[1], x.device)
        if self.causal_chunk_frames:
            if self.sp is not None:
                raise ValueError("a causal MMDiT does not support sequence parallelism")
            video = block_causal_video_mask(
                grid[0], grid[1] * grid[2], self.causal_chunk_frames // self.patch_size[0], x.device
            )
            mask = joint_attention_mask(text_mask, txt.shape[1], video)
        else:
            mask = self.padding_mask(
                text_mask, text_lengths, txt.shape[1], img.shape[1], text_mask_has_padding, rows_from_mask=bounded
            )

        if self.sp is not None:
            img, txt, rope, mask = self.shard_sequence(img, txt, rope, mask)
        img = self.run_blocks(img, txt, vec, rope, mask)
        if self.sp is not None:
            img = gather_tokens(img, self.sp)[:, : grid[0] * grid[1] * grid[2]]  # drop padding tokens, if any
        return unpatchify(img, grid, self.patch_size)

    def embed(self, x, timestep, text_emb, pooled, cond=None, guidance=None, with_text: bool = True):
        """Inputs -> (video tokens, text tokens, conditioning vector, patch grid (t, h, w)), with the input checks.
        ``with_text=False`` skips the text projection (text tokens None: a pass whose text comes from a cache)."""
        if pooled is None:
            raise ValueError("pooled text vector [B, pooled_dim] is required")
        img, txt, grid = self.embed_tokens(x, text_emb, cond, with_text)
        return img, txt, self.conditioning_vector(timestep, pooled, guidance), grid

    def embed_tokens(self, x, text_emb, cond=None, with_text: bool = True):
        """``embed`` without the conditioning vector: (video tokens, text tokens or None, patch grid)."""
        patches, cond_patches, grid = self.patch_inputs(x, cond)
        img = self.embed_patches(patches, cond_patches)
        return img, self.txt_in(text_emb) if with_text else None, grid

    def patch_inputs(self, x, cond=None):
        """Checked ``x`` [B, C, T, H, W] and ``cond`` -> (patch tokens of x, of cond or None, patch grid (t, h, w)).
        ``embed_patches`` of any subset of their rows (the same rows of both) embeds those video tokens only."""
        if x.dim() != 5 or x.shape[1] != self.in_channels:
            raise ValueError(f"x must be [B, {self.in_channels}, T, H, W], got {tuple(x.shape)}")
        _, _, t, h, w = x.shape
        pt, ph, pw = self.patch_size
        cond_patches = None
        if cond is not None:
            if self.cond_in is None:
                raise ValueError("cond was given but this MMDiT was built with cond_channels=None")
            if cond.shape[1] != self.cond_channels or cond.shape[2:] != x.shape[2:]:
                raise ValueError(
                    f"cond must be [B, {self.cond_channels}, {t}, {h}, {w}] (mask channel + masked latents), "
                    f"got {tuple(cond.shape)}"
                )
            cond_patches = patchify(cond, self.patch_size)
        return patchify(x, self.patch_size), cond_patches, (t // pt, h // ph, w // pw)

    def embed_patches(self, patches, cond_patches=None) -> torch.Tensor:
        """Video tokens of patch tokens (+ the zero-initialised projection of the condition's)."""
        img = self.img_in(patches)
        if cond_patches is not None:
            img = img + self.cond_in(cond_patches)
        if img.is_cuda:
            device_major(img.device)  # fill the capability cache eagerly, outside the compiled blocks
        return img

    def run_blocks(self, img, txt, vec, rope, mask, kv_hooks=None):
        """Double then single blocks and the final layer -> output video tokens. ``kv_hooks``: one per block
        (double blocks first), see layers.py. ``txt=None``: a video-only pass whose hooks supply the text
        keys/values (causal text cache, ``forward_chunk``)."""
        num_blocks = len(self.double_blocks) + len(self.single_blocks)
        state = self.run_block_range(dict(img=img, txt=txt), 0, num_blocks, vec, rope, mask, kv_hooks)
        return self.final_tokens(state, vec)

    def run_block_range(self, state: dict, lo: int, hi: int, vec, rope, mask, kv_hooks=None) -> dict:
        """Blocks ``lo..hi-1`` of ``[*double_blocks, *single_blocks]`` on ``state``: ``dict(img, txt)`` before and
        inside the double blocks (``txt`` None in a video-only pass), ``dict(tokens, num_text)`` once the single
        blocks began (text rows first). ``kv_hooks[i - lo]`` is block i's kv_hook. ``run_blocks`` is the whole range,
        and a two-GPU pipeline stage (``inference.pipeline_parallel``) a part of it: the same operations in the same order."""
        depth = len(self.double_blocks)
        for i in range(lo, hi):
            hook = None if kv_hooks is None else kv_hooks[i - lo]
            if i < depth:
                img, txt = self.run_block(
                    self.double_blocks[i], i < self.grad_ckpt_double, state["img"], state["txt"], vec, rope, mask, hook
                )
                state = dict(img=img, txt=txt)
            else:
                state = self._as_tokens(state)
                j = i - depth
                tokens = self.run_block(
                    self.single_blocks[j], j < self.grad_ckpt_single, state["tokens"], vec, rope, mask, hook
                )
                state = dict(tokens=tokens, num_text=state["num_text"])
        return state

    @staticmethod
    def _as_tokens(state: dict) -> dict:
        """The joint sequence [text, video] of a state (as the single blocks take it)."""
        if "tokens" in state:
            return state
        img, txt = state["img"], state["txt"]
        tokens = img if txt is None else torch.cat((txt, img), dim=1)
        return dict(tokens=tokens, num_text=0 if txt is None else txt.shape[1])

    def final_tokens(self, state: dict, vec) -> torch.Tensor:
        """The final layer on the video tokens of a state after the last block."""
        state = self._as_tokens(state)
        return self.final_layer(state["tokens"][:, state["num_text"] :], vec)

    def shard_sequence(self, img, txt, rope, mask):
        """This rank's slices of the text and video tokens, their RoPE angles, and the key mask in the rank-major
        order the attention sees after the all-to-all (opensora.parallel.sequence_parallel).

        Token counts that the group size does not divide are padded at the end of each stream with zero tokens that
        no query may attend to (the key mask hides them; identity RoPE); their outputs are dropped after the
        gather. Padding turns the mask on, which rules out the mask-free attention kernels for that shape."""
        sp = self.sp
        n_txt, n_img = txt.shape[1], img.shape[1]
        pad_txt, pad_img = -n_txt % sp.size, -n_img % sp.size
        if pad_txt or pad_img:
            if mask is None:
                mask = torch.ones(img.shape[0], 1, 1, n_txt + n_img, dtype=torch.bool, device=img.device)
            mask = torch.cat((F.pad(mask[..., :n_txt], (0, pad_txt)), F.pad(mask[..., n_txt:], (0, pad_img))), -1)
            rope = tuple(
                torch.cat(
                    (
                        table[:n_txt],
                        table.new_full((pad_txt, table.shape[1]), fill),
                        table[n_txt:],
                        table.new_full((pad_img, table.shape[1]), fill),
                    )
                )
                for table, fill in zip(rope, (1.0, 0.0))
            )  # cos 1, sin 0: no rotation
            txt, img = F.pad(txt, (0, 0, 0, pad_txt)), F.pad(img, (0, 0, 0, pad_img))
            n_txt, n_img = n_txt + pad_txt, n_img + pad_img
        txt_part = sp.local_slice(n_txt, "the text token count")
        img_part = sp.local_slice(n_img, "the video token count")
        # joint-sequence positions (text first, then video) of each rank's tokens, in rank order
        per_rank = [
            torch.cat((t, n_txt + i))
            for t, i in zip(torch.arange(n_txt).chunk(sp.size), torch.arange(n_img).chunk(sp.size))
        ]
        rope = tuple(table.index_select(0, per_rank[sp.rank].to(table.device)) for table in rope)
        if mask is not None:
            mask = mask.index_select(-1, torch.cat(per_rank).to(mask.device))
        return img[:, img_part], txt[:, txt_part], rope, mask

"""The sampling CLI's options (opensora/inference/options.py): one owner of every default, each feature's flags
checked with a one-line error naming the flag, the namespace read once; and the streaming rules every chunk loop
shares, against their closed forms."""

import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opensora.cli_errors import UserInputError
from opensora.inference.cache.config import JanoConfig
from opensora.inference.options import FEATURES, CacheOptions, InferenceOptions, StreamingOptions

ROOT = Path(__file__).resolve().parents[1]


def namespace(**overrides):
    values = dict(InferenceOptions.flags(), config="c.py")
    unknown = set(overrides) - set(values)
    assert not unknown, unknown
    return SimpleNamespace(**dict(values, **overrides))


def test_every_flag_has_one_owner_and_the_cli_takes_them_all():
    from opensora.inference import cli

    owners = {}
    for name, kind in FEATURES.items():
        for f in fields(kind):
            assert f.name not in owners, f"{f.name} is declared by {owners[f.name]} and {name}"
            owners[f.name] = name
    assert set(cli.INFERENCE_FLAGS) == set(owners)
    assert CacheOptions().jano_config() == JanoConfig()  # the cache's defaults are JanoConfig's own


def test_defaults_pass_their_checks_and_the_namespace_is_read_once():
    options = InferenceOptions.from_args(namespace())
    assert options.sampling.step_list is None and options.streaming.rollout == "renoise"
    assert options.config == "c.py" and not options.pipeline.enabled and not options.cache.enabled
    options = InferenceOptions.from_args(namespace(step_list="1.0, 0.75,0.5", streaming=True, window_frames=4))
    assert options.sampling.step_list == [1.0, 0.75, 0.5] and options.streaming.window_frames == 4
    assert options.sampling.steps_record() == dict(num_steps=3, step_list=[1.0, 0.75, 0.5])
    kwargs = options.streaming.generator_kwargs(options.sampling, "cpu")
    assert kwargs["cuda_graphs"] is False and kwargs["step_list"] == [1.0, 0.75, 0.5] and kwargs["window_frames"] == 4


@pytest.mark.parametrize(
    "overrides, phrase",
    [
        (dict(rollout="ddim"), "--rollout 'ddim' is not one of renoise, euler"),
        (dict(context_time=1.0), "--context-time must be < 1"),
        (dict(window_frames=0), "--window-frames must be >= 1"),
        (dict(stream_graphs="maybe"), "--stream-graphs must be one of auto, on, off"),
        (dict(pp_overlap="max"), "--pp-overlap must be one of"),
        (dict(pp_decode_stream="gpu"), "--pp-decode-stream must be one of"),
        (dict(pp_host_copies="mine"), "--pp-host-copies must be one of"),
        (dict(pp_devices="cuda:0", streaming=True), "--pp-devices needs exactly two devices"),
        (dict(pp_devices="cuda:0,cuda:1"), "--pp-devices drives the streaming sampler: add --streaming"),
        (dict(pp_devices=(0, 1)), "--pp-devices drives the streaming sampler"),  # "--pp-devices 0,1" parses to ints
        (dict(jano_settings=dict(warmup_steps=1)), "--jano-settings: jano warmup_steps must be >= 2"),
        (dict(jano_settings=dict(warmup=4)), "--jano-settings.warmup is not a Jano setting"),
        (dict(jano=True, streaming=True), "--streaming has its own KV cache: pick one"),
        (dict(streaming=True, cond_type="i2v_head"), "--streaming generates text-to-video only"),
        (dict(sequence_parallel_size=2, jano_graphs=True), "does not combine with --jano"),
        (dict(step_list="1.0,x"), "--step-list"),
        (dict(rope_anchor="relative"), "--rope-anchor 'relative' is not one of absolute, window"),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag(overrides, phrase):
    with pytest.raises(UserInputError, match=phrase.replace("(", r"\(")) as error:
        InferenceOptions.from_args(namespace(**overrides))
    assert "\n" not in str(error.value)


def test_help_lists_every_feature_without_loading_torch():
    probe = "import sys; from opensora.inference import cli, options; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-2000:]


def test_streaming_graph_choice_follows_the_device():
    on = StreamingOptions(stream_graphs="auto")
    assert on.graphs_on("cuda:1") and not on.graphs_on("cpu")
    assert not StreamingOptions(stream_graphs="off").graphs_on("cuda:0")


def test_the_rope_anchor_defaults_to_window_on_one_device_and_in_the_pipeline():
    one = InferenceOptions.from_args(namespace(streaming=True))
    assert one.streaming.rope_anchor == "window" and one.streaming.record()["rope_anchor"] == "window"
    piped = InferenceOptions.from_args(namespace(streaming=True, pp_devices="cuda:0,cuda:1"))
    assert piped.streaming.rope_anchor == "window"
    assert InferenceOptions.from_args(namespace(streaming=True, rope_anchor="absolute")).streaming.rope_anchor == (
        "absolute"
    )


def test_rollout_steps_are_their_closed_forms():
    from opensora.inference.streaming.rules import rollout_step

    x, v, noise = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(rollout_step(x, v, 0.75, 0.5, "euler"), x - 0.25 * v)
    x0 = x - 0.75 * v
    torch.testing.assert_close(rollout_step(x, v, 0.75, 0.5, "renoise", noise), 0.5 * noise + 0.5 * x0)
    torch.testing.assert_close(rollout_step(x, v, 0.25, 0.0, "renoise"), x - 0.25 * v)  # x0 at the final time
    with pytest.raises(ValueError, match="unknown rollout"):
        rollout_step(x, v, 0.75, 0.5, "ddim")


def test_stream_noise_draws_in_the_loops_order_from_one_generator_per_sample():
    """Per chunk: the initial latent, one draw per re-noised step (not at the final time 0), the context noise;
    a sample's draws are those of its own seeded CPU generator, whatever its batch."""
    from opensora.inference.streaming.rules import StreamNoise

    times = [1.0, 0.6, 0.3, 0.0]
    noise = StreamNoise([3, 9], 2, (4, 4), times, "renoise", 0.1)
    assert noise.draws_per_chunk() == 1 + 2 + 1
    x, steps, context = noise.chunk(2)
    assert [s is None for s in steps] == [False, False, True] and context is not None
    gen = torch.Generator().manual_seed(9)
    expected = [torch.randn((2, 2, 4, 4), generator=gen) for _ in range(4)]
    for got, want in zip([x, steps[0], steps[1], context], expected):
        assert torch.equal(got[1], want)
    euler = StreamNoise([3], 2, (4, 4), times, "euler", 0.0)
    assert euler.draws_per_chunk() == 1 and euler.chunk(2)[1:] == ([None, None, None], None)


def test_padding_is_decided_over_every_cfg_row():
    from opensora.inference.streaming.rules import rows_of_passes, text_has_padding

    cond = dict(text_emb=torch.zeros(1, 3, 2), text_mask=torch.ones(1, 3, dtype=torch.bool))
    null = dict(text_emb=torch.zeros(1, 3, 2), text_mask=torch.tensor([[True, True, False]]))
    assert not text_has_padding(rows_of_passes([cond], "text_mask"))
    assert text_has_padding(rows_of_passes([cond, null], "text_mask"))
    assert not text_has_padding(rows_of_passes([dict(text_emb=torch.zeros(1, 3, 2))], "text_mask"))

"""Flow-matching math shared by training and sampling: timesteps and shift, noising, loss, conditions, CFG,
Euler sampling. Pure functions; see each module's docstring for the pinned conventions."""

from .conditions import (
    CONDITION_TYPES,
    ConditionBatch,
    build_inference_condition,
    build_training_condition,
    condition_frame_table,
    condition_mask_for_types,
    condition_probabilities,
    make_cond_input,
    null_condition_like,
    paste_condition_frames,
    reference_condition,
    sample_condition_types,
)
from .flow_matching import (
    add_noise,
    drop_text,
    inverse_time_shift,
    masked_mse,
    masked_mse_per_sample,
    num_latent_tokens,
    predict_noise,
    predict_x0,
    sample_drop_mask,
    sample_timesteps,
    sample_training_timesteps,
    shift_alpha_for,
    time_shift,
    velocity_target,
)
from .guidance import image_text_cfg, text_cfg
from .sampling import euler_step, guided_velocity, sample, timesteps_for_sampling, timesteps_from_list

from types import ModuleType as _ModuleType

__all__ = [
    name for name, obj in dict(globals()).items() if not name.startswith("_") and not isinstance(obj, _ModuleType)
]

"""CausVid-style DMD: DMD2 on a causal (block-causal attention) student.

Everything is DMD2 (``opensora.methods.dmd2``): the teacher is the real score with classifier-free guidance, the
critic is the fake score trained with flow matching on the student's samples, the two-time-scale rule decides
when the student steps, and the generator loss is ``dmd_gradient`` / ``generator_loss``. The student's rollout
is DMD2's backward simulation with a random step index per iteration; because the student's network is built
with ``causal_chunk_frames = num_frames_per_chunk``, each of its forwards is the full causal forward (chunk ``c``
of the video sees the text and chunks ``<= c``), so the student generates chunk-wise as it will stream. The
critic and the teacher stay bidirectional (they judge whole clips).

What this class adds: the causal-student check, and the guidance key ``real_guidance_scale``: the *standard*
CFG scale ``s`` of the real score, ``real = u + s (c - u)``; papers in the DMD family write ``c + w (c - u)``,
i.e. ``s = w + 1`` (``opensora.methods.causal.dmd_guidance_to_cfg_scale``). The ambiguous ``guidance_scale`` of
DMD2 is refused here.

Initialise the student from a causal ODE-init checkpoint (``CausalODEInit``), not straight from the teacher: a
bidirectional network run causally starts far from its own distribution.
"""

from opensora.methods.causal import check_causal_student
from opensora.methods.dmd2 import DMD2
from opensora.registry import METHODS


def _refuse_bare_guidance(name: str, kwargs: dict) -> None:
    if "guidance_scale" in kwargs:
        raise ValueError(
            f"{name}: use real_guidance_scale (the standard CFG scale s of the teacher's real score, "
            f"u + s (c - u); DMD's c + w (c - u) has s = w + 1), not guidance_scale"
        )


@METHODS.register_module()
class CausVid(DMD2):
    def __init__(
        self, roles, components, num_frames_per_chunk: int = 2, real_guidance_scale: float = 5.0, **dmd2_kwargs
    ):
        _refuse_bare_guidance(type(self).__name__, dmd2_kwargs)
        super().__init__(roles, components, guidance_scale=real_guidance_scale, **dmd2_kwargs)
        self.num_frames_per_chunk = check_causal_student(type(self).__name__, self.student, num_frames_per_chunk)

    @property
    def real_guidance_scale(self) -> float:
        return self.guidance_scale

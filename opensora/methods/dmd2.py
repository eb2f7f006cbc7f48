"""DMD2: distribution-matching distillation of a flow-matching teacher into a few-step student.

Roles (``models = dict(student=..., teacher=..., critic=...)`` in the config):

* ``student`` (trainable): the few-step generator. It is evaluated at the times of ``step_list`` (e.g.
  ``[1.0, 0.75, 0.5, 0.25]``, t = 1 is noise), each step predicting x0.
* ``teacher`` (frozen): the "real" score, queried with classifier-free guidance (prompt + null text).
* ``critic`` (trainable): the "fake" score, a flow-matching model of the student's current output distribution.

One iteration (all policy lives here; the adapter only runs networks):

1. Backward simulation: draw a step index ``j`` of the step list, run the student without gradients from pure
   noise through steps ``0 .. j-1`` (Euler, exactly the sampler inference uses -- or ``rollout="renoise"``:
   predicted x0 re-noised with fresh noise, as in the DMD2 paper), then one student step at ``t_j`` predicts
   ``x0_s`` -- with gradients when the student updates this iteration.
2. Generator loss (student iterations only): noise ``x0_s`` at ``t ~ U(min, max)`` (shifted), teacher x0 with CFG
   (``real``), critic x0 (``fake``), both without gradients; in float32
   ``g = (fake - real) / mean_per_sample(|x0_s - real|)`` and ``generator_loss = 0.5 * mse(x0_s, sg(x0_s - g))``.
   With the mean-reduced MSE, ``d generator_loss / d x0_s = g / x0_s.numel()``: the student moves its samples
   against the (normalised) score difference, i.e. towards the teacher's distribution.
3. Critic loss (every iteration): flow-matching velocity MSE of the critic on ``sg(x0_s)`` noised at a fresh t.

Two-time-scale rule: the critic updates every iteration, the student every ``student_update_every``-th
(iterations 0, k, 2k, ...). ``total_loss = generator_loss + critic_loss`` on student iterations and
``critic_loss`` otherwise; the two terms touch disjoint parameters (the critic sees a detached sample, teacher
and critic run without gradients for the generator loss), so one backward per optimizer restricted to that
role's parameters trains both correctly. ``get_optimizers`` / ``get_lr_schedulers`` list exactly the roles
that step, so each scheduler advances only with its optimizer.
"""

from typing import List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from opensora.diffusion.guidance import text_cfg
from opensora.diffusion.sampling import euler_step, timesteps_from_list
from opensora.methods.base import MissingRoleError, TrainingMethod
from opensora.registry import ADAPTERS, METHODS, build_module

ROLLOUTS = ("euler", "renoise")


# ---- pure math --------------------------------------------------------------------------------------------------
def dmd_gradient(x0: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(fake - real) / mean_per_sample(|x0 - real|)`` in float32 (the DMD2 normalised score difference)."""
    x0, real_x0, fake_x0 = x0.detach().float(), real_x0.detach().float(), fake_x0.detach().float()
    dims = tuple(range(1, x0.dim()))
    scale = (x0 - real_x0).abs().mean(dim=dims, keepdim=True).clamp_min(eps)
    return torch.nan_to_num((fake_x0 - real_x0) / scale)


def generator_loss(x0: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``0.5 * mse(x0, sg(x0 - grad))`` in float32; its gradient w.r.t. ``x0`` is ``grad / x0.numel()``."""
    x0 = x0.float()
    return 0.5 * F.mse_loss(x0, (x0 - grad.float()).detach(), reduction="mean")


def is_student_iteration(iteration: int, every: int) -> bool:
    """Two-time-scale rule: the student updates at iterations 0, every, 2 * every, ..."""
    return iteration % every == 0


@METHODS.register_module()
class DMD2(TrainingMethod):
    required_roles = ("student", "teacher", "critic")
    trainable_roles = ("student", "critic")

    def __init__(
        self,
        roles,
        components,
        step_list: Sequence[float] = (1.0, 0.75, 0.5, 0.25),
        rollout: str = "euler",
        student_update_every: int = 5,
        guidance_scale: float = 5.0,
        min_timestep: int = 20,
        max_timestep: int = 980,
        adapter: Optional[Mapping] = None,
    ):
        super().__init__(roles, components)
        if self.roles["teacher"].trainable:
            raise MissingRoleError(
                "DMD2: role 'teacher' must be frozen (trainable=False); it is the fixed real "
                "score and is never boosted or optimised"
            )
        if rollout not in ROLLOUTS:
            raise ValueError(f"DMD2: rollout must be one of {ROLLOUTS}, got {rollout!r}")
        if int(student_update_every) < 1:
            raise ValueError(f"DMD2: student_update_every must be >= 1, got {student_update_every}")
        self.step_times = timesteps_from_list(step_list)  # validated, with the final 0 appended
        self.num_student_steps = len(self.step_times) - 1
        self.rollout = rollout
        self.student_update_every = int(student_update_every)
        self.guidance_scale = float(guidance_scale)
        self.adapter = build_module(adapter or dict(type="MMDiTAdapter"), ADAPTERS, components=components)
        n = self.adapter.num_train_timesteps
        if not 0 <= int(min_timestep) <= int(max_timestep) <= n:
            raise ValueError(f"DMD2: need 0 <= min_timestep <= max_timestep <= {n}, got {min_timestep}, {max_timestep}")
        self.min_timestep, self.max_timestep = int(min_timestep), int(max_timestep)
        self.student = self.roles["student"]
        self.teacher = self.roles["teacher"]
        self.critic = self.roles["critic"]

    # ---- schedule -------------------------------------------------------------------------------------------
    def roles_to_update(self, iteration: int) -> List[str]:
        # critic first: the single-role "lr" the trainer logs stays the critic's
        if is_student_iteration(iteration, self.student_update_every):
            return ["critic", "student"]
        return ["critic"]

    # ---- policy ---------------------------------------------------------------------------------------------
    def sample_timesteps(self, batch) -> torch.Tensor:
        """Uniform discrete index in [min_timestep, max_timestep] per sample -> shifted continuous t."""
        index = torch.randint(self.min_timestep, self.max_timestep + 1, (batch.batch_size,))
        return self.adapter.shift_and_clamp_timestep(index, batch).to(self.components.device)

    def simulate_student_input(self, noise: torch.Tensor, step_index: int, batch) -> torch.Tensor:
        """Backward simulation: the student's own no-grad rollout from noise to step ``step_index``."""
        x = noise
        with torch.no_grad():
            for i in range(step_index):
                t, t_next = self.step_times[i], self.step_times[i + 1]
                t_batch = t.to(x.device).expand(x.shape[0])
                if self.rollout == "euler":
                    v = self.adapter.predict_velocity(self.student, x, t_batch, batch)
                    x = euler_step(x, v, t, t_next)
                else:
                    x0 = self.adapter.predict_x0(self.student, x, t_batch, batch)
                    x = self.adapter.add_noise(x0, torch.randn_like(x0), t_next.to(x.device).expand(x.shape[0]))
        return x

    def generate(self, batch, with_grad: bool) -> Tuple[torch.Tensor, int]:
        """Student sample ``x0_s`` from a random step of its step list (backward simulation first)."""
        noise = self.adapter.noise(batch)
        step_index = int(torch.randint(0, self.num_student_steps, (1,)).item())
        x = self.simulate_student_input(noise, step_index, batch)
        t = self.step_times[step_index].to(x.device).expand(x.shape[0])
        with torch.set_grad_enabled(with_grad):
            x0 = self.adapter.predict_x0(self.student, x, t, batch)
        return x0, step_index

    @torch.no_grad()
    def real_and_fake_x0(self, x0: torch.Tensor, batch) -> Tuple[torch.Tensor, torch.Tensor]:
        """Teacher x0 with CFG (prompt + null text) and critic x0 on the same freshly noised ``x0``."""
        t = self.sample_timesteps(batch)
        noisy = self.adapter.add_noise(x0.detach(), torch.randn_like(x0), t)
        cond = self.adapter.predict_x0(self.teacher, noisy, t, batch, conditional=True)
        if self.guidance_scale != 1.0:
            uncond = self.adapter.predict_x0(self.teacher, noisy, t, batch, conditional=False)
            real = text_cfg(cond, uncond, self.guidance_scale)
        else:
            real = cond
        fake = self.adapter.predict_x0(self.critic, noisy, t, batch, conditional=True)
        return real, fake

    def critic_loss(self, x0: torch.Tensor, batch) -> torch.Tensor:
        """Flow-matching loss of the critic on the detached student sample."""
        x0 = x0.detach()
        t = self.sample_timesteps(batch)
        noise = torch.randn_like(x0)
        noisy = self.adapter.add_noise(x0, noise, t)
        velocity = self.adapter.predict_velocity(self.critic, noisy, t, batch, conditional=True)
        return F.mse_loss(velocity, self.adapter.velocity_target(x0, noise))

    def judged_batch(self, prepared):
        """The batch whose prompts the teacher and the critic judge the generated ``x0`` with: the step's own (a
        method whose rollout switches prompts returns the switched one)."""
        return prepared

    # ---- one micro-step -------------------------------------------------------------------------------------
    def single_train_step(self, batch: Mapping, iteration: int):
        prepared = self.adapter.prepare_batch(batch)
        train_student = is_student_iteration(iteration, self.student_update_every)
        x0, step_index = self.generate(prepared, with_grad=train_student)
        judged = self.judged_batch(prepared)

        loss_map = {}
        forward_passes = step_index + 1 + 1  # rollout + student step + critic step
        backward_passes = 1  # critic
        if train_student:
            real, fake = self.real_and_fake_x0(x0, judged)
            grad = dmd_gradient(x0, real, fake)
            loss_map["generator_loss"] = generator_loss(x0, grad)
            forward_passes += 3 if self.guidance_scale != 1.0 else 2
            backward_passes += 1
        loss_map["critic_loss"] = self.critic_loss(x0, judged)
        loss_map["total_loss"] = loss_map["critic_loss"] + loss_map.get("generator_loss", 0.0)
        loss_map = {k: v if k == "total_loss" else v.detach() for k, v in loss_map.items()}

        # every MMDiT pass costs about the same; a backward is about twice a forward
        pass_flops = self.adapter.forward_flops(self.critic, prepared)
        outputs = dict(
            num_samples=prepared.batch_size,
            num_tokens=self.adapter.num_tokens(self.critic, prepared),
            flops=pass_flops * (forward_passes + 2 * backward_passes),
            student_step_index=step_index,
            trained_student=train_student,
        )
        return loss_map, outputs

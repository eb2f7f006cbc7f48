"""The training-step strategy interface ("method").

The trainer is algorithm-agnostic: every micro-step it calls ``single_train_step(batch, iteration)``, backwards
``loss_map["total_loss"]`` into the parameters of every role whose optimizer ``get_optimizers(iteration)`` returns
(each role's gradients through its own optimizer), and at the end of an accumulation window calls
``optimizers_step``, ``optimizers_zero_grad`` and, once the step is known to count, ``schedulers_step``. Which
optimizers and schedulers step in an iteration comes only from ``get_optimizers`` / ``get_lr_schedulers``, so a
scheduler never steps when its optimizer does not. Everything algorithm-specific lives in subclasses.
"""

from typing import Dict, List, Mapping, Tuple

import torch

from opensora.roles import Components, Role


class MissingRoleError(ValueError):
    pass


class TrainingMethod:
    #: role names this method needs; checked once at start-up
    required_roles: Tuple[str, ...] = ()
    #: role names whose optimizers step by default (``get_optimizers``); subclasses may alternate
    trainable_roles: Tuple[str, ...] = ()
    #: True when neither ``single_train_step`` nor the update schedule depends on ``iteration``: the trainer may then
    #: queue a step before it has read whether the previous one was skipped (``nonfinite_check="auto"``)
    same_step_every_iteration: bool = False

    def __init__(self, roles: Mapping[str, Role], components: Components):
        missing = [name for name in self.required_roles if name not in roles]
        if missing:
            raise MissingRoleError(
                f"method {type(self).__name__} needs roles {list(self.required_roles)}; missing {missing}; "
                f"the config defines {sorted(roles)}"
            )
        not_trainable = [name for name in self.trainable_roles if not roles[name].trainable]
        if not_trainable:
            raise MissingRoleError(f"method {type(self).__name__} trains roles {not_trainable}, marked frozen")
        self.roles = dict(roles)
        self.components = components

    # ---- the algorithm ----------------------------------------------------------------------------------------
    def single_train_step(self, batch: dict, iteration: int) -> Tuple[Dict[str, torch.Tensor], dict]:
        raise NotImplementedError

    # ---- what steps in an iteration (override for alternating schedules) --------------------------------------
    def roles_to_update(self, iteration: int) -> List[str]:
        return list(self.trainable_roles)

    def get_optimizers(self, iteration: int) -> list:
        return [self.roles[name].optimizer for name in self.roles_to_update(iteration)]

    def get_lr_schedulers(self, iteration: int) -> list:
        roles = (self.roles[name] for name in self.roles_to_update(iteration))
        return [role.lr_scheduler for role in roles if role.lr_scheduler is not None]

    def optimizers_step(self, iteration: int, found_inf=None) -> Dict[str, float]:
        """Step the optimizers (clipping gradients first); return grad norms by role. ``found_inf``: a device flag
        that turns the steps into no-ops (``Role.clip_and_step``)."""
        return {name: self.roles[name].clip_and_step(found_inf) for name in self.roles_to_update(iteration)}

    def schedulers_step(self, iteration: int) -> None:
        for scheduler in self.get_lr_schedulers(iteration):
            scheduler.step()

    def optimizers_schedulers_step(self, iteration: int) -> Dict[str, float]:
        """Step the optimizers (clipping gradients first) and their schedulers; return grad norms by role."""
        grad_norms = self.optimizers_step(iteration)
        self.schedulers_step(iteration)
        return grad_norms

    def optimizers_zero_grad(self, iteration: int) -> None:
        for optimizer in self.get_optimizers(iteration):
            optimizer.zero_grad()

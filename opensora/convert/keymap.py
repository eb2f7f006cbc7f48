"""Table-driven renaming of state-dict keys between our MMDiT and another layout.

A ``Rule`` maps one of our parameters (or a module's ``.weight``/``.bias``) to one or more foreign parameters.
With several targets our tensor is split along dim 0 (fused QKV <-> separate q/k/v; single-block ``linear1``
<-> q, k, v, MLP-in); ``swap_halves`` swaps the two dim-0 halves (adaLN (shift, scale) <-> (scale, shift)).
Templates use ``{i}`` for the block index. Both directions refuse keys no rule covers, naming them, so a
layout change never drops weights silently.
"""

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

StateDict = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: Tuple[str, ...]
    # Split sizes along dim 0 in units of hidden_size; None = whatever is left (the MLP part).
    split: Optional[Tuple[Optional[int], ...]] = None
    swap_halves: bool = False
    ours_re: re.Pattern = field(init=False, repr=False, compare=False)
    theirs_re: Tuple[re.Pattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.theirs, str):
            object.__setattr__(self, "theirs", (self.theirs,))
        if (self.split is None) != (len(self.theirs) == 1):
            raise ValueError(f"rule {self.ours}: a split needs several targets and several targets need a split")
        object.__setattr__(self, "ours_re", _compile(self.ours))
        object.__setattr__(self, "theirs_re", tuple(_compile(t) for t in self.theirs))


def _compile(template: str) -> re.Pattern:
    body = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)")
    return re.compile("^" + body + r"(?P<suffix>\.weight|\.bias)?$")


def split_sizes(total: int, split: Sequence[Optional[int]], hidden: int) -> List[int]:
    fixed = sum(hidden * s for s in split if s is not None)
    rest = total - fixed
    if rest < 0 or (None in split and rest == 0):
        raise ValueError(f"cannot split {total} rows into {tuple(split)} x hidden {hidden}")
    return [hidden * s if s is not None else rest for s in split]


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def export_state(state: StateDict, rules: Sequence[Rule], hidden: int, layout: str) -> StateDict:
    """Our state dict -> the foreign layout described by ``rules``."""
    out: StateDict = {}
    unknown = []
    for key, tensor in state.items():
        for rule in rules:
            match = rule.ours_re.match(key)
            if match is None:
                continue
            index, suffix = match.group("i") if "i" in match.groupdict() else None, match.group("suffix") or ""
            targets = [t.format(i=index) + suffix for t in rule.theirs]
            if rule.split is not None:
                parts = tensor.split(split_sizes(tensor.shape[0], rule.split, hidden), dim=0)
            else:
                parts = [swap_halves(tensor) if rule.swap_halves else tensor]
            out.update((t, p.contiguous()) for t, p in zip(targets, parts))
            break
        else:
            unknown.append(key)
    if unknown:
        raise KeyError(f"no {layout} mapping for our keys {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    return out


def import_state(state: StateDict, rules: Sequence[Rule], layout: str) -> StateDict:
    """A foreign state dict in the layout of ``rules`` -> our layout (split parts are concatenated back)."""
    groups: Dict[Tuple[int, Optional[str], str], Dict[int, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state.items():
        found = False
        for rule_index, rule in enumerate(rules):
            for part, pattern in enumerate(rule.theirs_re):
                match = pattern.match(key)
                if match is None:
                    continue
                index = match.group("i") if "i" in match.groupdict() else None
                groups.setdefault((rule_index, index, match.group("suffix") or ""), {})[part] = tensor
                found = True
                break
            if found:
                break
        if not found:
            unknown.append(key)
    if unknown:
        raise KeyError(f"keys not in the {layout} layout: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    out: StateDict = {}
    for (rule_index, index, suffix), parts in groups.items():
        rule = rules[rule_index]
        ours = rule.ours.format(i=index) + suffix
        missing = [rule.theirs[p].format(i=index) + suffix for p in range(len(rule.theirs)) if p not in parts]
        if missing:
            raise KeyError(f"{layout} state dict lacks {missing} (needed to build our {ours})")
        if rule.split is not None:
            out[ours] = torch.cat([parts[p] for p in range(len(rule.theirs))], dim=0)
        else:
            out[ours] = swap_halves(parts[0]) if rule.swap_halves else parts[0]
    return out


def hidden_size_of(state: StateDict, key: str) -> int:
    """Hidden size read off a [hidden, in] linear weight (``key``), with a clear error if it is absent."""
    if key not in state:
        raise KeyError(f"state dict has no {key}: is it an MMDiT / Flux checkpoint?")
    return int(state[key].shape[0])

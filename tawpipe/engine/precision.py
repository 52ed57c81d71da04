"""Loss scaling, gradient clipping and non-finite steps: the numerics of one optimizer step.

Masters, optimizer state and gradient accumulators are float32 whatever the compute dtype
(design §6.4). What remains is to scale the loss so float16 gradients do not underflow, to clip
by the global norm, and to never let a non-finite loss or gradient reach the parameters.

Each chunk has exactly one owner, so the owners' squared norms add up to the global one: one
24-byte all-reduce (the plan's ALLREDUCE_STATS) gives every rank the norm and the overflow flag.
Replicated gradients are identical on every rank after their all-reduce and count once.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

NONFINITE = ("skip", "raise")
NORM_PIECE = 1 << 16  # elements per float32 norm of a piece in ``squared_norm``
CAST_SLICE = NORM_PIECE << 8  # elements cast to float32 at once by ``squared_norm`` (64 MiB)


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of float32 ``t``, in float64, without a copy of ``t``: the float32 norm
    of each piece of ``NORM_PIECE`` elements (a reduction kernel, no temporary), squared and summed
    in float64. A float64 copy and its square (16 B per element, 6 GiB at 403 M parameters on a
    GPU) would be the step's peak; this is within about 1e-6 of it (float32 rounding of a piece).
    A ``t`` of another dtype (a bfloat16 gradient) is taken ``CAST_SLICE`` elements at a time,
    each cast to float32: the same pieces, the same sum, a temporary of one slice."""
    flat = t.reshape(-1)
    if flat.dtype != torch.float32:
        return sum((squared_norm(flat[i:i + CAST_SLICE].float()) for i in range(0, flat.numel(), CAST_SLICE)),
                   torch.zeros((), dtype=torch.float64, device=flat.device))
    whole = flat.numel() // NORM_PIECE * NORM_PIECE
    pieces = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_PIECE), dim=1).double().square().sum()
    return pieces + torch.linalg.vector_norm(flat[whole:]).double().square()


@dataclass(frozen=True)
class DynamicScaling:
    """How a dynamic loss scale moves (the defaults are torch's ``GradScaler``'s): it starts at
    ``init_scale``, is multiplied by ``backoff`` on an overflow (that step is skipped) and by
    ``growth`` after ``growth_interval`` finite steps in a row."""

    init_scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 1000

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        if not number("init_scale") > 0:
            raise ValueError(f"init_scale must be > 0 (the first loss scale, e.g. 2**16), got {self.init_scale!r}")
        if not number("growth") > 1:
            raise ValueError(f"growth must be > 1 (e.g. 2.0), got {self.growth!r}")
        if not 0 < number("backoff") < 1:
            raise ValueError(f"backoff must be in (0, 1) (e.g. 0.5), got {self.backoff!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be a whole number >= 1 (finite steps before the scale "
                             f"grows, e.g. 1000), got {self.growth_interval!r}")


@dataclass
class Precision:
    """The per-step numerics; its mutable state is the loss scale and the step counters.

    ``loss_scale``: None (no scaling), a positive number (static) or "dynamic" (start at
    ``init_scale``, multiply by ``backoff`` on overflow, by ``growth`` after ``growth_interval``
    good steps: ``DynamicScaling``). ``nonfinite``: "skip" the step (parameters and optimizer state untouched) or
    "raise" FloatingPointError. Under dynamic scaling an overflow is routine and always skips.
    """

    loss_scale: float | str | None = None
    max_grad_norm: float | None = None
    nonfinite: str = "skip"
    init_scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 1000

    def __post_init__(self) -> None:
        ls = self.loss_scale
        if not (ls is None or ls == "dynamic" or (isinstance(ls, (int, float)) and not isinstance(ls, bool)
                                                  and math.isfinite(ls) and ls > 0)):
            raise ValueError(f"loss_scale must be None, 'dynamic' or a finite positive number, got {ls!r}")
        mgn = self.max_grad_norm
        if mgn is not None and (isinstance(mgn, bool) or not isinstance(mgn, numbers.Real)):
            raise TypeError(f"max_grad_norm must be a number > 0 (the global gradient norm to clip to) or None, "
                            f"got {mgn!r} (a {type(mgn).__name__}): pass e.g. max_grad_norm=1.0")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0 (or None), got {self.max_grad_norm}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}")
        DynamicScaling(self.init_scale, self.growth, self.backoff, self.growth_interval)  # its checks
        self.dynamic = self.loss_scale == "dynamic"
        self.scale = self.init_scale if self.dynamic else float(self.loss_scale or 1.0)
        self.good_steps = 0
        self.skipped_steps = 0

    @staticmethod
    def local_stats(grad_acc: torch.Tensor, loss_sum: torch.Tensor, sq: torch.Tensor | None = None) -> torch.Tensor:
        """[squared norm, non-finite flag] of this rank's own-chunk gradient and its loss sum, to be
        all-reduced (``squared_norm``: no copy of the gradient, on a GPU as on a host). ``sq``: the
        gradient's squared norm where it was taken already (on the device, before the gradient
        went to a host accumulator), so that ``grad_acc`` is not read again."""
        sq = squared_norm(grad_acc) if sq is None else sq
        return torch.stack([sq, (~torch.isfinite(sq)).double(), loss_sum.to(sq.device, torch.float64)])

    def finish(self, step: int, stats: torch.Tensor, loss: float, rep_grad: torch.Tensor,
               own_grad: torch.Tensor) -> bool:
        """Unscale, check and clip the step's gradients; True if the optimizer should step.

        ``stats`` is the all-reduced ``local_stats`` (of the scaled gradients); ``rep_grad`` and
        ``own_grad`` are flat views that are unscaled and clipped in place.
        """
        inv = 1.0 / self.scale
        sq = (stats[0].item() + squared_norm(rep_grad).item()) * inv * inv
        finite = stats[1].item() == 0 and math.isfinite(sq) and math.isfinite(loss)
        if not finite:
            self.skipped_steps += 1
            if self.dynamic:
                self.scale *= self.backoff
                self.good_steps = 0
                return False
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"step {step}: the loss ({loss}) or the gradients are not finite; the parameters "
                    "and optimizer state are unchanged (nonfinite='skip' skips such steps instead)"
                )
            return False
        coef = inv
        if self.max_grad_norm is not None:
            coef *= min(1.0, self.max_grad_norm / (math.sqrt(sq) + 1e-6))
        if coef != 1.0:
            own_grad.mul_(coef)
            rep_grad.mul_(coef)
        if self.dynamic:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth
        return True

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])

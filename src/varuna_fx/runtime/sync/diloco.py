"""DiLoCo: replicas that take local steps and meet every ``every`` steps.

With ``replica_sync=vf.DiLoCo(every=H, outer_lr=..., outer_momentum=...)`` (``costs/wire.py``)
a stage's gradients are not reduced over its replicas: each replica's optimizer (made by
``pipe.optimizer``) steps on its own replica's gradients (the *inner* steps). A step
post-hook on that optimizer counts them; after every H-th, the *outer* step
(:meth:`DiLoCoSync.outer_step`): every replica all-reduces its parameters' change since the
last outer step, ``anchor - theta`` (the outer gradient, averaged over the D replicas), an outer
``torch.optim.SGD(nesterov=True, lr=outer_lr, momentum=outer_momentum)`` (plain SGD at
``outer_momentum=0``) steps the anchor (the
parameters the replicas last agreed on) with it, and every replica's parameters become the new
anchor. This is the DiLoCo paper's algorithm (and torchft's), per pipeline stage: the replicas
of each stage meet at the same inner step because every replica steps every step (fp16 steps
skipped for an overflow are skipped on every rank and not counted).

Composition. The pipeline runs as always within a replica. Weights tied across stages are still
summed over holders and replicas every step (their all-reduce spans both), so they stay
identical everywhere and take part in the outer step like the rest. ZeRO-1 is refused (each
replica's inner optimizer state is its own: ``planner/slow_links.check_settings``), and
``shard_optimizer="auto"`` leaves it unsharded. Gradient clipping clips each replica's own
gradients over its pipeline. D = 1 is refused at compile (nothing to average).

Checkpoints (``checkpoint/sync_state.py``): ``model/<fqn>`` holds the anchor (what every replica
agrees on: a DiLoCo checkpoint loads as a model anywhere), the outer momentum and the inner step
count per FQN, and each replica's own parameters and inner optimizer state under
``sync/replica<r>/``: resuming on the same layout continues exactly; a layout with other
replicas starts replica r from saved replica r where there is one, else from the anchor with
replica 0's optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...costs.wire import DiLoCo
from ..comm import AllReduce


class DiLoCoSync:
    """One rank's outer loop over the parameters it holds (``named``: trainable, by FQN)."""

    def __init__(self, setting: DiLoCo, named: dict[str, nn.Parameter], group: Any,
                 replicas: int, timeout: float, who: str) -> None:
        self.setting, self.named, self.group = setting, dict(named), group
        self.replicas, self.timeout, self.who = replicas, timeout, who
        self.inner_steps = 0  # optimizer steps since the run began (the same on every rank)
        with torch.no_grad():
            self.anchor = {n: nn.Parameter(p.detach().clone()) for n, p in self.named.items()}
        # Nesterov needs a momentum (torch refuses nesterov=True at 0); outer_momentum=0 is in
        # DiLoCo's documented range [0, 1) and means plain outer SGD.
        momentum = setting.outer_momentum
        self.outer = torch.optim.SGD(list(self.anchor.values()), lr=setting.outer_lr,
                                     momentum=momentum, nesterov=momentum > 0)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps and take the outer step after every ``every``-th; the
        first step of each period takes the parameters as its anchor (they agree then: after
        an outer step, the start, or weights loaded alike on every replica)."""
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.before_inner_step())
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_inner_step())

    def before_inner_step(self) -> None:
        if self.inner_steps % self.setting.every == 0:
            with torch.no_grad():
                for n, p in self.named.items():
                    self.anchor[n].copy_(p)

    def after_inner_step(self) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.setting.every == 0:
            self.outer_step()

    def outer_step(self) -> None:
        """Average the replicas' change since the anchor, step the anchor with it (outer
        Nesterov SGD), and start every replica from the new anchor."""
        names = list(self.named)
        deltas = [(self.anchor[n].detach() - self.named[n].detach()) for n in names]
        if deltas and self.group is not None:
            reduce = AllReduce(deltas, self.group, divide=self.replicas, timeout=self.timeout,
                               who=self.who, what="DiLoCo's outer all-reduce of the "
                               "replicas' parameter change")
            reduce.finish()
        for n, delta in zip(names, deltas):
            self.anchor[n].grad = delta
        self.outer.step()
        with torch.no_grad():
            for n in names:
                self.anchor[n].grad = None
                self.named[n].copy_(self.anchor[n])

    # -- checkpoints ---------------------------------------------------------------------------

    def momentum(self) -> dict[str, torch.Tensor]:
        """The outer momentum per FQN (absent before the first outer step)."""
        out = {}
        for n, p in self.anchor.items():
            buf = self.outer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[n] = buf
        return out

    def restore(self, inner_steps: int, anchor: dict[str, torch.Tensor],
                momentum: dict[str, torch.Tensor]) -> None:
        """Put a checkpoint's outer state back (``anchor``: what the model was loaded with)."""
        self.inner_steps = inner_steps
        with torch.no_grad():
            for n, value in anchor.items():
                if n in self.anchor:
                    self.anchor[n].copy_(value)
        self.outer.state.clear()
        for n, buf in momentum.items():
            if n in self.anchor:
                self.outer.state[self.anchor[n]] = {"momentum_buffer": buf.clone()}

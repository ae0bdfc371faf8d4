"""In-place morphing: survivors keep running when a machine leaves or joins.

``controller`` drives a morph (agree on the next generation, re-plan in this process, build the
runtime, move what changed owner, adopt it into the same ``Pipeline``); ``morphable`` names
what it reads of that pipeline and asks of it, and of a re-plan; ``state`` says what a
rank holds and needs (model tensors, optimizer state, the step's samples) as flat ranges per
canonical name; ``carried`` keeps what a joining process receives before the objects it belongs
to exist (optimizer, scheduler, data loader); ``records`` is ``pipe.morphs``.
"""

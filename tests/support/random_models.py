"""Seeded random models for the randomized equivalence test (issue 9).

``Program.generate(seed)`` draws a small model: a DAG of Linear layers, activations, in-place
ops, residual adds, concat/split, dropout, LayerNorm, shared modules, tied weights, buffers
(read, or updated by forward: in place, rebound, counted), torch.no_grad() blocks,
reductions, reshapes and masks over (batch, width) or (batch, seq, width) inputs, given by
position or keyword, with tensor/tuple/dict/nested outputs holding None, constants, inputs or
integer tensors, or a loss the model computes itself (``FEATURES``). The program renders as the
Python source of an ``nn.Module`` (``str(program)``), and the model is built by executing
exactly that source, so a failing seed prints a model one can read, paste and debug.

``Case.generate(seed)`` adds a pipeline configuration (stages P in 1..4, lowered to what the
model allows; schedule; recompute; micro-batch size; fx or torch.export) and ``run_case``
checks it against eager PyTorch with ``torch.testing.assert_close``: two training steps (loss,
every parameter gradient and every buffer; SGD in between) and the eval-mode output.

Dropout: the library keys each random op's draws by (step seed, op, sample index) (ir/rng.py).
Eager equality is checked with every dropout probability set to 0 (in train mode), in eval
mode, and with dropout active against eager on the whole batch inside ``vf.per_sample_rng``
(the same keyed draws), so P, schedule and recompute cannot change the loss or a gradient.

Reproduce a failure: ``python -c "from support import random_models as rm; print(rm.check(SEED))"`` from
``tests/`` (with ``PYTHONPATH=src``); ``bench/bench_random_models.py`` runs 2,000 cases.
"""

from __future__ import annotations

import copy
import random
import re
import textwrap
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - used by the generated source
from torch import nn

import varuna_fx as vf
from varuna_fx.errors import PartitionError

# Every feature the generator can put into a program (the last four: into a case). float64 is
# checked in one process; its torchrun bug (issue 9) is outside what this test launches.
FEATURES = (
    "linear", "activation", "activation_module", "residual_add", "elementwise", "concat",
    "split", "layernorm", "dropout", "functional_dropout", "shared_module", "tied_weights",
    "inplace", "inplace_module", "iadd", "inplace_statement", "inplace_view", "tuple_output",
    "dict_output",
    "nested_output", "model_loss", "none_output", "const_output", "input_output", "int_output",
    "keyword_inputs", "float64", "sequence",
    "param_matmul", "buffer", "reduction", "reshape", "masked",
    # state written by forward (a buffer updated in place or rebound: with micro_batch_size =
    # batch, as eager updates once per batch) and torch.no_grad() blocks (a frozen branch
    # reading parameters needs torch.export: such cases trace with tracer="auto")
    "buffer_update", "no_grad", "no_grad_frozen",
    # case-level: an in-place op at P > 1 (its input may be received from another stage);
    # captured by torch.export; torch.export and dropout
    "inplace_received", "export_tracer", "export_dropout",
    # observed when run: some parameter gets no gradient (only dead code reads it)
    "unread_parameters",
)

# Features that hit bugs being fixed on other branches (issue 9). A pending feature is never
# generated (for "inplace_received": programs with in-place ops run at P = 1 only). Enabling a
# fix is deleting its line here.
PENDING_FIXES: dict[str, str] = {}

ENABLED = frozenset(FEATURES) - frozenset(PENDING_FIXES)
OBSERVED = frozenset({"unread_parameters"})  # known only once a case ran
OUTPUT_KINDS = ("tuple_output", "dict_output", "nested_output", "model_loss")
DROPOUT = frozenset({"dropout", "functional_dropout"})
INPLACE = frozenset({"inplace", "inplace_module", "iadd", "inplace_statement", "inplace_view"})
STATE = ("buffer_update", "no_grad", "no_grad_frozen")  # drawn in a quarter of the programs

WIDTH = 8       # the width of the inputs and of every Linear's output
MAX_WIDTH = 16  # concat never makes a value wider
BATCH = 8
SCHEDULES = ("gpipe", "1f1b", "varuna", "gpipe-zb", "1f1b-zb", "varuna-zb")


@dataclass
class _Value:
    name: str
    width: int
    fresh: bool = False  # an in-place op may write into it: produced by an op that saves
    #                      neither its output nor (for the consumers to come) this value
    uses: int = 0
    learned: bool = False  # depends on a parameter (so the loss has a gradient)


@dataclass
class Program:
    """A random model as data; ``source`` is its Python class, ``features`` what it uses."""

    seed: int
    inputs: list[str]
    keyword: bool
    dtype: torch.dtype
    dropout_p: float
    seq_len: int = 0  # > 0: inputs are (batch, seq_len, width), as in sequence models
    init_lines: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    features: set[str] = field(default_factory=set)
    num_ops: int = 0

    @property
    def model_loss(self) -> bool:
        return "model_loss" in self.features

    @property
    def loss_fn(self) -> Any:
        return None if self.model_loss else program_loss

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The loss eager training minimises, as the pipeline computes it."""
        return output["loss"] if self.model_loss else program_loss(output, target)

    @property
    def source(self) -> str:
        init = "\n".join(self.init_lines) or "pass"
        body = "\n".join(self.body)
        args = ", ".join(self.inputs)
        return (
            f"class RandomModel(nn.Module):  # seed {self.seed}\n"
            f"    def __init__(self, p):\n"
            f"        super().__init__()\n"
            f"        self.p = p\n"
            f"{textwrap.indent(init, ' ' * 8)}\n\n"
            f"    def forward(self, {args}):\n"
            f"{textwrap.indent(body, ' ' * 8)}\n"
        )

    def __str__(self) -> str:
        how = "keyword" if self.keyword else "positional"
        shape = f"(batch, {self.seq_len}, width)" if self.seq_len else "(batch, width)"
        return (f"# program seed={self.seed} dtype={self.dtype} inputs={how} {shape} "
                f"dropout_p={self.dropout_p} features={sorted(self.features)}\n{self.source}")

    def build(self, dropout_p: float | None = None) -> nn.Module:
        """The model, its weights drawn from the seed (the same for every ``dropout_p``)."""
        scope: dict[str, Any] = {"nn": nn, "torch": torch, "F": F}
        exec(compile(self.source, f"<random model {self.seed}>", "exec"), scope)  # noqa: S102
        torch.manual_seed(self.seed)
        model = scope["RandomModel"](self.dropout_p if dropout_p is None else dropout_p)
        if dropout_p is not None:
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = dropout_p
        return model.to(self.dtype)

    def example(self, batch: int = 0) -> tuple[tuple | dict, torch.Tensor]:
        """(example inputs, target) for a batch of ``BATCH`` samples (with ``model_loss``, the
        target is also the input ``labels``)."""
        g = torch.Generator().manual_seed(self.seed * 1_000 + batch)
        lead = (BATCH, self.seq_len) if self.seq_len else (BATCH,)
        target = torch.randn(*lead, MAX_WIDTH, generator=g, dtype=self.dtype)
        tensors = {n: target if n == "labels" else
                   torch.randn(*lead, WIDTH, generator=g, dtype=self.dtype) for n in self.inputs}
        return (tensors if self.keyword else tuple(tensors.values())), target

    @staticmethod
    def generate(seed: int, enabled: frozenset[str] = ENABLED) -> Program:
        return _Generator(seed, enabled).program


def program_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """A weighted squared error of every tensor in the output against a slice of the target.

    A mean over samples, so the mean of the micro-batches' losses is the whole batch's."""
    leaves = [t for t in _leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(((t - target[..., : t.shape[-1]]) ** 2).mean() * (i + 1)
               for i, t in enumerate(leaves))  # type: ignore[return-value]


def _leaves(output: Any) -> list[Any]:
    if isinstance(output, dict):
        return [leaf for v in output.values() for leaf in _leaves(v)]
    if isinstance(output, (tuple, list)):
        return [leaf for v in output for leaf in _leaves(v)]
    return [output]


class _Generator:
    def __init__(self, seed: int, enabled: frozenset[str]) -> None:
        self.rng = rng = random.Random(seed)
        self.enabled = enabled
        keyword = "keyword_inputs" in enabled and rng.random() < 0.3
        n_inputs = 2 if keyword or rng.random() < 0.3 else 1
        dtype = torch.float64 if "float64" in enabled and rng.random() < 0.15 else torch.float32
        self.program = Program(seed=seed, inputs=["x", "y"][:n_inputs], keyword=keyword,
                               dtype=dtype, dropout_p=rng.choice([0.1, 0.3, 0.5]))
        if keyword:
            self.program.features.add("keyword_inputs")
        if dtype == torch.float64:
            self.program.features.add("float64")
        if "sequence" in enabled and rng.random() < 0.3:
            self.program.seq_len = 3
            self.program.features.add("sequence")
        self.values = [_Value(n, WIDTH) for n in self.program.inputs]
        self.linears: list[tuple[str, int]] = []  # (attribute, in width)
        # a third of the programs use in-place ops (else nearly all would, with ~10 ops each)
        self.inplace = rng.random() < 0.35
        # from a generator of their own, so the programs without them stay as they were
        self.state = random.Random(seed * 104_729 + 5).random() < 0.25
        self.counter = 0
        for _ in range(rng.randint(3, 12)):
            self._one_op()
        for v in self.values[:n_inputs]:
            if v.uses == 0:  # every input is read
                self._linear(v)
        self._output()

    # -- helpers -------------------------------------------------------------------------------

    def _new(self, width: int, fresh: bool, *operands: _Value | None,
             learned: bool = False) -> _Value:
        self.counter += 1
        learned = learned or any(o is not None and o.learned for o in operands)
        v = _Value(f"h{self.counter}", width, fresh, learned=learned)
        self.values.append(v)
        return v

    def _emit(self, line: str, *features: str) -> None:
        self.program.body.append(line)
        self.program.features.update(features)
        self.program.num_ops += 1

    def _pick(self, width: int | None = None, fresh: bool = False) -> _Value | None:
        choices = [v for v in self.values if (width is None or v.width == width)
                   and (not fresh or (v.fresh and v.uses == 0))]
        if not choices:
            return None
        # favour values nothing reads yet (little dead code), then recent ones (deep graphs)
        unused = [c for c in choices if c.uses == 0]
        r = self.rng.random()
        v = (self.rng.choice(unused) if unused and r < 0.5 else
             choices[-1] if r < 0.75 else self.rng.choice(choices))
        v.uses += 1
        return v

    def _module(self, prefix: str, ctor: str) -> str:
        name = f"{prefix}{sum(1 for line in self.program.init_lines if ' = nn.' in line)}"
        self.program.init_lines.append(f"self.{name} = nn.{ctor}")
        return name

    def _retire(self, v: _Value) -> _Value:
        """An in-place op on ``v``: the same name now holds a new value; the old one is gone."""
        self.values.remove(v)
        new = _Value(v.name, v.width, fresh=False, learned=v.learned)
        self.values.append(new)
        return new

    # -- operations ----------------------------------------------------------------------------

    def _one_op(self) -> None:
        ops = {
            "linear": self._linear, "activation": self._activation,
            "activation_module": self._activation_module, "residual_add": self._binary,
            "elementwise": self._elementwise, "concat": self._concat, "split": self._split,
            "layernorm": self._layernorm, "dropout": self._dropout,
            "functional_dropout": self._functional_dropout, "shared_module": self._shared,
            "tied_weights": self._tied, "inplace": self._inplace,
            "inplace_module": self._inplace_module, "iadd": self._iadd,
            "inplace_statement": self._inplace_statement, "param_matmul": self._param_matmul,
            "buffer": self._buffer, "reduction": self._reduction, "reshape": self._reshape,
            "masked": self._masked, "buffer_update": self._buffer_update,
            "no_grad": self._no_grad, "inplace_view": self._inplace_view,
        }
        names = [n for n in ops if n in self.enabled and (self.inplace or n not in INPLACE)
                 and (self.state or n not in STATE)]
        # Linear most (it makes values in-place ops may write into), then in-place ops in the
        # programs that have them, as they need such a value nothing has read yet
        weights = [3 if n == "linear" or n in INPLACE else 1 for n in names]
        for _ in range(10):  # some ops need operands that may not exist yet
            if ops[self.rng.choices(names, weights)[0]]():
                return

    def _linear(self, v: _Value | None = None) -> bool:
        v = v or self._pick()
        assert v is not None
        name = self._module("lin", f"Linear({v.width}, {WIDTH})")
        self.linears.append((name, v.width))
        out = self._new(WIDTH, True, learned=True)
        self._emit(f"{out.name} = self.{name}({v.name})", "linear")
        return True

    def _shared(self) -> bool:
        if not self.linears:
            return False
        name, width = self.rng.choice(self.linears)
        v = self._pick(width)
        if v is None:
            return False
        out = self._new(WIDTH, True, learned=True)
        self._emit(f"{out.name} = self.{name}({v.name})  # shared module", "shared_module")
        return True

    def _tied(self) -> bool:
        if not self.linears:
            return False
        other, width = self.rng.choice(self.linears)
        v = self._pick(width)
        if v is None:
            return False
        name = self._module("lin", f"Linear({width}, {WIDTH})")
        self.program.init_lines.append(f"self.{name}.weight = self.{other}.weight  # tied")
        self.linears.append((name, width))
        out = self._new(WIDTH, True, learned=True)
        self._emit(f"{out.name} = self.{name}({v.name})", "tied_weights")
        return True

    def _activation(self) -> bool:
        v = self._pick()
        assert v is not None
        fn = self.rng.choice(["torch.tanh", "F.gelu", "torch.sigmoid", "F.relu", "F.silu"])
        out = self._new(v.width, False, v)  # tanh/sigmoid save their output
        self._emit(f"{out.name} = {fn}({v.name})", "activation")
        return True

    def _activation_module(self) -> bool:
        v = self._pick()
        assert v is not None
        name = self._module("act", self.rng.choice(["GELU()", "Tanh()", "ReLU()", "SiLU()"]))
        out = self._new(v.width, False, v)
        self._emit(f"{out.name} = self.{name}({v.name})", "activation_module")
        return True

    def _binary(self) -> bool:
        a = self._pick()
        assert a is not None
        b = self._pick(a.width)
        if b is None or b is a:
            a.uses -= 1
            if b is not None:
                b.uses -= 1
            return False
        out = self._new(a.width, True, a, b)
        self._emit(f"{out.name} = {a.name} + {b.name}  # residual", "residual_add")
        return True

    def _elementwise(self) -> bool:
        a = self._pick()
        assert a is not None
        b = self._pick(a.width)
        if b is None or b is a or self.rng.random() < 0.5:
            if b is not None and b is not a:
                b.uses -= 1
            out = self._new(a.width, False, a)
            self._emit(f"{out.name} = {a.name} * {self.rng.choice([0.5, 2.0, -1.5])}",
                       "elementwise")
        else:
            out = self._new(a.width, False, a, b)
            self._emit(f"{out.name} = {a.name} * {b.name}", "elementwise")
        return True

    def _concat(self) -> bool:
        a = self._pick()
        assert a is not None
        b = self._pick()
        assert b is not None
        if a.width + b.width > MAX_WIDTH:
            a.uses -= 1
            b.uses -= 1
            return False
        out = self._new(a.width + b.width, False, a, b)
        self._emit(f"{out.name} = torch.cat([{a.name}, {b.name}], dim=-1)", "concat")
        return True

    def _split(self) -> bool:
        candidates = [v for v in self.values if v.width >= WIDTH]
        if not candidates:
            return False
        v = self.rng.choice(candidates)
        v.uses += 1
        half = v.width // 2
        a, b = self._new(half, False, v), self._new(half, False, v)
        form = self.rng.choice(["split", "chunk", "slice"])
        if form == "split":
            line = f"{a.name}, {b.name} = {v.name}.split({half}, dim=-1)"
        elif form == "chunk":
            line = f"{a.name}, {b.name} = torch.chunk({v.name}, 2, dim=-1)"
        else:
            line = f"{a.name}, {b.name} = {v.name}[..., :{half}], {v.name}[..., {half}:]"
        self._emit(line, "split")
        return True

    def _layernorm(self) -> bool:
        v = self._pick()
        assert v is not None
        name = self._module("norm", f"LayerNorm({v.width})")
        out = self._new(v.width, True, learned=True)
        self._emit(f"{out.name} = self.{name}({v.name})", "layernorm")
        return True

    def _dropout(self) -> bool:
        v = self._pick()
        assert v is not None
        name = self._module("drop", "Dropout(p)")
        out = self._new(v.width, False, v)
        self._emit(f"{out.name} = self.{name}({v.name})", "dropout")
        return True

    def _functional_dropout(self) -> bool:
        v = self._pick()
        assert v is not None
        out = self._new(v.width, False, v)
        self._emit(f"{out.name} = F.dropout({v.name}, p=self.p, training=self.training)",
                   "functional_dropout")
        return True

    def _param_matmul(self) -> bool:
        # a Linear's weight read directly too, as a tied LM head reads the embedding
        if not self.linears:
            return False
        name, width = self.rng.choice(self.linears)
        v = self._pick(WIDTH)
        if v is None:
            return False
        out = self._new(width, False, learned=True)
        self._emit(f"{out.name} = {v.name} @ self.{name}.weight", "param_matmul")
        return True

    def _buffer(self) -> bool:
        v = self._pick()
        assert v is not None
        name = f"buf{len(self.program.init_lines)}"
        self.program.init_lines.append(
            f'self.register_buffer("{name}", torch.linspace(0.5, 1.5, {v.width}))')
        out = self._new(v.width, False, v)
        self._emit(f"{out.name} = {v.name} * self.{name}", "buffer")
        return True

    def _reduction(self) -> bool:
        v = self._pick()
        assert v is not None
        out = self._new(v.width, False, v)
        n = v.name
        forms = [f"torch.softmax({n}, dim=-1)", f"{n} - {n}.mean(-1, keepdim=True)",
                                f"{n} * torch.tanh({n}.sum(dim=-1, keepdim=True))",
                 f"F.log_softmax({n}, -1)", f"{n} / ({n}.norm(dim=-1, keepdim=True) + 1.0)"]
        if self.program.seq_len:  # mixing positions of one sample, as attention does
            forms += [f"torch.softmax({n} @ {n}.transpose(1, 2), dim=-1) @ {n}",
                      f"torch.cumsum({n}, dim=1)", f"{n} + {n}.mean(dim=1, keepdim=True)"]
        form = self.rng.choice(forms)
        self._emit(f"{out.name} = {form}", "reduction")
        return True

    def _reshape(self) -> bool:
        v = self._pick()
        assert v is not None
        n, w = v.name, v.width
        seq = self.program.seq_len > 0
        lead = f"{n}.size(0), {n}.size(1)" if seq else f"{n}.size(0)"
        forms = [(w, f"{n}.view({lead}, 2, {w // 2}).flip(-2).reshape({lead}, -1)")]
        if w >= WIDTH:
            forms.append((w // 2, f"{n}.reshape({lead}, 2, {w // 2}).sum(dim=-2)"))
            if not seq:
                forms.append((w // 2, f"{n}.reshape(-1, 2, {w // 2}).mean(dim=1)"))
        if 2 * w <= MAX_WIDTH:
            expand = "-1, -1" if seq else "-1"
            forms.append((2 * w, f"{n}.unsqueeze(-2).expand({expand}, 2, -1).flatten(-2)"))
        width, form = self.rng.choice(forms)
        out = self._new(width, False, v)
        self._emit(f"{out.name} = {form}", "reshape")
        return True

    def _buffer_update(self) -> bool:
        # an EMA of a value, as a running statistic: in place (two writes), rebound, or a
        # counter (`+=` on a buffer, which fx traces as a rebinding); later ops read the new value
        v = self._pick()
        assert v is not None
        n, w = v.name, v.width
        name = f"buf{len(self.program.init_lines)}"
        mean = f"{n}.detach().reshape(-1, {w}).mean(dim=0)"
        form = self.rng.choice(["inplace", "rebind", "counter", "no_grad"])
        if form == "counter":
            self.program.init_lines.append(
                f'self.register_buffer("{name}", torch.zeros((), dtype=torch.long))')
            lines = [f"self.{name} += 1", f"h{self.counter + 1} = {n} * (1.0 + 0.1 * self.{name})"]
        else:
            self.program.init_lines.append(f'self.register_buffer("{name}", torch.zeros({w}))')
            update = {
                "inplace": f"self.{name}.mul_(0.9).add_({mean} * 0.1)",
                "rebind": f"self.{name} = 0.9 * self.{name} + 0.1 * {mean}",
                "no_grad": f"with torch.no_grad():\n    self.{name}.mul_(0.9).add_({mean})",
            }[form]
            lines = [update, f"h{self.counter + 1} = {n} + self.{name}"]
        out = self._new(w, False, v)
        assert out.name == f"h{self.counter}"
        self._emit("\n".join(lines), "buffer_update")
        return True

    def _no_grad(self) -> bool:
        # a block computing without gradients: from detached values (fx keeps it), or a frozen
        # branch through a Linear (no gradient to it, nor through it)
        v = self._pick()
        assert v is not None
        frozen = [(name, width) for name, width in self.linears if width == v.width]
        if frozen and self.rng.random() < 0.5:
            name, _ = self.rng.choice(frozen)
            out = self._new(WIDTH, False)
            self._emit(f"with torch.no_grad():\n    {out.name} = torch.tanh(self.{name}({v.name}))",
                       "no_grad", "no_grad_frozen")
        else:
            out = self._new(v.width, False)
            self._emit(f"with torch.no_grad():\n    {out.name} = {v.name}.detach() * 0.5 + 1.0",
                       "no_grad")
        return True

    def _masked(self) -> bool:
        v = self._pick()
        assert v is not None
        out = self._new(v.width, False, v)
        n = v.name
        form = self.rng.choice([f"{n}.masked_fill({n} > 0.5, 0.0)",
                                f"torch.where({n} > 0, {n}, {n} * 0.1)"])
        self._emit(f"{out.name} = {form}", "masked")
        return True

    # In-place ops write only into a value no op has read yet, produced by an op that does not
    # save its output (Linear, add, LayerNorm), and retire it: eager autograd accepts exactly
    # that, and what comes after reads the new value under the same name.

    def _inplace(self) -> bool:
        v = self._pick(fresh=True)
        if v is None:
            return False
        other = self._pick(v.width)
        v = self._retire(v)
        forms = [f"{v.name} = {v.name}.relu_()", f"{v.name} = {v.name}.mul_(0.5)",
                 f"{v.name} = torch.relu_({v.name})", f"{v.name} = {v.name}.clamp_(-1.0, 1.0)"]
        if other is not None and other.name != v.name:
            forms.append(f"{v.name} = {v.name}.add_({other.name})")
        form = self.rng.choice(forms)
        if other is not None and f".add_({other.name})" in form:
            v.learned |= other.learned
        self._emit(form, "inplace")
        return True

    def _inplace_module(self) -> bool:
        v = self._pick(fresh=True)
        if v is None:
            return False
        name = self._module("act", "ReLU(inplace=True)")
        v = self._retire(v)
        self._emit(f"{v.name} = self.{name}({v.name})", "inplace_module")
        return True

    def _iadd(self) -> bool:
        v = self._pick(fresh=True)
        if v is None:
            return False
        other = self._pick(v.width)
        if other is None or other is v:
            line = f"{v.name} *= {self.rng.choice([0.5, 3.0])}"
        else:
            line = f"{v.name} {self.rng.choice(['+=', '-='])} {other.name}"
        learned = other is not None and other.learned
        v = self._retire(v)
        v.learned |= learned
        v.fresh = True  # add_/sub_/mul_ by a scalar save nothing
        self._emit(line, "iadd")
        return True

    def _inplace_statement(self) -> bool:
        v = self._pick(fresh=True)
        if v is None:
            return False
        v = self._retire(v)
        line = self.rng.choice([f"{v.name}.relu_()", f"{v.name}.mul_(2.0)",
                                f"torch.relu_({v.name})", f"{v.name}.sub_(1.0)"])
        self._emit(f"{line}  # statement", "inplace_statement")
        return True

    def _inplace_view(self) -> bool:
        # a write into a view writes the value viewed (at P > 1 it was lost: the silent branch)
        v = self._pick(fresh=True)
        if v is None:
            return False
        v = self._retire(v)
        line = self.rng.choice([f"{v.name}.narrow(-1, 0, 2).mul_(2.0)",
                                f"{v.name}[..., :2].zero_()", f"{v.name}.select(-1, 1).add_(1.0)",
                                f"{v.name}[..., 0].fill_(0.5)"])
        self._emit(f"{line}  # into a view", "inplace_view")
        return True

    # -- output --------------------------------------------------------------------------------

    def _output(self) -> None:
        rng = self.rng
        if not self.values[-1].learned:  # the loss must depend on a parameter
            self._linear(self.values[-1])
        last = self.values[-1]
        unused = [v for v in self.values[:-1] if v.uses == 0 and v.name not in self.program.inputs]
        extra = rng.sample(unused, min(len(unused), rng.randint(0, 3)))
        leaves = [v.name for v in extra]
        kinds = ["tensor"] + [k for k in OUTPUT_KINDS if k in self.enabled]
        kind = rng.choice(kinds)
        if kind == "tensor":
            self._emit_output(f"return {last.name}")
            return
        self.program.features.add(kind)
        odd_leaves = {  # leaves that are not computed float tensors
            "none_output": "None", "const_output": rng.choice(["3", '"text"', "0.5"]),
            "input_output": rng.choice(self.program.inputs),
            "int_output": f"{rng.choice(self.values).name}.argmax(dim=-1)",
        }
        for feature, leaf in odd_leaves.items():
            if feature in self.enabled and rng.random() < 0.25:
                leaves.insert(rng.randint(0, len(leaves)), leaf)
                self.program.features.add(feature)
        if kind == "tuple_output":
            self._emit_output(f"return ({', '.join([last.name, *leaves])},)")
        elif kind == "dict_output":
            self._emit_output(f"return {_dict({'out': last.name}, leaves)}")
        elif kind == "nested_output":
            leaves = leaves or [last.name]  # the same tensor twice in the output
            if rng.random() < 0.5:
                self._emit_output(f"return {_dict({'out': last.name}, [])[:-1]}, "
                                  f"\"aux\": ({', '.join(leaves)},)}}")
            else:
                self._emit_output(f"return ({last.name}, {_dict({}, leaves)})")
        else:  # model_loss: forward takes the target and returns the loss, as HF models do
            # (named labels: an input named target cannot be passed by keyword to pipe.step, whose
            # own target= parameter takes it)
            self.program.inputs.append("labels")
            self._emit_output(f"loss = (({last.name} - labels[..., :{last.width}]) ** 2).mean()")
            self._emit_output(f"return {_dict({'loss': 'loss', 'out': last.name}, leaves)}")

    def _emit_output(self, line: str) -> None:
        self.program.body.append(line)


def _dict(first: dict[str, str], leaves: list[str]) -> str:
    items = [*(f'"{k}": {v}' for k, v in first.items()),
             *(f'"aux{i}": {leaf}' for i, leaf in enumerate(leaves, 1))]
    return "{" + ", ".join(items) + "}"


# -- cases --------------------------------------------------------------------------------------

@dataclass
class Case:
    seed: int
    program: Program
    stages: int
    schedule: str
    recompute: bool
    micro_batch_size: int
    tracer: str = "fx"  # or "export"; "auto" where fx must refuse the model
    enabled: frozenset[str] = ENABLED
    error: str | None = None  # after check_case: a one-line summary of the failure
    observed: set[str] = field(default_factory=set)  # features seen while running it

    @property
    def features(self) -> set[str]:
        f = set(self.program.features) | self.observed
        if self.stages > 1 and f & INPLACE:
            f.add("inplace_received")
        if self.tracer == "export":
            f.add("export_tracer")
            if f & DROPOUT:
                f.add("export_dropout")
        return f

    @staticmethod
    def generate(seed: int, enabled: frozenset[str] = ENABLED) -> Case:
        program = Program.generate(seed, enabled)
        rng = random.Random(seed * 7919 + 1)
        # a stage needs at least one operation; the pending in-place bug needs P = 1
        max_stages = min(4, program.num_ops)
        if program.features & INPLACE and "inplace_received" not in enabled:
            max_stages = 1
        export = "export_tracer" in enabled and rng.random() < 0.1 and (
            "export_dropout" in enabled or not program.features & DROPOUT)
        case = Case(seed, program, stages=rng.randint(1, max_stages),
                    schedule=rng.choice(SCHEDULES), recompute=rng.random() < 0.5,
                    micro_batch_size=rng.choice([1, 2, 4, 8]),
                    tracer="export" if export else "fx", enabled=enabled)
        if "buffer_update" in program.features:  # eager updates once per batch
            case.micro_batch_size = BATCH
        if "no_grad_frozen" in program.features and case.tracer == "fx":
            case.tracer = "auto"  # fx refuses the block; torch.export records grad mode
        return case

    def __str__(self) -> str:
        return (f"case seed={self.seed}: stages={self.stages} schedule={self.schedule} "
                f"recompute={self.recompute} micro_batch_size={self.micro_batch_size} "
                f"tracer={self.tracer}\n"
                f"{self.program}")


CLUSTER = vf.Cluster(gpus=4, device="cpu")


def _compile(case: Case, model: nn.Module, inputs: tuple | dict, stages: int | None = None,
             schedule: str | None = None, recompute: bool | None = None) -> vf.Pipeline:
    """Compile for the case; a P the model cannot be cut into lowers ``case.stages``."""
    while True:
        try:
            return vf.compile(model, CLUSTER, example_inputs=inputs, loss_fn=case.program.loss_fn,
                              stages=case.stages if stages is None else stages, data_parallel=1,
                              schedule=schedule or case.schedule,
                              recompute=case.recompute if recompute is None else recompute,
                              micro_batch_size=case.micro_batch_size, tracer=case.tracer)
        except PartitionError as e:
            # the documented refusals of more stages than the model has operations or places
            # to cut
            refusal = ("places the model can be cut", "operations of the model")
            if stages is not None or case.stages == 1 or not any(r in str(e) for r in refusal):
                raise
            case.stages -= 1


def _call(f: Any, inputs: tuple | dict, **kw: Any) -> Any:
    return f(*inputs, **kw) if isinstance(inputs, tuple) else f(**inputs, **kw)


def _grads(named: Any) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in named}


def _loose(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1.3e-5, "atol": 1e-4} if dtype == torch.float32 else \
        {"rtol": 1e-6, "atol": 1e-6}


def _assert_grads(got: dict, expected: dict, what: str, all_params: bool,
                  **tol: float) -> None:
    assert set(got) <= set(expected), f"{what}: unknown parameters {set(got) - set(expected)}"
    for name, want in expected.items():
        if name not in got:
            # API.md: in one process pipe.named_parameters() has all of them; today one that
            # only dead code reads is held by no stage (see PENDING_FIXES)
            assert want is None and not all_params, \
                f"{what}: parameter {name} missing from pipe.named_parameters()"
            continue
        have = got[name]
        if want is None or have is None:
            zero = want if have is None else have
            assert zero is None or not zero.any(), f"{what}: {name} grad {have} vs {want}"
            continue
        torch.testing.assert_close(have, want, msg=lambda m, n=name: f"{what}: {n}: {m}", **tol)


def _assert_outputs(got: Any, want: Any, what: str) -> None:
    if want is None:
        assert got is None, f"{what}: expected None, got {type(got).__name__}"
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{what}: keys {got} vs {want}"
        for k in want:
            _assert_outputs(got[k], want[k], f"{what}[{k!r}]")
        return
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), f"{what}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_outputs(g, w, f"{what}[{i}]")
        return
    if not isinstance(want, torch.Tensor):  # a constant leaf
        assert type(got) is type(want) and got == want, f"{what}: {got!r} vs {want!r}"
        return
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def _assert_buffers(got: nn.Module, want: nn.Module, what: str, **tol: float) -> None:
    expected = dict(want.named_buffers())
    for name, b in got.named_buffers():
        torch.testing.assert_close(b, expected[name], msg=lambda m, n=name: f"{what} {n}: {m}",
                                   **tol)


def _set_dropout(model: nn.Module, p: float) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p


def run_case(case: Case) -> None:
    """Compile the case's model and compare it with eager; raises on any difference.

    One compile serves every check (compiling dominates the time): ``nn.Dropout`` modules are
    the user's own objects inside the stages, so their ``p`` can be set to 0 for the eager
    comparison and back. Functional dropout, and torch.export's graphs, bake ``p`` into the
    graph: a second model then."""
    program = case.program
    inputs, full_target = program.example()
    target = None if program.model_loss else full_target  # else it is an input
    features = case.features
    dropout = bool(features & DROPOUT)
    model = program.build()
    pipe = _compile(case, model, inputs)

    # 1. train mode, dropout off: two steps' losses and every gradient equal eager's
    zero_model, zero_pipe = model, pipe
    exported = pipe.captured.tracer == "export"  # it bakes nn.Dropout's p into the graph
    if "functional_dropout" in features or (dropout and exported):
        zero_model = program.build(dropout_p=0.0)
        zero_pipe = _compile(case, zero_model, inputs)
    _set_dropout(zero_model, 0.0)
    eager_model = copy.deepcopy(zero_model)  # trains beside the pipeline
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_model, zero_pipe)]
    all_params = "unread_parameters" in case.enabled
    for step in range(2):  # the second step starts from the weights the first one updated
        batch, batch_target = program.example(step)
        eager_loss = program.loss(_call(eager_model, batch), batch_target)
        eager_loss.backward()
        expected = _grads(eager_model.named_parameters())  # tied: once, under its first name
        if any(g is None for g in expected.values()):
            case.observed.add("unread_parameters")
        loss = _call(zero_pipe.step, batch,
                     target=None if program.model_loss else batch_target)
        # the second step starts from weights that the first step's rounding (micro-batches
        # sum in another order) already moved apart a little: 10x assert_close's tolerances
        tol = {} if step == 0 else _loose(program.dtype)
        torch.testing.assert_close(torch.as_tensor(loss), eager_loss.detach(),
                                   msg=lambda m, s=step: f"step {s} loss: {m}", **tol)
        _assert_grads(_grads(zero_pipe.named_parameters()), expected, f"step {step} grad",
                      all_params, **tol)
        _assert_buffers(zero_model, eager_model, f"step {step} buffer", **tol)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    _set_dropout(model, program.dropout_p)

    # 2. eval mode (dropout active in train mode): the output equals eager's
    pipe.eval()
    model.eval()
    eager_model = copy.deepcopy(model)  # forward may update buffers: both start equal
    with torch.no_grad():
        _assert_outputs(_call(pipe, inputs), _call(eager_model, inputs), "eval output")
    _assert_buffers(model, eager_model, "eval buffer")
    pipe.train()
    model.train()

    # 3. dropout active: the loss and every gradient equal eager's on the whole batch under
    # the same per-sample keyed draws (vf.per_sample_rng), whatever P, schedule and recompute
    if dropout:
        eager_model = copy.deepcopy(model)  # the same weights and buffers as the pipeline's
        eager_model.zero_grad(set_to_none=True)
        pipe.zero_grad()
        torch.manual_seed(1234)
        loss = torch.as_tensor(_call(pipe.step, inputs, target=target))
        torch.manual_seed(1234)
        with vf.per_sample_rng(BATCH):
            eager_loss = program.loss(_call(eager_model, inputs), full_target)
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss.detach(),
                                   msg=lambda m: f"dropout loss vs eager: {m}")
        _assert_grads(_grads(pipe.named_parameters()), _grads(eager_model.named_parameters()),
                      "dropout grad vs eager", all_params)


def check_case(case: Case) -> str | None:
    """None if the case passes, else a report: the case, its program and the error."""
    try:
        run_case(case)
    except Exception as e:  # noqa: BLE001 - every failure is reported with its seed and program
        # a short key for tables: the error's first line, numbers and names of values elided
        first = (str(e).strip().splitlines() or [""])[0]
        first = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", first)
        case.error = f"{type(e).__name__}: {first}"[:110]
        return f"{case}\n{traceback.format_exc()}"
    return None


def check(seed: int, enabled: frozenset[str] = ENABLED) -> str | None:
    return check_case(Case.generate(seed, enabled))

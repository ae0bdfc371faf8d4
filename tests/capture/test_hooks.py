"""Module hooks, parametrizations and other code around forward against eager (capture/trace.py):
hooks a graph runs (forward hooks of traced and called modules, the legacy
weight_norm/spectral_norm pre-hooks, parametrizations, a called module's backward hook) give
eager's losses, gradients, buffers and outputs; hooks a graph would silently drop, a
``__call__`` override and ``torch.autocast`` blocks (which torch.fx does not record) are
refused at compile."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

import varuna_fx as vf
from support.eager import assert_like_eager, eager_step
from tiers import product, tiered


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Hooked(nn.Module):
    """A traced block, a called conv (fx keeps nn.Conv1d as call_module) and a called head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        h = h + self.conv(h.unsqueeze(-1).expand(-1, -1, 4)).mean(-1)  # a positional conv
        return self.head(h).pow(2).mean()


def _scale_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 2.0


def _scale_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 3.0,)


HONOURED: dict[str, Callable[[Hooked], object]] = {
    "traced_forward_hook": lambda m: m.block.register_forward_hook(_scale_output),
    "traced_pre_hook": lambda m: m.block.register_forward_pre_hook(_scale_input),
    "called_forward_hook": lambda m: m.head.register_forward_hook(_scale_output),
    "legacy_weight_norm": lambda m: (torch.nn.utils.weight_norm(m.conv),
                                     torch.nn.utils.weight_norm(m.block.lin)),
    "legacy_spectral_norm": lambda m: torch.nn.utils.spectral_norm(m.block.lin),
    "weight_norm": lambda m: (parametrizations.weight_norm(m.conv),
                              parametrizations.weight_norm(m.block.lin)),
    "orthogonal": lambda m: parametrizations.orthogonal(m.block.lin),
    "spectral_norm": lambda m: parametrizations.spectral_norm(m.block.lin),
}


def _built(hook: str) -> Hooked:
    torch.manual_seed(0)
    model = Hooked()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the legacy weight_norm's deprecation
        HONOURED[hook](model)
    return model


@pytest.mark.parametrize("hook,tracer", tiered(
    [c for c in product(HONOURED, ["fx", "export"])
     if c != ("spectral_norm", "export")],  # refused: export drops its `self._u = ...`
    [("traced_pre_hook", "fx"), ("legacy_weight_norm", "fx"), ("spectral_norm", "fx"),
     ("called_forward_hook", "export")], lambda c: "-".join(c)))
def test_hooks_and_parametrizations_follow_eager(hook: str, tracer: str) -> None:
    # deepcopy cannot copy the legacy weight_norm: eager is the same model built again
    model, eager, x = _built(hook), _built(hook), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=8, tracer=tracer)
    for _ in range(2):  # the second step runs on weights (and u, v buffers) the first changed
        pipe.zero_grad()
        eager.zero_grad()
        loss = pipe.step(x)
        eager_loss = eager(x)
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss.detach())
        want = dict(eager.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[name].grad, msg=name)
                p.sub_(0.1 * p.grad)
                want[name].sub_(0.1 * want[name].grad)
    torch.testing.assert_close(dict(model.named_buffers()), dict(eager.named_buffers()))
    pipe.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), eager(x))


@pytest.mark.parametrize("schedule", tiered(["1f1b", "varuna-zb"], ["varuna-zb"]))
def test_a_called_modules_backward_hook_follows_eager(schedule: str) -> None:
    # fx keeps nn.Linear as call_module: the stage calls the model's object, hooks included
    def built() -> Hooked:
        torch.manual_seed(0)
        model = Hooked()
        model.head.register_full_backward_hook(lambda module, gin, gout: (gin[0] * 2.0,))
        return model

    model, eager, x = built(), built(), torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4, tracer="fx",
                      schedule=schedule)
    loss = pipe.step(x)
    eager_loss = eager(x)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach())
    want = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)


def _backward_hook(module: nn.Module, grad_in: tuple, grad_out: tuple) -> tuple:
    return (grad_in[0] * 2.0,)


REFUSED: list[tuple[str, str, Callable[[Hooked], object], str]] = [
    # fx traces the model's forward without __call__: the hooks never ran
    ("root_forward_hook", "fx", lambda m: m.register_forward_hook(_scale_output),
     r"Hooked has the forward hook _scale_output \(.*test_hooks.py:\d+\): torch\.fx traces "
     r"the model's forward without its hooks.*tracer='export'"),
    ("root_pre_hook", "fx", lambda m: m.register_forward_pre_hook(_scale_input),
     r"Hooked has the forward pre-hook _scale_input.*on a submodule or apply it in forward$"),
    # torch.export gets the inputs by keyword: a positional pre-hook saw no arguments
    ("root_pre_hook", "export", lambda m: m.register_forward_pre_hook(_scale_input),
     r"Hooked has the forward pre-hook _scale_input.*by keyword.*with_kwargs=True"),
    # a module backward hook acts on autograd nodes that tracing never makes
    ("traced_backward_hook", "fx", lambda m: m.block.register_full_backward_hook(_backward_hook),
     r"Hooked\.block \(_Block\) has the backward hook _backward_hook.*traced into the graph.*"
     r"parameter\.register_hook"),
    ("traced_backward_pre_hook", "export",
     lambda m: m.block.register_full_backward_pre_hook(lambda module, gout: None),
     r"Hooked\.block \(_Block\) has the backward pre-hook"),
    ("called_backward_hook", "export",
     lambda m: m.head.register_full_backward_hook(_backward_hook),
     r"Hooked\.head \(Linear\) has the backward hook _backward_hook"),
]


@pytest.mark.filterwarnings("ignore:For backward hooks to be called")  # torch's, fx tracing
@pytest.mark.parametrize("name,tracer,add,match", tiered(
    REFUSED, lambda c: c[0] in ("root_forward_hook", "root_pre_hook", "traced_backward_hook"),
    lambda c: f"{c[0]}-{c[1]}"))
def test_hooks_a_graph_would_drop_are_refused(name: str, tracer: str,
                                              add: Callable[[Hooked], object],
                                              match: str) -> None:
    model = Hooked()
    add(model)
    with pytest.raises(vf.CaptureError, match=match):
        vf.compile(model, example_inputs=(torch.randn(8, 8),), stages=2, tracer=tracer)


def test_the_legacy_weight_norm_on_the_model_itself_names_parametrizations() -> None:
    conv = nn.Conv1d(8, 8, 3, padding=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(conv)
    with pytest.raises(vf.CaptureError, match=r"parametrizations\.weight_norm"):
        vf.compile(conv, example_inputs=(torch.randn(4, 8, 5),),
                   loss_fn=lambda out, target: out.pow(2).mean(), stages=1, tracer="fx")


def test_a_root_forward_hook_is_kept_by_auto_through_torch_export() -> None:
    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(8, 8)
    model.register_forward_hook(_scale_output)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=8, tracer="auto")
    assert pipe.captured.tracer == "export"
    torch.testing.assert_close(pipe.step(x), model(x).detach())


# -- other code torch.fx does not record: __call__ overrides, torch.autocast blocks ------------


class DoublesInCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().__call__(x * 2.0)


class AutocastBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.a(x))
        return self.b(h.float()).pow(2).mean()


@pytest.mark.parametrize("model,match", [
    (DoublesInCall, r"DoublesInCall overrides __call__ \(DoublesInCall\.__call__ at .*\): "
                    r"torch\.fx traces forward only.*tracer='export'"),
    (AutocastBlock, r"AutocastBlock\.forward runs operations in a torch\.autocast block "
                    r"\(File .*test_hooks\.py.*h = torch\.relu\(self\.a\(x\)\)\).*full precision"),
], ids=["call", "autocast"])
def test_code_fx_does_not_record_is_refused_and_auto_exports_it(model: type[nn.Module],
                                                                match: str) -> None:
    # fx silently ran forward without the __call__ wrapper / in float32
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    with pytest.raises(vf.CaptureError, match=match):
        vf.compile(model(), example_inputs=(x,), stages=2, tracer="fx")
    user = model()
    pipe = vf.compile(user, example_inputs=(x,), stages=2, micro_batch_size=8, tracer="auto")
    assert pipe.captured.tracer == "export"
    eager = model()
    eager.load_state_dict(user.state_dict())
    eager_loss = eager(x)
    eager_loss.backward()
    torch.testing.assert_close(pipe.step(x), eager_loss.detach())
    want = dict(eager.named_parameters())
    for name, p in user.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)


class HooksAnActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h.register_hook(lambda grad: grad * 3.0)
        return self.b(h).pow(2).mean()


def test_a_tensor_hook_registered_in_forward_is_refused_by_torch_export() -> None:
    # torch.export registered it on a fake tensor: a.weight's gradient came out 3x too small
    with pytest.raises(vf.CaptureError, match=r"HooksAnActivation\.forward registers a "
                                              r"gradient hook on a tensor \(.*test_hooks\.py:\d+\)"):
        vf.compile(HooksAnActivation(), example_inputs=(torch.randn(4, 8),), stages=2,
                   tracer="export")


class Checkpoints(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=self.reentrant)
        return self.b(torch.relu(h)).pow(2).mean()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, tracing
@pytest.mark.parametrize("tracer", ["fx", "export", "auto"])
def test_a_reentrant_checkpoint_in_forward_is_refused(tracer: str) -> None:
    # torch.export recorded its function as a no-grad block: with a loss that also depends on
    # b, a.weight silently got no gradient (torch.fx said "use tracer='export'")
    with pytest.raises(vf.CaptureError, match=r"Checkpoints\.forward uses torch\.utils\."
                                              r"checkpoint with use_reentrant=True "
                                              r"\(.*test_hooks\.py:\d+\)"):
        vf.compile(Checkpoints(reentrant=True), example_inputs=(torch.randn(4, 8),), stages=1,
                   tracer=tracer)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_non_reentrant_checkpoint_in_forward_follows_eager(tracer: str) -> None:
    torch.manual_seed(0)
    model, x = Checkpoints(reentrant=False), torch.randn(4, 8)
    eager, eager_loss = eager_step(model, x)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, micro_batch_size=4, tracer=tracer)
    assert_like_eager(pipe, model, eager, pipe.step(x), eager_loss)


def _double_the_models_output(module: nn.Module, args: tuple, out: torch.Tensor) -> Any:
    return out * 2.0 if isinstance(module, Hooked) else None


def _backward_noop(module: nn.Module, grad_in: tuple, grad_out: tuple) -> None:
    return None


def test_a_global_forward_hook_is_refused_by_fx_and_auto_exports_it() -> None:
    # fx traced the model's forward without __call__: the global hook never ran on the model
    # itself, so the loss came out half of eager's
    torch.manual_seed(0)
    user, x = Hooked(), torch.randn(8, 8)
    handle = nn.modules.module.register_module_forward_hook(_double_the_models_output)
    try:
        eager, eager_loss = eager_step(user, x)
        with pytest.raises(vf.CaptureError, match=r"global module forward hook "
                                                  r"_double_the_models_output .*tracer='export'"):
            vf.compile(user, example_inputs=(x,), stages=2, tracer="fx")
        pipe = vf.compile(user, example_inputs=(x,), stages=2, micro_batch_size=8)
        assert pipe.captured.tracer == "export"
        assert_like_eager(pipe, user, eager, pipe.step(x), eager_loss)
    finally:
        handle.remove()


@pytest.mark.filterwarnings("ignore:For backward hooks to be called")  # torch's, fx tracing
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_global_backward_hook_is_refused(tracer: str) -> None:
    handle = nn.modules.module.register_module_full_backward_hook(_backward_noop)
    try:
        with pytest.raises(vf.CaptureError, match=r"global module backward hook _backward_noop"):
            vf.compile(Hooked(), example_inputs=(torch.randn(8, 8),), stages=2,
                       tracer=tracer)
    finally:
        handle.remove()


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("edit", ["added", "removed"])
def test_a_global_hook_added_or_removed_after_compile_asks_for_a_new_compile(
        tracer: str, edit: str) -> None:
    # torch.export inlined the modules' code: a hook added later never ran (and one removed
    # later still did) in a pipeline compiled before
    x = torch.randn(8, 8)
    hook = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    if edit == "added":
        hook.remove()
    try:
        pipe = vf.compile(Hooked(), example_inputs=(x,), stages=2, micro_batch_size=8,
                          tracer="export" if edit == "removed" else tracer)
        if edit == "added":
            hook = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
        else:
            hook.remove()
        with pytest.raises(vf.InputError, match=r"global module hook .* was added or removed "
                                                r"after vf\.compile"):
            pipe.step(x)
    finally:
        hook.remove()

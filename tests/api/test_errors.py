"""Every error a user can cause is a VarunaFxError that says what to change."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

import varuna_fx as vf
from support.registry import CASES


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # control flow on a tensor value
            return h
        return -h


def test_untraceable_model_fx_names_operation_and_line() -> None:
    with pytest.raises(vf.CaptureError) as err:
        vf.compile(DataDependent(), example_inputs=(torch.randn(2, 4),), stages=1, tracer="fx")
    message = str(err.value)
    assert "if h.sum() > 0" in message and "test_errors.py" in message
    assert "torch.where" in message  # what to do about it


def test_untraceable_model_auto_reports_both_tracers() -> None:
    with pytest.raises(vf.CaptureError) as err:
        vf.compile(DataDependent(), example_inputs=(torch.randn(2, 4),), stages=1)
    message = str(err.value)
    assert "fx:" in message and "export:" in message
    assert message.count("if h.sum() > 0") == 2


@pytest.mark.slow  # a second export of hf_gpt2 (the fast tier compiles it with "auto" in test_step)
def test_auto_falls_back_to_export_for_hf_models() -> None:
    case = CASES["hf_gpt2"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, stages=2)
    assert pipe.plan.tracer == "export"


@pytest.mark.parametrize("stages", [0, -2])
def test_stages_below_one(stages: int) -> None:
    case = CASES["mlp"]
    with pytest.raises(vf.VarunaFxError, match="positive number of pipeline stages"):
        vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn, stages=stages)


def test_more_stages_than_operations() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(vf.PartitionError, match="operations of the model"):
        vf.compile(model, example_inputs=(torch.randn(4, 4),), stages=5)


@pytest.mark.parametrize("inputs, match", [
    ("not a tensor", "tuple of positional arguments or a dict"),
    ((torch.randn(4, 32), torch.randn(4, 32)), "do not match"),
    ({"y": torch.randn(4, 32)}, "do not match"),
    (([1, 2, 3],), "inputs must be tensors"),
    ((torch.tensor(3.0),), "0-d tensors"),
    ((), "do not match"),
])
def test_malformed_example_inputs(inputs: object, match: str) -> None:
    case = CASES["mlp"]
    with pytest.raises(vf.InputError, match=match):
        vf.compile(case.model, example_inputs=inputs, stages=1)


def test_missing_example_inputs() -> None:
    with pytest.raises(vf.VarunaFxError, match="example_inputs is required"):
        vf.compile(CASES["mlp"].model, stages=1)


def test_inputs_whose_batch_dims_disagree() -> None:
    case = CASES["kwargs_dict"]
    inputs = {"features": torch.randn(8, 5, 16), "mask": torch.ones(6, 5)}
    with pytest.raises(vf.InputError, match=r"features: 8, mask: 6"):
        vf.compile(case.model, example_inputs=inputs, stages=2)


def test_unknown_schedule_and_tracer() -> None:
    case = CASES["mlp"]
    with pytest.raises(vf.VarunaFxError, match="1f1b"):
        vf.compile(case.model, example_inputs=case.inputs, stages=1, schedule="zigzag")
    with pytest.raises(vf.VarunaFxError, match="export"):
        vf.compile(case.model, example_inputs=case.inputs, stages=1, tracer="jit")


def test_not_a_module() -> None:
    with pytest.raises(vf.VarunaFxError, match="torch.nn.Module"):
        vf.compile(lambda x: x, example_inputs=(torch.randn(2, 2),), stages=1)


def test_micro_batch_that_does_not_divide_the_batch() -> None:
    case = CASES["mlp"]
    with pytest.raises(vf.PlanError, match=r"micro_batch_size=3.*batch of 8"):
        vf.compile(case.model, example_inputs=case.inputs, stages=2, micro_batch_size=3)


def test_step_batch_not_divisible_names_both_numbers() -> None:
    case = CASES["mlp"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn, stages=2,
                      micro_batch_size=4)
    with pytest.raises(vf.InputError, match=r"batch size 6 .* micro-batch size 4"):
        pipe.step(torch.randn(6, 32), target=torch.randint(0, 4, (6,)))


def test_step_without_any_loss() -> None:
    case = CASES["mlp"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, stages=2)
    with pytest.raises(vf.InputError, match="loss_fn"):
        pipe.step(*case.inputs)


def test_loss_fn_returning_a_non_scalar() -> None:
    case = CASES["mlp"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=lambda o, t: o, stages=2)
    with pytest.raises(vf.InputError, match="0-d tensor"):
        pipe.step(*case.inputs, target=case.target)


def test_step_input_with_another_sequence_length_or_dtype() -> None:
    case = CASES["gpt_tied"]
    pipe = vf.compile(case.model, example_inputs=case.inputs, loss_fn=case.loss_fn, stages=2)
    (tokens,) = case.inputs
    with pytest.raises(vf.InputError, match=r"compiled for \(batch, 16\).*only the batch size"):
        pipe.step(tokens[:, :8], target=case.target[:, :8])
    with pytest.raises(vf.InputError, match="torch.float32 but the pipeline was compiled for"):
        pipe.step(tokens.float(), target=case.target)
    pipe.zero_grad()
    pipe.step(tokens[:4], target=case.target[:4])  # another batch size is fine
    pipe.zero_grad()


class TensorDefault(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor,
                y: torch.Tensor = torch.zeros(16, 64)) -> torch.Tensor:  # noqa: B008 - the case
        return (self.a(x) + y).pow(2).mean()


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_a_tensor_default_in_forward_is_refused_saying_what_to_do(tracer: str) -> None:
    """fx raised a raw NameError ('_tensor_constant0'), "auto" did not fall back, and export
    blamed Python/numpy arithmetic for the batch its rows fixed."""
    with pytest.raises(vf.CaptureError, match=r"parameter 'y' defaults to a tensor \(shape "
                       r"\(16, 64\)\).*Pass 'y' in example_inputs.*register_buffer"):
        vf.compile(TensorDefault(), example_inputs=(torch.randn(16, 64),), stages=1,
                   tracer=tracer)


class OptionalMask(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h)


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_a_none_default_keyword_left_out_runs_as_eager(tracer: str) -> None:
    """Issue 30 item 7: ``forward(self, x, mask=None)`` called without the mask once raised a
    raw NameError ('_tensor_constant0') from fx's code; it must run as eager does."""
    torch.manual_seed(0)
    model, x = OptionalMask(), torch.randn(4, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, tracer=tracer,
                      loss_fn=lambda o, t: (o - t).pow(2).mean())
    loss = pipe.step(x, target=torch.zeros(4, 8))
    torch.testing.assert_close(loss, model(x).pow(2).mean().detach())


@pytest.mark.parametrize("block", [torch.no_grad, torch.inference_mode])
def test_step_under_no_grad_says_a_step_needs_gradients(block) -> None:  # noqa: ANN001
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    x = torch.randn(8, 8)
    pipe = vf.compile(model, example_inputs=(x,), stages=2, loss_fn=lambda o, t: o.mean())
    with block(), pytest.raises(vf.InputError, match=r"pipe.step was called under torch\."
                                r"(no_grad|inference_mode)\(\).*pipe\(\.\.\.\) for a "
                                "forward-only evaluation"):
        pipe.step(x)
    pipe.step(x)  # outside the block it trains


def test_a_sparse_input_is_refused_at_compile() -> None:
    """It compiled, then step failed inside split_batch with a raw error."""
    model = torch.nn.Linear(8, 1)
    x = torch.randn(8, 8).to_sparse()
    with pytest.raises(vf.InputError, match=r"argument 'input' is a sparse_coo tensor.*"
                       r"input\.to_dense\(\)"):
        vf.compile(model, example_inputs=(x,), stages=1, loss_fn=lambda o, t: o.mean())


class WithPipeSplit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pipe_split()  # a torch.distributed.pipelining cut marker
        return self.b(h).mean()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_pipe_split_markers_are_ignored_with_a_warning(tracer: str) -> None:
    """They were ignored without a word (fx records no node for them; export kept a no-op)."""
    from varuna_fx.capture.untraced import PipeSplitIgnoredWarning
    torch.manual_seed(0)
    model, x = WithPipeSplit(), torch.randn(4, 8)
    with pytest.warns(PipeSplitIgnoredWarning, match=r"pipe_split\(\) at .*test_errors.py:\d+: "
                      r"varuna_fx ignores these markers.*stages=P"):
        pipe = vf.compile(model, example_inputs=(x,), stages=2, tracer=tracer)
    assert not any("pipe_split" in str(n.target) for s in pipe.stages
                   for n in s.module.graph.nodes)
    torch.testing.assert_close(torch.as_tensor(pipe.step(x)), model(x).detach())

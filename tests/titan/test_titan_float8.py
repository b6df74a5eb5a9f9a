"""Float8 training in torchtitan jobs (graphmem/titan/float8.py), through torchao.

On the CPU, torchtitan's own ``Float8LinearConverter`` with ``emulate=True`` ("for test purposes":
torchao's casts to float8 happen, the mm runs in high precision on the dequantized operands) trains
for real over gloo; tests/titan_truth.py measures it, rank by rank, against graphmem's analysis of
the same job: saved bytes and the bytes before the step exact, peaks within 1 % (measured: exact,
but TP2's first peak, 12 B under as without float8). On the CUDA target (H100, sm90), without
``emulate``, torchao's autograd function runs ``torch._scaled_mm`` on graphmem's fake float8 tensors.
Tests that need torchao skip without it; those of the error without it run everywhere."""
from __future__ import annotations

import math
import sys
from typing import Any

import pytest

import graphmem
from graphmem.errors import UsageError

NEEDS = "float8 training needs torchao: pip install 'graphmem[float8]'"


@pytest.fixture
def torchao() -> Any:
    pytest.importorskip("torchtitan", reason="torchtitan jobs need pip install 'graphmem[titan]'")
    return pytest.importorskip("torchao.float8", reason=NEEDS)


def small_llama3_float8() -> Any:
    """tests/titan_truth.py's shrunk llama3 debug model (every decoder linear's dims divide by 16, so
    all of them convert), its linears through torchtitan's Float8LinearConverter with ``emulate``,
    gated as this machine gates it (``emulate`` without compile passes without a GPU)."""
    from graphmem.titan.float8 import with_float8
    from tests.titan_truth import small_llama3

    return with_float8(small_llama3(), emulate=True, gpu=None)


def _float8_ran(report: Any) -> None:
    """torchao's casts ran in the analyzed step: float8 storages of 1 B an element."""
    casts = [s for s in report.step.storages.values() if s.dtype == "float8_e4m3fn"]
    assert casts and all(s.nbytes == math.prod(s.shape) for s in casts)


@pytest.mark.slow
@pytest.mark.parametrize("degree", ["data_parallel_shard_degree",
                                    pytest.param("tensor_parallel_degree", marks=pytest.mark.heavy)])  # heavy: ~60 s
def test_emulated_against_gloo(torchao: Any, degree: str) -> None:
    """FSDP2 and TP over 2 gloo ranks, float8 emulated: 1,531,176 B (FSDP2) and 856,456 B (TP2)
    saved on each rank, the same as the job with plain linears (torchao saves the high-precision
    input and weight)."""
    from tests.titan.test_titan_truth import _as_predicted, _consistent, _predicted
    from tests.titan_truth import real_titan, small_llama3

    overrides = {f"parallelism.{degree}": 2}
    ranks = real_titan(small_llama3_float8, 2, overrides)
    _consistent(ranks)
    _as_predicted(small_llama3_float8, 2, overrides, ranks)
    report = _predicted(small_llama3_float8, 2, overrides, 0)
    _float8_ran(report)
    assert "float8 linears (torchao, tensor-wise scaling, emulated)" in report.budget.training.train.describe("cpu")
    assert report.activation_bytes == _predicted(small_llama3, 2, overrides, 0).activation_bytes


def _cuda_job(recipe: str, float8: bool) -> Any:
    from graphmem.titan.float8 import with_float8
    from tests.titan_truth import small_llama3

    job = small_llama3()
    job.training.mixed_precision_param = "bfloat16"  # row-wise _scaled_mm writes bf16 (ScaledBlas.cpp)
    job.parallelism.data_parallel_shard_degree = 2
    return with_float8(job, recipe=recipe) if float8 else job


def _gemms_per_linear(config: Any) -> int:
    """torchao's matmul_with_hp_or_float8_args: the output mm in float8, and each backward mm in float8
    unless its two operands' casts are DISABLED (``rowwise_with_gw_hp``: the grad-weight mm in bf16)."""
    from torchao.float8.config import ScalingType

    def cast(*configs: Any) -> bool:
        return all(c.scaling_type is not ScalingType.DISABLED for c in configs)

    return 1 + cast(config.cast_config_grad_output, config.cast_config_weight_for_grad_input) + \
        cast(config.cast_config_grad_output_for_grad_weight, config.cast_config_input_for_grad_weight)


@pytest.mark.parametrize("recipe", ["rowwise", pytest.param("rowwise_with_gw_hp", marks=pytest.mark.slow)])
def test_scaled_mm_on_the_cuda_target(torchao: Any, recipe: str) -> None:
    """Without ``emulate``, on H100: every float8 linear's gemms run ``torch._scaled_mm`` on float8
    operands (1 B an element) into a bf16 (M, N) output, as ScaledBlas.cpp allocates it; what is
    saved is what torchao's autograd function saves, the high-precision input and weight, so the
    same bytes as the job with plain linears, and no float8 tensor among them."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    report = graphmem.analyze(_cuda_job(recipe, True), world_size=2, rank=0, device="cuda", gpu="h100")
    plain = graphmem.analyze(_cuda_job(recipe, False), world_size=2, rank=0, device="cuda", gpu="h100")
    g = report.step
    gemms = [op for op in g.ops if op.target is torch.ops.aten._scaled_mm.default]
    model = graphmem.frontends.titan_job._meta_model(_cuda_job(recipe, True))
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    # each call of torchao's function saves its input and weight (ctx.save_for_backward(input_hp, weight_hp_t));
    # the lm_head runs once per chunk of torchtitan's chunked loss
    calls = [s for s in g.saves if s.grad_fn == "matmul_with_hp_or_float8_argsBackward"]
    assert len(calls) % 2 == 0 and len(calls) // 2 >= len(linears) > 0
    assert len(gemms) == len(calls) // 2 * _gemms_per_linear(linears[0].config)
    for op in gemms:
        for operand in op.args[:2]:
            node = operand[0] if isinstance(operand, tuple) else operand
            s = g.storages[node.meta["storage"]]
            assert node.meta["dtype"] == torch.float8_e4m3fn and s.nbytes == math.prod(s.shape)
        out = g.storages[op.meta["storage"]]
        assert op.meta["dtype"] == torch.bfloat16 and out.nbytes == 2 * math.prod(op.meta["shape"])
    assert report.activation_bytes == plain.activation_bytes
    assert not [s for s in g.saves if s.dtype.startswith("float8")]
    assert f"{len(linears)} float8 linears (torchao, row-wise scaling)" in report.budget.training.train.describe("cuda")


def test_registry_gate_answered_as_the_gpu(torchao: Any) -> None:
    """torchtitan's ``llama3_debugmodel_float8`` converts at load time behind has_cuda_capability(8, 9):
    answered as H100 (sm90) it converts; as A100 (sm80), or as this GPU-less machine, torchtitan refuses."""
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.models.common.linear import Linear

    from graphmem.titan import load_job

    job = load_job("llama3_debugmodel_float8", gpu="h100")
    assert any(isinstance(c, Float8Linear.Config) for _f, c, _p, _a in job.model_spec.model.traverse(Linear.Config))
    for gpu in ("a100", None):
        with pytest.raises(UsageError, match="SM89"):
            load_job("llama3_debugmodel_float8", gpu=gpu)
    with pytest.raises(UsageError, match="sm89"):
        graphmem.analyze(job, world_size=1, device="cpu")


def test_without_torchao_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchao, torchtitan's float8 module holds ``Float8Linear = None`` and its converter raises
    ImportError; graphmem says, in one line, what to install."""
    pytest.importorskip("torchtitan", reason="torchtitan jobs need pip install 'graphmem[titan]'")
    import torchtitan.components.quantization.float8 as titan_float8

    from graphmem.titan import load_job
    from graphmem.titan.float8 import with_float8
    from tests.titan_truth import small_llama3

    monkeypatch.setattr(titan_float8, "Float8Linear", None)
    with pytest.raises(UsageError, match="pip install torchao") as e:
        load_job("llama3_debugmodel_float8")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UsageError, match="pip install torchao"):
        with_float8(small_llama3())

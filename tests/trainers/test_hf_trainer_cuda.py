"""A transformers ``Trainer``'s step on the CUDA target (graphmem/training/hf_trainer_cuda.py).

No GPU here, so no real CUDA run: the Trainer's CUDA-target report is checked against graphmem's own
loop on the same CUDA target with the equivalent options (``amp="bf16"``, ``optimizer="adamw"``,
``release_output=True``, ``clip_grad_norm=1.0``; each checked against real steps elsewhere), and against
the same Trainer on the CPU target where CUDA's rules differ.

Saved for backward: the own loop's set plus one tensor, the Trainer's token count (``num_items_in_batch``:
``Trainer._get_num_items_in_batch``'s count through a true division, an fp32 0-dim tensor) that the
loss's ``DivBackward0`` keeps (ForCausalLMLoss divides the summed loss by it; the own loop's loss is the
model's mean). First peak (both at AdamW's ``_foreach_sqrt``): the Trainer's AdamW has two param groups
(``get_decay_parameter_names``: weight decay and none), so its first group's foreach update runs before the
second group's states exist; the own loop's one group has every state and every ``_foreach_sqrt``
temporary live there. The difference is exactly those (the no-decay parameters' ``exp_avg``/``exp_avg_sq``
and sqrt temporaries, and the own loop's 4-B loss) less the Trainer's four 4-B scalars (``_tr_loss``,
the token count, its last loss, and the clipped gradients' norm, which ``_run_epoch``'s ``grad_norm`` holds
through the optimizer step). Later steps (in backward): the Trainer's 0-dim fp32 scalars, 12 B.
"""
from __future__ import annotations

import functools
import json
import tempfile
from collections import Counter
from typing import Any

import pytest
import torch

import graphmem
from graphmem.cli.main import main
from graphmem.errors import GraphmemError, UsageError
from graphmem.frontends.trainer import trainer_batch
from graphmem.validation.result import NO_GPU
from tests.trainers.test_hf_trainer import _gpt2, _llama

transformers = pytest.importorskip("transformers")
TOKEN_COUNT = ("aten.div.Tensor", "", (), "float32", 4)  # the Trainer's num_items_in_batch, kept by DivBackward0
SCALARS = 12  # the Trainer's 0-dim fp32 tensors live beside the own loop's (module docstring)
NORM = 4  # the clipped gradients' norm, held through the Trainer's optimizer step (the own loop's is not)


def _args(out: str, **kwargs: Any) -> Any:
    kwargs = {"optim": "adamw_torch", **kwargs}
    return transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_grad_norm=1.0, bf16=True,
                                          **kwargs)


@functools.cache
def _reports(name: str) -> tuple[Any, Any, Any, Any, set[str]]:
    """The Trainer's CUDA-target and CPU-target reports, the own loop's CUDA-target one, the model, and its
    parameters without weight decay (the Trainer's second AdamW group)."""
    torch.manual_seed(0)
    model = {"llama": _llama, "gpt2": _gpt2, "llama-checkpointing": _llama}[name]()
    checkpointing = name.endswith("checkpointing")
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=model, args=_args(out, activation_checkpointing=checkpointing))
        batch = trainer_batch(trainer, (2, 16))
        cuda, cpu = graphmem.analyze(trainer, batch, device="cuda"), graphmem.analyze(trainer, batch)
        decay = set(trainer.get_decay_parameter_names(model))
    if checkpointing:
        model.activation_checkpointing_enable()
    own = graphmem.analyze(model, batch, device="cuda", amp="bf16", optimizer="adamw", release_output=True,
                           clip_grad_norm=1.0)
    return cuda, cpu, own, model, {n for n, _ in model.named_parameters()} - decay


def _saved(r: Any) -> Counter:
    return Counter((s.op, s.module, tuple(s.shape), s.dtype, s.bytes) for s in r.saved)


def _live(r: Any) -> Counter:
    return Counter((t.kind, t.name, tuple(t.shape), t.dtype, t.nbytes) for t in r.live_at_peak)


def _ops(r: Any, phase: str) -> set[str]:
    g = r.step
    starts = sorted(g.phase_start.values())
    start = g.phase_start[phase]
    stop = min([s for s in starts if s > start] + [len(g.ops)])
    return {str(n.target) for n in g.ops[start:stop]}


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama-checkpointing"])
def test_saved_and_states_match_the_own_loop_on_the_cuda_target(name: str) -> None:
    cuda, _, own, _, _ = _reports(name)
    assert (cuda.target.device, cuda.target.amp) == ("cuda", "bf16")
    assert _saved(cuda) - _saved(own) == Counter({TOKEN_COUNT: 1}) and not _saved(own) - _saved(cuda)
    assert cuda.activation_bytes == own.activation_bytes + 4
    assert cuda.budget.row("optimizer states").size == own.budget.row("optimizer states").size  # steps on the host: 0 B
    assert cuda.attention_backends == own.attention_backends == {"flash": 4 if "checkpointing" in name else 2}
    # CUDA's implementations: foreach AdamW (torch's pick for CUDA tensors) and clip_grad_norm_'s _foreach_norm
    assert _ops(cuda, "optimizer") == _ops(own, "optimizer")
    assert {"aten._foreach_norm.Scalar", "aten._foreach_sqrt.default"} <= _ops(cuda, "optimizer")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_peaks_differ_from_the_own_loop_by_the_named_tensors(name: str) -> None:
    cuda, _, own, model, no_decay = _reports(name)
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if n in no_decay}
    own_only, trainer_only = _live(own) - _live(cuda), _live(cuda) - _live(own)
    for (kind, tensor, shape, _, nbytes), _n in own_only.items():
        assert (kind == "optimizer state" and tensor.split(":")[0] in no_decay) or \
            (tensor == "aten._foreach_sqrt.default" and shape in shapes) or \
            (tensor == "aten.nll_loss_forward.default" and nbytes == 4), (kind, tensor, shape)
    assert all(shape == () and dtype == "float32" for _, _, shape, dtype, _ in trainer_only)
    assert sum(k[4] * n for k, n in trainer_only.items()) == SCALARS + NORM
    assert own.budget.peak_bytes - cuda.budget.peak_bytes == \
        sum(k[4] * n for k, n in own_only.items()) - sum(k[4] * n for k, n in trainer_only.items()) > 0
    assert cuda.budget.rank.peak_op == own.budget.rank.peak_op == "aten._foreach_sqrt.default"
    assert cuda.budget.rank.later_peak_bytes - own.budget.rank.later_peak_bytes == SCALARS


def test_fused_adamw_peaks_differ_only_by_the_trainers_scalars() -> None:
    """adamw_torch_fused against the own loop's fused AdamW: no foreach temporaries, so the Trainer's two
    param groups change nothing; its step states stay on the device (fused) in both. The first peak is
    the Trainer's four 4-B scalars (its gradient norm among them) less the own loop's 4-B loss above the own
    loop's, the later ones 12 B."""
    torch.manual_seed(0)
    model = _llama()
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=model, args=_args(out, optim="adamw_torch_fused"))
        batch = trainer_batch(trainer, (2, 16))
        cuda = graphmem.analyze(trainer, batch, device="cuda")
    own = graphmem.analyze(model, batch, device="cuda", amp="bf16", optimizer="adamw", optimizer_impl="fused",
                           release_output=True, clip_grad_norm=1.0)
    assert cuda.activation_bytes == own.activation_bytes + 4
    assert cuda.budget.row("optimizer states").size == own.budget.row("optimizer states").size
    assert cuda.budget.peak_bytes - own.budget.peak_bytes == SCALARS + NORM - 4
    assert cuda.budget.rank.later_peak_bytes - own.budget.rank.later_peak_bytes == SCALARS


def test_cuda_rules_change_the_trainers_saved_set() -> None:
    """Llama: CUDA's flash kernel keeps its philox seed (2 x uint64) and offset (uint64) per layer beside
    the output and fp32 logsumexp the CPU flash kernel keeps too: 24 B a layer more. GPT-2 (dropout 0.1):
    CUDA's fused dropout keeps a 1-B bool mask per element where the CPU keeps fp32 noise."""
    cuda, cpu, _, _, _ = _reports("llama")
    extra = _saved(cuda) - _saved(cpu)
    assert cuda.activation_bytes - cpu.activation_bytes == 2 * 24
    assert {(op, shape, dtype) for op, _, shape, dtype, _ in extra if dtype == "uint64"} == {
        ("aten._scaled_dot_product_flash_attention.default", (2,), "uint64"),
        ("aten._scaled_dot_product_flash_attention.default", (), "uint64")}
    assert {op for op, *_ in _saved(cpu) - _saved(cuda)} == {"aten._scaled_dot_product_flash_attention_for_cpu.default"}
    gpt_cuda, gpt_cpu, _, _, _ = _reports("gpt2")
    masks = [s for s in gpt_cuda.saved if s.op == "aten.native_dropout.default" and s.dtype == "bool"]
    assert masks and not [s for s in gpt_cpu.saved if s.dtype == "bool"]
    assert gpt_cuda.activation_bytes < gpt_cpu.activation_bytes


def test_a_trainer_built_on_a_gpu_is_analyzed_on_the_cuda_target() -> None:
    """A Trainer whose args.device and accelerate's device are cuda:0 (as built on a GPU host; set here by
    hand): analyze picks the CUDA target, its step stays on the fake CPU tensors, the devices come back."""
    from accelerate.state import PartialState

    cuda, _, _, _, _ = _reports("llama")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=_llama(), args=_args(out))
        batch = trainer_batch(trainer, (2, 16))
        gpu, kept = torch.device("cuda", 0), PartialState._shared_state["device"]
        trainer.args.__dict__["_setup_devices"] = PartialState._shared_state["device"] = gpu
        try:
            forward = trainer.model.forward
            r = graphmem.analyze(trainer, batch)
            assert trainer.args.device == gpu and PartialState._shared_state["device"] == gpu
            # accelerate's autocast wrapper, installed in the step, is taken off again
            assert "_original_forward" not in trainer.model.__dict__ and trainer.model.forward == forward
            with pytest.raises(UsageError, match="device='cuda'"):
                graphmem.analyze(trainer, batch, device="cpu")
        finally:
            trainer.args.__dict__.pop("_setup_devices")
            PartialState._shared_state["device"] = kept
    assert r.target is not None and r.budget is not None
    assert r.target.device == "cuda" and r.activation_bytes == cuda.activation_bytes
    assert r.budget.peak_bytes == cuda.budget.peak_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU line")
def test_refusals_are_one_line(tmp_path: Any, capsys: Any) -> None:
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=_llama(), args=_args(out))
        with pytest.raises(GraphmemError, match=f"^{NO_GPU}$"):
            graphmem.validate(trainer, input_shape=(2, 16), device="cuda")
        with pytest.raises(UsageError, match="^unknown device 'mps'"):
            graphmem.analyze(trainer, input_shape=(2, 16), device="mps")
        paged = transformers.Trainer(model=_llama(), args=_args(out, optim="paged_adamw_8bit"))
        with pytest.raises(UsageError, match="managed memory.*`optim='adamw_bnb_8bit'`"):
            graphmem.analyze(paged, input_shape=(2, 16), device="cuda")
        compiled = transformers.Trainer(model=_llama(), args=_args(out, torch_compile=True))
        with pytest.raises(UsageError, match="torch_compile.*`device='cuda'`"):
            graphmem.analyze(compiled, input_shape=(2, 16), device="cuda")
    _llama().config.to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "bf16": True}))
    argv = ["validate", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args",
            str(tmp_path / "args.json"), "--device", "cuda"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(NO_GPU)


def test_a_gpu_users_training_args_file_from_the_cli(tmp_path: Any, capsys: Any) -> None:
    """--training-args with --device cuda: a GPU user's file (bf16, no use_cpu; TrainingArguments itself
    refuses bf16 where no GPU is found) is read as on the target's GPU; the step is the Trainer's on the
    CUDA target, the same as the API's."""
    _llama().config.to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "bf16": True,
                                                    "optim": "adamw_torch", "max_grad_norm": 1.0}))
    argv = ["analyze", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args",
            str(tmp_path / "args.json"), "--device", "cuda", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["target"]["device"], d["target"]["amp"]) == ("cuda", "bf16")
    assert d["target"]["attention_backends"] == {"flash": 2}
    assert (d["budget"]["loop"], d["budget"]["precision"]) == ("transformers.Trainer", "bf16 autocast")

"""Graph inputs: torch.export programs (API and .pt2 on the CLI) and fx.GraphModules, analyzed
like modules, with saved bytes equal to a real CPU run of the same program."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cases import tiny_gpt

import graphmem
from graphmem.cli.main import main
from graphmem.models import gpt2, mlp
from graphmem.validation.measure import measure_saved


def _real_saved(module: torch.nn.Module, inputs: tuple, loss) -> int:
    """saved_tensors_hooks on a real forward + loss, dedup by storage, parameters excluded
    (an exported module refuses .train(), so the flag is set directly)."""
    for m in module.modules():
        m.training = True
    state = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in state:
            saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(module(*inputs), inputs)
    return sum(saved.values())


def _gpt() -> torch.nn.Module:
    return tiny_gpt().train()


def test_exported_program_matches_a_real_run_of_its_module() -> None:
    x = (torch.randint(0, 101, (2, 16)),)
    ep = torch.export.export(_gpt(), x)
    report = graphmem.analyze(ep, loss=gpt2.loss)  # the program's own example inputs
    assert report.input_shapes == ((2, 16),)
    assert report.activation_bytes == _real_saved(ep.module(), x, gpt2.loss)
    assert report.activation_bytes == graphmem.analyze(_gpt(), x, loss=gpt2.loss).activation_bytes


def test_graph_module_matches_a_real_run() -> None:
    torch.manual_seed(0)
    net = mlp.build(mlp.MLPConfig(in_features=64, hidden=(128, 128), out_features=10, dropout=0.1))
    gm = torch.fx.symbolic_trace(net)
    x = (torch.randn(4, 64),)
    assert isinstance(gm, torch.fx.GraphModule)
    assert graphmem.analyze(gm, x, loss=mlp.loss).activation_bytes == measure_saved(gm, x, mlp.loss)


def test_pt2_file_on_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = (torch.randint(0, 101, (2, 16)),)
    path = tmp_path / "gpt.pt2"
    torch.export.save(torch.export.export(_gpt(), x), str(path))
    assert main(["analyze", str(path), "--input-shape", "2x16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # the default loss (sum of the logits): compare with the same program analyzed through the API
    expected = graphmem.analyze(torch.export.load(str(path)), x).activation_bytes
    assert data["activation_bytes"] == expected and data["model"] == "gpt.pt2"


def test_broken_pt2_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junk.pt2"
    path.write_bytes(b"not a program")
    assert main(["analyze", str(path), "--input-shape", "2x16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch.export.save" in err[0]

"""graphmem/capture/aot_settings.py: AOTAutograd's text dumps of its graphs are skipped only while
a step compiles and only when no log reads them."""
from __future__ import annotations

import torch
from torch._functorch._aot_autograd import graph_compile

from graphmem.capture.aot_settings import unlogged


def test_the_dumps_are_skipped_while_compiling_and_restored_after() -> None:
    joint, fw_bw = graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs
    with unlogged():
        assert graph_compile._log_joint_graph is not joint and graph_compile._log_fw_bw_graphs is not fw_bw
        assert graph_compile._log_joint_graph(None, None) is None  # what enable_log=False returns
        assert graph_compile._log_fw_bw_graphs(None, None, None, None, None) == (None, None)
    assert graph_compile._log_joint_graph is joint and graph_compile._log_fw_bw_graphs is fw_bw


def test_the_dumps_are_made_when_torch_logs_them() -> None:
    joint = graph_compile._log_joint_graph
    torch._logging.set_logs(aot_graphs=True)
    try:
        with unlogged():
            assert graph_compile._log_joint_graph is joint
    finally:
        torch._logging.set_logs()

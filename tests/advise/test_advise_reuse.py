"""Advise's ranked table does not depend on depth reuse: every lever and combination captured with
reuse (graphmem/capture/reuse.py: 5 blocks captured, checked at 6, widened; the optimizer step
included) gives the numbers the full captures give, row for row."""
from __future__ import annotations

import pytest
import torch

import graphmem
from graphmem.models import llama


@pytest.mark.slow
def test_advice_is_the_same_with_and_without_depth_reuse() -> None:
    # GIVEN a 16-block Llama on the CUDA target with AdamW (deep enough for reuse), in too little memory,
    # so every lever that applies is captured (one rank: the sharded steps are compared in
    # tests/capture/test_reuse_optim.py)
    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=16, n_heads=4, n_kv_heads=2,
                                          ffn_hidden=64, max_seq_len=32))
    x = (torch.randint(0, 101, (1, 32), generator=torch.Generator().manual_seed(1)),)
    options = dict(loss=llama.loss, device="cuda", amp="bf16", optimizer="adamw")
    # WHEN it is advised with depth reuse and without
    a = graphmem.analyze(model, x, **options).advise(memory="2MiB", ranks=1)
    b = graphmem.analyze(model, x, reuse=False, **options).advise(memory="2MiB", ranks=1)
    # THEN the advice is the same, row for row
    assert a.levers and a.left_out  # (the peaks each lever captured and the reasons the others are left out)
    assert a.to_dict() == b.to_dict()

"""Expert parallel's token counts on fake tensors: routing read as balanced.

With expert parallel, torchtitan's ``AllToAllTokenDispatcher`` exchanges each rank's token count
per expert, then reads the all-to-all split sizes as Python lists
(torchtitan/models/common/token_dispatcher.py ``_sync_token_count_exchange``). Those counts come
from the router's top-k over the model's values, which a fake tensor does not have. graphmem
reads them as the routing the load-balancing objective aims at: each rank's ``T·K`` routed
tokens split evenly over the expert-parallel ranks, and each rank receiving as many as it sends
(torchtitan's own ``_debug_force_load_balance`` routing gives exactly this split; the gloo truth
runs with it, tests/titan_truth.py). Every other op of the exchange runs as torchtitan runs it; a
real step whose routing is uneven holds more on the ranks that receive more.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher


@contextlib.contextmanager
def balanced_routing() -> Iterator[list[int]]:
    """Around a torchtitan step: the split sizes of each expert-parallel dispatch read as
    balanced; yields the routed token counts of the dispatches seen (one per MoE layer call)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher as Dispatcher

    dispatch, sync = Dispatcher.dispatch, Dispatcher._sync_token_count_exchange
    routed: list[int] = []

    def dispatching(self: AllToAllTokenDispatcher, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor,
                    topk_expert_ids_TK: torch.Tensor, *args: object,
                    **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, object]:  # (..., its dispatch metadata)
        routed.append(topk_expert_ids_TK.numel())  # T tokens x K experts each
        return dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, *args, **kwargs)

    def synced(self: AllToAllTokenDispatcher, local_E: torch.Tensor, global_EP_e: torch.Tensor,
               ep_size: int) -> tuple[torch.Tensor, list[int], list[int]]:
        counts, _, _ = sync(self, local_E, global_EP_e, ep_size)  # its ops as torchtitan runs them
        n, me = routed[-1], self.ep_mesh.get_local_rank()
        sent = [n // ep_size + (i < n % ep_size) for i in range(ep_size)]
        received = [n // ep_size + (me < n % ep_size)] * ep_size
        return counts, sent, received

    Dispatcher.dispatch, Dispatcher._sync_token_count_exchange = dispatching, synced  # type: ignore[method-assign]
    try:
        yield routed
    finally:
        Dispatcher.dispatch, Dispatcher._sync_token_count_exchange = dispatch, sync  # type: ignore[method-assign]


__all__ = ["balanced_routing"]

"""CUDA's memory-relevant rules, applied to a step running on fake CPU tensors.

A TorchFunctionMode (above autograd, so autograd saves what the CUDA kernels would save):
- dropout: CUDA's ``at::dropout`` takes the fused ``native_dropout`` path (a bool mask, 1 B an
  element) where the CPU multiplies by float noise (aten/src/ATen/native/Dropout.cpp,
  ``is_fused_kernel_acceptable``);
- scaled_dot_product_attention: the backend CUDA picks (``select_backend``, after
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) runs through its own aten op, whose
  autograd formula saves exactly what the kernel keeps (flash: fp32 logsumexp (b, h, s) and the
  RNG seed/offset; memory-efficient: logsumexp padded to a multiple of 32; cuDNN: (b, h, s, 1)
  stats); the math backend is ATen's ``_scaled_dot_product_attention_math`` written out, with
  CUDA's fused dropout and its fp32 upcast of half inputs;
- autocast (``amp``): CUDA's cast lists (torch/amp autocast_mode.cpp, the CUDA kernels
  registered as lower_precision_fp and fp32) for the ops below; casts of parameters are cached
  for the forward, as autocast caches casts of leaf tensors that require grad. The casts follow
  the CUDA autocast state: ``CudaRules`` sets it to the target's ``amp`` and the model's own
  ``torch.autocast`` regions change it (``with torch.autocast(x.device.type, enabled=False)`` in
  transformers' rotary embeddings: ``"cpu"`` on graphmem's fake CPU tensors, ``"cuda"`` on the
  GPU, so a region for the fake tensors' device type is taken as the CUDA region it stands for);
- torch functions written in Python (torch/nn/functional.py ``multi_head_attention_forward``):
  a TorchFunctionMode sees such a function as one call and runs it with the mode off the stack
  (torch/overrides.py ``handle_torch_function`` pops it), where CUDA's autocast, backend choice
  and dropout act on the aten ops inside it; so the rules run the function's body with the mode
  on the stack (``python_body``) and its linears, bmm, softmax, dropout and SDPA meet them.
"""
from __future__ import annotations

import contextlib
import math
import sys
from types import FunctionType
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from graphmem.capture.target import Target

LOWER_PRECISION = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
                   torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.addmm, torch.addbmm, F.conv1d, F.conv2d,
                   F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.prelu,
                   F.scaled_dot_product_attention}
FP32 = {F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
        torch.Tensor.log_softmax, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
        F.binary_cross_entropy_with_logits, F.kl_div, F.cosine_similarity, torch.exp, torch.Tensor.exp, torch.log,
        torch.Tensor.log, torch.pow, torch.Tensor.pow, torch.rsqrt, torch.Tensor.rsqrt, torch.sum, torch.Tensor.sum,
        torch.cumsum, torch.Tensor.cumsum, torch.logsumexp, torch.Tensor.logsumexp, torch.norm, torch.Tensor.norm,
        F.softplus}
DROPOUT = {F.dropout, torch.dropout}
PYTHON_MODULES = ("torch.nn.functional", "torch.functional")  # the torch functions written in Python
CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")  # torch/overrides.py


def _unchecked(*_: object) -> bool:
    return False


def _plain(t: type) -> bool:
    """``t`` adds no ``__torch_function__`` of its own (a Tensor, a fake or wrapper subclass)."""
    tf = getattr(t, "__torch_function__", None)
    return tf is torch._C._disabled_torch_function_impl or \
        getattr(tf, "__func__", None) is torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]


def python_body(func: Callable, types: Iterable[type]) -> Optional[Callable]:
    """``func`` past its own torch-function check, when it is a torch function written in Python that
    hands itself to the mode (``if has_torch_function(...): return handle_torch_function(...)``) and
    no argument overrides ``__torch_function__``: a copy of the function whose globals read the
    checks as False (the module's other names the same). Run with the mode on the stack, the calls
    in its body meet the mode one by one, as CUDA autocast meets the aten ops below a Python
    function. None for anything else (a builtin, a function without the check, a Tensor method:
    ``Tensor.backward`` stays one call, its hooks outside the rules as before)."""
    if not isinstance(func, FunctionType) or func.__module__ not in PYTHON_MODULES \
            or not set(CHECKS) & set(func.__code__.co_names) or not all(_plain(t) for t in types):
        return None
    scope = dict(func.__globals__, **{name: _unchecked for name in CHECKS})  # fresh: the module as it is now
    body = FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


@contextlib.contextmanager
def _on_stack(mode: TorchFunctionMode) -> Iterator[None]:
    """``mode`` back on the torch function mode stack (its ``__torch_function__`` runs with it popped)."""
    torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        torch._C._pop_torch_function_stack()


def select_backend(target: Target, q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   enable_gqa: bool, v: Optional[torch.Tensor] = None) -> str:
    """Which SDPA kernel CUDA runs: the first backend, in PyTorch's priority order, that is enabled
    and whose checks pass (sdp_utils.cpp ``select_sdp_backend``). The order and the enabled set are
    torch's own (``torch._C._get_sdp_priority_order``, ``torch.backends.cuda.*_sdp_enabled``): by
    default flash > efficient > math > cuDNN, and a model's ``sdpa_kernel(backends,
    set_priority=True)`` (torchtitan's SDPA asks cuDNN > flash > math) changes both, as it does
    on a GPU. See the table in README.md."""
    if target.attention != "auto":
        return target.attention
    for backend in _enabled_in_order():
        if _eligible(backend, target, q, k, attn_mask, enable_gqa, v):
            return backend
    return "math"


_SDP_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend's values


def _enabled_in_order() -> list[str]:
    enabled = {"math": torch.backends.cuda.math_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
               "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
               "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    return [_SDP_NAMES[i] for i in torch._C._get_sdp_priority_order() if i in _SDP_NAMES and enabled[_SDP_NAMES[i]]]


def _eligible(backend: str, target: Target, q: torch.Tensor, k: torch.Tensor, attn_mask: Optional[torch.Tensor],
              enable_gqa: bool, v: Optional[torch.Tensor]) -> bool:
    """sdp_utils.cpp's checks for one backend. Flash needs q, k and v of one head dim
    (``check_head_dim_size_flash``: MLA's 192/128 goes to memory-efficient) and no mask;
    memory-efficient aligned q/k and v head dims (``check_head_dim_size_mem_efficient``); cuDNN
    (``can_use_cudnn_attention``) 16-bit inputs on sm80+, one head dim, a multiple of 8 up to 128
    (``check_cudnn_tensor_shapes``), grouped-query heads allowed."""
    major, _ = target.capability
    hd = q.shape[-1]
    hd_v = v.shape[-1] if v is not None else hd
    half = q.dtype in (torch.float16, torch.bfloat16)
    same_heads = q.shape[-3] == k.shape[-3]
    if backend == "flash":
        return attn_mask is None and half and major >= 8 and hd == hd_v <= 256 and hd % 8 == 0 and (same_heads or enable_gqa)
    if backend == "efficient":
        aligned = hd % (4 if q.dtype == torch.float32 else 8) == 0 and hd_v % (4 if q.dtype == torch.float32 else 8) == 0
        return aligned and same_heads and (q.dtype != torch.bfloat16 or major >= 8) and major >= 5
    if backend == "cudnn":
        return half and major >= 8 and hd == hd_v <= 128 and hd % 8 == 0 and (same_heads or enable_gqa)
    return backend == "math"


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask becomes an additive float mask (sdp_utils convert_boolean_attn_mask)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], p: float,
          causal: bool, scale: Optional[float]) -> torch.Tensor:
    """ATen's _scaled_dot_product_attention_math as CUDA runs it: half inputs upcast to fp32,
    the scale split over q and k, a float causal mask, _safe_softmax, fused dropout."""
    origin = q.dtype
    if origin in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    attn = torch.matmul(q * factor, k.transpose(-2, -1) * factor)  # (b, h, s, s)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        attn = attn + _float_mask(mask, attn.dtype)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if p > 0:
        attn = torch.ops.aten.native_dropout(attn, p, True)[0]
    return torch.matmul(attn, v).to(origin)


_INIT = torch.amp.autocast_mode.autocast.__init__
_OWNERS = [0]  # CudaRules contexts holding the CUDA autocast state, entered now


def _translated_init(self: torch.amp.autocast_mode.autocast, device_type: str, dtype: Optional[torch.dtype] = None, enabled: bool = True,
                     cache_enabled: Optional[bool] = None) -> None:
    """``torch.autocast.__init__`` while the CUDA target runs: a region for the fake tensors' device
    type is the CUDA region it stands for (models pass ``x.device.type``: "cuda" on the GPU); without
    a ``dtype`` it takes CUDA's current one, as ``torch.autocast("cuda")`` does
    (torch/amp/autocast_mode.py ``torch.get_autocast_dtype(device_type)``)."""
    _INIT(self, device_type, dtype, enabled, cache_enabled)
    if self.device == "cpu":
        self.device = "cuda"
        if dtype is None:
            self.fast_dtype = torch.get_autocast_dtype("cuda")


def _as_cuda(args: tuple) -> tuple:
    return tuple("cuda" if a == "cpu" else a for a in args)


def _state_query(query: Callable[..., object]) -> Callable[..., Any]:  # (put in place of torch's own functions)
    """``torch.is_autocast_enabled`` / ``torch.get_autocast_dtype`` as the model sees them on the
    CUDA target: a question about the fake tensors' device type gets CUDA's answer, as the GPU run
    answers one about ``x.device.type`` (transformers' ``maybe_autocast(device_type,
    enabled=False)`` opens its region only where ``torch.is_autocast_enabled(device_type)``:
    transformers/utils/generic.py). torch's own callers (dynamo saving and restoring the global
    state, torch.utils.checkpoint, AOTAutograd) get the real state; dynamo, tracing the model's
    call, traces the translated one (``torch._dynamo.substitute_in_graph``, registered on first use)."""
    def ask(*args: object) -> object:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return query(*(args if caller.split(".")[0] == "torch" else _as_cuda(args)))

    def traced(*args: object) -> object:
        return query(*_as_cuda(args))
    ask.__name__ = traced.__name__ = query.__name__
    ask.traced = traced  # type: ignore[attr-defined]
    return ask


_IS_ENABLED, _GET_DTYPE = torch.is_autocast_enabled, torch.get_autocast_dtype
_QUERIES = {"is_autocast_enabled": _state_query(_IS_ENABLED), "get_autocast_dtype": _state_query(_GET_DTYPE)}
_REGISTERED: list[bool] = []


def _translating(step: int) -> None:
    """Count an owning ``CudaRules`` in (+1) or out (-1); the first in installs ``_translated_init``
    and the state questions of ``_state_query``, the last out puts torch's back."""
    if not _REGISTERED:
        from torch._dynamo import substitute_in_graph

        for ask in _QUERIES.values():
            substitute_in_graph(ask, skip_signature_check=True)(ask.traced)  # type: ignore[attr-defined]
        _REGISTERED.append(True)
    _OWNERS[0] += step
    on = bool(_OWNERS[0])
    torch.amp.autocast_mode.autocast.__init__ = _translated_init if on else _INIT  # type: ignore[method-assign]
    torch.is_autocast_enabled = _QUERIES["is_autocast_enabled"] if on else _IS_ENABLED
    torch.get_autocast_dtype = _QUERIES["get_autocast_dtype"] if on else _GET_DTYPE


def sdpa(target: Target, used: dict[str, int], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    backend = select_backend(target, query, key, attn_mask, enable_gqa, value)
    used[backend] = used.get(backend, 0) + 1
    aten = torch.ops.aten
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    bias = _float_mask(attn_mask, query.dtype) if attn_mask is not None else None
    if backend == "efficient":
        return aten._scaled_dot_product_efficient_attention(query, key, value, bias, need_lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(query, key, value, bias, need_lse, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale)


class CudaRules(TorchFunctionMode):
    """Installs the rules above for one step (see the module docstring)."""

    def __init__(self, target: Target, backends: Optional[dict[str, int]] = None,
                 clearing: Callable[[], ContextManager[object]] = contextlib.nullcontext, owns_state: bool = True) -> None:
        super().__init__()
        # entering sets CUDA's autocast state to ``amp`` (restored on exit) and translates the model's
        # regions; compiled mode's per-node contexts (graphmem/capture/compiled_cuda.py) only read it
        self.owns_state = owns_state
        self.saved_states: list[tuple[bool, torch.dtype]] = []
        self.clearing = clearing  # wraps emptying the cast cache (the recorder marks what dies there)
        self.target = target
        self.amp = target.amp_dtype
        self.casts: dict[int, torch.Tensor] = {}  # id(parameter) -> its cached low-precision copy
        self.backends: dict[str, int] = {} if backends is None else backends  # SDPA backend -> calls

    def _cast(self, x: object, dtype: torch.dtype) -> object:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype and x.dtype != torch.float64):
            return x
        if x.is_leaf and x.requires_grad:  # a parameter: one cached copy per forward
            if id(x) not in self.casts:
                self.casts[id(x)] = x.to(dtype)
            return self.casts[id(x)]
        return x.to(dtype)

    def _cast_all(self, args: tuple, kwargs: dict, dtype: torch.dtype, only_lower: bool = False) -> tuple[tuple, dict]:
        def one(a: object) -> object:
            if isinstance(a, (list, tuple)):
                return type(a)(one(x) for x in a)
            if only_lower and isinstance(a, torch.Tensor) and a.dtype not in (torch.float16, torch.bfloat16):
                return a
            return self._cast(a, dtype)
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    def __enter__(self) -> "CudaRules":
        if self.owns_state:
            self.saved_states.append((_IS_ENABLED("cuda"), _GET_DTYPE("cuda")))
            torch.set_autocast_enabled("cuda", self.amp is not None)
            if self.amp is not None:
                torch.set_autocast_dtype("cuda", self.amp)
            _translating(+1)
        return super().__enter__()

    def clear_casts(self) -> None:
        """Empty the cached parameter casts, as ``torch.clear_autocast_cache`` empties CUDA autocast's."""
        with self.clearing():
            self.casts.clear()

    def __exit__(self, *exc: object) -> Optional[bool]:
        self.clear_casts()  # autocast empties its cast cache when its outermost context exits
        out = super().__exit__(*exc)
        if self.owns_state:
            _translating(-1)
            enabled, dtype = self.saved_states.pop()
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", dtype)
        return out

    def amp_now(self) -> Optional[torch.dtype]:
        """The dtype CUDA autocast casts to here, None where it is off: CUDA's autocast state, set to
        the target's ``amp`` by the owning context and changed by the model's own regions. (A method,
        not a static one: dynamo guards a mode's methods through ``__func__`` when it traces under
        this mode.)"""
        return _GET_DTYPE("cuda") if _IS_ENABLED("cuda") else None

    def autocast(self, func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``func``'s arguments as CUDA autocast hands them to the kernel (unchanged where it is off)."""
        amp = self.amp_now()
        if amp is not None:
            if func in LOWER_PRECISION:
                return self._cast_all(args, kwargs, amp)
            if func in FP32:
                return self._cast_all(args, kwargs, torch.float32, only_lower=True)
        return args, kwargs

    def __torch_function__(self, func: Callable, types: Sequence[type], args: tuple = (), kwargs: Optional[dict] = None,
                           ) -> object:
        args, kwargs = self.autocast(func, args, kwargs or {})
        if func is F.scaled_dot_product_attention:
            return sdpa(self.target, self.backends, *args, **kwargs)
        if func in DROPOUT:
            return self._dropout(func, args, kwargs)
        body = None if func in LOWER_PRECISION or func in FP32 else python_body(func, types)
        if body is not None:  # e.g. F.multi_head_attention_forward: its inner calls meet the rules
            with _on_stack(self):
                return body(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(func: Callable, args: tuple, kwargs: dict) -> object:
        names = ("input", "p", "training", "inplace") if func is not torch.dropout else ("input", "p", "train")
        bound = dict(zip(names, args), **kwargs)
        x, p = bound["input"], float(bound.get("p", 0.5))
        training = bool(bound.get("training", bound.get("train", True)))
        if not training or p == 0.0 or not x.is_floating_point():
            return func(*args, **kwargs)
        out = torch.ops.aten.native_dropout(x, p, True)[0]  # CUDA: the fused kernel, a bool mask
        if bound.get("inplace", False):
            return x.copy_(out)
        return out

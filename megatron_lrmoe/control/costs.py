"""Bytes per pair and per replica of one LRMoE layer call, from the layer's shapes and dtypes.

Shape legend: H hidden size, F expert FFN width, F1 fc1 output width (2F gated, else F).

The controller plans memory and traffic with these constants. They model what the LRMoE op holds
and sends (megatron_lrmoe/op.py) at the granularity of rows; per-pair scalars (routing weights,
``||x||^2``, positions; 4-8 bytes against kilobytes per row) are left out. Terms:

| term | per | save | recompute (lean) |
|---|---|---|---|
| replica | replica on a rank | fc1 + fc2 weights + their gradient buffer | same |
| expert-side saved activations | pair computed in forward | x (H; 0 at EP 1 when trimmed) + fc1 output h (F1) | 0 (lean: activation a, F) |
| source-side saved rows | pair sent by the rank | z (H) unless every pair is kept | same (lean: 0) |
| backward working rows | kept pair at its backward holder | gradient row (H) + gathered x (H; h is read in place) + d act, act (2F) + dh (F1) + dx (H) | gradient + token rows (2H) + recomputed h (F1) + 2F + dh (F1) + dx (H) |
| ... every pair kept (exact path) | pair | gradient row (H) + 2F + dh (F1) + dx (H): nothing gathered | (not used) |
| backward exchange | kept pair | gradient row (H) | gradient + token row (2H) |
| forward token buffers (reported only) | pair computed in forward | x in (H) + z out (H) | same |
| lean's router gradient | pair computed in forward, unless every pair is kept | - | lean: gradient row + fc2 input-gradient row (H + F), before the kept rows' backward (the budget holds the larger of the two; in Qwen3's shape the kept rows' above keep 0.262) |

At EP 1 the trimmed ``save`` path reads x from the layer input (which the router saves anyway)
instead of saving it: there the expert side holds h alone (``local_tokens``). The exact path
(every pair kept) saves x at every EP size.

Stock Megatron with fixed ownership (the reference, ``SequentialMLP`` as Megatron-Core builds it
without Transformer Engine) saves, per pair, x (H), h (F1), the activation's intermediates and
the routing-weighted activation that fc2 reads (3F gated: silu(a), silu(a) * b and its product
with the routing weight; 2F otherwise), and holds the gradient row, the activation gradients, dh
and dx in backward (2H + F1 + 2F), with no replicas. ``tests/test_costs.py`` measures both
layers' saved bytes against these terms. Transformer Engine's fused grouped MLP saves less than
``SequentialMLP``; with it the reference is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CostModel"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _dtype_bytes(dtype: Any) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r} for the LRMoE cost model")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class CostModel:
    """Per-pair and per-replica bytes of one MoE layer call.

    Attributes:
        hidden_size: H.
        ffn_hidden_size: F, one expert's FFN width.
        gated: True for gated activations (fc1 is ``[2F, H]``).
        activation_bytes: Bytes per element of token rows and activations (2 for bf16).
        param_bytes: Bytes per element of expert weights.
        grad_bytes: Bytes per element of the gradient buffer a replica needs (Megatron's
            ``main_grad``; 4 for fp32 gradient accumulation).
    """

    hidden_size: int
    ffn_hidden_size: int
    gated: bool = True
    activation_bytes: int = 2
    param_bytes: int = 2
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "activation_bytes", "param_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CostModel.{name} ({value!r}) must be a positive int")
        if not isinstance(self.grad_bytes, int) or self.grad_bytes < 0:
            raise ValueError(f"CostModel.grad_bytes ({self.grad_bytes!r}) must be an int >= 0")

    @classmethod
    def from_config(cls, config: Any, grad_bytes: int = 4) -> "CostModel":
        """Read H, F, gating and dtypes from a Megatron ``TransformerConfig`` (duck-typed).

        Args:
            config: The MoE layer's ``TransformerConfig``.
            grad_bytes: Element size of the replica's gradient buffer (``main_grad``).
        """
        ffn = getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size
        if getattr(config, "bf16", False):
            activation = 2
        elif getattr(config, "fp16", False):
            activation = 2
        else:
            activation = 4
        return cls(
            hidden_size=int(config.hidden_size),
            ffn_hidden_size=int(ffn),
            gated=bool(getattr(config, "gated_linear_unit", False)),
            activation_bytes=activation,
            param_bytes=_dtype_bytes(getattr(config, "params_dtype", "float32")),
            grad_bytes=int(grad_bytes),
        )

    @property
    def fc1_width(self) -> int:
        """F1: 2F for gated activations, else F."""
        return 2 * self.ffn_hidden_size if self.gated else self.ffn_hidden_size

    @property
    def replica_bytes(self) -> int:
        """One expert copy: fc1 ``[F1, H]`` and fc2 ``[H, F]`` weights plus a gradient buffer."""
        elements = self.fc1_width * self.hidden_size + self.hidden_size * self.ffn_hidden_size
        return elements * (self.param_bytes + self.grad_bytes)

    @property
    def row_bytes(self) -> int:
        """One token, output or gradient row (H elements)."""
        return self.hidden_size * self.activation_bytes

    def expert_saved_bytes(self, mode: str, local_tokens: bool = False) -> int:
        """Bytes the expert side keeps from forward to backward per pair it computed.

        Args:
            mode: ``"save"``, ``"recompute"`` or ``"lean"``.
            local_tokens: The trimmed path at EP 1, whose backward reads x from the layer input
                (held anyway) instead of a saved copy.
        """
        if mode == "save":
            x = 0 if local_tokens else self.hidden_size
            return (x + self.fc1_width) * self.activation_bytes
        if mode == "lean":  # the activation a, for the router gradient <W2^T g, a>
            return self.ffn_hidden_size * self.activation_bytes
        return 0

    def source_saved_bytes(self, mode: str, keeps_all: bool) -> int:
        """Bytes the source keeps from forward to backward per pair it sent: ``z`` (for the
        exact router gradient of dropped pairs) unless every pair is kept. In recompute mode the
        token row re-sent with a kept pair's gradient is the layer input (held anyway); its copy
        is a backward working row (:meth:`backward_bytes`). ``"lean"`` keeps no z (the expert
        side's activation stands in for it)."""
        return 0 if keeps_all or mode == "lean" else self.row_bytes

    def backward_bytes(self, mode: str, keeps_all: bool = False) -> int:
        """Working bytes per kept pair at the rank that runs its expert backward.

        Trimmed ``recompute`` holds 3H + 2F1 + 2F elements (x arrives with the gradient, h is
        recomputed); trimmed ``save`` 3H + F1 + 2F (it gathers the kept rows' x; the activation
        backward reads their h in place from the saved h, which the saved term already counts);
        in both the activation gradient and the activation for fc2's weight gradient add 2F.
        The exact path (every pair kept) gathers nothing: 2H + F1 + 2F.
        """
        h, f, f1 = self.hidden_size, self.ffn_hidden_size, self.fc1_width
        if keeps_all:
            elements = 2 * h + f1 + 2 * f
        elif mode == "save":
            elements = 3 * h + f1 + 2 * f
        else:
            elements = 3 * h + 2 * f1 + 2 * f
        return elements * self.activation_bytes

    def router_bytes(self, mode: str, keeps_all: bool = False) -> int:
        """Working bytes per computed pair of ``lean``'s router gradient ``<W2^T g, a>``: the
        pair's gradient row (H) and its fc2 input gradient (F), live at once at the expert
        side before the kept pairs' backward starts (``op/trimmed.py``, ``_lean_router_grad``).
        No quota removes them. 0 in the other modes and when every pair is kept (the exact
        path takes the router gradient from saved rows)."""
        if mode != "lean" or keeps_all:
            return 0
        return (self.hidden_size + self.ffn_hidden_size) * self.activation_bytes

    def exchange_bytes(self, mode: str) -> int:
        """Bytes per kept pair in the backward's gradient exchange (the largest one)."""
        return self.row_bytes * (2 if mode == "recompute" else 1)

    @property
    def forward_buffer_bytes(self) -> int:
        """Forward token buffers per computed pair: the received row and the returned output."""
        return 2 * self.row_bytes

    @property
    def stock_saved_bytes(self) -> int:
        """Stock Megatron's saved activations per pair: x, h, the activation's intermediates
        and the routing-weighted activation (see the module docstring)."""
        act = (3 if self.gated else 2) * self.ffn_hidden_size
        return (self.hidden_size + self.fc1_width + act) * self.activation_bytes

    @property
    def stock_backward_bytes(self) -> int:
        """Stock Megatron's backward working bytes per pair (gradient row, activation
        gradients, dh, dx)."""
        h, f, f1 = self.hidden_size, self.ffn_hidden_size, self.fc1_width
        return (2 * h + f1 + 2 * f) * self.activation_bytes

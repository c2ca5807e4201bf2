"""LoGRA linear layers: the forward saves x A^T instead of x, the backward accumulates the sketch.

For a frozen W [d, k] and input x [..., k]:
  forward   y = x W^T + b, saves P = x A^T [..., r] (A [r, k] regenerated, never stored)
  backward  returns dX = dY W and adds dY^T P into the layer's sketch S [d, r] (fp32);
            W.grad stays None and the dense gradient G = dY^T x is never formed.

Note [LoGRA projection under checkpointing]
Rationale: saving P = x A^T instead of x is what keeps activation memory at r per token per
layer. Under activation checkpointing, though, a layer's saved tensors exist only between its
recomputation and its backward, for one layer at a time, while projecting in the forward costs
the projection twice (the checkpointed forward projects and throws P away, the recomputation
projects again).
Approach: ``projection="backward"`` saves x (a reference to a tensor the recomputed layer holds
anyway for most projections) and projects it in the backward, once per micro-batch;
``projection="forward"`` saves P. ``apply_logra(projection="auto")`` picks "backward" when the
model has gradient checkpointing enabled (HF's ``is_gradient_checkpointing``) and "forward"
otherwise; :meth:`LoGRAModel.set_projection` changes it later.
Limitations: without checkpointing, "backward" keeps every layer's input alive until its
backward, which is the dense-activation memory LoGRA exists to avoid.

Note [LoGRA over split heads]
Rationale: a head-parallel model (membar.oomb.tensor_parallel) keeps rows of q/k/v and gate/up
(blocks of each section of Phi-3's fused projections) and columns of o_proj and down_proj on each
rank; LoGRA must sketch and update exactly the single-process W while each rank holds its part.
Approach: the split is read from the weight (membar.collectives.weight_split), so LoGRA does not
depend on how the model was split. Rows: the sketch dY^T P of this rank's rows is the rows of the
whole sketch (x and A are whole on every rank), and the update W -= U A of those rows is rounded as
those rows of the whole matrix (first_element, per contiguous run of rows). Columns: x holds this
rank's columns, so P = x A^T is summed over the group from x_local A_cols^T (A's columns of this
rank, generated once per draw); dY is whole on every rank, so the sketch dY^T P [d, r] is the
same everywhere; the update W_cols -= U A_cols is a matmul in fp32 (a bf16 weight gets fp32
masters for those layers); the partial outputs are summed by the layer's own reduce().
Limitations: predicted-KL control and publishing updates are refused on split models (the
forward-mode pass does not cross the group's all-reduces; receivers of whole weights would round
column blocks differently); split MoE experts are not LoGRA targets (fused 3-D weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
import torch.nn.functional as F

from membar.collectives import WeightSplit, weight_split
from membar.logra import ops
from membar.logra.state import LoGRAStates, allocate_state

# Attention and MLP projections of Hugging Face decoders: q/k/v/o_proj and gate/up/down_proj in
# Llama, Qwen2/3, Mistral, Gemma 2/3 and the attention of Qwen3-MoE and Mixtral; Phi-3 fuses them
# into qkv_proj and gate_up_proj. Fused MoE expert weights (3-D parameters named gate_up_proj or
# down_proj) are not nn.Linear: apply_logra names them in its error (Note [LoGRA targets]).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                   "down_proj")
PROJECTIONS = ("forward", "backward")


@dataclass
class KeyState:
    """The run's seed and the current draw of A, shared by every LoGRA layer of a model.

    ``step`` changes only between updates (the optimizer redraws A), never between the
    micro-batches of one update: a backward checks that its forward used the same draw.
    """

    seed: int
    step: int = 0

    def key(self, matrix_id: int) -> ops.ProjectionKey:
        return ops.ProjectionKey(self.seed, matrix_id, self.step)


class _LoGRAFunction(torch.autograd.Function):
    """y = x W^T + b with a sketch-accumulating backward. ``anchor`` is a 0-element tensor that
    requires grad, so that the output requires grad although x, W and b may all be frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, layer):
        y = F.linear(x, weight, bias)
        key = layer.current_key()
        ctx.projected_in_backward = layer.projection == "backward"
        if ctx.projected_in_backward:
            ctx.save_for_backward(x)  # [..., k], projected in backward (Note [LoGRA projection under checkpointing])
        else:
            with torch.no_grad():
                projected = layer.project(x, key)  # [..., r]
            ctx.save_for_backward(projected)
        ctx.layer = layer
        ctx.key = key
        ctx.x_dtype = x.dtype
        ctx.x_needs_grad = ctx.needs_input_grad[0]
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        layer: LoGRALinear = ctx.layer
        if layer.current_key() != ctx.key:
            raise RuntimeError(
                "LoGRA: A was redrawn between this layer's forward and backward; "
                "call the optimizer's step() only after every backward of the update."
            )
        if ctx.projected_in_backward:
            with torch.no_grad():
                projected = layer.project(saved, ctx.key)  # [..., r]
        else:
            projected = saved
        if projected.dtype != grad_output.dtype:
            projected = projected.to(grad_output.dtype)
        ops.sketch_accumulate_(layer.sketch_for_accumulation(), grad_output, projected)
        grad_x = None
        if ctx.x_needs_grad:
            weight = layer.weight
            if weight.dtype != grad_output.dtype:
                weight = weight.to(grad_output.dtype)
            grad_x = torch.matmul(grad_output, weight).to(ctx.x_dtype)  # [..., k]
        return grad_x, None, None, None, None


class LoGRALinear(nn.Module):
    """Wraps an ``nn.Linear`` (its weight and bias become frozen) with LoGRA's sketching backward.

    States:
      sketch  [d, r] fp32, accumulated by every backward until the optimizer consumes it: a view
              of the model's flat sketch buffer (membar.logra.state.LoGRAStates), or of a
              buffer of its own for a layer made outside :func:`apply_logra`;
      master  [d, k] fp32, optional: the authoritative weights when ``weight`` is bf16.
    """

    def __init__(self, base: nn.Module, rank: int, matrix_id: int, key_state: KeyState, master_weights: bool = False,
                 states: LoGRAStates | None = None, state_index: int = 0, projection: str = "forward"):
        super().__init__()
        if rank < 1:
            raise ValueError(f"the LoGRA rank must be at least 1, got {rank}")
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        # Head parallel (Note [LoGRA over split heads]): rows or columns of a split weight.
        self.split: WeightSplit | None = weight_split(base.weight)
        self._reduce = base.reduce if self.split is not None and self.split.dim == 1 else None
        self._columns: tuple | None = None   # (key, A's columns of this rank [r, k_local] fp32)
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank = int(rank)
        self.matrix_id = int(matrix_id)
        self.key_state = key_state
        self.projection = projection
        if states is None:
            states = LoGRAStates([(self.out_features, self.rank)], self.weight.device)
            state_index = 0
        self.states = states
        self.state_index = int(state_index)
        self.master: torch.Tensor | None = None
        if self._reduce is not None and self.weight.dtype != torch.float32:
            master_weights = True   # a column block is updated by a matmul, in fp32 (Note [LoGRA over split heads])
        if master_weights:
            self.master = allocate_state(self.weight.shape, self.weight.device, "master")
            self.master.copy_(self.weight.detach())
        self._anchor = torch.empty(0, device=self.weight.device, requires_grad=True)
        # Forward-mode direction for predicted-KL (set by membar.logra.kl): the layer's output
        # tangent gains -coefficient * (x A^T) U^T, i.e. the JVP along dW = -coefficient * U A.
        self._tangent_update: torch.Tensor | None = None
        self._tangent_coefficient = 0.0

    def current_key(self) -> ops.ProjectionKey:
        return self.key_state.key(self.matrix_id)

    @property
    def whole_in_features(self) -> int:
        """Columns of the whole weight (this rank holds in_features of them when split by columns)."""
        return self.in_features * (self.split.size if self._reduce is not None else 1)

    def columns_of_a(self, key: ops.ProjectionKey) -> torch.Tensor:
        """This rank's columns of A [r, k_local] fp32, for a weight split by columns (generated once
        per draw)."""
        if self._columns is None or self._columns[0] != key:
            # Generated on the CPU (the op has no CUDA kernel; the CUDA kernels regenerate the same A).
            whole = ops.generate(key, self.rank, self.whole_in_features, "cpu")
            first = self.split.rank * self.in_features
            self._columns = (key, whole[:, first: first + self.in_features].to(self.weight.device).contiguous())
        return self._columns[1]

    def project(self, x: torch.Tensor, key: ops.ProjectionKey) -> torch.Tensor:
        """P = x A^T [..., r] in x's dtype; for a weight split by columns, x holds this rank's columns
        and the partial products are summed over the group (every rank gets the whole P)."""
        if self._reduce is None:
            return ops.project(x, key, self.rank)
        from membar.collectives import dist

        projected = torch.matmul(x.float(), self.columns_of_a(key).t()).contiguous()
        dist().all_reduce(projected, group=self.split.group)
        return projected.to(x.dtype)

    @property
    def sketch(self) -> torch.Tensor | None:
        """The sketch [d, r] fp32 accumulated since the last update (None before any backward)."""
        return self.states.peek("sketch", self.state_index)

    def sketch_for_accumulation(self) -> torch.Tensor:
        return self.states.view("sketch", self.state_index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b [..., d]; with grad enabled its backward adds to the sketch instead of
        forming W's gradient (and, during predicted KL, the output carries the update's tangent)."""
        if self._tangent_update is not None:
            return self._forward_with_tangent(x)
        if self._reduce is not None:   # this rank's columns: partial products summed, then the bias
            if torch.is_grad_enabled():
                out = self._reduce(_LoGRAFunction.apply(x, self.weight, None, self._anchor, self))
            else:
                out = self._reduce(F.linear(x, self.weight))
            return out if self.bias is None else out + self.bias
        if not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return _LoGRAFunction.apply(x, self.weight, self.bias, self._anchor, self)

    def _forward_with_tangent(self, x: torch.Tensor) -> torch.Tensor:
        # Primal and tangent are computed as two plain linears: a linear on a dual tensor takes a
        # much slower path in PyTorch's forward-mode AD.
        x_primal, x_tangent = forward_ad.unpack_dual(x)
        y_primal = F.linear(x_primal, self.weight, self.bias)
        projected = ops.project(x_primal, self.current_key(), self.rank)  # [..., r]
        tangent = torch.matmul(projected.float(), self._tangent_update.t()).mul_(-self._tangent_coefficient)
        if x_tangent is not None:
            tangent += F.linear(x_tangent, self.weight).float()
        return forward_ad.make_dual(y_primal, tangent.to(y_primal.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"matrix_id={self.matrix_id}, master_weights={self.master is not None}, projection={self.projection}")


@dataclass
class LoGRAModel:
    """What :func:`apply_logra` made: the model, its LoGRA layers (index = matrix_id) and the key."""

    model: nn.Module
    layers: list[LoGRALinear]
    key_state: KeyState
    names: list[str] = field(default_factory=list)
    states: LoGRAStates | None = None

    def zero_sketches(self) -> None:
        if self.states is not None and self.states.allocated("sketch"):
            self.states.flat("sketch").zero_()

    def set_projection(self, projection: str) -> None:
        """"forward" or "backward" for every layer (Note [LoGRA projection under checkpointing])."""
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
        for layer in self.layers:
            layer.projection = projection

    def authoritative_weights(self) -> list[torch.Tensor]:
        """The weights updates are applied to: fp32 masters where kept, else the weights."""
        return [layer.master if layer.master is not None else layer.weight for layer in self.layers]


def _wrappable(module) -> bool:
    """An nn.Linear, a LoGRA layer, or the column-split linear of a head-parallel model (a module
    whose weight is marked split by columns and whose reduce() sums partial products over the group:
    membar.oomb.tensor_parallel.RowParallelLinear)."""
    if isinstance(module, (nn.Linear, LoGRALinear)):
        return True
    split = weight_split(getattr(module, "weight", None))
    return split is not None and split.dim == 1 and callable(getattr(module, "reduce", None))


def target_linears(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(parent name, parent, attribute, linear) of every ``nn.Linear`` named in ``targets``, in
    ``named_modules`` order: index i is matrix id i. Rollout processes use it to find the weights
    a subscriber updates without wrapping them."""
    targets = tuple(targets)
    found = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if child_name in targets and _wrappable(child):
                found.append((parent_name, parent, child_name, child))
    return found


# Note [LoGRA targets]
#   Rationale: LoGRA replaces the backward of a frozen y = x W^T + b; what it wraps must be exactly
#   that. Decoder families name their projections differently (Phi-3's fused qkv_proj and
#   gate_up_proj are plain nn.Linear and need nothing more), and some hold a targeted name in
#   another layout: transformers' MoE experts (Qwen3-MoE, Mixtral) keep every expert's
#   gate_up_proj / down_proj as one 3-D parameter applied per routed token, and other libraries
#   put quantized or convolutional modules there. Freezing such a weight while wrapping the rest
#   would silently leave it untrained.
#   Approach: apply_logra looks for every module or parameter named in targets that is not an
#   nn.Linear and refuses with one sentence naming each (path, type, shape), before changing
#   anything; the caller narrows targets (e.g. the attention projections) to go on.
#   Limitations: per-expert sketches of fused expert weights are not implemented.
def unsupported_targets(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> list[str]:
    """Descriptions of modules and parameters named in ``targets`` that are not nn.Linear
    (Note [LoGRA targets]); empty when every target can be wrapped."""
    targets = tuple(targets)
    found = []
    for parent_name, parent in model.named_modules():
        if _wrappable(parent):
            continue
        prefix = f"{parent_name}." if parent_name else ""
        for child_name, child in parent.named_children():
            if child_name in targets and not _wrappable(child):
                found.append(f"{prefix}{child_name} ({type(child).__name__})")
        for parameter_name, parameter in parent.named_parameters(recurse=False):
            if parameter_name in targets:
                found.append(f"{prefix}{parameter_name} (a {tuple(parameter.shape)} parameter of "
                             f"{type(parent).__name__})")
    return found


def target_weights(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> dict[int, torch.Tensor]:
    """matrix id -> weight [d, k] of the targeted projections (the subscriber's view)."""
    return {index: entry[3].weight for index, entry in enumerate(target_linears(model, targets))}


def state_pool_bytes(model: nn.Module, rank: int, targets: Iterable[str] = DEFAULT_TARGETS) -> int:
    """Runtime memory (per tier) that apply_logra's states need: the three flat fp32 kinds (sketch
    and two moments) of every targeted projection, with room for page rounding. For sizing a
    runtime that other spaces share (membar-train's chunk-recurrent pages)."""
    return _state_pool_bytes([(entry[3].out_features, int(rank)) for entry in target_linears(model, targets)])


def _state_pool_bytes(shapes) -> int:
    frame = 2 << 20
    state_bytes = 4 * sum(rows * rank for rows, rank in shapes)
    return (3 * (state_bytes + 2 * frame) + frame - 1) // frame * frame


def _connect_runtime_for_states(shapes, device: torch.device):
    """A runtime for apply_logra(runtime="auto"): the daemon when one answers with a backend of
    the weights' device type, else an embedded one whose GPU and host pools hold the three flat
    state kinds (sketch, two moments) with room for page rounding."""
    from membar.runtime import Runtime

    backend = "cuda" if device.type == "cuda" else "host"
    pool_bytes = _state_pool_bytes(shapes)
    try:
        runtime = Runtime.connect(embedded=False, name="logra",
                                  device=(device.index or 0) if device.type == "cuda" else None)
        if runtime.device.type == device.type:
            return runtime
    except RuntimeError as error:
        if "UNAVAILABLE" not in str(error) and "NOT_FOUND" not in str(error):
            raise
    return Runtime.connect(embedded=True, backend=backend, gpu_pool_bytes=pool_bytes, host_pool_bytes=pool_bytes,
                           device=device.index or 0, name="logra")


def apply_logra(
    model: nn.Module,
    rank: int,
    targets: Iterable[str] = DEFAULT_TARGETS,
    seed: int = 0,
    master_weights: bool = False,
    projection: str = "auto",
    runtime="auto",
) -> LoGRAModel:
    """Freezes every parameter of ``model`` and replaces each ``nn.Linear`` whose attribute name
    is in ``targets`` with a :class:`LoGRALinear` of the given rank. Matrix ids follow
    ``named_modules`` order, so two processes that build the same model get the same ids.
    Call it after the model is on its device and in its dtype: states and masters are created on
    the weights' device and do not follow a later ``model.to()``.

    ``projection``: "forward", "backward" or "auto" (Note [LoGRA projection under checkpointing]).
    ``runtime``: a membar.runtime.Runtime whose pages hold the sketches and optimizer moments
    (Note [LoGRA state storage]); "auto" (default) connects one (the daemon when one answers and
    its backend matches the weights' device, else an embedded runtime sized for the states); None
    keeps them in plain tensors."""
    targets = tuple(targets)
    if projection == "auto":
        projection = "backward" if getattr(model, "is_gradient_checkpointing", False) else "forward"
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be 'auto' or one of {PROJECTIONS}, got {projection!r}")
    unsupported = unsupported_targets(model, targets)
    if unsupported:
        raise ValueError(f"apply_logra wraps nn.Linear projections only, and these targets are not: "
                         f"{'; '.join(unsupported[:4])}{' ...' if len(unsupported) > 4 else ''} "
                         f"({len(unsupported)} in all); leave their names out of targets (fused MoE expert "
                         f"weights have no LoGRA layout).")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    key_state = KeyState(seed=int(seed))
    layers: list[LoGRALinear] = []
    names: list[str] = []
    replacements = target_linears(model, targets)
    if any(isinstance(entry[3], LoGRALinear) for entry in replacements):
        raise ValueError("apply_logra: the model already has LoGRA layers")
    if not replacements:
        raise ValueError(f"apply_logra found no nn.Linear named any of {targets} in the model")
    devices = {entry[3].weight.device for entry in replacements}
    if len(devices) != 1:
        raise ValueError(f"apply_logra: the targeted weights sit on several devices ({sorted(map(str, devices))})")
    device = devices.pop()
    shapes = [(entry[3].out_features, int(rank)) for entry in replacements]
    if isinstance(runtime, str):
        if runtime != "auto":
            raise ValueError(f"runtime must be a Runtime, 'auto' or None, got {runtime!r}")
        runtime = _connect_runtime_for_states(shapes, device)
    if runtime is not None and runtime.device.type != device.type:
        raise ValueError(f"apply_logra: the runtime's pages live on {runtime.device} but the weights on {device}")
    states = LoGRAStates(shapes, device, runtime=runtime)
    for parent_name, parent, child_name, child in replacements:
        layer = LoGRALinear(child, rank, len(layers), key_state, master_weights=master_weights, states=states,
                            state_index=len(layers), projection=projection)
        setattr(parent, child_name, layer)
        layers.append(layer)
        names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return LoGRAModel(model=model, layers=layers, key_state=key_state, names=names, states=states)

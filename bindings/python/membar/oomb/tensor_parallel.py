"""Head (tensor) parallel chunk-recurrent training over torch.distributed.

Note [Head parallel layers]
  Rationale: one sequence's pages (K/V and dK/dV of every layer) and its attention compute grow
  with its length; splitting a layer's attention heads over T ranks divides both by T, so the
  longest context and the step time scale with the GPUs of a node. membar rides on
  torch.distributed (NCCL on GPUs, gloo on CPUs); it has no transport of its own.
  Approach: shard_model(model, group) splits each decoder layer in place, Megatron style. The
  q/k/v projections keep the rows of this rank's query and key/value heads (rank r of T holds
  heads r*H/T .. (r+1)*H/T - 1 of each), o_proj keeps the matching columns; gate/up keep rows r of
  T of the intermediate size, down_proj the matching columns. The input of the attention block
  and of the MLP goes through copy_to_group (identity forward; the gradient, of which each rank's
  projections give only a part, is summed over the group backward), and o_proj/down_proj become
  RowParallelLinear (the partial products are summed over the group forward, the bias added once
  after). That is one all-reduce per sublayer in each direction. The attention itself needs
  nothing: the trainer's probe sees this rank's heads, its pages hold only them, and the paged
  attention works head by head. The input embeddings and lm_head are split over the vocabulary
  when T divides it (Note [Vocabulary split]). Everything else outside the split blocks (norms,
  MoE routers) is replicated: it computes the same on every rank, so its gradients agree without
  communication. Parameters inside a split block that are not split (Qwen3's and Gemma 3's
  q_norm/k_norm, applied per head) see only this rank's heads: their gradients are summed over the
  group after each step (`TensorParallel.partial`). Parameter objects are kept (their .data is
  replaced by the shard), so an optimizer made before sharding still holds them; full_state_dict
  gathers the shards for saving, clip_grad_norm_ counts each shard once and each replicated
  parameter once.
  MoE experts kept as transformers' fused 3-D parameters split the same way (Note [Split experts]),
  and so do fused projections (Phi-3's qkv_proj and gate_up_proj: each rank keeps its block of
  every section, and its attention module reads the config through a view with its own head
  counts). Sparse mode selects pages from scores summed over the group (Note [Page selection over
  split heads]).
  Limitations: attention blocks need q_proj/k_proj/v_proj/o_proj linears or Phi-3's qkv_proj (any
  other layout is refused with a sentence); MLPs of another layout stay whole on every rank; the
  query and key/value head counts and the intermediate sizes must divide by T (a vocabulary that T
  does not divide stays whole, with a log line). LoGRA reads each weight's split (Note [LoGRA over
  split heads] in membar/logra/linear.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from membar.collectives import WeightSplit, mark_split
from membar.collectives import dist as _dist

log = logging.getLogger("membar.oomb")

_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        _dist().all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over the group forward; identity backward (every rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        _dist().all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


class RowParallelLinear(torch.nn.Module):
    """A linear layer holding columns of its weight: its partial products are summed over the
    group, then the (whole) bias is added. Keeps the Parameter objects of the layer it replaces."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, group):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x):
        out = self.reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The whole output from this rank's partial product (summed over the group), bias not added:
        what a module that replaces this layer's product (LoGRA) applies after its own."""
        return reduce_from_group(partial, self.group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank's columns), out_features={self.out_features}"


@dataclass
class TensorParallel:
    """What shard_model did to a model (kept as model._membar_tensor_parallel)."""

    group: object
    rank: int
    size: int
    # parameter -> how it was split: the dimension of its equal blocks in rank order (0: rows,
    # 1: columns, 2: an expert's columns), or ("sections", dim, sizes) for fused projections
    # whose every section is split (_take_sections; full_state_dict undoes both).
    sharded: dict = field(default_factory=dict)
    partial: list = field(default_factory=list)   # unsplit parameters that see only this rank's heads
    split_layers: int = 0
    whole_mlps: list = field(default_factory=list)   # layers whose MLP stays whole on every rank
    vocab_split: bool = False   # Note [Vocabulary split]
    vocab_first: int = 0
    vocab_rows: int = 0


def info(model) -> TensorParallel | None:
    return getattr(model, "_membar_tensor_parallel", None)


def _take(parameter: torch.nn.Parameter | None, dim: int, rank: int, size: int) -> None:
    if parameter is None:
        return
    block = parameter.shape[dim] // size
    with torch.no_grad():
        parameter.data = parameter.data.narrow(dim, rank * block, block).clone()
    if parameter.grad is not None:
        parameter.grad = parameter.grad.narrow(dim, rank * block, block).clone()


def _take_sections(parameter: torch.nn.Parameter, dim: int, sizes, rank: int, size: int) -> None:
    """Keeps block `rank` of `size` of each consecutive section (sizes along dim) of a fused weight."""
    pieces, offset = [], 0
    with torch.no_grad():
        for section in sizes:
            block = section // size
            pieces.append(parameter.data.narrow(dim, offset + rank * block, block))
            offset += section
        parameter.data = torch.cat(pieces, dim=dim).contiguous()


def _shard_sections(linear: torch.nn.Linear, sizes, rank: int, size: int, tp: TensorParallel) -> None:
    _take_sections(linear.weight, 0, sizes, rank, size)
    tp.sharded[linear.weight] = ("sections", 0, tuple(sizes))
    mark_split(linear.weight, WeightSplit(tp.group, rank, size, 0, tuple(sizes)))
    if linear.bias is not None:
        _take_sections(linear.bias, 0, sizes, rank, size)
        tp.sharded[linear.bias] = ("sections", 0, tuple(sizes))
    linear.out_features = linear.weight.shape[0]


def _shard_rows(linear: torch.nn.Linear, rank: int, size: int, tp: TensorParallel) -> None:
    _take(linear.weight, 0, rank, size)
    _take(linear.bias, 0, rank, size)
    linear.out_features = linear.weight.shape[0]
    tp.sharded[linear.weight] = 0
    mark_split(linear.weight, WeightSplit(tp.group, rank, size, 0))
    if linear.bias is not None:
        tp.sharded[linear.bias] = 0


def _row_parallel(linear: torch.nn.Linear, rank: int, size: int, tp: TensorParallel) -> RowParallelLinear:
    _take(linear.weight, 1, rank, size)
    tp.sharded[linear.weight] = 1
    mark_split(linear.weight, WeightSplit(tp.group, rank, size, 1))
    return RowParallelLinear(linear.weight, linear.bias, tp.group)


def _copy_input_hook(group):
    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=copy_to_group(kwargs["hidden_states"], group))
        return (copy_to_group(args[0], group), *args[1:]), kwargs
    return hook


def _divides(what: str, count: int, size: int) -> None:
    if count % size:
        raise ValueError(f"--tensor-parallel {size} splits {what} over {size} ranks, but there are {count}: "
                         f"choose a tensor-parallel size that divides {count}.")


def shard_model(model, group) -> TensorParallel:
    """Splits the model's attention heads and MLPs over `group` in place (Note [Head parallel
    layers]); every rank must call it with the same, unsplit weights. Returns what it did."""
    dist = _dist()
    existing = info(model)
    if existing is not None:
        if existing.group is not group:
            raise ValueError("the model is already split over another tensor-parallel group.")
        return existing
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tp = TensorParallel(group=group, rank=rank, size=size)
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no .layers: tensor parallel splits decoder layers.")
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        missing = [name for name in _ATTENTION_LINEARS
                   if not isinstance(getattr(attention, name, None), torch.nn.Linear)]
        if attention is not None and missing and _fused_qkv(attention):
            _split_fused_attention(attention, rank, size, tp)
        elif attention is None or missing:
            raise ValueError(f"tensor parallel splits attention blocks with separate q_proj, k_proj, v_proj and o_proj "
                             f"linears; layer {index}'s {type(attention).__name__} has no {', '.join(missing)} "
                             f"(or a fused qkv_proj with num_key_value_heads, as in Phi-3).")
        else:
            _split_attention(attention, rank, size, tp)
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is not None and _fused_experts(experts):
            _split_experts(experts, rank, size, tp)
        elif mlp is not None and all(isinstance(getattr(mlp, name, None), torch.nn.Linear) for name in _MLP_LINEARS):
            _divides("the MLP's intermediate size", mlp.gate_proj.out_features, size)
            kept = {id(getattr(mlp, name).weight) for name in _MLP_LINEARS}
            kept |= {id(getattr(mlp, name).bias) for name in _MLP_LINEARS if getattr(mlp, name).bias is not None}
            _shard_rows(mlp.gate_proj, rank, size, tp)
            _shard_rows(mlp.up_proj, rank, size, tp)
            mlp.down_proj = _row_parallel(mlp.down_proj, rank, size, tp)
            tp.partial += [p for p in mlp.parameters() if id(p) not in kept]
            mlp.register_forward_pre_hook(_copy_input_hook(group), with_kwargs=True)
        elif mlp is not None and all(isinstance(getattr(mlp, name, None), torch.nn.Linear)
                                     for name in ("gate_up_proj", "down_proj")):
            # Phi-3: gate and up fused in one linear whose output the forward chunks in two.
            intermediate = mlp.down_proj.in_features
            _divides("the MLP's intermediate size", intermediate, size)
            kept = {id(mlp.gate_up_proj.weight), id(mlp.down_proj.weight)}
            kept |= {id(l.bias) for l in (mlp.gate_up_proj, mlp.down_proj) if l.bias is not None}
            _shard_sections(mlp.gate_up_proj, (intermediate, intermediate), rank, size, tp)
            mlp.down_proj = _row_parallel(mlp.down_proj, rank, size, tp)
            tp.partial += [p for p in mlp.parameters() if id(p) not in kept]
            mlp.register_forward_pre_hook(_copy_input_hook(group), with_kwargs=True)
        else:
            tp.whole_mlps.append(index)
        tp.split_layers += 1
    tp.vocab_split = _split_vocabulary(model, tp)
    if tp.whole_mlps:
        log.warning("tensor parallel: the MLPs of %d layer(s) (%s) have no gate/up/down linears or fused experts and "
                    "stay whole on every rank.", len(tp.whole_mlps),
                    type(getattr(layers[tp.whole_mlps[0]], "mlp", None)).__name__)
    model._membar_tensor_parallel = tp
    return tp


def _split_attention(attention, rank: int, size: int, tp: TensorParallel) -> None:
    """q/k/v keep this rank's heads, o_proj their columns (Note [Head parallel layers])."""
    head_dim = attention.head_dim
    _divides("the query heads", attention.q_proj.out_features // head_dim, size)
    _divides("the key/value heads", attention.k_proj.out_features // head_dim, size)
    kept = {id(getattr(attention, name).weight) for name in _ATTENTION_LINEARS}
    kept |= {id(getattr(attention, name).bias) for name in _ATTENTION_LINEARS if getattr(attention, name).bias is not None}
    for name in ("q_proj", "k_proj", "v_proj"):
        _shard_rows(getattr(attention, name), rank, size, tp)
    attention.o_proj = _row_parallel(attention.o_proj, rank, size, tp)
    tp.partial += [p for p in attention.parameters() if id(p) not in kept]
    attention.register_forward_pre_hook(_copy_input_hook(tp.group), with_kwargs=True)


def _fused_qkv(attention) -> bool:
    return (isinstance(getattr(attention, "qkv_proj", None), torch.nn.Linear)
            and isinstance(getattr(attention, "o_proj", None), torch.nn.Linear)
            and hasattr(attention, "num_key_value_heads") and hasattr(attention, "config"))


class _LocalHeads:
    """A model config seen with this rank's head counts; everything else (read or written, e.g.
    the attention implementation chosen later) is the model's own config."""

    _LOCAL = ("num_attention_heads", "num_key_value_heads")

    def __init__(self, config, q_heads: int, kv_heads: int):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_heads", {"num_attention_heads": q_heads, "num_key_value_heads": kv_heads})

    def __getattr__(self, name):
        heads = object.__getattribute__(self, "_heads")
        if name in heads:
            return heads[name]
        return getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name, value):
        if name in self._LOCAL:
            self._heads[name] = value
        else:
            setattr(self._config, name, value)


def _split_fused_attention(attention, rank: int, size: int, tp: TensorParallel) -> None:
    """Phi-3: one qkv_proj whose rows are the query heads, then the key heads, then the value
    heads; the forward cuts its output at config.num_attention_heads * head_dim and at
    num_key_value_heads * head_dim. Each rank keeps its block of each section and sees the config
    through a view with its own head counts."""
    head_dim = attention.head_dim
    kv_heads = attention.num_key_value_heads
    q_heads = attention.qkv_proj.out_features // head_dim - 2 * kv_heads
    _divides("the query heads", q_heads, size)
    _divides("the key/value heads", kv_heads, size)
    kept = {id(attention.qkv_proj.weight), id(attention.o_proj.weight)}
    kept |= {id(l.bias) for l in (attention.qkv_proj, attention.o_proj) if l.bias is not None}
    _shard_sections(attention.qkv_proj, (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), rank, size, tp)
    attention.o_proj = _row_parallel(attention.o_proj, rank, size, tp)
    attention.config = _LocalHeads(attention.config, q_heads // size, kv_heads // size)
    attention.num_key_value_heads = kv_heads // size
    tp.partial += [p for p in attention.parameters() if id(p) not in kept]
    attention.register_forward_pre_hook(_copy_input_hook(tp.group), with_kwargs=True)


# Note [Split experts]
#   Rationale: a MoE model's experts are most of its weights; kept whole, head parallel would
#   divide little of its memory.
#   Approach: transformers keeps a MoE block's experts as two 3-D parameters (Qwen3-MoE, Mixtral,
#   ...): gate_up_proj [E, 2I, H] (gate rows, then up rows; the forward chunks the product in two)
#   and down_proj [E, H, I], applied per routed token after a router that stays whole. Like a dense
#   MLP, each rank keeps block r of T of every expert's intermediate size: rows r of the gate half
#   and of the up half, columns r of down_proj. The experts' output is a partial sum, summed over
#   the group; their inputs (the tokens and the routing weights) go through copy_to_group, so the
#   gradients of the routing weights, of which each rank's block gives a part, are summed backward
#   and the router trains as one process's would.
#   Limitations: every rank runs every routed token through its block of every expert (this is
#   not expert parallelism, which would place whole experts on ranks and exchange tokens).
def _fused_experts(module) -> bool:
    import inspect

    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        return False
    names = list(inspect.signature(module.forward).parameters)
    return names[:3] == ["hidden_states", "top_k_index", "top_k_weights"]


def _split_experts(experts, rank: int, size: int, tp) -> None:
    intermediate = experts.down_proj.shape[2]
    _divides("the experts' intermediate size", intermediate, size)
    block = intermediate // size
    _take_sections(experts.gate_up_proj, 1, (intermediate, intermediate), rank, size)
    tp.sharded[experts.gate_up_proj] = ("sections", 1, (intermediate, intermediate))
    _take(experts.down_proj, 2, rank, size)
    tp.sharded[experts.down_proj] = 2
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = block
    group = tp.group

    def inputs(module, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        for position, name in ((0, "hidden_states"), (2, "top_k_weights")):
            if name in kwargs:
                kwargs[name] = copy_to_group(kwargs[name], group)
            elif len(args) > position:
                args[position] = copy_to_group(args[position], group)
        return tuple(args), kwargs

    experts.register_forward_pre_hook(inputs, with_kwargs=True)
    experts.register_forward_hook(lambda module, args, output: reduce_from_group(output, group))


def full_state_dict(model) -> dict:
    """The unsplit state dict, on every rank of the group (a collective: every rank calls it)."""
    tp = info(model)
    state = model.state_dict()
    if tp is None:
        return state
    by_id = {id(p): dim for p, dim in tp.sharded.items()}
    named = dict(model.named_parameters(remove_duplicate=False))
    full = {}
    for name, tensor in state.items():
        parameter = named.get(name)
        dim = by_id.get(id(parameter)) if parameter is not None else None
        if dim is None:
            full[name] = tensor
            continue
        full[name] = _gather(tensor, dim, tp)
    return full


def _gather(tensor: torch.Tensor, how, tp) -> torch.Tensor:
    """The whole tensor from the group's shards: `how` is the dimension of equal blocks in rank
    order, or ("sections", dim, sizes) for fused projections (q/k/v, gate/up) where each rank
    holds its block of every section."""
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    _dist().all_gather(parts, tensor.contiguous(), group=tp.group)
    if isinstance(how, tuple):   # ("sections", dim, full sizes): block r of each section
        _, dim, sizes = how
        pieces, offset = [], 0
        for size in sizes:
            block = size // tp.size
            pieces += [part.narrow(dim, offset, block) for part in parts]
            offset += block
        return torch.cat(pieces, dim=dim)
    return torch.cat(parts, dim=how)


def full_gradients(model) -> dict:
    """A copy of every parameter's .grad, unsplit (a collective; None stays None). For checks."""
    tp = info(model)
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        dim = tp.sharded.get(parameter) if tp is not None else None
        if grad is None or dim is None:
            grads[name] = None if grad is None else grad.detach().clone()
            continue
        grads[name] = _gather(grad, dim, tp)
    return grads


def clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a split model: the norm of the whole model's gradient
    (each shard once, each replicated parameter once), the same scale on every rank."""
    tp = info(model)
    parameters = [p for p in model.parameters() if p.grad is not None]
    if tp is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    if not parameters:
        return torch.zeros(())
    device = parameters[0].grad.device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for parameter in parameters:
        square = parameter.grad.detach().double().pow(2).sum()
        if parameter in tp.sharded:
            sharded += square
        else:
            replicated += square
    _dist().all_reduce(sharded, group=tp.group)
    norm = (sharded + replicated).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for parameter in parameters:
        parameter.grad.detach().mul_(scale.to(parameter.grad.dtype))
    return norm.float()


# Note [Vocabulary split]
#   Rationale: a model's input embeddings and lm_head are vocabulary x hidden each (1.1B of a 7B
#   Qwen2.5's 7.6B parameters); kept whole they and their gradients and Adam moments would sit on
#   every rank of a head-parallel group, and the logits of a loss piece are vocabulary wide.
#   Approach: rank r keeps vocabulary rows [r*V/T, (r+1)*V/T) of both (once when they are tied).
#   The embedding looks up the ids of its rows (the others give zeros) and the rows are summed over
#   the group. lm_head computes this rank's columns of the logits from its input through
#   copy_to_group (the input's gradient is summed backward); called as a module (the model's own
#   forward, predict()) it gathers the full logits, while the trainer's loss uses
#   vocab_parallel_cross_entropy on the local columns: the row maximum, the sum of exponentials and
#   the target's logit are summed (max-reduced) over the group, and the backward is softmax minus
#   the one-hot target on this rank's columns, so no rank forms vocabulary-wide logits. Gemma's
#   final soft-cap is elementwise and applies to the local columns.
#   Limitations: T must divide the vocabulary; otherwise both stay whole on every rank.
class _GatherFromGroup(torch.autograd.Function):
    """Concatenates the group's last-dimension parts forward; this rank's part of the gradient back."""

    @staticmethod
    def forward(ctx, x, group):
        dist = _dist()
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


class _MaxOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        _dist().all_reduce(out, op=_dist().ReduceOp.MAX, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, first: int, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of logits split over the group by vocabulary columns: `local_logits`
    [tokens, V/T] are columns first .. first + V/T of the full logits (Note [Vocabulary split])."""
    width = local_logits.shape[-1]
    # The maximum only shifts the exponentials (no gradient needed through it).
    maximum = _MaxOverGroup.apply(local_logits.detach().max(dim=-1).values, group)
    shifted = local_logits - maximum.unsqueeze(-1)
    total = reduce_from_group(shifted.exp().sum(dim=-1), group)
    local_target = targets - first
    here = (local_target >= 0) & (local_target < width)
    picked = shifted.gather(-1, local_target.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * here
    target_logit = reduce_from_group(picked, group)
    valid = targets != ignore_index
    return ((total.log() - target_logit) * valid).sum()


def _vocab_rows(module, rank: int, size: int, tp) -> None:
    _take(module.weight, 0, rank, size)
    tp.sharded[module.weight] = 0
    bias = getattr(module, "bias", None)
    if bias is not None:
        _take(bias, 0, rank, size)
        tp.sharded[bias] = 0


def _split_vocabulary(model, tp) -> bool:
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = embedding.weight.shape[0]
    if vocab % tp.size or head is None or head.weight.shape[0] != vocab:
        log.warning("tensor parallel: the vocabulary (%d) does not split over %d ranks: the embeddings and lm_head stay "
                    "whole on every rank.", vocab, tp.size)
        return False
    block = vocab // tp.size
    first = tp.rank * block
    tied = head.weight is embedding.weight
    _vocab_rows(embedding, tp.rank, tp.size, tp)
    if not tied:
        _vocab_rows(head, tp.rank, tp.size, tp)
    padding = getattr(embedding, "padding_idx", None)
    if padding is not None:
        embedding.padding_idx = padding - first if first <= padding < first + block else None
    group = tp.group

    def lookup(module, args, kwargs):
        ids = args[0] if args else kwargs["input"]
        local = ids - first
        here = (local >= 0) & (local < block)
        module._membar_rows_here = here
        local = torch.where(here, local, torch.zeros_like(local))
        return ((local, *args[1:]), kwargs) if args else (args, dict(kwargs, input=local))

    def combine(module, args, kwargs, output):
        here = module._membar_rows_here
        module._membar_rows_here = None
        return reduce_from_group(output * here.unsqueeze(-1).to(output.dtype), group)

    embedding.register_forward_pre_hook(lookup, with_kwargs=True)
    embedding.register_forward_hook(combine, with_kwargs=True)

    def head_input(module, args):
        return (copy_to_group(args[0], group), *args[1:])

    def head_output(module, args, output):
        return _GatherFromGroup.apply(output, group)

    head.register_forward_pre_hook(head_input)
    head.register_forward_hook(head_output)
    head._membar_vocab_split = (first, group)
    tp.vocab_first, tp.vocab_rows = first, block
    return True


def split_head_loss(lm_head, hidden: torch.Tensor, targets: torch.Tensor, logit_softcap: float | None,
                    ignore_index: int = -100) -> torch.Tensor | None:
    """The summed cross-entropy of hidden [tokens, hidden] through a vocabulary-split lm_head
    without vocabulary-wide logits; None when lm_head is not split."""
    split = getattr(lm_head, "_membar_vocab_split", None)
    if split is None:
        return None
    first, group = split
    logits = F.linear(copy_to_group(hidden, group), lm_head.weight, getattr(lm_head, "bias", None)).float()
    if logit_softcap is not None:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    return vocab_parallel_cross_entropy(logits, targets, first, group, ignore_index)


# Note [Page selection over split heads]
#   Rationale: sparse mode picks each query tile's top-k history pages by a score summed over all
#   query heads (the mean query of the tile against each page's mean key, kernels' page_select);
#   each rank of a head-parallel group holds only its heads, so its own top-k would differ from
#   one process's, and the ranks would attend to different pages.
#   Approach: the score is a sum over heads, so each rank computes its heads' part (in float64, as
#   the CPU kernel does), the parts are summed over the group, and every rank takes the same top-k
#   (highest score first, the lower page on a tie, listed in ascending order, -1 padded: the
#   kernel's output format).
#   Limitations: the min/max-bound scores (use_bounds) are not offered here; scores within float64
#   rounding of each other may order differently from the kernel's.
def split_page_select(q: torch.Tensor, mean: torch.Tensor, top_k: int, query_tile_tokens: int, group) -> torch.Tensor:
    """int32 [tiles, top_k] history pages per query tile, scores summed over the group's heads.
    q [tokens, Hq_local, D]; mean [pages, Hkv_local, D] float32 (page mean keys)."""
    from membar.attention import page_select_scores

    return page_select_scores(q, mean, top_k, query_tile_tokens,
                              reduce_scores=lambda scores: _dist().all_reduce(scores, group=group))


def make_groups(tensor_parallel: int):
    """(data-parallel group, tensor-parallel group) of this rank for a job of the default group's
    ranks: ranks k*T .. k*T + T - 1 split one model (T = tensor_parallel), ranks with the same
    rank mod T train different sequences. Every rank creates every group, in the same order."""
    dist = _dist()
    world = dist.get_world_size()
    if tensor_parallel < 1 or world % tensor_parallel:
        raise ValueError(f"--tensor-parallel {tensor_parallel} must divide the job's {world} ranks.")
    rank = dist.get_rank()
    tp_group = dp_group = None
    for first in range(0, world, tensor_parallel):
        ranks = list(range(first, first + tensor_parallel))
        group = dist.new_group(ranks) if tensor_parallel > 1 else None
        if rank in ranks:
            tp_group = group
    for offset in range(tensor_parallel):
        ranks = list(range(offset, world, tensor_parallel))
        group = dist.new_group(ranks) if world > tensor_parallel else None
        if rank in ranks:
            dp_group = group
    return dp_group, tp_group

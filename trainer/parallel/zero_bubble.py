"""The zero-bubble split backward of a pipeline stage, made exact for the stages of trainer/parallel/pipeline.py.

Contract: under ZBVZeroBubble and InterleavedZeroBubble each stage's backward splits into an input pass (to its
received inputs, which the previous stage waits for) and a later weight pass (the parameters' gradients), and the
gradients equal the single process's (tests/parallel/test_zero_bubble.py). `Tie` ties every stage output that
carries a gradient to a received tensor, `ContiguousGrad` hands back contiguous input gradients, `ZeroGrad` gives
the float carriers of integer inputs an exact zero gradient, and `ZeroBubbleStage` runs our own input and weight
passes (the weight pass as one autograd call from every joint, so no node runs twice). Activation checkpointing does
not combine with these schedules yet.

Design and reasoning: docs/parallelism.md#zero-bubble-split-backward
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining import PipelineStage

__all__ = ["ContiguousGrad", "OLD_PIPELINING", "Tie", "ZeroBubbleStage", "ZeroGrad"]

OLD_PIPELINING = torch.torch_version.TorchVersion(torch.__version__) < "2.13"
"""torch 2.11's pipelining: received buffers all require grad, every received tensor wants a gradient back, and its
gloo has no pair to its own rank (trainer/parallel/pipeline.py's float wire and ZeroBubbleStage work around it)."""


# -- autograd graph walks (our own: pipelining/_backward.py's private helpers differ between torch 2.11 and 2.13) --

def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node that receives t's gradient: its grad_fn, or for a leaf that requires grad its
    AccumulateGrad node (created lazily, so reached through a throw-away view)."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    node = t.view_as(t).grad_fn
    if node is None:
        raise RuntimeError("zero-bubble backward: a parameter has no gradient node (built under no_grad?)")
    return node.next_functions[0][0]


def _consumers(roots: list[Node | None]) -> dict[Node, list[Node]]:
    """node -> the nodes whose backward feeds it (one step towards the outputs), for every node reachable from
    `roots` (the outputs' nodes). The roots themselves are keys only when another root feeds them."""
    out: dict[Node, list[Node]] = {}
    todo = deque(dict.fromkeys(r for r in roots if r is not None))
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in out:
                out[nxt] = []
                todo.append(nxt)
            out[nxt].append(node)
    return out


def _towards_outputs(starts: list[Node | None], stop: set[Node], consumers: dict[Node, list[Node]]):
    """Walk from `starts` towards the outputs; the walk ends at nodes in `stop`. Returns (the nodes walked, the
    nodes of `stop` met)."""
    seen = set(s for s in starts if s is not None)
    met: set[Node] = set()
    todo = deque(seen)
    while todo:
        for nxt in consumers.get(todo.popleft(), ()):
            if nxt in seen:
                continue
            if nxt in stop:
                met.add(nxt)
                continue
            seen.add(nxt)
            todo.append(nxt)
    return seen, met


def _input_grads(outputs, inputs, grad_outputs) -> tuple:
    """torch.autograd.grad of `outputs` to those `inputs` that are tensors requiring grad (None elsewhere and for
    inputs the outputs do not use), keeping the graph for the weight pass."""
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [None] * len(inputs)
    if wanted:
        got = torch.autograd.grad(outputs, [inputs[i] for i in wanted], grad_outputs, retain_graph=True,
                                  allow_unused=True)
        for i, g in zip(wanted, got):
            grads[i] = g
    return tuple(grads)


class ContiguousGrad(torch.autograd.Function):
    """Identity on a received tensor whose gradient, the stage's input gradient, leaves contiguous: the sender
    reads it with gloo's send, which refuses a strided tensor (a received KV entry read through a transpose, say,
    gets a transposed gradient). Returns an alias (no copy forward; a copy backward only when needed)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Tie(torch.autograd.Function):
    """Identity on a stage output t that also takes a received tensor `anchor` (which gets no gradient from it), so that
    autograd sees t depend on the stage inputs and the zero-bubble input pass saves the gradient t receives, the joint
    for every parameter path that reaches t without touching the stage inputs (a source layer's indexer keys: see
    docs/parallelism.md#zero-bubble-split-backward). Returns an alias of t that is not a view (the zero-bubble backward
    detaches outputs in place; t itself stays in the graph)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ZeroGrad(torch.autograd.Function):
    """Identity on a stage output t that hands an exact zero gradient to each of `received` (the float carriers of
    a stage's integer inputs, trainer/parallel/pipeline.py `_FLOAT_WIRE`, which the stage reads only through their
    detached bytes): every received tensor then has a gradient for the stage to send back, as torch 2.11's
    PipelineStage requires, in the full and in the split backward alike. Returns an alias of t that is not a view."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, *received: torch.Tensor) -> torch.Tensor:
        ctx.received = [(r.shape, r.dtype, r.device) for r in received]
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.received))


class ZeroBubbleStage(PipelineStage):
    """torch's PipelineStage with our own zero-bubble split backward (docs/parallelism.md#zero-bubble-split-backward):
    the input pass (`_backward_input`) and the weight pass (`_backward_weight`) replace pipelining/_backward.py's
    stage_backward_input / stage_backward_weight; the full backward (1F1B, Interleaved1F1B, and the first stage's weight
    pass under a zero-bubble schedule) is torch's.

    fill_input_grads (set by pipeline.build_pipeline under its float wire, i.e. on torch 2.11): a received tensor
    whose input gradient is None gets zeros instead, as torch 2.11's PipelineStage sends a gradient back for every
    received tensor (it raises on None; 2.13 sends zeros itself)."""

    fill_input_grads = False

    def _get_init_p2p_neighbors_ops(self) -> list:
        """torch's warm-up sends and receives between neighbouring stages, less those to this rank itself (the two
        middle stages of a V schedule share a rank and hand tensors over locally): torch 2.11's gloo has no pair to
        its own rank ("Pair is not connected") and fails the first step of ZBVZeroBubble."""
        ops = super()._get_init_p2p_neighbors_ops()
        if not OLD_PIPELINING:
            return ops
        me = dist.get_rank(self.group)
        return [op for op in ops if op.group_peer != me]

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        grads, state = self._backward(backward_type, bwd_kwargs, last_backward)
        if self.fill_input_grads and backward_type != "weight" and not self.is_first:
            grads = tuple(torch.zeros_like(v) if g is None and isinstance(v, torch.Tensor) else g
                          for g, v in zip(grads, bwd_kwargs["input_values"]))
        return grads, state

    def _backward(self, backward_type, bwd_kwargs: dict, last_backward: bool):
        if backward_type not in ("input", "weight"):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.submod, DistributedDataParallel):
            raise NotImplementedError("pipeline: the zero-bubble backward of a DDP-wrapped stage")
        if isinstance(self.submod, FSDPModule):  # as PipelineStage does: gradients reduce after the last backward
            self.submod.set_is_last_backward(False)
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(False)
        if backward_type == "input":
            return _backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                   bwd_kwargs["input_values"], self.submod.parameters())
        return _backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"]), None


def _backward_input(outputs, output_grads, input_values, weights):
    """The input pass: gradients of the stage inputs (set as their .grad and returned, as torch's
    stage_backward_input does), saving for the weight pass the gradients entering every node of the
    input-to-output graph that a parameter's own subgraph joins ("the joints"). Returns (input gradients, [state])."""
    # (output, its gradient): the loss and ones on the last stage; elsewhere those with a gradient (None: zero)
    pairs = [(t, torch.ones_like(t) if output_grads is None else output_grads[i]) for i, t in enumerate(outputs)
             if t.requires_grad or t.grad_fn is not None]
    pairs = [(t, g) for t, g in pairs if g is not None]
    consumers = _consumers([_node_of(t) for t, _ in pairs])
    weight_fns = [f for f in map(_node_of, weights) if f is not None and f in consumers]
    on_path, _ = _towards_outputs([_node_of(t) for t in input_values if isinstance(t, torch.Tensor)], set(),
                                  consumers)
    # one search from all parameters at once, stopping at the first node on the input-to-output path: the joints
    _, joints = _towards_outputs(weight_fns, on_path, consumers)
    saved: dict = {}

    def keep(node):
        def hook(grad_outputs):
            saved[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keep(node)) for node in joints]
    try:
        if pairs:
            dinputs = _input_grads([t for t, _ in pairs], input_values, [g for _, g in pairs])
        else:
            dinputs = tuple(None for _ in input_values)
    finally:
        for h in handles:
            h.remove()
    for inp, d in zip(input_values, dinputs):
        if isinstance(inp, torch.Tensor) and d is not None:
            inp.grad = d if inp.grad is None else inp.grad + d
    # The outputs stay attached until the weight pass: a joint that is a custom autograd.Function's node lives only
    # as long as the graph above it (its Python object holds it weakly on torch 2.11, where detaching the outputs
    # here, as torch's own input pass does, freed such joints before the weight pass reached them).
    return dinputs, [{"saved": saved, "outputs": list(outputs)}]


def _backward_weight(weights, state) -> tuple:
    """The weight pass: one autograd call from every joint, fed the gradient the input pass saved there, to every
    parameter; each joint's own gradient is clamped to the saved one (a joint downstream of another would otherwise
    count the other's share twice). One call, not torch's parameter groups: see
    docs/parallelism.md#zero-bubble-split-backward."""
    (state,) = state
    saved = state.pop("saved")
    outputs = state.pop("outputs")
    edges, grads = [], []
    for node, grad_outputs in saved.items():
        for i, g in enumerate(grad_outputs):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
    weights = [w for w in weights if w.requires_grad]
    accs = [_node_of(w) for w in weights]
    if not edges:
        _release(outputs)
        return tuple(w.grad for w in weights)
    handles = [node.register_prehook(lambda _, g=grad_outputs: g) for node, grad_outputs in saved.items()]
    try:
        dws = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accs], grads, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
        _release(outputs)
    for w, dw in zip(weights, dws):
        if dw is not None:
            if w.grad is None:
                w.grad = dw
            else:
                w.grad += dw
    return tuple(w.grad for w in weights)


def _release(outputs) -> None:
    """Detach the stage outputs in place, so that autograd frees the graph that led to them."""
    for t in outputs:
        t.detach_()

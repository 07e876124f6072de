"""The built-in generation engine: batched prefill + decode on the model's inference cache (model/cache.py).

A batch of requests (any prompt lengths) shares one cache: each request is prefilled into its own row (through the
prefix cache when there is one), then every row decodes together, a position per row. A request stops at one of its
stop tokens or after max_new_tokens; a row that has stopped keeps decoding its last token until the batch ends
(its output is dropped; the cache is sized for it), which keeps the batch's shapes fixed.

Decode steps run `model.serving.decode_step` (`model(ids, cache=..., static=True)`): static shapes, no host
synchronisation, every KV source's whole capacity presented and masked, so `Engine(cuda_graph=True)` can capture the
step once per batch and replay it per token (one process, a CUDA device; not yet run on a GPU: issue 21). The checks
such a step cannot make (token ids in range, room in the cache) are made here, on the prompts, before the prefill.
A batch that keeps routing records (R3) decodes through the dynamic serving forward, which returns them.

Per generated token the completion has its log-prob under the sampling distribution and under the model's
(trainer/engine/sampling.py) and, with `return_routing`, the routing records of every token the model read
(prompt and completion but the last: model/routing.py): the training forward given them replays the rollout's
top-k and expert choices (RL's R3 / index replay).

Bad requests (an empty prompt, ids outside the vocabulary, a prompt + max_new_tokens longer than max_len, an effort
outside 1..100) get a completion with `error` set and finish_reason "error"; the other requests of the batch run as
if it were not there.

Distributed (rollouts colocated with training, each data rank with its own requests): every model call is a
collective under FSDP (the weights' all-gather), expert parallelism (the all-to-all) and tensor parallelism, so the
ranks call the model in lockstep: before each call every rank says whether it has one (one all-reduce), and a rank
that has none while another has makes a one-token call on a scratch cache. Pipeline and context parallelism are
refused (a rank holds only some layers / a chunk of each sequence); so is sequence parallelism, whose activations
are split along the tokens (one token a decode step).

`RolloutBackend` is the seam a stage generates through: `generate(requests, on_token=None) -> completions` and
`sync_weights(module)` after an optimiser step. The built-in `Engine` reads the training model's own parameters
(nothing to sync). An external server (vLLM or SGLang, which load Hugging Face-format weights) plugs in as a backend
whose sync_weights writes the weights in HF format (issue 18's exporter) and asks the server to reload them, and
whose generate sends the requests (token ids, sampling settings, the seed) and maps the server's answer (tokens,
log-probs; vLLM can return routed experts for R3) into Completions. docs/generation.md says more.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from trainer.engine.sampling import SamplingParams, sample

__all__ = ["Request", "Completion", "RolloutBackend", "Engine", "PromptFormat", "serving_module"]


def serving_module(model) -> torch.nn.Module:
    """The module the engine calls: a Transformer, or a trainer ParallelModel's (checked: the engine needs the whole
    model on every rank and whole sequences). Refusals name the setting."""
    pm = model if hasattr(model, "dims") and hasattr(model, "module") else None
    module = model if pm is None else pm.module
    if pm is not None:
        for key, value in (("pp", pm.dims.pp), ("cp", pm.dims.cp)):
            if value > 1:
                what = "pipeline" if key == "pp" else "context"
                raise ValueError(f"the generation engine does not run under {what} parallelism (parallel.{key}="
                                 f"{value}): a rank holds only {'some layers' if key == 'pp' else 'a chunk of each sequence'}")
        if pm.sequence_parallel:
            raise ValueError("the generation engine does not run under sequence parallelism "
                             "(parallel.sequence_parallel=true splits the tokens; a decode step has one)")
        if pm.engram is not None:
            raise ValueError("the generation engine does not run with parallel.engram_shard=true yet (the rows' "
                             "exchange is prefetched per training forward)")
    if module.__class__.__name__ == "StageGroup" or not hasattr(module, "new_cache"):
        raise ValueError("the generation engine needs the whole model on every rank: it does not run under pipeline "
                         "parallelism (parallel.pp > 1)")
    from model.attention import SequenceShard

    if getattr(module, "sequence_shard", SequenceShard()) != SequenceShard():
        raise ValueError("the generation engine does not run under context parallelism (parallel.cp > 1)")
    return module


@dataclass
class PromptFormat:
    """How a text prompt and its reasoning effort (1..100; SPEC 2: the API tiers max/high/low are 100/75/50) become
    the text the model reads: by default the chat template's generation prompt of one user turn (data/chat.py,
    docs/chat_template.md), its markers special tokens of the tokenizer, as the SFT and RL stages train on it."""

    template: str = "<bos><|effort|>{effort}\n<|user|>{prompt}<|end|><|assistant|>"

    def render(self, prompt: str, effort: int) -> str:
        return self.template.format(prompt=prompt, effort=effort)


@dataclass
class Request:
    prompt: list[int] | str
    """token ids, or text (rendered with the engine's PromptFormat and tokenized)"""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    effort: int = 100
    """reasoning effort 1..100"""
    request_id: object = None
    return_routing: bool = False


@dataclass
class Completion:
    request_id: object
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # under the sampling distribution
    model_logprobs: list[float] = field(default_factory=list)  # under the model's distribution (temperature 1)
    finish_reason: str = "length"  # "stop" (a stop token, included), "length" (max_new_tokens), "error"
    effort: int = 100
    error: str | None = None
    routing: object | None = None  # RoutingRecords over prompt_ids + token_ids[:-1] (return_routing)
    text: str | None = None  # the completion decoded (with a tokenizer)


class RolloutBackend(Protocol):
    def generate(self, requests: list[Request], on_token: Callable | None = None) -> list[Completion]: ...

    def sync_weights(self, module: torch.nn.Module) -> None: ...


class _Lockstep:
    """Keeps the ranks' model calls paired one to one (see the module docstring). One process: no-op."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None
        self.device = device

    def any_calls(self, mine: bool) -> bool:
        if self.dist is None:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.device)
        self.dist.all_reduce(flag)
        return bool(flag.item() > 0)


class Engine:
    """The built-in RolloutBackend. model: the Transformer, or the trainer's ParallelModel (`serving_module`)."""

    def __init__(self, model, *, max_batch: int = 32, max_len: int = 4096, replay: str = "halo",
                 prefix_cache=None, tokenizer=None, prompt_format: PromptFormat | None = None,
                 cuda_graph: bool = False):
        model = serving_module(model)
        self.model, self.max_batch, self.max_len, self.replay = model, max_batch, max_len, replay
        self.cuda_graph = cuda_graph
        if cuda_graph:
            from torch.distributed.tensor import DTensor

            if model.embed.weight.device.type != "cuda":
                raise ValueError("Engine(cuda_graph=True) needs the model on a CUDA device")
            if torch.distributed.is_initialized() or any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError("Engine(cuda_graph=True) runs one process with a plain (unsharded) model: a "
                                 "parallel plan's collectives are not captured")
        self.prefix_cache = prefix_cache
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format or PromptFormat()
        self.device = model.embed.weight.device
        self.lockstep = _Lockstep(self.device)
        self._scratch = None
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}

    def sync_weights(self, module: torch.nn.Module) -> None:
        """The engine computes with the training module's own parameters: nothing to copy."""

    # -- one model call, paired across ranks ---------------------------------------------------------------------
    def _call(self, ids: torch.Tensor, cache, keep_routing: bool):
        self.lockstep.any_calls(True)
        out = self.model(ids.to(self.device), cache=cache, outputs=True, keep_routing=keep_routing)
        return out.logits, out.routing  # (plain: model/serving.py gathers vocab-sharded logits)

    def _decode(self, ids: torch.Tensor, cache, keep_routing: bool, graph: "_DecodeGraph | None"):
        """One token per row: the static-shape decode step (model.serving.decode_step), replayed from its CUDA graph
        when there is one; the dynamic serving forward when routing records are kept (R3)."""
        if keep_routing:
            return self._call(ids, cache, True)
        self.lockstep.any_calls(True)
        ids = ids.to(self.device)
        return (graph(ids) if graph is not None else self.model(ids, cache=cache, static=True)), None

    def _drain(self) -> None:
        """After this rank's last call: match every call the other ranks still make with a one-token call."""
        if self.lockstep.dist is None:
            return
        while self.lockstep.any_calls(False):
            if self._scratch is None:
                self._scratch = self.model.new_cache(1, 1, replay="none")
            self._scratch.reset()
            self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=self._scratch)

    # -- requests ----------------------------------------------------------------------------------------------------
    def _prompt_ids(self, req: Request) -> list[int]:
        if isinstance(req.prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs an engine with a tokenizer (or pass token ids)")
            return self.tokenizer.encode(self.prompt_format.render(req.prompt, req.effort)).ids
        return [int(t) for t in req.prompt]

    def _problem(self, req: Request, ids: list[int]) -> str | None:
        V = self.model.cfg.vocab_size
        if not ids:
            return "empty prompt"
        if not 1 <= req.effort <= 100:
            return f"reasoning effort {req.effort} is outside 1..100"
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {V})"
        n = len(ids) + req.sampling.max_new_tokens
        if n > self.max_len:
            return (f"prompt of {len(ids)} tokens + max_new_tokens={req.sampling.max_new_tokens} exceeds the "
                    f"engine's max_len={self.max_len}")
        return None

    @torch.no_grad()
    def generate(self, requests: list[Request], on_token: Callable | None = None) -> list[Completion]:
        """Completions in the order of `requests`. on_token(request_id, token_id, logprob) streams each token."""
        done: list[Completion | None] = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            try:
                ids = self._prompt_ids(req)
                problem = self._problem(req, ids)
            except ValueError as e:
                ids, problem = [], str(e)
            if problem is not None:
                done[i] = Completion(req.request_id, ids, finish_reason="error", effort=req.effort,
                                     error=f"request {req.request_id!r}: {problem}")
            else:
                todo.append((i, req, ids))
        for start in range(0, len(todo), self.max_batch):
            chunk = todo[start:start + self.max_batch]
            for (i, _, _), comp in zip(chunk, self._generate_batch(chunk, on_token)):
                done[i] = comp
        self._drain()
        return done

    def _generate_batch(self, chunk, on_token) -> list[Completion]:
        B = len(chunk)
        keep = any(req.return_routing for _, req, _ in chunk)
        max_len = max(len(ids) for _, _, ids in chunk) + max(req.sampling.max_new_tokens for _, req, _ in chunk)
        cache = self.model.new_cache(B, max_len, replay=self.replay)
        comps = [Completion(req.request_id, ids, effort=req.effort) for _, req, ids in chunk]
        records: list[list] = [[] for _ in range(B)]
        params = [req.sampling for _, req, _ in chunk]
        gens = [torch.Generator(device="cpu").manual_seed(int(p.seed)) for p in params]
        last = []
        t0 = time.perf_counter()
        for b, (_, req, ids) in enumerate(chunk):
            logits, rec = self._prefill(cache.rows(b, b + 1), ids, keep)
            last.append(logits[:, -1])
            if keep:
                records[b].extend(rec)
            self.stats["prefill_tokens"] += len(ids)
        self.stats["prefill_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = torch.cat(last)
        active = [True] * B
        graph = _DecodeGraph(self.model, cache) if self.cuda_graph and not keep else None
        while True:
            tok, lp, mlp = sample(logits.float(), params, gens)
            for b in range(B):
                if not active[b]:
                    continue
                c, t = comps[b], int(tok[b])
                c.token_ids.append(t)
                c.logprobs.append(float(lp[b]))
                c.model_logprobs.append(float(mlp[b]))
                if on_token is not None:
                    on_token(c.request_id, t, float(lp[b]))
                if t in params[b].stop_token_ids:
                    c.finish_reason, active[b] = "stop", False
                elif len(c.token_ids) >= params[b].max_new_tokens:
                    c.finish_reason, active[b] = "length", False
            if not any(active):
                break
            feed = torch.tensor([[c.token_ids[-1]] for c in comps])
            step, rec = self._decode(feed, cache, keep, graph)
            logits = step[:, -1]
            self.stats["decode_tokens"] += sum(active)
            if keep:
                for b in range(B):
                    if active[b]:
                        records[b].append(rec.rows(b, b + 1))
        self.stats["decode_s"] += time.perf_counter() - t0
        if keep:
            from model.routing import RoutingRecords

            for b, (_, req, _) in enumerate(chunk):
                if req.return_routing:
                    comps[b].routing = RoutingRecords.cat(records[b], dim=1)
        if self.tokenizer is not None:
            for c in comps:
                c.text = self.tokenizer.decode(c.token_ids)
        return comps

    def _prefill(self, row_cache, ids: list[int], keep: bool):
        """Prefill one request into its cache row: through the prefix cache when there is one (a hit restores the
        cached global KV and, while it lives, the SWA state; else the last `window` hit tokens are replayed).
        Returns (the logits of the last call, the routing records of the prompt's rows)."""
        ids_t = torch.tensor([ids], dtype=torch.long)
        pc = self.prefix_cache
        if pc is None:
            logits, rec = self._call(ids_t, row_cache, keep)
            return logits, [rec] if keep else []
        start = pc.restore(row_cache, ids)
        boundary = pc.boundary(len(ids))  # block-aligned, < len(ids): its SWA state is worth keeping
        records = [_no_records(self.model, start)] if keep and start > 0 else []
        logits = None
        for a, b in ((start, boundary), (max(start, boundary), len(ids))):
            if b <= a:
                continue
            logits, rec = self._call(ids_t[:, a:b], row_cache, keep)
            if keep:
                records.append(rec)
            if b == boundary:
                pc.insert(row_cache, ids, boundary)
        return logits, records


class _DecodeGraph:
    """The decode step of one cache captured as a CUDA graph (Engine(cuda_graph=True)): a token per row is copied
    into the graph's input and the graph replayed, so a decode step costs one launch instead of the model's
    thousands. The step is `decode_step` (static shapes, no host synchronisation, the cache preallocated); it is
    warmed up on a scratch cache of the same shapes (kernels compiled, workspaces allocated: the warm-up runs, the
    capture only records) and captured on the batch's cache, whose buffers stay where they are for its life."""

    def __init__(self, model, cache):
        self.ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.lengths.device)
        scratch = model.new_cache(cache.batch_size, cache.max_len, replay="none")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _uncached_autocast():
            for _ in range(2):
                model(self.ids, cache=scratch, static=True)
        torch.cuda.current_stream().wait_stream(side)
        del scratch
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), _uncached_autocast():
            self.logits = model(self.ids, cache=cache, static=True)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits.clone()


def _uncached_autocast():
    """The caller's autocast, without its cache of cast weights: a captured graph would keep reading a cast copy
    that the cache frees when the autocast region ends (torch's CUDA-graph notes)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def _no_records(model, n: int):
    """Records of n rows the engine did not compute (restored from the prefix cache): -1, the forward chooses."""
    from model.routing import RoutingRecords

    ke = model.cfg.moe.experts_per_token
    return RoutingRecords({s.index: torch.full((1, n, 1), -1, dtype=torch.int32) for s in model.plan
                           if s.owns_indexer},
                          {s.index: torch.full((1, n, ke), -1, dtype=torch.long) for s in model.plan})

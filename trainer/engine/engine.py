"""The built-in generation engine: batched prefill + decode on the model's inference cache (model/cache.py).

Contract: `Engine.generate(requests)` returns one `Completion` per `Request`, in order: the tokens, each with its
log-prob under the sampling distribution and under the model's, the finish reason (a stop token, max_new_tokens, or
"error" with `error` set for a bad request, which leaves the batch's other requests as they would be), and with
`return_routing` the routing records a training forward replays (R3). Each request is prefilled into its own cache
row (through the prefix cache when there is one), then all rows decode together with static shapes
(`model.serving.decode_step`, so `cuda_graph=True` can capture it). With a drafter (`drafter=`, `spec_tokens=`)
decoding is speculative (trainer/engine/spec_decode.py); under FSDP / EP / TP the ranks call the model in lockstep;
pipeline, context and sequence parallelism are refused. `RolloutBackend` is the seam a stage generates through
(`generate`, `sync_weights`).

Design and reasoning: docs/generation.md#the-engine-in-detail
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from model.forward import SequenceShard
from model.routing import RoutingRecords
from model.serving import compiled_decode_step, decode_step
from model.serving_decode import DECODE_KERNELS, check_decode_kernels
from trainer.engine.sampling import SamplingParams, sample
from trainer.engine.spec_decode import SpecDecoder

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
    """Keeps the ranks' model calls paired one to one (see docs/generation.md#the-engine-in-detail). One process:
    no-op."""

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
                 cuda_graph: bool = False, compile_decode: str | None = None, drafter=None,
                 spec_tokens: int | None = None, spec_schedule: str = "fixed", serving_kernels: str = "reference",
                 keep_graphs: int = 2):
        """compile_decode (equal to the op-by-op step in fp32 on an H100 at v41_tiny, as close under bf16 at
        v41_small; its graph's replay there 2x the op-by-op step's graph on the serving kernels: docs/generation.md):
        a torch.compile backend for the decode step
        (model.serving.compiled_decode_step; with cuda_graph, the compiled step is what the graph captures), None: the
        reference operations one by one. drafter: a model.dspark.DSpark of this model for speculative decoding
        (docs/generation.md#the-engine-in-detail); spec_tokens: the most drafts a step verifies (None: the drafter's
        block_size); spec_schedule: "fixed" (always spec_tokens) or "auto" (from the confidences and the measured cost:
        trainer/engine/speculative.py). serving_kernels: the decode step's kernels (model.serving.decode_step):
        "reference" (the default, every device), "triton" (attention and indexer on the cache's stored bytes,
        model/serving_decode.py; a CUDA device, or the CPU under TRITON_INTERPRET=1) or "auto" (triton on a CUDA
        device where the model can take it, else reference); `self.serving_kernels` says which it took.
        keep_graphs (with cuda_graph): how many captured decode graphs, each with its cache, the engine keeps between
        `generate` calls, most recently used first (0: one a call, dropped after it). Under cuda_graph every batch's
        cache is max_len tokens a row, so the calls of one batch size (an RL step's engine batches, one step after
        another) share one graph and one cache, cleared before each batch (`KVCache.clear`): one capture (and with
        compile_decode one compilation) for them all. Their memory stays allocated between calls:
        `release_graphs()`."""
        model = serving_module(model)
        self.model, self.max_batch, self.max_len, self.replay = model, max_batch, max_len, replay
        self.cuda_graph = cuda_graph
        self.compile_decode = compile_decode
        self.decode_step = None
        if serving_kernels not in DECODE_KERNELS + ("auto",):
            raise ValueError(f"Engine: serving_kernels must be one of {list(DECODE_KERNELS) + ['auto']}, got "
                             f"{serving_kernels!r}")
        if serving_kernels == "auto":
            device = model.embed.weight.device
            usable = device.type == "cuda" and check_decode_kernels(model.cfg, device) is None
            serving_kernels = "triton" if usable else "reference"
        self.serving_kernels = serving_kernels
        if serving_kernels == "triton":
            why = check_decode_kernels(model.cfg, model.embed.weight.device)
            if why:
                raise ValueError(f"Engine(serving_kernels='triton'): {why}")
        if compile_decode is not None:
            self.decode_step = compiled_decode_step(model, compile_decode, serving_kernels)
        elif serving_kernels == "triton":
            self.decode_step = functools.partial(decode_step, model, kernels=serving_kernels)
        if cuda_graph:
            from torch.distributed.tensor import DTensor

            if model.embed.weight.device.type != "cuda":
                raise ValueError("Engine(cuda_graph=True) needs the model on a CUDA device")
            if torch.distributed.is_initialized() or any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError("Engine(cuda_graph=True) runs one process with a plain (unsharded) model: a "
                                 "parallel plan's collectives are not captured")
        if not isinstance(keep_graphs, int) or keep_graphs < 0:
            raise ValueError(f"Engine: keep_graphs must be an int >= 0, got {keep_graphs!r}")
        self.keep_graphs = keep_graphs
        self._graphs: collections.OrderedDict = collections.OrderedDict()  # (B, max_len, keep) -> (cache, graph)
        self.prefix_cache = prefix_cache
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format or PromptFormat()
        self.device = model.embed.weight.device
        self.lockstep = _Lockstep(self.device)
        self._scratch = None
        self.spec = None
        if drafter is not None:
            from torch.distributed.tensor import DTensor

            if cuda_graph:
                raise ValueError("Engine(cuda_graph=True) does not take a drafter: a verify forward's length changes "
                                 "from step to step (spec_schedule=auto) and the cache rolls back")
            if self.lockstep.dist is not None or any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError("Engine(drafter=...) runs one process with a plain (unsharded) model: the drafter "
                                 "calls the backbone's embedding and head outside its forward")
            self.spec = SpecDecoder(model, drafter, spec_tokens, spec_schedule)
        elif spec_tokens is not None or spec_schedule != "fixed":
            raise ValueError(f"spec_tokens={spec_tokens!r} / spec_schedule={spec_schedule!r} need a drafter "
                             "(Engine(drafter=...))")
        # decode_row_forwards: the rows still generating, summed over decode forwards; tokens_per_forward:
        # decode_tokens / decode_row_forwards (1 without a drafter)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0,
                      "decode_forwards": 0, "decode_row_forwards": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                      "draft_s": 0.0, "tokens_per_forward": 0.0, "graphs_captured": 0, "graphs_reused": 0}

    def release_graphs(self) -> None:
        """Drop the kept decode graphs and their caches (their device memory goes back to the allocator)."""
        self._graphs.clear()

    def _batch_cache(self, B: int, max_len: int, keep: bool):
        """(cache, its captured graph or None) for a batch: under cuda_graph a kept pair of this shape, cleared, or a
        new max_len cache (graph None: `_decode_plain` captures one and keeps it); otherwise a new cache of the
        batch's own length."""
        spec = self.spec
        if not self.cuda_graph:
            return self.model.new_cache(B, max_len + (spec.spec_tokens if spec else 0), replay=self.replay,
                                        spec_tokens=spec.cache_tokens if spec else 0), None
        key = (B, self.max_len, keep)
        if key in self._graphs:
            self._graphs.move_to_end(key, last=False)
            cache, graph = self._graphs[key]
            cache.clear()
            self.stats["graphs_reused"] += 1
            return cache, graph
        return self.model.new_cache(B, self.max_len, replay=self.replay), None

    def _keep_graph(self, cache, graph, keep: bool) -> None:
        if self.keep_graphs == 0:
            return
        key = (cache.batch_size, cache.max_len, keep)  # _batch_cache's: a graph's cache is max_len rows long
        self._graphs[key] = (cache, graph)
        self._graphs.move_to_end(key, last=False)
        while len(self._graphs) > self.keep_graphs:
            self._graphs.popitem(last=True)

    def sync_weights(self, module: torch.nn.Module) -> None:
        """The engine computes with the training module's own parameters: nothing to copy."""

    # -- one model call, paired across ranks ---------------------------------------------------------------------
    def _call(self, ids: torch.Tensor, cache, keep_routing: bool):
        self.lockstep.any_calls(True)
        out = self.model(ids.to(self.device), cache=cache, outputs=True, keep_routing=keep_routing)
        return out.logits, out.routing  # (plain: model/serving.py gathers vocab-sharded logits)

    def _decode(self, ids: torch.Tensor, cache, keep_routing: bool, graph: "_DecodeGraph | None"):
        """One token per row: the static-shape decode step (model.serving.decode_step), replayed from its CUDA graph
        when there is one (routing records kept or not); without a graph, the dynamic serving forward when routing
        records are kept (R3)."""
        if graph is not None:
            self.lockstep.any_calls(True)
            return graph(ids.to(self.device)), graph.last_records()
        if keep_routing:
            return self._call(ids, cache, True)
        self.lockstep.any_calls(True)
        ids = ids.to(self.device)
        if self.decode_step is not None:
            return self.decode_step(ids, cache), None
        return self.model(ids, cache=cache, static=True), None

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
        if self.spec is not None and any(req.return_routing for req in requests):
            raise ValueError("return_routing=True is not supported with speculative decoding (Engine(drafter=...)): "
                             "generate those requests on an engine without a drafter")
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
        spec = self.spec
        max_len = max(len(ids) for _, _, ids in chunk) + max(req.sampling.max_new_tokens for _, req, _ in chunk)
        cache, graph = self._batch_cache(B, max_len, keep)
        comps = [Completion(req.request_id, ids, effort=req.effort) for _, req, ids in chunk]
        records: list[list] = [[] for _ in range(B)]
        params = [req.sampling for _, req, _ in chunk]
        gens = [torch.Generator(device="cpu").manual_seed(int(p.seed)) for p in params]

        def emit(b: int, token: int, lp: float, model_lp: float) -> bool:
            """Row b's next token into its completion (streamed); whether the row goes on."""
            c, p = comps[b], params[b]
            c.token_ids.append(token)
            c.logprobs.append(lp)
            c.model_logprobs.append(model_lp)
            if on_token is not None:
                on_token(c.request_id, token, lp)
            if token in p.stop_token_ids:
                c.finish_reason = "stop"
                return False
            if len(c.token_ids) >= p.max_new_tokens:
                c.finish_reason = "length"
                return False
            return True

        with spec.capture() if spec else contextlib.nullcontext() as means:
            ring = spec.new_ring(B) if spec else None
            last = []
            t0 = time.perf_counter()
            for b0, b1 in self._prefill_groups(chunk):
                def after_call(rows_cache, b0=b0):
                    spec.record_prefill(ring, b0, rows_cache, means)

                logits, rec = self._prefill(cache.rows(b0, b1), [ids for _, _, ids in chunk[b0:b1]], keep,
                                            after_call if spec else None)
                last.append(logits[:, -1])
                for b in range(b0, b1) if keep else ():
                    records[b].extend(r.rows(b - b0, b - b0 + 1) for r in rec)
                self.stats["prefill_tokens"] += sum(len(ids) for _, _, ids in chunk[b0:b1])
            self.stats["prefill_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            tok, lp, mlp = sample(torch.cat(last).float(), params, gens)
            active = [emit(b, int(tok[b]), float(lp[b]), float(mlp[b])) for b in range(B)]
            if spec is not None:
                spec.decode(cache, ring, means, tok.tolist(), params, gens, comps, active, emit,
                            lambda ids: self._call(ids, cache, False)[0], self.stats)
            else:
                self._decode_plain(cache, graph, active, comps, params, gens, records, keep, emit)
        self.stats["decode_s"] += time.perf_counter() - t0
        if self.stats["decode_row_forwards"]:
            self.stats["tokens_per_forward"] = self.stats["decode_tokens"] / self.stats["decode_row_forwards"]
        if keep:
            for b, (_, req, _) in enumerate(chunk):
                if req.return_routing:
                    comps[b].routing = RoutingRecords.cat(records[b], dim=1)
        if self.tokenizer is not None:
            for c in comps:
                c.text = self.tokenizer.decode(c.token_ids)
        return comps

    def _decode_plain(self, cache, graph, active, comps, params, gens, records, keep: bool, emit) -> None:
        """A token a row and step until every row has stopped (the first is emitted). graph: the cache's kept decode
        graph; None under cuda_graph: captured here (and kept)."""
        B = cache.batch_size
        if self.cuda_graph and graph is None:
            step = self.decode_step
            if keep:
                k = self.serving_kernels
                step = (compiled_decode_step(self.model, self.compile_decode, k, keep_routing=True)
                        if self.compile_decode else functools.partial(decode_step, self.model, kernels=k,
                                                                      keep_routing=True))
            graph = _DecodeGraph(self.model, cache, step, keep)
            self.stats["graphs_captured"] += 1
            self._keep_graph(cache, graph, keep)
        while any(active):
            feed = torch.tensor([[c.token_ids[-1]] for c in comps])
            step, rec = self._decode(feed, cache, keep, graph)
            self.stats["decode_tokens"] += sum(active)
            self.stats["decode_forwards"] += 1
            self.stats["decode_row_forwards"] += sum(active)
            if keep:
                for b in range(B):
                    if active[b]:
                        records[b].append(rec.rows(b, b + 1))
            tok, lp, mlp = sample(step[:, -1].float(), params, gens)
            for b in range(B):
                if active[b]:
                    active[b] = emit(b, int(tok[b]), float(lp[b]), float(mlp[b]))

    def _prefill_groups(self, chunk) -> list[tuple[int, int]]:
        """Rows [b0, b1) prefilled in one call: neighbours of one prompt length (an RL group's samples of a prompt),
        without a prefix cache (a row at a time); routing records are split by row after the call."""
        groups, b0 = [], 0
        while b0 < len(chunk):
            b1 = b0 + 1
            if self.prefix_cache is None:
                while b1 < len(chunk) and len(chunk[b1][2]) == len(chunk[b0][2]):
                    b1 += 1
            groups.append((b0, b1))
            b0 = b1
        return groups

    def _prefill(self, row_cache, prompts: list[list[int]], keep: bool, after_call=None):
        """Prefill requests of one prompt length into their cache rows (`row_cache`, a view): through the prefix
        cache when there is one (one request: a hit restores the cached global KV and, while it lives, the SWA state;
        else the last `window` hit tokens are replayed). after_call(row_cache) runs after each model call. Returns
        (the logits of the last call, the routing records of the prompt's rows)."""
        ids_t = torch.tensor(prompts, dtype=torch.long)
        pc = self.prefix_cache
        if pc is None:
            logits, rec = self._call(ids_t, row_cache, keep)
            if after_call is not None:
                after_call(row_cache)
            return logits, [rec] if keep else []
        (ids,) = prompts
        start = pc.restore(row_cache, ids)
        boundary = pc.boundary(len(ids))  # block-aligned, < len(ids): its SWA state is worth keeping
        records = [_no_records(self.model, start)] if keep and start > 0 else []
        logits = None
        for a, b in ((start, boundary), (max(start, boundary), len(ids))):
            if b <= a:
                continue
            logits, rec = self._call(ids_t[:, a:b], row_cache, keep)
            if after_call is not None:
                after_call(row_cache)
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
    capture only records) and captured on the batch's cache, whose buffers stay where they are for its life.
    step: the step to capture, (ids, cache) -> logits (model.serving.compiled_decode_step); None: the model's.
    keep: the step returns (logits, RoutingRecords) (decode_step's keep_routing), replayed with the records too.
    A call returns a copy of the logits; `last_records()` copies of that replay's records (None without keep)."""

    def __init__(self, model, cache, step=None, keep: bool = False):
        step = step or (lambda ids, c: model(ids, cache=c, static=True))
        self.ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.lengths.device)
        scratch = model.new_cache(cache.batch_size, cache.max_len, replay="none")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _uncached_autocast():
            for _ in range(2):
                step(self.ids, scratch)
        torch.cuda.current_stream().wait_stream(side)
        del scratch
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), _uncached_autocast():
            out = step(self.ids, cache)
        self.logits, self.records = out if keep else (out, None)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.graph.replay()
        return self.logits.clone()

    def last_records(self) -> RoutingRecords | None:
        rec = self.records
        if rec is None:
            return None
        return RoutingRecords({k: v.clone() for k, v in rec.topk.items()}, {k: v.clone() for k, v in rec.experts.items()})


def _uncached_autocast():
    """The caller's autocast, without its cache of cast weights: a captured graph would keep reading a cast copy
    that the cache frees when the autocast region ends (torch's CUDA-graph notes)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def _no_records(model, n: int):
    """Records of n rows the engine did not compute (restored from the prefix cache): -1, the forward chooses."""
    ke = model.cfg.moe.experts_per_token
    return RoutingRecords({s.index: torch.full((1, n, 1), -1, dtype=torch.int32) for s in model.plan
                           if s.owns_indexer},
                          {s.index: torch.full((1, n, ke), -1, dtype=torch.long) for s in model.plan})

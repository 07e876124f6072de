"""An independent forward pass of the DeepSeek-V4.1 text model over a Hugging Face directory (config.json and
safetensors), written from the public layout as REFERENCE.md Part A states it (A1-A9, A11, A14) and from nothing
of Cedar's model, so that Cedar's forward can be checked against it.

Plain functions over a dict of fp32 tensors named as in the file. One full forward, positions 0..L-1, no padding
and no cache, with the reference's CACHE-path semantics (A14): each KV source REPLACES the shared compressed KV and
index keys, and each index source replaces the shared top-k bias. Every fake quantisation of A9 is applied, as the
reference applies it in every run (`Reference.quant`: off for the comparisons no rounding edge may decide, each call
recorded). Every top-k the forward takes (index picks, candidate blocks, experts) may be replaced by given ones (a
layer's `given`), so that it runs on another implementation's choices where a near-tie could go either way; its own
choices and the scores they came from are published beside them.

Shapes: B batch, L tokens, N mHC streams, C hidden size, H heads, D head dim, T compressed entries, I index heads,
E index head dim, X routed experts. S is the streams [B, L, N, C], as in A6.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

INF = float("inf")
_FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# -- numerics (A9) ---------------------------------------------------------------------------------------------------

def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^(e - 127 + [mantissa != 0]) from the fp32 bit fields: 2^ceil(log2 t) for a normal t, exactly."""
    bits = t.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).int()
    return (exponent << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """x [..., F] -> [..., F / block, block], or None when block does not divide F (then no quantisation)."""
    if x.shape[-1] % block:
        return None
    return x.unflatten(-1, (x.shape[-1] // block, block))


def _fp4_values(v: torch.Tensor) -> torch.Tensor:
    """E2M1 rounding of v (already scaled): ties at 0.75, 1.75, 3.5 round up, at 0.25, 1.25, 2.5, 5 round down, which
    is round-half-to-even on the codes. The sign comes from the sign bit; -0 gives 0."""
    a = v.abs().clamp(max=6.0)
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return torch.where(torch.signbit(v), -1.0, 1.0) * _FP4_GRID[code]


def fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Window KV: E4M3 values, a power-of-two scale per block of 32 (every channel, the RoPE tail included)."""
    xb = _blocks(x, block)
    if xb is None:
        return x
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = _pow2_ceil(amax * torch.tensor(1 / 448, dtype=torch.float32))  # multiply by the fp32 reciprocal
    v = (xb / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (v * scale).flatten(-2)


def fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Indexer q and k: E2M1 values, a power-of-two scale per block of 32."""
    xb = _blocks(x, block)
    if xb is None:
        return x
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126 * 6)
    scale = _pow2_ceil(amax * torch.tensor(1 / 6, dtype=torch.float32))
    return (_fp4_values(xb / scale) * scale).flatten(-2)


def fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Compressed (main) KV: E2M1 values, an E4M3 scale per block of 16 (round to nearest: it can round down, and the
    clamp to +-6 then bites)."""
    xb = _blocks(x, block)
    if xb is None:
        return x
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0 ** -9)
    scale = (amax / 6).to(torch.float8_e4m3fn).float()
    return (_fp4_values((xb / scale).clamp(-6.0, 6.0)) * scale).flatten(-2)


class Quantiser:
    """The A9 fake quantisations by site name ("fp8": window KV, "fp4": main KV, "fp4_ue8m0": indexer q and k); with
    `on` False each is the identity. Every call is appended to `calls` as (name, input, output)."""

    FORMATS = {"fp8": fp8_ue8m0, "fp4": fp4_e4m3, "fp4_ue8m0": fp4_ue8m0}

    def __init__(self, on: bool = True):
        self.on = on
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = self.FORMATS[name](x) if self.on else x
        self.calls.append((name, x, y))
        return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


# -- RoPE (A1) -------------------------------------------------------------------------------------------------------

def inv_freq(cfg: dict, compressed: bool) -> torch.Tensor:
    """The rope_dim / 2 frequencies: default RoPE (rope_theta) on ratio-0 layers; compress_rope_theta with YaRN on
    ratio >= 1 layers, attention_factor 1 (cos and sin unscaled)."""
    dim = cfg["qk_rope_head_dim"]
    base = cfg["compress_rope_theta"] if compressed else cfg["rope_theta"]
    theta = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scaling = cfg.get("rope_scaling") or {}
    if not compressed or not scaling:
        return theta
    factor, max_pos = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the pair index whose wavelength fits `rotations` in max_pos
        return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return theta * (1 - ramp) + theta / factor * ramp


def rope(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * len(freq) channels of x [B, L, ..., F] in interleaved pairs (2i, 2i+1) by pos[L] *
    freq[i]; `inverse` negates sin. The leading channels pass through."""
    n = 2 * freq.numel()
    angle = pos.float()[:, None] * freq  # [L, n / 2], fp32
    shape = (angle.shape[0],) + (1,) * (x.dim() - 3) + (angle.shape[1],)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    if inverse:
        sin = -sin
    even, odd = x[..., -n::2], x[..., -n + 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)
    return torch.cat((x[..., :-n], rotated), -1)


# -- mHC (A6) --------------------------------------------------------------------------------------------------------

def mhc_coefficients(w: dict, site: str, S: torch.Tensor, cfg: dict):
    """(pre [B, L, N], post [B, L, N], mix [B, L, N, N]) of a site from the streams S."""
    n, eps = cfg["hc_mult"], cfg["hc_eps"]
    fn, base, scale = w[f"hc_{site}_fn"], w[f"hc_{site}_base"], w[f"hc_{site}_scale"]
    u = rms_norm(S.flatten(-2), None, cfg["rms_norm_eps"])  # unweighted: one statistic per token
    m = u @ fn.T  # [B, L, 2N + N^2]
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    mix = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))  # mix[j, k]: row-major
    mix = mix.softmax(-1) + eps
    mix = mix / (mix.sum(-2, keepdim=True) + eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):  # the last step is a column normalisation
        mix = mix / (mix.sum(-1, keepdim=True) + eps)
        mix = mix / (mix.sum(-2, keepdim=True) + eps)
    return pre, post, mix


def collapse(S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * S).sum(-2)


def expand(y: torch.Tensor, S: torch.Tensor, post: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * y + sum_j mix[j, k] * S_j."""
    return post[..., None] * y[..., None, :] + torch.einsum("bljk,bljc->blkc", mix, S)


# -- Engram (A8) -----------------------------------------------------------------------------------------------------

def _primes_above(start: int, count: int) -> list[int]:
    out, c = [], start
    while len(out) < count:
        c += 1
        if c > 1 and all(c % d for d in range(2, math.isqrt(c) + 1)):
            out.append(c)
    return out


def engram_hash_plan(cfg: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """layer -> (multipliers [G], primes [G-1, Hg], offsets [G-1, Hg]), G = max n-gram, Hg = engram heads. Primes are
    consecutive above engram_vocab_size, handed out layer by layer in engram_layer_ids order, n-gram-major."""
    G, heads = cfg["engram_max_ngram_size"], cfg["engram_n_heads"]
    per_layer = (G - 1) * heads
    layers = cfg.get("engram_layer_ids") or []
    primes = _primes_above(cfg["engram_vocab_size"], per_layer * len(layers))
    bound = (2 ** 63 - 1) // cfg["engram_compressed_vocab_size"] // 2  # so that id * multiplier fits in int64
    plan = {}
    for k, layer in enumerate(layers):
        mine = primes[k * per_layer:(k + 1) * per_layer]
        draws = np.random.default_rng(10007 * layer).integers(0, bound, size=G)
        mult = torch.from_numpy(2 * draws + 1).long()
        offsets = np.concatenate(([0], np.cumsum(mine)[:-1]))
        plan[layer] = (mult, torch.tensor(mine).view(G - 1, heads), torch.from_numpy(offsets).long().view(G - 1, heads))
    want = cfg.get("engram_num_embeddings")
    got = [int(plan[layer][1].sum()) for layer in layers]
    if want is not None and list(want) != got:
        raise ValueError(f"engram_num_embeddings={want} but the primes give {got}")
    return plan


def engram_rows(ids: torch.Tensor, canonical: torch.Tensor, pad: int, mult, primes, offsets) -> torch.Tensor:
    """Table rows [B, L, (G-1) * Hg] of the n-grams ending at each position: shift s reads history[p - s]; a shift
    the history does not reach (p < s) reads pad. Rolling XOR of id * multiplier; mod the head's prime; + offset."""
    tok = canonical[ids]  # [B, L]
    L = tok.shape[1]
    rolling, cols = None, []
    for s in range(mult.numel()):
        shifted = torch.full_like(tok, pad)
        if s < L:
            shifted[:, s:] = tok[:, :L - s]
        product = shifted * mult[s]
        rolling = product if rolling is None else rolling ^ product
        if s >= 1:
            cols.append(torch.remainder(rolling[..., None], primes[s - 1]) + offsets[s - 1])
    return torch.cat(cols, -1)


def engram(w: dict, S: torch.Tensor, rows: torch.Tensor, cfg: dict) -> torch.Tensor:
    """S -> S + gate_k * value on each stream k."""
    n, C, eps = cfg["hc_mult"], cfg["hidden_size"], cfg["rms_norm_eps"]
    emb = w["engram.embed.weight"][rows].flatten(-2)  # [B, L, rows * head_dim]
    kv = (emb @ w["engram.wkv.weight"].T).unflatten(-1, (n + 1, C))
    key, value = kv[..., :n, :], kv[..., n, :]  # [B, L, N, C], [B, L, C]
    qk = w["engram.q_weight"] * w["engram.k_weight"]  # only their product is used
    dot = (S * qk * key).sum(-1)
    dot = dot * torch.rsqrt(S.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / math.sqrt(C)
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())  # [B, L, N]
    return S + gate[..., None] * value[..., None, :]


# -- attention (A2-A5) -----------------------------------------------------------------------------------------------

def compressor(w: dict, h: torch.Tensor, ratio: int, eps: float) -> torch.Tensor:
    """Pre-RoPE latent [B, T, D] of the non-overlapping groups of `ratio` tokens (a trailing partial group is dropped):
    per channel, a softmax over the group's tokens of the gate pools kv (fp32); ratio 1 has no gate."""
    kv = h @ w["attn.compressor.wkv.weight"].T
    if ratio > 1:
        T = h.shape[1] // ratio
        gate = (h @ w["attn.compressor.wgate.weight"].T)[:, :T * ratio].unflatten(1, (T, ratio))
        kv = (gate.softmax(2) * kv[:, :T * ratio].unflatten(1, (T, ratio))).sum(2)
    return rms_norm(kv, w["attn.compressor.norm.weight"], eps)


def indexer_scores(w: dict, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, freq, pos, cfg,
                   quant: Quantiser) -> torch.Tensor:
    """I [B, L, T] = sum_h w_h * ReLU(q_h . k_t) * E^-1/2, w = weights_proj(x) * I^-1/2."""
    heads, dim = cfg["index_n_heads"], cfg["index_head_dim"]
    q = (q_res @ w["attn.indexer.wq_b.weight"].T).unflatten(-1, (heads, dim))
    q = quant("fp4_ue8m0", rope(q, pos, freq))  # [B, L, I, E]
    weights = (x @ w["attn.indexer.weights_proj.weight"].T) * heads ** -0.5  # [B, L, I]; may be negative
    logits = torch.einsum("blie,bte->blit", q, keys).relu()
    return torch.einsum("blit,bli->blt", logits, weights) * dim ** -0.5


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [B, L, T]: the entries of the top candidate_topk_blocks blocks of candidate_block_size entries by block
    max, the block of each query's newest visible entry forced in; the block scores [B, L, nb] they were picked by)."""
    size = cfg["candidate_block_size"]
    T = scores.shape[-1]
    nb = -(-T // size)
    padded = F.pad(scores, (0, nb * size - T), value=-INF)
    block = padded.unflatten(-1, (nb, size)).amax(-1)  # [B, L, nb]
    newest = F.one_hot(((visible - 1) // size).clamp(min=0), nb).bool() & (visible >= 1)[:, None]  # [L, nb]
    block = block.masked_fill(newest, INF)
    top, idx = block.topk(min(cfg["candidate_topk_blocks"], nb), dim=-1)
    keep = torch.zeros_like(block, dtype=torch.bool).scatter(-1, idx, top > -INF)
    return keep.repeat_interleave(size, -1)[..., :T], block


def topk_bias(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, L, T]: 0 at the top-k picks (a pick scored -inf is dropped), -inf elsewhere."""
    top, idx = scores.topk(min(k, scores.shape[-1]), dim=-1, sorted=False)
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, top > -INF)
    return torch.zeros_like(scores).masked_fill(~picked, -INF)


def attention(w: dict, x: torch.Tensor, i: int, ratio: int, role: str, shared: dict, cfg: dict, quant: Quantiser,
              given: dict) -> torch.Tensor:
    """Layer i's attention on x [B, L, C] (post attn_norm). `shared` holds what the sources publish: the main KV and
    index keys (replaced by each KV source), the top-k bias (by each index source) and the candidate mask. An index
    source's own picks go to shared["picks"] (with "scores"), the pool builder's to shared["pool"] (with
    "block_scores"); given["selection"] / given["pool"] (bool [B, L, T]) replace them in what the layers use."""
    B, L, _ = x.shape
    H, D, eps = cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    freq = inv_freq(cfg, compressed=ratio > 0)
    pos = torch.arange(L)

    q_res = rms_norm(x @ w["attn.wq_a.weight"].T, w["attn.q_norm.weight"], eps)
    q = rope((q_res @ w["attn.wq_b.weight"].T).unflatten(-1, (H, D)), pos, freq)  # [B, L, H, D]; no per-head norm
    kv = rms_norm(x @ w["attn.wkv.weight"].T, w["attn.kv_norm.weight"], eps)
    kv = quant("fp8", rope(kv, pos, freq))  # [B, L, D], K = V

    if role == "full":  # this layer's compressor and index keys replace the shared ones (cache path)
        latent = compressor(w, x, ratio, eps)
        entry_pos = torch.arange(latent.shape[1]) * ratio  # each group at its first token
        shared["kv"] = quant("fp4", rope(latent, entry_pos, freq))
        keys = rms_norm(latent @ w["attn.indexer.wk.weight"].T, w["attn.indexer.k_norm.weight"], eps)
        shared["keys"] = quant("fp4_ue8m0", rope(keys, entry_pos, freq))
    if role in ("full", "reindex") and shared["kv"].shape[1] > 0:
        visible = (pos + 1) // ratio  # entries t < visible[p] are visible to query p
        scores = indexer_scores(w, x, q_res, shared["keys"], freq, pos, cfg, quant)
        scores = scores.masked_fill(torch.arange(scores.shape[-1]) >= visible[:, None], -INF)
        if role == "reindex" and "candidates" in shared:
            scores = scores.masked_fill(~shared["candidates"], -INF)
        if i == cfg["candidate_source_layer_id"]:  # its own top-k is not restricted
            shared["pool"], shared["block_scores"] = candidate_blocks(scores, visible, cfg)
            shared["candidates"] = given.get("pool", shared["pool"])
        shared["scores"], shared["picks"] = scores, topk_bias(scores, cfg["index_topk"]) == 0
        picks = given.get("selection", shared["picks"])
        shared["bias"] = torch.zeros_like(scores).masked_fill(~picks, -INF)

    window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg["sliding_window"])  # [L, L]
    logits = torch.einsum("blhd,bkd->bhlk", q, kv) * D ** -0.5
    logits = logits.masked_fill(~window, -INF)
    values = kv
    if ratio > 0 and "bias" in shared and shared["kv"].shape[1] > 0:
        # compressed entries after the window keys: no window rule, no removal of tokens the window also holds
        cmp = torch.einsum("blhd,btd->bhlt", q, shared["kv"]) * D ** -0.5 + shared["bias"][:, None]
        logits, values = torch.cat((logits, cmp), -1), torch.cat((kv, shared["kv"]), 1)
    sink = w["attn.attn_sink"].view(1, H, 1, 1).expand(B, H, L, 1)
    probs = torch.cat((logits, sink), -1).softmax(-1)[..., :-1]  # the sink takes its share, then is dropped
    out = torch.einsum("bhlk,bkd->blhd", probs, values)
    out = rope(out, pos, freq, inverse=True)  # back at the query's position

    groups = cfg["o_groups"]
    wo_a = w["attn.wo_a.weight"].unflatten(0, (groups, -1))  # [G, rank, H * D / G]: block diagonal
    y = torch.einsum("blgi,gri->blgr", out.reshape(B, L, groups, -1), wo_a)
    return y.flatten(-2) @ w["attn.wo_b.weight"].T


def layer_roles(cfg: dict) -> list[str]:
    """Per layer: swa (ratio 0), full (KV source: compressor + index keys), reindex (own indexer queries on the last
    keys), reuse (the last published KV and top-k)."""
    kv_sources, index_sources = set(cfg["kv_source_layer_ids"]), set(cfg["index_source_layer_ids"])
    roles = []
    for i, ratio in enumerate(cfg["compress_ratios"][:cfg["num_hidden_layers"]]):
        if ratio == 0:
            roles.append("swa")
        else:
            roles.append("full" if i in kv_sources else "reindex" if i in index_sources else "reuse")
    return roles


# -- MoE (A7) --------------------------------------------------------------------------------------------------------

def swiglu(x: torch.Tensor, w1, w2, w3, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = (x @ w1.T).clamp(max=limit), (x @ w3.T).clamp(-limit, limit)
    a = F.silu(gate) * up
    return (a if weight is None else a * weight[:, None]) @ w2.T  # the routing weight applies before w2


def moe(w: dict, x: torch.Tensor, cfg: dict, shared: dict, given: dict) -> torch.Tensor:
    """The routed experts (top-k by score + bias; given["experts"] [B, L, K] replaces the pick, whose own choice and
    selection scores go to shared["experts"] and shared["router_scores"]) plus the shared expert."""
    flat = x.flatten(0, -2)  # [B * L, C]
    logits = flat @ w["ffn.gate.weight"].T / cfg.get("gate_temp", 1.0)
    scores = F.softplus(logits).sqrt()  # [B * L, X]
    biased = scores + w["ffn.gate.bias"]  # the bias selects only
    _, chosen = biased.topk(cfg["num_experts_per_tok"], dim=-1)
    shared["experts"], shared["router_scores"] = chosen.view(*x.shape[:-1], -1), biased.view(*x.shape[:-1], -1)
    if "experts" in given:
        chosen = given["experts"].flatten(0, -2)
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg["routed_scaling_factor"]
    limit = cfg["swiglu_limit"]
    out = torch.zeros_like(flat)
    for e in range(cfg["n_routed_experts"]):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel():
            p = f"ffn.experts.{e}."
            out.index_add_(0, rows, swiglu(flat[rows], w[p + "w1.weight"], w[p + "w2.weight"], w[p + "w3.weight"],
                                           limit, weights[rows, slot]))
    if "ffn.shared_experts.w1.weight" in w:
        p = "ffn.shared_experts."
        out = out + swiglu(flat, w[p + "w1.weight"], w[p + "w2.weight"], w[p + "w3.weight"], limit)
    return out.view_as(x)


# -- the model -------------------------------------------------------------------------------------------------------

class Reference:
    """The text model of an HF directory: `logits`, or its steps (`embed`, `layer` by layer, `head`)."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor], canonical: torch.Tensor, quantise: bool = True):
        self.cfg = cfg
        self.quant = Quantiser(quantise)
        self.weights = weights
        self.layers = [{k[len(f"model.layers.{i}."):]: v for k, v in weights.items()
                        if k.startswith(f"model.layers.{i}.")} for i in range(cfg["num_hidden_layers"])]
        self.roles = layer_roles(cfg)
        self.canonical = canonical
        self.engram_plan = engram_hash_plan(cfg)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, given: dict[int, dict] | None = None,
               seen: dict[int, dict] | None = None) -> torch.Tensor:
        """ids [B, L] -> logits [B, L, V] (fp32), positions 0..L-1. given: layer -> the choices to use instead of its
        own (`layer`); seen: filled with layer -> its published own choices and their scores."""
        S, pre = self.embed(ids)
        shared: dict = {}  # what the sources publish, for this forward only
        for i in range(len(self.layers)):
            S, pre = self.layer(i, S, pre, ids, shared, (given or {}).get(i))
            if seen is not None:
                seen[i] = {k: shared.pop(k) for k in _OWN_CHOICES if k in shared}
        return self.head(S, pre)

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the streams S, each equal to the embedding; the first site's pre, one-hot on stream 0)."""
        n = self.cfg["hc_mult"]
        S = self.weights["model.embed.weight"][ids][:, :, None].repeat(1, 1, n, 1)
        pre = torch.zeros(n)
        pre[0] = 1.0
        return S, pre

    def layer(self, i: int, S: torch.Tensor, pre: torch.Tensor, ids: torch.Tensor, shared: dict,
              given: dict | None = None):
        """Layer i on the streams S and the previous site's pre; returns (S, this layer's FFN-site pre).
        `shared` carries what the KV and index sources publish to the layers after them, and this layer's own
        choices (`_OWN_CHOICES`); `given` the choices to use instead ("selection", "pool", "experts")."""
        cfg, w, given = self.cfg, self.layers[i], given or {}
        eps = cfg["rms_norm_eps"]
        if i in self.engram_plan:  # at layer entry, before the attention site's mHC
            pad = int(self.canonical[cfg["engram_pad_id"]])
            S = engram(w, S, engram_rows(ids, self.canonical, pad, *self.engram_plan[i]), cfg)
        pre_a, post_a, mix_a = mhc_coefficients(w, "attn", S, cfg)
        x = rms_norm(collapse(S, pre), w["attn_norm.weight"], eps)  # the previous site's pre: the one-site lag
        y = attention(w, x, i, cfg["compress_ratios"][i], self.roles[i], shared, cfg, self.quant, given)
        S = expand(y, S, post_a, mix_a)
        pre_f, post_f, mix_f = mhc_coefficients(w, "ffn", S, cfg)
        x = rms_norm(collapse(S, pre_a), w["ffn_norm.weight"], eps)
        return expand(moe(w, x, cfg, shared, given), S, post_f, mix_f), pre_f

    def head(self, S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Collapse with the last layer's FFN-site pre (no separate hyper-head), norm, lm_head; fp32 logits."""
        h = rms_norm(collapse(S, pre), self.weights["model.norm.weight"], self.cfg["rms_norm_eps"])
        return (h @ self.weights["lm_head.weight"].T).float()


_OWN_CHOICES = ("picks", "scores", "pool", "block_scores", "experts", "router_scores")


def _canonical_map(path: Path, cfg: dict) -> torch.Tensor:
    """Token id -> compressed id. Without a tokenizer.json the vocabulary is its own canonical form (the identity),
    which must then have engram_compressed_vocab_size ids."""
    if (path / "tokenizer.json").is_file():
        raise NotImplementedError("canonicalising a real tokenizer's vocabulary (A8) is not needed by the tests")
    if cfg.get("engram_layer_ids") and cfg["vocab_size"] != cfg["engram_compressed_vocab_size"]:
        raise ValueError(f"identity canonical map: vocab_size={cfg['vocab_size']} but "
                         f"engram_compressed_vocab_size={cfg['engram_compressed_vocab_size']}")
    return torch.arange(cfg["vocab_size"])


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """HF name -> fp32 tensor, without what the text model does not use (draft layers, vision)."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    raw = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for k, v in raw.items():
        if k.startswith(("mtp.", "model.mtp.", "vision.", "model.vision.", "aligner.", "model.aligner.")) \
                or k.endswith(("_scale_inv", ".engram.embed.scale")):
            continue
        if k.endswith(".engram.embed.weight") and v.dtype == torch.float8_e4m3fn:  # one scale per 32 channels
            v = (v.float().unflatten(-1, (-1, 32)) * raw[k[:-len("weight")] + "scale"].float()[..., None]).flatten(-2)
        elif k + "_scale_inv" in raw:
            raise NotImplementedError(f"{k}: FP8 block-scaled weights are not needed by the tests")
        out[k] = v.float()
    return out


def load(path, quantise: bool = True) -> Reference:
    """An HF directory (config.json, then model.safetensors or model.safetensors.index.json) -> Reference; quantise
    False turns the fake quantisations off."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg = dict(cfg.get("text_config") or cfg)
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus" or cfg.get("num_key_value_heads", 1) != 1:
        raise ValueError("only sqrtsoftplus routing and one KV head are modelled")
    cfg.setdefault("candidate_source_layer_id", cfg["kv_source_layer_ids"][-1])  # A1: the last KV source
    ratios = list(cfg["compress_ratios"])[:cfg["num_hidden_layers"]]
    cfg["compress_ratios"] = ratios + [0] * (cfg["num_hidden_layers"] - len(ratios))
    return Reference(cfg, _read_weights(path), _canonical_map(path, cfg), quantise)

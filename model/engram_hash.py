"""Engram addressing: canonical vocabulary, prime-sized sub-tables, hash multipliers and the n-gram hasher.

Shape legend: B batch, T tokens, V vocabulary, L engram layers, C sub-tables per layer (= num_orders * num_heads),
H hash heads per order.

Everything here is a pure function of token ids (REFERENCE A8, B5): no learned state, so the row ids of both Engram
layers can be computed once per forward, before any layer runs, and a prefetcher can pull the rows from host memory
while earlier layers compute.

Pieces, in the order the data flows:
- canonical vocabulary: token id -> canonical id (case/accent/whitespace variants share one id);
- dead mask: padding and image tokens break n-grams (SPEC 4, B5);
- per engram layer: one odd multiplier per shift, an XOR-rolled product over the window, reduced modulo a distinct
  prime per (order, head) and offset so that the layer's 24 sub-tables sit one after another in one table.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from model.config import EngramConfig, ModelConfig

# ---------------------------------------------------------------------------------------------------------------------
# Canonical vocabulary
# ---------------------------------------------------------------------------------------------------------------------

_REPLACEMENT_CHAR = "\ufffd"
# A private-use code point stands in for a bare " " while the text is stripped, so an all-whitespace token keeps
# the key " " instead of collapsing to "" (REFERENCE A8 "protect a bare ' ' -> strip -> restore").
_SPACE_SENTINEL = "\ue000"


@functools.lru_cache(maxsize=1)
def _normalizer():
    # The reference canonicaliser is the `tokenizers` normaliser pipeline (the protect/strip/restore step is how one
    # spells "don't strip a lone space" in it). Python's unicodedata differs from it on ~2.4k code points (Unicode
    # version of the combining-mark table, enclosing marks, final sigma, \x1c-\x1f as whitespace), which would change
    # the canonical ids, so we use the same library rather than re-deriving the steps by hand.
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),  # drops combining (Mn) marks, i.e. the accents NFD split off
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def canonical_key(text: str) -> str:
    """The normalised form of one decoded token; an empty result falls back to the original text."""
    key = _normalizer().normalize_str(text)
    return key if key else text


def build_canonical_vocab(
    decode: Callable[[int], str],
    vocab_size: int,
    raw_token: Callable[[int], str] | None = None,
) -> tuple[torch.Tensor, int]:
    """Map every token id to a canonical id (REFERENCE A8 "Canonical vocabulary").

    Each id is decoded alone. A decode containing U+FFFD (a partial UTF-8 byte sequence) is keyed by the raw token
    string instead, so distinct byte tokens stay distinct; without `raw_token` such ids get a key unique to the id.
    Canonical ids are numbered by first appearance in id order. Returns (map [V] int64, number of canonical ids).
    """
    keys: dict[Any, int] = {}
    mapping = torch.empty(vocab_size, dtype=torch.int64)
    for i in range(vocab_size):
        text = decode(i)
        if _REPLACEMENT_CHAR in text:
            key: Any = raw_token(i) if raw_token is not None else ("raw-id", i)
        else:
            key = canonical_key(text)
        mapping[i] = keys.setdefault(key, len(keys))
    return mapping, len(keys)


def canonical_vocab_from_tokenizer(tok: Any, vocab_size: int | None = None) -> tuple[torch.Tensor, int]:
    """`build_canonical_vocab` for a `tokenizers.Tokenizer` or anything with `.decode([id])`.

    Special tokens are kept (decoded with skip_special_tokens=False where the tokenizer takes it). When the model's
    vocab_size exceeds the tokenizer's, the extra ids (embedding padding, never seen in data) map to canonical id 0
    and do not count towards the returned number of canonical ids.
    """
    if hasattr(tok, "get_vocab_size"):
        n_tok = tok.get_vocab_size(with_added_tokens=True)
    else:
        n_tok = len(tok)
    vocab_size = n_tok if vocab_size is None else vocab_size
    if n_tok > vocab_size:
        raise ValueError(f"tokenizer has {n_tok} ids, more than vocab_size={vocab_size}")

    def decode(i: int) -> str:
        try:
            return tok.decode([i], skip_special_tokens=False)
        except TypeError:
            return tok.decode([i])

    raw = getattr(tok, "id_to_token", None) or getattr(tok, "convert_ids_to_tokens", None)
    mapping, n = build_canonical_vocab(decode, n_tok, raw)
    if vocab_size > n_tok:
        mapping = torch.cat([mapping, mapping.new_zeros(vocab_size - n_tok)])
    return mapping, n


# ---------------------------------------------------------------------------------------------------------------------
# Primes and multipliers
# ---------------------------------------------------------------------------------------------------------------------

# Deterministic Miller-Rabin: these bases decide primality exactly for every n < 3.3e24 (so all 64-bit n).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=16)
def _primes(num_layers: int, num_orders: int, num_heads: int, prime_start: int) -> tuple:
    """Consecutive primes above prime_start as nested tuples [layer][order][head] (hashable, so cacheable)."""
    nxt = prime_start
    out = []
    for _ in range(num_layers):
        per_order = []
        for _ in range(num_orders):
            heads = []
            for _ in range(num_heads):
                nxt += 1
                while not is_prime(nxt):
                    nxt += 1
                heads.append(nxt)
            per_order.append(tuple(heads))
        out.append(tuple(per_order))
    return tuple(out)


def engram_primes(cfg: EngramConfig) -> list[list[list[int]]]:
    """Sub-table sizes [engram layer][order 2..max_ngram][head]: consecutive primes above prime_start.

    The reference restarts its search at prime_start for every (layer, order) but skips primes already taken, which
    is the same as handing out consecutive primes in flat (layer, order, head) order, layers in `cfg.layers` order.
    """
    p = _primes(len(cfg.layers), cfg.max_ngram - 1, cfg.num_heads, cfg.prime_start)
    return [[list(h) for h in layer] for layer in p]


def engram_table_rows(cfg: EngramConfig, layer_id: int) -> int:
    """Rows of the table of the Engram at model layer `layer_id` (the sum of its primes)."""
    j = list(cfg.layers).index(layer_id)
    return sum(sum(h) for h in engram_primes(cfg)[j])


def engram_multipliers(cfg: EngramConfig, layer_id: int) -> list[int]:
    """One odd multiplier per shift 0..max_ngram-1 for model layer `layer_id` (REFERENCE A8 "Multipliers").

    The bound keeps canonical_id * multiplier (and so the XOR of such products) inside int64 for canonical ids below
    compressed_vocab_size; the factor 2 leaves room for 2v + 1. Odd multipliers are invertible mod 2^64.
    """
    bound = ((2**63 - 1) // cfg.compressed_vocab_size) // 2
    v = np.random.default_rng(10007 * layer_id).integers(0, bound, size=cfg.max_ngram, dtype=np.int64)
    return [2 * int(x) + 1 for x in v]


# ---------------------------------------------------------------------------------------------------------------------
# Hasher
# ---------------------------------------------------------------------------------------------------------------------


class EngramHasher(nn.Module):
    """Token ids -> table row ids for every Engram layer. No parameters; its buffers are derived, not learned.

    The canonical map defaults to the identity (no tokenizer: token id = canonical id). Then ids above
    compressed_vocab_size can overflow id * multiplier; int64 products wrap, which is still deterministic, and the
    floor-mod keeps every row inside its sub-table, so only the hash quality (not correctness) changes.

    Build on meta is fine: `init_buffers()` (called after `to_empty`) refills the buffers from host copies.
    """

    def __init__(self, cfg: ModelConfig, canonical_map: torch.Tensor | None = None):
        super().__init__()
        ecfg = cfg.engram
        if not ecfg.layers:
            raise ValueError("EngramHasher needs at least one layer in model.engram.layers")
        if not 0 <= ecfg.pad_id < cfg.vocab_size:
            raise ValueError(f"model.engram.pad_id={ecfg.pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
        self.layer_ids = list(ecfg.layers)
        self.max_ngram = ecfg.max_ngram
        self.vocab_size = cfg.vocab_size
        self.image_token_id = cfg.image_token_id
        self.pad_id = ecfg.pad_id
        self.compressed_vocab_size = ecfg.compressed_vocab_size

        primes = engram_primes(ecfg)
        flat = [[p for order in layer for p in order] for layer in primes]  # [L][C], column = (order-2)*H + head
        offsets = [np.cumsum([0] + row[:-1]).tolist() for row in flat]  # exclusive: each layer's table starts at 0
        self.num_columns = len(flat[0])
        mults = [engram_multipliers(ecfg, i) for i in self.layer_ids]  # [L][max_ngram]
        # Host copies are pinned to the CPU: under a meta device context they would otherwise be meta, with nothing
        # left for init_buffers to copy from.
        self._host = {
            "multipliers": torch.tensor(mults, dtype=torch.int64, device="cpu"),
            "primes": torch.tensor(flat, dtype=torch.int64, device="cpu"),
            "offsets": torch.tensor(offsets, dtype=torch.int64, device="cpu"),
        }
        self._host["canonical_map"] = self._check_map(canonical_map)
        for name, t in self._host.items():
            # Non-persistent: all are recomputed from the config (and the tokenizer), never loaded.
            self.register_buffer(name, torch.empty(t.shape, dtype=t.dtype), persistent=False)
        if not any(b.is_meta for b in self.buffers()):
            self.init_buffers()

    def _check_map(self, canonical_map: torch.Tensor | None) -> torch.Tensor:
        if canonical_map is None:
            return torch.arange(self.vocab_size, dtype=torch.int64, device="cpu")
        m = canonical_map.detach().to("cpu", torch.int64)
        if m.shape != (self.vocab_size,):
            raise ValueError(f"canonical map has shape {tuple(m.shape)}, expected ({self.vocab_size},)")
        if m.min() < 0 or m.max() >= self.compressed_vocab_size:
            raise ValueError(
                f"canonical ids must lie in [0, model.engram.compressed_vocab_size={self.compressed_vocab_size}), "
                f"got [{int(m.min())}, {int(m.max())}]"
            )
        return m

    def set_canonical_map(self, canonical_map: torch.Tensor) -> None:
        """Install a tokenizer's canonical map (from `canonical_vocab_from_tokenizer`) after the model is built."""
        self._host["canonical_map"] = self._check_map(canonical_map)
        if not self.canonical_map.is_meta:
            self.canonical_map.copy_(self._host["canonical_map"])

    @torch.no_grad()
    def init_buffers(self) -> None:
        for name, t in self._host.items():
            getattr(self, name).copy_(t)

    @property
    def pad_canonical_id(self) -> int:
        return int(self._host["canonical_map"][self.pad_id])

    def prepare(
        self,
        input_ids: torch.Tensor,
        image_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (canonical ids [B, T] int64, dead [B, T] bool).

        Dead = padding (attention_mask == 0), image placeholders (token == image_token_id) or an explicit image_mask.
        """
        canon = self.canonical_map[input_ids]
        dead = input_ids == self.image_token_id  # image_token_id = -1 (text only) matches nothing
        if image_mask is not None:
            dead = dead | image_mask.bool()
        if attention_mask is not None:
            dead = dead | ~attention_mask.bool()
        return canon, dead

    def forward(self, canon_ids: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
        """canon_ids [B, T] int64, dead [B, T] bool -> row ids [B, T, L, C] int64, layers in `layer_ids` order.

        REFERENCE A8 "N-grams"/"Hash": tok_s = id at p - s; a shift is blocked once p < s or any token at shift <= s
        is dead, and a blocked shift uses pad's canonical id. R_1 = P_0 ^ P_1, R_i = R_{i-1} ^ P_i with
        P_s = tok_s * M[s]; column (i-1)*H + h gets R_i mod prime + offset.
        """
        B, T = canon_ids.shape
        pad = torch.full_like(canon_ids, self.pad_canonical_id)
        blocked = torch.zeros_like(dead)
        H = self.num_columns // (self.max_ngram - 1)
        rolled = None  # [B, T, L]
        rows = []
        for s in range(self.max_ngram):
            # Shift right by s: position p sees p - s; the first s positions have no history (blocked).
            tok = torch.nn.functional.pad(canon_ids, (s, 0))[:, :T]
            gone = torch.nn.functional.pad(dead, (s, 0), value=True)[:, :T]
            blocked = blocked | gone
            tok = torch.where(blocked, pad, tok)
            prod = tok[..., None] * self.multipliers[:, s]  # [B, T, L]; int64, wraps only past compressed vocab
            rolled = prod if rolled is None else rolled ^ prod
            if s >= 1:
                cols = slice((s - 1) * H, s * H)
                # torch's % is a floor-mod: non-negative for a positive prime even if a wrapped product went negative.
                rows.append(rolled[..., None] % self.primes[:, cols] + self.offsets[:, cols])  # [B, T, L, H]
        return torch.cat(rows, dim=-1)

    def for_tokens(
        self,
        input_ids: torch.Tensor,
        image_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids [B, T] -> {model layer id: (row ids [B, T, C], dead [B, T])}, what each Engram layer consumes."""
        canon, dead = self.prepare(input_ids, image_mask, attention_mask)
        rows = self(canon, dead)
        return {layer: (rows[:, :, j], dead) for j, layer in enumerate(self.layer_ids)}

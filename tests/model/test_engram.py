"""Engram addressing and module (model/engram.py, model/engram_hash.py).

Proves:
- the flagship's prime-sized sub-tables reproduce REFERENCE A8 exactly (row counts 384,006,168 / 384,016,682, first
  and last primes per layer, consecutive and never reused), and the Miller-Rabin test agrees with a sieve;
- the hash multipliers of layers 1 and 14 equal A8's pinned numpy draws;
- row ids equal a straightforward pure-Python re-derivation of A8's n-gram hash, are identical across independent
  builds (and a meta build refilled by init_buffers), match pinned values, and always fall inside their own sub-table
  (also when ids overflow the multiplier bound);
- a dead (image or padding) token breaks exactly the n-grams that cross it, and its gate is 0;
- the canonical vocabulary merges case/accent/whitespace variants, keys U+FFFD tokens by their raw string, numbers ids
  by first appearance, with a fake decoder and with a trained byte-level BPE from `tokenizers`;

The rest of what it proves: docs/testing.md#engram-addressing-and-module
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import CSA2Config, EngramConfig, MHCConfig, ModelConfig
from model.engram import (
    Engram,
    EngramHasher,
    build_canonical_vocab,
    canonical_vocab_from_tokenizer,
    engram_multipliers,
    engram_primes,
    engram_table_rows,
)
from model.engram_hash import is_prime


def tiny_cfg(**engram) -> ModelConfig:
    e = dict(layers=[1, 2], max_ngram=4, num_heads=2, head_dim=8, prime_start=50, compressed_vocab_size=300, pad_id=2)
    e.update(engram)
    return ModelConfig(
        vocab_size=300, dim=16, num_layers=4, num_encoder_layers=2, image_token_id=299,
        csa2=CSA2Config(compress_ratios=[0] * 4), mhc=MHCConfig(num_streams=3), engram=EngramConfig(**e),
    )


# -- primes and multipliers --------------------------------------------------------------------------------------------

def test_is_prime_matches_sieve_and_known_cases():
    n = 20_000
    sieve = [True] * n
    sieve[0] = sieve[1] = False
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = [False] * len(sieve[i * i :: i])
    assert [is_prime(i) for i in range(n)] == sieve
    assert is_prime(2**61 - 1) and is_prime(18446744073709551557)  # largest 64-bit prime
    for carmichael in (561, 41041, 3215031751, 3825123056546413051):  # strong pseudoprimes to small bases
        assert not is_prime(carmichael)


def test_flagship_primes_match_reference():
    cfg = EngramConfig()
    primes = engram_primes(cfg)
    assert [len(p) for p in primes] == [3, 3] and all(len(h) == 8 for p in primes for h in p)
    flat = [x for layer in primes for order in layer for x in order]
    assert [sum(x for o in layer for x in o) for layer in primes] == [384_006_168, 384_016_682]
    assert engram_table_rows(cfg, 1) == 384_006_168 and engram_table_rows(cfg, 14) == 384_016_682
    assert (flat[0], flat[23], flat[24], flat[47]) == (16_000_057, 16_000_463, 16_000_477, 16_000_889)
    # Consecutive primes: every prime in (prime_start, last] is used, once, in increasing flat order.
    every = [p for p in range(cfg.prime_start + 1, flat[-1] + 1) if is_prime(p)]
    assert flat == every


def test_multipliers_match_reference():
    cfg = EngramConfig()
    assert engram_multipliers(cfg, 1) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram_multipliers(cfg, 14) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    bound = ((2**63 - 1) // cfg.compressed_vocab_size) // 2
    for m in engram_multipliers(cfg, 1) + engram_multipliers(cfg, 14):
        assert m % 2 == 1 and m < 2 * bound + 1
        assert (cfg.compressed_vocab_size - 1) * m < 2**63  # products of canonical ids stay inside int64


# -- hashing -----------------------------------------------------------------------------------------------------------

def reference_rows(cfg: ModelConfig, canon: list[int], dead: list[bool], pad: int) -> list[list[list[int]]]:
    """A8 in plain Python integers, one position at a time: [T][L][C]."""
    e = cfg.engram
    primes = engram_primes(e)
    out = []
    for p in range(len(canon)):
        per_layer = []
        for j, layer in enumerate(e.layers):
            mult = engram_multipliers(e, layer)
            toks, blocked = [], False
            for s in range(e.max_ngram):
                blocked = blocked or p < s or dead[p - s]
                toks.append(pad if blocked else canon[p - s])
            cols, offset, rolled = [], 0, (toks[0] * mult[0]) % 2**64
            for i in range(1, e.max_ngram):
                rolled ^= (toks[i] * mult[i]) % 2**64
                signed = rolled - 2**64 if rolled >= 2**63 else rolled  # int64 view, as the tensors hold it
                for prime in primes[j][i - 1]:
                    cols.append(signed % prime + offset)
                    offset += prime
            per_layer.append(cols)
        out.append(per_layer)
    return out


@pytest.mark.parametrize("high", [300, 2**40])  # 2**40: ids far past the multiplier bound, products wrap
def test_hash_matches_python_reference_and_stays_in_subtable(high):
    cfg = tiny_cfg()
    hasher = EngramHasher(cfg)
    g = torch.Generator().manual_seed(0)
    canon = torch.randint(0, high, (3, 13), generator=g)
    dead = torch.rand(3, 13, generator=g) < 0.15
    rows = hasher(canon, dead)
    C = 3 * 2
    assert rows.shape == (3, 13, 2, C) and rows.dtype == torch.int64
    for b in range(3):
        want = reference_rows(cfg, canon[b].tolist(), dead[b].tolist(), pad=hasher.pad_canonical_id)
        assert rows[b].tolist() == want
    # Each column lies in its own sub-table [offset, offset + prime); the layer's table holds them all.
    for j, layer in enumerate(cfg.engram.layers):
        flat = [p for order in engram_primes(cfg.engram)[j] for p in order]
        lo = torch.tensor([sum(flat[:c]) for c in range(C)])
        assert ((rows[:, :, j] >= lo) & (rows[:, :, j] < lo + torch.tensor(flat))).all()
        assert int(rows[:, :, j].max()) < engram_table_rows(cfg.engram, layer)


def test_flagship_hash_is_pinned_and_rebuild_stable():
    ids = torch.tensor([[0, 5, 17, 99091, 2, 1234, 42, 7]])
    a, b = EngramHasher(ModelConfig()), EngramHasher(ModelConfig())
    rows_a = a(*a.prepare(ids))
    assert torch.equal(rows_a, b(*b.prepare(ids)))
    # Position 3, layer 1: the 2-gram (17, 99091) etc.; column 0 is (99091*M0 ^ 17*M1) % 16000057, checked by hand.
    assert rows_a[0, 3, 0].tolist()[:4] == [379248, 18191193, 40143441, 48303286]
    assert rows_a[0, 3, 0].tolist()[-2:] == [352322499, 369009118]
    assert rows_a[0, 7, 1].tolist()[:3] == [11305274, 27334783, 40171751]
    assert rows_a[0, 7, 1].tolist()[-1] == 376446421
    # A meta build materialised with to_empty + init_buffers hashes identically.
    with torch.device("meta"):
        m = EngramHasher(ModelConfig())
    m.to_empty(device="cpu")
    m.init_buffers()
    assert torch.equal(m(*m.prepare(ids)), rows_a)


@pytest.mark.parametrize("how", ["image_token", "image_mask", "padding"])
def test_dead_token_breaks_exactly_its_ngrams(how):
    cfg = tiny_cfg()
    hasher = EngramHasher(cfg)
    torch.manual_seed(1)
    T, p, N = 16, 6, cfg.engram.max_ngram
    ids = torch.randint(3, 250, (1, T))
    clean = hasher(*hasher.prepare(ids))
    marked, image_mask, attention_mask = ids.clone(), None, None
    if how == "image_token":
        marked[0, p] = cfg.image_token_id
    elif how == "image_mask":
        image_mask = torch.zeros(1, T, dtype=torch.bool)
        image_mask[0, p] = True
    else:
        attention_mask = torch.ones(1, T, dtype=torch.long)
        attention_mask[0, p] = 0
    canon, dead = hasher.prepare(marked, image_mask, attention_mask)
    assert dead[0].nonzero().flatten().tolist() == [p]
    broken = hasher(canon, dead)
    assert torch.equal(broken[:, :p], clean[:, :p])
    assert torch.equal(broken[:, p + N :], clean[:, p + N :])
    # At p + j the shifts >= j reach back to p or beyond and read pad: the same ids as a clean sequence whose
    # tokens up to and including p are the pad token.
    padded = ids.clone()
    padded[0, : p + 1] = cfg.engram.pad_id
    padded_rows = hasher(*hasher.prepare(padded))
    for j in range(N):
        assert torch.equal(broken[0, p + j], padded_rows[0, p + j])
        # Orders that reach only shifts < j are untouched; order n uses shifts 0..n-1.
        H = cfg.engram.num_heads
        for n in range(2, N + 1):
            cols = slice((n - 2) * H, (n - 1) * H)
            same = torch.equal(broken[0, p + j, :, cols], clean[0, p + j, :, cols])
            assert same == (n - 1 < j)
    # The gate is 0 at the dead position, so the Engram leaves its streams untouched there and only there.
    eng = Engram(cfg, 1)
    eng.init_weights()
    S = torch.randn(1, T, cfg.mhc.num_streams, cfg.dim)
    out = eng(S, broken[:, :, 0], dead)
    assert torch.equal(out[0, p], S[0, p])
    assert (out[0, torch.arange(T) != p] != S[0, torch.arange(T) != p]).any(-1).all()


def test_hasher_rejects_bad_canonical_map():
    cfg = tiny_cfg()
    with pytest.raises(ValueError, match="compressed_vocab_size"):
        EngramHasher(cfg, canonical_map=torch.full((300,), 300))
    with pytest.raises(ValueError, match="shape"):
        EngramHasher(cfg, canonical_map=torch.zeros(299, dtype=torch.long))
    h = EngramHasher(cfg)
    h.set_canonical_map(torch.arange(300) // 2)
    assert h.pad_canonical_id == 1 and int(h.canonical_map[7]) == 3


# -- canonical vocabulary ----------------------------------------------------------------------------------------------

def test_canonical_vocab_with_fake_decoder():
    texts = ["Hello", "hello", "h\u00e9llo", " HÉLLO", "\ufffd", "\ufffd", "\n\n", " ", "\t \r", "\u0301", "ﬁ", "fi",
             "a\ufffd"]
    raws = ["Hello", "hello", "héllo", "ĠHÉLLO", "Ã", "©", "ĊĊ", "Ġ", "ĉĠč", "Ì", "ï¬ģ", "fi", "aÃ"]
    mapping, n = build_canonical_vocab(lambda i: texts[i], len(texts), raw_token=lambda i: raws[i])
    m = mapping.tolist()
    assert m[0] == m[1] == m[2] == m[3] == 0  # case, accents, leading space
    assert m[4] != m[5] and m[12] not in (m[4], m[5])  # U+FFFD tokens keyed by their (distinct) raw strings
    assert m[6] == m[7] == m[8]  # whitespace runs collapse to one protected " "
    assert m[10] == m[11]  # NFKC ligature
    assert m[9] not in m[:9]  # a lone combining accent strips to "" and falls back to itself
    # Ids are numbered by first appearance: each new id is one past the largest so far.
    seen = -1
    for x in m:
        assert x <= seen + 1
        seen = max(seen, x)
    assert n == seen + 1 == len(set(m))
    # Without raw strings, U+FFFD tokens still stay distinct (one key per id).
    m2, _ = build_canonical_vocab(lambda i: texts[i], len(texts))
    assert m2[4] != m2[5]


def test_canonical_vocab_with_trained_byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["Hello world, hello again.", "hello there Hello", "héllo HELLO Héllo héllo", "Héllo café naïve"]
    tok.train_from_iterator(corpus * 50, trainer)
    mapping, n = canonical_vocab_from_tokenizer(tok)
    V = tok.get_vocab_size()
    assert mapping.shape == (V,) and n == int(mapping.max()) + 1 < V
    # Byte-level raw strings: "Ġ" is a leading space, "Ã©" the two bytes of "é".
    variants = ["Hello", "hello", "hÃ©llo", "HÃ©llo", "ĠHello", "Ġhello", "ĠhÃ©llo", "ĠHELLO"]
    cid = {w: int(mapping[tok.token_to_id(w)]) for w in variants + ["Ã", "©", "<pad>"]}
    assert len({cid[w] for w in variants}) == 1
    # Lone bytes of a UTF-8 sequence decode to U+FFFD: each keeps its own canonical id.
    assert cid["Ã"] != cid["©"] and cid["Ã"] != cid["Hello"]
    # Special tokens are decoded, not skipped: the first three ids stay themselves.
    assert mapping[:3].tolist() == [0, 1, 2] and cid["<pad>"] == 2
    # A larger model vocabulary pads the map with canonical id 0; the hasher accepts it.
    padded, n2 = canonical_vocab_from_tokenizer(tok, vocab_size=V + 5)
    assert n2 == n and padded[V:].tolist() == [0] * 5 and torch.equal(padded[:V], mapping)
    cfg = tiny_cfg(compressed_vocab_size=n)
    cfg.vocab_size = V + 5
    h = EngramHasher(cfg, canonical_map=padded)
    ids = torch.tensor([tok.encode("Hello hello").ids + tok.encode("hello Hello").ids])
    canon, _ = h.prepare(ids)
    assert canon[0, :2].tolist() == canon[0, 2:].tolist()


# -- the module --------------------------------------------------------------------------------------------------------

def reference_engram(eng: Engram, S, row_ids, dead):
    """A8 "Lookup" and "Gate" written with F.rms_norm, one stream at a time."""
    n, D = S.shape[-2:]
    kv = eng.table[row_ids].flatten(-2) @ eng.wkv.weight.t()
    out = S.clone()
    value = kv[..., n * D :]
    for k in range(n):
        key = kv[..., k * D : (k + 1) * D]
        h = F.rms_norm(S[..., k, :], (D,), eps=eng.eps)
        kn = F.rms_norm(key, (D,), eps=eng.eps)
        dot = (h * eng.q_weight[k] * eng.k_weight[k] * kn).sum(-1) / math.sqrt(D)
        g = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt()) * (~dead)
        out[..., k, :] = S[..., k, :] + g[..., None] * value
    return out


def test_forward_matches_reference_and_gradients_reach_read_rows():
    cfg = tiny_cfg(max_ngram=3)
    hasher = EngramHasher(cfg)
    eng = Engram(cfg, 2)
    eng.init_weights()
    with torch.no_grad():  # non-unit q/k so their product matters
        eng.q_weight.uniform_(0.5, 1.5)
        eng.k_weight.uniform_(0.5, 1.5)
    torch.manual_seed(0)
    ids = torch.randint(0, 299, (2, 7))
    dead = torch.zeros(2, 7, dtype=torch.bool)
    dead[1, 3] = True
    rows = hasher(hasher.prepare(ids)[0], dead)[:, :, 1]
    S = torch.randn(2, 7, cfg.mhc.num_streams, cfg.dim)
    out = eng(S, rows, dead)
    torch.testing.assert_close(out, reference_engram(eng, S, rows, dead), rtol=1e-5, atol=1e-6)

    (out * torch.randn_like(out)).sum().backward()
    live = rows[~dead].unique()
    hit = eng.table.grad.abs().sum(-1) > 0
    assert hit.nonzero().flatten().tolist() == live.tolist()
    for p in (eng.wkv.weight, eng.q_weight, eng.k_weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_bf16_table_and_streams():
    cfg = tiny_cfg(table_dtype="bfloat16")
    eng = Engram(cfg, 1)
    assert eng.table.dtype == torch.bfloat16
    eng.init_weights()
    eng.wkv.to(torch.bfloat16)
    S = torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)
    rows = torch.randint(0, eng.num_rows, (2, 5, 6))
    out = eng(S, rows, torch.zeros(2, 5, dtype=torch.bool))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_flagship_module_builds_on_meta():
    cfg = ModelConfig()
    with torch.device("meta"):
        eng = Engram(cfg, 14)
    assert eng.table.is_meta and eng.table.shape == (384_016_682, 256)
    assert eng.wkv.weight.shape == (5 * 5120, 24 * 256)
    assert eng.q_weight.shape == eng.k_weight.shape == (4, 5120)
    n_params = sum(p.numel() for p in eng.parameters())
    assert n_params == 384_016_682 * 256 + 25600 * 6144 + 2 * 4 * 5120
    with pytest.raises(ValueError, match="engram.layers"):
        Engram(cfg, 2)

"""The shard format (data/shards.py): ids survive a write/read round trip in uint16 and uint32, writing is
deterministic, the webdataset library reads our shards as ordinary samples, every kind of damage (garbage,
truncation, counts that disagree with meta.json) is reported as ShardError, and a directory without meta.json
gives an error naming the path and the prepare command."""

import hashlib
import io
import os
import tarfile

import numpy as np
import pytest

from data.shards import ShardError, ShardInfo, encode_shard, read_meta, read_shard, write_meta, write_shard


def _docs(dtype, high):
    rng = np.random.default_rng(0)
    return [rng.integers(0, high, size=n).astype(dtype) for n in (1, 5, 300, 17)]


@pytest.mark.parametrize("dtype,high", [("<u2", 1 << 16), ("<u4", 1 << 32)])
def test_round_trip(tmp_path, dtype, high):
    docs = _docs(dtype, high)
    info = write_shard(str(tmp_path), 3, docs, first_key=40, dtype=dtype)
    assert info.name == "shard-000003.tar" and info.num_docs == 4 and info.num_tokens == 323
    back = read_shard(str(tmp_path / info.name), info, dtype)
    assert [d.tolist() for d in back] == [d.tolist() for d in docs]
    with tarfile.open(tmp_path / info.name) as tar:
        assert tar.getnames() == ["000000040.ids", "000000041.ids", "000000042.ids", "000000043.ids"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n], "temporary file left behind"


def test_encoding_is_deterministic():
    docs = _docs("<u2", 1 << 16)
    assert encode_shard(docs, 0, "<u2") == encode_shard([d.copy() for d in docs], 0, "<u2")


def test_webdataset_reads_our_shards(tmp_path):
    import webdataset as wds

    docs = _docs("<u2", 1 << 16)
    info = write_shard(str(tmp_path), 0, docs, first_key=0, dtype="<u2")
    samples = list(wds.WebDataset(str(tmp_path / info.name), shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(4)]
    assert [np.frombuffer(s["ids"], "<u2").tolist() for s in samples] == [d.tolist() for d in docs]


def _damaged(tmp_path, how):
    docs = _docs("<u2", 1 << 16)
    info = write_shard(str(tmp_path), 0, docs, first_key=0, dtype="<u2")
    path = tmp_path / info.name
    data = path.read_bytes()
    if how == "garbage":
        path.write_bytes(np.random.default_rng(1).bytes(len(data)))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "missing":
        path.unlink()
    return path, info


@pytest.mark.parametrize("how,match", [("garbage", "checksum"), ("truncated", "checksum"), ("missing", "cannot read")])
def test_damage_is_a_shard_error(tmp_path, how, match):
    path, info = _damaged(tmp_path, how)
    with pytest.raises(ShardError, match=match):
        read_shard(str(path), info, "<u2")


def test_counts_must_match_meta(tmp_path):
    # A shard that is a valid tar with a valid checksum but other contents than meta.json describes.
    docs = _docs("<u2", 1 << 16)
    info = write_shard(str(tmp_path), 0, docs[:2], first_key=0, dtype="<u2")
    lying = ShardInfo(info.name, info.num_docs + 1, info.num_tokens, info.sha256)
    with pytest.raises(ShardError, match="meta.json says 3"):
        read_shard(str(tmp_path / info.name), lying, "<u2")


def test_tar_errors_are_shard_errors(tmp_path):
    # Bypass the checksum (meta.json hashes the cut file) to reach the tar parser with a body cut mid-member:
    # members 0 and 1 take 2 x (512 header + 512 data); member 2's 600-byte payload starts at 2560.
    data = encode_shard(_docs("<u2", 1 << 16), 0, "<u2")
    cut = data[: 2560 + 300]
    (tmp_path / "x.tar").write_bytes(cut)
    info = ShardInfo("x.tar", 4, 323, hashlib.sha256(cut).hexdigest())
    with pytest.raises(ShardError, match="bad tar"):
        read_shard(str(tmp_path / "x.tar"), info, "<u2")


def test_meta_round_trip_and_missing_meta(tmp_path):
    info = write_shard(str(tmp_path), 0, _docs("<u2", 100), first_key=0, dtype="<u2")
    write_meta(str(tmp_path), {"ids_dtype": "<u2"}, [info])
    meta, shards = read_meta(str(tmp_path))
    assert shards == [info] and meta["num_shards"] == 1
    with pytest.raises(FileNotFoundError, match=r"nowhere.*does not exist.*python -m data\.prepare"):
        read_meta(str(tmp_path / "nowhere"))
    os.remove(tmp_path / "meta.json")
    with pytest.raises(FileNotFoundError, match="has no meta.json"):
        read_meta(str(tmp_path))


def test_unknown_fields_are_ignored(tmp_path):
    # A later writer may add fields such as `.txt`; the reader takes the `.ids` members only.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, payload in (("000000000.txt", b"hello"), ("000000000.ids", np.arange(3, dtype="<u2").tobytes())):
            m = tarfile.TarInfo(name)
            m.size = len(payload)
            tar.addfile(m, io.BytesIO(payload))
    (tmp_path / "s.tar").write_bytes(buf.getvalue())
    info = ShardInfo("s.tar", 1, 3, hashlib.sha256(buf.getvalue()).hexdigest())
    assert [d.tolist() for d in read_shard(str(tmp_path / "s.tar"), info, "<u2")] == [[0, 1, 2]]

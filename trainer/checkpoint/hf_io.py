"""Cedar checkpoints <-> Hugging Face safetensors shards, streaming: `python -m trainer.cli.export_hf` and
`python -m trainer.cli.import_hf` (and `checkpoint.init_from=<HF dir>`) call `export` and `import_`.

Contract: neither holds a whole model nor a whole large tensor: a tensor moves in pieces of at most `chunk_bytes`
(default 256 MiB), so host memory stays near two pieces whatever the model's size. `export` writes safetensors files
of about `max_shard_bytes` and `model.safetensors.index.json`, in `dtype` (bf16 by default) but what the reference
keeps in fp32, or with quant="released" the released quantised kinds (trainer/checkpoint/hf_quant.py). `import_`
writes a DCP checkpoint in the dtypes Cedar's model holds, dequantising what the files hold quantised. bf16 -> fp32
-> bf16 is exact: released weights round-trip bit for bit. Under torchrun the ranks split the files.

Design and reasoning: docs/checkpoints.md#streaming-hugging-face-export-and-import
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from pathlib import Path

import torch

import model as model_pkg
from model.config import ModelConfig
from trainer.checkpoint import hf_quant
from trainer.checkpoint.checkpointer import Checkpointer, row_ranges
from trainer.checkpoint.hf import cedar_name, dropped_reason, hf_config, hf_tensors, keeps_fp32
from trainer.checkpoint.hf import model_config as model_config_from_hf
from trainer.config import CheckpointConfig

log = logging.getLogger(__name__)

PREFIX = "train.model."  # where a Cedar checkpoint keeps the model's tensors (trainer/checkpoint/checkpointer.py TrainState)
INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 256 * 2**20
SHARD_BYTES = 5 * 10**9  # export_hf's max_shard_gb=5

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int64: "I64",
              torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8"}


@dataclasses.dataclass
class _Entry:
    """One HF tensor of the export: its name, shape and dtype, and where it comes from (a Cedar tensor, all of it or
    one expert of a stacked weight)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str | None
    expert: int | None
    kind: str | None = None  # a quantised format (trainer/checkpoint/hf_quant.py released_kind), None = a cast
    scale: _Entry | None = None  # a quantised weight's scales, written beside it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def with_scale(self) -> list[_Entry]:
        return [self] + ([self.scale] if self.scale else [])


def _model_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor of Cedar's model of `cfg` (parameters and persistent buffers) that the Hugging Face format holds,
    in state-dict order, from a model on the meta device (no memory). Not the vision tower (`vision.*`): its names in
    the released files are not known here (issue 20), so an export is the text model and an import drops the
    released files' tower (trainer/checkpoint/hf.py)."""
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    return [(k, tuple(v.shape), v.dtype) for k, v in m.state_dict().items() if not k.startswith("vision.")]


# -- safetensors, written as a stream -----------------------------------------------------------------------------

class _SafetensorsWriter:
    """A safetensors file written as a stream: the header first (every tensor's name, dtype, shape and byte range),
    then each tensor's bytes in pieces, in row order; a quantised weight's scales arrive beside its pieces."""

    def __init__(self, path: Path, entries: list[_Entry], metadata: dict | None = None) -> None:
        header, offset, self.at, self.end = {}, 0, {}, {}
        for e in entries:
            header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            self.at[e.name], self.end[e.name] = offset, offset + e.nbytes
            offset += e.nbytes
        header["__metadata__"] = {"format": "pt", **(metadata or {})}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.data = path, 8 + len(raw)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)

    def write(self, name: str, piece: torch.Tensor) -> None:
        """The next bytes of tensor `name`."""
        data = piece.contiguous().view(-1).view(torch.uint8).numpy()
        if self.at[name] + data.nbytes > self.end[name]:
            raise RuntimeError(f"{self.path}: more bytes for {name} than its header gives")
        if self.f.tell() != self.data + self.at[name]:
            self.f.seek(self.data + self.at[name])
        self.f.write(memoryview(data))
        self.at[name] += data.nbytes

    def close(self) -> None:
        import os

        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        short = [n for n in self.at if self.at[n] != self.end[n]]
        if short:
            raise RuntimeError(f"{self.path}: {short[0]} got {self.at[short[0]]} of its bytes' end "
                               f"{self.end[short[0]]} ({len(short)} tensor(s) incomplete)")


# -- reading pieces of a DCP checkpoint ----------------------------------------------------------------------------

def _dcp_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):  # the metadata read once, not at every piece's load
        _md = None

        def read_metadata(self):
            if self._md is None:
                self._md = super().read_metadata()
            return self._md

    return _Reader(str(path))


def _read_pieces(reader, requests: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each destination tensor with the piece (fqn, offsets, sizes) of a DCP checkpoint's tensor: one load
    plan of exactly those pieces, so DCP reads only the byte ranges that hold them."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _Pieces(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.metadata, self.is_coordinator = metadata, is_coordinator
            self.dest = {}

        def create_local_plan(self):
            items = []
            for fqn, offsets, sizes, dest in requests:
                md = self.metadata.state_dict_metadata[fqn]
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for item in create_read_items_for_chunk_list(fqn, md, [chunk]):
                    self.dest[(fqn, tuple(offsets))] = dest
                    items.append(item)
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            dest = self.dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                dest = dest.narrow(dim, start, length)
            return dest

        def commit_tensor(self, read_item, tensor):
            pass

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load({}, storage_reader=reader, planner=_Pieces())


# -- export ------------------------------------------------------------------------------------------------------

def _view(buffer: torch.Tensor, start: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over the bytes of uint8 `buffer` from `start` (a multiple of 64)."""
    n = math.prod(shape) * dtype.itemsize
    return buffer[start:start + n].view(dtype).view(tuple(shape))


def _source_pieces(entries: list[_Entry], saved: dict, chunk_bytes: int):
    """The reads that produce `entries` in order: (fqn, offsets, sizes, the entries the piece's parts go to, source
    dtype). A piece of a stacked expert weight holds whole experts, one part each (consecutive experts are read
    together, at most chunk_bytes: DCP reads a stored item whole for every request, so one request per expert would
    read the stacked weight once per expert), or the rows of one expert above chunk_bytes; a piece of any other
    tensor is one part, a row range of at most chunk_bytes (starting a block of rows where its format scales
    blocks: trainer/checkpoint/hf_quant.py)."""
    k = 0
    while k < len(entries):
        e = entries[k]
        fqn = PREFIX + e.source
        src_dtype, full = saved[fqn].properties.dtype, tuple(saved[fqn].size)
        if e.expert is not None:
            per = math.prod(full[1:]) * src_dtype.itemsize
            run = 1
            while (k + run < len(entries) and entries[k + run].source == e.source
                   and entries[k + run].expert == e.expert + run and (run + 1) * per <= chunk_bytes):
                run += 1
            if run > 1 or per <= chunk_bytes:
                offsets = (e.expert,) + (0,) * (len(full) - 1)
                yield fqn, offsets, (run,) + full[1:], entries[k:k + run], src_dtype
                k += run
                continue
            inner = full[1:]  # one expert above chunk_bytes: its rows
            for a, b in row_ranges(inner, src_dtype.itemsize, chunk_bytes):
                offsets = (e.expert, a) + (0,) * (len(inner) - 1)
                yield fqn, offsets, (1, b - a) + inner[1:], [e], src_dtype
            k += 1
            continue
        multiple = hf_quant.BLOCK[0] if e.kind == "fp8_block" else 1
        for a, b in row_ranges(full, src_dtype.itemsize, chunk_bytes, multiple):
            offsets = (a,) + (0,) * (len(full) - 1) if full else ()
            yield fqn, offsets, (b - a,) + full[1:] if full else (), [e], src_dtype
        k += 1


def export_plan(cfg: ModelConfig, dtype: torch.dtype, max_shard_bytes: int = SHARD_BYTES,
                quant: str = "none") -> list[list[_Entry]]:
    """The export's files, each a list of HF tensors (about max_shard_bytes a file, whole tensors with their scales,
    state-dict order): the same on every rank, computed from the model config alone. quant="released": the
    released checkpoints' quantised formats where they use them (trainer/checkpoint/hf_quant.py), `dtype` elsewhere."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for name, shape, _ in _model_shapes(cfg):
        out = torch.float32 if keeps_fp32(name) else dtype
        kind = hf_quant.released_kind(name) if quant == "released" else None
        for t in hf_tensors(name, shape):
            if kind is None:
                e = _Entry(t.name, t.shape, out, name, t.expert)
            else:
                hf_quant.check_quantisable(kind, t.name, t.shape)
                scale_name = t.name[:-len(".weight")] + ".scale"
                e = _Entry(t.name, hf_quant.stored_shape(kind, t.shape),
                           torch.int8 if kind == "fp4" else torch.float8_e4m3fn, name, t.expert, kind,
                           _Entry(scale_name, hf_quant.scale_shape(kind, t.shape), torch.float8_e8m0fnu, None, None))
            nbytes = sum(x.nbytes for x in e.with_scale())
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += nbytes
    return shards


def export(ckpt: Path, out: Path, cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
           max_shard_bytes: int = SHARD_BYTES, chunk_bytes: int = CHUNK_BYTES, rank: int = 0, world: int = 1,
           tokenizer: str | None = None, quant: str = "none") -> dict:
    """Cedar checkpoint `ckpt` (a step directory; any layout) -> HF safetensors shards, index and config.json in
    `out`. This rank writes the files rank, rank + world, ...; rank 0 the index and the config (call it on every
    rank, then wait for all). quant="released": the released quantised formats (trainer/checkpoint/hf_quant.py). Returns the
    index."""
    reader = _dcp_reader(ckpt)
    saved = reader.read_metadata().state_dict_metadata
    shards = export_plan(cfg, dtype, max_shard_bytes, quant)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    missing = [e.source for s in shards for e in s if PREFIX + e.source not in saved]
    if missing:
        raise ValueError(f"checkpoint {ckpt} has no tensor {missing[0]!r} ({len(missing)} missing): not a checkpoint "
                         "of this model config")
    out.mkdir(parents=True, exist_ok=True)
    # Two buffers of chunk_bytes, reused by every load: the pieces read (source dtype) and their casts. Allocating
    # each piece anew grew the process by about a piece per load (a v41_small export: 3.3 GiB resident at the end,
    # 2 of its tensors alive; the allocator kept what the pieces had used).
    source, cast = torch.empty(chunk_bytes, dtype=torch.uint8), [torch.empty(chunk_bytes, dtype=torch.uint8)]
    for i in range(rank, len(shards), world):
        writer = _SafetensorsWriter(out / names[i], [x for e in shards[i] for x in e.with_scale()])
        pending: list[tuple] = []  # pieces read by one load plan, then written in order

        def flush() -> None:
            _read_pieces(reader, [p[:4] for p in pending])
            for _, _, _, piece, targets in pending:
                # a piece: one tensor's rows, or whole experts of a stacked weight (a part each)
                for e, part in zip(targets, piece if targets[0].expert is not None else [piece]):
                    if e.kind is not None:
                        codes, scales = hf_quant.quantise(e.kind, part)
                        writer.write(e.name, codes)
                        writer.write(e.scale.name, scales)
                    elif part.dtype == e.dtype:
                        writer.write(e.name, part)
                    else:
                        if cast[0].numel() < part.numel() * e.dtype.itemsize:  # a cast to a wider dtype
                            cast[0] = torch.empty(part.numel() * e.dtype.itemsize, dtype=torch.uint8)
                        writer.write(e.name, _view(cast[0], 0, part.shape, e.dtype).copy_(part))
            pending.clear()

        try:
            used = 0
            for fqn, offsets, sizes, targets, src_dtype in _source_pieces(shards[i], saved, chunk_bytes):
                nbytes = math.prod(sizes) * src_dtype.itemsize
                if used + nbytes > chunk_bytes and pending:
                    flush()
                    used = 0
                if nbytes > chunk_bytes:  # one row above chunk_bytes: a buffer of its own
                    piece = torch.empty(sizes, dtype=src_dtype)
                else:
                    piece = _view(source, used, sizes, src_dtype)
                    used += -(-nbytes // 64) * 64  # 64-byte aligned
                pending.append((fqn, offsets, sizes, piece, targets))
            if pending:
                flush()
        finally:
            writer.close()
    index = {"metadata": {"total_size": sum(x.nbytes for s in shards for e in s for x in e.with_scale()),
                          "format": "cedar-export", "dtype": str(dtype).replace("torch.", ""), "quant": quant},
             "weight_map": {x.name: names[i] for i, s in enumerate(shards) for e in s for x in e.with_scale()}}
    if rank == 0:
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config(cfg)
        if quant == "released":
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(hf_quant.BLOCK), "scale_fmt": "ue8m0",
                                             "expert_dtype": "fp4"}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer:
            import shutil

            shutil.copyfile(tokenizer, out / "tokenizer.json")
    return index


# -- import ------------------------------------------------------------------------------------------------------

def is_hf_dir(path: Path) -> bool:
    """A directory in the Hugging Face layout: config.json and safetensors weights (one file, or an index)."""
    return (path / "config.json").is_file() and ((path / INDEX).is_file() or (path / "model.safetensors").is_file())


def read_json(path: Path, key: str | None = None):
    """The JSON object of `path` (its `key` entry, if given); ValueError in one line naming the file when it is not
    JSON (truncated, corrupt) or lacks `key`."""
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}): the file is truncated or corrupt") from None
    if key is None:
        return obj
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{path}: no {key!r} entry: the file is truncated or corrupt")
    return obj[key]


def open_safetensors(path: Path):
    """`safetensors.safe_open` of `path`; ValueError in one line naming the file when it is not a safetensors file
    (a truncated download, a corrupt header: safetensors says "incomplete metadata" without the file's name)."""
    from safetensors import SafetensorError, safe_open  # the HF format's reader, needed only by HF import

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}): the file is truncated or corrupt") from None


def weight_map(src: Path) -> dict[str, str]:
    """HF tensor name -> the safetensors file (in `src`) that holds it."""
    if (src / INDEX).is_file():
        return read_json(src / INDEX, "weight_map")
    with open_safetensors(src / "model.safetensors") as f:
        return {k: "model.safetensors" for k in f.keys()}


def quantization(src: Path) -> dict:
    """The directory's `quantization_config` (config.json, or its text_config's); {} when none. Another method than
    DeepSeek's FP8 (with FP4 experts) is refused by name."""
    config = read_json(src / "config.json") if (src / "config.json").is_file() else {}
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    if quant and (quant.get("quant_method", "fp8") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"
                  or quant.get("expert_dtype", "fp8") not in ("fp8", "fp4")):
        raise ValueError(f"{src}/config.json: quantization_config {quant!r}; only DeepSeek's fp8 (e4m3) block scales "
                         "with fp8 or fp4 experts are read")
    return quant


def fp8_block(src: Path) -> tuple[int, int]:
    """The [rows, columns] block of the directory's FP8 block-scaled matrices: `quantization_config`'s
    `weight_block_size` (DeepSeek's [128, 128] by default)."""
    rows, cols = quantization(src).get("weight_block_size", list(hf_quant.BLOCK))
    return int(rows), int(cols)


class _Files:
    """The safetensors files of an HF directory, opened once each (memory-mapped: reading a slice reads its bytes)."""

    def __init__(self, src: Path, where: dict[str, str]) -> None:
        self.src, self.where, self.open = src, where, {}
        self.block = fp8_block(src)

    def slice(self, name: str):
        from safetensors import SafetensorError  # the HF format's reader, needed only by HF import

        file = self.where[name]
        if file not in self.open:
            self.open[file] = open_safetensors(self.src / file)
        try:
            return self.open[file].get_slice(name)
        except SafetensorError as e:
            raise ValueError(f"{self.src / file}: cannot read {name} ({e}): the file is truncated or corrupt") from None

    def dtype(self, name: str) -> str:
        return self.slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())

    def scale_name(self, name: str) -> str | None:
        """The scales of quantised weight `name` in the directory: `<m>.scale` (V4's files; an Engram table's
        `engram.embed.scale`) or `<m>.weight_scale_inv` (V3's); None when neither is there."""
        for scale in (name[:-len(".weight")] + ".scale" if name.endswith(".weight") else None, name + "_scale_inv"):
            if scale in self.where:
                return scale
        return None


_PACKED = ("I8", "U8")  # an FP4-packed weight: two E2M1 codes a byte
_QUANTISED = ("F8_E4M3",) + _PACKED


def import_plan(cfg: ModelConfig, src: Path) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], list[str]]:
    """Check that the HF directory holds every tensor of `cfg`'s model with its shape (an FP4-packed one with half
    the columns), and the scales of every quantised one. Returns the model's tensors and the messages on what the
    directory holds that Cedar does not (dropped tensors, by kind)."""
    where = weight_map(src)
    files = _Files(src, where)
    model = _model_shapes(cfg)
    wanted: dict[str, tuple[str, tuple]] = {}
    for name, shape, _ in model:
        for t in hf_tensors(name, shape):
            wanted[t.name] = (name, t.shape)
    missing = [n for n in wanted if n not in where]
    if missing:
        raise ValueError(f"{src}: no tensor {missing[0]!r} ({len(missing)} of the model's {len(wanted)} missing)")
    scales = set()
    for n, (_, shape) in wanted.items():
        got, dtype = files.shape(n), files.dtype(n)
        packed = dtype in _PACKED and shape and got == hf_quant.stored_shape("fp4", shape)
        if got != shape and not packed:
            raise ValueError(f"{src}: {n} has shape {list(got)}, the model config gives {list(shape)}")
        if dtype in _QUANTISED:
            scale = files.scale_name(n)
            if scale is None:
                raise ValueError(f"{src}: {n} is {'fp4-packed' if packed else 'fp8'} but its scales "
                                 f"({n[:-len('weight')]}scale or {n}_scale_inv) are missing")
            scales.add(scale)
    dropped: dict[str, int] = {}
    for n in where:
        if n in wanted or n in scales:
            continue
        why = dropped_reason(n)
        if why is None:
            try:
                cedar_name(n)
                why = "not a tensor of this model config"
            except KeyError:
                why = "not a DeepSeek-V4.1 tensor"
        dropped[why] = dropped.get(why, 0) + 1
    return model, [f"dropped {k} tensor(s): {why}" for why, k in dropped.items()]


def _read_hf(files: _Files, name: str, shape: tuple[int, ...], dtype: torch.dtype, rows: tuple[int, int]):
    """Rows [a, b) of Cedar tensor `name` read from the HF files, cast to `dtype` (a stacked expert weight: experts
    a..b-1, one HF tensor each)."""
    a, b = rows
    parts = hf_tensors(name, shape)
    if parts[0].expert is not None:
        return torch.stack([_cast(files, parts[e].name, files.slice(parts[e].name)[:], dtype)
                            for e in range(a, b)])
    t = parts[0].name
    piece = files.slice(t)[a:b] if shape else files.slice(t)[:]
    return _cast(files, t, piece, dtype, rows)


def _cast(files: _Files, name: str, piece: torch.Tensor, dtype: torch.dtype, rows=None) -> torch.Tensor:
    """A piece (rows [a, b) of HF tensor `name`, or all of it) dequantised where the file holds it quantised
    (trainer/checkpoint/hf_quant.py: an FP8 block-scaled matrix, an FP4-packed expert, an FP8 Engram table), cast to `dtype`."""
    if piece.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        scale = files.slice(files.scale_name(name))
        a, b = rows if rows else (0, piece.shape[0])
        if piece.dtype != torch.float8_e4m3fn:
            piece = hf_quant.dequantise_fp4(piece, scale[a:b])
        elif name.endswith(".engram.embed.weight"):
            piece = hf_quant.dequantise_rows(piece, scale[a:b])
        else:
            if piece.dim() != 2:
                raise ValueError(f"{name}: an fp8 tensor of {piece.dim()} dimensions (block scales are for matrices)")
            bo = files.block[0]
            piece = hf_quant.dequantise_block(piece, scale[a // bo:(b - 1) // bo + 1], a, files.block)
    elif not piece.dtype.is_floating_point:
        raise ValueError(f"{name}: dtype {piece.dtype} is not a format the import reads")
    return piece.to(dtype)


def hf_model_config(src: Path):
    """The ModelConfig of HF directory `src`: its config.json, the Engram tables' dtype from the files."""
    if not is_hf_dir(src):
        raise ValueError(f"{src} is not a Hugging Face checkpoint directory (config.json and model.safetensors, or "
                         "model-*.safetensors with model.safetensors.index.json)")
    cfg = model_config_from_hf(read_json(src / "config.json"))
    if cfg.engram.layers:  # the tables' storage dtype: as in the files (fp8 tables dequantise to bf16)
        where = weight_map(src)
        name = f"model.layers.{cfg.engram.layers[0]}.engram.embed.weight"
        if name in where:
            dtype = "float32" if _Files(src, where).dtype(name) == "F32" else "bfloat16"
            cfg = dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, table_dtype=dtype))
    return cfg


def import_(src: Path, out: Path, cfg: ModelConfig, *, chunk_bytes: int = CHUNK_BYTES, rank: int = 0, world: int = 1,
            info: dict | None = None) -> Path:
    """HF directory `src` -> a Cedar checkpoint `out/checkpoints/step_0` holding the weights (no optimiser state:
    for checkpoint.init_from). Call it on every rank of a job (or on one process); this rank reads and writes the
    tensors rank, rank + world, ... Returns the checkpoint's path."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    model, notes = import_plan(cfg, src)
    for note in notes:
        log.warning("import %s: %s", src, note)
    files = _Files(src, weight_map(src))
    mine = [m for i, m in enumerate(model) if i % world == rank]
    shapes = {name: (shape, dtype) for name, shape, dtype in mine}

    class _Lazy(DefaultSavePlanner):
        """Every tensor of this rank as row pieces, each read from the HF files when the writer asks for it."""

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.state_dict, self.is_coordinator, self.mappings = {}, is_coordinator, {}

        def create_local_plan(self):
            items = []
            for name, shape, dtype in mine:
                fqn = PREFIX + name
                self.mappings[fqn] = tuple(fqn.split(".", 2)[:2]) + (name,)
                props = TensorProperties(dtype=dtype)
                for a, b in row_ranges(shape, dtype.itemsize, chunk_bytes):
                    offsets = (a,) + (0,) * (len(shape) - 1) if shape else ()
                    sizes = (b - a,) + shape[1:] if shape else ()
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                    items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                                       size=torch.Size(shape))))
            self.plan = SavePlan(items, planner_data=self.mappings)
            return self.plan

        def resolve_data(self, write_item):
            name = write_item.index.fqn[len(PREFIX):]
            shape, dtype = shapes[name]
            offsets, sizes = write_item.tensor_data.chunk.offsets, write_item.tensor_data.chunk.sizes
            rows = (offsets[0], offsets[0] + sizes[0]) if shape else (0, 1)
            return _read_hf(files, name, shape, dtype, rows).reshape(sizes).contiguous()

    marker = {"model": dataclasses.asdict(cfg), "imported_from": str(src.resolve()), "weights_only": True,
              **(info or {})}
    checkpointer = Checkpointer(out / "checkpoints", CheckpointConfig(), rank, info=marker)
    return checkpointer.save(0, {}, planner=_Lazy(), file_per_item=True)

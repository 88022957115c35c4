"""GGUF metadata and tokenizer checks, read from the file header without loading any weights.

The header is parsed here with `struct` over a read-only mmap, using the `gguf` package only for
its type tables (value types, quantisation block sizes). `gguf.GGUFReader` is not used because it
builds a numpy view for every array element up front: measured 7.5 s for a header with Qwen2.5's
151,936 tokens and 151,387 merges, against well under a second here. This parser skips what it is
not asked for (merges, scores, token types) and decodes the token texts only when they are needed.

Limits: GGUF versions 2 and 3, either byte order; array-valued head counts (per-layer) are reduced
to their maximum, so `kv_bytes_per_token` is an upper bound for such models.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from homespec.errors import IncompatibleTokenizer, ModelError

KvType = Literal["f16", "q8_0"]  # the KV-cache element types homespec uses (llama/runtime.py)
GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # bytes; general.alignment when absent (GGUF spec)
# llama.cpp's speculative example (common/speculative.cpp) allows this much padding difference:
# some conversions pad the vocabulary to a multiple of 64 or 128 rows for faster matmuls.
MAX_VOCAB_DIFFERENCE = 128  # tokens

# GGUF value type ids (gguf.GGUFValueType) -> struct format of one scalar.
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Arrays longer than this are left unread unless asked for: only the vocabulary-sized ones are
# that long, and reading them into Python objects is what makes a naive reader slow.
_SMALL_ARRAY = 4096  # items


@dataclass(frozen=True)
class _LazyArray:
    """An array value left in the file: where it starts and what it holds."""

    item_type: int
    count: int
    offset: int  # bytes from the start of the file


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    file_size: int  # bytes
    architecture: str
    name: str
    n_vocab: int  # tokens
    n_ctx_train: int  # tokens
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    tokenizer_model: str
    tokenizer_pre: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None
    tensor_bytes: int  # bytes of tensor data (weights)
    # The input embedding and output matrices (the memory plan places them apart from the layers).
    token_embd_bytes: int | None = None  # bytes of token_embd.weight; None when the file has none
    output_bytes: int | None = None  # bytes of output.weight; 0 when tied to token_embd (absent)
    matrix_types: frozenset[str] = frozenset()  # ggml type names of the tensors of 2+ dimensions ("Q4_K", ...)

    def kv_bytes_per_token(self, kv_type: KvType = "f16") -> int:
        """KV-cache bytes one token costs: K and V, all layers, in the cache's element type."""
        return kv_bytes_per_token(self.n_layer, self.n_head_kv * self.head_dim_k, self.n_head_kv * self.head_dim_v, kv_type)


def kv_bytes_per_token(n_layer: int, k_width: int, v_width: int, kv_type: KvType = "f16") -> int:
    """Bytes of one token's K row (k_width elements) and V row, over n_layer layers, as llama.cpp
    stores them in a `kv_type` cache ("f16", "q8_0": ggml's block sizes, e.g. 34 bytes per 32)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred: importing gguf costs ~0.1 s

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kv_type.upper()]]  # elements, bytes per block
    return n_layer * (-(-k_width // block) + -(-v_width // block)) * size


@dataclass
class TokenizerReport:
    compatible: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Header:
    """Key/value metadata and tensor table of one GGUF file, parsed from a mapped buffer."""

    def __init__(self, path: Path, buf: mmap.mmap, want_tokens: bool) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.kv: dict[str, Any] = {}
        self.tokens: list[str] | None = None
        self._want_tokens = want_tokens
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise ModelError(f"{path}: corrupt or truncated GGUF header ({e})") from None

    def _parse(self) -> None:
        buf = self.buf
        if buf[:4] != GGUF_MAGIC:
            raise ModelError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        (version,) = struct.unpack_from("<I", buf, 4)
        # A file written on a big-endian machine reads as version << 16 here.
        self.e = "<" if version & 0xFFFF else ">"
        (version,) = struct.unpack_from(self.e + "I", buf, 4)
        if version not in (2, 3):
            raise ModelError(f"{self.path}: GGUF version {version} is not supported (only 2 and 3)")
        n_tensors, n_kv = struct.unpack_from(self.e + "QQ", buf, 8)
        off = 24
        self._check_count(n_kv, 12, off, "metadata entries")
        for _ in range(n_kv):
            key, off = self._string(off)
            (vtype,) = struct.unpack_from(self.e + "I", buf, off)
            value, off = self._value(vtype, off + 4, key)
            self.kv[key] = value
        self._check_count(n_tensors, 24, off, "tensors")
        self.tensors: list[tuple[str, list[int], int, int]] = []  # name, dims, ggml type, offset
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,) = struct.unpack_from(self.e + "I", buf, off)
            dims = list(struct.unpack_from(f"{self.e}{n_dims}Q", buf, off + 4))
            off += 4 + 8 * n_dims
            ggml_type, t_off = struct.unpack_from(self.e + "IQ", buf, off)
            off += 12
            self.tensors.append((name, dims, ggml_type, t_off))
        align = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelError(f"{self.path}: invalid general.alignment {align!r}")
        self.data_start = -(-off // align) * align  # bytes; first byte of tensor data

    def _check_count(self, count: int, min_item: int, off: int, what: str) -> None:
        # A corrupt count would otherwise send the loops below on a very long walk.
        if count * min_item > self.size - off:
            raise ModelError(f"{self.path}: corrupt GGUF header ({count} {what} cannot fit in the file)")

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self.e + "Q", self.buf, off)
        end = off + 8 + n
        if end > self.size:
            raise struct.error("string runs past the end of the file")
        return self.buf[off + 8 : end].decode("utf-8", "surrogateescape"), end

    def _value(self, vtype: int, off: int, key: str) -> tuple[Any, int]:
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is not None:
            (v,) = struct.unpack_from(self.e + fmt, self.buf, off)
            return v, off + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(off)
        if vtype != _ARRAY:
            raise ModelError(f"{self.path}: unknown GGUF value type {vtype} for key {key}")
        itype, count = struct.unpack_from(self.e + "IQ", self.buf, off)
        off += 12
        if itype == _STRING:
            self._check_count(count, 8, off, f"strings in {key}")
            decode = count <= _SMALL_ARRAY or (self._want_tokens and key == "tokenizer.ggml.tokens")
            items, end = self._strings(off, count, decode)
            return (items if decode else _LazyArray(itype, count, off)), end
        fmt = _SCALAR_FMT.get(itype)
        if fmt is None:  # nested arrays: legal but unused by any key read here
            raise ModelError(f"{self.path}: unsupported array item type {itype} for key {key}")
        width = struct.calcsize(fmt)
        self._check_count(count, width, off, f"items in {key}")
        end = off + count * width
        if count <= _SMALL_ARRAY:
            return list(struct.unpack_from(f"{self.e}{count}{fmt}", self.buf, off)), end
        return _LazyArray(itype, count, off), end

    def _strings(self, off: int, count: int, decode: bool) -> tuple[list[str], int]:
        """Walk `count` strings from `off`; decode them only when asked (walking is ~20x cheaper)."""
        unpack = struct.Struct(self.e + "Q").unpack_from
        buf, out = self.buf, []
        for _ in range(count):
            (n,) = unpack(buf, off)
            if decode:
                out.append(buf[off + 8 : off + 8 + n].decode("utf-8", "surrogateescape"))
            off += 8 + n
        if off > self.size:
            raise struct.error("string array runs past the end of the file")
        return out, off


def _read_header(path: Path, want_tokens: bool) -> _Header:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:  # bytes: magic + version + two counts
                raise ModelError(f"{path}: not a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _Header(path, buf, want_tokens)
    except FileNotFoundError:
        raise ModelError(f"{path}: model file not found") from None
    except IsADirectoryError:
        raise ModelError(f"{path}: is a directory, not a GGUF file") from None
    except PermissionError:
        raise ModelError(f"{path}: permission denied") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None


def _tensor_sizes(h: _Header) -> dict[str, int]:
    """Data size in bytes of every tensor, by name; checks that every tensor lies inside the file."""
    from gguf.constants import GGML_QUANT_SIZES  # deferred: importing gguf costs ~0.1 s

    sizes_by_name: dict[str, int] = {}
    for name, dims, ggml_type, t_off in h.tensors:
        sizes = GGML_QUANT_SIZES.get(ggml_type)
        if sizes is None:
            raise ModelError(f"{h.path}: tensor {name} has a ggml type ({ggml_type}) this gguf package does not know")
        block, type_size = sizes
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * type_size
        end = h.data_start + t_off + nbytes
        if end > h.size:
            raise ModelError(
                f"{h.path}: truncated: tensor {name} ends at byte {end:,} but the file has {h.size:,} bytes"
            )
        sizes_by_name[name] = nbytes
    return sizes_by_name


def _matrix_types(h: _Header) -> frozenset[str]:
    from gguf.constants import GGMLQuantizationType

    return frozenset(GGMLQuantizationType(t).name for _, dims, t, _ in h.tensors if sum(d > 1 for d in dims) >= 2)


def _info_from(h: _Header) -> GGUFInfo:
    kv = h.kv

    def need(key: str) -> Any:
        if key not in kv:
            raise ModelError(f"{h.path}: not a usable model: metadata key {key} is missing")
        return kv[key]

    def as_int(key: str, default: int | None = None) -> int:
        v = kv.get(key, default) if default is not None else need(key)
        if isinstance(v, list):  # per-layer values (some architectures): the largest bounds memory
            v = max(v) if v else 0
        if not isinstance(v, int) or isinstance(v, bool):
            raise ModelError(f"{h.path}: metadata key {key} is {v!r}, expected an integer")
        return v

    def opt_int(key: str) -> int | None:
        v = kv.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    arch = need("general.architecture")
    tokens = need("tokenizer.ggml.tokens")
    n_vocab = tokens.count if isinstance(tokens, _LazyArray) else len(tokens)
    n_embd = as_int(f"{arch}.embedding_length")
    n_head = as_int(f"{arch}.attention.head_count")
    head_dim = n_embd // n_head if n_head else 0
    template = kv.get("tokenizer.chat_template")
    pre = kv.get("tokenizer.ggml.pre")
    sizes = _tensor_sizes(h)  # bytes by tensor name
    embd = sizes.get("token_embd.weight")
    return GGUFInfo(
        path=h.path,
        file_size=h.size,
        architecture=arch,
        name=kv.get("general.name") or h.path.stem,
        n_vocab=n_vocab,
        n_ctx_train=as_int(f"{arch}.context_length"),
        n_embd=n_embd,
        n_layer=as_int(f"{arch}.block_count"),
        n_head=n_head,
        n_head_kv=as_int(f"{arch}.attention.head_count_kv", n_head),
        head_dim_k=as_int(f"{arch}.attention.key_length", head_dim),
        head_dim_v=as_int(f"{arch}.attention.value_length", head_dim),
        tokenizer_model=str(need("tokenizer.ggml.model")),
        tokenizer_pre=pre if isinstance(pre, str) else None,
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        eot_token_id=opt_int("tokenizer.ggml.eot_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        chat_template=template if isinstance(template, str) else None,
        tensor_bytes=sum(sizes.values()),
        token_embd_bytes=embd,
        # No output.weight: llama.cpp ties the output to token_embd (the plan copies it then).
        output_bytes=sizes.get("output.weight", 0) if embd is not None else None,
        matrix_types=_matrix_types(h),
    )


def read_gguf_info(path: Path) -> GGUFInfo:
    """Header metadata of a GGUF model. ModelError when missing, not a GGUF, truncated or incomplete."""
    return _info_from(_read_header(path, want_tokens=False))


def read_token_texts(path: Path) -> list[str]:
    """Text of every token, by id (bytes that are not UTF-8 are kept as surrogate escapes)."""
    h = _read_header(path, want_tokens=True)
    tokens = h.kv.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelError(f"{path}: not a usable model: metadata key tokenizer.ggml.tokens is missing")
    return tokens


def _read_with_tokens(path: Path) -> tuple[GGUFInfo, list[str]]:
    h = _read_header(path, want_tokens=True)
    info = _info_from(h)
    return info, h.kv["tokenizer.ggml.tokens"]


def _show(text: str, limit: int = 40) -> str:
    """A token text quoted on one line (repr escapes newlines), shortened past `limit` chars."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _tokenizer_name(info: GGUFInfo) -> str:
    return f"{info.tokenizer_model}/{info.tokenizer_pre}" if info.tokenizer_pre else info.tokenizer_model


def _compare(tgt: GGUFInfo, tgt_tokens: list[str], dft: GGUFInfo, dft_tokens: list[str]) -> TokenizerReport:
    problems: list[str] = []
    notes: list[str] = []
    if abs(tgt.n_vocab - dft.n_vocab) > MAX_VOCAB_DIFFERENCE:
        problems.append(f"vocab {dft.n_vocab} vs {tgt.n_vocab} tokens")
    elif tgt.n_vocab != dft.n_vocab:
        notes.append(f"vocab {dft.n_vocab} vs {tgt.n_vocab} tokens (padding, allowed up to {MAX_VOCAB_DIFFERENCE})")
    if (dft.tokenizer_model, dft.tokenizer_pre) != (tgt.tokenizer_model, tgt.tokenizer_pre):
        problems.append(f"tokenizer model {_tokenizer_name(dft)} vs {_tokenizer_name(tgt)}")
    for label, d, t in (("BOS", dft.bos_token_id, tgt.bos_token_id), ("EOS", dft.eos_token_id, tgt.eos_token_id)):
        if d != t:
            problems.append(f"{label} token {d} vs {t}")
    if dft.eot_token_id is not None and tgt.eot_token_id is not None and dft.eot_token_id != tgt.eot_token_id:
        problems.append(f"EOT token {dft.eot_token_id} vs {tgt.eot_token_id}")
    if dft.pad_token_id != tgt.pad_token_id:
        notes.append(f"padding token {dft.pad_token_id} vs {tgt.pad_token_id} (not used in generation)")
    common = min(len(dft_tokens), len(tgt_tokens))
    if dft_tokens[:common] != tgt_tokens[:common]:  # list equality is C-speed; find where only if not
        diffs = [i for i in range(common) if dft_tokens[i] != tgt_tokens[i]]
        if diffs:
            i = diffs[0]
            problems.append(
                f"first differing token id {i}: {_show(dft_tokens[i])} vs {_show(tgt_tokens[i])} "
                f"({len(diffs)} of {common} shared ids differ)"
            )
    return TokenizerReport(compatible=not problems, problems=problems, notes=notes)


def compare_tokenizers(target: Path, draft: Path) -> TokenizerReport:
    """Whether `draft` can propose token ids for `target`; each problem reads 'draft vs target'.

    Modelled on llama.cpp's common_speculative_are_compatible, slightly stricter: the same
    tokenizer model and pre-tokenizer, the same BOS and EOS ids (EOT too when both define one),
    vocab sizes within MAX_VOCAB_DIFFERENCE, and identical token texts on every shared id
    (llama.cpp skips ids 0-4; here a proposed id must mean the same token to both models).
    """
    tgt, tgt_tokens = _read_with_tokens(target)
    dft, dft_tokens = _read_with_tokens(draft)
    return _compare(tgt, tgt_tokens, dft, dft_tokens)


def check_tokenizer_compat(target: Path, draft: Path) -> None:
    """Raise IncompatibleTokenizer, one line naming every difference, unless compatible."""
    tgt, tgt_tokens = _read_with_tokens(target)
    dft, dft_tokens = _read_with_tokens(draft)
    report = _compare(tgt, tgt_tokens, dft, dft_tokens)
    if not report.compatible:
        raise IncompatibleTokenizer(
            f"draft {dft.name} is not compatible with target {tgt.name}: " + "; ".join(report.problems)
        )


@dataclass(frozen=True)
class ModelCard:
    """What a model says about itself, for clients that show it (Ollama's /api/show)."""

    metadata: dict[str, Any]  # GGUF key -> value; long arrays (the vocabulary, merges) as None
    n_params: int  # weights, summed over the tensor table
    file_type: str | None  # the quantization, as llama.cpp names it ("Q4_K_M"); None if unknown


def _json_safe(v: Any) -> Any:
    # Keys and strings were decoded with surrogateescape; JSON bodies need real text.
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return None if isinstance(v, _LazyArray) else v


def read_model_card(path: Path) -> ModelCard:
    """The metadata and size of a GGUF model, from its header. ModelError as read_gguf_info."""
    from gguf import LlamaFileType  # deferred: importing gguf costs ~0.1 s

    h = _read_header(path, want_tokens=False)
    n_params = 0
    for _name, dims, _type, _off in h.tensors:
        n = 1
        for d in dims:
            n *= d
        n_params += n
    ft = h.kv.get("general.file_type")
    try:
        file_type = LlamaFileType(ft).name.removeprefix("MOSTLY_") if isinstance(ft, int) else None
    except ValueError:
        file_type = None
    metadata = {_json_safe(k): _json_safe(v) for k, v in h.kv.items()}
    return ModelCard(metadata, n_params, file_type)

"""Load the models config.yaml describes: the target, the draft, the MTP head, the chat template.

Resolve model paths, refuse a draft whose tokenizer differs from the target's, open the runtimes
and the head. Loading knows nothing of the step: serving/host.py builds the proposers, the
controller and the engine over what is loaded here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homespec.config import Config, RuntimeConfig
from homespec.llama import kernels
from homespec.llama.cpu_build import has_grouped_attention
from homespec.llama.fim import Chunk, infill_prompt
from homespec.llama.gguf_info import check_tokenizer_compat, read_gguf_info
from homespec.llama.runtime import Runtime, RuntimeOptions
from homespec.llama.template import ChatTemplate
from homespec.models.derived import served_draft
from homespec.models.fetch import resolve_model_path
from homespec.mtp.checkpoint import head_window, open_head

if TYPE_CHECKING:
    from homespec.mtp.model import HeadRunner

log = logging.getLogger("homespec.models.loader")


@dataclass
class ModelSet:
    target: Runtime
    draft: Runtime | None
    template: ChatTemplate
    target_path: Path
    draft_path: Path | None
    mtp_path: Path | None = None  # the MTP head's checkpoint, when one is served
    mtp_head: HeadRunner | None = None  # the head, opened to serve beside the target
    load_s: float = 0.0  # seconds to open all models

    @property
    def target_name(self) -> str:
        return self.target_path.stem

    @property
    def draft_name(self) -> str | None:
        return self.draft_path.stem if self.draft_path else None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """tools: function definitions for the template's tools section (None: no tools)."""
        # Only the template's own text may hold special tokens: "<|im_end|>" inside a message is
        # text, or a message could close its turn and forge another (a system turn, say).
        parts = self.template.render_parts(messages, tools=tools, special_texts=self.target.special_texts())
        bos = self.template.bos_token
        # A template that writes BOS itself must not get a second one from the tokenizer.
        add_special = not (bos and "".join(t for t, _ in parts).startswith(bos))
        return self.target.tokenize_parts(parts, add_special=add_special)

    def encode_text(self, text: str) -> list[int]:
        # A raw prompt is the client's own template: "<|im_start|>" or "<|fim_prefix|>" in it are
        # the special tokens it means (llama.cpp's /completion parses them too); written as text,
        # a model never sees its markers and FIM or a hand-made chat turn fails quietly.
        return self.target.tokenize(text, add_special=True, parse_special=True)

    def encode_infill(
        self, prefix: str, suffix: str, *, extra: Sequence[Chunk] = (), prompt: str = "", n_predict: int
    ) -> list[int]:
        """A fill-in-the-middle prompt from the target's FIM tokens (llama/fim.py); NoFimTokens
        when it has none. The file text is never parsed for special tokens; `prompt` (llama.cpp's
        /infill field, the client's) is."""
        t = self.target
        return infill_prompt(
            lambda text: t.tokenize(text, add_special=False, parse_special=False),
            t.fim_tokens(),
            prefix=prefix,
            suffix=suffix,
            extra=extra,
            prompt=t.tokenize(prompt, add_special=False, parse_special=True) if prompt else [],
            n_batch=t.opts.n_batch,
            n_ctx=t.n_ctx,
            n_predict=n_predict,
            bos=t.bos_id if t.add_bos and t.bos_id >= 0 else None,
            model=self.target_path.name,
        )

    def load_draft(self, cfg: Config) -> None:
        """Open the configured draft beside the target (refused if its tokenizer differs)."""
        if self.draft is not None or cfg.models.draft is None:
            return
        check_tokenizer_compat(self.target_path, resolve_model_path(cfg, cfg.models.draft))  # IncompatibleTokenizer
        path = served_draft(cfg, cfg.models.draft)
        self.draft = Runtime(path, runtime_options(cfg, cfg.models.draft.n_gpu_layers, self.target.n_ctx, slots=self.target.n_seq, draft=True))
        self.draft_path = path

    def unload_draft(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.draft = None

    def close(self) -> None:
        self.unload_draft()
        self.mtp_head = None
        self.target.close()


def flash_attention(r: RuntimeConfig, n_gpu_layers: int) -> bool | None:
    """runtime.flash_attn for a model with n_gpu_layers on the installed build (its `auto` reads
    whether the build has the grouped kernel); None leaves the choice to llama.cpp."""
    return r.flash_attn_for(n_gpu_layers, has_grouped_attention())


def runtime_options(
    cfg: Config, n_gpu_layers: int, n_ctx: int | None = None, embeddings: bool = False, hidden_window: int = 0,
    slots: int = 1, draft: bool = False, keep_amx: bool = False, reference_decode: bool = False,
) -> RuntimeOptions:
    """The options of the target, or with `draft` of the draft model: exact mode changes the
    target's kernels only, since a proposal need not be batch-invariant to be verified exactly.
    keep_amx: exact mode keeps llama.cpp's extra buffers, for AMX's; reference_decode: its decode
    passes take llama.cpp's reference kernels (llama/kernels.py)."""
    r = cfg.runtime
    if draft and r.exact:
        r = r.model_copy(update={"exact": False})
    return RuntimeOptions(
        n_ctx=n_ctx or r.n_ctx,
        n_batch=r.n_batch,
        n_threads=r.n_threads,
        n_gpu_layers=n_gpu_layers,
        use_mmap=r.use_mmap,
        use_mlock=r.use_mlock,
        embeddings=embeddings,
        hidden_window=hidden_window,
        flash_attn=flash_attention(r, n_gpu_layers),
        n_seq=slots,
        # Exact mode: the settings under which a row's logits do not depend on its batch.
        repack=not r.exact or keep_amx,
        kv_type=r.kv_type,
        kv_unified=r.kv_unified,
        tiled_matmul=r.tiled_matmul,
        reference_decode=r.exact and reference_decode,
        fill_stream_gaps=not r.exact,
    )


def open_target(cfg: Config, path: Path, n_ctx: int | None = None, window: int = 0, slots: int = 1,
                amx: bool = True, reference: bool = True) -> Runtime:
    """The target with the configured options. In exact mode on a CPU with AMX, with AMX's buffer
    where the file's matrix types keep a row's logits independent of its pass (llama/kernels.py),
    else, or if llama.cpp put any weight in its repacked layouts after all, unpacked (amx=False:
    unpacked in any case, to compare). Its decode passes take llama.cpp's reference kernels where
    the build can switch to them (reference=False: never, to compare)."""
    n_gpu = cfg.models.target.n_gpu_layers
    keep_amx = (amx and cfg.runtime.exact and n_gpu == 0
                and kernels.exact_keeps_amx(read_gguf_info(path).matrix_types, kernels.amx_buffer_available()))
    ref = reference and cfg.runtime.exact and n_gpu == 0 and kernels.reference_kernels_available()
    target = Runtime(path, runtime_options(cfg, n_gpu, n_ctx, hidden_window=window, slots=slots, keep_amx=keep_amx,
                                           reference_decode=ref))
    if keep_amx and not kernels.batch_invariant_buffers(target.weight_buffers):
        log.warning("exact mode: llama.cpp put weights of %s in repacked layouts (%s); loading it again unpacked",
                    path.name, _buffers(target.weight_buffers))
        target.close()
        target = Runtime(path, runtime_options(cfg, n_gpu, n_ctx, hidden_window=window, slots=slots, reference_decode=ref))
    return target


def _buffers(weight_buffers: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {mib:.0f} MiB" for name, mib in weight_buffers.items()) or "none reported"


def load_model_set(cfg: Config, *, with_draft: bool = True, n_ctx: int | None = None, slots: int = 1) -> ModelSet:
    """Open the target (and the draft unless told not to, and the MTP head when configured);
    slots: KV sequences of each model, for requests decoded together."""
    t0 = time.perf_counter()
    target_path = resolve_model_path(cfg, cfg.models.target)
    if with_draft and cfg.models.draft:
        # Before any weights load: a mismatched pair should fail in milliseconds, not seconds.
        check_tokenizer_compat(target_path, resolve_model_path(cfg, cfg.models.draft))
    mtp_path = cfg.resolve(cfg.models.mtp) if cfg.models.mtp else None
    # The head attends over the target's last `window` hidden states: the target must keep them.
    window = head_window(mtp_path) if mtp_path else 0  # reads the header only: no torch yet
    target = open_target(cfg, target_path, n_ctx, window, slots)
    head = None
    if mtp_path:
        try:
            head = open_head(target, mtp_path, target_path, threads=target.n_threads)
        except BaseException:
            target.close()
            raise
    template = ChatTemplate(
        target.chat_template,
        bos_token=target.token_text(target.bos_id) if target.bos_id >= 0 else "",
        eos_token="",
    )
    ms = ModelSet(target, None, template, target_path, None, mtp_path=mtp_path, mtp_head=head)
    if with_draft:
        ms.load_draft(cfg)
    ms.load_s = time.perf_counter() - t0
    log.info(
        "loaded target %s%s%s in %.1f s (n_ctx %d%s, %d threads)",
        target_path.name,
        f" + draft {ms.draft_path.name}" if ms.draft_path else "",
        f" + MTP head {mtp_path.name}" if mtp_path else "",
        ms.load_s,
        target.n_ctx,
        f" x {slots} sequences" if slots > 1 else "",
        target.n_threads,
    )
    o = target.opts
    log.info("llama.cpp kernels: %s weights (%s), tiled matmul %s, %s KV cache%s%s", "repacked" if o.repack else "unpacked",
             _buffers(target.weight_buffers), "on" if target.tiled_matmul else "off", o.kv_type,
             ("" if slots == 1 else " in one buffer" if o.kv_unified else ", a stream per slot"),
             (", exact mode (batch-invariant rows" + (", decode passes on reference kernels)" if o.reference_decode else ")")
              if cfg.runtime.exact else ""))
    return ms

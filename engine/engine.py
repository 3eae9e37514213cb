"""The engine's public face: text in, `InfillResult` out.

`Engine` owns one loaded model and its tokenizer. `Engine.infill(prefix, suffix)` tokenizes, lays the request out
as the model's settings say ("canvas": suffix head clamped in the canvas; "prompt": suffix in the encoder prompt),
runs the denoising loop in `engine.canvas`, and decodes. `Engine.fill(prefix, middle, suffix)` does the same for
several holes (and span rewrites) in one canvas, the code between them clamped. Callers (the CLI, the LSP server,
the resident engine) use only this module's names; nothing outside `engine/` touches a tensor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .adapters import AdapterSet
from .canvas import (
    CancelToken,
    CanvasJob,
    CanvasOutput,
    Clamp,
    DenoiseParams,
    DenoisingBatch,
    GapSpec,
    InfillCancelled,
    Segment,
    StepView,
)
from .compile_child import CompilerProcess
from .compiled import CompiledDecoder, keep_inductor_cache
from .confidence import answer_support, model_display, sequence_score
from .encoding import encode_prefixes
from .loading import LoadedModel, load_model
from .paths import PREFIX_CACHE_MB
from .prefix_cache import PrefixCache
from .regions import FillError, Hole, Region, regions_to_parts, split_parts
from .results import GapResult, InfillResult
from .settings import InfillSettings, model_settings
from .threads import governor
from .token_cache import DOCUMENT_WEIGHT, Caches, TokenCache, WorkspaceCaches
from .tokenizer import TokenHealing

__all__ = [
    "Engine",
    "EngineBatch",
    "FillError",
    "Hole",
    "InfillCancelled",
    "InfillRequest",
    "InfillResult",
    "Region",
    "regions_to_parts",
    "split_parts",
]

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
INSTRUCTION = (
    "Complete the code at <CURSOR>. Answer with only the code that goes there, nothing else.\n\n"
    "{prefix}<CURSOR>{suffix}"
)


@dataclass
class InfillRequest:
    prefix: str
    suffix: str
    overrides: dict[str, Any] | None = None
    cancel: CancelToken | None = None
    on_step: Callable[[StepView], None] | None = None
    # Between prefix and suffix: holes and the code between them (`Engine.fill`); None is one plain hole.
    middle: list[str | Hole] | None = None
    # Work computed ahead (an editor's next suggestion): the resident engine runs it only when nothing else waits.
    background: bool = False
    # A LoRA adapter folder to answer with (a workspace's, tuned from this model; `AdapterSet`); None: the model.
    adapter: str | None = None
    # The workspace folder the document belongs to: its token cache (`token_cache`) is mixed into the answer.
    workspace: str | None = None
    # Whether the answer gets the engine's own score (`InfillResult.score`): the language server scores what it
    # shows itself (`confidence.scores`), so it asks for none and the document is searched once (`copy_support`).
    score: bool = True


@dataclass(frozen=True)
class Prepared:
    """A request laid out for the model: its settings, encoder ids, clamped suffix head and denoising params."""

    settings: InfillSettings
    encoder_ids: list[int]
    head_ids: list[int]
    params: DenoiseParams
    segments: tuple[Segment, ...] | None = None  # several gaps; None: one gap, then head_ids
    around: tuple[tuple[str, str], ...] = ()  # per gap, the request's text before and after it (its copy support)


class Engine:
    """One model, ready to fill gaps. Thread-safe: requests run one at a time on the model."""

    def __init__(self, loaded: LoadedModel, overrides: dict[str, Any] | None = None,
                 prefix_cache_mb: int = PREFIX_CACHE_MB, compile: str = "off"):  # fmt: skip
        self.loaded = loaded
        # The compiling process `canvas-ls engine` started before this engine loaded (`compile_child.start_early`):
        # the warm-up reads it, or stops it where it is not needed.
        self.early_compiler: CompilerProcess | None = None
        # The batched step's decoder forward (the resident engine's): eager, or compiled once `warm_up` is done.
        self.decoder = CompiledDecoder(loaded.model, compile)
        # Encoder KV of recent prefixes: a keystroke re-encodes only the tail. 0 turns it off.
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 else None
        # LoRA adapters that requests name, held apart from the weights; each has its own prefix cache (its KV).
        self.adapters = AdapterSet(loaded.model)
        self._adapter_caches: dict[str, PrefixCache] = {}
        self.tokenizer = loaded.tokenizer
        generation_config = getattr(loaded.model, "generation_config", None)
        self.settings = InfillSettings().merged(model_settings(loaded.folder, generation_config)).merged(overrides)
        self.display = model_display(loaded.folder)
        self._stop_ids = _stop_ids(loaded.model, self.tokenizer)
        self.lock = threading.Lock()  # one decoder forward at a time (EngineBatch and the single-request path)
        # On a CPU: the intra-op threads, from the cores this process can get now (`engine/threads.py`)
        self.threads = governor() if loaded.device.type == "cpu" else None
        self._newline_ids: frozenset[int] | None = None
        self.healing = TokenHealing(self.tokenizer, loaded.model.config.get_text_config().vocab_size)
        self._healing_masks: dict[str, torch.Tensor] = {}  # cut text -> allowed first tokens
        # Per workspace folder, the token n-gram cache of its files (built in the background on first use)
        self.token_caches = WorkspaceCaches(self._encode)

    @classmethod
    def load(
        cls,
        model: str | None = None,
        device: str | None = None,
        overrides: dict[str, Any] | None = None,
        prefix_cache_mb: int = PREFIX_CACHE_MB,
        dtype: str | None = None,
        compile: str = "off",
        adapter: str | None = None,
        quantize: str | None = None,
    ) -> Engine:
        if compile != "off":
            keep_inductor_cache()  # before the load, which fixes inductor's folder
        return cls(load_model(model, device, dtype, adapter, quantize=quantize), overrides, prefix_cache_mb, compile)

    @property
    def name(self) -> str:
        return self.loaded.name

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Around the model's work on its thread: the intra-op thread count the load allows now, and the load
        measured while it computes (`threads.ThreadGovernor.computing`)."""
        return self.threads.computing() if self.threads is not None else contextlib.nullcontext()

    @property
    def steps(self) -> int:
        """Denoising steps taken (batched steps, each one decoder forward, compiled or eager): /health, canvas/stats."""
        return sum(self.decoder.steps.values())

    @property
    def identity(self) -> dict[str, str]:
        """Which model answers (`loading.LoadedModel.identity`): /health reports it; the server checks, keys on it."""
        return self.loaded.identity

    @property
    def dtype(self) -> str:
        """The model's compute dtype, e.g. "bfloat16"."""
        return str(self.loaded.model.dtype).removeprefix("torch.")

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end a gap (EOS ids and pad)."""
        return list(self._stop_ids)

    def infill(
        self,
        prefix: str,
        suffix: str,
        overrides: dict[str, Any] | None = None,
        cancel: CancelToken | None = None,
        on_step: Callable[[StepView], None] | None = None,
        adapter: str | None = None,
        workspace: str | None = None,
        score: bool = True,
    ) -> InfillResult:
        """Fill the gap between `prefix` and `suffix` (with a LoRA `adapter` of this model, and the token cache of
        the `workspace` folder, when given; `score`: the answer's own score too). Raises InfillCancelled when
        `cancel` is set mid-way."""
        return self.run(InfillRequest(prefix, suffix, overrides, cancel, on_step, adapter=adapter, workspace=workspace,
                                      score=score))  # fmt: skip

    def fill(
        self,
        prefix: str,
        middle: list[str | Hole],
        suffix: str,
        overrides: dict[str, Any] | None = None,
        cancel: CancelToken | None = None,
        adapter: str | None = None,
        workspace: str | None = None,
        score: bool = True,
    ) -> InfillResult:
        """Fill every `Hole` of `middle` (holes and the code between them) in one canvas after `prefix`, before
        `suffix`: each gap sees the code on both sides and the other gaps' drafts. The answers are `result.gaps`.
        Raises FillError for a request that cannot be laid out, InfillCancelled when cancelled."""
        return self.run(InfillRequest(prefix, suffix, overrides, cancel, middle=middle, adapter=adapter,
                                      workspace=workspace, score=score))  # fmt: skip

    def run(self, request: InfillRequest) -> InfillResult:
        """One request: a batch of one (the resident engine's path, alone). Raises what its preparation raised, or
        InfillCancelled."""
        outcome = self.infill_batch([request])[0]
        if isinstance(outcome, InfillCancelled):
            raise outcome
        return outcome

    def infill_batch(self, requests: list[InfillRequest]) -> list[InfillResult | InfillCancelled]:
        """Fill several gaps at once: their canvases share each decoder forward. A cancelled request's slot holds
        its InfillCancelled; the others complete."""
        batch = self.batch()
        for _, error in batch.add_many(requests):
            raise error
        outcomes: dict[int, InfillResult | InfillCancelled] = {}
        while batch:
            outcomes.update((id(request), outcome) for request, outcome in batch.step())
        return [outcomes[id(request)] for request in requests]

    def batch(self) -> EngineBatch:
        """An empty batch that requests can join between denoising steps (the resident engine's scheduler)."""
        return EngineBatch(self)

    def warm_up(self, background: bool = True, elsewhere: bool = True) -> None:
        """Compile the batched step's decoder (when `compile` turned it on) on the inputs of made-up requests: one
        alone, then two together (a batch of one is its own graph). Requests meanwhile run eager.

        One prefix runs past the sliding window: there sliding and full layers hold caches of different lengths,
        and a graph compiled only on short prefixes assumed them equal (dynamo's duck sizing) and compiled again,
        ~20 s on 2 cores, on the first long request. On the CPU, graphs not saved yet are compiled by a child
        process at the lowest priority (unless `elsewhere` is False) and loaded as it saves them."""

        def examples() -> list[dict[str, Any]]:
            window = getattr(self.loaded.model.config.get_text_config(), "sliding_window", None) or 0
            long = "".join(f"x{i} = {i}\n" for i in range(window // 3 + 8)) + "def area(r):\n    return "
            found = []
            for prefixes in ([long], ["import os\n\n\ndef main():\n    ", long]):
                batch = self.batch()
                for error in (error for _, error in batch.add_many([InfillRequest(p, "\n") for p in prefixes])):
                    raise error
                found.append(batch.decoder_inputs())
            return found

        if elsewhere and self.decoder.enabled and self.loaded.folder is not None:  # the child loads the same folder
            self.decoder.compiler = (str(self.loaded.folder), self.dtype, self.loaded.quantized)
        self.decoder.early, self.early_compiler = self.early_compiler, None
        self.decoder.warm_up(examples, background)

    def prepare(self, request: InfillRequest) -> Prepared:
        """A request tokenized and laid out (the model's settings with its overrides): what a CanvasJob starts from."""
        settings = self.settings.merged(request.overrides)
        if request.middle is not None:
            return self._prepare_fill(request, settings)
        canvas = settings.layout == "canvas"
        healed = self.healing.cut(request.prefix) if canvas and settings.token_healing else ""
        allowed = self._first_slot_allowed(healed) if healed else None
        prefix_ids = self._encode(request.prefix[: len(request.prefix) - len(healed)])
        suffix_ids = self._encode(request.suffix)
        if canvas:
            encoder_ids = self._with_bos(prefix_ids[-settings.max_prefix_tokens :])
            head_ids = suffix_ids[: settings.suffix_head_tokens]
        else:
            encoder_ids, head_ids = self._prompt_ids(prefix_ids, suffix_ids, settings), []
        line_ends = self._line_end_ids() if settings.single_line else frozenset()
        token_cache = self._token_cache(request, settings, prefix_ids, [suffix_ids])
        params = DenoiseParams(settings, settings.max_new_tokens, line_ends, healed, allowed, token_cache)
        return Prepared(settings, encoder_ids, head_ids, params, around=((request.prefix, request.suffix),))

    def _token_cache(self, request: InfillRequest, settings: InfillSettings, before: list[int],
                     after: list[list[int]]) -> Caches | None:  # fmt: skip
        """The token cache of the user's own code, where the settings weigh it: the document's (its tokens `before`
        the first gap and the parts `after` it: the editor's text, unsaved edits included) and its workspace's,
        where the request names one and its cache is built."""
        if settings.workspace_cache <= 0:
            return None
        caches = [(TokenCache.of_document(before, after), DOCUMENT_WEIGHT)]
        workspace = self.token_caches.get(request.workspace) if request.workspace is not None else None
        return Caches(caches if workspace is None else [*caches, (workspace, 1.0)], before)

    def _prepare_fill(self, request: InfillRequest, settings: InfillSettings) -> Prepared:
        """Lay out [prefix] -> encoder, then [gap | clamped | gap | ... | suffix head] in the canvas. Each gap is
        token-healed against the text before it; a rewrite gap starts from its span's tokens."""
        if settings.layout != "canvas":
            raise FillError("several holes need the 'canvas' layout (this model's layout is 'prompt')")
        texts, holes = [request.prefix], []
        for part in request.middle or []:
            if isinstance(part, Hole):
                holes.append(part)
                texts.append("")
            else:
                texts[-1] += part
        texts[-1] += request.suffix
        if not holes:
            raise FillError("nothing to fill: no hole given")
        if len(holes) > settings.max_holes:
            raise FillError(f"{len(holes)} holes, over the limit of {settings.max_holes} (setting max_holes)")
        segments: list[Segment] = []
        encoder_ids: list[int] = []
        seen = ""  # the document's text before the current gap (the holes' own text left out)
        parts: list[list[int]] = []  # the tokens of the document's text between the gaps
        for index, hole in enumerate(holes):
            if not 0 < hole.strength <= 1:
                raise FillError(f"hole {index + 1}: strength must be in (0, 1], got {hole.strength}")
            before = texts[index]
            seen += before
            cut = self.healing.cut(seen) if settings.token_healing and before else ""
            kept = self._encode(before[: len(before) - len(cut)])
            parts.append(kept)
            if index == 0:
                encoder_ids = self._with_bos(kept[-settings.max_prefix_tokens :])
            else:
                segments.append(Clamp(tuple(kept)))
            allowed = self._first_slot_allowed(cut) if cut else None
            init: list[int] = self._encode(cut + hole.text) if hole.strength < 1 else []
            length = len(init) + max(4, len(init) // 2) if init else settings.gap_tokens
            segments.append(GapSpec(length, tuple(init), hole.strength, allowed, cut,
                                    max(settings.max_new_tokens, length)))  # fmt: skip
        parts.append(self._encode(texts[-1]))
        segments.append(Clamp(tuple(parts[-1][: settings.suffix_head_tokens])))
        gap_slots = sum(s.length for s in segments if isinstance(s, GapSpec))
        canvas = gap_slots + sum(len(s.ids) for s in segments if isinstance(s, Clamp))
        if gap_slots > settings.fill_tokens:
            raise FillError(f"the holes need {gap_slots} gap slots, over fill_tokens={settings.fill_tokens}")
        if canvas > settings.max_canvas_tokens:
            raise FillError(f"the holes and the code between them take {canvas} tokens, over "
                            f"max_canvas_tokens={settings.max_canvas_tokens}: select a smaller region")  # fmt: skip
        # One hole continues canvas after canvas up to its answer's bound; several share the fill's budget.
        budget = max(settings.max_new_tokens, gap_slots) if len(holes) == 1 else max(settings.fill_tokens, gap_slots)
        params = DenoiseParams(settings, budget, token_cache=self._token_cache(request, settings, parts[0], parts[1:]))
        around = tuple(("".join(texts[: i + 1]), "".join(texts[i + 1 :])) for i in range(len(holes)))
        return Prepared(settings, encoder_ids, [], params, tuple(segments), around)

    def cache_for(self, settings: InfillSettings) -> PrefixCache | None:
        """The prefix KV cache a request may use (none when its settings turn reuse off): the model's, or that of
        the adapter it computes with now (an adapter changes the KV); an adapter no longer loaded loses its cache."""
        adapter = self.adapters.active
        if not settings.reuse_prefix or self.prefix_cache is None or adapter is None:
            return self.prefix_cache if settings.reuse_prefix else None
        for gone in set(self._adapter_caches) - set(self.adapters.names):
            del self._adapter_caches[gone]
        if adapter not in self._adapter_caches:
            self._adapter_caches[adapter] = PrefixCache(self.prefix_cache.max_bytes)
        return self._adapter_caches[adapter]

    def prefix_cache_bytes(self) -> int:
        """Bytes of KV held by the prefix caches (the model's and its adapters')."""
        caches = [self.prefix_cache, *list(self._adapter_caches.values())]
        return sum(cache.nbytes for cache in caches if cache is not None)

    def use_adapter(self, adapter: str | None) -> None:
        """Compute with `adapter` from now on (under `lock`). The first adapter turns the compiled step off: its
        graph holds neither the LoRA layers nor the switch between adapters."""
        if adapter is not None and self.adapters.peft is None:
            self.decoder.stop("LoRA adapters in use: the step runs eager")
        self.adapters.activate(adapter)

    def _line_end_ids(self) -> frozenset[int]:
        """Vocabulary ids whose text holds a line break (computed once)."""
        if self._newline_ids is None:
            self._newline_ids = frozenset(i for i, text in enumerate(self.healing.texts) if "\n" in text)
        return self._newline_ids

    def _first_slot_allowed(self, cut: str) -> torch.Tensor:
        """[V] bool on the model's device: the ids that may re-write `cut`, and the stop ids (nothing to add is
        still an answer)."""
        allowed = self._healing_masks.get(cut)
        if allowed is None:
            allowed = torch.zeros(self.healing.vocab_size, dtype=torch.bool)
            allowed[self.healing.first_tokens(cut) + self._stop_ids] = True
            allowed = allowed.to(self.loaded.model.device)
            if len(self._healing_masks) < 256:
                self._healing_masks[cut] = allowed
        return allowed

    def result(self, prepared: Prepared, out: CanvasOutput, score: bool = True) -> InfillResult:
        """The answer of a finished CanvasJob: decoded text, per-gap answers, timings, and (`score`) the confidence
        score of each gap (None when not asked for)."""
        specs = [s for s in prepared.segments or () if isinstance(s, GapSpec)]
        cuts = [spec.healed for spec in specs] if specs else [prepared.params.healed]
        texts = [self.tokenizer.decode(gap.tokens, skip_special_tokens=True).removeprefix(cut if gap.tokens else "")
                 for gap, cut in zip(out.gaps, cuts, strict=True)]  # fmt: skip
        kind, threshold = self.display.for_request(prepared.settings.single_line)
        token_texts = [self.tokenizer.decode([t]) for t in out.tokens]  # gap 0's (a fill's others: their own)

        def texts_of(tokens: list[int]) -> list[str]:
            return token_texts if tokens == out.tokens else [self.tokenizer.decode([t]) for t in tokens]

        gaps = [GapResult(
            text=text,
            tokens=gap.tokens,
            token_texts=texts_of(gap.tokens),
            confidence=[round(c, 4) for c in gap.confidence],
            score=round(sequence_score(gap.confidence, kind, text, answer_support(kind, text, side)), 4)
            if score else None,
            healed=cut if gap.tokens else "",
            stop_reason="eos" if gap.ended_with_eos else "truncated",
        ) for gap, cut, text, side in zip(out.gaps, cuts, texts, prepared.around or [None] * len(texts),
                                          strict=True)]  # fmt: skip
        produced = len(out.tokens) + sum(1 for gap in out.gaps if gap.ended_with_eos)
        return InfillResult(
            text=gaps[0].text,
            tokens=out.tokens,
            token_texts=token_texts,
            confidence=[round(c, 4) for c in out.confidence],
            steps=out.steps,
            forward_passes=out.forward_passes,
            tokens_per_forward=round(produced / max(out.forward_passes, 1), 3),
            canvases=out.canvases,
            canvas_stops=out.canvas_stops,
            stop_reason="eos" if out.ended_with_eos else "max_tokens",
            encode_ms=round(out.encode_seconds * 1000, 2),
            denoise_ms=round(out.denoise_seconds * 1000, 2),
            prefix_tokens=len(prepared.encoder_ids),
            prefix_reused_tokens=out.prefix_reused,
            suffix_head_tokens=sum(len(s.ids) for s in prepared.segments[-1:] if isinstance(s, Clamp))
            if specs
            else len(prepared.head_ids),
            layout=prepared.settings.layout,
            model=self.name,
            dtype=self.dtype,
            healed=gaps[0].healed,
            settings=prepared.settings.to_dict(),
            gaps=gaps,
            score=gaps[0].score,
            score_kind=kind,
            min_confidence=threshold,
        )

    # -- layouts -------------------------------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _with_bos(self, ids: list[int]) -> list[int]:
        """The encoder needs at least one token; models expect BOS first."""
        start = self.tokenizer.bos_token_id
        if start is None:
            start = self._stop_ids[0]
        return [start, *ids]

    def _prompt_ids(self, prefix_ids: list[int], suffix_ids: list[int], settings: InfillSettings) -> list[int]:
        """The "prompt" layout: prefix and suffix (their tokens) both in the encoder prompt, the canvas holds only the
        middle."""
        prefix = self.tokenizer.decode(prefix_ids[-settings.max_prefix_tokens :])
        suffix = self.tokenizer.decode(suffix_ids[: settings.max_suffix_tokens])
        template = settings.prompt_template
        vocab = self.tokenizer.get_vocab()
        if template == "auto" and all(t in vocab for t in FIM_TOKENS):
            template = "{}{{prefix}}{}{{suffix}}{}".format(*FIM_TOKENS)
        elif template == "auto" and getattr(self.tokenizer, "chat_template", None):
            message = [{"role": "user", "content": INSTRUCTION.format(prefix=prefix, suffix=suffix)}]
            ids = self.tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        elif template == "auto":
            template = INSTRUCTION
        return self._with_bos(self._encode(template.format(prefix=prefix, suffix=suffix)))


class EngineBatch:
    """Requests denoising together. `add` encodes a request's prefix; each `step` runs one decoder forward shared
    by every request in the batch and returns the requests that ended, with their outcomes."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._batch = DenoisingBatch(engine.loaded.model, pad_id=engine.stop_ids[-1], decoder=engine.decoder)
        self._requests: dict[int, tuple[InfillRequest, Prepared]] = {}  # by job serial
        self.adapter: str | None = None  # every request in the batch answers with this adapter (one forward)

    def __len__(self) -> int:
        return len(self._batch)

    def add(self, request: InfillRequest) -> None:
        """Admit one request (raises what its preparation raised)."""
        for _, error in self.add_many([request]):
            raise error

    def add_many(self, requests: list[InfillRequest]) -> list[tuple[InfillRequest, Exception]]:
        """Admit requests that arrived together: their prefixes are encoded in one encoder forward. Returns the
        ones that could not be admitted (a bad setting, a failed encode), with why; the others joined the batch."""
        engine = self.engine
        failed: list[tuple[InfillRequest, Exception]] = []
        by_cache: dict[bool, list[tuple[InfillRequest, Prepared]]] = {}
        if not self._batch and requests:
            self.adapter = requests[0].adapter
        for request in requests:
            if request.adapter != self.adapter:  # the scheduler batches one adapter at a time
                failed.append((request, ValueError("a batch answers with one adapter at a time")))
                continue
            try:
                prepared = engine.prepare(request)
            except Exception as exc:  # this request's problem, not its neighbours'
                failed.append((request, exc))
                continue
            # requests that skip the prefix cache are encoded apart from those that use it
            by_cache.setdefault(prepared.settings.reuse_prefix, []).append((request, prepared))
        for group in by_cache.values():
            try:
                with engine.lock, engine.computing():
                    engine.use_adapter(self.adapter)
                    cache = engine.cache_for(group[0][1].settings)
                    encoded = encode_prefixes(engine.loaded.model, [p.encoder_ids for _, p in group], cache)
                    jobs = [CanvasJob(engine.loaded.model, p.encoder_ids, p.head_ids, p.params, engine.stop_ids,
                                      request.cancel, request.on_step, encoded=done, segments=p.segments)
                            for (request, p), done in zip(group, encoded, strict=True)]  # fmt: skip
            except Exception as exc:
                failed += [(request, exc) for request, _ in group]
                continue
            for job, item in zip(jobs, group, strict=True):
                self._requests[job.serial] = item
                self._batch.add(job)
        return failed

    def decoder_inputs(self) -> dict[str, Any]:
        """The inputs of this batch's next decoder forward (what the compiler warms up on)."""
        with self.engine.lock:
            return self._batch.decoder_inputs()

    def step(self) -> list[tuple[InfillRequest, InfillResult | InfillCancelled]]:
        with self.engine.lock, self.engine.computing():
            self.engine.use_adapter(self.adapter)
            ended = self._batch.step()
        outcomes: list[tuple[InfillRequest, InfillResult | InfillCancelled]] = []
        for job in ended:
            request, prepared = self._requests.pop(job.serial)
            outcome = job.error if job.error is not None else self.engine.result(prepared, job.out, request.score)
            if isinstance(outcome, InfillResult):
                outcome.adapter = request.adapter
            outcomes.append((request, outcome))
        return outcomes


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config, the model config and the tokenizer, then pad: any of them ends a gap."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config.get_text_config(), tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    for source in (model.config.get_text_config(), tokenizer):
        value = getattr(source, "pad_token_id", None)
        if value is not None:
            ids.append(value)
    if not ids:
        raise ValueError("the model defines no EOS or pad token, so a gap could never end")
    return list(dict.fromkeys(ids))

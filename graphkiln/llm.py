"""graphkiln.LLM: the object users generate with, whichever runner (eager or compiled) is behind it."""

from __future__ import annotations

import dataclasses
import operator
import re
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from graphkiln.chat import template_messages
from graphkiln.checks import is_int
from graphkiln.compiler.compile import CompileReport, compile_module
from graphkiln.compiler.config import CompileConfig
from graphkiln.errors import ConfigError, ModelFileError, RequestError, RequestFailedError
from graphkiln.models import load_model, resolve_dtype
from graphkiln.models.config import model_config_from_hf, read_hf_config
from graphkiln.models.quant_scheme import check_tensor_parallel, model_scheme
from graphkiln.models.sharding import Shard, check_shardable
from graphkiln.models.tiny import TINY_NAME, tiny_model_dir
from graphkiln.models.tokenizer import IncrementalDecoder, Tokenizer
from graphkiln.runtime.builder import build_engine
from graphkiln.runtime.config import EngineConfig, engine_config
from graphkiln.runtime.engine import Engine
from graphkiln.runtime.readback import TokenLogprobs
from graphkiln.runtime.memory import resolve_device
from graphkiln.runtime.sampling_params import SamplingParams
from graphkiln.runtime.scheduler import Sequence as Request
from graphkiln.runtime.stats import EngineStats, LoadStats
from graphkiln.runtime.tensor_parallel import parallel_engine

Prompt = str | Sequence[int]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name


@dataclass(frozen=True)
class RequestOutput:
    """One finished request: its prompt ids, generated ids and text, logprobs when asked (one TokenLogprobs a
    token), and timings."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str
    queue_s: float
    time_to_first_token_s: float
    total_s: float

    @property
    def decode_s(self) -> float:
        return self.total_s - self.time_to_first_token_s

    @property
    def tokens_per_s(self) -> float:
        """Output tokens over the whole request time, as a user sees it."""
        return len(self.token_ids) / self.total_s if self.total_s > 0 else float("inf")


@dataclass(frozen=True)
class StreamDelta:
    """One new token of a stream: the text it adds, its logprobs when asked, and why the stream ends on it."""

    token_id: int
    text: str
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None


def resolve_model_dir(model: str | Path) -> Path:
    """'tiny', a model directory, or a Hugging Face hub id (a string `org/name` naming no directory here),
    found in the hub's local cache: graphkiln never downloads."""
    if not isinstance(model, (str, Path)) or not str(model):
        raise ConfigError(f"model={model!r}; give 'tiny', a model directory (str or Path) or a hub id 'org/name'")
    if str(model) == TINY_NAME:
        return tiny_model_dir()
    return hub_snapshot(model) if is_hub_id(model) else Path(model)


def is_hub_id(model: str | Path) -> bool:
    return isinstance(model, str) and HUB_ID.fullmatch(model) is not None and not Path(model).exists()


def hub_snapshot(repo_id: str) -> Path:
    """The snapshot folder of `repo_id`'s main revision in the hub's cache (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, ValueError) as e:  # not cached, cached in part, or not a valid repository id
        why = "" if type(e) is LocalEntryNotFoundError else f" ({e})"  # the plain case needs no more words
        raise ModelFileError(
            f"{repo_id}: no such directory, and not in the Hugging Face cache {constants.HF_HUB_CACHE}{why}; "
            f"download it with `hf download {repo_id}` (or set HF_HUB_CACHE to the cache holding it), or pass a "
            "model directory"
        ) from e


class LLM:
    """Generate, stream and score with one engine. `close()` (or a `with` block) frees its device memory
    at once; dropping the last reference frees it too."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, compile_counters: dict[str, int] | None = None) -> None:
        self._engine: Engine | None = engine
        self._close = weakref.finalize(self, engine.close)  # runs once: at close(), on collection or at exit
        self.tokenizer = tokenizer
        self.compile_counters = compile_counters
        self.compile_report: CompileReport | None = None
        self.manifest: dict | None = None
        self.load_stats: LoadStats | None = None  # set by graphkiln.load

    @classmethod
    def eager(
        cls,
        model: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        engine: EngineConfig | None = None,
        tensor_parallel_size: int = 1,
        **options,
    ) -> LLM:
        """The eager reference engine: no compile, SDPA attention unless `attention_backend` says otherwise.
        What compiled engines are checked against. `options` override fields of `engine` (EngineConfig).
        `tensor_parallel_size` > 1 splits the model over that many processes (started here, as `load` does)."""
        if not is_int(tensor_parallel_size) or tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size!r}: give an int >= 1 (1: this process "
                              "alone)")  # fmt: skip
        config = engine_config(engine, **options)
        model_dir = resolve_model_dir(model)
        device = resolve_device(device)
        tokenizer = Tokenizer.from_dir(model_dir)  # first: an engine (or a group of ranks) is not left behind
        if tensor_parallel_size > 1:
            check_shardable(model_config_from_hf(read_hf_config(model_dir), model_dir), tensor_parallel_size)
            check_tensor_parallel(model_scheme(model_dir, None), tensor_parallel_size)
            load_rank = partial(_eager_rank, model_dir, device.type, resolve_dtype(dtype))
            return cls(parallel_engine(tensor_parallel_size, device.type, load_rank, config), tokenizer)
        net = load_model(model_dir, device, resolve_dtype(dtype))
        return cls(build_engine(net, None, config), tokenizer)

    @classmethod
    def compile(
        cls, model: str | Path, config: CompileConfig | None = None, engine: EngineConfig | None = None, **options
    ) -> LLM:
        """Trace and compile in this process (no artifacts written) and serve the compiled model."""
        config = config or CompileConfig()
        if config.tensor_parallel_size > 1:
            raise ConfigError(
                f"LLM.compile serves one rank, not tensor_parallel_size={config.tensor_parallel_size}; compile "
                "with graphkiln.compile_model(MODEL, OUT, config) and graphkiln.load(OUT)"
            )
        serving = engine_config(engine, **options)
        model_dir = resolve_model_dir(model)
        net = load_model(model_dir, resolve_device(config.device), resolve_dtype(config.dtype),
                         quantization=config.quantization)
        compiled, report = compile_module(net, config)
        llm = cls(build_engine(net, compiled, serving), Tokenizer.from_dir(model_dir), report.counters.as_dict())
        llm.compile_report = report
        return llm

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RequestError("this LLM is closed; load the artifact again to serve it")
        return self._engine

    def stats(self) -> EngineStats:
        """The KV cache, the captured graphs (sizes, capture time, pool bytes, replays; which were prepared
        when), steps run without a graph, the engine config, the compile counters of the compile behind
        this LLM and, after `graphkiln.load`, where the load spent its time (`load`)."""
        engine = self.engine
        stats = engine.stats()
        load = self.load_stats
        if load is not None:
            done, first = engine.preparation.finished_at, engine.first_token_at
            load = dataclasses.replace(load, prepare_s=None if done is None else done - load.started,
                                       first_token_s=None if first is None else first - load.started)  # fmt: skip
        return dataclasses.replace(stats, compile_counters=self.compile_counters, load=load)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the compiled model serves: a background load (the default) returns with the weights in
        and serves with the model itself until its first background job has loaded the compiled pieces.
        False on timeout; the error that kept them out (an ArtifactError naming the piece) is raised."""
        return self.engine.wait_compiled(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the graphs (or warm-ups) being prepared in the background are all done; False if
        `timeout` seconds passed first. Requests need not wait for this: benchmarks do. A tensor-parallel
        group that failed meanwhile (a rank died) raises its RankFailedError."""
        return self.engine.wait_ready(timeout)

    def close(self) -> None:
        """Abort what is running and free the KV cache, graphs and weights now; the LLM is unusable after."""
        self._engine = None
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt plus output) this engine serves; a prompt of exactly this many tokens still
        gets its one token, which the KV cache never holds."""
        return self.engine.scheduler.max_context

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model directory has no tokenizer; pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        try:
            return [operator.index(t) for t in prompt]
        except TypeError:
            raise RequestError(f"prompt {prompt!r}: give a string or a list of token ids (ints)") from None

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); results come back in prompt order.

        A request that fails inside an engine step (a device or runtime fault) does not stop the others:
        once they have finished, RequestFailedError names the failed ones, with every output on its
        `outputs` (the failed ones with finish_reason "error"). An interrupt aborts this call's requests."""
        prompts = _prompt_list(prompts)
        params_list = _broadcast(params, len(prompts))
        encoded = [self.encode(p) for p in prompts]
        seqs = []
        try:
            for ids, p in zip(encoded, params_list):
                seqs.append(self.engine.add_request(ids, p))
            while any(s.finish_reason is None for s in seqs):
                self.engine.step()
        finally:
            self._abort_unfinished(seqs)
        outputs = [self._output(s) for s in seqs]
        failed = [(f"request {s.request_id} (prompt {i})", s) for i, s in enumerate(seqs) if s.error is not None]
        if failed:
            raise _failure(failed, outputs)
        return outputs

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield each new token with the text it adds, as soon as a step produces it. Streams, generate and
        score may interleave on one LLM: whichever drives a step, its tokens wait on their request for
        their stream. Closing the stream early aborts the request; a request failing in a step raises
        RequestFailedError after its last token."""
        params = SamplingParams() if params is None else params
        seq = self.engine.add_request(self.encode(prompt), params, stream=True)
        text = IncrementalDecoder(self.decode)
        try:
            while seq.events or seq.finish_reason is None:
                if not seq.events:
                    self.engine.step()
                    continue
                event = seq.events.popleft()
                piece = text.push([event.token_id]) + (text.flush() if event.finish_reason else "")
                yield StreamDelta(event.token_id, piece, event.finish_reason, event.logprobs)
        finally:
            self._abort_unfinished([seq])
        if seq.error is not None:
            raise _failure([(f"request {seq.request_id}", seq)])

    def _abort_unfinished(self, seqs: list[Request]) -> None:
        """Abort what an interrupt (or an error outside any request's step) left running, freeing its blocks."""
        for seq in seqs:
            if seq.finish_reason is None and self._engine is not None:
                self._engine.abort(seq)

    def chat(
        self, conversations: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...]) with the tokenizer's chat template;
        messages are checked and their text parts joined as `graphkiln serve` does (graphkiln/chat.py)."""
        prompts = [self.tokenizer.chat_template_ids(c) if self.tokenizer else None for c in _chats(conversations)]
        if any(p is None for p in prompts):
            raise RequestError("this model's tokenizer has no chat template; use generate() with plain prompts")
        return self.generate(prompts, params)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [num_tokens, vocab] of one prompt."""
        return self.engine.score(self.encode(token_ids))

    def _output(self, seq: Request) -> RequestOutput:
        first_token_time = seq.finish_time if seq.first_token_time is None else seq.first_token_time  # none: failed
        return RequestOutput(
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(seq.output_ids),
            text=self.decode(seq.output_ids),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            queue_s=seq.scheduled_time - seq.arrival,
            time_to_first_token_s=first_token_time - seq.arrival,
            total_s=seq.finish_time - seq.arrival,
        )


def _eager_rank(model_dir: Path, device: str, dtype: torch.dtype, shard: Shard) -> tuple:
    """One tensor-parallel rank's eager model (each rank sees its own GPU as cuda:0)."""
    return load_model(model_dir, device, dtype, shard=shard), None


def _failure(failed: list[tuple[str, Request]], outputs: list[RequestOutput] | None = None) -> RequestFailedError:
    """The error a caller gets for its requests that failed in a step, the first one's error as its cause."""
    cause = failed[0][1].error
    error = RequestFailedError(
        f"{', '.join(name for name, _ in failed)} failed in an engine step ({type(cause).__name__}: {cause}); the "
        "engine freed what they held and serves on" + ("; every prompt's output is on .outputs" if outputs else ""),
        outputs,
    )
    error.__cause__ = cause
    return error


def _prompt_list(prompts) -> list:
    """`generate`'s prompts as a list: one string is one prompt."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise RequestError(f"prompts={prompts!r:.80}: give a string (one prompt) or a list of prompts, each a string "
                           "or a list of token ids")  # fmt: skip
    prompts = list(prompts)
    if any(isinstance(p, int) for p in prompts):
        raise RequestError("prompts must be strings or lists of token ids; wrap a single token-id prompt in a list")
    return prompts


def _chats(conversations) -> list[list[dict]]:
    """`chat`'s conversations, each checked and normalised for its chat template: one conversation is a list of
    message dicts."""
    if isinstance(conversations, (str, bytes, Mapping)) or not isinstance(conversations, Sequence):
        raise RequestError(f"conversations={conversations!r:.80}: give a conversation (a list of messages, each a "
                           "dict with role and content) or a list of conversations")  # fmt: skip
    if conversations and isinstance(conversations[0], Mapping):
        return [template_messages(conversations)]
    return [template_messages(c, f"conversations.{i}") for i, c in enumerate(conversations)]


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    wrong = [p for p in params if not isinstance(p, SamplingParams)] if isinstance(params, (list, tuple)) else [params]
    if wrong:
        raise RequestError(
            f"params: {wrong[0]!r} is a {type(wrong[0]).__name__}; give a SamplingParams, or a list of one per prompt"
        )
    if len(params) != n:
        raise RequestError(f"{len(params)} SamplingParams given for {n} prompts; give one, or one per prompt")
    return list(params)

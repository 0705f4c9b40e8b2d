"""Command line: `compile-model`, and `graphkiln compile | inspect | generate | serve | keygen`.

Exit codes: 0 success, 2 bad input (one line on stderr naming the problem), 1 internal error.
Progress goes to stderr; results (tables, JSON, generated text) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.config import ATTENTION_BACKENDS, CAPTURE_MODES, DECODE_KERNELS, KV_CACHE_DTYPES
from graphkiln.version import __version__

from . import report

QUANTIZATIONS = ("fp8", "int8", "int4")  # compiler.config's, which imports torch: the CLI's help must not


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2, like every other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _count(low: int, high: int | None = None):
    """An argparse type: an integer >= low (and <= high, when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer {bounds}")
        return value

    return parse


def _given(text: str) -> str:
    """A flag's value that must not be empty (an empty --api-key would turn authentication off)."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a value, or leave the flag out")
    return text


def _compile_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="Hugging Face model directory, hub id (org/name) in the local Hugging Face "
                                      "cache, or 'tiny' for the built-in model")  # fmt: skip
    parser.add_argument("-o", "--out", required=True, type=Path, help="artifact directory to write")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--specialize-sizes", type=_sizes, default=(), metavar="1,2,4,...",
                        help="token counts that get one more Inductor compile each, with the token dim fixed")
    parser.add_argument("--disable-pass", action="append", default=[], metavar="NAME")
    parser.add_argument("--enable-pass", action="append", default=[], metavar="NAME",
                        help="turn on a pass that is off by default (symm_mem_all_reduce; add_rms_norm on the CPU)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="quantize the decoder's linear layers at compile time (fp8: per-channel weights, "
                             "per-token activations; int8: weight-only, per-channel; int4: weight-only, groups "
                             "of 128)")
    parser.add_argument("--tensor-parallel-size", type=_count(1), default=1, metavar="N",
                        help="split the model over N ranks (GPUs, or CPU processes); `load` starts them")
    parser.add_argument("--dump-dir", type=Path, default=None, help="write pass-debugging dumps here")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT if it is a graphkiln artifact (or empty); anything else is never replaced")
    parser.add_argument("--sign-key", type=Path, default=None, metavar="KEY",
                        help="sign the manifest with this Ed25519 private key (PEM; see `graphkiln keygen`)")
    parser.add_argument("--no-build-kernels", dest="build_kernels", action="store_false",
                        help="on CUDA: do not load the artifact once after the compile to build graphkiln's Triton "
                             "kernels for its buckets into this machine's Triton cache and the artifact (a first "
                             "start then builds them)")
    parser.add_argument("--quiet", action="store_true", help="no progress, no summary table")
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    _engine_parser(parser.add_argument_group("serving defaults recorded in the artifact (load can override them)"))
    return parser


def _engine_parser(group) -> None:
    """EngineConfig fields as flags; left out, a flag keeps the default (or the artifact's recorded one)."""
    group.add_argument("--decode-batch-sizes", type=_sizes, default=None, metavar="1,2,4,...",
                       help="decode batch sizes that get a CUDA graph")
    group.add_argument("--prefill-token-buckets", type=_sizes, default=None, metavar="16,32,...",
                       help="prefill token counts that get a CUDA graph")
    group.add_argument("--max-seq-len", type=int, default=None, help="longest prompt plus output")
    group.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens")
    group.add_argument("--gpu-memory-fraction", type=float, default=None, help="share of GPU memory for the KV cache")
    group.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block")
    group.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None)
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                       help="KV cache elements: the model's dtype (auto) or fp8 with a scale per token and head")
    group.add_argument("--capture", choices=CAPTURE_MODES, default=None,
                       help="capture CUDA graphs while serving (default) or before the first request")
    group.add_argument("--decode-kernel", choices=DECODE_KERNELS, default=None,
                       help="Triton decode kernel: by batch size (auto), row gathers (rows) or block copies (blocks)")


ENGINE_FLAGS = (
    "decode_batch_sizes", "prefill_token_buckets", "max_seq_len", "kv_cache_tokens", "gpu_memory_fraction",
    "block_size", "max_num_seqs", "max_num_batched_tokens", "attention_backend", "cuda_graphs", "kv_cache_dtype",
    "capture", "decode_kernel",
)  # fmt: skip


def _engine_options(args) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}


def _config(args):
    import torch

    from graphkiln.compiler.config import CompileConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    fields = {
        "device": device,
        "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        "specialize_sizes": args.specialize_sizes,
        "disabled_passes": tuple(args.disable_pass),
        "enabled_passes": tuple(args.enable_pass),
        "dump_dir": str(args.dump_dir) if args.dump_dir else None,
        "quantization": args.quantization,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    return CompileConfig(**{k: v for k, v in fields.items() if v is not None})


def run_compile(args) -> int:
    from graphkiln.api import compile_model
    from graphkiln.runtime.config import engine_config

    config = _config(args)
    engine = engine_config(**_engine_options(args))
    progress = report.ProgressDisplay(enabled=not args.quiet and not args.json)
    start = time.perf_counter()
    try:
        manifest, rep = compile_model(
            args.model, args.out, config, engine=engine, force=args.force, sign_key=args.sign_key, progress=progress,
            build_kernels=args.build_kernels,
        )
    finally:
        progress.close()
    summary = report.compile_summary(manifest, rep, args.out, time.perf_counter() - start)
    if args.json:
        print(json.dumps(summary, indent=1))
    elif not args.quiet:
        print(report.format_compile_summary(summary))
    return 0


def run_inspect(args) -> int:
    from graphkiln.compiler.manifest import MANIFEST, read_manifest

    if not (args.artifact / MANIFEST).exists():
        from graphkiln.llm import is_hub_id, resolve_model_dir

        model_dir = resolve_model_dir(str(args.artifact)) if str(args.artifact) == "tiny" or is_hub_id(
            str(args.artifact)) else args.artifact
        if (model_dir / "config.json").is_file():
            return _inspect_checkpoint(model_dir, args.json)
    manifest = read_manifest(args.artifact)
    print(json.dumps(manifest, indent=1) if args.json else report.format_manifest(manifest, args.artifact))
    return 0


def _inspect_checkpoint(model_dir: Path, as_json: bool) -> int:
    """A Hugging Face checkpoint as graphkiln would read it (the model, its quantization and each linear layer's
    format), from config.json and the weight files' headers alone; what it cannot read is the error compile-model
    would give."""
    from dataclasses import asdict

    from graphkiln.models.loader import DTYPES, empty_model, weight_files
    from graphkiln.models.quantized_layers import layer_schemes

    try:  # only for its dtype: empty_model reads it again and names what is wrong with it
        stored = json.loads((model_dir / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        stored = None
    stored = stored if isinstance(stored, dict) else {}
    dtype = stored.get("dtype") or stored.get("torch_dtype")
    model = empty_model(model_dir, device="meta", dtype=dtype if dtype in DTYPES else "bfloat16")
    scheme = model.weight_source.scheme
    quantization = None if scheme is None else {"scheme": asdict(scheme), "description": scheme.describe(),
                                                "layers": layer_schemes(model)}
    files = sorted(set(weight_files(model_dir).values()))
    found = {"checkpoint": str(model_dir), "config": asdict(model.cfg), "quantization": quantization,
             "weight_files": {f.name: f.stat().st_size for f in files}}
    print(json.dumps(found, indent=1) if as_json else report.format_checkpoint(found))
    return 0


def run_generate(args) -> int:
    import graphkiln

    params = graphkiln.SamplingParams(  # checked before the artifact loads
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )  # fmt: skip
    llm = graphkiln.load(args.artifact, model=args.model, trusted_keys=args.trusted_key, **_engine_options(args))
    outputs = llm.generate(args.prompt, params)
    llm.wait_compiled()  # an artifact whose pieces cannot be loaded is an error here, not a slow engine
    if args.verbose:
        print(report.format_load_stats(llm.stats().load), file=sys.stderr)
    for prompt, out in zip(args.prompt, outputs):
        print(f"{prompt!r} -> {out.text!r}")
        print(
            f"  {len(out.token_ids)} tokens, first token {out.time_to_first_token_s * 1e3:.1f} ms, "
            f"{out.tokens_per_s:.1f} tokens/s, finish {out.finish_reason}"
        )
        if args.logprobs is not None and out.logprobs:
            pairs = (f"{entry.token_id}:{entry.logprob:.4f}" for entry in out.logprobs)
            print("  logprobs " + " ".join(pairs))
    return 0


def run_keygen(args) -> int:
    from graphkiln.compiler.signing import generate_key_pair

    private, public = generate_key_pair(args.folder)
    print(f"private key {private} (sign with: compile-model ... --sign-key {private}; keep it secret)")
    print(f"public key  {public} (give it to users: graphkiln generate OUT --trusted-key {public})")
    return 0


def _run(handler, args) -> int:
    try:
        return handler(args)
    except GraphkilnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def compile_model_main(argv: list[str] | None = None) -> int:
    parser = _compile_parser(_Parser(prog="compile-model", description="Compile a model into an artifact directory."))
    return _run(run_compile, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    from .cli_serve import serve_parser  # (it imports this module's helpers)

    parser = _Parser(prog="graphkiln", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"graphkiln {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _compile_parser(sub.add_parser("compile", help="compile a model (same as compile-model)")).set_defaults(handler=run_compile)
    inspect = sub.add_parser("inspect", help="print an artifact's manifest and piece table, or how graphkiln reads "
                                             "a model directory (its quantization and each layer's format)")
    inspect.add_argument("artifact", type=Path)
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(handler=run_inspect)
    gen = sub.add_parser("generate", help="generate text with a compiled artifact")
    gen.add_argument("artifact", type=Path)
    gen.add_argument("--model", type=Path, default=None, metavar="DIR",
                     help="the model directory (default: where it was when compiled)")
    gen.add_argument("--trusted-key", type=Path, action="append", default=None, metavar="PATH",
                     help="refuse the artifact unless signed by this public key (PEM); repeat for several")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID",
                     help="stop when this token is generated; repeat for several")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="return logprobs (N alternatives per token); prints each sampled token's logprob")
    gen.add_argument("--verbose", action="store_true", help="print where the load spent its time (stderr)")
    _engine_parser(gen.add_argument_group("engine options (default: what the artifact records)"))
    gen.set_defaults(handler=run_generate)
    serve_parser(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'graphkiln[serve]')"))
    keygen = sub.add_parser("keygen", help="write a new Ed25519 key pair for signing artifacts")
    keygen.add_argument("folder", type=Path, help="where to write graphkiln-sign.pem and graphkiln-sign.pub.pem")
    keygen.set_defaults(handler=run_keygen)
    args = parser.parse_args(argv)
    return _run(args.handler, args)

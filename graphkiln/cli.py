"""Command line: `compile-model`, and `graphkiln compile | inspect | generate | keygen`.

Exit codes: 0 success, 2 bad input (one line on stderr naming the problem), 1 internal error.
Progress goes to stderr; results (tables, JSON, generated text) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from graphkiln.errors import GraphkilnError

from . import report


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _compile_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="Hugging Face model directory, or 'tiny' for the built-in model")
    parser.add_argument("-o", "--out", required=True, type=Path, help="artifact directory to write")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--decode-batch-sizes", type=_sizes, default=None, metavar="1,2,4,...")
    parser.add_argument("--prefill-token-buckets", type=_sizes, default=None, metavar="16,32,...")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--specialize", action=argparse.BooleanOptionalAction, default=None,
                        help="one more Inductor compile per bucket size (default: off)")
    parser.add_argument("--disable-pass", action="append", default=[], metavar="NAME")
    parser.add_argument("--dump-dir", type=Path, default=None, help="write pass-debugging dumps here")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT if it is a graphkiln artifact (or empty); anything else is never replaced")
    parser.add_argument("--sign-key", type=Path, default=None, metavar="KEY",
                        help="sign the manifest with this Ed25519 private key (PEM; see `graphkiln keygen`)")
    parser.add_argument("--quiet", action="store_true", help="no progress, no summary table")
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    return parser


def _config(args):
    import torch

    from graphkiln.compiler.config import CompileConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    fields = {
        "device": device,
        "dtype": args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        "decode_batch_sizes": args.decode_batch_sizes,
        "prefill_token_buckets": args.prefill_token_buckets,
        "max_seq_len": args.max_seq_len,
        "specialize": args.specialize,
        "disabled_passes": tuple(args.disable_pass),
        "dump_dir": str(args.dump_dir) if args.dump_dir else None,
    }
    return CompileConfig(**{k: v for k, v in fields.items() if v is not None})


def run_compile(args) -> int:
    from graphkiln.api import compile_model

    config = _config(args)
    bar = report.ProgressBar(enabled=not args.quiet and not args.json)
    start = time.perf_counter()
    try:
        manifest, rep = compile_model(
            args.model, args.out, config, force=args.force, sign_key=args.sign_key, progress=bar
        )
    finally:
        bar.close()
    summary = report.compile_summary(manifest, rep, args.out, time.perf_counter() - start)
    if args.json:
        print(json.dumps(summary, indent=1))
    elif not args.quiet:
        print(report.format_compile_summary(summary))
    return 0


def run_inspect(args) -> int:
    from graphkiln.compiler.manifest import read_manifest

    manifest = read_manifest(args.artifact)
    print(json.dumps(manifest, indent=1) if args.json else report.format_manifest(manifest, args.artifact))
    return 0


def run_generate(args) -> int:
    import graphkiln

    llm = graphkiln.load(args.artifact, model=args.model, trusted_keys=args.trusted_key)
    params = graphkiln.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    outputs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outputs):
        print(f"{prompt!r} -> {out.text!r}")
        print(
            f"  {len(out.token_ids)} tokens, first token {out.time_to_first_token_s * 1e3:.1f} ms, "
            f"{out.tokens_per_s:.1f} tokens/s, finish {out.finish_reason}"
        )
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
    parser = _compile_parser(argparse.ArgumentParser(prog="compile-model", description="Compile a model into an artifact directory."))
    return _run(run_compile, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphkiln", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _compile_parser(sub.add_parser("compile", help="compile a model (same as compile-model)")).set_defaults(handler=run_compile)
    inspect = sub.add_parser("inspect", help="print an artifact's manifest and piece table")
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
    gen.set_defaults(handler=run_generate)
    keygen = sub.add_parser("keygen", help="write a new Ed25519 key pair for signing artifacts")
    keygen.add_argument("folder", type=Path, help="where to write graphkiln-sign.pem and graphkiln-sign.pub.pem")
    keygen.set_defaults(handler=run_keygen)
    args = parser.parse_args(argv)
    return _run(args.handler, args)

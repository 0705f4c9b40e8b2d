"""`graphkiln serve`: its flags, and the server started from them (the artifact loaded, or MODEL compiled first)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from . import report
from .cli import QUANTIZATIONS, _config, _count, _engine_options, _engine_parser, _given

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # pip install 'graphkiln[serve]'
API_KEY_ENV = "GRAPHKILN_API_KEY"  # serve's --api-key when not given


def serve_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="OUT", help="an artifact directory; with --compile, a model directory, a hub "
                                                     "id (org/name) in the local Hugging Face cache, or 'tiny'")
    parser.add_argument("--compile", action="store_true",
                        help="OUT is a model: compile it into graphkiln's cache on first start "
                             "(GRAPHKILN_CACHE_DIR, default ~/.cache/graphkiln), and load it from there after")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="with --compile, the device to compile for (default: cuda if available); without, "
                             "an artifact compiled for another is refused")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="with --compile, the dtype to compile in (default: bfloat16 on cuda, float32 on cpu); "
                             "without, an artifact compiled in another is refused")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="with --compile: quantize the decoder's linear layers (see compile-model --help)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_count(0, 65535), default=8000,
                        help="port (default 8000; 0: any free one, printed)")
    parser.add_argument("--api-key", type=_given, default=None, metavar="KEY",
                        help=f"require Authorization: Bearer KEY on every route but /health (default: ${API_KEY_ENV})")
    parser.add_argument("--served-model-name", type=_given, default=None, metavar="NAME",
                        help="the model name clients send (default: 'tiny', the hub id, or the model folder's name)")
    parser.add_argument("--max-queued-requests", type=_count(0), default=256, metavar="N",
                        help="requests admitted beyond --max-num-seqs before new ones get 503 (default 256)")
    parser.add_argument("--max-body-bytes", type=_count(1), default=4 << 20, metavar="N",
                        help="larger request bodies get 413 (default 4 MiB)")
    parser.add_argument("--model", dest="weights", type=Path, default=None, metavar="DIR",
                        help="the model directory, if it moved since the artifact was compiled")
    parser.add_argument("--trusted-key", type=Path, action="append", default=None, metavar="PATH",
                        help="refuse the artifact unless signed by this public key (PEM); repeat for several")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                        help="uvicorn's log level (info: one line per request)")
    _engine_parser(parser.add_argument_group("engine options (default: what the artifact records)"))
    parser.set_defaults(handler=run_serve, specialize_sizes=(), disable_pass=[], enable_pass=[], dump_dir=None,
                        tensor_parallel_size=1)


def run_serve(args) -> int:
    from graphkiln.errors import ConfigError

    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"graphkiln serve needs {', '.join(missing)}; pip install 'graphkiln[serve]'")
    if args.compile and args.trusted_key:
        raise ConfigError("--trusted-key checks a signed artifact; --compile makes an unsigned one: use one of them")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key == "":
        raise ConfigError(f"{API_KEY_ENV} is set but empty; give a key, or unset it for none")
    from graphkiln.compiler.manifest import MANIFEST
    from graphkiln.models.switch_interval import serve_switch_interval
    from graphkiln.serve.app import ServerConfig
    from graphkiln.serve.server import bind, serve

    if not args.compile and not (Path(args.model) / MANIFEST).is_file():
        raise ConfigError(f"{args.model}: not a graphkiln artifact (no {MANIFEST}); compile it first "
                          f"(compile-model {args.model} -o OUT), or pass --compile to compile it into graphkiln's "
                          "cache on first start")  # fmt: skip
    switch_interval = serve_switch_interval()  # a bad setting is said before the model loads
    sock = bind(args.host, args.port)  # before the model loads: a port in use is said at once
    try:
        llm = _serving_llm(args)
        config = ServerConfig(
            model_name=args.served_model_name or _model_name(_served_source(args, llm.manifest)),
            api_key=api_key,
            max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
        )  # fmt: skip
        serve(llm, config, sock, args.log_level, switch_interval)
    finally:
        sock.close()
    return 0


def _serving_llm(args):
    """The artifact OUT loaded (--device and --dtype, when given, must be those it was compiled for); with
    --compile, MODEL compiled into graphkiln's cache first (once)."""
    import graphkiln
    from graphkiln.errors import ConfigError

    if not args.compile:
        if args.quantization:
            raise ConfigError(f"--quantization {args.quantization} needs --compile: {args.model} is compiled already; "
                              f"serve the model with --compile, or compile it with --quantization {args.quantization}")
        return graphkiln.load(args.model, model=args.weights, device=args.device, dtype=args.dtype,
                              trusted_keys=args.trusted_key, **_engine_options(args))
    progress = report.ProgressDisplay()
    try:
        out = graphkiln.cached_artifact(args.model, _config(args), progress=progress)
    finally:
        progress.close()
    return graphkiln.load(out, model=args.model, on_mismatch="recompile", **_engine_options(args))


def _served_source(args, manifest: dict) -> str:
    """What the served model is named after: MODEL with --compile, else the folder it was compiled from, or the
    --model DIR that load took in place of a model.source that names none."""
    from graphkiln.compiler.manifest import recorded_source
    from graphkiln.errors import ArtifactError

    if args.compile:
        return args.model
    try:
        return recorded_source(manifest, Path(args.model))
    except ArtifactError:
        return str(args.weights)  # (load refuses such an artifact without --model)


def _model_name(source: str) -> str:
    """The name clients ask for: 'tiny' or a hub id as it is, a model directory by its folder's name."""
    from graphkiln.llm import is_hub_id

    return source if source == "tiny" or is_hub_id(source) else Path(source).name

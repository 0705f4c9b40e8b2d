"""`python -m bench attention --latency`: where a short decode launch's time goes (attention.py's docstring).

The row kernel at its plan, at other `unsplit_tiles` and unsplit, timed three ways from its CUDA graph, each
behind a sleep so that the replay's own launch stays out of the time.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from .attention import Heads, decode_inputs, decode_kernel, parse_shapes
from .common import log
from .measure import flush_l2, in_graph, time_ms

LATENCY_COLUMNS = ["batch", "context", "num_splits", "block_n", "unsplit_tiles", "planned", "cold_us",
                   "inputs_in_l2_us", "warm_us", "empty_replay_us"]


def decode_latency(h: Heads, shapes: str, num_sms: int, unsplit_tiles: tuple[int, ...]) -> list[dict]:
    """At each BATCHxCONTEXT shape, the row kernel at its plan, with each of `unsplit_tiles` and
    unsplit, timed cold, with its inputs in L2 and warm (`--latency`), beside an empty replay's time. A sleep
    queued ahead of each sample keeps the replay's launch out of its time."""
    import torch

    from graphkiln.kernels.decode_attention import paged_decode

    def busy() -> None:  # the device still busy when the replay is queued: its launch stays out of the time
        torch.cuda._sleep(100_000)

    one = torch.zeros(1, device=h.device)
    empty = time_ms(in_graph(lambda: one.add_(1), h.device), h.device, reps=50,
                    before=lambda: (flush_l2(h.device), busy()))
    rows = []
    for batch, context in parse_shapes(shapes):
        args, scales = decode_inputs(h, batch, context)
        planned, _ = decode_kernel(h, "rows", batch, args[6].shape[1] * h.block, args[3], num_sms)
        tensors = [t for t in args + (scales or ()) if isinstance(t, torch.Tensor)]

        def read_inputs() -> None:
            flush_l2(h.device)
            for t in tensors:
                t.to(torch.float32).max()

        variants = [planned, *(replace(planned, unsplit_tiles=m) for m in unsplit_tiles),
                    replace(planned, num_splits=1)]
        for tiles in dict.fromkeys(variants):
            replay = in_graph(lambda t=tiles: paged_decode(*args, **asdict(t), scales=scales), h.device)
            times = {name: time_ms(replay, h.device, reps=50, before=lambda b=before: (b(), busy())).us
                     for name, before in (("cold_us", lambda: flush_l2(h.device)), ("inputs_in_l2_us", read_inputs),
                                          ("warm_us", lambda: None))}
            rows.append(dict(batch=batch, context=context, **asdict(tiles), planned=tiles == planned, **times,
                             empty_replay_us=empty.us))
            measured = ", ".join(f"{name} {us:.1f}" for name, us in times.items())
            log(f"latency {batch}x{context} splits {tiles.num_splits} (unsplit up to {tiles.unsplit_tiles} tiles): "
                f"{measured} (an empty replay {empty.us:.1f})")
    return rows

"""The transformers rows: eager (default dynamic cache) and static cache with its automatic torch.compile."""

from __future__ import annotations

import time

from .child import run_child
from .common import error_text, log
from .timing import decode_cell, free_memory, measure_decode, measure_prefill, now, random_prompts


def _stamp_streamer():
    """A streamer that only records when generate hands it tokens (the first put is the prompt)."""
    try:
        from transformers.generation.streamers import BaseStreamer
    except ImportError:
        BaseStreamer = object

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # generate passes CPU tensors: the device has caught up
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Stamps()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, s, **extra) -> dict:
    import torch

    ids = torch.tensor(prompts, device=s.device)
    streamer = _stamp_streamer()
    t0 = now(s.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=model.generation_config.pad_token_id, streamer=streamer, **extra,
    )
    t1 = now(s.device)
    made = out.shape[1] - ids.shape[1]
    if made != new_tokens:
        raise RuntimeError(f"transformers generated {made} tokens, not {new_tokens}")
    ttft = streamer.times[1] - t0 if len(streamer.times) >= 2 else None
    return {"total_s": t1 - t0, "ttft_s": ttft}


def hf_prefill_ms(model, n: int, s) -> list[float]:
    import torch

    ids = torch.tensor(random_prompts(1, n, model.config.vocab_size, seed=1000 + n), device=s.device)

    def forward():
        try:
            return model(input_ids=ids, use_cache=True, logits_to_keep=1)
        except TypeError:
            return model(input_ids=ids, use_cache=True)

    with torch.inference_mode():
        forward()
        times = []
        for _ in range(s.prefill_reps):
            t = now(s.device)
            forward()
            times.append((now(s.device) - t) * 1e3)
    return times


def _time_eager(model, s, row: dict, save) -> None:
    label = "transformers eager"
    measure_prefill(row, s, label, lambda n: hf_prefill_ms(model, n, s))
    measure_decode(row, s, label, lambda prompts, k: hf_generate(model, prompts, k, s), model.config.vocab_size, save)


def eager(s, mres: dict, row: dict, save) -> None:
    """The model built for this run (then freed), and start to first token in a fresh process."""
    model = mres.pop("_hf_model")
    try:
        _time_eager(model, s, row, save)
    finally:
        del model
        free_memory(s.device)
    try:
        spec = {"mode": "hf_start", "model_dir": mres["model_dir"], "device": s.device, "dtype": s.dtype_name,
                "prompt": random_prompts(1, s.prompt_len, mres["shape"]["vocab_size"], seed=7)[0]}
        start = run_child(spec, {}, timeout=s.child_timeout(reserve=60, cap=300))
        start["cold_s"] = start["warm_s"] = start["start_to_first_token_s"]
        row["start"] = start
        log(f"  transformers eager start to first token: {start['start_to_first_token_s']:.1f} s")
    except Exception as e:  # noqa: BLE001
        row["start"] = {"error": error_text(e)}
        log(f"  transformers eager start failed: {error_text(e)}")


def _time_static(model, s, row: dict, save) -> None:
    """cache_implementation="static": transformers compiles the decode step itself on the first call."""
    extra: dict = {"cache_implementation": "static"}
    if s.device != "cuda":  # transformers auto-compiles on CUDA only unless told to compile everywhere
        from transformers import CompileConfig as HFCompileConfig

        cc = HFCompileConfig()
        cc._compile_all_devices = True
        extra["compile_config"] = cc
    row["note"] = "prefill is not compiled by transformers' auto-compile: see the eager row"
    for b in s.static_batches:
        if s.remaining() < 60:
            row["decode"][str(b)] = {"error": "skipped: time budget spent"}
            continue
        try:
            prompts = random_prompts(b, s.prompt_len, model.config.vocab_size, seed=b)
            log(f"  transformers static batch {b}: first call (compiles)...")
            first = hf_generate(model, prompts, s.new_tokens, s, **extra)  # same shapes as the timed call
            log(f"  transformers static batch {b}: first call {first['total_s']:.1f} s")
            hf_generate(model, prompts, s.new_tokens, s, **extra)  # cudagraph trees record on early calls
            runs = [hf_generate(model, prompts, s.new_tokens, s, **extra) for _ in range(s.decode_reps)]
            cell = decode_cell(runs, s.new_tokens, first_call_s=first["total_s"], first_call_ttft_s=first["ttft_s"])
            row["decode"][str(b)] = cell
            if "first_call_s" not in row:
                row["first_call_s"] = first["total_s"]
            log(f"  transformers static batch {b}: {cell.get('ms_per_token', float('nan')):.3f} ms/token")
        except Exception as e:  # noqa: BLE001
            row["decode"][str(b)] = {"error": error_text(e)}
            log(f"  transformers static batch {b} failed: {error_text(e)}")
        save()


def static(s, mres: dict, row: dict, save) -> None:
    """Loads the saved model; decode only, per --static-batches. Resets Dynamo after."""
    import torch
    from transformers import LlamaForCausalLM

    t = time.time()
    model = LlamaForCausalLM.from_pretrained(mres["model_dir"], dtype=s.dtype).to(s.device).eval()
    row["load_in_process_s"] = time.time() - t
    try:
        _time_static(model, s, row, save)
    finally:
        del model
        torch._dynamo.reset()  # drops the compiled code and its cudagraph trees' memory

"""Train graphkiln's built-in `tiny` model from scratch and write it as a Hugging Face directory.

The corpus is the docstrings of the running interpreter's standard library (PSF License): every
module, class and function docstring of the stdlib's .py files, test suites and site-packages left
out, prose paragraphs reflowed onto one line, exact duplicates dropped. Whole source files go to
one split each, in the order of a hash of their paths: ~2% of the characters held out (never
trained on nor used to choose anything; evaluated once at the end), ~2% validation, the rest train.

A byte-level BPE tokenizer is trained on the train split, then transformers' LlamaForCausalLM
(tied embeddings) with AdamW in bfloat16 autocast. The corpus is small enough for the model to
memorise, so training keeps the weights of the best validation perplexity and stops once it has
stopped improving. The weights are saved in bfloat16. Data order and initialisation follow --seed.

    python tools/train_tiny.py --device cuda --out graphkiln/models/tiny_model
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
import tokenize
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
UNK, BOS, EOS, PAD = range(4)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             intermediate_size=688, vocab_size=4096, max_position_embeddings=2048, rope_theta=10000.0,
             rms_norm_eps=1e-5)
MAX_SAFETENSORS_BYTES = 8_000_000
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
SPLITS = ("train", "valid", "held_out")
SAMPLE_PROMPTS = ("The kiln is", "Return the number of", "This module provides", "The")
PERPLEXITY_METHOD = (
    "exp of the mean next-token negative log-likelihood over the held-out documents, each encoded as "
    "<s> text </s>; every token after <s> (text and </s>) is predicted once from the tokens before it in "
    "its document, documents longer than seq_len+1 tokens cut into windows of seq_len+1 overlapping by one "
    "token; bfloat16 weights as saved, float32 arithmetic"
)
BITS_PER_BYTE_METHOD = "the same summed negative log-likelihood, in bits, per UTF-8 byte of the held-out text"


def stdlib_docstrings(root: Path) -> list[tuple[str, str]]:
    """(path relative to `root`, docstring) for every docstring of every stdlib .py file, in a fixed order."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS & set(rel.parts[:-1]):
            continue
        try:
            with tokenize.open(path) as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)  # dedented, tabs expanded, outer blank lines stripped
                if doc and doc.strip():
                    docs.append((rel.as_posix(), doc))
    return docs


_VERBATIM_LINE = re.compile(r"\s|>>>|\.\.\. |[-*+•] |\d+[.)] |[\W_]+$")


def normalise(doc: str) -> str:
    """Reflow prose paragraphs onto one line with single spaces; keep code, doctests, lists and tables as written."""
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", doc.strip()):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if any(_VERBATIM_LINE.match(line) for line in lines):
            paragraphs.append("\n".join(lines))
        else:
            paragraphs.append(" ".join(" ".join(line.split()) for line in lines))
    return "\n\n".join(paragraphs)


def assign_splits(files: dict[str, list[str]]) -> dict[str, list[str]]:
    """Whole files to splits: in the order of their paths' sha256, the first ~2% of characters are held out,
    the next ~2% validation, the rest train."""
    total = sum(len(doc) for docs in files.values() for doc in docs)
    splits: dict[str, list[str]] = {name: [] for name in SPLITS}
    seen = 0
    for rel in sorted(files, key=lambda rel: hashlib.sha256(rel.encode()).hexdigest()):
        name = "held_out" if seen < 0.02 * total else "valid" if seen < 0.04 * total else "train"
        splits[name].extend(files[rel])
        seen += sum(map(len, files[rel]))
    return splits


def build_corpus(max_docs: int | None) -> tuple[dict[str, list[str]], dict]:
    """The splits' documents (the first occurrence of each text kept) and the facts recorded about them."""
    raw = stdlib_docstrings(Path(sysconfig.get_paths()["stdlib"]))
    files: dict[str, list[str]] = {}
    seen: set[str] = set()
    for rel, doc in raw:
        text = normalise(doc)
        if text not in seen:
            seen.add(text)
            files.setdefault(rel, []).append(text)
    splits = assign_splits(files)
    if max_docs is not None:
        splits = {name: docs[:max_docs] for name, docs in splits.items()}
    digest = hashlib.sha256(json.dumps(splits, ensure_ascii=False).encode()).hexdigest()
    facts = {
        "source": "docstrings of the Python standard library",
        "license": "PSF License",
        "python": platform.python_version(),
        "files": len(files),
        "docstrings": len(raw),
        "documents": {name: len(docs) for name, docs in splits.items()},
        "characters": {name: sum(map(len, docs)) for name, docs in splits.items()},
        "sha256": digest,
        "sha256_of": "UTF-8 of json.dumps({split: [document, ...]}, ensure_ascii=False), splits train, valid, held_out",
    }
    return splits, facts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the special tokens at ids 0..3; encoding prepends <s> like Llama."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [UNK, BOS, EOS, PAD] or tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer: special ids {ids}, vocab {tok.get_vocab_size()} (max {vocab_size})")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each document as <s> ids </s>."""
    return [enc.ids + [EOS] for enc in tok.encode_batch(texts)]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to peak/10 at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def mean_nll(model: LlamaForCausalLM, docs: list[list[int]], seq_len: int, device: torch.device,
             autocast: bool, batch: int = 64) -> tuple[float, int]:
    """(summed next-token NLL, tokens predicted) over `docs`, each cut into windows of seq_len+1 overlapping by one."""
    windows = [d[i:i + seq_len + 1] for d in docs for i in range(0, max(1, len(d) - 1), seq_len)]
    windows = [w for w in windows if len(w) > 1]
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, w in enumerate(chunk):
            ids[row, :len(w)] = torch.tensor(w)
            labels[row, :len(w)] = torch.tensor(w)
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids[:, :-1]).logits  # right padding: causal attention never sees it
        total += F.cross_entropy(logits.float().flatten(0, 1), labels[:, 1:].flatten(), reduction="sum").item()
        count += int((labels[:, 1:] != -100).sum())
    model.train(was_training)
    return total, count


def train(args: argparse.Namespace, model: LlamaForCausalLM, stream: torch.Tensor, valid: list[list[int]],
          device: torch.device) -> dict:
    """AdamW in bfloat16 autocast on random windows of the packed train stream. The corpus is small enough
    to memorise, so the model ends with the weights of the best validation perplexity, and training stops
    once that has not improved for --patience evaluations. Returns the run's facts."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator(device).manual_seed(args.seed)
    stream = stream.to(device)
    offsets = torch.arange(args.seq_len + 1, device=device)
    warmup = max(1, args.steps // 20)
    tokens_per_step = args.batch_size * args.seq_len
    start = last = time.perf_counter()
    losses: list[torch.Tensor] = []
    recent: list[float] = []
    best = {"valid_perplexity": math.inf, "step": 0}
    best_state: dict[str, torch.Tensor] = {}
    step = evals_since_best = 0
    stop = None
    model.train()
    while stop is None:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size, 1), generator=gen, device=device)
        window = stream[starts + offsets]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        step += 1
        out_of_time = time.perf_counter() - start >= args.time_budget_s
        if step % args.eval_every and step < args.steps and not out_of_time:
            continue
        recent = torch.stack(losses).tolist()
        line = (f"step {step:6d}/{args.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  "
                f"{len(recent) * tokens_per_step / (time.perf_counter() - last):,.0f} tok/s")
        nll, n = mean_nll(model, valid, args.seq_len, device, autocast=True)
        ppl = math.exp(nll / n)
        evals_since_best += 1
        if ppl < best["valid_perplexity"]:
            best, evals_since_best = {"valid_perplexity": round(ppl, 3), "step": step}, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        print(f"{line}  valid ppl {ppl:.2f}", flush=True)
        losses, last = [], time.perf_counter()
        stop = ("steps" if step >= args.steps else "time budget" if out_of_time
                else "patience" if evals_since_best >= args.patience else None)
    model.load_state_dict(best_state)
    return {"steps": args.steps, "steps_done": step, "stopped_by": stop, "patience": args.patience, "best": best,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "tokens_per_step": tokens_per_step,
            "train_tokens_seen": step * tokens_per_step, "epochs": round(step * tokens_per_step / len(stream), 2),
            "peak_lr": args.lr, "warmup_steps": warmup, "weight_decay": args.weight_decay,
            "attention_dropout": args.attention_dropout,
            "final_train_loss": round(sum(recent) / len(recent), 4),
            "final_train_loss_over": f"the last {len(recent)} steps",
            "train_wall_time_s": round(time.perf_counter() - start, 1)}


def greedy_samples(model: LlamaForCausalLM, tok: Tokenizer, device: torch.device, new_tokens: int = 32) -> list[dict]:
    """Greedy continuations of SAMPLE_PROMPTS, stopping at </s>."""
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
        out.append({"prompt": prompt, "greedy": tok.decode(gen[0, ids.shape[1]:].tolist())})
    return out


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = dict(zip(("unk_token", "bos_token", "eos_token", "pad_token"), SPECIAL_TOKENS))
    files = {"special_tokens_map.json": special,
             "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                       "model_max_length": SHAPE["max_position_embeddings"],
                                       "chat_template": CHAT_TEMPLATE, **special}}
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.exists() else []
    return f"{names[0] if names else platform.machine()} ({torch.get_num_threads()} threads)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (created; files in it are replaced)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps; the LR schedule spans them")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence and evaluation window")
    p.add_argument("--time-budget-s", type=float, default=300.0, help="stop training after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=25, help="steps between progress lines with validation perplexity")
    p.add_argument("--patience", type=int, default=8, help="stop after this many evaluations without a better one")
    p.add_argument("--max-docs", type=int, help="use only the first N documents of each split (quick tests)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall = time.perf_counter()
    device = torch.device(args.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)

    splits, corpus = build_corpus(args.max_docs)
    tok = train_tokenizer(splits["train"], SHAPE["vocab_size"])
    docs = {name: encode(tok, texts) for name, texts in splits.items()}
    corpus["tokens"] = {name: sum(map(len, d)) for name, d in docs.items()}
    print(f"corpus: python {corpus['python']}, documents {corpus['documents']}, tokens {corpus['tokens']}, "
          f"sha256 {corpus['sha256'][:16]}", flush=True)
    stream = torch.tensor([t for d in docs["train"] for t in d], dtype=torch.long)

    config = LlamaConfig(**SHAPE, tie_word_embeddings=True, attention_dropout=args.attention_dropout,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(config).to(device)
    run = train(args, model, stream, docs["valid"], device)

    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    write_tokenizer(tok, args.out)
    size = (args.out / "model.safetensors").stat().st_size
    if size > MAX_SAFETENSORS_BYTES:
        raise SystemExit(f"model.safetensors is {size} bytes, over {MAX_SAFETENSORS_BYTES}")

    model.float().eval()  # the saved bfloat16 values, evaluated in float32
    nll, n = mean_nll(model, docs["held_out"], args.seq_len, device, autocast=False)
    held_out = {"perplexity": round(math.exp(nll / n), 3), "tokens_predicted": n,
                "bits_per_byte": round(nll / math.log(2) / len("".join(splits["held_out"]).encode()), 4),
                "method": PERPLEXITY_METHOD, "bits_per_byte_of": BITS_PER_BYTE_METHOD}
    print(f"held-out perplexity {held_out['perplexity']} over {n} tokens", flush=True)
    facts = {"corpus": corpus, "tokenizer": {"type": "byte-level BPE", "vocab_size": tok.get_vocab_size()},
             "model": {"parameters": sum(p.numel() for p in model.parameters()), "safetensors_bytes": size},
             "training": {**run, "seed": args.seed, "device": device_name(device), "torch": torch.__version__,
                          "transformers": transformers.__version__, "python": sys.version.split()[0]},
             "held_out": held_out, "samples": greedy_samples(model, tok, device),
             "wall_time_s": round(time.perf_counter() - wall, 1)}
    (args.out / "training.json").write_text(json.dumps(facts, indent=2, ensure_ascii=False) + "\n")
    for sample in facts["samples"]:
        print(f"{sample['prompt']!r} -> {sample['greedy']!r}", flush=True)


if __name__ == "__main__":
    main()

"""The built-in `tiny` model: a small random-weight Llama written as a real Hugging Face directory.

Weights and tokenizer are generated deterministically (per-tensor seeded generators, a seeded
built-in corpus), so every machine builds byte-identical files under the same cache name.
"""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import tempfile
import zlib

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TINY_NAME = "tiny"
_FORMAT_VERSION = 1  # bump on any change to the corpus, weight init or file layout
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = """the of and to a in is it you that he was for on are with as his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem model graph kiln
compile token kernel tensor layer cache batch decode prompt""".split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr".split()
_NUCLEI = "a e i o u ai ea oo ou ie".split()
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """Shape and token ids of the tiny model; everything its files are derived from."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 688
    vocab_size: int = 4096
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    unk_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3
    seed: int = 0


TINY_SPEC = TinySpec()


def _corpus(seed: int, n_sentences: int = 4000) -> list[str]:
    """Sentences of common words and syllable pseudo-words, drawn from a seeded RNG."""
    rng = random.Random(seed)

    def pseudo() -> str:
        return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                       for _ in range(rng.randint(1, 3)))

    sentences = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) if rng.random() < 0.7 else pseudo()
                 for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2000)))
        sentences.append(" ".join(words).capitalize() + rng.choice(".,.?!;:"))
    return sentences


def _train_tokenizer(spec: TinySpec) -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus; encoding prepends <s> like Llama."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, show_progress=False,
                                  special_tokens=list(_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    ids = [tok.token_to_id(t) for t in _SPECIAL_TOKENS]
    want = [spec.unk_token_id, spec.bos_token_id, spec.eos_token_id, spec.pad_token_id]
    if ids != want or tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tiny tokenizer: special ids {ids} (want {want}), "
                           f"vocab {tok.get_vocab_size()} (max {spec.vocab_size})")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", spec.bos_token_id)])
    return tok


def _weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Every tensor drawn from its own generator seeded by crc32(name): stable and order-free."""
    h, ff, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "mlp.gate_proj": (ff, h), "mlp.up_proj": (ff, h),
             "mlp.down_proj": (h, ff), "input_layernorm": (h,), "post_attention_layernorm": (h,)}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    shapes |= {f"model.layers.{i}.{k}.weight": shape
               for i in range(spec.num_hidden_layers) for k, shape in layer.items()}
    out = {}
    for name, shape in shapes.items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ spec.seed)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 1:  # RMSNorm gains
            out[name] = 1.0 + 0.05 * noise
        elif name == "model.embed_tokens.weight":  # std 1: token identity outweighs the layers
            out[name] = noise
        else:  # std 1/sqrt(in_features): activations keep unit scale through the stack
            out[name] = noise / math.sqrt(shape[1])
    for i in (spec.unk_token_id, spec.bos_token_id, spec.pad_token_id):  # logit 0: never greedy
        out["lm_head.weight"][i] = 0.0
    return out


def _write(spec: TinySpec, path: pathlib.Path) -> None:
    """Write config, weights and tokenizer files of `spec` into the existing directory `path`."""
    from transformers import LlamaConfig  # heavy import, only needed when building

    fields = dataclasses.asdict(spec)
    del fields["unk_token_id"], fields["seed"]
    LlamaConfig(**fields, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                dtype="float32").save_pretrained(path)
    save_file(_weights(spec), str(path / "model.safetensors"), metadata={"format": "pt"})
    _train_tokenizer(spec).save(str(path / "tokenizer.json"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    files = {"special_tokens_map.json": special,
             "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                       "model_max_length": spec.max_position_embeddings,
                                       "chat_template": _CHAT_TEMPLATE, **special},
             "generation_config.json": {"bos_token_id": spec.bos_token_id,
                                        "eos_token_id": spec.eos_token_id,
                                        "pad_token_id": spec.pad_token_id}}
    for name, obj in files.items():
        (path / name).write_text(json.dumps(obj, indent=2) + "\n")


def tiny_model_dir(cache_root: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the tiny model's HF directory, built atomically on first use and reused after."""
    root = cache_root or os.environ.get("GRAPHKILN_CACHE") or "~/.cache/graphkiln"
    key = json.dumps([_FORMAT_VERSION, dataclasses.asdict(TINY_SPEC)], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    target = pathlib.Path(root).expanduser() / f"{TINY_NAME}-{digest}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write(TINY_SPEC, tmp)
        for f in tmp.iterdir():  # safetensors writes 0600; the cache may be shared
            f.chmod(0o644)
        tmp.chmod(0o755)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

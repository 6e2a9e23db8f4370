"""Tiny local models: a complete Hugging Face model directory built on the spot, for tests, demos and benchmarks.

Nothing is downloaded. `build_tiny_model` writes what `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` read offline:

* `config.json` + `model.safetensors`: a Llama-architecture model (grouped-query attention, RoPE, SwiGLU,
  RMSNorm, tied input/output embeddings by default, like Qwen2.5-0.5B), randomly initialised from `seed`.
* the tokenizer files: a byte-level BPE tokenizer trained here on a small built-in corpus of English words,
  numbers and punctuation. Byte-level means every string round-trips (unknown characters become their UTF-8
  bytes), so any prompt works. Special tokens `<|endoftext|>` (BOS and padding), `<|im_start|>` and
  `<|im_end|>` (EOS), and a ChatML chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`, plus
  `<|im_start|>assistant\\n` when asked for a generation prompt).

The tokenizer depends only on `vocab_size`, not on `seed`, so models of one size built with different seeds
share it. The model has `vocab_size` embedding rows; the tokenizer has at most that many tokens (the corpus
may run out of merges first for a large `vocab_size`, as real models pad their embeddings too).

Random weights produce word salad, which is all tests and benchmarks need: real shapes, real kernels, real
tokenization. The default (`initializer_range` 0.2 rather than Llama's 0.02) makes the next-token
distributions peaked, so greedy choices are separated by clear margins instead of float noise.

Run from the repository root:

    .venv/bin/python -m trainer.models build /tmp/tiny                  # ~1.1M parameters, context 512
    .venv/bin/python -m trainer.models build /tmp/small --layers 8 --hidden-size 256 --vocab-size 2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tandem.trainer.v1 import config_pb2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainer.inference.weights import dtype_of

BOS_TOKEN = "<|endoftext|>"  # noqa: S105 - a token of the vocabulary, not a credential
PAD_TOKEN = BOS_TOKEN
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS = (BOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORD_TEXT = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from or "
    "had by hot word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head stand own page "
    "should country found answer school grow study still learn plant cover food sun four between state "
    "keep eye never last let thought city tree cross farm hard start might story saw far sea draw left "
    "late run while press close night real life few north open seem together next white children begin "
    "got walk example ease paper group always music those both mark often letter until mile river car "
    "feet care second book carry took science eat room friend began idea fish mountain stop once base "
    "hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red "
    "list though feel talk bird soon body dog family direct pose leave song measure door product black "
    "short numeral class wind question happen complete ship area half rock order fire south problem piece "
    "told knew pass since top whole king space heard best hour better true during hundred five remember "
    "step early hold west ground interest reach fast verb sing listen six table travel less morning ten "
    "simple several vowel toward war lay against pattern slow center love person money serve appear road "
    "map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark "
    "machine note wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop ocean warm free minute strong special "
    "mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue "
    "object decide surface deep moon island foot system busy test record boat common gold possible plane "
    "stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring "
    "yes distant fill east paint language among reward policy model train answer correct token agent task "
    "episode score value gradient"
)
_WORDS = tuple(_WORD_TEXT.split())
_PUNCTUATION = (*".,;:!?'\"()-", "...", " -", "\n", "\n\n")


def training_corpus(lines: int = 4000) -> list[str]:
    """Deterministic pseudo-sentences from the built-in words, with numbers, capitals and punctuation."""
    rng = random.Random(0)  # noqa: S311 - fixed seed: the tokenizer depends only on its vocab size
    corpus: list[str] = []
    for _ in range(lines):
        words: list[str] = []
        for _ in range(rng.randint(4, 16)):
            roll = rng.random()
            if roll < 0.08:
                words.append(str(rng.randint(0, 10_000)))
            elif roll < 0.15:
                words.append(rng.choice(_WORDS).capitalize())
            else:
                words.append(rng.choice(_WORDS))
            if rng.random() < 0.1:
                words[-1] += rng.choice(_PUNCTUATION)
        corpus.append(" ".join(words) + rng.choice([".", "?", "!", ".\n"]))
    return corpus


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with at most `vocab_size` tokens (specials included) and the chat template."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for a byte-level vocabulary"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # type: ignore[no-untyped-call,unused-ignore]  # typed from tokenizers 0.23.3 on
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{token!r} is not one token of the vocabulary")
    return found


def build_tiny_model(
    path: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    context: int = 512,
    tie_embeddings: bool = True,
    initializer_range: float = 0.2,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a randomly initialised Llama-architecture model and its tokenizer to `path`; returns `path`.

    `kv_heads` defaults to half the heads (grouped-query attention, as in current small models) and
    `intermediate_size` to 4x `hidden_size`. Equal arguments write equal files."""
    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of heads {heads}")
    kv = kv_heads if kv_heads is not None else max(1, heads // 2)
    if heads % kv:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv}")
    tokenizer = build_tokenizer(vocab_size)
    ids = {token: _token_id(tokenizer, token) for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=context,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        # transformers types `to` through functools.wraps(Module.to), which mypy reads as unbound
        model = model.to(dtype_of(dtype))  # type: ignore[arg-type]
    finally:
        torch.random.set_rng_state(generator_state)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Each file as the umask makes a new one (transformers writes the weights through a private temporary
    # file, 0600): the trainer and workers reading the folder may run as another user (run_as = org).
    umask = os.umask(0)
    os.umask(umask)
    for file in path.iterdir():
        if file.is_file():
            file.chmod(0o666 & ~umask)
    return path


def ensure_model(model: config_pb2.ModelConfig) -> Path:
    """The job's model directory; built first from `model.build` when it holds no model yet. The build goes to
    a folder beside it that is renamed into place, so an interrupted build never leaves half a model."""
    path = Path(model.dir).absolute()  # workers and trainer ranks run from other folders
    if (path / "config.json").is_file():
        return path
    if not model.HasField("build"):
        raise FileNotFoundError(
            f"model.dir {model.dir} holds no model (no config.json); point it at a Hugging Face model directory, "
            "or add a [model.build] section to build a small random one there"
        )
    spec = model.build
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    build_tiny_model(
        partial,
        vocab_size=spec.vocab_size or 512,
        hidden_size=spec.hidden_size or 128,
        layers=spec.layers or 2,
        heads=spec.heads or 4,
        initializer_range=spec.init_std if spec.HasField("init_std") else 0.02,
        seed=spec.seed,
        dtype=model.dtype or "float32",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(path)
    return path


def parameter_count(path: Path) -> int:
    """Parameters of a model directory written by `build_tiny_model`, from its config (tied weights once)."""
    config = json.loads((path / "config.json").read_text())
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if config["tie_word_embeddings"] else 2)
    total: int = config["num_hidden_layers"] * per_layer + embeddings + hidden
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.models", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write a tiny random model directory")
    build.add_argument("path", type=Path)
    build.add_argument("--vocab-size", type=int, default=512)
    build.add_argument("--hidden-size", type=int, default=128)
    build.add_argument("--layers", type=int, default=4)
    build.add_argument("--heads", type=int, default=4)
    build.add_argument("--kv-heads", type=int, default=None)
    build.add_argument("--intermediate-size", type=int, default=None)
    build.add_argument("--context", type=int, default=512)
    build.add_argument("--untied", action="store_true", help="a separate lm_head instead of tied embeddings")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.path,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        context=args.context,
        tie_embeddings=not args.untied,
        seed=args.seed,
        dtype=args.dtype,
    )
    print(f"wrote {path} ({parameter_count(path):,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A real tokenizer for the benchmark's random-weight models, which ship none.

``vllm serve`` needs a tokenizer with a chat template for chat completions, structured output
and tool calls, and the GPU host cannot reach the model hub. This builds one: a byte-level BPE
(the kind Qwen's and DeepSeek's tokenizers are) trained with Hugging Face ``tokenizers`` on a
generated corpus until it fills the model's ``vocab_size`` (less the special tokens), with a
ChatML chat template that renders tools in Hermes' ``<tool_call>`` format. xgrammar's per-vocabulary
work (tokenizer info, token bitmasks) then costs what it costs at the real vocabulary size.

    python3 bench/serve_tokenizer.py bench/models/tiny-qwen3-next /tmp/tiny-qwen3-next-serve

writes ``config.json`` (copied), ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` into the output folder, which ``vllm serve`` then takes as the model
(``--load-format dummy``). Deterministic: the same config gives the same tokenizer. About 1 s at
a 4k vocabulary and 15-25 s at 152k on one core.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"

# ChatML, tools in the system turn as Hermes/Qwen do, a tool call as <tool_call>{json}</tool_call>.
# Every system message comes first (the benchmark puts a per-request nonce there, so that a
# repeat never shares a prefix-cache block with its first occurrence), then the tool list.
CHAT_TEMPLATE = (
    "{% for m in messages if m.role == 'system' %}<|im_start|>system\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v",
           "w", "x", "z", "br", "ch", "cl", "dr", "fl", "gr", "kr", "pl", "pr", "sh", "sl", "sp",
           "st", "str", "th", "tr", "wh"]
_NUCLEI = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "io", "oo", "ou", "au"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rd", "rs", "st", "x", "ck"]


def words(count: int, seed: int = 0) -> list[str]:
    """`count` pronounceable pseudo-words, deterministic in `seed` (prompt text and corpus)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        out.append("".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                           for _ in range(syllables)))
    return out


def corpus(bpe_size: int, seed: int = 1) -> list[str]:
    """Lines of text with enough distinct words for `bpe_size` merges: words, numbers, JSON-ish
    punctuation and capitals, so that the vocabulary has what structured output and tool calls
    emit."""
    rng = random.Random(seed)
    vocab = words(max(2000, bpe_size * 2), seed)
    lines = []
    for i in range(0, len(vocab), 40):
        chunk = vocab[i:i + 40]
        chunk = [w.capitalize() if rng.random() < 0.1 else w for w in chunk]
        extra = [str(rng.randrange(10 ** rng.randrange(1, 6))), '{"', '": "', '", "', '"}', "[", "]",
                 ", ", ". ", ":", "\n"]
        lines.append(" ".join(chunk) + " " + " ".join(rng.sample(extra, 4)))
    return lines


def model_vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"{model_dir / 'config.json'}: no usable vocab_size ({size!r})")
    return size


def build_tokenizer(vocab_size: int):
    """A ``tokenizers.Tokenizer``: byte-level BPE of at most `vocab_size` ids, specials last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe_size = vocab_size - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, show_progress=False, min_frequency=0,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(bpe_size), trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, the model {vocab_size}")
    return tok


def write_model_folder(model_dir: Path, out_dir: Path, max_len: int | None = None) -> dict:
    """`out_dir` = `model_dir`'s files + the tokenizer's. Returns what was built (ids, seconds)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    started = time.perf_counter()
    vocab_size = model_vocab_size(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS, "pad_token": PAD, "bos_token": None, "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        "model_max_length": max_len or 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": PAD}, indent=1))
    return {"vocab_size": vocab_size, "tokenizer_ids": tok.get_vocab_size(),
            "eos_id": tok.token_to_id(EOS), "build_s": round(time.perf_counter() - started, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="model folder with config.json (bench/models/...)")
    ap.add_argument("out", type=Path, help="folder to write (config + tokenizer)")
    args = ap.parse_args(argv)
    try:
        info = write_model_folder(args.model, args.out)
    except (OSError, ValueError) as exc:
        print(f"serve_tokenizer: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

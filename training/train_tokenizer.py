"""Train the built-in model's byte-level BPE tokenizer with Hugging Face `tokenizers`.

GPT-2's recipe, so a pure-Python tokenizer can reproduce it: no normalizer, the
ByteLevel pre-tokenizer with GPT-2's split regex and no prefix space, BPE merges over
the 256 byte symbols, the ByteLevel decoder. A template post-processor puts
`<|endoftext|>` in front of every encoding, because every training document starts
right after one; `apply_chat_template` writes it itself (`{{ bos_token }}`).

    python -m training.train_tokenizer --vocab-size 4096 --out py_engine/data/tiny-shakespeare
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from training.corpus import load_corpus
from training.dialogue import CHAT_TEMPLATE

__all__ = ["BOS", "EOS", "SPECIAL_TOKENS", "train_tokenizer", "write_tokenizer_config"]

BOS = EOS = "<|endoftext|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "py_engine" / "data" / "tiny-shakespeare"
DEFAULT_VOCAB_SIZE = 4096
CONTEXT_LENGTH = 256


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids (3 special, 256 bytes, the rest merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def write_tokenizer_config(out: Path, context_length: int = CONTEXT_LENGTH) -> None:
    """tokenizer_config.json: what transformers' AutoTokenizer needs beyond tokenizer.json."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        # Listed so skip_special_tokens and all_special_ids cover the chat markers too.
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "add_bos_token": True,  # the post-processor in tokenizer.json does the adding
        "add_eos_token": False,
        # Decoding must be the inverse of encoding: no " ," -> "," clean-up.
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    train, validation = load_corpus()
    tokenizer = train_tokenizer([d.text for d in train], args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    write_tokenizer_config(args.out)
    # Characters per token on held-out text: the compression the model will see.
    chars = sum(len(d.text) for d in validation)
    tokens = sum(len(tokenizer.encode(d.text, add_special_tokens=False).ids) for d in validation)
    print(f"vocab {tokenizer.get_vocab_size()}: {chars / tokens:.3f} characters per token on validation")
    print(f"wrote {args.out / 'tokenizer.json'} and tokenizer_config.json")


if __name__ == "__main__":
    main()

"""Tiny complete model folders (random weights + a freshly trained tokenizer) for end-to-end tests.

`build_tiny_model(folder, model_type)` writes what a Hugging Face model folder
holds: config.json, generation_config.json, model.safetensors (saved by
transformers), tokenizer.json (trained by HF tokenizers) and a
tokenizer_config.json with a ChatML chat template. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die - to sleep,
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to: 'tis a consummation
Devoutly to be wish'd. Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600 1234567890.
""" * 4

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE like GPT-2's, with ChatML specials; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "chat_template": CHATML,
        "model_max_length": 128}))
    return tok.get_vocab_size()


def build_tiny_model(folder: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a complete random-weight model folder and return it."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder)
    eos = SPECIALS.index("<|im_end|>")
    config = dict(model_type=model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=None, eos_token_id=eos, pad_token_id=0, initializer_range=0.2,
                  tie_word_embeddings=True)
    config.update(overrides)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos], "do_sample": False}))
    return folder

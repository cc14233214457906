"""`ruvllm chat`: an interactive conversation with a model through its chat template.

Commands start with a slash (/help lists them). Ctrl-C while the model
answers stops that reply and keeps the conversation; Ctrl-D or /quit ends it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any, TextIO

from py_engine.sampling_params import SamplingParams, SamplingParamsError
from py_engine.adapters.config import lora_from_args
from py_engine.adapters.xlora_config import xlora_from_args
from ruvllm_cli.generate import model_options, sampling_options, sampling_params, speculative_from_args

HELP = """commands:
  /help             this text
  /clear            forget the conversation (the system prompt stays)
  /system <prompt>  set the system prompt (empty: none) and clear the conversation
  /temp <value>     set the sampling temperature (0 is greedy)
  /quit, /exit      leave"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="talk to a model through its chat template")
    p.add_argument("model", nargs="?", default="tiny-shakespeare", metavar="MODEL",
                   help="local dir, alias or cached repo id (default tiny-shakespeare)")
    p.add_argument("--system", default=None, help="system prompt")
    sampling_options(p, max_tokens=256)
    model_options(p)
    p.set_defaults(func=cmd_chat)


class ChatSession:
    """The conversation and its settings; `handle` answers one line of input."""

    def __init__(self, llm: Any, params: SamplingParams, system: str | None, out: TextIO,
                 adapter: str | None = None) -> None:
        self.llm, self.params, self.system, self.out = llm, params, system, out
        self.adapter = adapter  # the --lora adapter the replies use (None: the base model)
        self.history: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/clear":
            self.history.clear()
            self.say("(conversation cleared)")
        elif name == "/system":
            self.system = arg.strip() or None
            self.history.clear()
            self.say(f"(system prompt {'set' if self.system else 'removed'}; conversation cleared)")
        elif name == "/temp":
            try:
                self.params = replace(self.params, temperature=float(arg))
                self.say(f"(temperature {self.params.temperature:g})")
            except (ValueError, SamplingParamsError) as e:
                self.say(f"(invalid temperature {arg.strip()!r}: {e})")
        else:
            self.say(f"(unknown command {name}; /help lists them)")
        return True

    def reply(self, text: str) -> None:
        """Stream the assistant's answer; Ctrl-C cuts it short but keeps what was said."""
        self.history.append({"role": "user", "content": text})
        parts: list[str] = []
        try:
            for chunk in self.llm.chat(self.messages(), self.params, lora=self.adapter):
                parts.append(chunk.text)
                self.out.write(chunk.text)
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        self.out.write("\n")
        self.history.append({"role": "assistant", "content": "".join(parts)})

    def handle(self, line: str) -> bool:
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            return self.command(line)
        self.reply(line)
        return True

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def cmd_chat(args: argparse.Namespace) -> int:
    from py_engine.backends.torch import LLM
    from py_engine.quant.config import quant_config_from_args

    loras, adapter = lora_from_args(args)
    xlora, non_granular = xlora_from_args(args)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir,
              quantization=quant_config_from_args(args), lora=loras, max_lora_rank=args.max_lora_rank,
              xlora=xlora, xlora_non_granular=non_granular, kv_cache_dtype=args.kv_cache_dtype,
              kv_hot_tokens=args.kv_hot_tokens, speculative=speculative_from_args(args))
    llm.chat_prompt([{"role": "user", "content": "hi"}])  # fail now, not after the first question
    session = ChatSession(llm, sampling_params(args, llm.generation_config), args.system, sys.stdout, adapter)
    interactive = sys.stdin.isatty()
    if interactive:
        session.say(f"ruvllm chat with {llm.path.name}. /help for commands, /quit to leave.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            session.out.write("\n")
            continue
        if not session.handle(line):
            return 0

"""A tiny random Llama and its tokenizer, made here (no model hub is reachable), for vLLM to serve.

usage: python tiny_model.py DIR   (does nothing when DIR already holds the model)

Random weights generate nonsense, but real nonsense: vLLM runs the whole path (tokenizer, chat
template, scheduler, sampler, detokenizer) as for any model. Two heads of 32: vLLM's CPU attention
takes head sizes 32, 64, 80, ... only. A word-level tokenizer, so that every token is a whole word.

24 layers, so that a step of vLLM's engine takes ~5 ms here, longer than its API server's work on the
step's output. With 2 layers (~1 ms a step) the API server fell behind its engine and, once behind,
sent nothing of a stream for seconds, at times until the end of its generation: a kill or a client
leaving after the first event came too late to stop it (`server.VLLM.yield_to_the_api_server` is the
other half of the cure).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

#: The context: room for a stream long enough to be killed in its middle, and a prompt over it is cheap.
MAX_MODEL_LEN = 4096
#: What the tokenizer learns its ~360 words from.
TEXT = (
    "the a an one two three cache proxy answer question document rollout stream token model server job "
    "chunk rank output write read kill restart resume store replay hit miss error done byte red green blue "
    "cat dog bird tree river stone light dark fast slow old new big small " + " ".join(map(str, range(300)))
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build(target: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    partial = target.with_name(target.name + ".partial")
    LlamaForCausalLM(config).save_pretrained(partial)
    fast.save_pretrained(partial)
    partial.rename(target)  # whole or absent: a build killed halfway is not taken for a model


def model_dir() -> Path:
    """The tiny model, built (in a child process: torch stays out of this one) once per version of this
    builder and kept in the running venv (`make test-vllm`'s `.venv-vllm`), so that a rerun does not build it
    again."""
    builder = Path(__file__)
    target = Path(sys.prefix) / "tiny-model" / hashlib.sha256(builder.read_bytes()).hexdigest()[:12]
    subprocess.run([sys.executable, str(builder), str(target)], check=True, stdout=subprocess.DEVNULL)
    return target


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if not target.exists():
        build(target)

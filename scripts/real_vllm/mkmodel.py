"""Build a tiny random-weight Llama and a small BPE tokenizer with a chat template, offline.

Usage: VENV/bin/python scripts/real_vllm/mkmodel.py OUT_DIR [HIDDEN LAYERS MAX_LEN]
(defaults 128 2 256; the long-prefill check uses 1024 8 8192, as measured in issue 11; seconds; run with the vLLM venv,
which has torch, transformers and tokenizers). The output is deterministic (fixed seeds); its
text is random: tests check that tokens come back and how fast, not what they say.
"""
from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = ("alpha beta gamma delta node probe cache token stream engine ready busy queue prefill "
         "decode weight health envoy route cluster local zone fast slow ok").split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(n_lines: int) -> list[str]:
    """Random sentences over VOCAB, plus every printable ASCII character once."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(3, 20))) + rng.choice(".!?,")
             for _ in range(n_lines)]
    return lines + ["".join(map(chr, range(32, 127)))]


def main(out_dir: str, hidden: int = 128, layers: int = 2, max_len: int = 256) -> None:
    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(5000), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=max_len, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out_dir)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                      tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    print(f"model written to {out_dir} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 5):
        sys.exit("usage: mkmodel.py OUT_DIR [HIDDEN LAYERS MAX_LEN]")
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))

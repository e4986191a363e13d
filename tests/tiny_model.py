"""A tiny random-weight Llama with a real (trained) byte-level BPE tokenizer, saved as an HF
directory: fast enough to start whole Engines in process-level tests."""

from __future__ import annotations

from pathlib import Path

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Radix trees share prefixes; caches keep what was computed once.",
    "Ünïcödé, emoji 🚲🔧 and 中文字符 also appear in real prompts.",
    "A system prompt, a few-shot preamble and a long tool description.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llama(out_dir: Path, seed: int = 0, max_position_embeddings: int = 1024) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(out_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.bos_token_id,
        tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # Sharpen the output distribution so greedy decoding is far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
